"""Engine exports that hold where users deploy (issue 26): --serve-lengths (lambda >= 1 per consumer and
the remedies), --length-weights (the engine's law fitted where the traffic is), the modelopt block's
target over the enabled layers, vllm.serve resolved by Model-Optimizer's own plugin code, and
trtllm.yaml's target_sparsity form."""
import json
import math
import types

import numpy as np
import pytest

from sparsecal.analysis.engine_fit import best_factor, calibrated_weights, curves, sparsity_at
from sparsecal.analysis.engine_law import Hist
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.formats import engine_files as F
from sparsecal.formats.engines import parse_length_weights, parse_serve_lengths
from sparsecal.formats.errors import UserError
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.integrations.engine_safety import max_safe_target

from helpers import assert_user_error, cli, hybrid_synthetic_run, write_prompts

CFG = StatsConfig(block_m=128, block_n=128, orders=("forward",))
LAW = (0.02, 8.0, 0.5)   # lambda_best(S, n) = 0.02 exp(8 S) / sqrt(n): the best factor doubles from 1K to 4K


def _ok(res):
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def run(tmp_path_factory, module_seed):
    """A synthetic run at 128 x 128 tiles whose best factor grows with the length (no single a/L
    factor fits every length), fitted at three targets."""
    root = tmp_path_factory.mktemp("safe") / "run"
    write_synthetic_run(root, [1024, 2048, 4096], 4, layers=3, heads=4, seed=module_seed, cfg=CFG, law=LAW)
    _ok(cli("fit", root, "--engine", "trtllm", "--targets", "0.3,0.5,0.7"))
    return root


def test_options_parse_and_weights_map_onto_the_calibrated_lengths():
    assert parse_serve_lengths("512-8192") == (512, 8192) and parse_serve_lengths("1024") == (1024, None)
    assert parse_serve_lengths(None) is None
    for bad in ("0", "abc", "4096-1024", "1-2-3"):
        with pytest.raises(UserError, match="is not MIN or MIN-MAX"):
            parse_serve_lengths(bad)
    assert parse_length_weights("1024:0.5, 4096:1.5,1024:0.5") == {1024: 1.0, 4096: 1.5}
    for bad in ("1024", "1024:x", "0:1", "1024:-1", "1024:inf"):
        with pytest.raises(UserError, match="is not LENGTH:WEIGHT"):
            parse_length_weights(bad)
    w = calibrated_weights({1448: 1.0, 4096: 1.0}, [1024, 2048, 4096])   # 1448 ~ halfway in ln between 1K and 2K
    assert sum(w.values()) == pytest.approx(1.0) and w[4096] == pytest.approx(0.5)
    assert w[1024] == pytest.approx(0.25, abs=0.01) and w[2048] == pytest.approx(0.25, abs=0.01)
    with pytest.raises(UserError, match="512 tokens, 50% of the weight\\) lie outside the calibrated lengths"):
        calibrated_weights({512: 1.0, 1024: 1.0}, [1024, 2048, 4096])


def test_options_are_refused_in_one_line_before_any_work(run, tmp_path):
    out = tmp_path / "e"
    for args, needle in ((["--serve-lengths", "4096-1024"], "is not MIN or MIN-MAX"),
                         (["--serve-lengths", "3000000"], "past the model's context of 1048576 tokens"),
                         (["--length-weights", "1024:x"], "is not LENGTH:WEIGHT"),
                         (["--length-weights", "512:1,8192:1"], "outside the calibrated lengths 1024-4096"),
                         (["--length-weights", "nofile.jsonl"], "no such prompts file, and not LENGTH:WEIGHT"),
                         (["--length-weights", "1024:0"], "holds no positive weight")):
        assert_user_error(cli("export", run, "--out", out, "--format", "all", *args), needle)
    assert_user_error(cli("export", run, "--out", out, "--serve-lengths", "1024"), "give --format too")
    assert not out.exists()


def _traffic(man: dict) -> dict:
    return {(tuple(g["formats"]), m): p for g in man["traffic"]["groups"] for m, p in g["phases"].items()}


