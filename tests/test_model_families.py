"""Any modern decoder: tiny random checkpoints of each family transformers ships (tests/families.py).

With capture on, and with sparsify at a no-op threshold, a model computes exactly its own logits
(sparsecal must not change what the model computes): full-attention layers are captured (with
soft-capping on the capped scores), sliding and chunked layers run their exact dense attention and
are recorded as not captured, and features sparsecal cannot honour are refused in one line.
"""
import json

import pytest
import torch
from families import FAMILIES, WINDOW, make_family_checkpoint

import sparsecal
from sparsecal.capture.runner import capture_sample
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import write_blasst
from sparsecal.formats.layers import layer_specs, plan_layers
from sparsecal.formats.run import RunStore
from sparsecal.formats.stats_config import StatsConfig

from helpers import INTERPRETER_WARNINGS, NOOP_BLASST_FACTOR, assert_user_error, cli, write_prompts

N = 3 * WINDOW + 5  # the window binds: sliding and chunked layers differ from full ones
CFG = StatsConfig(block_m=16, block_n=8, orders=("forward",), k_values=(1, 2), decode_rows=4)
CAPTURED = {"llama": [0, 1, 2, 3], "mistral": None, "gpt_oss": None}  # None: refused; default [1, 3]
TOL = dict(atol=2e-5, rtol=2e-5)


def _load(path, attn="eager"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, module_seed):
    root = tmp_path_factory.mktemp("families")
    return {f: make_family_checkpoint(root / f, module_seed + i, f) for i, f in enumerate(FAMILIES)}


def _ids(seed, n=N):
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


CAPTURABLE = [f for f in FAMILIES if CAPTURED.get(f, [1, 3]) is not None]
# The Triton capture in the interpreter for the families whose attention the kernels see differently
# (soft cap; head dim 256 with one KV head); the others reach the same kernel as Llama.
CASES = [(f, "reference") for f in CAPTURABLE] + [("gemma2", "triton"), ("gemma3_text", "triton")]


@pytest.mark.parametrize("family,backend", CASES)
@INTERPRETER_WARNINGS
def test_capture_keeps_the_models_logits(checkpoints, family, backend, seed):
    model = _load(checkpoints[family])
    ids = _ids(seed)
    with torch.no_grad():
        own = model(ids).logits
    stats, _, logits = capture_sample(model, ids[0].tolist(), CFG, logits_to_keep=0, backend=backend)
    torch.testing.assert_close(logits, own, **TOL)
    layers = CAPTURED.get(family, [1, 3])
    assert plan_layers(layer_specs(model.config), None, N)[0] == layers
    assert stats["bsfa_threshold"].shape[0] == len(layers)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3_text", "llama4_text"])
def test_noop_sparsify_keeps_the_models_logits(checkpoints, family, tmp_path, seed):
    """Prefill and greedy decode (through the KV cache, past the window) on the reference backend."""
    model = _load(checkpoints[family])
    ids = _ids(seed)
    with torch.no_grad():
        own = model(ids).logits
        own_gen = model.generate(ids, max_new_tokens=WINDOW + 3, do_sample=False)
    text = model.config.get_text_config()
    export = tmp_path / "export"
    export.mkdir()
    write_blasst(export, {"algorithm": "skip_softmax", "target_sparsity": 0.5, "targets": [], "model": "tiny",
                          "threshold_scale_factor": {"prefill": NOOP_BLASST_FACTOR, "decode": NOOP_BLASST_FACTOR},
                          "num_layers": text.num_hidden_layers, "num_heads": text.num_attention_heads,
                          "q_block_size": 16, "k_block_size": 8, "schema_version": 1})
    sparsecal.sparsify(model, export, method="blasst", backend="reference")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, own, **TOL)
        reach = model.sparsecal_stats["reachable"].sum(dim=1)
        assert reach[[1, 3]].gt(0).all() and not reach[[0, 2]].any()  # the sliding/chunked layers ran dense
        assert torch.equal(model.generate(ids, max_new_tokens=WINDOW + 3, do_sample=False), own_gen)


