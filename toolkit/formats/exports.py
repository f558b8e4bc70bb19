"""Threshold exports (DESIGN.md "Exports"): writing them atomically and loading them with checks.

    EXPORT/
      thresholds.bsfa.pt          torch.save dict, exactly the BSFA reference's keys (BSFA_KEYS)
      thresholds.safetensors      the same thresholds [num_k, L, H, P] + k_values, with metadata
                                  (model, geometry, k values, samples, lengths, schema version)
      blasst.json                 skip-softmax calibration: lambda = threshold_scale_factor / L

This module is torch-free: thresholds are numpy arrays here; ``sparsecal.integrations.exports``
writes and reads the torch side (``thresholds.bsfa.pt``) and hands tensors to the kernels.
Loading validates the file against what it is applied to (model id, layers, heads, block sizes)
and raises ``UserError`` with one line that names the mismatch.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparsecal.formats.dispatch import check_dispatch
from sparsecal.formats.errors import UserError
from sparsecal.formats.files import atomic_write, check_schema
from sparsecal.formats.json_values import finite_number, first_non_finite, in_range, positive_int
from sparsecal.formats.version import SCHEMA_VERSION, __version__

BSFA_PT = "thresholds.bsfa.pt"
BSFA_ST = "thresholds.safetensors"
BLASST_JSON = "blasst.json"
BSFA_KEYS = ("thresholds", "k_values", "max_num_blocks", "num_layers", "num_heads", "q_block_size",
             "k_block_size", "aggregation_method", "shape_description")
# Optional beside BSFA_KEYS (exports made before them lack both): thresholds calibrated on single
# decode rows, the same layout as ``thresholds``, and the positions a decode row was calibrated at.
BSFA_DECODE_KEYS = ("decode_thresholds", "decode_positions")
# Optional too (exports made before them lack them): the model the thresholds were calibrated for,
# so a .pt file alone still names it (thresholds.safetensors carries both in its metadata).
BSFA_IDENTITY_KEYS = ("model", "head_dim")
SHAPE_DESCRIPTION = "[num_k, num_layers, num_heads, max_num_blocks]"
BLASST_ALGORITHM = "skip_softmax"


@dataclass(frozen=True)
class BsfaExport:
    """BSFA thresholds [num_k, L, H, P] (a numpy array here; a torch tensor when loaded through
    ``sparsecal.integrations.exports``) and their geometry."""

    thresholds: object
    k_values: tuple[int, ...]
    q_block_size: int
    k_block_size: int
    aggregation_method: str
    model: str | None = None
    meta: dict | None = None
    decode_thresholds: object = None            # [num_k, L, H, P] like thresholds, or None (older exports)
    decode_positions: tuple[int, ...] | None = None  # the positions decode rows were calibrated at

    @property
    def num_layers(self) -> int:
        return self.thresholds.shape[1]

    @property
    def num_heads(self) -> int:
        return self.thresholds.shape[2]

    @property
    def ignored_layers(self) -> dict[int, str]:
        """{model layer: why it keeps every block} (thresholds -inf there); {} for older exports."""
        return {int(k): v for k, v in json.loads((self.meta or {}).get("ignored_layers", "{}")).items()}

    @property
    def sparse_layers(self) -> list[int]:
        """The model layers whose thresholds were calibrated (every layer for older exports)."""
        raw = (self.meta or {}).get("sparse_layers")
        return json.loads(raw) if raw else [i for i in range(self.num_layers) if i not in self.ignored_layers]

    def for_k(self, k: int):
        """[L, H, P] thresholds for one k; the kernel reads [layer][head, min(q_block, P - 1)]."""
        if k not in self.k_values:
            raise UserError(f"k={k} is not in the export (k values {', '.join(map(str, self.k_values))}); "
                            f"fit and export it with `sparsecal fit RUN --k ...`.")
        return self.thresholds[self.k_values.index(k)]

    def decode_for_k(self, k: int, required: bool = False):
        """[L, H, P] decode thresholds (calibrated on single decode rows) for one k, read like
        ``for_k``'s; None when the export has none, or with ``required`` one line saying what to do."""
        if self.decode_thresholds is None:
            if required:
                raise UserError("the BSFA export has no decode thresholds (made from a run captured before decode "
                                "rows had BSFA statistics); capture the run again, fit and export it, or run decode "
                                "dense or top-k.")
            return None
        self.for_k(k)  # the same refusal for a k that was not exported
        return self.decode_thresholds[self.k_values.index(k)]


