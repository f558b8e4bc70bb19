"""``sparsecal export --break-even FILE``: the export's ``dispatch`` record (formats.dispatch) from
the calibrated prefill sparsity per operating point, layer and calibrated length, and the
break-even sparsity measured on a GPU (``sparsecal bench break-even``).

Calibrated sparsity = what the kernels would skip (skipped / reachable tiles, heads pooled):

- BSFA, per exported k: 1 - the measured density of the fit table ``bsfa_heads`` (the fitted
  thresholds on the held-out samples, or in-sample when the fit had no hold-out), mean over heads;
- BLASST, per fitted target: the held-out samples' gap histograms of the exported order under
  exactly what sparsify applies to each layer (its own factor with ``--per-layer``, the runtime
  policy: dense below the validated lengths and where factor / L > 1). When the run's samples are
  gone, the fit table ``blasst_heads`` (all samples pooled, the target's a/L) stands in, under the
  same runtime policy, and the record says so.

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


def load_for_run(path, manifest: dict) -> dict:
    """The break-even file, checked against the run's model (head_dim, group) and tiles."""
    doc = D.load_break_even(path)
    head_dim, group = model_group(manifest["model"])
    D.check_model(path, doc, head_dim, group, manifest["config"]["block_m"], manifest["config"]["block_n"])
    return doc


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
                         target: float) -> np.ndarray:
    """[L, NL] mean over the held-out samples of each layer's prefill sparsity at the lambda
    sparsify runs it with; ``held``: [(length, Hist with count [L', H, NG])] of the exported order."""
    factors = blasst_layer_factors(doc, "prefill", target)     # None: the layer runs dense
    min_length = blasst_min_length(doc, "prefill", target)
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


def blasst_pooled_sparsity(root: Path, doc: dict, lengths: list[int], target: float) -> np.ndarray:
    """[L, NL] from the fit table ``blasst_heads`` (all samples pooled, the target's a/L; heads
    averaged), 0 where the runtime policy runs dense; NaN on layers the export leaves dense."""
    import polars as pl

    factors = blasst_layer_factors(doc, "prefill", target)
    a = doc["threshold_scale_factor"]["prefill"] if abs(target - doc["target_sparsity"]) < 1e-9 else next(
        e["threshold_scale_factor"]["prefill"] for e in doc["targets"] if abs(e["target_sparsity"] - target) < 1e-9)
    min_length = blasst_min_length(doc, "prefill", target)
    tab = (read_table(root / FIT_DIR, "blasst_heads")
           .filter((pl.col("mode") == "prefill") & (pl.col("order") == doc["scan_order"])
                   & ((pl.col("target") - target).abs() < 1e-9))
           .group_by(["length", "layer"]).agg(pl.col("sparsity").mean()))
    out = np.full((doc["num_layers"], len(lengths)), np.nan)
    for r in tab.iter_rows(named=True):
        layer, n = int(r["layer"]), int(r["length"])
        if n in lengths and factors[layer] is not None:
            dense = blasst_runtime_lambda(a, n, min_length) is None
            out[layer, lengths.index(n)] = 0.0 if dense else float(r["sparsity"])
    return out


def configs(root: Path, fit: dict, doc: dict, cal: dict, layers: list[int], bsfa_layers) -> list[dict]:
    """Every exported operating point with its calibrated sparsity [L, NL] (formats.dispatch.dispatch_record)."""
    lengths = [int(n) for n in fit["lengths"]]
    out = [{"method": "bsfa", "config": D.config_name("bsfa", k), "value": k, "source": f"{fit['validation']} "
            "(fit table bsfa_heads: 1 - measured density under the fitted thresholds)", "sparsity": s}
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
                    "sparsity": s})
    return out


def dispatch(root: Path, fit: dict, doc: dict, cal: dict, layers: list[int], bsfa_layers, be_path, be_doc: dict,
             margin: float, warn=None) -> dict:
    """The ``dispatch`` record for blasst.json; warns about methods the break-even file lacks and
    break-evens taken from the nearest measured length."""
    head_dim, group = model_group(fit["model"])
    rec, missing = D.dispatch_record(configs(root, fit, doc, cal, layers, bsfa_layers), fit["lengths"], be_doc,
                                     Path(be_path).name, head_dim, group, margin)
    for m in missing:
        warn and warn(f"{be_path} has no {m} rows at head_dim {head_dim} group {group}: the {m} configs are left "
                      "out of the dispatch record (they run sparse at every length, as without dispatch).")
    for method, lens in rec["break_even_file"]["measured_lengths"].items():
        out = [n for n in rec["lengths"] if n < lens[0] or n > lens[-1]]
        if out:
            warn and warn(f"{method} break-even at {', '.join(map(str, out))} tokens is that of the nearest measured "
                          f"length ({lens[0]}-{lens[-1]} measured in {Path(be_path).name}); measure those lengths "
                          "with `sparsecal bench break-even --lengths ...`.")
    return rec
