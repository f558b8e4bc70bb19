"""Running-max rescales and shortfall, and VFA's joint statistic, in `sparsecal fit`
(analysis/stabilization.py): the tables' numbers against the samples' own histograms read back,
the quantile and share rules against raw values, the console tables, and a run captured before
these statistics existed (fit still works and says so in one line each)."""
import json
import math

import numpy as np
import polars as pl
import pytest
import torch

from sparsecal.analysis import stabilization as S
from sparsecal.analysis.fit import FitRequest, fit_run
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.formats.run import JOINT_KEYS, JOINT_MISSING, RESCALE_KEYS, RESCALE_MISSING, SPARSE_KEYS, RunStore
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.formats.tensors import load_arrays, save_arrays

from helpers import cli

LENGTHS = [512, 1024]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, module_seed):
    root = tmp_path_factory.mktemp("stab") / "run"
    store = write_synthetic_run(root, LENGTHS, 2, layers=2, heads=3, seed=module_seed)
    doc = fit_run(store, FitRequest(targets=[0.5], holdout=0.5), warn=lambda line: None)
    return store, doc


def summed(store, key):
    """{length: the key summed over that length's samples (int64)}."""
    out = {}
    for sid in store.done_ids():
        rec, t = store.load_sample(sid, keys=(key,))
        out[rec["length"]] = out.get(rec["length"], 0) + np.asarray(t[key]).astype(np.int64)
    return out


def test_rescale_table_is_exact(fitted):
    store, doc = fitted
    assert {"stab_rescale", "stab_rescale_hist", "stab_shortfall", "stab_shortfall_hist"} <= set(doc["tables"])
    cfg = StatsConfig()
    counts, excess = summed(store, "rescale_count"), summed(store, "rescale_excess")
    tab = pl.read_parquet(store.root / "fit" / "stab_rescale.parquet")
    assert tab.height == len(LENGTHS) * 2 * 3 * len(cfg.orders)
    for r in tab.iter_rows(named=True):
        c = counts[r["length"]][r["layer"], r["head"], cfg.orders.index(r["order"])]
        ex = excess[r["length"]][r["layer"], r["head"], cfg.orders.index(r["order"])]
        want = ((np.arange(len(c)) * c).sum() + ex) / c.sum()
        assert r["rows"] == c.sum() and math.isclose(r["mean_rescales"], want, rel_tol=1e-12)
        assert math.isclose(r["share_zero"], c[0] / c.sum()) and r["open_rows"] == c[-1]
        assert r["q50"] == np.searchsorted(np.cumsum(c), 0.5 * c.sum())
    hist = pl.read_parquet(store.root / "fit" / "stab_rescale_hist.parquet")
    assert hist["rows"].sum() == sum(int(c.sum()) for c in counts.values())
    assert set(hist.filter(pl.col("open"))["rescales"]) == {cfg.rescale_bins - 1}


def test_shortfall_table_shares_and_quantiles(fitted):
    store, _ = fitted
    cfg = StatsConfig()
    counts = summed(store, "shortfall_count")
    tab = pl.read_parquet(store.root / "fit" / "stab_shortfall.parquet")
    assert set(tab["prefix"]) == {"first", "local"}
    for r in tab.head(40).iter_rows(named=True):
        c = counts[r["length"]][r["layer"], r["head"], cfg.orders.index(r["order"]), ("first", "local").index(r["prefix"])]
        assert math.isclose(r["share_zero"], c[0] / c.sum()) and math.isclose(r["share_above_range"], c[-1] / c.sum())
        assert r["q50"] <= r["q75"] <= r["q90"] <= r["q95"] <= cfg.shortfall_hi
    hist = pl.read_parquet(store.root / "fit" / "stab_shortfall_hist.parquet")
    zero = hist.filter(pl.col("bin_hi") == 0)
    assert (zero["bin_lo"] == 0).all() and zero["rows"].sum() == sum(int(c[..., 0].sum()) for c in counts.values())


