"""Capture end to end on tiny random-initialized Llama checkpoints: files, shapes, counts, logits,
resume after an interrupted run, and every bad input (one line, exit code 2, nothing written)."""
import subprocess
import sys

import pytest
import torch

from sparsecal.capture.models import load_model, resolve_model
from sparsecal.capture.prompts import load_prompts_file
from sparsecal.capture.runner import capture_sample, run_capture
from sparsecal.formats.run import RunStore
from sparsecal.formats.stats_config import StatsConfig

from helpers import assert_user_error, check_sample_tensors, cli, make_checkpoint, write_prompts


@pytest.fixture
def tiny(tmp_path, seed):
    return make_checkpoint(tmp_path / "tiny", seed)


def test_capture_files_shapes_counts(tiny, tmp_path, seed):
    lengths = [1, 63, 200, 333]
    prompts = write_prompts(tmp_path / "p.jsonl", lengths, seed)
    out = tmp_path / "run"
    res = cli("capture", "--model", tiny, "--prompts-file", prompts, "--out", out,
              "--block-m", 64, "--block-n", 32, "--k", "1,2,4", "--decode-rows", 40, "--raw")
    assert res.exit_code == 0, res.output
    store = RunStore.open(out)
    man = store.manifest
    assert man["config"]["block_m"] == 64 and man["config"]["block_n"] == 32
    assert man["model"]["num_kv_heads"] == 2 and len(man["samples"]) == 4
    assert {"torch", "transformers", "sparsecal"} <= set(man["versions"])
    cfg = StatsConfig.from_dict(man["config"])
    file_ids = [s.input_ids for s in load_prompts_file(prompts, None)]
    for rec in man["samples"]:
        _, t = store.load_sample(rec["id"], raw=True)
        n = rec["length"]
        assert t["input_ids"].tolist() in file_ids
        check_sample_tensors(t, n, cfg, layers=3, heads=4)


@pytest.mark.parametrize("heads,kv,d", [(4, 2, 64), (3, 1, 128), (2, 2, 64)])
def test_logits_unchanged_by_capture(tmp_path, seed, heads, kv, d):
    ms = resolve_model(str(make_checkpoint(tmp_path / "m", seed, heads, kv, d)))
    model = load_model(ms)
    ids = torch.randint(0, 300, (157,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids]), use_cache=False).logits
    stats, _, logits = capture_sample(model, ids, StatsConfig(block_m=32, block_n=16), logits_to_keep=0)
    assert model.config._attn_implementation == "sdpa"  # restored
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert stats["gap_count"].shape[:3] == (3, heads, 3)


def test_resume_after_interruption(tiny, tmp_path, seed):
    prompts = load_prompts_file(write_prompts(tmp_path / "p.jsonl", [50, 70, 90], seed), None)
    cfg = StatsConfig(block_m=32, block_n=16)
    ms = resolve_model(str(tiny))
    model = load_model(ms)
    from sparsecal.capture.models import load_config, model_info

    info = model_info(ms, load_config(ms))
    out = tmp_path / "run"
    store = RunStore.create_or_resume(out, info, cfg.to_dict(), "float32", "reference")

    def interrupt(done, total, rec, secs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_capture(store, model, prompts, cfg, interrupt)
    # as if killed during a write: a temp folder .tmp-<id>-<pid> of a writer that is gone (pid 1,
    # the old suffix here, is alive: the store keeps a live writer's folder)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / "samples" / f".tmp-half-written-{dead.pid}").mkdir()
    assert len(store.done_ids()) == 1
    store = RunStore.create_or_resume(out, info, cfg.to_dict(), "float32", "reference")
    assert not list((out / "samples").glob(".tmp-*"))
    result = run_capture(store, model, prompts, cfg)
    assert result == {**result, "done": 2, "skipped": 1}
    assert len(store.done_ids()) == 3
    again = cli("capture", "--model", tiny, "--prompts-file", tmp_path / "p.jsonl", "--out", out,
                "--block-m", 32, "--block-n", 16)
    assert again.exit_code == 0, again.output
    text = again.stderr.replace("\n", " ")
    assert "all 3 samples are already captured" in text and "model loaded" not in text


def test_bad_inputs_one_line_exit_2_nothing_written(tiny, tmp_path, seed):
    from transformers import BertConfig, T5Config

    good = write_prompts(tmp_path / "p.jsonl", [40], seed)
    out = tmp_path / "out"
    assert_user_error(cli("capture", "--model", "no-such-model", "--out", out), "Unknown model 'no-such-model'")
    assert_user_error(cli("capture", "--model", tiny, "--task", "nope", "--out", out), "Unknown task 'nope'")
    assert_user_error(cli("capture", "--model", tiny, "--task", "niah_single", "--lengths", "600", "--out", out),
                      "over the model's context of 512")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert_user_error(cli("capture", "--model", tiny, "--prompts-file", tmp_path / "empty.jsonl", "--out", out), "empty")
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": [1, oops]}\n')
    assert_user_error(cli("capture", "--model", tiny, "--prompts-file", tmp_path / "bad.jsonl", "--out", out), "line 2")
    BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32).save_pretrained(tmp_path / "bert")
    assert_user_error(cli("capture", "--model", tmp_path / "bert", "--prompts-file", good, "--out", out),
                      "not a decoder-only causal LM")
    T5Config(vocab_size=300, d_model=32, num_layers=1, num_heads=2).save_pretrained(tmp_path / "t5")
    assert_user_error(cli("capture", "--model", tmp_path / "t5", "--prompts-file", good, "--out", out),
                      "not a decoder-only causal LM")
    (tmp_path / "text.jsonl").write_text('{"text": "a prompt needs a tokenizer"}\n')
    assert_user_error(cli("capture", "--model", tiny, "--prompts-file", tmp_path / "text.jsonl", "--out", out),
                      "has no usable tokenizer", '{"input_ids": [...]}')
    assert not out.exists()
    # an output directory holding a different run: other geometry, other model, not a run at all
    ok = cli("capture", "--model", tiny, "--prompts-file", good, "--out", out, "--block-m", 32, "--block-n", 16)
    assert ok.exit_code == 0, ok.output
    before = sorted(p.name for p in (out / "samples").iterdir())
    assert_user_error(cli("capture", "--model", tiny, "--prompts-file", good, "--out", out), "different geometry", "block_m")
    other = make_checkpoint(tmp_path / "other", seed + 1, heads=2, kv_heads=1)
    assert_user_error(cli("capture", "--model", other, "--prompts-file", good, "--out", out,
                          "--block-m", 32, "--block-n", 16), "holds a run of model")
    assert sorted(p.name for p in (out / "samples").iterdir()) == before
    (tmp_path / "notrun").mkdir()
    (tmp_path / "notrun" / "x.txt").write_text("mine")
    assert_user_error(cli("capture", "--model", tiny, "--prompts-file", good, "--out", tmp_path / "notrun"),
                      "not a sparsecal run")
