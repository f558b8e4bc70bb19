"""The dashboard app under streamlit's AppTest: every page on the committed fixture run (a real
SmolLM2 capture, fit and export) with its main controls changed; missing, broken and old files
shown on the page instead of a traceback; the Accuracy-speedup empty state and chart."""
import base64
import json
import shutil

import numpy as np
import polars as pl
import pytest
from streamlit.testing.v1 import AppTest

from helpers import FIXTURE, ROOT, write_results

APP = ROOT / "dashboard" / "app.py"
PAGES = {"overview": "page_overview.py", "density": "page_density.py", "blasst": "page_blasst.py",
         "stabilization": "page_stabilization.py", "tiles": "page_tiles.py", "curves": "page_curves.py",
         "export": "page_export.py"}
CHARTS = {"overview": 1, "density": 2, "blasst": 4, "stabilization": 4, "tiles": 3, "curves": 0, "export": 2}


def _app(monkeypatch, *runs, results="") -> AppTest:
    """results: a directory, "" (none), or None (the variable unset: the committed evaluations)."""
    monkeypatch.setenv("SPARSECAL_RUNS", ":".join(map(str, runs)))
    if results is None:
        monkeypatch.delenv("SPARSECAL_RESULTS", raising=False)
    else:
        monkeypatch.setenv("SPARSECAL_RESULTS", str(results))
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _page(at: AppTest, name: str) -> AppTest:
    at.switch_page(PAGES[name]).run()
    return at


def _ok(at: AppTest, charts: int) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert len(at.get("plotly_chart")) >= charts


def _set(at: AppTest, kind: str, key: str, value, charts: int) -> None:
    getattr(at, kind)(key=key).set_value(value).run()
    _ok(at, charts)


@pytest.fixture
def fixture_app(monkeypatch):
    return _app(monkeypatch, FIXTURE)


def test_overview(fixture_app):
    at = _page(fixture_app, "overview")
    _ok(at, 1)
    assert any(m.label == "layers x heads" and m.value == "30 x 9" for m in at.metric)
    assert any(m.label == "lengths" and m.value == "256-512" for m in at.metric)
    assert at.dataframe[0].value.shape[0] == 8
    _set(at, "multiselect", "ov_tasks", ["vt"], 1)
    assert at.dataframe[0].value.shape[0] == 4


def test_density(fixture_app):
    at = _page(fixture_app, "density")
    _ok(at, 2)
    _set(at, "multiselect", "den_ks", [1], 2)
    for key, value in (("den_k", 1), ("den_len", 256), ("den_q", "error"), ("den_q", "retained_mass_topk")):
        _set(at, "selectbox", key, value, 2)


def test_blasst(fixture_app):
    at = _page(fixture_app, "blasst")
    _ok(at, 4)
    for key, value in (("bl_mode", "decode"), ("bl_order", "reverse"), ("bl_target", 0.1), ("bl_len", 256),
                       ("bl_q", "retained_mass"), ("bl_mode", "prefill"), ("bl_order", "sink_local")):
        _set(at, "selectbox", key, value, 4)
    at.select_slider[0].set_value(-2.0).run()
    _ok(at, 4)
    assert "ln λ=-2 " in json.loads(at.get("plotly_chart")[-1].proto.spec)["layout"]["title"]["text"]
    # prefill target 0.1 reaches only 512 tokens: the law chart still draws, from one length
    _set(at, "selectbox", "bl_target", 0.1, 4)


def test_stabilization(fixture_app):
    at = _page(fixture_app, "stabilization")
    _ok(at, 4)
    for key, value in (("st_len", 512), ("st_layer", 3), ("st_order", "sink_local"), ("st_cat", "middle"),
                       ("st_layer", -1)):
        _set(at, "selectbox", key, value, 4)


def test_stabilization_old_run_says_rescales_are_not_in_it(fixture_app):
    """The fixture run was captured before the rescale statistics: one info line where they would be."""
    from sparsecal.formats.run import RESCALE_MISSING

    at = _page(fixture_app, "stabilization")
    _ok(at, 4)
    assert [i.value for i in at.info].count(RESCALE_MISSING) == 1
    assert any("same for every scan order" in m.value for m in at.markdown)
    # nor VFA's joint statistic: its fit tables are absent, the info line names the command
    assert [i.value for i in at.info if "joint_hist.parquet is missing" in i.value and "sparsecal fit" in i.value]


