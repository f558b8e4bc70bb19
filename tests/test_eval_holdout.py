"""Held-out tasks and text: the second corpus (``text_stdlib``, the standard library's docstrings)
builds prompts at exact awkward lengths deterministically; an evaluation labels each row's split
("seen": its task family was calibrated on, "held-out": it was not) from the calibration run's
manifest, or from ``--holdout-tasks`` when no run is found, and reports the splits apart; the
disjointness check holds across corpora and task names.

Everything runs on a tiny random Llama with a byte-level tokenizer (one token per ASCII
character: a real ``tokenizers`` BPE without merges), on the CPU."""
import json
import math
from pathlib import Path

import polars as pl
import pytest
import torch

from sparsecal.capture.prompts import TEXT_TASKS, build_task_prompts, load_prompts_file
from sparsecal.capture.prompts.corpora import STDLIB_SOURCE, stdlib_text
from sparsecal.capture.prompts.scoring import score
from sparsecal.capture.prompts.tasks import source_text
from sparsecal.evaluation.inputs import HELD_OUT, SEEN, Calibration, check_disjoint, check_holdout, split_of
from sparsecal.formats.errors import UserError
from sparsecal.formats.run import sample_id

from helpers import assert_user_error, cli, make_checkpoint

AWKWARD = (16, 17, 255, 1001, 4099)
CAL_LENGTH = 64  # the calibration run's prompts (task text)


