"""sparsecal fit: known answers on synthetic runs, the BSFA in-sample property, and the tables."""
import json
import math

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecal.analysis import bsfa
from sparsecal.analysis.fit import FitRequest, fit_run
from sparsecal.analysis.samples import split_samples
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.formats.errors import UserError
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.reduce_reference import bsfa_reduce

from helpers import block_counts_torch

LENGTHS = [1024, 2048, 4096, 8192]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, module_seed):
    """4 samples per length, lambda = 300 / L for 50% prefill sparsity and 30 / L for decode."""
    root = tmp_path_factory.mktemp("syn") / "run"
    store = write_synthetic_run(root, LENGTHS, 4, layers=2, heads=8, a=300.0, a_decode=30.0, target=0.5,
                                seed=module_seed)
    doc = fit_run(store, FitRequest(targets=[0.5], holdout=0.25), warn=lambda line: None)
    return store, doc


def test_fit_recovers_the_law(synthetic):
    _, doc = synthetic
    by_mode = {c["mode"]: c for c in doc["blasst"]}
    for mode, a in (("prefill", 300.0), ("decode", 30.0)):
        c = by_mode[mode]
        assert c["a"] == pytest.approx(a, rel=0.1)  # ~4 standard errors of the 1K quantile
        assert c["power_law"]["b"] == pytest.approx(1.0, abs=0.05)
        assert c["law"]["r2"] > 0.99
        assert [p["length"] for p in c["per_length"] if p["in_fit"]] == LENGTHS


def test_held_out_sparsity_hits_target_and_fixed_drifts(synthetic):
    store, _ = synthetic
    ev = pl.read_parquet(store.root / "fit" / "blasst_eval.parquet").filter(pl.col("order") == "forward")
    cal = ev.filter(pl.col("method") == "a/L")
    assert cal.height == 2 * len(LENGTHS)  # one held-out sample per length and mode
    assert (cal["achieved"] - 0.5).abs().max() < 0.03
    fixed = ev.filter((pl.col("method") == "fixed") & (pl.col("mode") == "prefill")).sort("length")["achieved"]
    assert fixed[0] < 0.4 and fixed[-1] > 0.8  # one lambda for all lengths over- and under-shoots
    assert ((ev["retained_mass"] >= 0) & (ev["retained_mass"] <= 1)).all()


def test_bsfa_tables_predicted_tracks_measured(synthetic):
    store, doc = synthetic
    dens = pl.read_parquet(store.root / "fit" / "bsfa_density.parquet")
    assert set(dens["k"]) == set(doc["k_values"]) and set(dens["length"]) == set(LENGTHS)
    assert (dens["measured"] - dens["predicted"]).abs().max() < 0.1
    heads = pl.read_parquet(store.root / "fit" / "bsfa_heads.parquet")
    assert heads.height == len(doc["k_values"]) * len(LENGTHS) * 2 * 8
    # density is monotone in k at every length
    for n in LENGTHS:
        d = dens.filter(pl.col("length") == n).sort("k")["measured"].to_numpy()
        assert np.all(np.diff(d) >= -1e-12)


def test_every_table_written_and_nonempty(synthetic):
    store, doc = synthetic
    for name in doc["tables"]:
        df = pl.read_parquet(store.root / "fit" / f"{name}.parquet")
        assert df.height > 0, name
    where = pl.read_parquet(store.root / "fit" / "stab_where.parquet")
    assert set(where["order"]) == set(StatsConfig().orders)
    q = pl.read_parquet(store.root / "fit" / "qinit.parquet")
    assert (q["q05"] <= q["q50"]).all() and (q["q50"] <= q["q95"]).all()


def test_split_is_per_length_and_deterministic(synthetic):
    store, doc = synthetic
    recs = [r for r in store.manifest["samples"]]
    a, b = split_samples(recs, 0.25, seed=3), split_samples(recs, 0.25, seed=3)
    assert a == b
    assert sorted(r["length"] for r in a.test) == LENGTHS
    assert not {r["id"] for r in a.test} & {r["id"] for r in a.train}
    assert set(doc["split"]["test"]).isdisjoint(doc["split"]["train"])


