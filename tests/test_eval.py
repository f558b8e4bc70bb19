"""`sparsecal eval`: the method grammar, answer scoring on exact-length task prompts, the chunked
fidelity metrics (dense vs dense: KL 0, agreement 1), and a tiny end-to-end evaluation of the real
SmolLM2 at 512 tokens through the CLI with resume, the bench join and the bad-input lines."""
import json
import math
import re
import shutil

import pytest
import torch

from sparsecal.capture.prompts import TASKS, TEXT_TASKS, build_task_prompts
from sparsecal.capture.prompts.scoring import answer_budget, answer_items, is_correct, score
from sparsecal.evaluation.methods import GRAMMAR, Method, parse_methods, with_dense
from sparsecal.evaluation.metrics import Fidelity, Reference, fidelity, sparsity
from sparsecal.formats.errors import UserError

from helpers import (
    CALIBRATION,
    FIXTURE,
    NOOP_BLASST_FACTOR,
    assert_user_error,
    block_counts_torch,
    cli,
    make_checkpoint,
)

CAL = CALIBRATION


# ----------------------------------------------------------------------------- method grammar
def test_methods_grammar():
    ms = parse_methods("dense,bsfa:16,32,64,blasst:0.5,0.7,window:32")
    assert [m.label for m in ms] == ["dense", "bsfa:16", "bsfa:32", "bsfa:64", "blasst:0.5", "blasst:0.7", "window:32"]
    assert [m.config for m in ms] == ["dense", "k=16", "k=32", "k=64", "target=0.5", "target=0.7", "blocks=32"]
    assert ms[1].sparsify_kwargs == {"method": "bsfa", "k": 16, "decode": "dense", "dispatch": False}  # the paper's decode
    assert ms[4].sparsify_kwargs == {"method": "blasst", "target": 0.5, "decode": "sparse", "dispatch": False}
    assert ms[6].sparsify_kwargs == {"method": "window", "blocks": 32, "decode": "sparse", "dispatch": False}
    assert (Method("bsfa", 16, None, True).label, Method("bsfa", 16, None, True).config) == ("bsfa:16+dispatch",
                                                                                          "k=16 dispatch")
    assert ms[0].sparsify_kwargs == {"method": "dense", "precision": "model", "dispatch": False}  # the kernels, skipping off
    assert [m.label for m in with_dense(parse_methods("blasst:0.5, window:0"))] == [
        "dense", "dense:fp32", "blasst:0.5", "window:0"]
    assert with_dense(parse_methods("bsfa:4,dense"))[0] == Method("dense")


@pytest.mark.parametrize("spec,why", [
    ("bsfa:x", "'x' is not a positive integer k"), ("bsfa:0", "'0' is not a positive integer k"),
    ("blasst:1.5", "between 0 and 1"), ("window:-1", "whole number of blocks"),
    ("topk:4", "unknown method 'topk'"), ("16,bsfa:4", "the value '16' follows no method name"),
    ("dense,,bsfa:4", "an item is empty"), ("", "an item is empty"), ("sparse", "'sparse' is not a method"),
    ("bsfa:4,bsfa:4", "bsfa:4 is given twice"), ("dense,4", "follows no method name"),
])
def test_methods_grammar_errors_name_the_grammar(spec, why):
    with pytest.raises(UserError) as e:
        parse_methods(spec)
    assert why in str(e.value) and GRAMMAR in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- tasks and scoring
def _right(s) -> str:
    """A generation that gives the right answer, in the wording a model would use."""
    if s.task in ("niah_single", "niah_multikey"):
        return f" {s.answer[0]}.\n\nThe passage"
    if s.task in TEXT_TASKS:
        return " " + s.answer[0]
    return " " + ", ".join(reversed(s.answer)) + "."


def _wrong(s) -> list[str]:
    """Generations that must not count as right."""
    if s.task == "niah_multikey":
        other = next(n for n in s.meta["numbers"] if n != s.answer[0])
        return [f" {other}.", f" {other} and {s.answer[0]}", " none"]
    if s.task == "niah_single":
        return [f" {int(s.answer[0]) + 1}.", f" {s.answer[0][:-1]}", ""]
    if s.task == "vt":
        return [" " + ", ".join(s.answer[:-1]), " " + ", ".join(s.answer + s.meta["decoy_names"][:1])]
    if s.task == "cwe":
        return [" " + ", ".join(s.answer[:-1]), " " + s.answer[0].upper()]
    return [" " + s.answer[0].split()[0] + "x", " the end"]


