"""Threshold exports (DESIGN.md "Exports"): writing them atomically and loading them with checks.

    EXPORT/
      thresholds.bsfa.pt          torch.save dict, exactly the BSFA reference's keys (BSFA_KEYS)
      thresholds.safetensors      the same thresholds [num_k, L, H, P] + k_values, with metadata
                                  (model, geometry, k values, samples, lengths, schema version)
      blasst.json                 skip-softmax calibration: lambda = threshold_scale_factor / L

Loading validates the file against what it is applied to (model id, layers, heads, block sizes)
and raises ``UserError`` with one line that names the mismatch.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import SCHEMA_VERSION, __version__
from .errors import UserError

BSFA_PT = "thresholds.bsfa.pt"
BSFA_ST = "thresholds.safetensors"
BLASST_JSON = "blasst.json"
BSFA_KEYS = ("thresholds", "k_values", "max_num_blocks", "num_layers", "num_heads", "q_block_size",
             "k_block_size", "aggregation_method", "shape_description")
SHAPE_DESCRIPTION = "[num_k, num_layers, num_heads, max_num_blocks]"
BLASST_ALGORITHM = "skip_softmax"


@dataclass(frozen=True)
class BsfaExport:
    """BSFA thresholds [num_k, L, H, P] and their geometry."""

    thresholds: torch.Tensor
    k_values: tuple[int, ...]
    q_block_size: int
    k_block_size: int
    aggregation_method: str
    model: str | None = None
    meta: dict | None = None

    @property
    def num_layers(self) -> int:
        return self.thresholds.shape[1]

    @property
    def num_heads(self) -> int:
        return self.thresholds.shape[2]

    def for_k(self, k: int) -> torch.Tensor:
        """[L, H, P] thresholds for one k; the kernel reads [layer][head, min(q_block, P - 1)]."""
        if k not in self.k_values:
            raise UserError(f"k={k} is not in the export (k values {', '.join(map(str, self.k_values))}); "
                            f"fit and export it with `sparsecal fit RUN --k ...`.")
        return self.thresholds[self.k_values.index(k)]


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def write_bsfa(out: Path, thr: torch.Tensor, k_values, block_m: int, block_n: int, aggregation: str,
               meta: dict) -> None:
    """thresholds.bsfa.pt and thresholds.safetensors from thresholds [num_k, L, H, P]."""
    from safetensors.torch import save_file

    thr = thr.detach().to("cpu", torch.float32).contiguous()
    k_list = [int(k) for k in k_values]
    d = {"thresholds": thr, "k_values": k_list, "max_num_blocks": thr.shape[3], "num_layers": thr.shape[1],
         "num_heads": thr.shape[2], "q_block_size": int(block_m), "k_block_size": int(block_n),
         "aggregation_method": aggregation, "shape_description": SHAPE_DESCRIPTION}
    _atomic(out / BSFA_PT, lambda p: torch.save(d, p))
    st_meta = {"kind": "sparsecal-bsfa", "schema_version": str(SCHEMA_VERSION), "sparsecal": __version__,
               "k_values": json.dumps(k_list), "q_block_size": str(block_m), "k_block_size": str(block_n),
               "aggregation_method": aggregation, "shape_description": SHAPE_DESCRIPTION}
    st_meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()})
    tensors = {"thresholds": thr, "k_values": torch.tensor(k_list, dtype=torch.int64)}
    _atomic(out / BSFA_ST, lambda p: save_file(tensors, str(p), metadata=st_meta))


def write_blasst(out: Path, doc: dict) -> None:
    _atomic(out / BLASST_JSON, lambda p: p.write_text(json.dumps(doc, indent=1, allow_nan=False)))


def _bsfa_from_pt(path: Path) -> BsfaExport:
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable pickle is one user-facing error
        raise UserError(f"{path} is not a readable BSFA export ({type(e).__name__}); export it again with `sparsecal export`.")
    if not isinstance(d, dict) or set(d) != set(BSFA_KEYS):
        have = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise UserError(f"{path} does not hold the BSFA export keys {list(BSFA_KEYS)} (has {have}).")
    thr = d["thresholds"]
    want = (len(d["k_values"]), d["num_layers"], d["num_heads"], d["max_num_blocks"])
    if not isinstance(thr, torch.Tensor) or tuple(thr.shape) != want:
        raise UserError(f"{path}: thresholds shape {tuple(getattr(thr, 'shape', ()))} does not match "
                        f"{SHAPE_DESCRIPTION} = {want}; the file is damaged: export it again.")
    return BsfaExport(thr.float(), tuple(int(k) for k in d["k_values"]), int(d["q_block_size"]),
                      int(d["k_block_size"]), str(d["aggregation_method"]))


def _bsfa_from_safetensors(path: Path) -> BsfaExport:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            thr, ks = f.get_tensor("thresholds"), f.get_tensor("k_values")
    except Exception as e:  # noqa: BLE001
        raise UserError(f"{path} is not a readable BSFA safetensors export ({type(e).__name__}); export it again.")
    if meta.get("schema_version") != str(SCHEMA_VERSION):
        raise UserError(f"{path} has schema version {meta.get('schema_version')}; this sparsecal reads "
                        f"{SCHEMA_VERSION}: export it again.")
    return BsfaExport(thr.float(), tuple(int(k) for k in ks.tolist()), int(meta["q_block_size"]),
                      int(meta["k_block_size"]), meta.get("aggregation_method", "mean"), meta.get("model"), meta)


def load_bsfa(path, expect: dict | None = None) -> BsfaExport:
    """Load BSFA thresholds from an export directory, a .bsfa.pt or a .safetensors file, and check
    them against ``expect`` (any of: model, num_layers, num_heads, block_m, block_n)."""
    path = Path(path)
    if path.is_dir():
        st, pt = path / BSFA_ST, path / BSFA_PT
        path = st if st.is_file() else pt
    if not path.is_file():
        raise UserError(f"{path} does not exist; write an export with `sparsecal export RUN --out DIR`.")
    exp = _bsfa_from_pt(path) if path.suffix == ".pt" else _bsfa_from_safetensors(path)
    if exp.model is None and (path.parent / BSFA_ST).is_file():
        from dataclasses import replace
        from safetensors import safe_open

        with safe_open(str(path.parent / BSFA_ST), framework="pt") as f:
            exp = replace(exp, model=(f.metadata() or {}).get("model"))
    check_geometry(path, {"model": exp.model, "num_layers": exp.num_layers, "num_heads": exp.num_heads,
                          "block_m": exp.q_block_size, "block_n": exp.k_block_size}, expect)
    return exp


def load_blasst(path, expect: dict | None = None) -> dict:
    """Load and check blasst.json (a directory or the file); returns the document."""
    path = Path(path)
    if path.is_dir():
        path = path / BLASST_JSON
    if not path.is_file():
        raise UserError(f"{path} does not exist; write an export with `sparsecal export RUN --out DIR`.")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg}); export it again.")
    if doc.get("algorithm") != BLASST_ALGORITHM or "threshold_scale_factor" not in doc:
        raise UserError(f"{path} is not a BLASST skip-softmax export (algorithm {doc.get('algorithm')!r}).")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{path} has schema version {doc.get('schema_version')}; this sparsecal reads "
                        f"{SCHEMA_VERSION}: export it again.")
    check_geometry(path, {"model": doc.get("model"), "num_layers": doc.get("num_layers"),
                          "num_heads": doc.get("num_heads"), "block_m": doc.get("q_block_size"),
                          "block_n": doc.get("k_block_size")}, expect)
    return doc


def blasst_lambda(doc: dict, length: int, target: float | None = None, mode: str = "prefill") -> float:
    """lambda = threshold_scale_factor[mode] / length for ``target`` (default: the file's own)."""
    entry = doc
    if target is not None and abs(target - doc["target_sparsity"]) > 1e-9:
        found = [t for t in doc.get("targets", []) if abs(t["target_sparsity"] - target) < 1e-9]
        if not found:
            have = ", ".join(f"{t['target_sparsity']:g}" for t in doc.get("targets", [doc]))
            raise UserError(f"target sparsity {target:g} is not in the BLASST export (has {have}); fit it with "
                            "`sparsecal fit RUN --targets ...` and export again.")
        entry = found[0]
    factor = entry["threshold_scale_factor"].get(mode)
    if factor is None:
        raise UserError(f"the BLASST export has no {mode} calibration for target {entry['target_sparsity']:g}.")
    return float(factor) / float(length)


def check_geometry(path, have: dict, expect: dict | None) -> None:
    """Refuse an export whose model or geometry differs from what it is applied to."""
    for key, want in (expect or {}).items():
        got = have.get(key)
        if want is not None and got is not None and got != want:
            raise UserError(f"{path} was calibrated for {key} {got!r}, but it is applied to {key} {want!r}; "
                            "use an export made from a run of this model and geometry.")