def test_weighted_fit_beats_the_unweighted_one_where_the_traffic_is(run, tmp_path):
    """Weight on 1K: the engines' factors move to where 1K reaches the target, and the held-out
    weighted error drops below the unweighted fit's for the scalar files and for the block."""
    out = tmp_path / "e"
    _ok(cli("export", run, "--out", out, "--format", "all", "--target", "0.5", "--length-weights", "1024:0.9,4096:0.1",
            "--serve-lengths", "1024"))
    man = F.load_engine_manifest(out)
    tr = _traffic(man)
    assert man["traffic"]["weights"] == {"1024": 0.9, "2048": 0.0, "4096": 0.1}
    assert {k[0] for k in tr} == {("trtllm", "sglang"), ("modelopt", "vllm")}
    for (fmts, mode), p in tr.items():
        assert p["error"] < p["unweighted_error"], (fmts, mode)
        assert p["factor"] != pytest.approx(p["unweighted_factor"], rel=0.01)
        by_len = {r["length"]: r["achieved"] for r in p["per_length"]}
        assert abs(by_len[1024] - 0.5) < abs(next(r["unweighted_achieved"] for r in p["per_length"]
                                                  if r["length"] == 1024) - 0.5)
    sim = {(r["factors"].split(":")[0], r["mode"], r["length"]): r for r in man["simulation"]}
    for m in F.PHASES:  # what the report shows per length is the simulation at the exported factor
        p = tr[(("trtllm", "sglang"), m)]
        assert p["factor"] == man["formats"]["sglang"]["factors"][m] == sim[("trtllm/sglang", m, 1024)]["factor"]
        assert p["per_length"][0]["achieved"] == sim[("trtllm/sglang", m, 1024)]["achieved_sparse_layers"]
    assert "Traffic (--length-weights 1024:0.9,4096:0.1" in (out / "report.txt").read_text()


def test_prompt_lengths_weigh_the_fit(run, tmp_path, seed):
    prompts = write_prompts(tmp_path / "p.jsonl", [1024, 1024, 4096], seed)
    _ok(cli("export", run, "--out", tmp_path / "e", "--format", "sglang", "--target", "0.5",
            "--length-weights", prompts))
    tr = F.load_engine_manifest(tmp_path / "e")["traffic"]
    assert tr["source"] == f"the 3 prompts of {prompts}"
    assert tr["weights"]["1024"] == pytest.approx(2 / 3) and tr["weights"]["4096"] == pytest.approx(1 / 3)


def test_lambda_over_one_on_served_lengths_is_said_per_consumer(run, tmp_path):
    out = tmp_path / "e"
    res = _ok(cli("export", run, "--out", out, "--format", "all", "--target", "0.7", "--serve-lengths", "100-4096"))
    man = F.load_engine_manifest(out)
    safety = man["safety"]
    assert safety["serve_lengths"] == {"min": 100, "max": 4096, "source": "--serve-lengths"}
    for fmt, rec in safety["formats"].items():
        f = man["formats"][fmt]["factors"]["prefill"]
        p = rec["phases"]["prefill"]
        assert f > 100 and rec["unsafe"] and p["safe_from"] == math.floor(f) + 1
        assert p["lambda_at_shortest"] == pytest.approx(f / 100) and rec["consumers"]
        assert rec["remedies"]["min_length"] >= p["safe_from"]
        s = rec["remedies"]["max_target"]["prefill"]
        law = man["law"]["prefill"] if fmt in ("modelopt", "vllm") else None
        if law:  # the block's law keeps lambda < 1 from 100 tokens at the offered target, not 0.001 above it
            assert law["a"] * math.exp(law["b"] * s) < 100 <= law["a"] * math.exp(law["b"] * (s + 0.001))
    does = {c["consumer"]: c for c in safety["formats"]["modelopt"]["consumers"]}
    assert not does["Model-Optimizer HF path"]["exact"] and does["Model-Optimizer vLLM plugin"]["exact"]
    assert "XQA" in json.dumps(safety["formats"]["sglang"])
    assert "refAttention.cpp" in json.dumps(safety["formats"]["trtllm"])
    warned = [ln for ln in res.stderr.splitlines() if "lambda = factor / L >= 1 on served lengths" in ln]
    assert len(warned) == 1 and "from 100 tokens" in warned[0]
    assert res.stderr.count("never receives SGLANG_SKIP_SOFTMAX_DECODE_THRESHOLD_SCALE_FACTOR") == 1
    text = (out / "report.txt").read_text()
    assert "Served lengths 100-4096 tokens" in text and "remedies: serve sparse from" in text
    _ok(res := cli("export", run, "--out", out, "--format", "all", "--target", "0.3", "--serve-lengths", "1024"))
    assert not any(r["unsafe"] for r in F.load_engine_manifest(out)["safety"]["formats"].values())
    assert "on served lengths" not in res.stderr


