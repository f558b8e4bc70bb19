"""``sparsecal fit``: calibrate a run and write its analysis tables next to it.

    RUN/fit/
      fit.json                      what was fitted: request, split (sample ids), BLASST laws,
                                    warnings, versions, schema version
      bsfa_thresholds.safetensors   aggregated thresholds [K, L, H, P] (what `export` writes out)
      gap_cum.safetensors           tiles and mass per 0.25 step of ln(lambda) (cumulate for 'below'), per mode and
                                    length [Nlen, L, H, O, E'], all samples pooled (the dashboard's
                                    per-head sparsity at any lambda)
      bsfa_density.parquet          predicted vs measured density per k and length (Table 1)
      bsfa_heads.parquet            the same per layer and head
      blasst_lambda.parquet         lambda_best per length next to both laws
      blasst_fit.parquet            a, b, R^2 of lambda = a/L, a L^-b and A exp(B S)/L, their lengths
      blasst_eval.parquet           held-out sparsity per law, fixed lambda and the deployed a/L (Table 5)
      blasst_layers.parquet         per-layer a (the spread across layers)
      blasst_heads.parquet          per layer x head sparsity at the calibrated lambda
      blasst_curves.parquet         sparsity(lambda) and retained mass(lambda) per length
      blasst_decode_group.parquet   decode under the group decision: its skip share at the head law, its own
                                    lambda_best and a/L (analysis/blasst_group.py; empty before the statistic)
      stab_where / stab_tstar / qinit / qinit_hist .parquet   stabilization (VFA)
      joint / joint_hist .parquet   VFA's frozen max - true max (empty for a run captured before it)
      stab_rescale(_hist) / stab_shortfall(_hist) .parquet   running-max rescales and shortfall per order

Samples are read one at a time: calibration samples first (thresholds, histograms), then the
held-out ones are measured against what was fitted.
"""
from __future__ import annotations

import datetime as _dt
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from sparsecal.analysis import blasst_fit as B
from sparsecal.analysis import blasst_group, bsfa, bsfa_decode, stabilization
from sparsecal.analysis import blasst_laws as BL
from sparsecal.analysis.samples import decode_reachable, finished_records, load_arrays, split_samples
from sparsecal.formats.errors import UserError
from sparsecal.formats.files import read_json_manifest
from sparsecal.formats.json_values import fit_values
from sparsecal.formats.run import FIT_DIR, FIT_KIND, GROUP_GAP_KEYS, JOINT_KEYS, captured_layers
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.formats.version import SCHEMA_VERSION

CAL_KEYS = ("bsfa_threshold", "gap_count", "gap_mass", "decode_gap_count", "decode_gap_mass",
            "tstar_where", "tstar_hist", "qinit_count", "candidates", "reachable")
EVAL_KEYS = CAL_KEYS + ("bsfa_top_bmax", "bsfa_skipped_mass")
OPTIONAL_KEYS = stabilization.RESCALE_KEYS + JOINT_KEYS + GROUP_GAP_KEYS  # statistics older captures lack


@dataclass
class FitRequest:
    k_values: list | None = None        # None: every k the run captured
    targets: list = field(default_factory=lambda: [0.5, 0.7])
    holdout: float = 0.25
    seed: int = 0
    aggregation: str = "mean"
    order: str = "forward"              # the scan order exported for BLASST
    strict: bool = False                # refuse a run with damaged samples instead of leaving them out


@dataclass
class _State:
    """Everything accumulated over the samples."""

    cfg: StatsConfig
    kidx: list
    thr: bsfa.ThresholdAccumulator
    train: dict = field(default_factory=lambda: {m: {} for m in B.MODES})   # mode -> length -> HistSum
    pooled: dict = field(default_factory=lambda: {m: {} for m in B.MODES})  # all samples
    held: dict = field(default_factory=lambda: {m: [] for m in B.MODES})    # mode -> [(length, HistSum)]
    where: dict = field(default_factory=dict)
    tstar: dict = field(default_factory=dict)
    qinit: dict = field(default_factory=dict)
    joint: dict = field(default_factory=dict)                               # length -> [L, H, NQ], where captured
    rescale: stabilization.RescaleSums = field(default_factory=stabilization.RescaleSums)
    bsfa_eval: dict = field(default_factory=dict)                           # length -> [per-sample dict]
    dec: bsfa_decode.DecodeStep | None = None                               # BSFA decode thresholds, retained mass
    group: dict = field(default_factory=dict)                               # length -> HistSum, decode group gaps