def test_shortfall_quantiles_match_raw_values(np_rng):
    """Values binned as capture bins them (bucketize right=False: exact zeros in bin 0) give
    quantiles within one bin of the raw ones; a quantile inside the zero mass is exactly 0."""
    cfg = StatsConfig()
    edges = cfg.shortfall_edges()
    vals = np.concatenate([np.zeros(400), np_rng.exponential(2.0, 600)])
    idx = torch.bucketize(torch.from_numpy(vals), torch.from_numpy(edges), right=False).numpy()
    counts = np.bincount(idx, minlength=len(edges) + 1)
    got = S.shortfall_quantiles(counts, edges, (0.3, 0.5, 0.9))
    assert got[0] == 0.0
    assert np.all(np.abs(got[1:] - np.quantile(vals, (0.5, 0.9))) <= cfg.shortfall_step + 1e-9)
    frame = pl.DataFrame({"bin_lo": np.concatenate([[0.0], edges]), "bin_hi": np.concatenate([[0.0], edges[1:], [np.inf]]),
                          "rows": counts})
    assert abs(S.hist_median(frame) - got[1]) < 1e-9


def test_console_table_per_order(fitted, monkeypatch):
    store, _ = fitted
    res = cli("fit", str(store.root), "--targets", "0.5", "--holdout", "0.5")
    assert res.exit_code == 0, res.output
    text = res.stdout + res.stderr if hasattr(res, "stderr") else res.output
    assert "Running-max stabilization per scan order" in text and "rescales / row" in text
    rows = S.order_summary(pl.read_parquet(store.root / "fit" / "stab_rescale.parquet"),
                           pl.read_parquet(store.root / "fit" / "stab_shortfall_hist.parquet"))
    assert [r["order"] for r in rows] == list(StatsConfig().orders)
    assert all(0 <= r["first_share_zero"] <= 1 and r["mean_rescales"] > 0 for r in rows)


def make_old_run(root, seed):
    """A synthetic run as sparsecal 0.1.0 wrote it: no rescale arrays, no rescale config keys, no
    joint statistic."""
    store = write_synthetic_run(root, [512], 2, layers=1, heads=2, seed=seed)
    for folder in store.sample_dirs():
        arrays, meta = load_arrays(folder / "stats.safetensors")
        meta.pop("sparsecal.sparse", None)
        save_arrays(folder / "stats.safetensors", {k: v for k, v in arrays.items() if k not in RESCALE_KEYS + JOINT_KEYS},
                    sparse=SPARSE_KEYS, metadata=meta)
    man = json.loads((root / "manifest.json").read_text())
    for k in ("rescale_bins", "shortfall_hi", "shortfall_step"):
        man["config"].pop(k)
    (root / "manifest.json").write_text(json.dumps(man))
    return RunStore.open(root)


def test_old_run_fits_and_says_so(tmp_path, seed):
    store = make_old_run(tmp_path / "old", seed)
    doc = fit_run(store, FitRequest(targets=[0.5], holdout=0.5), warn=lambda line: None)
    for name in ("stab_rescale", "stab_rescale_hist", "stab_shortfall", "stab_shortfall_hist", "joint", "joint_hist"):
        assert name in doc["tables"] and pl.read_parquet(store.root / "fit" / f"{name}.parquet").height == 0
    assert pl.read_parquet(store.root / "fit" / "stab_where.parquet").height > 0
    res = cli("fit", str(store.root), "--targets", "0.5", "--holdout", "0.5")
    assert res.exit_code == 0, res.output
    text = res.stdout + res.stderr if hasattr(res, "stderr") else res.output
    lines = [x for x in text.splitlines() if RESCALE_MISSING in x]
    assert len(lines) == 1 and lines[0].startswith("Running-max stabilization per scan order")
    joint = [x for x in text.splitlines() if JOINT_MISSING in x]
    assert len(joint) == 1 and joint[0].startswith("VFA frozen max")


