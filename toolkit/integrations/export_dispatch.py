"""``sparsecal export --break-even FILE``: the export's ``dispatch`` record (formats.dispatch) from
the calibrated prefill and decode sparsity per operating point, layer and calibrated length, and
the break-even sparsities measured on a GPU (``sparsecal bench break-even``; ``--dispatch-timing``
graph | eager picks the rows; ``--break-even`` given several times merges the files row-wise, e.g.
decode rows of batch 1 and of batch 16 measured apart).

Calibrated sparsity = what the kernels would skip (skipped / reachable tiles, heads pooled):

- BSFA, per exported k: 1 - the measured density of the fit table ``bsfa_heads`` (the fitted
  thresholds on the held-out samples, or in-sample when the fit had no hold-out), mean over heads;
- BLASST, per fitted target: the held-out samples' gap histograms of the exported order under
  exactly what sparsify applies to each layer (its own factor with ``--per-layer``, the runtime
  policy: dense below the validated lengths and where factor / L > 1). When the run's samples are
  gone, the fit table ``blasst_heads`` (all samples pooled, the target's a/L) stands in, under the
  same runtime policy, and the record says so.

Calibrated decode sparsity (per decode mode that skips; the record's ``decode`` entry):

- BLASST ``sparse``: the held-out samples' decode gap histograms at the lambda sparsify gives each
  layer under the decode law (decode factor, its validated lengths), as for prefill; the pooled fit
  table's decode rows without the samples; none when the export has no decode calibration (its
  decode runs dense anyway);
- BSFA ``topk`` (k blocks kept per head): max(A - k, 0) / (A + 1) at each length, A = (N - 1) // BN
  candidates (ties, which keep more, ignored); ``thresholds``: 1 - the fit table ``bsfa_decode``'s
  measured decode density (model mean, the same on every sparse layer), when the fit has it.
  BSFA's default decode mode (dense) needs no entry.

Layers the export leaves dense (not captured; BLASST: skipping does not pay) have no sparsity (NaN
here, null in the file) and never dispatch sparse.

Shape legend: L model layers, L' captured layers, H query heads, NL calibrated lengths, NG gap bins.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from sparsecal.analysis.blasst import skipped
from sparsecal.analysis.fit import FIT_DIR
from sparsecal.analysis.tables import read_table
from sparsecal.formats import dispatch as D
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import blasst_layer_factors, blasst_min_length, blasst_runtime_lambda


def model_group(model: dict) -> tuple[int, int]:
    """(head_dim, group = H / Hkv) of a run manifest's model."""
    try:
        return int(model["head_dim"]), int(model["num_heads"]) // int(model["num_kv_heads"])
    except (KeyError, TypeError, ValueError):
        raise UserError("the run's manifest does not record head_dim and num_kv_heads (captured by an older "
                        "sparsecal): capture it again to dispatch on a break-even file.") from None


def _paths(path) -> list[Path]:
    return [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]


def be_name(path) -> str:
    """The break-even file's name in the record: 'a.json', or 'a.json + b.json' for merged files."""
    return " + ".join(p.name for p in _paths(path))


def load_for_run(path, manifest: dict) -> dict:
    """The break-even file, or several merged row-wise (formats.dispatch.merge_break_even: e.g. the
    decode rows of each batch from its own file), each checked against the run's model (head_dim,
    group) and tiles."""
    head_dim, group = model_group(manifest["model"])
    docs = []
    for p in _paths(path):
        doc = D.load_break_even(p)
        D.check_model(p, doc, head_dim, group, manifest["config"]["block_m"], manifest["config"]["block_n"])
        docs.append((p.name if p.name not in [n for n, _ in docs] else str(p), doc))
    return docs[0][1] if len(docs) == 1 else D.merge_break_even(docs)


def bsfa_sparsity(root: Path, fit: dict, sparse_layers, num_layers: int) -> dict[int, np.ndarray]:
    """{k: [L, NL]} 1 - the held-out measured density per layer (heads pooled); NaN off sparse_layers."""
    import polars as pl

    lengths = [int(n) for n in fit["lengths"]]
    tab = (read_table(root / FIT_DIR, "bsfa_heads").group_by(["k", "length", "layer"])
           .agg(pl.col("measured").mean()))
    keep = {int(i) for i in sparse_layers}
    out = {}
    for k in fit["k_values"]:
        s = np.full((num_layers, len(lengths)), np.nan)
        for r in tab.filter(pl.col("k") == k).iter_rows(named=True):
            if int(r["layer"]) in keep and int(r["length"]) in lengths:
                s[int(r["layer"]), lengths.index(int(r["length"]))] = 1.0 - float(r["measured"])
        out[int(k)] = s
    return out