def check_request(req: FitRequest, cfg: StatsConfig) -> list[int]:
    """Validate k values, targets, aggregation and order; returns the k indices into the run's k list."""
    ks = list(cfg.k_values) if req.k_values is None else sorted(set(req.k_values))
    missing = [k for k in ks if k not in cfg.k_values]
    if missing:
        raise UserError(f"k {','.join(map(str, missing))} was not captured; this run has k in "
                        f"{','.join(map(str, cfg.k_values))}: choose from those or capture again with --k.")
    bad = [t for t in req.targets if not 0.0 < t < 1.0]
    if bad or not req.targets:
        raise UserError(f"--targets {req.targets} must be sparsities strictly between 0 and 1 (e.g. 0.5,0.7).")
    if req.aggregation not in bsfa.AGGREGATIONS:
        raise UserError(f"--aggregation {req.aggregation!r} is not one of {', '.join(bsfa.AGGREGATIONS)}.")
    if req.order not in cfg.orders:
        raise UserError(f"--order {req.order!r} was not captured; this run has {', '.join(cfg.orders)}.")
    return [cfg.k_values.index(k) for k in ks]


def _add_hists(st: _State, arrays: dict, length: int, into: list[dict], held: bool) -> None:
    """Add one sample's gap histograms (both modes) to the given accumulators."""
    dec_reach, dec_rows = _decode_norms(st, length)
    reach = {"prefill": float(arrays["reachable"].sum()), "decode": dec_reach}
    npos = {"prefill": float(len(arrays["reachable"])), "decode": dec_rows}
    for mode, prefix in (("prefill", ""), ("decode", "decode_")):
        c = arrays[f"{prefix}gap_count"].astype(np.float64)
        m = arrays[f"{prefix}gap_mass"].astype(np.float64)
        for acc in into:
            acc[mode].setdefault(length, B.HistSum.empty_like(c)).add(c, m, reach[mode], npos[mode])
        if held:
            one = B.HistSum.empty_like(c)
            one.add(c, m, reach[mode], npos[mode])
            st.held[mode].append((length, one))


def _decode_norms(st: _State, length: int) -> tuple[float, float]:
    """(reachable tiles, decode rows) of one sample's decode histograms, per layer and head."""
    return float(decode_reachable(length, st.cfg)), float(min(st.cfg.decode_rows, length))


def _add_group(st: _State, arrays: dict, length: int) -> None:
    """Add one calibration sample's decode group gap histograms (absent before the statistic)."""
    if "decode_group_gap_count" not in arrays:
        return
    g = arrays["decode_group_gap_count"].astype(np.float64)
    st.group.setdefault(length, B.HistSum.empty_like(g)).add(
        g, arrays["decode_group_gap_mass"].astype(np.float64), *_decode_norms(st, length))


def _add_stab(st: _State, arrays: dict, length: int) -> None:
    for name, acc in (("tstar_where", st.where), ("tstar_hist", st.tstar), ("qinit_count", st.qinit)):
        a = arrays[name].astype(np.int64)
        acc[length] = acc[length] + a if length in acc else a
    if "joint_count" in arrays:  # samples captured before it lack the key
        a = arrays["joint_count"].astype(np.int64)
        st.joint[length] = st.joint[length] + a if length in st.joint else a
    st.rescale.add(arrays, length)


def _measure_bsfa(st: _State, thr: np.ndarray, arrays: dict, length: int, ks: list) -> None:
    cand, reach = arrays["candidates"], arrays["reachable"]
    kept, saturated = bsfa.measured_kept(thr, arrays["bsfa_top_bmax"], cand)
    skipped = np.moveaxis(arrays["bsfa_skipped_mass"][..., st.kidx], -1, 0)  # [K, L, H, P]
    st.bsfa_eval.setdefault(length, []).append({
        "density": bsfa.density(kept, cand, reach), "predicted": bsfa.predicted_density(cand, reach, ks),
        "retained": bsfa.retained_mass(skipped), "saturated": saturated})