def bsfa_pt_payload(thr: np.ndarray, k_values, block_m: int, block_n: int, aggregation: str,
                    decode: tuple | None = None, identity: dict | None = None) -> dict:
    """The dict ``thresholds.bsfa.pt`` holds (BSFA_KEYS, plus BSFA_DECODE_KEYS when ``decode`` =
    (decode thresholds shaped like thr, positions list) is given, plus ``identity``'s
    BSFA_IDENTITY_KEYS: model id, head_dim), thresholds still arrays."""
    d = {"thresholds": thr, "k_values": [int(k) for k in k_values], "max_num_blocks": thr.shape[3],
         "num_layers": thr.shape[1], "num_heads": thr.shape[2], "q_block_size": int(block_m),
         "k_block_size": int(block_n), "aggregation_method": aggregation, "shape_description": SHAPE_DESCRIPTION}
    if decode is not None:
        d.update(decode_thresholds=decode[0], decode_positions=[int(p) for p in decode[1]])
    d.update({k: v for k, v in (identity or {}).items() if k in BSFA_IDENTITY_KEYS and v is not None})
    return d


def write_bsfa_safetensors(out: Path, thr: np.ndarray, k_values, block_m: int, block_n: int, aggregation: str,
                           meta: dict, decode: tuple | None = None) -> None:
    """thresholds.safetensors from thresholds [num_k, L, H, P] (float32) with its metadata; ``decode``:
    (decode_thresholds [num_k, L, H, P], decode_positions [C]) or None."""
    from safetensors.numpy import save_file

    thr = np.ascontiguousarray(thr, np.float32)
    k_list = [int(k) for k in k_values]
    st_meta = {"kind": "sparsecal-bsfa", "schema_version": str(SCHEMA_VERSION), "sparsecal": __version__,
               "k_values": json.dumps(k_list), "q_block_size": str(block_m), "k_block_size": str(block_n),
               "aggregation_method": aggregation, "shape_description": SHAPE_DESCRIPTION}
    st_meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()})
    arrays = {"thresholds": thr, "k_values": np.array(k_list, dtype=np.int64)}
    if decode is not None:
        arrays["decode_thresholds"] = np.ascontiguousarray(decode[0], np.float32)
        arrays["decode_positions"] = np.asarray(decode[1], np.int64).reshape(-1)
    atomic_write(Path(out) / BSFA_ST, lambda p: save_file(arrays, str(p), metadata=st_meta))


def write_blasst(out: Path, doc: dict) -> None:
    atomic_write(Path(out) / BLASST_JSON, lambda p: p.write_text(json.dumps(doc, indent=1, allow_nan=False)))


