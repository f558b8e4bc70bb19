"""Serving-engine exports (sparsecal export --format, --patch-config, --per-layer; capture/fit --engine):
round trips per format, a refused mismatch per loader, the a*exp(b*S) law, the engines' rule
simulated on held-out samples against the fit's own held-out table, hybrid layers, the committed
SmolLM2 example."""
import json
import math
import re

import numpy as np
import polars as pl
import pytest
import torch

from sparsecal.analysis.engine_law import Hist, fit_exp_law, format_table, unpaid_layers
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.formats import engine_files as F
from sparsecal.formats.engines import ENGINES, engine_tiles, parse_formats, preset_blocks
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import blasst_layer_factors, load_blasst, load_bsfa
from sparsecal.formats.stats_config import StatsConfig

from helpers import ROOT, assert_user_error, cli, hybrid_synthetic_run, make_checkpoint, write_prompts

EXAMPLE = ROOT / "data" / "exports" / "smollm2-engine" / "export"
ENGINE_CFG = StatsConfig(block_m=128, block_n=128, orders=("forward",))
EXPECT = {"model": "synthetic-3x4", "num_layers": 3, "num_heads": 4, "block_m": 128, "block_n": 128}


def _ok(res):
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory, module_seed):
    """A synthetic run at trtllm's 128 x 128 tiles, fitted for trtllm at three targets, exported in every format."""
    base = tmp_path_factory.mktemp("engines")
    run, out = base / "run", base / "export"
    write_synthetic_run(run, [1024, 2048, 4096], 4, layers=3, heads=4, a=300.0, a_decode=30.0, target=0.5,
                        seed=module_seed, cfg=ENGINE_CFG)
    _ok(cli("fit", run, "--targets", "0.3,0.5,0.7", "--engine", "trtllm"))
    res = _ok(cli("export", run, "--out", out, "--format", "all", "--target", "0.5", "--per-layer"))
    return run, out, res


def test_engine_tiles_and_presets():
    assert [(engine_tiles(e, 64).block_m, engine_tiles(e, 64).block_n) for e in ENGINES] == \
        [(128, 64), (128, 128), (128, 128), (64, 256)]
    assert [engine_tiles("trtllm-hopper", d).block_n for d in (64, 128, 256)] == [256, 128, 64]
    for e in ENGINES:
        geo = engine_tiles(e, 128).geometry()
        assert geo["log_base"] in ("e", "2") and geo["score_scale"] and "/" in engine_tiles(e, 128).source
    assert parse_formats("all") == ["modelopt", "trtllm", "sglang", "vllm"] and parse_formats("vllm,trtllm") == ["trtllm", "vllm"]
    with pytest.raises(UserError, match="Unknown export format 'onnx'"):
        parse_formats("onnx")
    assert preset_blocks("modelopt", None, {"block-m": 128}) == (128, 128)
    with pytest.raises(UserError, match="--engine trtllm captures at 128 x 128 tiles, but --block-n 64"):
        preset_blocks("trtllm", None, {"block-n": 64})


def test_exp_law_recovers_a_and_b():
    targets = [0.3, 0.5, 0.7]
    law = fit_exp_law(targets, [7.9 * math.exp(8.6 * s) for s in targets])
    assert law.a == pytest.approx(7.9) and law.b == pytest.approx(8.6) and law.r2 == pytest.approx(1.0)
    assert law.predict(0.6) == pytest.approx(7.9 * math.exp(8.6 * 0.6))
    with pytest.raises(UserError, match="at least two fitted targets"):
        fit_exp_law([0.5], [300.0])


def test_unpaid_layers_are_the_ones_that_skip_nothing():
    edges = StatsConfig().gap_edges()
    count = np.zeros((2, 3, len(edges) + 1))
    count[0, :, 10] = 100   # far below any running max: skipped at every lambda on the grid
    count[1, :, -1] = 100   # every tile sets a new running max: never skipped
    h = Hist(count, count.copy(), reach=100.0, npos=10.0, samples=1)
    out = unpaid_layers({1024: h}, edges, factor=300.0, target=0.5, min_sparsity=0.05)
    assert list(out) == [1] and "at most 0.000" in out[1]
    assert unpaid_layers({1024: h}, edges, 300.0, 0.5, min_sparsity=0.0) == {}