def fit_run(store, req: FitRequest, progress=None, warn=print) -> dict:
    """Fit everything and write RUN/fit/. ``progress(done, total, record)`` after each sample read;
    ``warn(line)`` for warnings. Returns the fit.json document."""
    cfg = StatsConfig.from_dict(store.manifest["config"])
    kidx = check_request(req, cfg)
    check_fit_dir(Path(store.root))
    ks = [cfg.k_values[i] for i in kidx]
    split = split_samples(finished_records(store, warn, req.strict), req.holdout, req.seed, str(store.root))
    warnings = _k_warnings(ks, split.lengths, cfg)
    st = _State(cfg, kidx, bsfa.ThresholdAccumulator(req.aggregation))
    st.dec = bsfa_decode.DecodeStep(cfg, kidx, req.aggregation)
    evals = list(split.test) or list(split.train)
    total, done = len(split.train) + len(evals), 0
    for rec in split.train:
        a = load_arrays(store, rec, CAL_KEYS, OPTIONAL_KEYS)
        st.thr.add(a["bsfa_threshold"][..., kidx])
        st.dec.add_sample(store, rec)
        _add_hists(st, a, rec["length"], [st.train, st.pooled], held=False)
        _add_group(st, a, rec["length"])
        _add_stab(st, a, rec["length"])
        done += 1
        progress and progress(done, total, rec)
    thr = st.thr.result()
    st.dec.finish(thr.shape[-1], warn)
    cals = _calibrate(st, req, cfg, warnings)
    for w in warnings:  # only once nothing is refused
        warn(w)
    for rec in evals:
        a = load_arrays(store, rec, EVAL_KEYS, OPTIONAL_KEYS)
        if split.test:
            _add_hists(st, a, rec["length"], [st.pooled], held=True)
            _add_stab(st, a, rec["length"])
        else:  # in-sample validation: histograms were pooled in the first pass
            _add_hists(st, a, rec["length"], [], held=True)
        _measure_bsfa(st, thr, a, rec["length"], ks)
        st.dec.measure_sample(store, rec, thr, ks)
        done += 1
        progress and progress(done, total, rec)
    return _write(store, req, st, split, thr, ks, cals, warnings)


def check_fit_dir(root: Path) -> None:
    """RUN/fit must be the run's own directory (or absent): a symbolic link or a file there is
    refused, never written through."""
    out = root / FIT_DIR
    if out.is_symlink():
        raise UserError(f"{out} is a symbolic link; sparsecal does not write through it out of the run: remove it "
                        f"(rm {out}) and run `sparsecal fit {root}` again.")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not the run's fit directory; remove it and run `sparsecal fit {root}` "
                        "again.")


def _calibrate(st: _State, req: FitRequest, cfg: StatsConfig, warnings: list) -> list:
    """Every (mode, order, target) calibration; refuses targets no length reaches in the export order."""
    edges = cfg.gap_edges()
    cals = []
    for mode in B.MODES:
        if not st.train[mode] or all(s.reach == 0 for s in st.train[mode].values()):
            continue  # a run captured with --decode-rows 0 has no decode statistics
        for o, order in enumerate(cfg.orders):
            for target in req.targets:
                cal = B.calibrate(st.train[mode], edges, mode, o, order, target)
                if order == req.order and cal.law is None:
                    best = max(cal.max_sparsity)
                    raise UserError(f"BLASST {mode} target sparsity {target:g} is out of reach at every length of "
                                    f"the run (the most any length skips is {best:.3f}, at lambda = 1); choose "
                                    "a lower --targets value or capture longer prompts.")
                note = B.unreachable_note(cal)
                if note and order == req.order:
                    warnings.append(note)
                cals.append((o, cal))
    return cals


def _k_warnings(ks, lengths, cfg: StatsConfig) -> list[str]:
    from sparsecal.formats.geometry import cdiv, num_candidates

    most = max(num_candidates(cdiv(n, cfg.block_m) - 1, cfg.block_m, cfg.block_n) for n in lengths)
    return [f"k={k} keeps every candidate block at every length of this run (at most {most} candidates): its "
            "thresholds are all -inf (dense)." for k in ks if k >= most]