def _chart(at: AppTest, title: str) -> dict:
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    return next(s for s in specs if s["layout"].get("title", {}).get("text", "").startswith(title))


def test_stabilization_rescales_and_shortfall_per_order(monkeypatch, hybrid_run):
    """A run captured with the rescale statistics: rescales per order (the fit table's exact means),
    their distribution, rows already at their final max, the shortfall CDF and the per-head heatmap."""
    at = _page(_app(monkeypatch, hybrid_run), "stabilization")
    _ok(at, 9)
    assert not at.info, [i.value for i in at.info]
    tab = pl.read_parquet(hybrid_run / "fit" / "stab_rescale.parquet")
    bars = _chart(at, "Running-max rescales per row")["data"][0]
    for order, y in zip(bars["x"], bars["y"]):
        d = tab.filter(pl.col("order") == order)
        assert abs(y - float((d["mean_rescales"] * d["rows"]).sum() / d["rows"].sum())) < 1e-9
    final = _chart(at, "Rows already at their final max")["data"]
    assert len(final) == 2 and all(0 <= v <= 1 for t in final for v in t["y"])
    _set(at, "selectbox", "st_rs_order", "reverse", 9)
    _set(at, "selectbox", "st_rs_metric", "share at the final max after the first + local blocks", 9)
    assert "(reverse order)" in _chart(at, "Share at the final max after the first + local")["layout"]["title"]["text"]
    _set(at, "selectbox", "st_len", 64, 9)


def test_stabilization_joint_statistic_beside_qinit(monkeypatch, hybrid_run):
    """VFA's frozen max minus the true row max: its histogram (shares of rows, on the Q-init bins)
    beside the Q-init error's, and the caption's shares below -1 / -5 and above +5 nats are the
    joint table's row-weighted ones."""
    at = _page(_app(monkeypatch, hybrid_run), "stabilization")
    _ok(at, 9)
    y = _chart(at, "VFA frozen max minus true row max")["data"][0]["y"]
    if isinstance(y, dict):  # plotly's typed-array encoding of a numpy / polars column
        y = np.frombuffer(base64.b64decode(y["bdata"]), dtype=y["dtype"])
    assert abs(float(np.sum(y)) - 1) < 1e-9 and _chart(at, "Q-init error")
    tab = pl.read_parquet(hybrid_run / "fit" / "joint.parquet")
    want = float((tab["share_below_1"] * tab["rows"]).sum() / tab["rows"].sum())
    cap = next(c.value for c in at.caption if c.value.startswith("Frozen max = max(Q-init"))
    assert f"(p > 1 in VFA's frozen phase): {want:.2%}" in cap


def test_tiles(fixture_app):
    at = _page(fixture_app, "tiles")
    _ok(at, 3)
    ids = sorted(p.name for p in (FIXTURE / "samples").iterdir())
    assert "-512-" in at.selectbox(key="ti_sample").value, "the longest sample comes first"
    _set(at, "selectbox", "ti_sample", next(i for i in ids if "-256-" in i), 3)
    _set(at, "selectbox", "ti_sample", next(i for i in ids if "vt-512-" in i), 3)
    for key, value in (("ti_layer", 12), ("ti_head", 5), ("ti_order", "reverse"), ("ti_k", 1)):
        _set(at, "selectbox", key, value, 3)
    assert float(at.metric[0].value) > 0, "k=1 at 512 tokens skips candidate tiles"
    _set(at, "selectbox", "ti_target", "none", 3)
    _set(at, "selectbox", "ti_k", "none", 3)
    assert float(at.metric[0].value) == 0 and float(at.metric[2].value) == 0


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory, module_seed):
    """A tiny Gemma 3 (sliding layers 0 and 2, full layers 1 and 3) captured with raw tiles, fitted, exported."""
    from families import make_family_checkpoint

    from helpers import cli, write_prompts

    root = tmp_path_factory.mktemp("hybrid")
    model = make_family_checkpoint(root / "model", module_seed, "gemma3_text")
    prompts = write_prompts(root / "p.jsonl", [48, 64, 48, 64], module_seed)
    run = root / "run"
    for args in (("capture", "--model", model, "--prompts-file", prompts, "--out", run, "--block-m", 16,
                  "--block-n", 8, "--k", "1,2,4", "--decode-rows", 8, "--raw"),
                 ("fit", run, "--targets", "0.02"), ("export", run, "--out", run / "export")):
        res = cli(*args)
        assert res.exit_code == 0, res.output
    return run