def test_every_format_round_trips(engine_run):
    _, out, res = engine_run
    doc = load_blasst(out, expect={"block_m": 128, "block_n": 128})
    scalar = {m: doc["threshold_scale_factor"][m] for m in F.PHASES}
    man = F.load_engine_manifest(out, expect=EXPECT)
    for fmt in ("trtllm", "sglang"):
        got = F.LOADERS[fmt](out, expect=EXPECT)
        assert got["factors"] == scalar, fmt
        assert man["formats"][fmt]["tiles"]["engine"] == "trtllm"
    mo = F.load_modelopt(out, expect=EXPECT)
    vllm = F.load_vllm(out, expect=EXPECT)  # the block, served through Model-Optimizer's plugin
    assert vllm["factors"] == mo["factors"] and vllm["block"] == mo["block"]
    assert vllm["command"][1:] == ["vllm_serve_sparse_attn.py", "CHECKPOINT", "--enforce-eager"]
    assert man["formats"]["vllm"]["tiles"]["engine"] == "modelopt"
    group = mo["group"]
    assert group["algorithm"] == "skip_softmax" and group["targets"] == ["LlamaAttention"] and "ignore" not in group
    assert group["threshold_scale_factor"]["formula"] == "a * exp(b * target_sparsity)"
    assert group["target_sparsity"] == {"prefill": 0.5, "decode": 0.5}
    for m in F.PHASES:  # the law passes near every fitted target's a/L factor
        law = man["law"][m]
        assert law["r2"] > 0.9 and len(law["points"]) == 3
        assert mo["factors"][m] == pytest.approx(scalar[m], rel=0.15)
    geo = mo["calibration"]["geometry"]
    assert (geo["block_m"], geo["block_n"], geo["log_base"]) == (128, 128, "e") and geo["score_scale"]
    assert man["geometry"]["log_base"] == "e" and "softmax_scale" in man["geometry"]["score_scale"]
    assert "sparse_attention_config:" in (out / "trtllm.yaml").read_text()
    assert (out / "report.txt").read_text() in res.stdout


def test_a_refused_mismatch_per_loader(engine_run, tmp_path):
    _, out, _ = engine_run
    for load in F.LOADERS.values():
        with pytest.raises(UserError, match="block_n 128, but it is applied to block_n 64"):
            load(out, expect={"block_n": 64})
        with pytest.raises(UserError, match="model 'synthetic-3x4', but it is applied to model 'smollm2'"):
            load(out, expect={"model": "smollm2"})
    edited = tmp_path / "edited"
    edited.mkdir()
    for name in ("engine.json", "trtllm.yaml", "sglang.env", "vllm.serve", "modelopt.config.json"):
        (edited / name).write_text((out / name).read_text())
    (edited / "sglang.env").write_text((out / "sglang.env").read_text().replace("PREFILL_THRESHOLD_SCALE_FACTOR=",
                                                                                "PREFILL_THRESHOLD_SCALE_FACTOR=1"))
    with pytest.raises(UserError, match="edited or belongs to another export"):
        F.load_sglang(edited)
    (edited / "vllm.serve").write_text("vllm serve CHECKPOINT --attention-config.trtllm_skip_softmax_prefill_threshold"
                                       "_scale_factor 300\n")
    with pytest.raises(UserError, match="must hold one command `python vllm_serve_sparse_attn.py CHECKPOINT"):
        F.load_vllm(edited)
    (edited / "vllm.serve").unlink()
    (edited / "vllm.args").write_text("--attention-config.trtllm_skip_softmax_prefill_threshold_scale_factor 300\n")
    with pytest.raises(UserError, match="vllm.args was written by an older sparsecal: it names vLLM flags no released"):
        F.load_vllm(edited)
    (edited / "trtllm.yaml").write_text("sparse_attention_config:\n  algorithm: rocket\n")
    with pytest.raises(UserError, match="algorithm skip_softmax"):
        F.load_trtllm(edited)
    man = json.loads((out / "engine.json").read_text())
    (edited / "engine.json").write_text(json.dumps(dict(man, schema_version=0)))
    with pytest.raises(UserError, match="schema version 0"):
        F.load_engine_manifest(edited)