def test_task_prompts_exact_length_answer_inside_and_scored(tok):
    samples = build_task_prompts(tok, TASKS, [512, 700], 1, 4242)
    for s in samples:
        assert len(s.input_ids) == s.length
        text = tok.decode(s.input_ids)
        if s.task not in TEXT_TASKS:
            assert all(a in text for a in s.answer), (s.task, s.answer)
        assert score(s, _right(s)) == 1.0 and is_correct(s, _right(s)), (s.task, _right(s))
        for wrong in _wrong(s):
            assert not is_correct(s, wrong), (s.task, wrong)
        assert answer_budget(tok, s) > len(tok(" " + ", ".join(answer_items(s)), add_special_tokens=False)["input_ids"])
    vt = next(s for s in samples if s.task == "vt")
    assert score(vt, " " + ", ".join(vt.answer[:2])) == pytest.approx(2 / len(vt.answer))
    cwe = next(s for s in samples if s.task == "cwe")
    listed = "".join(f"\n{i}. {w}" for i, w in enumerate(cwe.answer, 1))  # the prompt's own list style
    assert is_correct(cwe, listed)


# ----------------------------------------------------------------------------- fidelity metrics
@pytest.fixture
def tiny_llama(tmp_path, seed):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / "tiny", seed, heads=2, kv_heads=1, layers=2)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


@torch.no_grad()
def test_dense_vs_dense_kl_zero_agreement_one(tiny_llama, seed):
    model = tiny_llama
    ids = torch.randint(0, 300, (1, 301), generator=torch.Generator().manual_seed(seed))
    h1 = model.base_model(input_ids=ids).last_hidden_state[0]
    h2 = model.base_model(input_ids=ids).last_hidden_state[0]  # a second, independent dense forward
    head = model.get_output_embeddings()
    fid = fidelity(head, h1, h2, ids[0], chunk=64)
    assert fid.kl == pytest.approx(0.0, abs=1e-7) and fid.top1 == 1.0
    # the perplexity is the model's own next-token loss over the prompt
    assert fid.nll == pytest.approx(float(model(ids, labels=ids).loss), rel=1e-5)
    assert fid.ppl == pytest.approx(math.exp(fid.nll))


@torch.no_grad()
def test_fidelity_chunks_match_the_full_vocabulary_oracle(tiny_llama, seed):
    model = tiny_llama
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (1, 150), generator=g)
    h = model.base_model(input_ids=ids).last_hidden_state[0]
    other = h + 0.5 * torch.randn(h.shape, generator=g)
    head = model.get_output_embeddings()
    fid = fidelity(head, h, other, ids[0], chunk=7)  # ragged last chunk
    p, q = torch.log_softmax(head(h).double(), -1), torch.log_softmax(head(other).double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).mean()
    agree = (p.argmax(-1) == q.argmax(-1)).double().mean()
    nll = -q[:-1].gather(-1, ids[0, 1:, None]).mean()
    assert fid.kl == pytest.approx(float(kl), rel=1e-4) and fid.kl > 0
    assert fid.top1 == pytest.approx(float(agree)) and fid.top1 < 1
    assert fid.nll == pytest.approx(float(nll), rel=1e-5)
    # the dense reference's chunks, cached within a byte budget (all, some, none), give the same
    for budget in (1 << 30, 3 * 7 * 300 * 4, 0):
        ref = Reference(head, h, chunk=7, budget_bytes=budget)
        for _ in range(2):  # a second method reads the cached chunks
            assert fidelity(head, ref, other, ids[0]) == fid
        assert len(ref._cache) == min(22, budget // (7 * 300 * 4))
    assert fidelity(head, Reference(head, h, chunk=7), h, ids[0]) == Fidelity(0.0, 1.0, fidelity(head, h, h, ids[0], chunk=7).nll)


def test_sparsity_counts():
    assert sparsity(torch.tensor([[1, 2], [3, 0]]), torch.tensor([[4, 4], [4, 4]])) == 6 / 16
    assert sparsity(0, 0) == 0.0 and sparsity(3, 12) == 0.25


# ----------------------------------------------------------------------------- runner (tiny Llama)
def _tiny_export(out, layers, heads, model="tiny"):
    """An export that skips nothing: BSFA thresholds -inf, BLASST factor NOOP_BLASST_FACTOR."""
    from sparsecal.formats.exports import write_blasst
    from sparsecal.integrations.exports import write_bsfa

    out.mkdir()
    write_bsfa(out, torch.full((2, layers, heads, 4), -math.inf), [1, 2], 128, 64, "mean", {"model": model})
    write_blasst(out, {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": NOOP_BLASST_FACTOR,
                                                                   "decode": NOOP_BLASST_FACTOR},
                       "target_sparsity": 0.5, "targets": [], "model": model, "num_layers": layers,
                       "num_heads": heads, "q_block_size": 128, "k_block_size": 64, "schema_version": 1})
    return out