def test_every_page_shows_a_hybrid_run_by_model_layer(monkeypatch, hybrid_run):
    at = _app(monkeypatch, hybrid_run)
    for name in PAGES:
        _ok(_page(at, name), CHARTS[name] + (name == "overview"))
        if name == "overview":  # the layer map: every layer's type, captured or not and why
            spec = json.loads(at.get("plotly_chart")[0].proto.spec)
            assert spec["data"][0]["z"] == [[1, 0, 1, 0]] and spec["data"][0]["text"] == [["", "●", "", "●"]]
            assert any("sliding window 16" in c.value for c in at.caption)
        if name == "density":
            heat = json.loads(at.get("plotly_chart")[-1].proto.spec)["data"][0]
            assert heat["y"] == ["1 full", "3 full"]
        if name == "tiles":
            assert [at.selectbox(key="ti_layer").format_func(i) for i in (0, 1)] == ["1 full", "3 full"]


def test_export(fixture_app):
    at = _page(fixture_app, "export")
    _ok(at, 2)
    assert len(at.get("download_button")) == 3
    for key, value in (("ex_k", 4), ("ex_layer", 29), ("ex_target", 0.1)):
        _set(at, "selectbox", key, value, 2)
    at.text_input(key="ex_other").input("/nonexistent/export").run()
    assert not at.exception and any("sparsecal export" in i.value for i in at.info)


def test_curves_empty_state_names_the_commands(fixture_app):
    at = _page(fixture_app, "curves")
    _ok(at, 0)
    text = " ".join(i.value for i in at.info)
    assert "sparsecal eval" in text and "sparsecal bench" in text and "--results" in text


def test_curves_out_of_the_box_from_the_committed_evaluation(monkeypatch):
    """No --results: the evaluations committed under data/eval/ (SmolLM2 on H100s) are plotted."""
    from sparsecal.dashboard.data import shipped_result_dirs

    shipped = shipped_result_dirs()
    assert [d.name for d in shipped] == ["smollm2-1k-8k-h100", "smollm2-1k-8k-h100-issue27", "smollm2-1k-8k-h100-s35"]
    at = _page(_app(monkeypatch, FIXTURE, results=None), "curves")
    _ok(at, 1)
    table = at.dataframe[0].value
    assert {"blasst", "bsfa", "window"} <= set(table["method"]) and table["speedup"].notna().any()


def test_curves_chart_from_result_files(monkeypatch, tmp_path):
    at = _page(_app(monkeypatch, FIXTURE, results=write_results(tmp_path / "results")), "curves")
    _ok(at, 1)
    _set(at, "multiselect", "cu_methods", ["bsfa"], 1)
    _set(at, "multiselect", "cu_lengths", [512], 1)
    (tmp_path / "results" / "broken.json").write_text("{not json")
    at.run()
    assert not at.exception and any("broken.json" in e.value for e in at.error)


def test_curves_shows_each_points_own_ttft_and_tpot_speedup(monkeypatch, tmp_path):
    """An evaluation timed by `sparsecal eval --time` carries each point's own TTFT and TPOT speedup:
    the page plots either (TTFT first), each with its rounds' interval where the rows have one."""
    rows = [{"method": "bsfa", "config": f"k={k}", "length": 512, "accuracy_rel_dense": 1 - k / 100,
             "speedup": 1 + k / 10, "speedup_ttft": 1 + k / 10, "speedup_tpot": 1 + k / 50,
             "speedup_tpot_graph": 1 + k / 20, "speedup_ttft_lo": 1 + k / 10 - 0.05, "speedup_ttft_hi": 1 + k / 10 + 0.05,
             "speedup_tpot_graph_lo": 1.0, "speedup_tpot_graph_hi": 1.2} for k in (1, 2)]
    (tmp_path / "results.json").write_text(json.dumps({"kind": "sparsecal-eval", "rows": rows, "provenance": {}}))
    at = _page(_app(monkeypatch, FIXTURE, results=tmp_path), "curves")
    _ok(at, 1)
    assert list(at.dataframe[0].value["speedup"]) == [1.1, 1.2]
    assert list(at.dataframe[0].value["speedup_lo"]) == pytest.approx([1.05, 1.15])
    # only the measures the points carry are offered (no graph TTFT here)
    assert at.selectbox(key="cu_speed").options == ["TTFT (prefill)", "TPOT (decode)", "TPOT, CUDA graph (device time)"]
    _set(at, "selectbox", "cu_speed", "TPOT (decode)", 1)
    assert list(at.dataframe[0].value["speedup"]) == [1.02, 1.04]
    assert at.dataframe[0].value["speedup_lo"].isna().all()   # no interval of eager TPOT in these rows
    _set(at, "selectbox", "cu_speed", "TPOT, CUDA graph (device time)", 1)
    assert list(at.dataframe[0].value["speedup"]) == [1.05, 1.1]
    assert list(at.dataframe[0].value["speedup_hi"]) == [1.2, 1.2]