def _skip_group(block: dict) -> dict:
    return next(g for g in block["sparse_attention_config"]["config_groups"].values()
                if g.get("algorithm") == "skip_softmax")


@pytest.mark.parametrize("edit, says", [
    (lambda b: _skip_group(b)["threshold_scale_factor"]["prefill"].update(b=1e4),
     "the prefill factor a * exp(b * target) is inf, not a finite positive number"),
    (lambda b: _skip_group(b)["threshold_scale_factor"]["prefill"].update(a=1e300),
     "lambda = factor / L >= 1 at every length"),
    (lambda b: _skip_group(b)["threshold_scale_factor"]["prefill"].update(a=2.0),
     "engine.json beside it says"),
    (lambda b: b["sparse_attention_config"]["producer"]["calibration"]["model"].update(num_layers=-1),
     "model.num_layers is -1, not a positive integer"),
])
def test_modelopt_factors_are_checked(engine_run, tmp_path, edit, says):
    """Model-Optimizer's block: each phase's factor a * exp(b * target) finite, positive, in range and
    equal to the factor engine.json beside it records; the calibration's model sizes positive."""
    _, out, _ = engine_run
    block = json.loads((out / "modelopt.config.json").read_text())
    for name in ("engine.json", "modelopt.config.json"):
        (tmp_path / name).write_text((out / name).read_text())
    assert F.load_modelopt(tmp_path)["factors"] == F.load_modelopt(out)["factors"]
    edit(block)
    (tmp_path / "modelopt.config.json").write_text(json.dumps(block))
    with pytest.raises(UserError, match=re.escape(says)):
        F.load_modelopt(tmp_path)


def test_engine_manifest_numbers_are_finite(engine_run, tmp_path):
    _, out, _ = engine_run
    man = json.loads((out / "engine.json").read_text())
    man["model"]["num_heads"] = 0
    (tmp_path / "engine.json").write_text(json.dumps(man))
    with pytest.raises(UserError, match="model.num_heads is 0, not a positive integer"):
        F.load_engine_manifest(tmp_path)
    man["model"]["num_heads"] = 4
    man["validity"] = dict(man.get("validity") or {}, note=float("nan"))
    (tmp_path / "engine.json").write_text(json.dumps(man))
    with pytest.raises(UserError, match=re.escape("validity.note is nan; every number of a sparsecal export")):
        F.load_engine_manifest(tmp_path)


def test_engine_rule_simulated_on_the_held_out_samples(engine_run):
    """With no layer left dense, the simulated engine rule at the exported factor is the fit's own
    held-out Table 5 (a/L method), sample by sample; and the synthetic law makes it the target."""
    run, out, _ = engine_run
    man = F.load_engine_manifest(out)
    ev = pl.read_parquet(run / "fit" / "blasst_eval.parquet").filter((pl.col("method") == "a/L")
                                                                   & (pl.col("target") == 0.5))
    rows = [r for r in man["simulation"] if r["factors"].startswith("trtllm")]
    assert {(r["mode"], r["length"]) for r in rows} == {(m, n) for m in F.PHASES for n in (1024, 2048, 4096)}
    for r in rows:
        want = ev.filter((pl.col("mode") == r["mode"]) & (pl.col("length") == r["length"]))["achieved"].mean()
        assert r["achieved"] == pytest.approx(want, abs=1e-9) and r["target"] == 0.5
        assert r["achieved"] == pytest.approx(0.5, abs=0.06) and r["lambda"] == pytest.approx(r["factor"] / r["length"])
    own = load_blasst(out)["simulation"]
    assert all(r in own for r in man["simulation"]) and {r["factors"] for r in own} > {r["factors"] for r in rows}
    table = format_table(rows)
    assert "achieved" in table.splitlines()[0] and len(table.splitlines()) == 2 + len(rows)


