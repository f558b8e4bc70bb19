"""sparsecal export --break-even: the dispatch record in blasst.json from the fit's held-out sparsity
per layer and a break-even file of given timings, the CLI's table, and the refusals."""
import json

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.cli import app
from sparsecal.formats import dispatch as D
from sparsecal.formats.exports import load_blasst

runner = CliRunner()
GEO = {"block_m": 128, "block_n": 64, "heads": 4, "kv_heads": 4, "head_dim": 64, "dtype": "bfloat16"}
PTS = [{"sparsity": 0.0, "ms": 10.0}, {"sparsity": 1.0, "ms": 2.0}]  # linear: break-even = (10 - dense) / 8


def _be_file(path, head_dim=64, group=1):
    """bsfa: break-even 0.5 at 1024, 0.25 at 4096 (0.375 at 2048, half-way in log length); blasst: 0.45 at 2048 only."""
    rows = [("bsfa", 1024, 6.0), ("bsfa", 4096, 8.0), ("blasst", 2048, 6.4)]
    measured = [{"method": m, "head_dim": head_dim, "group": group, "length": n,
                 "dense": {"CUDNN_ATTENTION": d, "FLASH_ATTENTION": d + 1.0}, "points": PTS} for m, n, d in rows]
    D.write_break_even(path, D.break_even_file(measured, dict(GEO, head_dim=head_dim), {"gpu": "G", "commit": "abc"}))
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("disp")
    run, out = base / "run", base / "export"
    write_synthetic_run(run, [1024, 2048, 4096], 3, layers=2, heads=4, a=300.0, a_decode=30.0, target=0.5)
    res = runner.invoke(app, ["fit", str(run), "--k", "8,16", "--targets", "0.4,0.5"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["export", str(run), "--out", str(out), "--break-even", str(_be_file(base / "be.json"))])
    assert res.exit_code == 0, res.output
    return run, out, res.output


def test_the_record_holds_the_held_out_sparsity_and_the_rule(exported):
    run, out, _ = exported
    rec = load_blasst(out)["dispatch"]
    assert rec["lengths"] == [1024, 2048, 4096] and rec["break_even_file"]["gpu"] == "G"
    assert rec["break_even_file"]["commit"] == "abc" and rec["margin"] == 0.0
    assert [e["config"] for e in rec["configs"]] == ["k=8", "k=16", "target=0.4", "target=0.5"]
    heads = pl.read_parquet(run / "fit" / "bsfa_heads.parquet")
    for e in rec["configs"]:
        s = np.array(e["sparsity"], float)
        want_be = [0.5, 0.375, 0.25] if e["method"] == "bsfa" else [0.45] * 3
        assert e["break_even"] == pytest.approx(want_be)
        assert e["extrapolated"] == ([False] * 3 if e["method"] == "bsfa" else [True, False, True])
        assert e["sparse"] == (s >= np.array(want_be)[None, :]).tolist()
        if e["method"] == "bsfa":  # 1 - held-out measured density, heads pooled
            for layer in range(2):
                got = heads.filter((pl.col("k") == e["value"]) & (pl.col("layer") == layer)).group_by("length").agg(
                    pl.col("measured").mean()).sort("length")["measured"].to_numpy()
                np.testing.assert_allclose(s[layer], 1.0 - got, rtol=1e-12)
    assert any(any(row) for e in rec["configs"] for row in e["sparse"])  # some layers pay, some do not
    assert not all(all(row) for e in rec["configs"] for row in e["sparse"])


def test_blasst_layer_sparsity_averages_to_the_fits_deployed_held_out_sparsity(exported):
    """Every layer has the same tiles, so the mean over layers is the fit's held-out 'deployed' sparsity."""
    run, out, _ = exported
    ev = pl.read_parquet(run / "fit" / "blasst_eval.parquet").filter(
        (pl.col("mode") == "prefill") & (pl.col("order") == "forward") & (pl.col("method") == "deployed"))
    for e in load_blasst(out)["dispatch"]["configs"][2:]:
        want = ev.filter((pl.col("target") - e["value"]).abs() < 1e-9).group_by("length").agg(
            pl.col("achieved").mean()).sort("length")["achieved"].to_numpy()
        np.testing.assert_allclose(np.array(e["sparsity"], float).mean(0), want, rtol=1e-9)
        assert np.array(e["sparsity"]).mean() == pytest.approx(e["value"], abs=0.08)  # the synthetic law holds


def test_cli_prints_which_layers_run_sparse(exported):
    _, out, output = exported
    rec = load_blasst(out)["dispatch"]
    assert "Dispatch" in output and "nearest measured length" in " ".join(output.split())
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]] for ln in output.splitlines()
            if ln.count("│") == 5}
    assert rows["bsfa break-even"] == ["0.500", "0.375", "0.250"] and rows["blasst break-even"] == ["0.450*", "0.450",
                                                                                                   "0.450*"]
    for e in rec["configs"]:
        for j, cell in enumerate(rows[f"{e['method']} {e['config']}"]):
            layers = [i for i in range(2) if e["sparse"][i][j]]
            assert cell == f"{len(layers)}/2: {D.layer_ranges(layers)}"