@pytest.fixture
def damaged(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    return run


def test_missing_fit_and_raw_tiles_say_which_command_makes_them(monkeypatch, damaged):
    shutil.rmtree(damaged / "fit")
    shutil.rmtree(damaged / "export")
    for raw in damaged.glob("samples/*/raw.safetensors"):
        raw.unlink()
    at = _app(monkeypatch, damaged)
    for name in PAGES:
        _page(at, name)
        assert not at.exception and not at.error, (name, [e.value for e in at.exception], [e.value for e in at.error])
        text = " ".join(i.value for i in at.info)
        want = {"tiles": "--raw", "export": "sparsecal export", "curves": "sparsecal bench"}.get(name, "sparsecal fit")
        if name != "overview":
            assert want in text, (name, text)


def test_broken_and_old_files_are_errors_on_the_page(monkeypatch, damaged):
    fit = damaged / "fit"
    (fit / "blasst_curves.parquet").write_bytes(b"not parquet")
    pl.read_parquet(fit / "bsfa_heads.parquet").drop("measured").write_parquet(fit / "bsfa_heads.parquet")
    (fit / "gap_cum.safetensors").write_bytes(b"\x00" * 64)
    doc = json.loads((fit / "fit.json").read_text())
    (fit / "fit.json").write_text(json.dumps(dict(doc, schema_version=0)))
    (damaged / "export" / "blasst.json").write_text("{")
    sample = next(damaged.glob("samples/*/raw.safetensors"))
    sample.write_bytes(b"garbage")
    at = _app(monkeypatch, damaged)
    expect = {"overview": "schema version 0", "density": "older sparsecal", "blasst": "blasst_curves.parquet",
              "export": "blasst.json"}
    for name, text in expect.items():
        _page(at, name)
        assert not at.exception, (name, [e.value for e in at.exception])
        assert any(text in e.value for e in at.error), (name, [e.value for e in at.error])
    _page(at, "tiles")
    at.selectbox(key="ti_sample").set_value(sample.parent.name).run()
    assert not at.exception and any("raw tile file" in e.value for e in at.error)


def test_impossible_fit_values_are_errors_on_the_page(monkeypatch, damaged):
    """The fit's values, not only its files: a NaN threshold, a negative gap count, a fit.json length of
    -5, a NaN sparsity in a fit table: each an error line on the pages that show it, no traceback."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    fit = damaged / "fit"
    path = fit / "bsfa_thresholds.safetensors"
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    arrays = load_file(str(path))
    arrays["thresholds"].reshape(-1)[3] = np.nan
    save_file(arrays, str(path), metadata=meta)
    doc = json.loads((fit / "fit.json").read_text())
    (fit / "fit.json").write_text(json.dumps(dict(doc, lengths=[-5])))
    heads = pl.read_parquet(fit / "bsfa_density.parquet")
    heads.with_columns(pl.lit(float("nan")).alias("measured")).write_parquet(fit / "bsfa_density.parquet")
    at = _app(monkeypatch, damaged)
    expect = {"overview": "lengths is [-5], not a list of positive integers",
              "density": "column measured must be in [0, 1]"}
    for name, text in expect.items():
        _page(at, name)
        assert not at.exception, (name, [e.value for e in at.exception])
        assert any(text in e.value for e in at.error), (name, [e.value for e in at.error])
    from sparsecal.dashboard import data as D

    with pytest.raises(D.Broken, match="a threshold is NaN or \\+inf"):
        D.fit_thresholds(damaged)
    cum = fit / "gap_cum.safetensors"
    with safe_open(str(cum), framework="np") as f:
        meta = f.metadata()
    arrays = load_file(str(cum))
    key = next(k for k in arrays if k.startswith("prefill.count_bins"))
    arrays[key].reshape(-1)[0] = -1
    save_file(arrays, str(cum), metadata=meta)
    with pytest.raises(D.Broken, match="prefill count_bins holds a NaN, infinite or negative value"):
        D.gap_cum(damaged)


def test_several_runs_and_a_bad_run_path(monkeypatch, damaged, tmp_path):
    (tmp_path / "notarun").mkdir()
    at = _app(monkeypatch, FIXTURE, damaged, tmp_path / "notarun")
    runs = at.sidebar.selectbox[0].options
    assert len(runs) == 3
    at.sidebar.selectbox[0].select_index(1).run()
    _page(at, "density")
    _ok(at, 2)
    at.sidebar.selectbox[0].select_index(2).run()
    _page(at, "overview")
    assert not at.exception and any("sparsecal capture" in i.value for i in at.info)


def test_the_app_never_imports_torch():
    """DESIGN.md: the dashboard reads files with streamlit, plotly and polars only."""
    import subprocess
    import sys

    code = ("import os, sys\nfrom streamlit.testing.v1 import AppTest\n"
            f"os.environ['SPARSECAL_RUNS'] = {str(FIXTURE)!r}\n"
            f"at = AppTest.from_file({str(APP)!r}, default_timeout=120)\nat.run()\n"
            f"for p in {sorted(PAGES.values())!r}:\n    at.switch_page(p).run()\n    assert not at.exception, p\n"
            "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_blasst_decode_group_decision(monkeypatch, tmp_path, seed):
    """A run with the decode group statistic (a synthetic run: the group gap is head 0's + ln 1.5): in
    decode mode the BLASST page adds the per-head against group chart, the group below the head's bars,
    and names both laws; the committed fixture (captured before the statistic) says how to get it."""
    from sparsecal.analysis.fit import FitRequest, fit_run
    from sparsecal.bench.synthetic import write_synthetic_run

    store = write_synthetic_run(tmp_path / "run", [1024, 2048], 2, layers=1, heads=2, seed=seed)
    fit_run(store, FitRequest(targets=[0.5], holdout=0.0), warn=lambda line: None)
    at = _page(_app(monkeypatch, store.root), "blasst")
    _set(at, "selectbox", "bl_mode", "decode", 5)
    spec = json.loads(at.get("plotly_chart")[3].proto.spec)
    assert spec["layout"]["title"]["text"].startswith("Decode: per-head against group decision")
    head, group = (np.frombuffer(base64.b64decode(tr["y"]["bdata"]), dtype=tr["y"]["dtype"]) if isinstance(tr["y"], dict)
                   else np.asarray(tr["y"], float) for tr in spec["data"][:2])
    assert (group < head).all() and any("a = " in c.value and "decode_group" in c.value for c in at.caption)
    at = _page(_app(monkeypatch, FIXTURE), "blasst")
    _set(at, "selectbox", "bl_mode", "decode", 4)
    assert any("group-decision table" in i.value for i in at.info)


def test_impossible_raw_tile_values_are_an_error(damaged):
    """Raw tiles are checked when read (-inf marks an unreachable tile): a NaN mass, or a mass above 1,
    in the layer and head shown is one line naming the file and the capture command."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from sparsecal.dashboard import data as D

    sample = next(damaged.glob("samples/*/raw.safetensors"))
    sid = sample.parent.name
    assert np.isfinite(D.raw_tiles(damaged, sid, 0, 0)["mass"]).any()
    for value in (float("nan"), 1.5):
        with safe_open(str(sample), framework="np") as f:
            meta, arrays = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not iterable
        arrays["raw_mass"][0, 0].reshape(-1)[0] = value
        save_file(arrays, str(sample), metadata=meta)
        with pytest.raises(D.Broken, match=r"layer 0, head 0: raw_mass\[0, 0\] is (nan|1\.5) \(NaN, \+inf or a mass"):
            D.raw_tiles(damaged, sid, 0, 0)