def test_per_layer_factors_for_the_sparse_kernels(engine_run):
    _, out, _ = engine_run
    doc = load_blasst(out)
    per = blasst_layer_factors(doc)
    assert len(per) == 3 and all(f > 0 for f in per)
    assert per == [doc["per_layer"]["prefill"][str(i)] for i in range(3)]
    assert per != [doc["threshold_scale_factor"]["prefill"]] * 3
    low = next(t for t in doc["targets"] if t["target_sparsity"] == 0.3)
    assert blasst_layer_factors(doc, "decode", 0.3) == [low["per_layer"]["decode"][str(i)] for i in range(3)]
    plain = dict(doc, per_layer=None, targets=[])
    assert blasst_layer_factors(plain) == [doc["threshold_scale_factor"]["prefill"]] * 3


def _llama_config(path, layers=3):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 256, "intermediate_size": 64,
        "vocab_size": 1000, "max_position_embeddings": 8192}, indent=2))
    return path


def test_patch_config_writes_the_block_atomically_with_a_backup(engine_run, tmp_path):
    run, _, _ = engine_run
    ckpt = _llama_config(tmp_path / "ckpt")
    original = (ckpt / "config.json").read_text()
    _ok(cli("export", run, "--out", tmp_path / "e", "--patch-config", ckpt, "--target", "0.5"))
    patched = json.loads((ckpt / "config.json").read_text())
    assert patched["num_hidden_layers"] == 3 and "sparse_attention_config" in patched
    assert (ckpt / "config.json.sparsecal-backup").read_text() == original
    got = F.load_modelopt(ckpt / "config.json", expect={"block_n": 128})
    assert got["block"] == json.loads((tmp_path / "e" / "modelopt.config.json").read_text())["sparse_attention_config"]
    _ok(cli("export", run, "--out", tmp_path / "e", "--patch-config", ckpt, "--target", "0.7"))
    assert (ckpt / "config.json.sparsecal-backup").read_text() == original  # the oldest original is kept
    other = _llama_config(tmp_path / "other", layers=5)
    before = (other / "config.json").read_text()
    assert_user_error(cli("export", run, "--out", tmp_path / "e2", "--patch-config", other),
                      "config of another model", "num_hidden_layers 5 (the run's model has 3)")
    assert (other / "config.json").read_text() == before and not (tmp_path / "e2").exists()
    with pytest.raises(UserError, match="config of another model"):
        F.check_config_model("c.json", {"model_type": "qwen2", "num_hidden_layers": 3}, {"model_type": "llama"})


def test_engine_exports_of_another_geometry_are_refused(tmp_path):
    run = tmp_path / "run"
    write_synthetic_run(run, [1024, 2048], 2, layers=1, heads=2, cfg=StatsConfig(orders=("forward",)))
    _ok(cli("fit", run, "--holdout", "0", "--targets", "0.3,0.5"))
    assert_user_error(cli("export", run, "--out", tmp_path / "e", "--format", "sglang"),
                      "--format sglang needs a run captured at trtllm's 128 x 128 tiles", "128 x 64",
                      "sparsecal capture --engine trtllm")
    assert_user_error(cli("export", run, "--out", tmp_path / "e", "--format", "trtllm-gen"), "Unknown export format")
    assert_user_error(cli("fit", run, "--engine", "modelopt"), "captured at 128 x 64 tiles, but modelopt skips on "
                      "128 x 128", "sparsecal capture --engine modelopt")
    assert_user_error(cli("capture", "--out", tmp_path / "c", "--engine", "trtllm", "--block-n", "64"),
                      "--engine trtllm captures at 128 x 128 tiles")
    assert_user_error(cli("capture", "--out", tmp_path / "c", "--engine", "flash"), "Unknown engine 'flash'")
    assert not (tmp_path / "e").exists() and not (tmp_path / "c").exists()