def test_margin_and_an_export_without_break_even(exported, tmp_path):
    run, _, _ = exported
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "m"), "--break-even",
                              str(_be_file(tmp_path / "be.json")), "--dispatch-margin", "1"])
    assert res.exit_code == 0, res.output
    assert not any(any(row) for e in load_blasst(tmp_path / "m")["dispatch"]["configs"] for row in e["sparse"])
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "plain")])
    assert res.exit_code == 0 and "dispatch" not in load_blasst(tmp_path / "plain")
    assert "Dispatch" not in res.output


@pytest.mark.parametrize("head_dim,group,needle", [
    (128, 1, "measured for head_dim 128 group 1, but the model has head_dim 64 group 1"),
    (64, 4, "measured for head_dim 64 group 4, but the model has head_dim 64 group 1")])
def test_a_break_even_file_of_another_geometry_is_refused(exported, tmp_path, head_dim, group, needle):
    run, _, _ = exported
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "x"), "--break-even",
                              str(_be_file(tmp_path / "be.json", head_dim, group))])
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.output
    assert not (tmp_path / "x").exists()
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "sparsecal-run"}))
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "x"), "--break-even",
                              str(tmp_path / "bad.json")])
    assert res.exit_code == 2 and "not a sparsecal-break-even" in res.output


def test_without_the_runs_samples_blasst_falls_back_to_the_pooled_fit_table(exported, tmp_path):
    """The run's samples gone: BLASST's per-layer sparsity is blasst_heads' (all samples pooled, the
    target's a/L; heads averaged) and the record says so; BSFA's still comes from bsfa_heads."""
    import shutil

    run, out, _ = exported
    bare = tmp_path / "run"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("samples"))
    res = runner.invoke(app, ["export", str(bare), "--out", str(tmp_path / "e"), "--break-even",
                              str(_be_file(tmp_path / "be.json"))])
    assert res.exit_code == 0, res.output
    rec = load_blasst(tmp_path / "e")["dispatch"]
    held = load_blasst(out)["dispatch"]
    heads = pl.read_parquet(run / "fit" / "blasst_heads.parquet").filter(pl.col("mode") == "prefill")
    for e, h in zip(rec["configs"], held["configs"]):
        if e["method"] == "bsfa":
            assert e["sparsity"] == h["sparsity"] and e["source"] == h["source"]
            continue
        assert "samples are gone" in e["source"]
        for layer in range(2):
            want = heads.filter(((pl.col("target") - e["value"]).abs() < 1e-9) & (pl.col("layer") == layer)).group_by(
                "length").agg(pl.col("sparsity").mean()).sort("length")["sparsity"].to_numpy()
            np.testing.assert_allclose(e["sparsity"][layer], want, rtol=1e-12)


def test_a_pooled_fit_table_naming_a_layer_past_the_model_is_one_line(exported, tmp_path):
    """blasst_heads naming layer 7 of a 2-layer export (an edited or foreign table) is refused in one
    line naming the table and `sparsecal fit` (before: an IndexError)."""
    import shutil

    run, _, _ = exported
    bare = tmp_path / "run"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("samples"))
    heads = pl.read_parquet(bare / "fit" / "blasst_heads.parquet")
    heads.with_columns(pl.lit(7).cast(heads["layer"].dtype).alias("layer")).write_parquet(
        bare / "fit" / "blasst_heads.parquet")
    res = runner.invoke(app, ["export", str(bare), "--out", str(tmp_path / "e"), "--break-even",
                              str(_be_file(tmp_path / "be.json"))])
    assert res.exit_code == 2 and "blasst_heads.parquet names layer 7" in res.output, res.output
    assert not (tmp_path / "e").exists()
