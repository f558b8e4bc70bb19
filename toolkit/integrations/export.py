"""``sparsecal export``: turn a run's fit into the files kernels and serving engines read (formats
in sparsecal.formats.exports, sparsecal.formats.engine_files and docs/formats.md "Exports").

Always: thresholds.bsfa.pt, thresholds.safetensors, blasst.json and report.txt (the engines'
rule replayed on the run's held-out samples). With ``formats``: the engine files of
integrations.engine_export beside them, and ``patch_config`` writes Model-Optimizer's block into a
checkpoint. Layers the run did not capture, and captured layers where skipping does not pay, are
listed as ignored (with the reason) in every file; BSFA keeps every block there (-inf).

Shape legend: K k values, L model layers, L' captured layers, H query heads, P query blocks
(extended to --max-length).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from sparsecal.analysis.bsfa import extend_positions
from sparsecal.analysis.engine_fit import calibrated_weights
from sparsecal.analysis.engine_law import MIN_LAYER_SPARSITY, collect, format_table, simulate, unpaid_layers
from sparsecal.analysis.fit import FIT_DIR, load_fit
from sparsecal.analysis.tables import THRESHOLDS, read_table
from sparsecal.formats import engine_files as F
from sparsecal.formats.engines import SCALED_SCORES
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import (
    BLASST_ALGORITHM,
    BLASST_JSON,
    BSFA_PT,
    BSFA_ST,
    BsfaExport,
    blasst_dense_below,
    check_bsfa_values,
    validate_blasst,
    write_blasst,
)
from sparsecal.formats.files import atomic_write_text
from sparsecal.formats.geometry import cdiv
from sparsecal.formats.run import MANIFEST as RUN_MANIFEST
from sparsecal.formats.run import RUN_KIND, SAMPLES
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.formats.tensors import load_arrays
from sparsecal.formats.version import SCHEMA_VERSION, __version__
from sparsecal.integrations import engine_export as E
from sparsecal.integrations import engine_safety as S
from sparsecal.integrations import export_dispatch as XD
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
    _finite_or_minus_inf(path, tensors["thresholds"], root)
    return tensors["thresholds"], meta


def _finite_or_minus_inf(path: Path, thr: np.ndarray, root: Path) -> None:
    """Fitted thresholds [K, L', H, P] are finite or -inf (keep every block); NaN or +inf is refused."""
    bad = np.isnan(thr) | (thr == np.inf)
    if bad.any():
        idx = [int(i) for i in np.argwhere(bad)[0]]
        raise UserError(f"{path} holds {thr[tuple(idx)]} at [k, layer, head, block] = {idx}; thresholds must be finite "
                        f"or -inf: run `sparsecal fit {root}` again.")


EXPORT_NAMES = (BLASST_JSON, BSFA_PT, BSFA_ST)  # a directory holding one of them is an export


def _kind(path: Path):
    """The ``kind`` of a JSON file, None when it is absent or not a JSON object."""
    try:
        doc = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return doc.get("kind") if isinstance(doc, dict) else None


def check_export_dir(out: Path) -> None:
    """Refuse an --out that is a file, a run (its root, fit/, samples/ or a sample folder, or
    anything inside fit/ or samples/), an evaluation directory, or a non-empty directory that is
    not an export: an export writes only into a new, empty or export directory."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory for the export.")
    for p in [out, *out.absolute().parents]:
        run_root = _kind(p.parent / RUN_MANIFEST) == RUN_KIND
        if p.name in (FIT_DIR, SAMPLES) and run_root:
            raise UserError(f"--out {out} is {'inside ' if p != out else ''}the {p.name}/ directory of run {p.parent}; "
                            f"export into a directory of its own (e.g. {p.parent}/export).")
    what = ("a run" if _kind(out / RUN_MANIFEST) == RUN_KIND else
            "a run's sample folder" if (out / "sample.json").is_file() or (out / "stats.safetensors").is_file() else
            "an evaluation directory" if (out / "data" / "manifest.json").is_file() or (out / "results.json").is_file()
            else None)
    if what is not None:
        raise UserError(f"--out {out} is {what}; export into a new or empty directory (e.g. {out}/export).")
    if out.is_dir() and any(out.iterdir()) and not any((out / n).is_file() for n in EXPORT_NAMES):
        raise UserError(f"--out {out} is a non-empty directory that is not a sparsecal export; choose a new or empty "
                        "directory.")


LENGTH_POLICY = ("lambda = threshold_scale_factor[mode] / L only where the law holds: sparsify runs dense (ln lambda "
                 "= -inf) below validity[mode].min_length (the shortest calibrated length at which the target was "
                 "reached), past validity[mode].max_length (the longest: the law is extrapolated there) unless "
                 "sparsify(..., extrapolate=True), and wherever factor / L > 1 (ln lambda > 0 would skip every "
                 "candidate tile)")


def _validity(cal: dict) -> dict | None:
    """Where a fit record's a/L law holds: its ``deployed`` entry (fits since validity existed), else
    the lengths of its per_length rows with in_fit."""
    if cal.get("deployed"):
        return cal["deployed"]
    lens = sorted(p["length"] for p in cal["per_length"] if p["in_fit"])
    return {"law": "a/L", "validated_lengths": lens, "min_length": lens[0], "max_length": lens[-1],
            "dense_below": blasst_dense_below(cal["a"], lens[0])} if lens else None


def _group_entry(fit: dict, target: float) -> dict:
    """``decode_group`` of a target's entry: the decode law of the group decision (fit.json's
    blasst_decode_group: its factor, validated lengths, and the group's share at the head law), or
    nothing where the fit has none (a run captured before the group statistic, or out of reach)."""
    for g in fit.get("blasst_decode_group") or []:
        if abs(g["target"] - target) < 1e-9 and g.get("a_group") is not None and g.get("validity"):
            return {"decode_group": {"threshold_scale_factor": g["a_group"], "validity": g["validity"],
                                     "group_sparsity_at_head_lambda": g["group_sparsity_at_head_lambda"]}}
    return {}


def _fit_entry(c: dict) -> dict:
    """blasst.json ``fit[mode]``: the deployed law's quality, the alternatives and held-out means."""
    out = {"law": c["law"], "power_law": c["power_law"], "fixed_lambda": c["fixed_lambda"],
           "fixed_length": c["fixed_length"]}
    out.update({k: c[k] for k in ("laws", "held_out") if k in c})
    return out


def _decode_thresholds(root: Path, layers: list[int], num_layers: int, num_blocks: int):
    """(decode thresholds [K, L, H, num_blocks] over the model's layers, -inf on layers not captured
    and extended like the prefill ones; calibrated positions [C]) from the fit, or (None, None) when
    the fit has none (a run captured before decode rows had BSFA statistics)."""
    tensors, _ = load_arrays(root / FIT_DIR / THRESHOLDS, keys=["decode_thresholds", "decode_positions"])
    if "decode_thresholds" not in tensors:
        return None, None
    dthr = extend_positions(model_layers(tensors["decode_thresholds"], layers, num_layers, root), num_blocks)
    return dthr, tensors["decode_positions"]


def blasst_doc(fit: dict, target: float | None) -> dict:
    """blasst.json: the serving engines' skip-softmax shape, plus every fitted target, its quality
    and the lengths its law holds on (``validity``)."""
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
            "fit": {m: _fit_entry(c) for m, c in by_mode.items()},
            "validity": {m: _validity(c) for m, c in by_mode.items() if _validity(c)},
            "per_length": [dict(p, mode=m) for m, c in by_mode.items() for p in c["per_length"]],
            **_group_entry(fit, t),
        })
    main = next(e for e in entries if abs(e["target_sparsity"] - target) < 1e-9)
    cfg, model = fit["config"], fit["model"]
    return {"algorithm": BLASST_ALGORITHM, "threshold_scale_factor": main["threshold_scale_factor"],
            "target_sparsity": target, "lambda_rule": "lambda = threshold_scale_factor[mode] / sequence_length; "
            "skip a tile when max over its rows of (rowmax - running max) < ln(lambda)",
            "length_policy": LENGTH_POLICY, "validity": main["validity"],
            "scan_order": fit["request"]["order"], "fit": main["fit"], "per_length": main["per_length"],
            **({"decode_group": main["decode_group"]} if "decode_group" in main else {}),
            "targets": entries, "model": model["id"], "num_layers": model["num_layers"],
            "num_heads": model["num_heads"], **({"head_dim": model["head_dim"]} if model.get("head_dim") else {}),
            "q_block_size": cfg["block_m"], "k_block_size": cfg["block_n"],
            "log_base": "e", "score_scale": SCALED_SCORES, "lengths": fit["lengths"], "samples": len(fit["split"]["train"]), "validation": fit["validation"],
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


def captured(manifest: dict, fit: dict) -> tuple[list[int], dict[int, str]]:
    """(the model layers with statistics, {layer not captured: why}) of a run; runs made before
    ``layers`` existed captured every layer."""
    n = manifest["model"]["num_layers"]
    layers = [int(i) for i in manifest.get("layers", range(n))]
    if fit.get("layers") is not None and [int(i) for i in fit["layers"]] != layers:
        raise UserError(f"the fit covers layers {fit['layers']} but the run captured {layers}; run `sparsecal fit` "
                        "again.")
    notes = {int(k): str(v) for k, v in (manifest.get("layer_notes") or {}).items()}
    return layers, {i: notes.get(i, "not captured by the run") for i in range(n) if i not in layers}


def model_layers(thr: np.ndarray, layers: list[int], num_layers: int, root) -> np.ndarray:
    """[K, L', H, P] over the captured layers -> [K, L, H, P], -inf (keep every block) elsewhere."""
    if thr.shape[1] == num_layers:
        return thr
    if thr.shape[1] != len(layers):
        raise UserError(f"{root}/{FIT_DIR} holds thresholds of {thr.shape[1]} layers but the run captured "
                        f"{len(layers)}; run `sparsecal fit {root}` again.")
    out = np.full((thr.shape[0], num_layers) + thr.shape[2:], -np.inf, np.float32)
    out[:, layers] = thr
    return out


def calibration(store, fit: dict, doc: dict, layers: list[int], min_sparsity: float, warn) -> dict:
    """The held-out histograms, the captured layers where skipping does not pay ({layer: why}) and
    the sparse mask [L'] (None, None and all-sparse when the run's samples are gone)."""
    split = fit["split"]
    done = store.done_ids()
    if not all(sid in done for sid in split["train"] + split["test"]):
        warn and warn(f"{store.root} lacks samples the fit used: no simulated sparsity, no layer left dense for "
                      "lack of skipping (capture them again with the same command to get both).")
        return {"held": None, "train": None, "edges": None, "unpaid": {}, "sparse": np.ones(len(layers), bool)}
    cfg = StatsConfig.from_dict(fit["config"])
    hists = collect(store, fit, cfg, doc["scan_order"])
    factor = doc["threshold_scale_factor"]["prefill"]
    unpaid = unpaid_layers(hists.train["prefill"], cfg.gap_edges(), factor, doc["target_sparsity"], min_sparsity)
    sparse = np.array([p not in unpaid for p in range(len(layers))])
    return {"held": hists.held, "train": hists.train, "edges": cfg.gap_edges(),
            "unpaid": {layers[p]: w for p, w in unpaid.items()}, "sparse": sparse}


def add_per_layer(root: Path, doc: dict, layers: list[int], ignored: dict) -> None:
    """``per_layer`` {mode: {"<layer>": a or null}} in blasst.json's main entry and each target's,
    from the fit's per-layer a/L laws (blasst_layers: heads pooled, calibration samples); null where
    the layer reaches the target at no length (it uses the global factor)."""
    tab = read_table(root / FIT_DIR, "blasst_layers")
    rows = [r for r in tab.iter_rows(named=True) if r["order"] == doc["scan_order"]]
    seen = {int(r["layer"]) for r in rows}
    positional = seen == set(range(len(layers)))  # the stats arrays' first axis, else model indices
    for entry in [doc] + doc["targets"]:
        per = {}
        for r in rows:
            if abs(r["target"] - entry["target_sparsity"]) > 1e-9:
                continue
            layer = layers[int(r["layer"])] if positional else int(r["layer"])
            if layer not in ignored:
                a = r["a"]
                per.setdefault(r["mode"], {})[str(layer)] = float(a) if a is not None and math.isfinite(a) else None
        entry["per_layer"] = per


def length_lines(doc: dict) -> list[str]:
    """One line per (target, phase): the lengths its a/L law holds on and where sparsify runs dense."""
    out = []
    for entry in doc["targets"]:
        for mode, v in entry.get("validity", {}).items():
            a = entry["threshold_scale_factor"][mode]
            below = blasst_dense_below(a, v["min_length"])
            why = (f"a/L > 1 below {math.ceil(a)} tokens would skip every candidate tile" if math.ceil(a) > v["min_length"]
                   else f"the law is not validated below {v['min_length']} tokens")
            out.append(f"BLASST target {entry['target_sparsity']:g} {mode}: a/L (a = {a:.4g}) holds on "
                       f"{', '.join(map(str, v['validated_lengths']))} tokens; sparsify runs {mode} dense below "
                       f"{below} tokens ({why}) and past {v['max_length']} tokens (extrapolated: a/L only with "
                       "extrapolate=True).")
    return out


def report(doc: dict, rows: list, ignored: dict, cfg: dict, root: Path) -> str:
    """report.txt: what the export's engines will skip on this run, and the layers left dense."""
    lines = [(f"sparsecal {__version__} export of {root.name} ({doc['model']}): BLASST target sparsity "
              f"{doc['target_sparsity']:g}, {cfg['block_m']} x {cfg['block_n']} tiles, {doc['scan_order']} order."),
             (f"Simulated: lambda = factor / L on the run's own tiles, over the {doc['validation']} samples; "
              "achieved = skipped / reachable tiles of every captured layer (dense layers count as kept)."), ""]
    lines += [format_table(rows) if rows else "(no simulation: the run's samples are not there)", ""]
    lines += [("Lengths (the sparsecal rows apply this policy: 'dense' in the lambda column; engines apply factor / L "
               "at every length, '>1' = every candidate tile skipped):")] + [f"  {x}" for x in length_lines(doc)] + [""]
    lines += ["Layers left dense:"] + ([f"  layer {i}: {why}" for i, why in sorted(ignored.items())] or ["  none"])
    return "\n".join(lines) + "\n"


def _checked(store, out: Path, max_length: int | None) -> dict:
    """The run's fit, checked against the run, and the --out/--max-length checks."""
    root = Path(store.root)
    fit = load_fit(root)
    if fit["model"]["id"] != store.manifest["model"]["id"] or fit["config"] != store.manifest["config"]:
        raise UserError(f"{root}/{FIT_DIR} was fitted on a different model or geometry than the run; "
                        f"run `sparsecal fit {root}` again.")
    check_export_dir(out)
    longest = max(fit["lengths"])
    if max_length is not None and max_length < longest:
        raise UserError(f"--max-length {max_length} is below the longest calibrated length {longest}; "
                        "leave it out or give a larger value.")
    context = fit["model"].get("max_context")
    if max_length is not None and context and max_length > context:
        raise UserError(f"--max-length {max_length} is past the model's context of {context} tokens; "
                        f"give at most {context}.")
    return fit


def engine_options(formats, fit: dict, serve_lengths, length_weights, weights_source) -> dict:
    """--serve-lengths and --length-weights checked against the fit (one UserError line each, before
    any work): {"serve": served lengths, "weights": {calibrated length: w} or None, "source"}."""
    if not formats and (serve_lengths is not None or length_weights is not None):
        raise UserError("--serve-lengths and --length-weights shape the serving-engine files: give --format too "
                        "(e.g. --format all).")
    weights = calibrated_weights(length_weights, fit["lengths"]) if length_weights is not None else None
    return {"serve": S.serve_range(serve_lengths, fit["model"].get("max_context")), "weights": weights,
            "weights_source": weights_source or "--length-weights"}


def _engines(formats, tiles, doc: dict, fit: dict, cal: dict, layers: dict, hf_config, opts: dict) -> tuple:
    """(the engine files built, their context) for ``formats``, or (None, None) without formats.
    ``layers``: {"ignored": {layer: why}, "sparse": [layer]}; ``opts``: engine_options and checkpoint."""
    if not formats:
        return None, None
    model = fit["model"]
    classes, names = E.attention_modules(model, hf_config)
    ctx = {"model": model, "run": doc["run"], "target": doc["target_sparsity"], "config": fit["config"],
           "sparse": cal["sparse"], "ignored": layers["ignored"], "names": names, "classes": classes,
           "held": cal["held"], "train": cal["train"], "edges": cal["edges"], "validation": fit["validation"],
           "sparse_layers": layers["sparse"], **opts}
    built = E.build(formats, tiles, doc, ctx)
    E.check_factors_finite(built)
    ignore = [names[i] for i in sorted(layers["ignored"]) if i in names]
    built["safety"] = S.check(built, opts["serve"], built["scalar_laws"], ignore)
    built["traffic"] = E.traffic(built, doc, ctx)
    return built, ctx


def engine_notes(built: dict | None) -> list[str]:
    """The lines the export prints about its engine files (each once): lambda >= 1 on served lengths,
    and SGLang's decode factor not reaching XQA."""
    if not built:
        return []
    out = [S.warning_line(built["safety"])]
    if "sglang" in built["formats"]:
        out.append("sglang.env: on SM90 and SM120 FlashInfer's decode goes through XQA, which never receives "
                   "SGLANG_SKIP_SOFTMAX_DECODE_THRESHOLD_SCALE_FACTOR: decode runs dense there.")
    return [x for x in out if x]


def engine_report(built: dict | None) -> str:
    """report.txt's sections on the engine files: served lengths, and traffic (with length weights)."""
    if not built:
        return ""
    lines = S.report_lines(built["safety"]) + [""] + E.traffic_lines(built.get("traffic"))
    return "\n" + "\n".join(lines).rstrip() + "\n"


def _bsfa_parts(root: Path, fit: dict, thr, meta: dict, layers, structural: dict, max_length) -> dict:
    """What thresholds.bsfa.pt and thresholds.safetensors will hold (write_bsfa's arguments), with
    the decode thresholds when fitted; checked (finite or -inf) before anything is written."""
    cfg, model = fit["config"], fit["model"]
    st_meta = {"model": model["id"], "samples": meta["samples"], "lengths": meta["lengths"],
               "max_length": str(max_length or max(fit["lengths"])), "run": root.name,
               "sparse_layers": layers, "ignored_layers": {str(i): w for i, w in sorted(structural.items())},
               "score_scale": SCALED_SCORES, **({"head_dim": model["head_dim"]} if model.get("head_dim") else {})}
    decode = _decode_thresholds(root, layers, model["num_layers"], thr.shape[-1])
    parts = {"thr": thr, "k_values": fit["k_values"], "block_m": cfg["block_m"], "block_n": cfg["block_n"],
             "aggregation": fit["request"]["aggregation"], "meta": st_meta, "decode": decode}
    exp = BsfaExport(np.asarray(thr, np.float32), tuple(fit["k_values"]), cfg["block_m"], cfg["block_n"],
                     parts["aggregation"], decode_thresholds=decode[0])
    check_bsfa_values(root / FIT_DIR / THRESHOLDS, exp)
    return parts


def _blasst_text(out: Path, doc: dict) -> None:
    """blasst.json checked as its readers check it, and as JSON without NaN, before anything is written."""
    validate_blasst(out / BLASST_JSON, doc)
    try:
        json.dumps(doc, allow_nan=False)
    except ValueError:
        bad = [k for k, v in doc.items() if not _json_ok(v)]
        raise UserError(f"the export's {BLASST_JSON} would hold NaN or inf (in {', '.join(bad) or 'a value'}); the fit "
                        f"is damaged: run `sparsecal fit {doc['run']['name']}` again.") from None


def _json_ok(v) -> bool:
    try:
        json.dumps(v, allow_nan=False)
    except ValueError:
        return False
    return True


def _write(out: Path, doc: dict, bsfa: dict, text: str, engines: tuple, model: dict, force: bool, patch_config):
    """The export's files into ``out`` once everything is checked (blasst.json's text first: a
    document JSON cannot hold is refused before the overwrite check and any write): the BSFA
    thresholds, blasst.json, report.txt ``text``, the engine files of ``engines`` (built, ctx) and
    Model-Optimizer's block patched into ``patch_config``. Returns (text, engine files, patched)."""
    built, ctx = engines
    _blasst_text(out, doc)
    check_overwrite(out, model["id"], doc["run"], force)
    out.mkdir(parents=True, exist_ok=True)
    write_bsfa(out, **bsfa)
    write_blasst(out, doc)
    atomic_write_text(out / F.REPORT, text)
    written = E.write(out, built, E.manifest(built, doc, ctx)) if built else []
    patched = F.patch_config(patch_config, built["block"], model) if patch_config is not None else None
    return text, written, patched


def export_run(store, out: Path, target: float | None = None, max_length: int | None = None, force: bool = False,
               formats=(), patch_config=None, per_layer: bool = False, min_layer_sparsity: float = MIN_LAYER_SPARSITY,
               hf_config=None, warn=None, break_even=None, margin: float = 0.0, serve_lengths=None,
               length_weights=None, weights_source: str | None = None, timing: str = "graph") -> dict:
    """Write the three threshold files and report.txt into ``out`` (plus the engine ``formats`` and,
    with ``patch_config``, Model-Optimizer's block into that checkpoint's config.json); everything
    is checked before the first write. An export of another run in ``out`` is refused unless ``force``.
    ``hf_config``: the model's transformers config, for the attention module names. ``break_even``:
    a break-even file (``sparsecal bench break-even``): blasst.json gets the ``dispatch`` record
    (sparse where the calibrated sparsity >= break-even + ``margin``; ``timing``: the graph or eager
    rows of the file). ``serve_lengths`` (MIN, MAX or
    None) and ``length_weights`` ({length: weight}) shape the engine files (engine_options)."""
    root, out = Path(store.root), Path(out)
    fit = _checked(store, out, max_length)
    opts = engine_options(formats, fit, serve_lengths, length_weights, weights_source)
    be_doc = XD.load_for_run(break_even, store.manifest) if break_even is not None else None
    notes = []  # warnings said once the files are written: a refused export prints only its error line
    cfg, model = fit["config"], fit["model"]
    formats = list(dict.fromkeys(list(formats) + (["modelopt"] if patch_config is not None else [])))
    tiles = E.formats_tiles(formats, root, cfg, model)
    if patch_config is not None:
        F.read_config(patch_config, model)  # refuse a config of another model before any work
        hf_config = E.checkpoint_config(patch_config) or hf_config
    doc = blasst_doc(fit, target)
    thr, meta = _thresholds(root, fit)
    layers, structural = captured(store.manifest, fit)
    thr = extend_positions(model_layers(thr, layers, model["num_layers"], root),
                           cdiv(max_length or max(fit["lengths"]), cfg["block_m"]))
    cal = calibration(store, fit, doc, layers, min_layer_sparsity, warn)
    ignored = {**structural, **cal["unpaid"]}
    sparse_layers = [i for i in layers if i not in ignored]
    doc.update(run={"name": root.name, "created": store.manifest.get("created")}, sparse_layers=sparse_layers,
               ignored_layers={str(i): why for i, why in sorted(ignored.items())})
    if per_layer:
        add_per_layer(root, doc, layers, ignored)
    if be_doc is not None:
        doc["dispatch"] = XD.dispatch(root, fit, doc, cal, layers, layers, break_even, be_doc, margin, notes.append,
                                       timing, store)
    rows = simulate(cal["held"], cal["edges"], doc["threshold_scale_factor"], {m: doc["target_sparsity"] for m in F.PHASES},
                    cal["sparse"], "sparsecal: blasst.json",
                    min_lengths={m: v["min_length"] for m, v in doc["validity"].items()}) if cal["held"] is not None else []
    opts["checkpoint"] = None if patch_config is None else str(Path(patch_config) if Path(patch_config).is_dir()
                                                                else Path(patch_config).parent)
    built, ctx = _engines(formats, tiles, doc, fit, cal, {"ignored": ignored, "sparse": sparse_layers}, hf_config, opts)
    rows += built["rows"] if built else []
    doc["simulation"] = rows
    bsfa = _bsfa_parts(root, fit, thr, meta, layers, structural, max_length)  # everything checked before writing
    text, written, patched = _write(out, doc, bsfa, report(doc, rows, ignored, cfg, root) + engine_report(built),
                                    (built, ctx), model, force, patch_config)
    # once written: a refused export prints its error line alone
    for line in length_lines(doc) + notes + engine_notes(built):
        warn and warn(line)
    return {"out": str(out), "bsfa_shape": list(thr.shape), "k_values": fit["k_values"],
            "blasst": {e["target_sparsity"]: e["threshold_scale_factor"] for e in doc["targets"]},
            "threshold_finite_share": float(np.isfinite(thr).mean()), "report": text, "rows": rows,
            "ignored_layers": ignored, "engine_files": written, "patched": patched, "block": built and built["block"],
            "dispatch": doc.get("dispatch")}