def test_relative_accuracy_needs_a_task_dense_can_do():
    """Answer tasks: score / dense's score only where dense scores >= MIN_DENSE_SCORE; text: ppl ratio."""
    import polars as pl

    from sparsecal.evaluation.intervals import MIN_DENSE_SCORE, cells
    from sparsecal.evaluation.summary import curves, summarize

    base = {"length": 1024, "correct": True, "kl": 0.0, "top1": 1.0, "nll": 1.0, "sparsity": 0.0,
            "decode_sparsity": 0.0, "prefill_s": 0.1, "decode_s": 0.1, "held_out_task": False}
    rows = []
    for task, dense_score, method_score in (("niah_single", 0.8, 0.6), ("cwe", MIN_DENSE_SCORE / 2, 0.3)):
        rows.append(dict(base, method="dense", config="dense", label="dense", task=task, score=dense_score,
                         sample_id=task))
        rows.append(dict(base, method="bsfa", config="k=16", label="bsfa:16", task=task, score=method_score,
                         sample_id=task))
        rows.append(dict(base, method="dense", config="fp32 attention", label="dense:fp32", task=task,
                         score=method_score, sample_id=task))
    summ = summarize(rows)
    assert summ.height == 6  # one row per (label, task): dense's values joined once, not per method "dense"
    rel = {(r["label"], r["task"]): r["accuracy_rel_dense"] for r in summ.to_dicts()}
    assert rel[("bsfa:16", "niah_single")] == pytest.approx(0.75) and rel[("bsfa:16", "cwe")] is None
    cur = curves(summ, pl.DataFrame(), cells(rows)).filter(pl.col("label") == "bsfa:16").to_dicts()[0]
    assert cur["accuracy_rel_dense"] == pytest.approx(0.75) and cur["tasks"] == "niah_single"


def test_runner_rows_dense_first_noop_and_window(tok, tmp_path, seed):
    """run_batch (one prompt) on a tiny random Llama with the real tokenizer's vocabulary: thresholds that skip
    nothing reproduce dense (KL 0, agreement 1, sparsity 0); window:0 skips every candidate tile,
    window:0:dense only in prefill. Dense is the project's kernel path with skipping off (it counts
    reachable tiles); the fp32 check equals it on a float32 model."""
    from transformers import AutoModelForCausalLM

    from sparsecal.capture.prompts import build_sample
    from sparsecal.evaluation.rows import run_batch

    make_checkpoint(tmp_path / "m", seed, heads=2, kv_heads=1, head_dim=64, layers=2, vocab_size=len(tok))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="sdpa").eval()
    exp = _tiny_export(tmp_path / "e", 2, 2)
    prompt = build_sample(tok, "niah_single", 333, seed)
    methods = with_dense(parse_methods("bsfa:2,window:0,0:dense"))
    manifest = {"model": {"id": "tiny"}, "prompts": [{"id": "x", "held_out_task": True}]}
    rows = [r for group in run_batch(model, tok, [prompt], methods, [methods], exp, manifest, set()) for r in group]
    dense, fp32, noop, window, prefill_only = rows
    assert [r["label"] for r in rows] == ["dense", "dense:fp32", "bsfa:2", "window:0", "window:0:dense"]
    assert dense["kl"] == 0.0 and dense["top1"] == 1.0 and dense["sparsity"] == 0.0
    assert dense["prefill_reachable"] > 0 and dense["decode_reachable"] > 0  # the kernels ran, skipping off
    assert fp32["kl"] == pytest.approx(0.0, abs=1e-9) and fp32["answer_logprob"] == pytest.approx(dense["answer_logprob"])
    assert noop["answer_logprob"] == pytest.approx(dense["answer_logprob"], abs=1e-4) and dense["answer_logprob"] < 0
    assert prefill_only["prefill_skipped"] == window["prefill_skipped"] and prefill_only["kl"] == window["kl"]
    assert prefill_only["decode_sparsity"] == 0.0 and prefill_only["decode_reachable"] > 0
    assert noop["kl"] == pytest.approx(0.0, abs=1e-6) and noop["top1"] == 1.0
    assert noop["sparsity"] == 0.0 and noop["prefill_reachable"] > 0
    assert noop["generated"] == dense["generated"] and noop["new_tokens"] == answer_budget(tok, prompt)
    cand, reach = block_counts_torch(333, 128, 64)
    assert window["sparsity"] == pytest.approx(int(cand.sum()) / int(reach.sum()))
    assert window["prefill_skipped"] == 2 * 2 * int(cand.sum()) and window["decode_sparsity"] > 0
    assert window["kl"] > 0 and model.config._attn_implementation == "sdpa"  # dense again afterwards
    for r in rows:
        assert r["answer"] == prompt.answer[0] and r["seconds"] >= r["prefill_s"] > 0
        assert 0.0 <= r["score"] <= 1.0 and r["correct"] == (r["score"] == 1.0)


