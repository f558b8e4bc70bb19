"""BSFA decode thresholds calibrated on decode rows (analysis/bsfa_decode.py) and the retained mass
under the fitted thresholds: interpolation over positions, retained mass from the stored sorted
maxima against brute force, the fit on synthetic runs (exact and drawn), on a real small capture,
and on a run captured before the decode arrays existed."""
import math
import shutil

import numpy as np
import polars as pl
import pytest

from sparsecal.analysis import bsfa_decode as D
from sparsecal.analysis.fit import FitRequest, fit_run
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.formats.errors import UserError
from sparsecal.formats.run import RunStore
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.formats.tensors import load_arrays

from helpers import FIXTURE, cli, make_checkpoint, write_prompts

LENGTHS = [1024, 2048, 4096]


def test_interpolation_between_calibrated_positions():
    """Linear in position index between finite calibrated values, constant beyond the ends, -inf up to
    the last calibrated -inf position."""
    cal = np.array([2, 5, 9])
    vals = np.array([[1.0, 4.0, 0.0], [-np.inf, 2.0, 6.0], [-np.inf, -np.inf, -np.inf]])
    out = D.interpolate(vals, cal, 12)
    np.testing.assert_allclose(out[0], [1, 1, 1, 2, 3, 4, 3, 2, 1, 0, 0, 0])
    assert np.isneginf(out[1, :3]).all()
    np.testing.assert_allclose(out[1, 3:], [2, 2, 2, 3, 4, 5, 6, 6, 6])
    assert np.isneginf(out[2]).all()


def test_retained_mass_from_sorted_maxima_matches_brute_force(np_rng):
    """apply_thresholds from the stored top T (and their masses) against the full tiles: kept and
    skipped mass exact wherever the kept count fits in T, a bound (flagged) otherwise; -inf keeps all."""
    lead, x, kb, t_len = (2, 3), 6, 20, 5
    cand = np.array([0, 2, 5, 9, 14, 20])
    bmax = np_rng.normal(size=lead + (x, kb))
    mass = np_rng.uniform(size=lead + (x, kb)) / kb
    cmask = np.arange(kb)[None] < cand[:, None]
    order = np.argsort(-np.where(cmask, bmax, -np.inf), axis=-1)[..., :t_len]
    top = np.where(np.arange(t_len) < cand[:, None], np.take_along_axis(bmax, order, -1), -np.inf)
    tmass = np.where(np.isfinite(top), np.take_along_axis(mass, order, -1), 0.0)
    cmass = (mass * cmask).sum(-1)
    th = np.stack([np.full(lead + (x,), v) for v in (-np.inf, 0.5, 1.2, -3.0)])   # [K, L, H, X]
    kept, skipped, bound = D.apply_thresholds(th, top, tmass, cmass, cand)
    want_kept = ((bmax[None] >= th[..., None]) & cmask).sum(-1)
    want_skip = (mass[None] * ((bmax[None] < th[..., None]) & cmask)).sum(-1)
    flagged = (want_kept >= t_len) & (cand > t_len) & ~np.isneginf(th)   # all T stored maxima pass
    exact = ~flagged
    assert flagged.any() and exact.any()
    assert (kept[exact] == want_kept[exact]).all() and np.allclose(skipped[exact], want_skip[exact])
    assert (kept[~exact] <= want_kept[~exact]).all() and (skipped[~exact] >= want_skip[~exact] - 1e-12).all()
    assert list(bound) == list(flagged.sum(axis=(1, 2, 3)))
    assert (kept[0] == cand).all() and (skipped[0] == 0).all() and bound[0] == 0


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory):
    """Every position of every sample has the candidate maxima 0, -1, -2, ...: the fitted thresholds
    are each sample's own, so held-out measured density must equal predicted (prefill and decode)."""
    store = write_synthetic_run(tmp_path_factory.mktemp("exact") / "run", LENGTHS, 3, layers=2, heads=2,
                                seed=3, exact_bsfa=True)
    doc = fit_run(store, FitRequest(targets=[0.5]), warn=lambda line: None)
    return store, doc