def test_hybrid_layers_are_ignored_in_every_format(tmp_path):
    """A run whose model layer 1 was not captured (a sliding layer): BSFA keeps every block there,
    every file lists it as ignored with the run's note, modelopt names its module."""
    run = hybrid_synthetic_run(tmp_path / "run", ENGINE_CFG)
    out = tmp_path / "e"
    _ok(cli("export", run, "--out", out, "--format", "modelopt,trtllm", "--min-layer-sparsity", "0"))
    bsfa = load_bsfa(out)
    assert bsfa.thresholds.shape[1] == 3 and np.isneginf(bsfa.thresholds[:, 1]).all()
    assert bsfa.ignored_layers == {1: "sliding window 512: runs dense"} and bsfa.sparse_layers == [0, 2]
    from sparsecal.integrations.exports import load_bsfa as load_pt

    assert load_pt(out / "thresholds.bsfa.pt").ignored_layers == {1: "sliding window 512: runs dense"}
    doc = load_blasst(out)
    assert doc["sparse_layers"] == [0, 2] and doc["ignored_layers"] == {"1": "sliding window 512: runs dense"}
    assert blasst_layer_factors(doc)[1] is None
    assert F.load_modelopt(out)["group"]["ignore"] == ["model.layers.1.self_attn"]
    assert F.load_trtllm(out)["manifest"]["ignored_layers"] == {"1": "sliding window 512: runs dense"}


def test_capture_engine_presets_the_tiles(tmp_path, seed):
    ckpt = make_checkpoint(tmp_path / "ckpt", seed, layers=2, context=512)
    prompts = write_prompts(tmp_path / "p.jsonl", [256], seed)
    _ok(cli("capture", "--model", ckpt, "--prompts-file", prompts, "--out", tmp_path / "run", "--engine", "trtllm",
            "--orders", "forward", "--decode-rows", "8"))
    cfg = json.loads((tmp_path / "run" / "manifest.json").read_text())["config"]
    assert (cfg["block_m"], cfg["block_n"]) == (128, 128)
    _ok(cli("capture", "--model", ckpt, "--prompts-file", prompts, "--out", tmp_path / "hop", "--engine",
            "trtllm-hopper", "--block-m", "64", "--orders", "forward", "--decode-rows", "8"))
    cfg = json.loads((tmp_path / "hop" / "manifest.json").read_text())["config"]
    assert (cfg["block_m"], cfg["block_n"]) == (64, 256)  # head_dim 64


@pytest.mark.skipif(not EXAMPLE.is_dir(), reason="the committed example is not in this checkout")
def test_committed_smollm2_example_loads_in_every_format():
    man = F.load_engine_manifest(EXAMPLE, expect={"num_layers": 30, "num_heads": 9})
    assert man["model"]["id"].startswith("smollm2") and (man["geometry"]["block_m"], man["geometry"]["block_n"]) == (128, 128)
    for fmt, load in F.LOADERS.items():
        if fmt != "vllm":
            assert load(EXAMPLE)["factors"]["prefill"] > 0, fmt
    with pytest.raises(UserError, match="vllm.args was written by an older sparsecal"):  # made before issue 26
        F.load_vllm(EXAMPLE)
    report = (EXAMPLE / "report.txt").read_text()
    assert "achieved" in report and "Layers left dense" in report
    assert load_bsfa(EXAMPLE).num_layers == 30
    assert torch.load(EXAMPLE / "thresholds.bsfa.pt", weights_only=True)["num_layers"] == 30


def test_export_page_shows_each_engine_file_ready_to_copy(engine_run, monkeypatch):
    from streamlit.testing.v1 import AppTest

    run, out, _ = engine_run
    monkeypatch.setenv("SPARSECAL_RUNS", str(run))
    monkeypatch.setenv("SPARSECAL_RESULTS", "")
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=120)
    at.run()
    at.switch_page("page_export.py").run()
    at.text_input(key="ex_other").input(str(out)).run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    codes = "\n".join(c.value for c in at.code)
    for needle in ("sparse_attention_config", "a * exp(b * target_sparsity)", "SGLANG_SKIP_SOFTMAX_PREFILL",
                   "python vllm_serve_sparse_attn.py CHECKPOINT --enforce-eager"):
        assert needle in codes
    sim = at.dataframe[-1].value
    assert {"factors", "mode", "length", "achieved", "target"} <= set(sim.columns) and len(sim) == 18