def bsfa_from_payload(path: Path, d) -> BsfaExport:
    """Check a loaded ``thresholds.bsfa.pt`` dict (thresholds as any array with a shape)."""
    allowed = set(BSFA_KEYS + BSFA_DECODE_KEYS + BSFA_IDENTITY_KEYS)
    if not isinstance(d, dict) or not set(BSFA_KEYS) <= set(d) <= allowed or (
            ("decode_thresholds" in d) != ("decode_positions" in d)):
        have = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise UserError(f"{path} does not hold the BSFA export keys {list(BSFA_KEYS)} (has {have}).")
    thr = d["thresholds"]
    try:
        want = (len(d["k_values"]), int(d["num_layers"]), int(d["num_heads"]), int(d["max_num_blocks"]))
    except (ValueError, TypeError) as e:
        raise UserError(f"{path}: k_values or the sizes are not what BSFA_KEYS describe ({e}); export it again.") from None
    if tuple(getattr(thr, "shape", ())) != want:
        raise UserError(f"{path}: thresholds shape {tuple(getattr(thr, 'shape', ()))} does not match "
                        f"{SHAPE_DESCRIPTION} = {want}; the file is damaged: export it again.")
    if not isinstance(d.get("model", ""), str) or not isinstance(d.get("head_dim", 1), int):
        raise UserError(f"{path}: model is not a string or head_dim not an integer; export it again.")
    try:
        return BsfaExport(thr, tuple(int(k) for k in d["k_values"]), int(d["q_block_size"]),
                          int(d["k_block_size"]), str(d["aggregation_method"]), model=d.get("model"),
                          meta={"head_dim": str(d["head_dim"])} if "head_dim" in d else None,
                          decode_thresholds=d.get("decode_thresholds"),
                          decode_positions=None if "decode_positions" not in d else tuple(int(p) for p in d["decode_positions"]))
    except (ValueError, TypeError) as e:
        raise UserError(f"{path}: k values or block sizes are not integers ({e}); export it again.") from None