def _log_lambda(factor, n: int, min_length) -> float:
    lam = blasst_runtime_lambda(factor, n, min_length)
    return -math.inf if lam is None else math.log(lam)


def blasst_held_sparsity(doc: dict, held: list, edges, layers: list[int], lengths: list[int],
                         target: float, mode: str = "prefill") -> np.ndarray:
    """[L, NL] mean over the held-out samples of each layer's ``mode`` sparsity at the lambda
    sparsify runs it with; ``held``: [(length, Hist with count [L', H, NG])] of the exported order."""
    factors = blasst_layer_factors(doc, mode, target)     # None: the layer runs dense
    min_length = blasst_min_length(doc, mode, target)
    sums, samples = np.zeros((doc["num_layers"], len(lengths))), np.zeros(len(lengths))
    for n, h in held:
        if n not in lengths:
            continue
        j = lengths.index(n)
        samples[j] += 1
        for p, layer in enumerate(layers):
            if factors[layer] is not None:
                tiles = h.reach * h.count.shape[1]
                sums[layer, j] += skipped(h.count[p].sum(0), edges, _log_lambda(factors[layer], n, min_length)) / tiles
    out = sums / np.where(samples > 0, samples, np.nan)
    out[[i for i, f in enumerate(factors) if f is None]] = np.nan
    return out


def _blasst_factor(doc: dict, target: float, mode: str):
    entry = doc if abs(target - doc["target_sparsity"]) < 1e-9 else next(
        e for e in doc["targets"] if abs(e["target_sparsity"] - target) < 1e-9)
    return entry["threshold_scale_factor"].get(mode)


def blasst_pooled_sparsity(root: Path, doc: dict, lengths: list[int], target: float,
                           mode: str = "prefill") -> np.ndarray:
    """[L, NL] from the fit table ``blasst_heads`` (all samples pooled, the target's a/L; heads
    averaged), 0 where the runtime policy runs dense; NaN on layers the export leaves dense."""
    import polars as pl

    factors = blasst_layer_factors(doc, mode, target)
    a = _blasst_factor(doc, target, mode)
    min_length = blasst_min_length(doc, mode, target)
    tab = (read_table(root / FIT_DIR, "blasst_heads")
           .filter((pl.col("mode") == mode) & (pl.col("order") == doc["scan_order"])
                   & ((pl.col("target") - target).abs() < 1e-9))
           .group_by(["length", "layer"]).agg(pl.col("sparsity").mean()))
    out = np.full((doc["num_layers"], len(lengths)), np.nan)
    for r in tab.iter_rows(named=True):
        layer, n = int(r["layer"]), int(r["length"])
        if n in lengths and factors[layer] is not None:
            dense = blasst_runtime_lambda(a, n, min_length) is None
            out[layer, lengths.index(n)] = 0.0 if dense else float(r["sparsity"])
    return out