def test_joint_table_is_exact(fitted):
    """joint rows per length, layer and head: rows, the open bins and the shares at -1 / -5 / +5
    (edges of the default grid: exact sums of bins) from the samples' joint_count read back; the
    synthetic joint is the Q-init count with rows moved up, so its CDF lies below Q-init's."""
    store, doc = fitted
    assert {"joint", "joint_hist"} <= set(doc["tables"])
    edges = StatsConfig().qinit_edges()
    counts, qinit = summed(store, "joint_count"), summed(store, "qinit_count")
    tab = pl.read_parquet(store.root / "fit" / "joint.parquet")
    assert tab.height == len(LENGTHS) * 2 * 3
    edge = {x: int(np.searchsorted(edges, x)) for x in (-5.0, -1.0, 5.0)}  # bins 0..edge[x] lie below x
    for r in tab.iter_rows(named=True):
        c = counts[r["length"]][r["layer"], r["head"]]
        tot = c.sum()
        assert r["rows"] == tot and math.isclose(r["share_below_range"], c[0] / tot)
        assert math.isclose(r["share_above_range"], c[-1] / tot)
        assert math.isclose(r["share_below_1"], c[:edge[-1.0] + 1].sum() / tot)
        assert math.isclose(r["share_below_5"], c[:edge[-5.0] + 1].sum() / tot)
        assert math.isclose(r["share_above_5"], c[edge[5.0] + 1:].sum() / tot)
        q = qinit[r["length"]][r["layer"], r["head"]]
        assert (np.cumsum(c) <= np.cumsum(q)).all() and r["q50"] >= S.hist_quantiles(q, edges)[2] - 1e-9
    hist = pl.read_parquet(store.root / "fit" / "joint_hist.parquet")
    assert hist["rows"].sum() == sum(int(c.sum()) for c in counts.values())


def test_joint_shares_match_raw_values(np_rng):
    """Values binned as the capture bins them (bucketize right=True) give the raw shares below -1
    and -5 and above +5 exactly (edges), and within one bin elsewhere (linear inside a bin)."""
    edges = StatsConfig().qinit_edges()
    vals = np.concatenate([np_rng.normal(0.0, 4.0, 900), np.full(50, 30.0), np.full(50, -1.0)])
    counts = np.bincount(torch.bucketize(torch.from_numpy(vals), torch.from_numpy(edges), right=True).numpy(),
                         minlength=len(edges) + 1)
    for x in (-5.0, -1.0, 5.0):
        assert math.isclose(S.hist_share_below(counts, edges, x), (vals < x).mean())
    assert abs(S.hist_share_below(counts, edges, 0.6) - (vals < 0.6).mean()) <= counts.max() / counts.sum()
    assert np.isnan(S.hist_share_below(np.zeros_like(counts), edges, 0.0))


def test_joint_console_table_per_layer_band(tmp_path, seed):
    """fit prints VFA's joint statistic per layer band: bands of consecutive layers cover every
    layer once, their rows add up, and the shares are the joint table's row-weighted ones."""
    store = write_synthetic_run(tmp_path / "run", [512], 2, layers=7, heads=2, seed=seed)
    res = cli("fit", str(store.root), "--targets", "0.5", "--holdout", "0.5")
    assert res.exit_code == 0, res.output
    assert "VFA frozen max - true row max per layer band" in res.output
    joint = pl.read_parquet(store.root / "fit" / "joint.parquet")
    bands = S.joint_bands(joint, pl.read_parquet(store.root / "fit" / "joint_hist.parquet"))
    assert [b["layers"] for b in bands] == ["0-1", "2", "3", "4", "5", "6"]
    assert sum(b["rows"] for b in bands) == joint["rows"].sum()
    first = joint.filter(pl.col("layer") <= 1)
    want = float((first["share_below_1"] * first["rows"]).sum() / first["rows"].sum())
    assert math.isclose(bands[0]["share_below_1"], want) and -20 <= bands[0]["median"] <= 20
    for b in bands:
        assert b["layers"] in res.output and f"{b['share_above_5']:.4f}" in res.output