def test_capture_cli_records_layer_types_and_notes(checkpoints, tmp_path, seed):
    prompts = write_prompts(tmp_path / "p.jsonl", [N, N + 7], seed)
    out = tmp_path / "run"
    res = cli("capture", "--model", checkpoints["gemma2"], "--prompts-file", prompts, "--out", out,
              "--block-m", 16, "--block-n", 8, "--k", "1,2", "--decode-rows", 4, "--orders", "forward")
    assert res.exit_code == 0, res.output
    store = RunStore.open(out)
    man = store.manifest
    assert man["model"]["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert man["model"]["sliding_window"] == WINDOW and man["model"]["softcap"] == 5.0
    assert store.layers() == [1, 3] and sorted(man["layer_notes"]) == ["0", "2"]
    assert "sliding window 16" in man["layer_notes"]["0"]
    rec, stats = store.load_sample(man["samples"][0]["id"])
    assert stats["bsfa_threshold"].shape[0] == 2
    again = cli("capture", "--model", checkpoints["gemma2"], "--prompts-file", prompts, "--out", out,
                "--block-m", 16, "--block-n", 8, "--k", "1,2", "--decode-rows", 4, "--orders", "forward",
                "--layers", "3")
    assert_user_error(again, "captured layers [1, 3], not [3]")


def test_layers_option_captures_a_subset(checkpoints, tmp_path, seed):
    prompts = write_prompts(tmp_path / "p.jsonl", [N], seed)
    out = tmp_path / "run"
    res = cli("capture", "--model", checkpoints["llama"], "--prompts-file", prompts, "--out", out,
              "--block-m", 16, "--block-n", 8, "--k", "1,2", "--decode-rows", 4, "--layers", "1-2")
    assert res.exit_code == 0, res.output
    store = RunStore.open(out)
    assert store.layers() == [1, 2] and store.manifest["layer_notes"] == {"0": "not in --layers: runs dense",
                                                                          "3": "not in --layers: runs dense"}
    for bad, needle in (("7", "outside 0..3"), ("x", "not a list of layer indices"), ("2-", "not a list")):
        assert_user_error(cli("capture", "--model", checkpoints["llama"], "--prompts-file", prompts, "--out",
                              tmp_path / f"bad{bad}", "--layers", bad), needle)
        assert not (tmp_path / f"bad{bad}").exists()


@pytest.mark.parametrize("family,needle", [("gpt_oss", "layer 1 (gpt_oss) uses learned attention sinks"),
                                           ("mistral", "no layer of this model can be captured")])
def test_unsupported_attention_is_refused_in_one_line(checkpoints, family, needle, tmp_path, seed):
    prompts = write_prompts(tmp_path / "p.jsonl", [N], seed)
    res = cli("capture", "--model", checkpoints[family], "--prompts-file", prompts, "--out", tmp_path / "run")
    assert_user_error(res, needle)
    assert not (tmp_path / "run").exists()


def test_a_window_that_covers_the_length_is_captured_as_full(checkpoints, seed):
    model = _load(checkpoints["mistral"])
    ids = _ids(seed, WINDOW)
    with torch.no_grad():
        own = model(ids).logits
    stats, _, logits = capture_sample(model, ids[0].tolist(), CFG, logits_to_keep=0, backend="reference")
    torch.testing.assert_close(logits, own, **TOL)
    assert stats["bsfa_threshold"].shape[0] == 4
    with pytest.raises(UserError, match="no layer of this model can be captured"):
        capture_sample(model, _ids(seed)[0].tolist(), CFG, backend="reference")


def test_manifest_of_an_old_run_reads_as_every_layer_full():
    from sparsecal.formats.run import captured_layers

    man = json.loads('{"model": {"num_layers": 3}}')
    assert captured_layers(man) == [0, 1, 2]


@pytest.mark.parametrize("name,kw,kinds", [
    ("Phi3Config", dict(sliding_window=WINDOW), {"sliding_attention"}),
    ("Starcoder2Config", dict(sliding_window=WINDOW), {"sliding_attention"}),
    ("Qwen2Config", dict(sliding_window=WINDOW, use_sliding_window=False), {"full_attention"}),
    ("LlamaConfig", {}, {"full_attention"}),
])
def test_layer_kinds_of_configs_without_layer_types(name, kw, kinds):
    import transformers

    cfg = getattr(transformers, name)(num_hidden_layers=3, **kw)
    specs = layer_specs(cfg)
    assert {s.kind for s in specs} == kinds and len(specs) == 3
    assert all((s.window == WINDOW) == (s.kind == "sliding_attention") for s in specs)


def test_geometries_without_a_triton_kernel_fall_back_to_the_reference_in_one_line(capsys):
    """Decided from the geometry alone (no GPU needed): auto falls back with a note, triton is refused."""
    from sparsecal.capture.runner import resolve_backend

    assert resolve_backend("auto", "cuda", 256, "bfloat16", 128) == "triton"
    assert resolve_backend("auto", "cuda", 256, "float32", 64) == "triton"
    assert resolve_backend("auto", "cuda", 256, "float32", 128) == "reference"
    assert resolve_backend("auto", "cuda", 96, "bfloat16", 128) == "reference"
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert len(notes) == 2 and "float32 query tiles of 128 x 256" in notes[0] and "head dim 96" in notes[1]
    with pytest.raises(UserError, match="--dtype bfloat16"):
        resolve_backend("triton", "cuda", 256, "float32", 128)