def test_max_safe_target():
    law = {"a": 10.0, "b": 5.0}
    s = max_safe_target(law, 100)
    assert s == pytest.approx(math.log(10) / 5, abs=0.001) and 10 * math.exp(5 * s) < 100
    assert max_safe_target(law, 10) is None and max_safe_target(None, 100) is None
    assert max_safe_target({"a": 10.0, "b": -1.0}, 100) is None


def test_block_target_is_the_mean_over_the_enabled_layers():
    """Layer 1 never skips: the block's factor reaches S on layer 0 alone (Model-Optimizer's meaning,
    ignored layers not counted), where an every-layer mean would stop at S / 2."""
    edges = StatsConfig().gap_edges()
    count = np.zeros((2, 3, len(edges) + 1))
    count[0, :, :-1] = 10.0      # spread evenly below 0
    count[1, :, -1] = 10.0 * len(edges)
    h = Hist(count, count.copy(), reach=10.0 * len(edges), npos=1.0, samples=1)
    enabled = curves({1024: h}, edges, np.array([True, False]))
    every = curves({1024: h}, edges, np.array([True, True]))
    f = best_factor(enabled, {1024: 1.0}, 0.4)
    assert sparsity_at(enabled, f)[1024] == pytest.approx(0.4, abs=0.01)
    assert sparsity_at(every, f)[1024] == pytest.approx(0.2, abs=0.01)


def _llama(path, layers=3):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
        "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 128, "intermediate_size": 64,
        "vocab_size": 1000, "max_position_embeddings": 8192}))
    return path


def test_vllm_plugin_resolves_the_patched_block(tmp_path):
    """Model-Optimizer's own resolution (plugins/sparse_attn_config.py, no GPU): the patched config.json
    block gives every enabled layer the calibrated law and target, and the ignored layer enable False,
    under vLLM's module names and transformers'; trtllm.yaml takes the target_sparsity form."""
    sac = pytest.importorskip("modelopt.torch.sparsity.attention_sparsity.plugins.sparse_attn_config")
    run = hybrid_synthetic_run(tmp_path / "run", CFG)
    ckpt, out = _llama(tmp_path / "ckpt"), tmp_path / "e"
    _ok(cli("export", run, "--out", out, "--format", "vllm,trtllm", "--target", "0.5", "--patch-config", ckpt,
            "--min-layer-sparsity", "0"))
    got = F.load_vllm(out)
    assert got["checkpoint"] == str(ckpt) and got["command"][-1] == "--enforce-eager"
    hf = types.SimpleNamespace(**json.loads((ckpt / "config.json").read_text()))
    cfg, preset = sac.load_from_checkpoint_metadata(hf)
    assert preset == "CHECKPOINT_CALIBRATED_SOFTMAX_SKIP"
    group = got["block"]["config_groups"]["group_0"]
    for i in range(3):
        for name in (f"model.layers.{i}.self_attn.attn", f"model.layers.{i}.self_attn"):
            layer = sac.match_sparse_config(name, cfg)
            if i == 1:
                assert layer == {"enable": False}, name
                continue
            assert layer["enable"] and layer["method"] == "triton_skip_softmax", name
            assert layer["threshold_scale_factor"] == group["threshold_scale_factor"]
            assert layer["target_sparse_ratio"] == {"prefill": 0.5, "decode": 0.5}
            for m in F.PHASES:  # the plugin's factor: a * exp(b * target)
                law = layer["threshold_scale_factor"][m]
                factor = law["a"] * math.exp(law["b"] * layer["target_sparse_ratio"][m])
                assert factor == pytest.approx(got["factors"][m])
    tr = F.load_trtllm(out)
    assert tr["form"] == "target_sparsity" and tr["config"]["target_sparsity"] == {"prefill": 0.5, "decode": 0.5}
    assert tr["factors"] == got["factors"]
    text = (out / "trtllm.yaml").read_text()
    (out / "trtllm.yaml").write_text(text.replace("prefill: 0.5", "prefill: 0.6"))
    with pytest.raises(UserError, match="holds target_sparsity .* but engine.json beside it says"):
        F.load_trtllm(out)
    cal = F.load_modelopt(out)["calibration"]
    assert "enabled (not ignored) layers" in cal["target_definition"]
