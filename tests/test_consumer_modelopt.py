"""Model-Optimizer in the loop (nvidia-modelopt 0.47.0, the `consumers` extra): every modelopt block
sparsecal writes is read by Model-Optimizer's own loader and applied through its Hugging Face path;
the exact counter agrees with Model-Optimizer's rule; `sparsecal verify` replays a run's samples
through it and compares with sparsecal's prediction."""
import json
import math

import pytest
import torch

from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.formats import engine_files as F
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.integrations import consumer_modelopt as M

from helpers import ROOT, assert_user_error, cli, hybrid_synthetic_run, make_checkpoint

pytest.importorskip("modelopt.torch.sparsity.attention_sparsity")
from modelopt.torch.sparsity.attention_sparsity.plugins.sparse_attn_config import (
    load_from_checkpoint_metadata,
    match_sparse_config,
)

CFG = StatsConfig(block_m=128, block_n=128, orders=("forward",))
NAMES = [f"model.layers.{i}.self_attn" for i in range(3)]


def _ok(res):
    assert res.exit_code == 0, res.output
    return res


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def exports(tmp_path_factory, module_seed):
    """Every modelopt block the export writes: plain, per-layer, with layers left dense, patched
    into a checkpoint's config.json (a 3-layer, 4-head random Llama, the synthetic run's shape)."""
    base = tmp_path_factory.mktemp("modelopt")
    run = base / "run"
    write_synthetic_run(run, [1024, 2048, 4096], 4, layers=3, heads=4, a=300.0, a_decode=30.0, target=0.5,
                        seed=module_seed, cfg=CFG)
    _ok(cli("fit", run, "--targets", "0.3,0.5,0.7", "--engine", "modelopt"))
    ckpt = make_checkpoint(base / "ckpt", module_seed, heads=4, kv_heads=4, layers=3, context=4096, vocab_size=1000)
    out = {"plain": base / "plain", "per-layer": base / "per-layer", "dense-layers": base / "dense-layers"}
    _ok(cli("export", run, "--out", out["plain"], "--format", "modelopt", "--target", "0.5"))
    _ok(cli("export", run, "--out", out["per-layer"], "--format", "all", "--target", "0.3", "--per-layer"))
    # model layer 1 not captured (a sliding layer): left dense, in `ignore`
    hybrid = hybrid_synthetic_run(base / "hybrid", CFG, heads=4, seed=module_seed, id="synthetic-3x4")
    _ok(cli("export", hybrid, "--out", out["dense-layers"], "--format", "modelopt", "--min-layer-sparsity", "0",
            "--patch-config", ckpt))
    blocks = {k: F.load_modelopt(v)["block"] for k, v in out.items()}
    blocks["checkpoint"] = F.load_modelopt(ckpt / "config.json")["block"]
    return blocks, ckpt


def test_loader_reads_every_block_with_its_law_and_ignore(exports):
    from transformers import AutoConfig

    blocks, ckpt = exports
    for name, block in blocks.items():
        serving, preset = M.resolve_block(block)
        assert preset == "CHECKPOINT_CALIBRATED_SOFTMAX_SKIP", name
        group = block["config_groups"]["group_0"]
        attn = match_sparse_config("model.layers.2.self_attn", serving)
        for phase in ("prefill", "decode"):
            assert attn["threshold_scale_factor"][phase] == group["threshold_scale_factor"][phase], name
            assert attn["target_sparse_ratio"][phase] == group["target_sparsity"][phase], name
        for module in NAMES:
            want = module not in group.get("ignore", [])
            assert match_sparse_config(module, serving)["enable"] is want, (name, module)
    # vLLM's plugin reads the checkpoint's config through transformers: the same block comes back
    assert load_from_checkpoint_metadata(AutoConfig.from_pretrained(str(ckpt)))[0] == M.resolve_block(blocks["checkpoint"])[0]
    assert blocks["dense-layers"]["config_groups"]["group_0"]["ignore"] == ["model.layers.1.self_attn"]


def test_hf_path_applies_every_block(exports):
    blocks, ckpt = exports
    for name, block in blocks.items():
        model = _model(ckpt)
        enabled = M.apply(model, block)
        ignored = set(block["config_groups"]["group_0"].get("ignore", []))
        assert enabled == {n: n not in ignored for n in NAMES}, name
        from modelopt.torch.sparsity.attention_sparsity.utils import get_named_sparse_attention_modules

        tsf = block["config_groups"]["group_0"]["threshold_scale_factor"]
        for _, module in get_named_sparse_attention_modules(model):
            method = module._sparse_method_instance
            assert method.name == "flash_skip_softmax" and method.backend == "pytorch"
            assert method.calibration_params["prefill"] == {"a": tsf["prefill"]["a"], "b": tsf["prefill"]["b"]}


def test_hf_path_in_loader_order_turns_ignored_layers_back_on(exports):
    """Model-Optimizer's HF path lets the last matching pattern win, its loader puts `ignore` first:
    passed through unchanged, the ignored layers run sparse. This pins the consumer's behaviour."""
    blocks, ckpt = exports
    block = blocks["dense-layers"]
    assert M.apply(_model(ckpt), block, order="loader") == {n: True for n in NAMES}