def bsfa_decode_sparsity(root: Path, fit: dict, k: int, sparse_layers, num_layers: int) -> dict:
    """{decode mode: {"source", "sparsity" [L, NL]}} of BSFA at ``k`` (module docstring); NaN off
    sparse_layers."""
    import polars as pl

    lengths = [int(n) for n in fit["lengths"]]
    rows = [i for i in sparse_layers]
    a = np.array([(n - 1) // int(fit["config"]["block_n"]) for n in lengths], float)
    topk = np.full((num_layers, len(lengths)), np.nan)
    topk[rows] = np.maximum(a - k, 0) / (a + 1)
    out = {"topk": {"source": "max(A - k, 0) / (A + 1), A = (N - 1) // BN candidates (ties ignored)",
                    "sparsity": topk}}
    path = root / FIT_DIR / "bsfa_decode.parquet"
    tab = read_table(root / FIT_DIR, "bsfa_decode").filter(pl.col("k") == k) if path.is_file() else None
    if tab is not None and tab.height:
        dens = {int(r["length"]): float(r["measured"]) for r in tab.iter_rows(named=True)}
        thr = np.full((num_layers, len(lengths)), np.nan)
        thr[rows] = [1.0 - dens.get(n, np.nan) for n in lengths]
        out["thresholds"] = {"source": f"{fit['validation']} (fit table bsfa_decode: 1 - measured decode density "
                                       "under the decode thresholds, model mean)", "sparsity": np.clip(thr, 0, 1)}
    return out


def blasst_decode(root: Path, fit: dict, doc: dict, cal: dict, layers: list[int], t: float) -> dict:
    """{"sparse": {"source", "sparsity" [L, NL]}} under the decode law, {} without a decode calibration."""
    if _blasst_factor(doc, t, "decode") is None:
        return {}
    lengths = [int(n) for n in fit["lengths"]]
    if cal["held"] is not None and cal["held"].get("decode"):
        s = blasst_held_sparsity(doc, cal["held"]["decode"], cal["edges"], layers, lengths, t, "decode")
        return {"sparse": {"source": f"{fit['validation']} (decode gap histograms at each layer's runtime lambda)",
                           "sparsity": s}}
    s = blasst_pooled_sparsity(root, doc, lengths, t, "decode")
    return {"sparse": {"source": "in-sample (fit table blasst_heads, decode rows, all samples pooled, a/L)",
                       "sparsity": s}}


def configs(root: Path, fit: dict, doc: dict, cal: dict, layers: list[int], bsfa_layers) -> list[dict]:
    """Every exported operating point with its calibrated prefill sparsity [L, NL] and decode
    sparsity per decode mode (formats.dispatch.dispatch_record)."""
    lengths = [int(n) for n in fit["lengths"]]
    out = [{"method": "bsfa", "config": D.config_name("bsfa", k), "value": k, "source": f"{fit['validation']} "
            "(fit table bsfa_heads: 1 - measured density under the fitted thresholds)", "sparsity": s,
            "decode": bsfa_decode_sparsity(root, fit, int(k), bsfa_layers, doc["num_layers"])}
           for k, s in bsfa_sparsity(root, fit, bsfa_layers, doc["num_layers"]).items()]
    for entry in doc["targets"] or [doc]:
        t = entry["target_sparsity"]
        if cal["held"] is not None:
            s = blasst_held_sparsity(doc, cal["held"]["prefill"], cal["edges"], layers, lengths, t)
            source = f"{fit['validation']} (gap histograms at each layer's runtime lambda)"
        else:
            s = blasst_pooled_sparsity(root, doc, lengths, t)
            source = "in-sample (the run's samples are gone: fit table blasst_heads, all samples pooled, a/L)"
        out.append({"method": "blasst", "config": D.config_name("blasst", t), "value": t, "source": source,
                    "sparsity": s, "decode": blasst_decode(root, fit, doc, cal, layers, t)})
    return out


def dispatch(root: Path, fit: dict, doc: dict, cal: dict, layers: list[int], bsfa_layers, be_path, be_doc: dict,
             margin: float, warn=None, timing: str = "graph") -> dict:
    """The ``dispatch`` record for blasst.json; warns about methods the break-even file lacks, a
    timing taken for want of the asked one, a file without decode rows, and break-evens taken from
    the nearest measured length."""
    if timing not in D.TIMINGS:
        raise UserError(f"--dispatch-timing takes {' or '.join(D.TIMINGS)}, got {timing!r}.")
    head_dim, group = model_group(fit["model"])
    name = be_name(be_path)
    rec, missing = D.dispatch_record(configs(root, fit, doc, cal, layers, bsfa_layers), fit["lengths"], be_doc,
                                     name, head_dim, group, margin, timing)
    for m in missing:
        warn and warn(f"{name} has no {m} rows at head_dim {head_dim} group {group}: the {m} configs are left "
                      "out of the dispatch record (they run sparse at every length, as without dispatch).")
    for phase, got in rec["timing"].items():
        if got is not None and got != timing:
            warn and warn(f"{name} has no {timing} {phase} rows: the {phase} dispatch uses its {got} timings.")
    if rec["timing"]["decode"] is None:
        warn and warn(f"{name} has no decode rows at head_dim {head_dim} group {group}: decode is not dispatched "
                      "(measure them with `sparsecal bench break-even --phases prefill,decode`).")
    src = rec["break_even_file"]
    measured = [(f"{m} prefill", lens) for m, lens in src["measured_lengths"].items()]
    measured += [(f"{m} decode batch {b}", lens) for m, by in src["decode_measured_lengths"].items()
                 for b, lens in by.items()]
    for what, lens in measured:
        out = [n for n in rec["lengths"] if n < lens[0] or n > lens[-1]]
        if out:
            warn and warn(f"{what} break-even at {', '.join(map(str, out))} tokens is that of the nearest "
                          f"measured length ({lens[0]}-{lens[-1]} measured in {name}); measure those lengths with "
                          "`sparsecal bench break-even --lengths ...`.")
    return rec