def read_bsfa_safetensors(path: Path) -> BsfaExport:
    """thresholds.safetensors as a BsfaExport with numpy thresholds, schema checked."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            meta = dict(f.metadata() or {})
            thr, ks = f.get_tensor("thresholds"), f.get_tensor("k_values")
            has_dec = {"decode_thresholds", "decode_positions"} <= set(f.keys())
            dthr = f.get_tensor("decode_thresholds").astype(np.float32) if has_dec else None
            dpos = tuple(int(p) for p in f.get_tensor("decode_positions").tolist()) if has_dec else None
    except Exception as e:  # noqa: BLE001
        raise UserError(f"{path} is not a readable BSFA safetensors export ({type(e).__name__}); export it again.")
    check_schema(path, meta.get("schema_version"), "export it again")
    try:
        exp = BsfaExport(thr.astype(np.float32), tuple(int(k) for k in ks.tolist()), int(meta["q_block_size"]),
                         int(meta["k_block_size"]), meta.get("aggregation_method", "mean"), meta.get("model"), meta,
                         dthr, dpos)
    except (KeyError, ValueError, TypeError) as e:
        raise UserError(f"{path}: metadata {e} is missing or not an integer; export it again.") from None
    check_layer_lists(path, _json_meta(path, meta, "ignored_layers", {}), _json_meta(path, meta, "sparse_layers", None),
                      exp.num_layers)
    return exp


def _json_meta(path, meta: dict, key: str, default):
    try:
        return json.loads(meta[key]) if key in meta else default
    except ValueError:
        raise UserError(f"{path}: metadata {key} is not JSON; export it again.") from None


def check_layer_lists(path, ignored, sparse, num_layers: int) -> None:
    """``ignored_layers`` {"<layer>": reason} and ``sparse_layers`` [layer, ...] (or None): model
    layer indices below num_layers, no layer in both."""
    ok = isinstance(ignored, dict) and all(isinstance(k, str) and k.isdigit() and int(k) < num_layers
                                           and isinstance(v, str) for k, v in ignored.items())
    ok = ok and (sparse is None or (isinstance(sparse, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in sparse)))
    if not ok:
        raise UserError(f"{path}: ignored_layers must map layer indices below {num_layers} to reasons and "
                        "sparse_layers list layer indices; export it again.")
    if sparse is not None and set(map(int, ignored)) & set(sparse):
        raise UserError(f"{path}: layer {min(set(map(int, ignored)) & set(sparse))} is both sparse and "
                        "ignored; export it again.")


def bsfa_file(path) -> Path:
    """The BSFA file to read: ``path`` itself, or in an export directory the safetensors (else .pt)."""
    path = Path(path)
    if path.is_dir():
        st, pt = path / BSFA_ST, path / BSFA_PT
        path = st if st.is_file() else pt
    if not path.is_file():
        raise UserError(f"{path} does not exist; write an export with `sparsecal export RUN --out DIR`.")
    return path


def _check_finite(path: Path, thr: np.ndarray, exp: BsfaExport, what: str) -> None:
    """Refuse NaN or +inf in thresholds [num_k, L, H, P] (-inf keeps every candidate)."""
    bad = np.isnan(thr) | (thr == np.inf)
    if bad.any():
        k, layer, head, pos = (int(i) for i in np.argwhere(bad)[0])
        raise UserError(f"{path}: {what} at k={exp.k_values[k]}, layer {layer}, head {head}, block {pos} is "
                        f"{thr[k, layer, head, pos]}; thresholds must be finite or -inf: export it again.")


def check_bsfa_values(path: Path, exp: BsfaExport) -> None:
    """Thresholds finite or -inf (keep every candidate), never NaN or +inf; k values distinct
    positive integers in ascending order, one per threshold set; block sizes positive."""
    thr = np.asarray(exp.thresholds, np.float32)
    if thr.ndim != 4 or thr.shape[0] != len(exp.k_values):
        raise UserError(f"{path}: thresholds of shape {thr.shape} do not match {SHAPE_DESCRIPTION} with "
                        f"{len(exp.k_values)} k values; export it again.")
    _check_finite(path, thr, exp, "threshold")
    if exp.decode_thresholds is not None:
        dec = np.asarray(exp.decode_thresholds, np.float32)
        if dec.shape != thr.shape:
            raise UserError(f"{path}: decode thresholds of shape {dec.shape} differ from the thresholds' {thr.shape}; "
                            "export it again.")
        _check_finite(path, dec, exp, "decode threshold")
        pos = list(exp.decode_positions) if exp.decode_positions is not None else None
        if pos is not None and (not pos or pos[0] < 0 or any(b <= a for a, b in itertools.pairwise(pos))):
            raise UserError(f"{path}: decode positions {pos} are not ascending block positions >= 0; export it again.")
    ks = list(exp.k_values)
    if not ks or ks != sorted(set(ks)) or ks[0] < 1:
        raise UserError(f"{path}: k values {ks} are not distinct positive integers in ascending order; export it again.")
    if exp.q_block_size < 1 or exp.k_block_size < 1:
        raise UserError(f"{path}: block sizes {exp.q_block_size} x {exp.k_block_size} must be positive; export it again.")


def check_bsfa(path: Path, exp: BsfaExport, expect: dict | None) -> BsfaExport:
    """Check the values; a .pt file's metadata (model id, layers) comes from a sibling safetensors
    file when there is one (its own model id and head_dim first); then check ``expect``."""
    check_bsfa_values(path, exp)
    if path.suffix == ".pt" and (path.parent / BSFA_ST).is_file():
        from dataclasses import replace

        from safetensors import safe_open

        with safe_open(str(path.parent / BSFA_ST), framework="np") as f:
            meta = dict(f.metadata() or {})
        if exp.model is not None and meta.get("model") not in (None, exp.model):
            raise UserError(f"{path} names model {exp.model} but {BSFA_ST} beside it {meta.get('model')}; the two "
                            "files are of different exports: export it again.")
        exp = replace(exp, model=exp.model or meta.get("model"), meta={**meta, **(exp.meta or {})})
    head_dim = (exp.meta or {}).get("head_dim")
    check_geometry(path, {"model": exp.model, "num_layers": exp.num_layers, "num_heads": exp.num_heads,
                          "block_m": exp.q_block_size, "block_n": exp.k_block_size,
                          "head_dim": int(head_dim) if str(head_dim).isdigit() else None}, expect)
    return exp


def load_bsfa(path, expect: dict | None = None) -> BsfaExport:
    """BSFA thresholds (numpy) from an export directory or a .safetensors file, checked against
    ``expect`` (any of: model, num_layers, num_heads, block_m, block_n). A .pt file needs torch:
    read it with ``sparsecal.integrations.exports.load_bsfa``."""
    path = bsfa_file(path)
    if path.suffix == ".pt":
        raise UserError(f"{path} is a torch pickle; read the thresholds.safetensors beside it, or load it with "
                        "sparsecal.integrations.exports.load_bsfa.")
    return check_bsfa(path, read_bsfa_safetensors(path), expect)


def load_blasst(path, expect: dict | None = None) -> dict:
    """Load and check blasst.json (a directory or the file); returns the document."""
    path = Path(path)
    if path.is_dir():
        path = path / BLASST_JSON
    if not path.is_file():
        raise UserError(f"{path} does not exist; write an export with `sparsecal export RUN --out DIR`.")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({getattr(e, 'msg', type(e).__name__)}); export it again.") from None
    validate_blasst(path, doc)
    check_geometry(path, {"model": doc["model"], "num_layers": doc["num_layers"], "num_heads": doc["num_heads"],
                          "block_m": doc["q_block_size"], "block_n": doc["k_block_size"],
                          "head_dim": doc.get("head_dim")}, expect)
    return doc


GEOMETRY_KEYS = {"model": str, "num_layers": int, "num_heads": int, "q_block_size": int, "k_block_size": int}


LONGEST_LENGTH = 1 << 31  # the bound on a factor when an export names no length (no sequence is that long)


def longest_length(doc: dict) -> int:
    """The longest length a blasst.json or engine.json covers: its calibrated ``lengths``, else the
    longest of its ``validity`` ranges, else LONGEST_LENGTH."""
    lens = doc.get("lengths")
    if isinstance(lens, list) and lens and all(map(positive_int, lens)):
        return max(lens)
    val = doc.get("validity")
    ends = [v.get("max_length") for v in val.values() if isinstance(v, dict)] if isinstance(val, dict) else []
    return max([n for n in ends if positive_int(n)], default=LONGEST_LENGTH)


def check_factor_range(path, where: str, factor: float, longest: int) -> None:
    """Refuse a factor with lambda = factor / L >= 1 at every length up to ``longest``: BLASST would
    run dense there (the runtime policy) or skip every candidate tile (an engine), never as calibrated."""
    if factor >= longest:
        raise UserError(f"{path}: {where} is {factor:g}, so lambda = factor / L >= 1 at every length up to the "
                        f"{longest} tokens the export covers (BLASST would never skip as calibrated); export it "
                        "again from a fit.")


def _check_entry(path, entry, where: str, longest: int = LONGEST_LENGTH) -> None:
    """One calibration: target_sparsity in (0, 1) and threshold_scale_factor {prefill, decode},
    each a finite positive number (lambda = factor / L) below ``longest`` or null (that phase not
    calibrated)."""
    bad = f"{path}: {where}"
    if not isinstance(entry, dict):
        raise UserError(f"{bad} is not an object; export it again with `sparsecal export`.")
    t = entry.get("target_sparsity")
    if not finite_number(t) or not 0.0 < t < 1.0:
        raise UserError(f"{bad}.target_sparsity is {t!r}, not a number in (0, 1); export it again.")
    tsf = entry.get("threshold_scale_factor")
    if not isinstance(tsf, dict) or not set(tsf) <= {"prefill", "decode"} or not tsf:
        raise UserError(f"{bad}.threshold_scale_factor must be an object with prefill and/or decode factors; "
                        "export it again.")
    for mode, f in tsf.items():
        if f is not None and (not finite_number(f) or f <= 0):
            raise UserError(f"{bad}.threshold_scale_factor.{mode} is {f!r}; it must be a finite positive number "
                            "(lambda = factor / length): export it again.")
        if f is not None:
            check_factor_range(path, f"{where}.threshold_scale_factor.{mode}", f, longest)
    check_validity(path, entry.get("validity"), where)
    check_decode_group(path, entry.get("decode_group"), where, longest)


def check_decode_group(path, group, where: str, longest: int = LONGEST_LENGTH) -> None:
    """Optional ``decode_group`` (the decode law of the group decision): threshold_scale_factor a
    finite positive factor below ``longest`` and validity as a decode law's (check_validity)."""
    if group is None:
        return
    f = group.get("threshold_scale_factor") if isinstance(group, dict) else None
    if not finite_number(f) or f <= 0 or not isinstance(group.get("validity"), dict):
        raise UserError(f"{path}: {where}.decode_group must hold a finite positive threshold_scale_factor and its "
                        "validity; export it again.")
    check_factor_range(path, f"{where}.decode_group.threshold_scale_factor", f, longest)
    check_validity(path, {"decode": group["validity"]}, f"{where}.decode_group")


