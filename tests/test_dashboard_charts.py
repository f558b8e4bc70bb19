"""Dashboard chart builders (DataFrame -> plotly Figure), the derived frames they draw, and the
Accuracy-speedup result format: on the committed fixture run's own tables and on small frames
with known contents."""
import json
import math
import re

import numpy as np
import plotly.graph_objects as go
import polars as pl
import pytest

from sparsecal.analysis.tables import read_table
from sparsecal.dashboard import charts_fit, charts_run, derive
from sparsecal.formats import geometry, results
from sparsecal.formats.geometry import num_candidates, num_reachable

from helpers import FIXTURE

FIT = FIXTURE / "fit"


def _gap_cum():
    from sparsecal.dashboard import data

    return data.gap_cum(FIXTURE)


def _is_empty(fig: go.Figure) -> bool:
    return not fig.data and any("no data" in a.text or "nothing" in a.text or "no " in a.text
                                for a in fig.layout.annotations)


def test_density_vs_length_has_measured_and_predicted_per_k():
    df = read_table(FIT, "bsfa_density")
    fig = charts_fit.density_vs_length(df)
    names = [t.name for t in fig.data]
    for k in sorted(set(df["k"])):
        assert f"k={k} measured" in names and f"k={k} predicted" in names
    meas = next(t for t in fig.data if t.name == "k=1 measured")
    want = df.filter(pl.col("k") == 1).sort("length")
    assert list(meas.x) == want["length"].to_list()
    np.testing.assert_allclose(meas.y, want["measured"].to_numpy())
    assert fig.layout.xaxis.type == "log"
    assert _is_empty(charts_fit.density_vs_length(df.clear()))


def test_layer_head_heatmap_puts_each_value_at_its_layer_and_head():
    df = pl.DataFrame({"layer": [1, 1, 3], "head": [0, 1, 1], "v": [0.1, 0.2, 0.9]})
    fig = charts_fit.layer_head_heatmap(df, "v", "t")
    z = np.array(fig.data[0].z, dtype=float)
    assert z.shape == (2, 2) and list(fig.data[0].y) == ["1", "3"]  # a row per layer present (captured)
    assert z[0, 1] == pytest.approx(0.2) and z[1, 1] == pytest.approx(0.9)
    assert math.isnan(z[1, 0])  # missing pairs stay blank
    assert fig.layout.yaxis.autorange == "reversed"
    hybrid = charts_fit.layer_head_heatmap(df, "v", "t", layer_types=["sliding_attention", "full_attention"] * 2)
    assert list(hybrid.data[0].y) == ["1 full", "3 full"]


def test_sparsity_curves_one_line_per_length_and_mode_marks():
    curves = read_table(FIT, "blasst_curves").filter((pl.col("mode") == "prefill") & (pl.col("order") == "forward"))
    marks = pl.DataFrame({"length": [256, 512], "lambda": [0.5, None]}, schema={"length": pl.Int64, "lambda": pl.Float64})
    fig = charts_fit.sparsity_curves(curves, marks)
    lines = [t for t in fig.data if t.mode == "lines"]
    assert len(lines) == 2 * 2  # sparsity and retained mass per length
    first = lines[0]
    d = curves.filter(pl.col("length") == 256).sort("log_lambda")
    np.testing.assert_allclose(first.x, np.exp(d["log_lambda"].to_numpy()))
    assert [t for t in fig.data if t.mode == "markers"], "the calibrated lambda is marked"
    assert _is_empty(charts_fit.sparsity_curves(curves.clear()))


