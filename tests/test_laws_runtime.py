"""Laws said right at run time (issue 27, part 6): ``sparsify`` runs BLASST dense past the longest
length its law was validated on unless told to extrapolate, and flags every forward's regime
(below | interpolated | extrapolated) for the evaluation's rows and summary.

A tiny random Llama (2 layers, GQA) on the evaluation's own path (evaluation/model.py, backend auto =
the plain-torch reference on the CPU) and a BLASST export whose law is validated on 64-128 tokens
with 16 x 16 tiles; a/L = 100 / L skips tiles at every length tested, so "dense" is never trivial.
"""
import json
import math

import polars as pl
import pytest
import torch

from sparsecal.evaluation.laws import check_extrapolate, law_cells, law_lines
from sparsecal.evaluation.methods import Method
from sparsecal.evaluation.model import answer_logprob, generate, prefill, use_method
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import blasst_law_regime, blasst_runtime_lambda, write_blasst
from sparsecal.integrations.sparsify_laws import worst_regime

from helpers import cli, make_checkpoint

LO, HI, A, BLOCK = 64, 128, 100.0, 16   # validated lengths LO..HI, factor a, tile size
BLASST = Method("blasst", 0.5)
SHARPEN = 8.0                            # query weights scaled: the random model's scores spread out


def _export(out, model="tiny", heads=4, lengths=(LO, HI), a=A):
    """A BLASST export of a 2-layer model: a/L validated on ``lengths`` (prefill and decode)."""
    out.mkdir(parents=True)
    val = {"law": "a/L", "validated_lengths": list(lengths), "min_length": lengths[0], "max_length": lengths[-1]}
    write_blasst(out, {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": a, "decode": a},
                       "target_sparsity": 0.5, "targets": [], "model": model, "num_layers": 2,
                       "num_heads": heads, "q_block_size": BLOCK, "k_block_size": BLOCK, "schema_version": 1,
                       "validity": {"prefill": val, "decode": val}})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("laws")
    path = make_checkpoint(root / "m", module_seed, heads=4, kv_heads=2, layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    with torch.no_grad():  # sharper scores than the random init's near-uniform attention: tiles to skip
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(module_seed)).tolist()
    return model, ids, _export(root / "export")


def _run(model, method, export, ids, extrapolate=False, new=3) -> dict:
    """What an evaluation row reads: prefill logits, greedy tokens, answer log-likelihood, counts, laws."""
    use_method(model, method, export, "tiny", extrapolate)
    pre = prefill(model, ids)
    with torch.no_grad():
        logits = model.get_output_embeddings()(pre.hidden)
    ll = answer_logprob(model, pre, ids[10:13])  # on a copy of the cache, before generate (run_sample's order)
    gen = generate(model, pre, new, set())
    return {"logits": logits, "tokens": gen.tokens, "ll": ll, "pre": pre, "gen": gen}


def test_policy_and_regimes():
    v = {"min_length": LO, "max_length": HI}
    assert [blasst_law_regime(n, v) for n in (LO - 1, LO, 100, HI, HI + 1)] == [
        "below", "interpolated", "interpolated", "interpolated", "extrapolated"]
    assert blasst_law_regime(10_000, None) is None
    assert blasst_runtime_lambda(A, HI, LO, HI) == A / HI and blasst_runtime_lambda(A, HI + 1, LO, HI) is None
    assert blasst_runtime_lambda(A, HI + 1, LO) == A / (HI + 1)  # no max_length given: opted in
    assert worst_regime(["interpolated", "extrapolated", "interpolated"]) == "extrapolated"
    assert worst_regime(["interpolated", "below"]) == "below" and worst_regime([None, None]) is None


def test_past_the_law_runs_dense_counts_nothing_and_is_flagged(tiny):
    """200 tokens, past the longest validated length (128): prefill and decode equal ``dense`` bit for
    bit, skip nothing, and say ``extrapolated``; opted in, the same prompt skips tiles."""
    model, ids, export = tiny
    dense = _run(model, Method("dense"), export, ids)
    got = _run(model, BLASST, export, ids)
    assert torch.equal(got["logits"], dense["logits"])
    assert got["tokens"] == dense["tokens"] and got["ll"] == dense["ll"]
    assert got["pre"].skipped == 0 and got["gen"].skipped == 0 and got["pre"].reachable > 0
    assert (got["pre"].law, got["gen"].law) == ("extrapolated", "extrapolated")
    assert (dense["pre"].law, dense["gen"].law) == (None, None)  # dense has no law
    assert model.sparsecal_law == {"mode": "decode", "length": 202, "law": "extrapolated"}
    opt = _run(model, BLASST, export, ids, extrapolate=True)
    assert opt["pre"].skipped > 0 and opt["gen"].skipped > 0
    assert (opt["pre"].law, opt["gen"].law) == ("extrapolated", "extrapolated")
    assert not torch.equal(opt["logits"], dense["logits"])
    use_method(model, Method("sdpa"), export, "tiny")