def test_counter_is_exact_and_lambda_at_least_one_skips_everything(exports, rng):
    blocks, ckpt = exports
    model = _model(ckpt)
    M.apply(model, blocks["plain"])
    counter = M.ExactCounter()
    assert counter.attach(model) == 3
    ids = torch.randint(0, 300, (1, 640), generator=rng)
    counter.key = 640
    a, b = (blocks["plain"]["config_groups"]["group_0"]["threshold_scale_factor"]["prefill"][k] for k in "ab")
    huge = (math.log(10 * 640 / a)) / b          # a exp(b S) = 10 L: lambda = 10
    counter.dense([0.01, huge])
    with torch.no_grad():
        model(ids, use_cache=False)
    tiles = 3 * 4 * (5 * 6 // 2)                 # layers x heads x causal 128 x 128 tiles of 640 tokens
    assert counter.counts[("prefill", huge, 640)] == [tiles, tiles]
    skipped, total = counter.counts[("prefill", 0.01, 640)]
    assert total == tiles and 0 <= skipped < tiles


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """SmolLM2 captured at Model-Optimizer's tiles on one 1024-token prompt, fitted at two targets,
    exported and verified at a target it reaches and one where lambda >= 1: a real model's tiles."""
    run = tmp_path_factory.mktemp("verify") / "run"
    _ok(cli("capture", "--task", "text", "--lengths", "1024", "--samples", "1", "--out", run, "--engine", "modelopt",
            "--orders", "forward", "--decode-rows", "4", "--raw", "--k", "4"))
    _ok(cli("fit", run, "--engine", "modelopt", "--targets", "0.2,0.3", "--holdout", "0"))
    _ok(cli("export", run, "--out", run / "export", "--format", "modelopt", "--target", "0.3",
            "--min-layer-sparsity", "0"))
    res = _ok(cli("verify", run / "export", "--samples", "all", "--targets", "0.2,0.9"))
    return run, res


@pytest.mark.model
def test_verify_measures_what_was_predicted(verified):
    run, res = verified
    doc = json.loads((run / "export" / "verify-modelopt.json").read_text())
    assert doc["kind"] == "sparsecal-verify" and doc["consumer"].startswith("nvidia-modelopt")
    rows = doc["rows"]
    assert {r["phase"] for r in rows} == {"prefill", "decode"} and len(rows) == 2 * 2
    for r in rows:
        assert r["measured_total"] > 0 and r["measured_masks"] is not None
        if r["saturated"]:
            assert r["predicted"] == 1.0 and r["measured_dense"] == 1.0, r
        elif r["phase"] == "prefill":
            assert abs(r["error"]) <= 0.01, r
    assert any(r["predicted"] > 0.05 for r in rows), "SmolLM2 skips tiles"
    assert "measured" in res.output and "drift" in res.output


def test_verify_refuses_bad_options_before_loading_anything(tmp_path, exports):
    assert_user_error(cli("verify", tmp_path, "--engine", "vllm"), "--engine vllm")
    assert_user_error(cli("verify", tmp_path, "--targets", "1.5"), "--targets")
    assert_user_error(cli("verify", tmp_path, "--samples", "some"), "--samples some")
    assert_user_error(cli("verify", tmp_path), "does not exist")


COMMITTED = ROOT / "data" / "consumers" / "smollm2-modelopt"


@pytest.mark.skipif(not (COMMITTED / "export").is_dir(), reason="the committed consumer result is not in this checkout")
def test_export_page_draws_the_committed_verify_table(monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("SPARSECAL_RUNS", str(COMMITTED))
    monkeypatch.setenv("SPARSECAL_RESULTS", "")
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=120)
    at.run()
    at.switch_page("page_export.py").run()
    at.text_input(key="ex_other").input(str(COMMITTED / "export")).run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    table = at.dataframe[-1].value
    assert {"phase", "target", "length", "predicted", "measured_dense", "drift"} <= set(table.columns)
    assert len(table) == 24 and (table["error"].abs() <= 0.01).all()


def test_verify_file_with_an_impossible_value_is_one_line(tmp_path):
    from sparsecal.formats.errors import UserError
    from sparsecal.formats.verify import VERIFY_JSON, load_verify

    doc = json.loads((COMMITTED / "export" / VERIFY_JSON).read_text())
    doc["rows"][3]["measured_dense"] = 1.5
    (tmp_path / VERIFY_JSON).write_text(json.dumps(doc))
    with pytest.raises(UserError, match="row 3"):
        load_verify(tmp_path)
    assert load_verify(tmp_path / "nothing") is None
    doc["rows"][3]["measured_dense"] = 0.5
    doc["rows"][2]["lambda"] = float("nan")   # shown on the Export page, checked like the sparsities
    (tmp_path / VERIFY_JSON).write_text(json.dumps(doc))
    with pytest.raises(UserError, match=r"rows\[2\]\.lambda is nan"):
        load_verify(tmp_path)