def test_exact_synthetic_decode_density_equals_predicted(exact_run):
    store, doc = exact_run
    fit = store.root / "fit"
    arrays, _ = load_arrays(fit / "bsfa_thresholds.safetensors")
    cfg = StatsConfig.from_dict(store.manifest["config"])
    assert arrays["decode_thresholds"].shape == arrays["thresholds"].shape
    want_pos = sorted({r // cfg.block_m for n in LENGTHS for r in range(n - cfg.decode_rows, n)})
    assert arrays["decode_positions"].tolist() == want_pos
    for i, k in enumerate(doc["k_values"]):
        d = arrays["decode_thresholds"][i]
        assert np.isneginf(d).all() or np.allclose(d[np.isfinite(d)], -(k - 0.5))
    dec = pl.read_parquet(fit / "bsfa_decode.parquet")
    assert dec.height == len(LENGTHS) * len(doc["k_values"])
    np.testing.assert_allclose(dec["measured"], dec["predicted"], atol=1e-12)
    np.testing.assert_allclose(dec["retained_mass"], dec["retained_mass_topk"], atol=1e-6)
    dens = pl.read_parquet(fit / "bsfa_density.parquet")
    np.testing.assert_allclose(dens["measured"], dens["predicted"], atol=1e-12)
    ret = pl.read_parquet(fit / "bsfa_retained.parquet")
    assert set(ret["phase"]) == {"prefill", "decode"} and (ret["bound_positions"] == 0).all()


def test_drawn_synthetic_decode_density_close_to_predicted(tmp_path):
    """Candidate maxima drawn iid N(0, 1) per row: the pooled midpoint thresholds keep about k."""
    store = write_synthetic_run(tmp_path / "run", LENGTHS, 6, layers=2, heads=4, seed=5)
    doc = fit_run(store, FitRequest(targets=[0.5], holdout=0.5), warn=lambda line: None)
    dec = pl.read_parquet(store.root / "fit" / "bsfa_decode.parquet")
    assert (dec["measured"] - dec["predicted"]).abs().max() < 0.03
    ret = pl.read_parquet(store.root / "fit" / "bsfa_retained.parquet")
    assert ret["retained_mass"].is_between(0, 1).all()
    assert doc["k_values"] == list(StatsConfig().k_values)


def test_median_aggregation(tmp_path):
    store = write_synthetic_run(tmp_path / "run", LENGTHS[:2], 3, layers=1, heads=2, seed=7, exact_bsfa=True)
    fit_run(store, FitRequest(targets=[0.5], aggregation="median"), warn=lambda line: None)
    dec = pl.read_parquet(store.root / "fit" / "bsfa_decode.parquet")
    np.testing.assert_allclose(dec["measured"], dec["predicted"], atol=1e-12)


def test_old_run_without_decode_arrays_fits_and_says_recapture(tmp_path):
    """The committed fixture run predates the decode arrays: the fit works, warns once, writes no
    decode thresholds; asking for them is one line that says to capture again."""
    run = tmp_path / "old"
    shutil.copytree(FIXTURE, run, ignore=shutil.ignore_patterns("fit", "export", "results"))
    lines = []
    fit_run(RunStore.open(run), FitRequest(targets=[0.1], holdout=0.0), warn=lines.append)
    assert sum("capture it again" in line for line in lines) == 1
    arrays, _ = load_arrays(run / "fit" / "bsfa_thresholds.safetensors")
    assert "decode_thresholds" not in arrays
    assert pl.read_parquet(run / "fit" / "bsfa_decode.parquet").height == 0
    with pytest.raises(UserError, match="capture it again"):
        D.require_decode(None, str(run))


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_real_small_capture(tmp_path, seed):
    """A tiny random Llama captured on the reference backend: decode thresholds at the decode rows'
    positions, finite exactly where some row of the position has more than k candidates."""
    model = make_checkpoint(tmp_path / "tiny", seed)
    prompts = write_prompts(tmp_path / "p.jsonl", [300, 300, 420, 420], seed)
    res = cli("capture", "--model", model, "--prompts-file", prompts, "--out", tmp_path / "run",
              "--block-m", 64, "--block-n", 16, "--k", "1,2,4,32", "--decode-rows", 40)
    assert res.exit_code == 0, res.output
    store = RunStore.open(tmp_path / "run")
    doc = fit_run(store, FitRequest(targets=[0.005], holdout=0.5), warn=lambda line: None)
    arrays, _ = load_arrays(store.root / "fit" / "bsfa_thresholds.safetensors")
    pos = arrays["decode_positions"].tolist()
    assert pos == sorted({r // 64 for n in (300, 420) for r in range(n - 40, n)})
    for i, k in enumerate(doc["k_values"]):
        for p in pos:
            rows = [r for n in (300, 420) for r in range(n - 40, n) if r // 64 == p]
            finite = np.isfinite(arrays["decode_thresholds"][i, :, :, p])
            assert finite.all() == any(r // 16 > k for r in rows) and (finite.all() or not finite.any())
    dec = pl.read_parquet(store.root / "fit" / "bsfa_decode.parquet")
    assert dec.height == 2 * len(doc["k_values"]) and dec["measured"].is_between(0, 1).all()
    assert math.isclose(dec.filter(pl.col("k") == 32)["measured"].max(), 1.0)  # k = 32 >= every A_r
    out = cli("fit", store.root, "--targets", "0.005", "--holdout", "0.5")
    assert out.exit_code == 0 and "decode" in out.output
