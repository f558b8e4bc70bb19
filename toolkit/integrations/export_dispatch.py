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

Calibrated decode sparsity of the group decision (a KV group skips a tile only when all its heads
would; the config's ``decode_group`` entry, from the break-even file's group rows):

- BLASST ``sparse``, where the target has the group law (blasst.json ``decode_group``: a_group and
  its validated lengths, what sparsify's group decision applies on every sparse layer,
  sparsify_laws.use_group_law): the held-out samples' decode group gap histograms
  (``decode_group_gap_count``: each head carries its KV group's gap, so heads pooled it is the
  group's V-tile skip share, analysis/blasst_group.py) at lambda = a_group / L, dense below the
  group law's min_length and where a_group / L > 1. Without the samples: the target on every sparse
  layer at the group law's validated lengths (where a_group / L was fitted to reach it), 0 where
  the runtime policy runs dense, none (never dispatched sparse) at the other lengths;
- none for BSFA (no calibrated group-decision decode sparsity) nor for a BLASST target without the
  group law: their group-decision decode is not dispatched.

Layers the export leaves dense (not captured; BLASST: skipping does not pay) have no sparsity (NaN
here, null in the file) and never dispatch sparse.

Shape legend: L model layers, L' captured layers, H query heads, NL calibrated lengths, NG gap bins.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from sparsecal.analysis.blasst import skipped
from sparsecal.analysis.engine_law import Hist
from sparsecal.analysis.fit import FIT_DIR
from sparsecal.analysis.samples import decode_reachable, load_arrays
from sparsecal.analysis.tables import read_table
from sparsecal.formats import dispatch as D
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import blasst_group_law, blasst_layer_factors, blasst_min_length, blasst_runtime_lambda
from sparsecal.formats.stats_config import StatsConfig


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
    return _held_sparsity(held, edges, layers, lengths, blasst_layer_factors(doc, mode, target),
                          blasst_min_length(doc, mode, target))


def _held_sparsity(held: list, edges, layers: list[int], lengths: list[int], factors: list, min_length) -> np.ndarray:
    """[L, NL] blasst_held_sparsity at per-layer ``factors`` [L] (None: the layer runs dense) and the
    law's ``min_length`` (dense below it)."""
    sums, samples = np.zeros((len(factors), len(lengths))), np.zeros(len(lengths))
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
        if not 0 <= layer < len(factors):
            raise UserError(f"{root / FIT_DIR}/blasst_heads.parquet names layer {layer}, but the export has "
                            f"{len(factors)} layers; run `sparsecal fit {root}` again.")
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


def group_held(store, fit: dict, order: str) -> list | None:
    """[(length, Hist with count [L', H, NG])] of the held-out samples' decode group gap histograms in
    ``order``; None where a sample lacks them (captured before the statistic)."""
    cfg = StatsConfig.from_dict(fit["config"])
    o = list(cfg.orders).index(order)
    by_id = {r["id"]: r for r in store.manifest["samples"]}
    out = []
    for sid in fit["split"]["test"] or fit["split"]["train"]:
        got = load_arrays(store, by_id[sid], (), optional=("decode_group_gap_count",))
        if "decode_group_gap_count" not in got:
            return None
        count = np.asarray(got["decode_group_gap_count"][:, :, o], np.float64)
        n = int(by_id[sid]["length"])
        if decode_reachable(n, cfg) > 0:
            out.append((n, Hist(count, np.zeros_like(count), float(decode_reachable(n, cfg)))))
    return out


def blasst_decode_group(fit: dict, doc: dict, cal: dict, layers: list[int], t: float, held: list | None) -> dict:
    """{"sparse": {"source", "sparsity" [L, NL]}} of the group decision under the target's group law
    (module docstring; ``held``: group_held's), {} without the law or a decode calibration."""
    law = blasst_group_law(doc, t)
    if law is None or _blasst_factor(doc, t, "decode") is None:
        return {}
    lengths, a = [int(n) for n in fit["lengths"]], float(law["threshold_scale_factor"])
    factors = [None if f is None else a for f in blasst_layer_factors(doc, "decode", t)]  # no per-layer factors
    v = law["validity"]
    if held:
        s = _held_sparsity(held, cal["edges"], layers, lengths, factors, v["min_length"])
        return {"sparse": {"source": f"{fit['validation']} (decode group gap histograms at the group law's "
                                     "lambda a_group / L)", "sparsity": s}}
    s = np.full((len(factors), len(lengths)), np.nan)
    for j, n in enumerate(lengths):
        dense = blasst_runtime_lambda(a, n, v["min_length"]) is None
        if dense or n in v["validated_lengths"]:
            s[[i for i, f in enumerate(factors) if f is not None], j] = 0.0 if dense else t
    return {"sparse": {"source": "the group law's target at its validated lengths (the run's samples or their group "
                                 "gap histograms are gone), 0 where it runs dense, none elsewhere", "sparsity": s}}


def configs(root: Path, fit: dict, doc: dict, cal: dict, layers: list[int], bsfa_layers, store=None) -> list[dict]:
    """Every exported operating point with its calibrated prefill sparsity [L, NL] and decode
    sparsity per decode mode, of the head decision (``decode``) and of the group decision where the
    export knows it (``decode_group``; ``store``: the run, for the held-out group histograms)
    (formats.dispatch.dispatch_record)."""
    lengths = [int(n) for n in fit["lengths"]]
    out = [{"method": "bsfa", "config": D.config_name("bsfa", k), "value": k, "source": f"{fit['validation']} "
            "(fit table bsfa_heads: 1 - measured density under the fitted thresholds)", "sparsity": s,
            "decode": bsfa_decode_sparsity(root, fit, int(k), bsfa_layers, doc["num_layers"])}
           for k, s in bsfa_sparsity(root, fit, bsfa_layers, doc["num_layers"]).items()]
    held = None
    if store is not None and cal["held"] is not None and any(blasst_group_law(doc, e["target_sparsity"])
                                                             for e in doc["targets"] or [doc]):
        held = group_held(store, fit, doc["scan_order"])
    for entry in doc["targets"] or [doc]:
        t = entry["target_sparsity"]
        if cal["held"] is not None:
            s = blasst_held_sparsity(doc, cal["held"]["prefill"], cal["edges"], layers, lengths, t)
            source = f"{fit['validation']} (gap histograms at each layer's runtime lambda)"
        else:
            s = blasst_pooled_sparsity(root, doc, lengths, t)
            source = "in-sample (the run's samples are gone: fit table blasst_heads, all samples pooled, a/L)"
        out.append({"method": "blasst", "config": D.config_name("blasst", t), "value": t, "source": source,
                    "sparsity": s, "decode": blasst_decode(root, fit, doc, cal, layers, t),
                    "decode_group": blasst_decode_group(fit, doc, cal, layers, t, held)})
    return out


def dispatch(root: Path, fit: dict, doc: dict, cal: dict, layers: list[int], bsfa_layers, be_path, be_doc: dict,
             margin: float, warn=None, timing: str = "graph", store=None) -> dict:
    """The ``dispatch`` record for blasst.json; warns about methods the break-even file lacks, a
    timing taken for want of the asked one, a file without decode rows, configs whose group-decision
    decode is not dispatched, and break-evens taken from the nearest measured length."""
    if timing not in D.TIMINGS:
        raise UserError(f"--dispatch-timing takes {' or '.join(D.TIMINGS)}, got {timing!r}.")
    head_dim, group = model_group(fit["model"])
    name = be_name(be_path)
    rec, missing = D.dispatch_record(configs(root, fit, doc, cal, layers, bsfa_layers, store), fit["lengths"], be_doc,
                                     name, head_dim, group, margin, timing)
    for m in missing:
        warn and warn(f"{name} has no {m} rows at head_dim {head_dim} group {group}: the {m} configs are left "
                      "out of the dispatch record (they run sparse at every length, as without dispatch).")
    for phase, got in rec["timing"].items():
        if got is not None and got != timing:
            warn and warn(f"{name} has no {timing} {phase} rows: the {phase} dispatch uses its {got} timings.")
    if rec["timing"]["decode"] is None and rec["timing"].get("decode_group") is None:
        warn and warn(f"{name} has no decode rows at head_dim {head_dim} group {group}: decode is not dispatched "
                      "(measure them with `sparsecal bench break-even --phases prefill,decode`).")
    if rec["timing"].get("decode_group") is not None:
        left = [c["config"] for c in rec["configs"] if "decode_group" not in c]
        if left:
            warn and warn(f"no calibrated group-decision decode sparsity for {', '.join(left)} (BSFA; BLASST targets "
                          "without blasst.json decode_group): their group-decision decode is not dispatched.")
    src = rec["break_even_file"]
    measured = [(f"{m} prefill", lens) for m, lens in src["measured_lengths"].items()]
    measured += [(f"{m} decode{' group' if key == 'decode_group_measured_lengths' else ''} batch {b}", lens)
                 for key in ("decode_measured_lengths", "decode_group_measured_lengths")
                 for m, by in src.get(key, {}).items() for b, lens in by.items()]
    for what, lens in measured:
        out = [n for n in rec["lengths"] if n < lens[0] or n > lens[-1]]
        if out:
            warn and warn(f"{what} break-even at {', '.join(map(str, out))} tokens is that of the nearest "
                          f"measured length ({lens[0]}-{lens[-1]} measured in {name}); measure those lengths with "
                          "`sparsecal bench break-even --lengths ...`.")
    return rec
