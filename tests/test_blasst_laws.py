"""The three BLASST lambda laws on synthetic runs with known parameters, saturation in the histogram
math, and what the export records about where the deployed law holds."""
import json
import math

import numpy as np
import polars as pl
import pytest
import torch
from typer.testing import CliRunner

from sparsecal.analysis.blasst import skipped
from sparsecal.analysis.fit import FitRequest, fit_run
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.cli import app
from sparsecal.formats.exports import blasst_min_length, blasst_validity, load_blasst
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.reduce_reference import histogram

EDGES = StatsConfig().gap_edges()
LENGTHS = [2048, 4096, 8192, 16384]
TARGETS = [0.3, 0.5, 0.7]
runner = CliRunner()


def test_saturation_matches_the_kernel_comparison(seed):
    """gap < ln(lambda): at ln(lambda) = 0 every gap < 0 tile and no gap == 0 tile; at any
    ln(lambda) > 0 every tile; nothing is clamped to 'just under 1'."""
    rng = np.random.default_rng(seed)
    gaps = np.concatenate([-rng.exponential(3.0, 4000), np.zeros(250)])
    counts = histogram(torch.as_tensor(gaps)[None], EDGES)[0].numpy()
    assert skipped(counts, EDGES, 0.0) == np.sum(gaps < 0.0) == 4000
    for x in (1e-9, 0.3, 5.0):
        assert skipped(counts, EDGES, x) == np.sum(gaps < x) == 4250
    assert skipped(counts, EDGES, -math.inf) == 0


@pytest.fixture(scope="module")
def law_runs(tmp_path_factory, module_seed):
    """Two synthetic runs whose lambda_best(S, L) = A exp(B S) L^-b exactly (up to sampling): b = 1
    (all three laws hold) and b = 1.5 (only the power law does)."""
    out = {}
    for b in (1.0, 1.5):
        root = tmp_path_factory.mktemp(f"law{b}") / "run"
        law = (2.0 * 2048 ** (b - 1.0), 4.0, b)  # lambda_best at 2K is the same for both runs
        store = write_synthetic_run(root, LENGTHS, 4, layers=2, heads=8, seed=module_seed, law=law)
        out[b] = (store, fit_run(store, FitRequest(targets=TARGETS), warn=lambda line: None), law)
    return out


def test_each_law_recovers_its_parameters(law_runs):
    store, doc, (big_a, big_b, _) = law_runs[1.0]
    fits = pl.read_parquet(store.root / "fit" / "blasst_fit.parquet").filter(pl.col("order") == "forward")
    for c in doc["blasst"]:
        laws, a_s = c["laws"], big_a * math.exp(big_b * c["target"])
        assert laws["a/L"]["a"] == pytest.approx(a_s, rel=0.1) and laws["a/L"]["r2"] > 0.99
        assert laws["power"]["b"] == pytest.approx(1.0, abs=0.05) and laws["power"]["r2"] > 0.99
        assert laws["exp"]["A"] == pytest.approx(big_a, rel=0.15) and laws["exp"]["B"] == pytest.approx(big_b, abs=0.3)
        assert laws["exp"]["r2"] > 0.99 and c["deployed"]["law"] == "a/L"
        assert c["deployed"]["validated_lengths"] == LENGTHS and c["deployed"]["min_length"] == LENGTHS[0]
    assert set(fits["law"]) == {"a/L", "power", "exp"} and fits.filter(pl.col("deployed"))["law"].unique().to_list() == ["a/L"]
    assert (fits["heldout_max_abs_error"] < 0.05).all()


def test_a_wrong_law_shows_in_r2_and_held_out_error(law_runs):
    """b = 1.5: the power law recovers b and hits the target on held-out samples; a/L (b fixed to 1)
    has a lower R^2 and misses the target at the ends of the length range."""
    store, doc, (big_a, big_b, b) = law_runs[1.5]
    ev = pl.read_parquet(store.root / "fit" / "blasst_eval.parquet").filter(pl.col("order") == "forward")
    for c in doc["blasst"]:
        assert c["laws"]["power"]["b"] == pytest.approx(b, abs=0.05)
        assert c["laws"]["power"]["r2"] > 0.99 > c["laws"]["a/L"]["r2"]
    err = ev.group_by("method").agg(pl.col("error").abs().max()).sort("method")
    worst = dict(zip(err["method"], err["error"]))
    assert worst["power"] < 0.05 < worst["a/L"]
    cand = ev.filter(pl.col("method") == "power")
    assert ((cand["achieved_candidates"] >= cand["achieved"]) & (cand["achieved_candidates"] <= 1)).all()


