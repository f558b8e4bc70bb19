"""``sparsecal export``: turn a run's fit into the files kernels and serving engines read
(formats in sparsecal.formats.exports and docs/formats.md "Exports").

Shape legend: K k values, L layers, H query heads, P query blocks (extended to --max-length).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sparsecal.analysis.bsfa import extend_positions
from sparsecal.analysis.fit import FIT_DIR, load_fit
from sparsecal.analysis.tables import THRESHOLDS
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import BLASST_ALGORITHM, BLASST_JSON, write_blasst
from sparsecal.formats.geometry import cdiv
from sparsecal.formats.tensors import load_arrays
from sparsecal.formats.version import SCHEMA_VERSION, __version__
from sparsecal.integrations.exports import write_bsfa


def _thresholds(root: Path, fit: dict):
    path = root / FIT_DIR / THRESHOLDS
    if not path.is_file():
        raise UserError(f"{path} is missing; run `sparsecal fit {root}` again.")
    try:
        tensors, meta = load_arrays(path, keys=["thresholds"])
    except Exception as e:  # noqa: BLE001 - a truncated or garbled file is one line
        raise UserError(f"{path} is damaged ({type(e).__name__}); run `sparsecal fit {root}` again.") from None
    if "thresholds" not in tensors or meta.get("schema_version") != str(SCHEMA_VERSION) or meta.get("model") != fit["model"]["id"]:
        raise UserError(f"{path} does not belong to this fit (schema/model differ); run `sparsecal fit {root}` again.")
    return tensors["thresholds"], meta


def blasst_doc(fit: dict, target: float | None) -> dict:
    """blasst.json: the serving engines' skip-softmax shape, plus every fitted target and its quality."""
    cals = fit["blasst"]
    targets = sorted({c["target"] for c in cals})
    if target is None:
        target = fit["request"]["targets"][0]
    if not any(abs(t - target) < 1e-9 for t in targets):
        raise UserError(f"--target {target:g} was not fitted (fitted: {', '.join(f'{t:g}' for t in targets)}); "
                        "fit it with `sparsecal fit RUN --targets ...`.")
    entries = []
    for t in targets:
        by_mode = {c["mode"]: c for c in cals if c["target"] == t}
        entries.append({
            "target_sparsity": t,
            "threshold_scale_factor": {m: by_mode[m]["a"] if m in by_mode else None for m in ("prefill", "decode")},
            "fit": {m: {"law": c["law"], "power_law": c["power_law"], "fixed_lambda": c["fixed_lambda"],
                        "fixed_length": c["fixed_length"]} for m, c in by_mode.items()},
            "per_length": [dict(p, mode=m) for m, c in by_mode.items() for p in c["per_length"]],
        })
    main = next(e for e in entries if abs(e["target_sparsity"] - target) < 1e-9)
    cfg, model = fit["config"], fit["model"]
    return {"algorithm": BLASST_ALGORITHM, "threshold_scale_factor": main["threshold_scale_factor"],
            "target_sparsity": target, "lambda_rule": "lambda = threshold_scale_factor[mode] / sequence_length; "
            "skip a tile when max over its rows of (rowmax - running max) < ln(lambda)",
            "scan_order": fit["request"]["order"], "fit": main["fit"], "per_length": main["per_length"],
            "targets": entries, "model": model["id"], "num_layers": model["num_layers"],
            "num_heads": model["num_heads"], "q_block_size": cfg["block_m"], "k_block_size": cfg["block_n"],
            "lengths": fit["lengths"], "samples": len(fit["split"]["train"]), "validation": fit["validation"],
            "schema_version": SCHEMA_VERSION, "sparsecal": __version__}


def check_overwrite(out: Path, model: str, run: dict, force: bool) -> None:
    """Refuse to overwrite an export of another model, or of another run (when the export names
    its run), in ``out`` unless ``force``. ``run``: {"name", "created"} of the run exported now."""
    path = Path(out) / BLASST_JSON
    if force or not path.is_file():
        return
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = None
    if not isinstance(doc, dict):
        raise UserError(f"--out {out} holds an unreadable {BLASST_JSON}; pass --force to overwrite it.")
    if doc.get("model") != model or doc.get("run", run) != run:
        name = (doc.get("run") or {}).get("name", "unknown") if isinstance(doc.get("run"), dict) else "unknown"
        raise UserError(f"--out {out} holds an export of another run ({name}, model {doc.get('model')}); pass "
                        "--force to overwrite it, or choose another directory.")


def export_run(store, out: Path, target: float | None = None, max_length: int | None = None,
               force: bool = False) -> dict:
    """Write thresholds.bsfa.pt, thresholds.safetensors and blasst.json into ``out``; an export
    of another run already there is refused unless ``force``."""
    root = Path(store.root)
    fit = load_fit(root)
    if fit["model"]["id"] != store.manifest["model"]["id"] or fit["config"] != store.manifest["config"]:
        raise UserError(f"{root}/{FIT_DIR} was fitted on a different model or geometry than the run; "
                        f"run `sparsecal fit {root}` again.")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory for the export.")
    doc = blasst_doc(fit, target)
    thr, meta = _thresholds(root, fit)
    cfg = fit["config"]
    longest = max(fit["lengths"])
    if max_length is not None and max_length < longest:
        raise UserError(f"--max-length {max_length} is below the longest calibrated length {longest}; "
                        "leave it out or give a larger value.")
    context = fit["model"].get("max_context")
    if max_length is not None and context and max_length > context:
        raise UserError(f"--max-length {max_length} is past the model's context of {context} tokens; "
                        f"give at most {context}.")
    blocks = cdiv(max_length or longest, cfg["block_m"])
    thr = extend_positions(thr, blocks)
    doc["run"] = {"name": root.name, "created": store.manifest.get("created")}
    check_overwrite(out, fit["model"]["id"], doc["run"], force)
    out.mkdir(parents=True, exist_ok=True)
    st_meta = {"model": fit["model"]["id"], "samples": meta["samples"], "lengths": meta["lengths"],
               "max_length": str(max_length or longest), "run": root.name}
    write_bsfa(out, thr, fit["k_values"], cfg["block_m"], cfg["block_n"], fit["request"]["aggregation"], st_meta)
    write_blasst(out, doc)
    return {"out": str(out), "bsfa_shape": list(thr.shape), "k_values": fit["k_values"],
            "blasst": {e["target_sparsity"]: e["threshold_scale_factor"] for e in doc["targets"]},
            "threshold_finite_share": float(np.isfinite(thr).mean())}