def check_validity(path, validity, where: str) -> None:
    """Optional ``validity``: {mode: {"law", "validated_lengths": [n, ...], "min_length", "max_length"}},
    lengths positive integers ascending, min/max_length their ends (absent in older exports)."""
    if validity is None:
        return
    ok = isinstance(validity, dict) and set(validity) <= {"prefill", "decode"}
    for v in validity.values() if ok else ():
        lens = v.get("validated_lengths") if isinstance(v, dict) else None
        ok = ok and isinstance(lens, list) and bool(lens) and all(map(positive_int, lens)) and lens == sorted(set(lens))
        ok = ok and v.get("min_length") == lens[0] and v.get("max_length") == lens[-1]
    if not ok:
        raise UserError(f"{path}: {where}.validity must map prefill/decode to validated_lengths (ascending positive "
                        "integers) with min_length and max_length their ends; export it again.")


def validate_blasst(path, doc) -> None:
    """blasst.json as every reader needs it: kind, schema, geometry keys with their types, the
    main calibration and every entry of ``targets`` checked, and the main one equal to its entry."""
    if not isinstance(doc, dict):
        raise UserError(f"{path} holds a JSON {type(doc).__name__}, not a BLASST export object; export it again.")
    if doc.get("algorithm") != BLASST_ALGORITHM:
        raise UserError(f"{path} is not a BLASST skip-softmax export (algorithm {doc.get('algorithm')!r}).")
    check_schema(path, doc.get("schema_version"), "export it again")
    for key, kind in GEOMETRY_KEYS.items():
        if not isinstance(doc.get(key), kind) or isinstance(doc.get(key), bool) or (kind is int and doc[key] <= 0):
            what = "a positive integer" if kind is int else f"a {kind.__name__}"
            raise UserError(f"{path}: {key} is {doc.get(key)!r}, not {what}; the export is damaged or "
                            "edited: export it again.")
    bad = first_non_finite(doc)
    if bad:
        raise UserError(f"{path}: {bad[0]} is {bad[1]}; every number of a BLASST export is finite: export it again.")
    _check_per_length(path, doc.get("per_length"))
    if "head_dim" in doc and not positive_int(doc["head_dim"]):  # optional: exports made before it lack it
        raise UserError(f"{path}: head_dim is {doc['head_dim']!r}, not a positive integer; export it again.")
    longest = longest_length(doc)
    _check_entry(path, doc, "the main calibration", longest)
    targets = doc.get("targets", [])
    if not isinstance(targets, list):
        raise UserError(f"{path}: targets is {type(targets).__name__}, not a list; export it again.")
    for i, entry in enumerate(targets):
        _check_entry(path, entry, f"targets[{i}]", longest)
    same = [e for e in targets if abs(e["target_sparsity"] - doc["target_sparsity"]) < 1e-9]
    if same and same[0]["threshold_scale_factor"] != doc["threshold_scale_factor"]:
        raise UserError(f"{path}: the main threshold_scale_factor differs from targets' entry for target "
                        f"{doc['target_sparsity']:g}; export it again.")
    check_layer_lists(path, doc.get("ignored_layers", {}), doc.get("sparse_layers"), doc["num_layers"])
    for where, entry in [("the main calibration", doc)] + [(f"targets[{i}]", e) for i, e in enumerate(targets)]:
        _check_per_layer(path, entry.get("per_layer"), where, doc["num_layers"], longest)
    if doc.get("dispatch") is not None:  # optional (sparsecal export --break-even); absent: no dispatch
        check_dispatch(path, doc["dispatch"], doc["num_layers"])