def _byte_tokenizer():
    """A byte-level BPE with no merges: 256 ids, every ASCII character one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


@pytest.fixture(scope="module")
def byte_tok():
    return _byte_tokenizer()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, module_seed, byte_tok):
    """(checkpoint, calibration run captured on task text, an export of that model in another
    directory): a tiny Llama with the byte tokenizer saved beside it."""
    from sparsecal.formats.run import RunStore
    from sparsecal.integrations.exports import write_bsfa

    base = tmp_path_factory.mktemp("holdout")
    ckpt = make_checkpoint(base / "tiny", module_seed, heads=2, kv_heads=1, layers=2, vocab_size=256)
    byte_tok.save_pretrained(ckpt)
    res = cli("capture", "--model", ckpt, "--task", "text", "--lengths", CAL_LENGTH, "--out", base / "run",
              "--block-m", 64, "--block-n", 32)
    assert res.exit_code == 0, res.output
    model_id = RunStore.open(base / "run").manifest["model"]["id"]
    (base / "exports" / "e").mkdir(parents=True)  # its parent is no run: the calibration is found only when given
    write_bsfa(base / "exports" / "e", torch.full((1, 2, 2, 4), -math.inf), [1], 128, 64, "mean", {"model": model_id})
    return ckpt, base / "run", base / "exports" / "e"


# ----------------------------------------------------------------------------- the second corpus
def test_text_stdlib_builds_exact_awkward_lengths_deterministically(byte_tok):
    """Exact lengths; the same seed rebuilds the same prompts, another seed others; each prompt is
    a stretch of the docstring corpus and its answer the words that follow; not the text corpus."""
    corpus = stdlib_text()
    assert corpus.isascii() and len(corpus) > 200_000 and "Return" in corpus
    built = build_task_prompts(byte_tok, ["text_stdlib"], AWKWARD, 2, 7)
    assert [len(p.input_ids) for p in built] == [n for n in AWKWARD for _ in range(2)]
    assert build_task_prompts(byte_tok, ["text_stdlib"], AWKWARD, 2, 7) == built
    other = build_task_prompts(byte_tok, ["text_stdlib"], AWKWARD, 2, 8)
    assert all(a.input_ids != b.input_ids for a, b in zip(built, other))
    wrapped, pydoc = corpus * 2, source_text()
    for p in built:
        text = byte_tok.decode(p.input_ids)
        assert p.meta["source"] == STDLIB_SOURCE and wrapped[p.meta["offset"]:].startswith(text)
        rest = wrapped[p.meta["offset"] + len(text):]
        assert p.answer == [" ".join(rest.split()[:20])] and len(p.answer[0].split()) == 20
        assert p.length < 100 or text not in pydoc  # another corpus than the text task's (16 characters may recur)
        assert score(p, " " + p.answer[0]) == 1.0 and score(p, " " + p.answer[0].split()[0] + "x") == 0.0
    assert "text_stdlib" in TEXT_TASKS  # scored by perplexity like text (summary, intervals)


# ----------------------------------------------------------------------------- disjointness
def _calibration(prompts) -> Calibration:
    """The calibration record find_calibration reads from a run manifest holding ``prompts``."""
    return Calibration(None, sorted({p.task for p in prompts}), {(p.task, p.length, p.seed) for p in prompts},
                       {sample_id(p.task, p.length, p.input_ids) for p in prompts})


def test_disjointness_holds_across_corpora_and_task_names(byte_tok, tmp_path):
    """Calibration prompts of task text (seed 0): the other corpus at the same seed is disjoint,
    the same task and seed is refused, and so are the same tokens under another task name."""
    cal_prompts = build_task_prompts(byte_tok, ["text"], [CAL_LENGTH, 300], 2, 0)
    cal = _calibration(cal_prompts)
    stdlib = build_task_prompts(byte_tok, ["text_stdlib"], [CAL_LENGTH, 300], 2, 0)
    check_disjoint(stdlib, cal, 0)  # another corpus: disjoint at the very same seed
    assert not {tuple(p.input_ids) for p in stdlib} & {tuple(p.input_ids) for p in cal_prompts}
    with pytest.raises(UserError, match="is a calibration prompt"):
        check_disjoint(build_task_prompts(byte_tok, ["text"], [300], 1, 0), cal, 0)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"input_ids": cal_prompts[3].input_ids}) + "\n")
    same_tokens = load_prompts_file(path, byte_tok)  # task "file", the calibration prompt's tokens
    with pytest.raises(UserError, match="is a calibration prompt"):
        check_disjoint(same_tokens, cal, 0)
    path.write_text(json.dumps({"input_ids": cal_prompts[3].input_ids[:-1]}) + "\n")
    check_disjoint(load_prompts_file(path, byte_tok), cal, 0)  # one token fewer: another prompt


# ----------------------------------------------------------------------------- the split
def test_split_follows_the_calibration_else_the_holdout_list():
    from sparsecal.evaluation.summary import summarize

    cal = Calibration(Path("run/manifest.json"), ["niah_single", "text"])
    assert [split_of(t, cal, None) for t in ("text", "text_stdlib", "vt")] == [SEEN, HELD_OUT, HELD_OUT]
    assert split_of("text", cal, ["vt"]) == SEEN  # the calibration's manifest decides where there is one
    check_holdout(["vt", "text_stdlib"], cal)
    with pytest.raises(UserError, match="captured task text, so it is not held out"):
        check_holdout(["vt", "text"], cal)
    unknown = Calibration(None)
    assert [split_of(t, unknown, ["vt"]) for t in ("vt", "text")] == [HELD_OUT, SEEN]
    assert split_of("vt", unknown, None) is None and split_of("vt", unknown, []) is None
    # rows written before the split column: it follows from held_out_task
    base = {"length": 64, "label": "dense", "method": "dense", "config": "dense", "score": 1.0, "correct": True,
            "kl": 0.0, "top1": 1.0, "nll": 1.0, "sparsity": 0.0, "decode_sparsity": 0.0, "prefill_s": 0.1,
            "decode_s": 0.1}
    rows = [dict(base, task=t, sample_id=t, held_out_task=h) for t, h in (("vt", True), ("cwe", False), ("text", None))]
    got = {r["task"]: r["split"] for r in summarize(rows).to_dicts()}
    assert got == {"vt": HELD_OUT, "cwe": SEEN, "text": None}


def test_eval_labels_held_out_and_seen_rows_and_reports_both(calibrated, tmp_path, one_thread):
    """Calibrated on text; evaluated on text and, held out, text_stdlib: every row, the manifest's
    prompts, the summary and results.json carry the split; the summary prints both; a held-out
    task the calibration captured is refused in one line."""
    ckpt, run, export = calibrated
    out = tmp_path / "ev"
    res = cli("eval", export, "--out", out, "--model", ckpt, "--tasks", "text", "--holdout-tasks", "text_stdlib",
              "--lengths", 96, "--samples", 1, "--methods", "dense", "--calibration", run)
    assert res.exit_code == 0, res.output
    rows = pl.read_parquet(out / "data" / "rows.parquet")
    assert rows.height == 4 and sorted(rows["task"].unique()) == ["text", "text_stdlib"]
    for r in rows.to_dicts():
        assert r["split"] == (SEEN if r["task"] == "text" else HELD_OUT)
        assert r["held_out_task"] == (r["split"] == HELD_OUT)
    man = json.loads((out / "data" / "manifest.json").read_text())
    assert man["request"]["holdout_tasks"] == ["text_stdlib"] and man["request"]["tasks"] == ["text", "text_stdlib"]
    assert {(p["task"], p["split"], p["corpus"]) for p in man["prompts"]} == {
        ("text", SEEN, "pydoc_data.topics"), ("text_stdlib", HELD_OUT, STDLIB_SOURCE)}
    summary = pl.read_parquet(out / "data" / "summary.parquet")
    assert dict(summary.select("task", "split").unique().iter_rows()) == {"text": SEEN, "text_stdlib": HELD_OUT}
    splits = json.loads((out / "results.json").read_text())["splits"]
    fp32 = [(r["split"], r["tasks"], r["samples"]) for r in splits if r["label"] == "dense:fp32"]
    assert fp32 == [(SEEN, "text", 1), (HELD_OUT, "text_stdlib", 1)]
    assert "dense:fp32 at 96 tokens: seen rel. dense" in " ".join(res.output.split())
    assert_user_error(cli("eval", export, "--out", tmp_path / "ev2", "--model", ckpt, "--tasks", "text_stdlib",
                          "--holdout-tasks", "text", "--lengths", 96, "--calibration", run),
                      "--holdout-tasks text", "captured task text")
    assert_user_error(cli("eval", export, "--out", tmp_path / "ev2", "--model", ckpt, "--holdout-tasks", "text,nope"),
                      "nope")
    assert not (tmp_path / "ev2").exists()