def _write(store, req, st: _State, split, thr, ks, cals, warnings) -> dict:
    from sparsecal.analysis import tables

    out = Path(store.root) / FIT_DIR
    out.mkdir(exist_ok=True)
    cfg = st.cfg
    edges = cfg.gap_edges()
    tables.write_thresholds(out, thr, ks, store.manifest, split, extra=st.dec.arrays())
    tables.write_gap_cum(out, st.pooled, edges, cfg.orders, B.CURVE_STRIDE)
    label = "held-out" if split.test else "in-sample"
    laws = BL.fit_laws([c for _, c in cals])  # a/L, a L^-b, A exp(B S)/L: analysis/blasst_laws.py
    evals = {id(c): BL.eval_rows(c, laws[id(c)], st.held[c.mode], edges, o) for o, c in cals}
    frames = {
        "bsfa_density": tables.bsfa_density_rows(st.bsfa_eval, ks, label),
        "bsfa_heads": tables.bsfa_head_rows(st.bsfa_eval, ks),
        "blasst_lambda": [r for _, c in cals for r in B.lambda_rows(c)],
        "blasst_fit": BL.fit_rows([c for _, c in cals], laws, evals),
        "blasst_eval": [dict(r, split=label) for _, c in cals for r in evals[id(c)]],
        "blasst_layers": [r for o, c in cals for r in B.layer_rows(c, st.train[c.mode], edges, o)],
        "blasst_heads": [r for o, c in cals if c.order == req.order
                         for r in B.head_rows(c, st.pooled[c.mode], edges, o)],
        "blasst_curves": [r for m in B.MODES if st.pooled[m] for r in B.curve_rows(m, cfg.orders, st.pooled[m], edges)],
        "stab_where": stabilization.where_rows(st.where, cfg.orders),
        "stab_tstar": stabilization.tstar_rows(st.tstar, cfg.orders),
        "qinit": stabilization.qinit_rows(st.qinit, cfg.qinit_edges()),
        "qinit_hist": stabilization.qinit_hist_rows(st.qinit, cfg.qinit_edges()),
        "joint": stabilization.joint_rows(st.joint, cfg.qinit_edges()),
        "joint_hist": stabilization.qinit_hist_rows(st.joint, cfg.qinit_edges()),
        "blasst_decode_group": blasst_group.group_rows(cals, st.group, st.train["decode"], edges, req.order),
        **st.dec.frames(ks, label),
        **stabilization.rescale_frames(st.rescale, cfg.orders, cfg.shortfall_edges()),
    }
    layers = captured_layers(store.manifest)
    for name, rows in frames.items():
        tables.write_table(out / f"{name}.parquet", _model_layers(rows, layers))
    doc = {"kind": FIT_KIND, "schema_version": SCHEMA_VERSION,
           "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "model": store.manifest["model"], "config": store.manifest["config"], "request": asdict(req),
           "k_values": ks, "lengths": split.lengths, "validation": label,
           "layers": layers, "layer_notes": store.manifest.get("layer_notes", {}),
           "split": {"train": [r["id"] for r in split.train], "test": [r["id"] for r in split.test]},
           "blasst": [dict(_cal_doc(c, evals[id(c)]), **BL.doc_extra(c, laws[id(c)], evals[id(c)]))
                      for _, c in cals if c.order == req.order],
           "blasst_decode_group": blasst_group.group_doc(frames["blasst_decode_group"]),
           "warnings": warnings, "tables": sorted(frames)}
    tables.write_json(out / "fit.json", doc)
    return doc


def _model_layers(rows: list[dict], layers: list[int]) -> list[dict]:
    """Rows whose ``layer`` is a position in the stats arrays, relabelled with the model's layer index."""
    return [dict(r, layer=layers[r["layer"]]) if "layer" in r else r for r in rows]


def _cal_doc(cal: B.Calibration, ev: list[dict]) -> dict:
    """One calibration (with its held-out eval rows) as fit.json, and later blasst.json, records it."""
    per_len = []
    for n, x in zip(cal.lengths, cal.log_lambda):
        got = [r["achieved"] for r in ev if r["length"] == n and r["method"] == "a/L"]
        per_len.append({"length": n, "target": cal.target,
                        "lambda": float(cal.law.predict(n)) if cal.law else None,
                        "lambda_best": math.exp(x) if not math.isnan(x) else None,
                        "achieved": float(np.mean(got)) if got else None, "in_fit": not math.isnan(x)})
    law = {"a": cal.law.a, "r2": _num(cal.law.r2), "residuals": list(cal.law.residuals)}
    power = ({"a": cal.power.a, "b": cal.power.b, "r2": _num(cal.power.r2)} if cal.power else None)
    return {"mode": cal.mode, "order": cal.order, "target": cal.target, "a": cal.law.a, "law": law,
            "power_law": power, "fixed_lambda": cal.fixed_lambda, "fixed_length": cal.fixed_length,
            "per_length": per_len}


def _num(x: float):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def load_fit(root) -> dict:
    """fit.json of a run, checked; says which command makes it when absent."""
    path = Path(root) / FIT_DIR / "fit.json"
    if not path.is_file():
        raise UserError(f"{root} has no fit; run `sparsecal fit {root}` first.")
    doc = read_json_manifest(path, FIT_KIND, f"run `sparsecal fit {root}` again")
    why = fit_values(doc)
    if why:
        raise UserError(f"{path}: {why}; run `sparsecal fit {root}` again.")
    return doc