def _check_per_length(path, rows) -> None:
    """Optional ``per_length`` (the fit's rows, plotted on the Export page): each a length (positive
    integer), target and achieved sparsity in [0, 1], lambda and lambda_best >= 0 (either may be null)."""
    if rows is None:
        return
    for i, r in enumerate(rows if isinstance(rows, list) else [None]):
        ok = isinstance(r, dict) and positive_int(r.get("length"))
        ok = ok and all(r.get(k) is None or in_range(r[k], 0.0, 1.0) for k in ("target", "achieved"))
        ok = ok and all(r.get(k) is None or in_range(r[k], 0.0) for k in ("lambda", "lambda_best"))
        if not ok:
            raise UserError(f"{path}: per_length[{i}] is {r!r}; each row needs a positive length, target and "
                            "achieved in [0, 1] and lambdas >= 0: export it again.")


def _check_per_layer(path, per_layer, where: str, num_layers: int, longest: int = LONGEST_LENGTH) -> None:
    """Optional ``per_layer``: {mode: {"<layer>": factor or null}}, factors finite, positive and
    below ``longest``."""
    if per_layer is None:
        return
    ok = isinstance(per_layer, dict) and set(per_layer) <= {"prefill", "decode"} and all(
        isinstance(m, dict) and all(k.isdigit() and int(k) < num_layers and (f is None or (finite_number(f) and f > 0))
                                    for k, f in m.items()) for m in per_layer.values())
    if not ok:
        raise UserError(f"{path}: {where}.per_layer must map prefill/decode to {{layer below {num_layers}: positive "
                        "factor or null}; export it again.")
    for mode, m in per_layer.items():
        for layer, f in m.items():
            if f is not None:
                check_factor_range(path, f"{where}.per_layer.{mode}.{layer}", f, longest)