def test_lambda_law_draws_points_both_laws_and_residuals():
    lam = read_table(FIT, "blasst_lambda").filter((pl.col("mode") == "decode") & (pl.col("order") == "forward")
                                                 & (pl.col("target") == 0.1))
    fits = read_table(FIT, "blasst_fit").filter((pl.col("mode") == "decode") & (pl.col("order") == "forward")
                                               & (pl.col("target") == 0.1))
    fig = charts_fit.lambda_law(lam, fits)
    names = " ".join(t.name or "" for t in fig.data)
    assert "a/L" in names and "a·L^-b" in names and "lambda_best" in names
    a = float(fits.filter(pl.col("law") == "a/L")["a"][0])
    law = next(t for t in fig.data if (t.name or "").startswith("a/L"))
    np.testing.assert_allclose(np.array(law.y) * np.array(law.x), a, rtol=1e-9)  # lambda * L = a
    res = next(t for t in fig.data if t.name == "residual a/L")
    pts = lam.filter(pl.col("in_fit")).sort("length")
    np.testing.assert_allclose(res.y, np.log(pts["lambda_best"].to_numpy()) - np.log(a / pts["length"].to_numpy()))
    # a target no length reaches: a message instead of a chart
    none = lam.with_columns(pl.lit(None, pl.Float64).alias("lambda_best"))
    assert _is_empty(charts_fit.lambda_law(none, fits))


def test_table5_bars_are_sample_means_with_the_target_line():
    ev = read_table(FIT, "blasst_eval").filter((pl.col("mode") == "prefill") & (pl.col("order") == "forward")
                                              & (pl.col("target") == 0.03))
    fig = charts_fit.table5(ev, 0.03)
    bars = {t.name: t for t in fig.data}
    assert set(bars) == {"a/L", "fixed"}
    for method, bar in bars.items():
        want = ev.filter(pl.col("method") == method).group_by("length").agg(pl.col("achieved").mean()).sort("length")
        np.testing.assert_allclose(bar.y, want["achieved"].to_numpy())
    assert any(s.y0 == pytest.approx(0.03) for s in fig.layout.shapes)


def test_where_shares_sum_to_one_per_order():
    df = read_table(FIT, "stab_where")
    fig = charts_fit.where_shares(df)
    assert [t.name for t in fig.data] == ["sink", "diagonal", "middle"]
    total = np.sum([np.array(t.y, dtype=float) for t in fig.data], axis=0)
    np.testing.assert_allclose(total, 1.0)
    sink = df.filter(pl.col("order") == "forward").select(pl.col("sink").sum()).item()
    allrows = df.filter(pl.col("order") == "forward").select(pl.sum_horizontal("sink", "diagonal", "middle").sum()).item()
    assert fig.data[0].y[list(fig.data[0].x).index("forward")] == pytest.approx(sink / allrows)


def test_tstar_and_qinit_histograms_are_shares():
    fig = charts_fit.tstar_distribution(read_table(FIT, "stab_tstar"))
    assert len(fig.data) == 3
    for t in fig.data:
        assert sum(t.y) == pytest.approx(1.0)
        assert 0.0 <= min(t.x) and max(t.x) <= 1.0
    q = read_table(FIT, "qinit_hist")
    fig = charts_fit.qinit_histogram(q, clip=10.0)
    assert sum(fig.data[0].y) == pytest.approx(1.0)
    assert max(abs(x) for x in fig.data[0].x) <= 10.0


def test_samples_chart_counts_finished_and_planned():
    man = json.loads((FIXTURE / "manifest.json").read_text())
    done = [json.loads(p.read_text()) for p in (FIXTURE / "samples").glob("*/sample.json")]
    prompts = derive.prompts_frame(man, done[:-1])  # pretend the last one is unfinished
    assert prompts.height == 8 and prompts["finished"].sum() == 7
    fig = charts_run.samples_chart(prompts)
    assert sum(sum(t.y) for t in fig.data) == 8
    assert any("planned" in t.name for t in fig.data)