def _random_sample_thresholds(rng, n, cfg, heads=3):
    """Thresholds, top maxima and candidates from the capture reduction on random block maxima."""
    cand, _ = block_counts_torch(n, cfg.block_m, cfg.block_n)
    kb = -(-n // cfg.block_n)
    bmax = torch.from_numpy(rng.standard_normal((heads, len(cand), kb))).float()
    mass = torch.from_numpy(rng.random((heads, len(cand), kb))).float()
    r = bsfa_reduce(bmax, mass, cand, cfg)
    return r["bsfa_threshold"].numpy()[None], r["bsfa_top_bmax"].numpy()[None], cand


@pytest.mark.parametrize("n", [700, 2048, 3000])
def test_thresholds_applied_back_keep_min_k_a(seed, n):
    """Fitted on one sample and applied back to it, BSFA keeps exactly min(k, A_i) per position."""
    cfg = StatsConfig(k_values=(1, 4, 8, 16, 40))
    thr, top, cand = _random_sample_thresholds(np.random.default_rng(seed), n, cfg)
    acc = bsfa.ThresholdAccumulator("mean")
    acc.add(thr)
    kept, saturated = bsfa.measured_kept(acc.result(), top, cand)
    want = np.minimum(np.array(cfg.k_values)[:, None], cand[None, :])  # [K, P]
    assert np.array_equal(kept, np.broadcast_to(want[:, None, None, :], kept.shape))
    assert not saturated.any()


def test_unseen_positions_take_the_last_threshold(seed):
    cfg = StatsConfig(k_values=(2, 4))
    rng = np.random.default_rng(seed)
    acc = bsfa.ThresholdAccumulator("median")
    short, _, _ = _random_sample_thresholds(rng, 500, cfg)
    long_, _, _ = _random_sample_thresholds(rng, 1500, cfg)
    acc.add(short)
    acc.add(long_)
    out = acc.result(num_blocks=20)
    p_short, p_long = short.shape[2], long_.shape[2]
    long_t = np.moveaxis(long_, -1, 0)
    assert np.array_equal(out[..., p_short:p_long], long_t[..., p_short:])  # only the long sample there
    assert np.array_equal(out[..., p_long:], np.repeat(long_t[..., -1:], 20 - p_long, -1))
    mid = np.median(np.stack([np.moveaxis(short, -1, 0), long_t[..., :p_short]]), axis=0)
    assert np.allclose(out[..., :p_short], mid)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4000), st.integers(0, 2**31 - 1))
def test_density_monotone_in_k(n, s):
    cfg = StatsConfig(k_values=(1, 2, 3, 5, 8, 13, 21))
    thr, top, cand = _random_sample_thresholds(np.random.default_rng(s), n, cfg, heads=2)
    other, _, _ = _random_sample_thresholds(np.random.default_rng(s + 1), n, cfg, heads=2)
    acc = bsfa.ThresholdAccumulator()
    acc.add(other)  # thresholds of another sample, applied to this one
    _, reach = block_counts_torch(n, cfg.block_m, cfg.block_n)
    d = bsfa.density(bsfa.measured_kept(acc.result(), top, cand)[0], cand, reach.numpy())
    assert np.all(np.diff(d, axis=0) >= 0)
    assert np.all(np.diff(bsfa.predicted_density(cand, reach.numpy(), cfg.k_values)) >= 0)


def test_unreachable_lengths_warn_and_unreachable_targets_refuse(tmp_path, seed):
    store = write_synthetic_run(tmp_path / "run", [1024, 4096], 2, layers=1, heads=2, a=3000.0, target=0.7, seed=seed)
    warnings = []
    doc = fit_run(store, FitRequest(targets=[0.6], holdout=0), warn=warnings.append)
    assert any("1024 tokens reach at most" in w for w in warnings)
    pre = next(c for c in doc["blasst"] if c["mode"] == "prefill")
    assert [p["length"] for p in pre["per_length"] if p["in_fit"]] == [4096]
    with pytest.raises(UserError, match="out of reach at every length"):
        fit_run(store, FitRequest(targets=[0.99], holdout=0), warn=lambda line: None)


def test_request_errors(tmp_path, seed):
    store = write_synthetic_run(tmp_path / "run", [1024], 1, layers=1, heads=1, seed=seed)
    with pytest.raises(UserError, match="too few samples for a hold-out split"):
        fit_run(store, FitRequest(holdout=0.25), warn=lambda line: None)
    with pytest.raises(UserError, match="k 12 was not captured"):
        fit_run(store, FitRequest(k_values=[12], holdout=0), warn=lambda line: None)
    with pytest.raises(UserError, match="strictly between 0 and 1"):
        fit_run(store, FitRequest(targets=[1.5], holdout=0), warn=lambda line: None)
    warnings = []
    fit_run(store, FitRequest(k_values=[64], targets=[0.1], holdout=0), warn=warnings.append)
    assert any("k=64 keeps every candidate" in w for w in warnings)
    thr = json.loads((store.root / "fit" / "fit.json").read_text())
    assert thr["k_values"] == [64] and thr["validation"] == "in-sample"
    assert math.isnan(pl.read_parquet(store.root / "fit" / "bsfa_density.parquet")["measured_std"][0])


def test_hist_quantiles_match_raw_values(seed):
    from sparsecal.analysis.stabilization import hist_quantiles
    from sparsecal.kernels.capture.reduce_reference import histogram

    rng = np.random.default_rng(seed)
    edges = StatsConfig().qinit_edges()
    vals = rng.normal(2.0, 3.0, (2, 20000))
    counts = histogram(torch.from_numpy(vals), edges).numpy()
    q = hist_quantiles(counts, edges)
    want = np.quantile(vals, [0.05, 0.25, 0.5, 0.75, 0.95], axis=1).T
    assert np.abs(q - want).max() < 0.25 + 0.1  # one bin width plus sampling noise
    assert np.isnan(hist_quantiles(np.zeros((1, len(edges) + 1)), edges)).all()