def test_batched_rows_are_each_prompts_own(tok, tmp_path, seed):
    """run_batch of two prompts of one length gives each prompt the row it gets alone: the same
    generation, answer likelihood and fidelity, and its own counted tiles. BLASST's decode skips a
    data-dependent share (q and k projections scaled up so scores spread), so the two prompts'
    decode counts differ and a batch-pooled count would be caught."""
    from transformers import AutoModelForCausalLM

    from sparsecal.capture.prompts import build_sample
    from sparsecal.evaluation.rows import batches, run_batch
    from sparsecal.formats.exports import write_blasst
    from sparsecal.integrations.exports import write_bsfa

    make_checkpoint(tmp_path / "m", seed, heads=2, kv_heads=1, head_dim=64, layers=2, vocab_size=len(tok))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="sdpa").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    exp = tmp_path / "e"
    exp.mkdir()
    write_bsfa(exp, torch.zeros((1, 2, 2, 4)), [1], 128, 64, "mean", {"model": "tiny"})
    write_blasst(exp, {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": 30.0, "decode": 30.0},
                       "target_sparsity": 0.5, "targets": [], "model": "tiny", "num_layers": 2, "num_heads": 2,
                       "q_block_size": 128, "k_block_size": 64, "schema_version": 1})
    prompts = [build_sample(tok, "niah_single", 200, seed + i) for i in range(2)]
    methods = parse_methods("dense,blasst:0.5")  # dense first: the reference
    manifest = {"model": {"id": "tiny"}, "prompts": []}

    def rows(group):
        return [r for g in run_batch(model, tok, group, methods, [methods] * len(group), exp, manifest, set()) for r in g]

    batched = rows(prompts)
    alone = {(r["sample_id"], r["label"]): r for p in prompts for r in rows([p])}
    assert len(batched) == len(alone) == 2 * len(methods)
    for r in batched:
        a = alone[(r["sample_id"], r["label"])]
        assert (r["batch"], a["batch"]) == (2, 1)
        assert min(r["setup_s"], r["answer_s"], r["fidelity_s"], r["prefill_s"], r["decode_s"]) > 0
        for k in ("generated", "new_tokens", "prefill_skipped", "prefill_reachable", "decode_skipped",
                  "decode_reachable"):
            assert r[k] == a[k], (r["label"], k)
        for k in ("kl", "top1", "nll", "answer_logprob"):
            assert r[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (r["label"], k)
    blasst = [r["decode_skipped"] for r in batched if r["label"] == "blasst:0.5"]
    assert blasst[0] != blasst[1] and min(blasst) > 0
    short = build_sample(tok, "niah_single", 150, seed)
    grouped = batches([(prompts[0], 1), (short, 2), (prompts[1], 3)], 8)
    assert [[x for _, x in g] for g in grouped] == [[1, 3], [2]]


# ----------------------------------------------------------------------------- real model, CLI
def _foreign_export(out, model="other/llama", heads=9, blocks=4):
    """A BSFA export of another model (or geometry) for SmolLM2's 30 layers."""
    from sparsecal.integrations.exports import write_bsfa

    out.mkdir()
    write_bsfa(out, torch.zeros(1, 30, heads, blocks), [4], 128, 64, "mean", {"model": model})
    return out


def _short_export(out):
    """The real export cut to its first 4 query blocks: Nmax = 512 tokens."""
    from sparsecal.integrations.exports import load_bsfa, write_bsfa

    exp = load_bsfa(CAL / "export")
    out.mkdir()
    write_bsfa(out, exp.thresholds[..., :4], exp.k_values, 128, 64, "mean", {"model": exp.model})
    shutil.copy(CAL / "export" / "blasst.json", out)
    return out


def _bench_file(path):
    rows = [{"method": "dense", "config": "dense", "length": 512, "speedup": 1.0, "sparsity": 0.0, "task": "kernel"},
            {"method": "blasst", "config": "target=0.5", "length": 512, "speedup": 1.8, "sparsity": 0.0, "task": "kernel"},
            {"method": "blasst", "config": "target=0.5", "length": 512, "speedup": 1.2, "sparsity": 0.0, "task": "ttft"}]
    path.write_text(json.dumps({"kind": "sparsecal-bench", "rows": rows, "provenance": {"gpu": "test"}}))
    return path


def _eval(*args):
    return cli("eval", *args)


@pytest.mark.model  # reads the real SmolLM2's config from its GGUF (head counts, ~5-10 s)
def test_eval_bad_input_one_line(tmp_path):
    """Refused before any model loads, with one line and exit 2, nothing written."""
    out = tmp_path / "ev"
    exp = CAL / "export"
    base = ["--out", out, "--tasks", "niah_single", "--lengths", "512"]
    assert_user_error(_eval(exp, *base, "--methods", "dense,bsfa:x"), "grammar is dense | sdpa |", "bsfa:K")
    assert_user_error(_eval(_foreign_export(tmp_path / "f"), *base, "--methods", "bsfa:4"),
                      "calibrated for model 'other/llama'")
    assert_user_error(_eval(_foreign_export(tmp_path / "g", "smollm2:SmolLM2-135M-Instruct.Q4_1.gguf", 8),
                            *base, "--methods", "bsfa:4"), "num_heads 8")
    assert_user_error(_eval(exp, *base, "--methods", "bsfa:12"), "k=12 is not in export")
    assert_user_error(_eval(exp, *base, "--methods", "bsfa:4:thresholds"), "no BSFA decode thresholds")
    assert_user_error(_eval(exp, *base, "--methods", "blasst:0.6"), "target 0.6 is not in export")
    short = _short_export(tmp_path / "s")
    assert_user_error(_eval(short, "--out", out, "--tasks", "niah_single", "--lengths", "512,640", "--methods",
                            "bsfa:4", "--calibration", CAL), "length 640 is over export", "Nmax of 512",
                      "--reuse-last-threshold")
    assert_user_error(_eval(exp, *base, "--held-out-tasks-only"), "niah_single was a calibration task")
    assert not out.exists()


@pytest.mark.model
def test_eval_real_model_end_to_end(tmp_path, one_thread):
    """SmolLM2 at 512 tokens, dense and BLASST; resume computes nothing; bench join; refusals."""
    import polars as pl

    from sparsecal.formats import results

    out, exp = tmp_path / "ev", CAL / "export"
    # the calibration prompts (seed 100) are refused: evaluation prompts must be held out
    assert_user_error(_eval(exp, "--out", out, "--tasks", "niah_single", "--lengths", "1024", "--seed", "100"),
                      "is a calibration prompt", "choose another --seed")
    args = [exp, "--out", out, "--tasks", "niah_single", "--lengths", "512", "--methods", "dense,blasst:0.5"]
    res = _eval(*args)
    assert res.exit_code == 0, res.output
    # no terminal here: a line per batch and method says where its time went
    assert re.search(r"\d\d:\d\d:\d\d blasst:0\.5 1/1 acc .* batch prefill [\d.]+s decode [\d.]+s answer", res.output)
    rows = pl.read_parquet(out / "data" / "rows.parquet")
    dense, blasst = (rows.filter(pl.col("label") == x).to_dicts()[0] for x in ("dense", "blasst:0.5"))
    assert dense["kl"] == 0.0 and dense["top1"] == 1.0 and dense["sparsity"] == 0.0
    assert dense["correct"] and dense["answer"] in dense["generated"]  # SmolLM2 finds a needle at 512
    # 512 tokens is below the export's shortest validated length (1K): BLASST runs dense there
    assert blasst["kl"] == 0 and blasst["top1"] == 1 and blasst["sparsity"] == 0 and blasst["decode_sparsity"] == 0
    assert blasst["decode_reachable"] > 0 and blasst["held_out_task"] is False  # calibrated on niah_single
    man = json.loads((out / "data" / "manifest.json").read_text())
    assert man["calibration"]["tasks"] == sorted(set(TASKS) - {"text_stdlib"}) and man["request"]["methods"] == "dense,dense:fp32,blasst:0.5"
    assert set(man["export"]["files"]) == {"thresholds.safetensors", "thresholds.bsfa.pt", "blasst.json"}
    (run,) = man["runs"]  # which code on which machine made the rows
    assert run["phase"] == "rows" and run["device"] == "cpu" and run["world"] == 1 and run["versions"]["torch"]
    # the dashboard reads the result file; the per-sample tables stay out of its way
    pts = results.curves([results.read_result_file(p) for p in results.result_files([out])])
    assert sorted(pts["config"]) == ["dense", "fp32 attention", "target=0.5"]
    assert pts["accuracy_rel_dense"].is_not_null().all()
    # resume: nothing new computed, rows untouched
    before = (out / "data" / "rows.parquet").read_bytes()
    (out / "data" / ".rows.parquet.tmp-1").write_bytes(b"cut short")  # an interrupted write
    res = _eval(*args)
    assert res.exit_code == 0 and "0 rows to compute" in res.output, res.output
    assert (out / "data" / "rows.parquet").read_bytes() == before
    assert len(json.loads((out / "data" / "manifest.json").read_text())["runs"]) == 1  # nothing run: none noted
    assert not (out / "data" / ".rows.parquet.tmp-1").exists()
    assert_user_error(_eval(exp, "--out", out, "--methods", "dense,blasst:0.7"), "different request", "methods")
    # bench join later: the recorded options are reused, curves.parquet carries speedups and provenance
    res = _eval(exp, "--out", out, "--bench", _bench_file(tmp_path / "bench.json"))
    assert res.exit_code == 0 and "0 rows to compute" in res.output, res.output
    cur = pl.read_parquet(out / "curves.parquet").filter(pl.col("method") == "blasst").to_dicts()[0]
    assert cur["speedup"] == 1.8 and cur["bench_speedup_kernel"] == 1.8 and cur["bench_speedup_ttft"] == 1.2
    assert cur["accuracy_rel_dense"] == blasst["score"] / dense["score"]
    meta = pl.read_parquet_metadata(out / "curves.parquet")
    assert json.loads(meta["bench_provenance"])[0]["provenance"] == {"gpu": "test"}
    assert json.loads(meta["eval_provenance"])["model"] == man["model"]["id"]
    pts = results.curves([results.read_result_file(p) for p in results.result_files([out])])
    assert pts.filter(pl.col("method") == "blasst")["speedup"].to_list() == [1.8]


def test_merge_shards_of_one_evaluation(tmp_path):
    """Shards of one export and method list merge into one directory whose summary has every cell;
    a shard of another method list is refused in one line."""
    from sparsecal.evaluation.command import finish
    from sparsecal.evaluation.store import EvalStore, merge_shards

    base = {"model": {"id": "m"}, "export": {"files": {}}, "export_path": "e", "calibration": {}, "versions": {}}
    for task, n in (("niah_single", 3), ("text", 2)):
        prompts = [{"id": f"{task}{i}", "task": task, "length": 512} for i in range(n)]
        st = EvalStore.create(tmp_path / task, dict(base, request={"methods": "dense,bsfa:4", "samples": n},
                                                    prompts=prompts))
        for p in prompts:
            for label, got in (("dense", 1.0), ("bsfa:4", 0.0 if p["id"] == "niah_single0" else 1.0)):
                st.add_row({"sample_id": p["id"], "task": task, "length": 512, "label": label,
                            "method": label.split(":")[0], "config": "dense" if label == "dense" else "k=4",
                            "score": got, "correct": got == 1.0, "kl": 0.0, "top1": 1.0, "nll": 1.0,
                            "sparsity": 0.0, "decode_sparsity": 0.0, "prefill_s": 0.1, "decode_s": 0.1,
                            "held_out_task": True, "answer_logprob": -1.0})
    EvalStore.open(tmp_path / "text").note_run("rows", device="cpu")
    merged = merge_shards(tmp_path / "all", [tmp_path / "niah_single", tmp_path / "text"])
    assert merged.manifest["request"]["samples"] == {"niah_single@512": 3, "text@512": 2} and len(merged.rows) == 10
    (run,) = merged.manifest["runs"]  # each shard's runs, named by their shard
    assert run["shard"] == str(tmp_path / "text") and run["phase"] == "rows" and "commit" in run
    finish(EvalStore.open(tmp_path / "all"))
    doc = json.loads((tmp_path / "all" / "results.json").read_text())
    row = next(r for r in doc["rows"] if r["label"] == "bsfa:4")
    assert row["accuracy_rel_dense"] == pytest.approx((2 / 3 + 1) / 2) and row["task"] == "niah_single,text"
    other = EvalStore.create(tmp_path / "other", dict(base, request={"methods": "dense"}, prompts=[]))
    with pytest.raises(UserError, match="other methods"):
        merge_shards(tmp_path / "x", [tmp_path / "text", other.root])
    # each shard's timing records come along; a configuration timed in two shards is refused
    import polars as pl

    from sparsecal.evaluation.store import TIMING, write_parquet

    def timed(n: int, ms: float, **more) -> pl.DataFrame:   # one timing record, its required columns
        return pl.DataFrame({"label": ["bsfa:4"], "length": [n], "ttft_ms": [ms], "tpot_ms": [ms / 10],
                             "speedup_ttft": [1.1], "speedup_tpot": [1.0], "sparsity_match": [True],
                             "decode_sparsity_match": [True], "speed_device": ["cpu"], **more})

    for shard, n in (("niah_single", 512), ("text", 1024)):
        write_parquet(tmp_path / shard / TIMING, timed(n, 1.0))
    joined = merge_shards(tmp_path / "timed", [tmp_path / "niah_single", tmp_path / "text"])
    assert pl.read_parquet(joined.root / TIMING)["length"].to_list() == [512, 1024]
    write_parquet(tmp_path / "text" / TIMING, timed(512, 2.0))
    with pytest.raises(UserError, match="timed in two shards"):
        merge_shards(tmp_path / "twice", [tmp_path / "niah_single", tmp_path / "text"])
    assert not (tmp_path / "twice").exists()  # nothing written
    write_parquet(tmp_path / "text" / TIMING, timed(1024, 2.0, sparsity=[1.7]))   # a shard's values are checked
    with pytest.raises(UserError, match=r"column sparsity must be in \[0, 1\]; row 0 holds 1.7"):
        merge_shards(tmp_path / "bad", [tmp_path / "niah_single", tmp_path / "text"])
    assert not (tmp_path / "bad").exists()


def test_export_with_a_dispatch_record_is_recorded(tmp_path):
    """An export made with --break-even: the evaluation notes the break-even file (its rows then
    measure what sparsify runs with dispatch); one without has none."""
    from sparsecal.evaluation.inputs import load_export

    from helpers import dispatch_export

    model = {"id": "tiny", "num_layers": 2, "num_heads": 4}
    info = load_export(dispatch_export(tmp_path / "with"), model)
    assert info.dispatch == {"name": "be.json", "gpu": "test", "commit": "c0ffee1", "date": None}
    assert load_export(dispatch_export(tmp_path / "without", dispatch=False), model).dispatch is None


@pytest.mark.parametrize("lengths", ["[256, oops", "[-3, 0]", "{\"a\": 1}"])
def test_export_metadata_lengths_are_checked(tmp_path, lengths):
    """An export's thresholds metadata `lengths` (the calibration lengths eval reports against) is a
    JSON list of positive token counts, else one line (before: a JSONDecodeError, or -3 accepted)."""
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import save_file

    from sparsecal.evaluation.inputs import load_export

    export = tmp_path / "export"
    shutil.copytree(FIXTURE / "export", export)
    model = json.loads((FIXTURE / "manifest.json").read_text())["model"]
    path = export / "thresholds.safetensors"
    assert load_export(export, model).calibration_lengths
    with safe_open(str(path), framework="np") as f:
        meta, arrays = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not iterable
    save_file(arrays, str(path), metadata=dict(meta, lengths=lengths))
    with pytest.raises(UserError, match="metadata lengths .* is not a list of positive token counts"):
        load_export(export, model)