def test_tile_kinds_match_the_definitions():
    for n, bm, bn in ((512, 128, 64), (333, 128, 64), (700, 80, 48), (64, 128, 64)):
        kind = geometry.tile_kinds(n, bm, bn)
        assert kind.shape == (-(-n // bm), -(-n // bn))
        for i in range(kind.shape[0]):
            reach = num_reachable(i, n, bm, bn)
            cand = min(num_candidates(i, bm, bn), reach)
            assert (kind[i, :cand] == 1).all() and (kind[i, cand:reach] == 2).all() and (kind[i, reach:] == 0).all()


def test_tile_frame_masks_follow_threshold_and_lambda(np_rng):
    p, kb = 4, 8
    rng = np_rng
    tiles = {"bmax": rng.normal(size=(p, kb)), "mass": rng.uniform(size=(p, kb)),
             "gap": -rng.exponential(size=(3, p, kb))}
    thr = np.array([-np.inf, 0.0, 0.5])  # position 3 uses the last threshold
    f = derive.tile_frame(tiles, 512, 128, 64, 1, thr, math.log(0.5))
    assert f.height == p * kb
    kind = geometry.tile_kinds(512, 128, 64)
    for r in f.iter_rows(named=True):
        i, j = r["q_block"], r["k_block"]
        cand = kind[i, j] == 1
        assert r["bsfa_skip"] == (cand and tiles["bmax"][i, j] < thr[min(i, 2)])
        assert r["blasst_skip"] == (cand and tiles["gap"][1, i, j] < math.log(0.5))
        assert (r["bmax"] is None) == (kind[i, j] == 0)
    s = derive.mask_summary(f)
    assert s["reachable"] == int((kind > 0).sum())
    assert s["bsfa_sparsity"] == pytest.approx(f["bsfa_skip"].sum() / s["reachable"])
    fig = charts_run.tiles_figure(f, "gap")
    assert fig.data[0].type == "heatmap"
    z = np.array(fig.data[0].z, dtype=float)
    assert np.isnan(z[kind == 0]).all() and np.allclose(z[kind > 0], tiles["gap"][1][kind > 0])
    overlay = np.nan_to_num(np.array(fig.data[1].z, dtype=float))  # 1 BSFA, 2 BLASST, 3 both
    for r in f.iter_rows(named=True):
        assert overlay[r["q_block"], r["k_block"]] == r["bsfa_skip"] + 2 * r["blasst_skip"]
    legend = {t.name.split(" (")[0]: int(t.name.split("(")[1][:-1]) for t in fig.data[2:]}
    assert legend.get("BSFA skips", 0) == f["bsfa_skip"].sum() and legend.get("BLASST skips", 0) == f["blasst_skip"].sum()
    assert len(charts_run.tiles_figure(f, "mass", show_bsfa=False, show_blasst=False).data) == 1


def test_head_sparsity_from_gap_cum_matches_the_fit_at_the_calibrated_lambda():
    """The per-head view at any lambda (gap_cum) agrees with the fit's own per-head table at the
    calibrated lambda, up to the 0.25 grid of ln(lambda): check at a law lambda on the grid."""
    gc = _gap_cum()["prefill"]
    x = float(gc.log_lambda[-3])  # ln lambda = -0.5
    d = derive.head_sparsity_frame(gc, 512, "forward", x + 0.01)
    assert d["log_lambda"][0] == pytest.approx(x)
    li = list(gc.lengths).index(512)
    want = gc.count_below[li, 7, 4, 0, -3] / gc.reach[li]
    got = d.filter((pl.col("layer") == 7) & (pl.col("head") == 4))["sparsity"][0]
    assert got == pytest.approx(float(want))
    assert d.height == 30 * 9 and d["sparsity"].is_between(0, 1).all()
    assert d["retained_mass"].is_between(0, 1.0 + 1e-6).all()
    fig = charts_fit.layer_head_heatmap(d, "sparsity", "t", 0, 1)
    assert np.array(fig.data[0].z).shape == (30, 9)


def test_law_lambda_and_thresholds_frame():
    fits = read_table(FIT, "blasst_fit")
    a = float(fits.filter((pl.col("mode") == "prefill") & (pl.col("order") == "forward") & (pl.col("target") == 0.03)
                          & (pl.col("law") == "a/L"))["a"][0])
    assert derive.law_lambda(fits, "prefill", "forward", 0.03, 512) == pytest.approx(a / 512)
    assert derive.law_lambda(fits, "prefill", "forward", 0.99, 512) is None
    thr = np.full((2, 3, 4, 5), -np.inf, np.float32)
    thr[1, 2, 3, 4] = 1.5
    f = derive.thresholds_frame(thr, [1, 2], 2, 2)
    assert f.height == 4 * 5 and f["threshold"].null_count() == 19
    assert f.filter(pl.col("threshold").is_not_null()).row(0) == (3, 4, 1.5)
    fig = charts_run.thresholds_heatmap(f, 2, 2)
    assert np.array(fig.data[0].z, dtype=float)[3, 4] == 1.5


def test_results_join_eval_and_bench_rows_and_refuse_bad_files(tmp_path):
    pl.DataFrame({"method": ["bsfa", "bsfa", "blasst"], "config": ["k=2", "k=2", "target=0.5"],
                  "length": [512, 512, 512], "task": ["a", "b", "a"],
                  "accuracy_rel_dense": [0.9, 1.0, 0.8]}).write_parquet(tmp_path / "eval.parquet")
    (tmp_path / "bench.json").write_text(json.dumps({"kind": "sparsecal-bench", "provenance": {}, "rows": [
        {"method": "bsfa", "config": "k=2", "length": 512, "speedup": 1.5, "sparsity": 0.4},
        {"method": "blasst", "config": "target=0.7", "length": 512, "speedup": 2.0}]}))
    (tmp_path / "bad.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "notes.txt").write_text("ignored")
    files = results.result_files([tmp_path, tmp_path / "absent"])
    assert [p.name for p in files] == ["bad.json", "bench.json", "eval.parquet"]
    with pytest.raises(results.UserError, match="not a result file"):
        results.read_result_file(tmp_path / "bad.json")
    pts = results.curves([results.read_result_file(p) for p in files[1:]])
    row = pts.filter(pl.col("method") == "bsfa").row(0, named=True)
    assert row["accuracy_rel_dense"] == pytest.approx(0.95) and row["speedup"] == 1.5 and row["sparsity"] == 0.4
    assert row["sources"] == "bench.json, eval.parquet"
    assert pts.height == 3
    fig = charts_run.accuracy_speedup(pts)
    assert sum(len(t.x) for t in fig.data if t.name not in ("dense", "Pareto front")) == 1  # only bsfa k=2 has both
    assert _is_empty(charts_run.accuracy_speedup(results.curves([])))


def test_pareto_front_per_length():
    from sparsecal.dashboard.derive import pareto_front

    pts = pl.DataFrame({"method": ["bsfa", "bsfa", "blasst", "window", "bsfa"],
                        "config": ["k=4", "k=8", "target=0.5", "blocks=2", "k=4"],
                        "length": [512, 512, 512, 512, 1024], "speedup": [2.0, 1.5, 1.5, 1.2, 1.1],
                        "accuracy_rel_dense": [0.7, 0.9, 0.8, 0.9, 0.5]})
    front = pareto_front(pts)  # blasst is beaten by bsfa k=8, window by bsfa k=8; 1024 stands alone
    assert sorted(zip(front["length"], front["config"])) == [(512, "k=4"), (512, "k=8"), (1024, "k=4")]
    fig = charts_run.accuracy_speedup(pts.with_columns(pl.lit(None, pl.Float64).alias("sparsity")))
    ring = next(t for t in fig.data if t.name == "Pareto front")
    assert sorted(zip(ring.x, ring.y)) == [(1.1, 0.5), (1.5, 0.9), (2.0, 0.7)]


def test_export_lambda_chart_from_blasst_json():
    doc = json.loads((FIXTURE / "export" / "blasst.json").read_text())
    per = pl.DataFrame([{k: r.get(k) for k in ("mode", "length", "lambda", "lambda_best")} for r in doc["per_length"]])
    fig = charts_run.export_lambda_chart(per)
    modes = {r["mode"] for r in doc["per_length"]}
    assert len(fig.data) == 2 * len(modes)
    exported = next(t for t in fig.data if t.name == "prefill: exported")
    f = doc["threshold_scale_factor"]["prefill"]
    np.testing.assert_allclose(np.array(exported.y) * np.array(exported.x), f, rtol=1e-9)


def test_accuracy_speedup_error_bars_from_the_interval(tmp_path):
    """An evaluation row's 95% interval becomes an asymmetric error bar on its point."""
    (tmp_path / "eval.json").write_text(json.dumps({"kind": "sparsecal-eval", "rows": [
        {"method": "bsfa", "config": "k=2", "length": 512, "accuracy_rel_dense": 0.9,
         "accuracy_rel_dense_lo": 0.8, "accuracy_rel_dense_hi": 0.95}]}))
    (tmp_path / "bench.json").write_text(json.dumps({"kind": "sparsecal-bench", "rows": [
        {"method": "bsfa", "config": "k=2", "length": 512, "speedup": 1.5}]}))
    pts = results.curves([results.read_result_file(p) for p in results.result_files([tmp_path])])
    trace = next(t for t in charts_run.accuracy_speedup(pts).data if t.name == "bsfa @ 512")
    assert trace.error_y.array == pytest.approx((0.05,)) and trace.error_y.arrayminus == pytest.approx((0.1,))
    assert trace.error_x.array is None   # the bench speedup has no interval
    # a timed point's speedup interval (the page aliases the chosen speed's _lo/_hi) is the horizontal bar
    timed = pts.with_columns(pl.lit(1.4).alias("speedup_lo"), pl.lit(1.7).alias("speedup_hi"))
    trace = next(t for t in charts_run.accuracy_speedup(timed).data if t.name == "bsfa @ 512")
    assert trace.error_x.array == pytest.approx((0.2,)) and trace.error_x.arrayminus == pytest.approx((0.1,))


def test_two_evaluations_and_two_splits_are_never_one_point(tmp_path):
    """The same (method, config, length) from two result directories, or from the seen and the
    held-out task families of one, stays apart: a chart point is one directory's rows of one split."""
    for name, acc in (("old", 0.5), ("new", 0.9)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"kind": "sparsecal-eval", "rows": [
            {"method": "bsfa", "config": "k=2", "length": 512, "accuracy_rel_dense": acc, "speedup": 1.2,
             **({"split": "seen"} if name == "new" else {})},
            *([{"method": "bsfa", "config": "k=2", "length": 512, "accuracy_rel_dense": 0.7, "speedup": 1.2,
                "split": "held-out"}] if name == "new" else [])]}))
    pts = results.curves([results.read_result_file(p) for p in results.result_files([tmp_path / "old", tmp_path / "new"])])
    got = {(r["origin"], r["split"]): r["accuracy_rel_dense"] for r in pts.to_dicts()}
    assert got == {("old", None): 0.5, ("new", "seen"): 0.9, ("new", "held-out"): 0.7}


@pytest.mark.parametrize("col, value, says", [
    ("speedup", float("nan"), "speedup must be finite and > 0; row 1 holds nan"),
    ("speedup", -1.2, "speedup must be finite and > 0; row 1 holds -1.2"),
    ("accuracy_rel_dense", float("inf"), "accuracy_rel_dense must be finite and >= 0; row 1 holds inf"),
    ("sparsity", 1.5, "sparsity must be in [0, 1]; row 1 holds 1.5"),
    ("speedup_tpot_graph", 0.0, "speedup_tpot_graph must be finite and > 0"),
    ("length", 0, "length must be finite and >= 1"),
    ("speedup_ttft_lo", 3.0, "speedup_ttft_lo 3.0 above speedup_ttft_hi"),
])
def test_results_refuse_values_out_of_range(tmp_path, col, value, says):
    """A result file's values are checked when read: one bad value refuses the file with one line
    naming the column, the row and the value; null (not measured) passes; the dashboard lists it."""
    rows = {"method": ["bsfa", "bsfa"], "config": ["k=2", "k=4"], "length": [512, 512],
            "accuracy_rel_dense": [0.9, 1.0], "speedup": [1.5, None], "sparsity": [0.4, None],
            "speedup_tpot_graph": [1.1, 1.0], "speedup_ttft_lo": [1.0, 1.1], "speedup_ttft_hi": [1.2, 1.3]}
    pl.DataFrame(rows).write_parquet(tmp_path / "good.parquet")
    assert results.read_result_file(tmp_path / "good.parquet").height == 2
    rows[col] = [rows[col][0], value]
    pl.DataFrame(rows).write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(results.UserError, match=re.escape(says)):
        results.read_result_file(tmp_path / "bad.parquet")
    (tmp_path / "text.json").write_text(json.dumps({"kind": "sparsecal-bench", "rows": [
        {"method": "bsfa", "config": "k=2", "length": 512, "speedup": "fast"}]}))
    with pytest.raises(results.UserError, match="column speedup is not numeric"):
        results.read_result_file(tmp_path / "text.json")