def _blasst_entry(doc: dict, target: float | None) -> dict:
    """The calibration of ``target`` (default: the file's own) from a validated blasst.json."""
    if target is None or abs(target - doc["target_sparsity"]) <= 1e-9:
        return doc
    found = [t for t in doc.get("targets", []) if abs(t["target_sparsity"] - target) < 1e-9]
    if not found:
        have = ", ".join(f"{t['target_sparsity']:g}" for t in doc.get("targets", [doc]))
        raise UserError(f"target sparsity {target:g} is not in the BLASST export (has {have}); fit it with "
                        "`sparsecal fit RUN --targets ...` and export again.")
    return found[0]


def _factor(entry: dict, mode: str) -> float:
    factor = entry["threshold_scale_factor"].get(mode)
    if factor is None:
        raise UserError(f"the BLASST export has no {mode} calibration for target {entry['target_sparsity']:g}.")
    return float(factor)


def blasst_lambda(doc: dict, length: int, target: float | None = None, mode: str = "prefill") -> float:
    """lambda = threshold_scale_factor[mode] / length for ``target`` (default: the file's own)."""
    return _factor(_blasst_entry(doc, target), mode) / float(length)


def blasst_layer_factors(doc: dict, mode: str = "prefill", target: float | None = None) -> list[float | None]:
    """One threshold_scale_factor per model layer (lambda_l = factor_l / L) from a validated
    blasst.json: the layer's own a where the export holds per-layer factors (``sparsecal export
    --per-layer``) and the layer has one, else the file's factor for the target; None for a layer
    that runs dense (listed in ``ignored_layers``: not captured, or skipping does not pay)."""
    entry = _blasst_entry(doc, target)
    default = _factor(entry, mode)
    own = (entry.get("per_layer") or {}).get(mode) or {}
    ignored = {int(k) for k in doc.get("ignored_layers", {})}
    return [None if layer in ignored else float(own.get(str(layer)) or default) for layer in range(doc["num_layers"])]