def test_curves_report_candidate_sparsity(law_runs):
    store, _, _ = law_runs[1.0]
    cur = pl.read_parquet(store.root / "fit" / "blasst_curves.parquet")
    assert ((cur["sparsity_candidates"] * cur["candidate_share"] - cur["sparsity"]).abs() < 1e-9).all()


def test_export_records_where_the_law_holds(tmp_path):
    """validity per target and phase round-trips through blasst.json; export warns in one line per
    target and phase naming the length below which sparsify runs dense; report.txt says it."""
    run, out = tmp_path / "run", tmp_path / "export"
    write_synthetic_run(run, [1024, 2048, 4096], 3, layers=2, heads=4, a=300.0, a_decode=30.0, target=0.5)
    assert runner.invoke(app, ["fit", str(run), "--targets", "0.5,0.9"]).exit_code == 0
    res = runner.invoke(app, ["export", str(run), "--out", str(out), "--target", "0.5"])
    assert res.exit_code == 0, res.output
    doc = load_blasst(out)
    fit = json.loads((run / "fit" / "fit.json").read_text())
    for c in fit["blasst"]:
        v = blasst_validity(doc, c["mode"], c["target"])
        assert v["validated_lengths"] == [p["length"] for p in c["per_length"] if p["in_fit"]]
        assert blasst_min_length(doc, c["mode"], c["target"]) == v["min_length"]
    assert doc["validity"] == doc["targets"][0]["validity"] and "runs dense" in doc["length_policy"]
    assert "laws" in doc["fit"]["prefill"] and "held_out" in doc["fit"]["prefill"]
    a9 = next(e for e in doc["targets"] if e["target_sparsity"] == 0.9)["threshold_scale_factor"]["prefill"]
    text = " ".join(res.output.split())
    assert f"BLASST target 0.9 prefill: a/L (a = {a9:.4g}) holds on" in text
    below = max(math.ceil(a9), blasst_min_length(doc, "prefill", 0.9))
    assert f"sparsify runs prefill dense below {below} tokens" in text
    assert "Lengths (the sparsecal rows apply this policy" in (out / "report.txt").read_text()


def test_engine_export_carries_the_lengths(tmp_path):
    """engine.json records per phase the validated lengths and dense_below; the text files say it in
    their header; engine_lambda (for serving-side readers) applies the runtime policy."""
    from sparsecal.formats import engine_files as F

    run, out = tmp_path / "run", tmp_path / "export"
    cfg = StatsConfig(block_m=128, block_n=128, orders=("forward",))
    write_synthetic_run(run, [1024, 2048, 4096], 3, layers=2, heads=4, a=300.0, a_decode=30.0, target=0.5, cfg=cfg)
    assert runner.invoke(app, ["fit", str(run), "--targets", "0.5,0.7"]).exit_code == 0
    res = runner.invoke(app, ["export", str(run), "--out", str(out), "--format", "all", "--target", "0.5"])
    assert res.exit_code == 0, res.output
    man = F.load_engine_manifest(out)
    v = man["validity"]["prefill"]
    assert v["min_length"] == 1024 and v["dense_below"] == max(1024, math.ceil(man["factors"]["prefill"]))
    assert "Validated lengths: prefill 1024-4096 tokens" in (out / "trtllm.yaml").read_text()
    assert F.engine_lambda(man, "prefill", 512) is None
    assert F.engine_lambda(man, "prefill", 4096) == pytest.approx(man["factors"]["prefill"] / 4096)
    assert F.load_modelopt(out)["calibration"]["validity"]["prefill"]["min_length"] == 1024
    for fmt in F.LOADERS:
        F.LOADERS[fmt](out)