def test_inside_the_law_sparse_and_the_edge_is_strict(tiny):
    """100 tokens: interpolated and sparse in both phases. 127 tokens: prefill interpolated, decode
    steps at 128 (inside) and 129 (past: dense unless opted in), so the generation says extrapolated.
    40 tokens: below, dense."""
    model, ids, export = tiny
    mid = _run(model, BLASST, export, ids[:100])
    assert (mid["pre"].law, mid["gen"].law) == ("interpolated", "interpolated")
    assert mid["pre"].skipped > 0 and mid["gen"].skipped > 0
    edge = _run(model, BLASST, export, ids[:127])
    assert (edge["pre"].law, edge["gen"].law) == ("interpolated", "extrapolated")
    from sparsecal.integrations.sparsify import call_args

    state = model._sparsecal_state
    assert call_args(state, 0, "decode", HI, "cpu") == {"log_lambda": math.log(A / HI)}
    assert call_args(state, 0, "decode", HI + 1, "cpu") == {"dense": True}  # dense's own call
    state.extrapolate = True
    assert call_args(state, 0, "decode", HI + 1, "cpu") == {"log_lambda": math.log(A / (HI + 1))}
    short = _run(model, BLASST, export, ids[:40])
    assert (short["pre"].law, short["pre"].skipped) == ("below", 0)
    use_method(model, Method("sdpa"), export, "tiny")


def test_rows_summary_lines_and_option_check():
    rows = [{"label": "blasst:0.5", "length": 8192, "prefill_law": "interpolated", "decode_law": "extrapolated"},
            {"label": "blasst:0.5", "length": 8192, "prefill_law": "interpolated", "decode_law": "extrapolated"},
            {"label": "dense", "length": 8192, "prefill_law": None, "decode_law": None}]
    assert law_cells(rows) == [{"label": "blasst:0.5", "length": 8192, "samples": 2,
                                "prefill": {"interpolated": 2}, "decode": {"extrapolated": 2}}]
    assert law_lines(rows, False) == [("law extrapolated: blasst:0.5 decode at 8192 tokens in 2 of 2 samples; ran "
                                       "dense there (pass --extrapolate to apply a/L anyway)")]
    check_extrapolate(True, "blasst:0.5,bsfa:4")
    check_extrapolate(False, "bsfa:4")
    with pytest.raises(UserError, match="has no blasst method"):
        check_extrapolate(True, "dense,bsfa:4")


def test_eval_extrapolate_end_to_end(tmp_path, seed, one_thread):
    """`sparsecal eval --extrapolate` at 96 tokens on a law validated on 32-64 tokens: the rows say
    extrapolated (that it then skips is test_past_the_law_...'s); the manifest records the option;
    the plan and the summary say so."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sparsecal.capture.models import load_config, model_info, resolve_model

    ckpt = make_checkpoint(tmp_path / "tiny", seed, heads=2, kv_heads=1, layers=2, vocab_size=256)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tk).save_pretrained(ckpt)
    ms = resolve_model(str(ckpt))
    export = _export(tmp_path / "export", model_info(ms, load_config(ms))["id"], heads=2, lengths=(32, 64), a=40.0)
    out = tmp_path / "ev"
    res = cli("eval", export, "--out", out, "--model", ckpt, "--tasks", "text", "--lengths", 96, "--samples", 1,
              "--methods", "blasst:0.5", "--extrapolate")
    assert res.exit_code == 0, res.output
    rows = {r["label"]: r for r in pl.read_parquet(out / "data" / "rows.parquet").to_dicts()}
    assert rows["blasst:0.5"]["prefill_law"] == "extrapolated" == rows["blasst:0.5"]["decode_law"]
    assert rows["dense"]["prefill_law"] is None
    assert json.loads((out / "data" / "manifest.json").read_text())["request"]["extrapolate"] is True
    laws = json.loads((out / "results.json").read_text())["laws"]
    assert [(c["label"], c["prefill"]) for c in laws] == [("blasst:0.5", {"extrapolated": 1})]
    text = " ".join(res.output.split())
    assert "blasst:0.5 prefill at 96 tokens: past the law's validated lengths (32-64)" in text
    assert "law extrapolated: blasst:0.5 prefill at 96 tokens in 1 of 1 samples; a/L applied" in text