def blasst_validity(doc: dict, mode: str = "prefill", target: float | None = None) -> dict | None:
    """The lengths a target's ``mode`` law holds on, from a validated blasst.json: its ``validity``
    entry ({"law", "validated_lengths", "min_length", "max_length"}); for an export written before
    ``validity`` existed, the same derived from its ``per_length`` rows with ``in_fit`` (the lengths
    where the target was reached); None when neither is there (no length guard)."""
    entry = _blasst_entry(doc, target)
    own = (entry.get("validity") or {}).get(mode)
    if own is not None:
        return own
    lens = sorted({int(p["length"]) for p in entry.get("per_length", []) if isinstance(p, dict)
                   and p.get("mode", mode) == mode and p.get("in_fit") and positive_int(p.get("length"))})
    return {"law": "a/L", "validated_lengths": lens, "min_length": lens[0], "max_length": lens[-1]} if lens else None


def blasst_group_law(doc: dict, target: float | None = None) -> dict | None:
    """A target's decode law under the group decision from a validated blasst.json (its entry's
    ``decode_group``: {"threshold_scale_factor", "validity", ...}), None in an export without one."""
    return _blasst_entry(doc, target).get("decode_group")


def blasst_min_length(doc: dict, mode: str = "prefill", target: float | None = None) -> int | None:
    """The shortest calibrated length at which ``target`` was reached in ``mode`` (None: no guard)."""
    v = blasst_validity(doc, mode, target)
    return None if v is None else int(v["min_length"])


def blasst_runtime_lambda(factor: float | None, length: int, min_length: int | None = None,
                          max_length: int | None = None) -> float | None:
    """The runtime policy (docs/design.md "Applying thresholds"): lambda = factor / length, or None
    (run dense: ln(lambda) = -inf, nothing skipped) when there is no factor, when ``length`` is below
    ``min_length`` (the law was never validated that short: extrapolating it is a guess), when it is
    past ``max_length`` (given unless the caller opts in to extrapolation: sparsify(..., extrapolate=
    True)) or when factor / length > 1 (ln(lambda) > 0 skips every candidate tile, since every gap is
    <= 0). lambda = 1 exactly is kept: it skips the tiles with gap < 0 only."""
    if factor is None or (min_length is not None and length < min_length):
        return None
    if max_length is not None and length > max_length:
        return None
    lam = float(factor) / float(length)
    return None if lam > 1.0 else lam


LAW_REGIMES = ("below", "interpolated", "extrapolated")  # where a length sits against a law's validated lengths


def blasst_law_regime(length: int, validity: dict | None) -> str | None:
    """Where ``length`` sits against a law's ``validity`` entry ({"min_length", "max_length", ...},
    blasst_validity): "below" (shorter than min_length: never validated there), "interpolated"
    (min_length <= length <= max_length) or "extrapolated" (past max_length); None without an entry
    (no validated lengths known: the law is applied at every length, unchecked)."""
    if not validity:
        return None
    if length < int(validity["min_length"]):
        return "below"
    return "extrapolated" if length > int(validity["max_length"]) else "interpolated"


def blasst_dense_below(factor: float, min_length: int | None = None) -> int:
    """The length below which ``blasst_runtime_lambda`` runs dense: max(min_length, ceil(factor))."""
    return max(int(min_length or 0), math.ceil(float(factor)))


EXPECT_KEYS = ("model", "num_layers", "num_heads", "block_m", "block_n", "head_dim")


def check_geometry(path, have: dict, expect: dict | None) -> None:
    """Refuse an export whose model or geometry differs from what it is applied to. ``expect``
    may hold any of EXPECT_KEYS (another key is a programming error)."""
    unknown_keys = set(expect or {}) - set(EXPECT_KEYS)
    if unknown_keys:
        raise ValueError(f"expect= keys {sorted(unknown_keys)} are not among {EXPECT_KEYS}")
    for key, want in (expect or {}).items():
        got = have.get(key)
        if want is not None and got is not None and got != want:
            raise UserError(f"{path} was calibrated for {key} {got!r}, but it is applied to {key} {want!r}; "
                            "use an export made from a run of this model and geometry.")
