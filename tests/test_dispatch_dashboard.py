"""The Export page shows the dispatch plan of an export made with --break-even (a layer x length
heatmap per config and the summary table), and one line when the export has none; the chart on
its own (colours, hover, counts)."""
import json
import shutil

import pytest
from streamlit.testing.v1 import AppTest

from sparsecal.dashboard import charts_dispatch
from sparsecal.formats import dispatch as D
from sparsecal.formats.exports import load_blasst

from helpers import FIXTURE, ROOT, cli

APP = ROOT / "dashboard" / "app.py"


@pytest.fixture(scope="module")
def dispatched(tmp_path_factory):
    """The fixture run (SmolLM2 geometry: head_dim 64, group 3) exported with a break-even file of
    given timings: break-even 0.05 at 256 tokens, 0.3 at 512."""
    base = tmp_path_factory.mktemp("dash")
    run = base / "run"
    shutil.copytree(FIXTURE, run)
    pts = [{"sparsity": 0.0, "ms": 10.0}, {"sparsity": 1.0, "ms": 1.0}]
    measured = [{"method": m, "head_dim": 64, "group": 3, "length": n, "dense": {"CUDNN_ATTENTION": d},
                 "points": pts} for m in D.METHODS for n, d in ((256, 9.55), (512, 7.3))]
    geo = {"block_m": 128, "block_n": 64, "heads": 9, "kv_heads": 3, "head_dim": 64}
    D.write_break_even(base / "be.json", D.break_even_file(measured, geo, {"gpu": "NVIDIA H100", "commit": "abc"}))
    res = cli("export", run, "--out", run / "export", "--break-even", base / "be.json")
    assert res.exit_code == 0, res.output
    return run


def _export_page(monkeypatch, run) -> AppTest:
    monkeypatch.setenv("SPARSECAL_RUNS", str(run))
    monkeypatch.setenv("SPARSECAL_RESULTS", "")
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    at.switch_page("page_export.py").run()
    assert not at.exception and not at.error, ([e.value for e in at.exception], [e.value for e in at.error])
    return at


def _heatmap(at):
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    return next(s for s in specs if s["layout"]["title"]["text"].startswith("Dispatch of"))


def test_export_page_shows_the_plan(monkeypatch, dispatched):
    rec = load_blasst(dispatched / "export")["dispatch"]
    cells = [x for e in rec["configs"] for row in e["sparse"] for x in row]
    assert any(cells) and not all(cells)  # some layers pay at some lengths, others not
    at = _export_page(monkeypatch, dispatched)
    assert len(at.get("plotly_chart")) >= 3  # thresholds, lambda and the dispatch map
    assert any("**Dispatch**" in m.value and "NVIDIA H100" in m.value for m in at.markdown)
    table = at.dataframe[-1].value
    assert list(table["config"]) == [f"{e['method']} {e['config']}" for e in rec["configs"]]
    for name in [f"{e['method']} {e['config']}" for e in rec["configs"]]:
        at.selectbox(key="ex_dispatch").set_value(name).run()
        assert not at.exception and not at.error
        entry = rec["configs"][list(table["config"]).index(name)]
        heat = _heatmap(at)["data"][0]
        assert heat["z"] == [[2 if s is None else int(on) for s, on in zip(sr, pr)]
                             for sr, pr in zip(entry["sparsity"], entry["sparse"])]


def test_export_page_without_a_dispatch_record_says_so(monkeypatch):
    at = _export_page(monkeypatch, FIXTURE)
    assert any("no dispatch record" in i.value for i in at.info)
    assert not any(json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("Dispatch of")
                   for c in at.get("plotly_chart"))


def test_heatmap_colours_hover_and_counts():
    entry = {"method": "bsfa", "config": "k=16", "break_even": [0.5, None], "extrapolated": [True, False],
             "sparsity": [[0.6, 0.9], [0.2, 0.1], [None, None]], "sparse": [[True, False], [False, False], [False, False]]}
    fig = charts_dispatch.dispatch_heatmap(entry, [1024, 2048])
    heat = fig.data[0]
    assert [list(r) for r in heat.z] == [[1, 0], [0, 0], [2, 2]] and list(heat.x) == ["1,024", "2,048"]
    assert "sparse kernel" in heat.customdata[0][0] and "nearest measured length" in heat.customdata[0][0]
    assert "SDPA" in heat.customdata[0][1] and "never pays" in heat.customdata[0][1]
    assert heat.customdata[2][0] == "left dense by the export"
    assert "sparse layers 1/3, 0/3" in fig.layout.xaxis.title.text
    rec = {"lengths": [1024, 2048], "configs": [entry]}
    row = charts_dispatch.dispatch_table(rec).row(0, named=True)
    assert row == {"config": "bsfa k=16", "1024 break-even": "0.500*", "1024 sparse layers": 1,
                   "2048 break-even": "never", "2048 sparse layers": 0}
