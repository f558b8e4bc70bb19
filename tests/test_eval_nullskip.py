"""A method that skips nothing equals ``dense`` bit for bit on the evaluation's own path
(evaluation/model.py use_method -> prefill -> generate / answer_logprob, backend "auto", which on
the CPU is the plain-torch reference), prefill and decode, on a tiny random Llama:

    bsfa:2 (thresholds -inf, dense decode), blasst:0.5 (below the law's validated lengths), window:8 (every
    candidate inside the window), each with its default and its dense decode; and the same methods
    under an export's dispatch record at a length below its shortest bucket, against a ``dense``
    under the same record.

On a GPU the kernels run instead (backend auto -> Triton/Gluon): the same assertions hold there
only if every skip-nothing call takes dense's own kernel call, which ``test_skip_nothing_calls_are
_dense_calls`` pins on the CPU (BLASST used to run its own kernel with ln lambda = -inf).
"""
import math
from dataclasses import replace

import pytest
import torch

from sparsecal.evaluation.methods import Method, parse_methods
from sparsecal.evaluation.model import answer_logprob, generate, prefill, use_method
from sparsecal.formats.exports import write_blasst
from sparsecal.integrations.exports import write_bsfa

from helpers import dispatch_export, make_checkpoint

N = 300          # prompt tokens: 3 query blocks of 128, at most 4 candidate key blocks of 64
VALIDATED = 1024  # BLASST's shortest validated length: N is below it, so BLASST runs dense
METHODS = "bsfa:2,blasst:0.5,blasst:0.5:dense,window:8,window:8:dense"


def _export(out, layers=2, heads=4, sparse_layers=None):
    """BSFA thresholds -inf (k = 1, 2); BLASST factors whose law is validated from VALIDATED tokens on
    (``sparse_layers``: the layers BLASST runs, the others left dense by the export)."""
    out.mkdir()
    write_bsfa(out, torch.full((2, layers, heads, 4), -math.inf), [1, 2], 128, 64, "mean", {"model": "tiny"})
    val = {"law": "a/L", "validated_lengths": [VALIDATED, 2 * VALIDATED], "min_length": VALIDATED,
           "max_length": 2 * VALIDATED}
    write_blasst(out, {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": 100.0, "decode": 100.0},
                       "target_sparsity": 0.5, "targets": [], "model": "tiny", "num_layers": layers,
                       "num_heads": heads, "q_block_size": 128, "k_block_size": 64, "schema_version": 1,
                       "validity": {"prefill": val, "decode": val},
                       **({"sparse_layers": sparse_layers} if sparse_layers is not None else {})})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    """A 2-layer random Llama (4 heads, 2 KV heads: GQA) and a prompt of N tokens."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("nullskip")
    path = make_checkpoint(root / "m", module_seed, heads=4, kv_heads=2, layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 300, (N,), generator=torch.Generator().manual_seed(module_seed)).tolist()
    return model, ids, root


def _outputs(model, method: Method, export, ids) -> dict:
    """What the evaluation reads from one method: prefill logits [N, V], the greedy generation, and
    the teacher-forced answer log-likelihood (two decode steps), with the counted tiles."""
    use_method(model, method, export, "tiny")
    pre = prefill(model, ids)
    head = model.get_output_embeddings()
    with torch.no_grad():
        logits = head(pre.hidden)
    gen = generate(model, pre, 3, set())
    ll = answer_logprob(model, pre, ids[10:13])
    return {"logits": logits, "tokens": gen.tokens, "ll": ll, "skipped": pre.skipped + gen.skipped}


def _check_equal(model, export, ids, dense_method: Method) -> None:
    ref = _outputs(model, dense_method, export, ids)
    for m in parse_methods(METHODS):
        got = _outputs(model, m, export, ids)
        assert got["skipped"] == 0, m.label
        assert torch.equal(got["logits"], ref["logits"]), m.label
        assert got["tokens"] == ref["tokens"] and got["ll"] == ref["ll"], m.label


def test_skip_nothing_equals_dense_on_the_eval_path(tiny):
    model, ids, root = tiny
    _check_equal(model, _export(root / "plain"), ids, Method("dense"))
    # the reference is not trivially equal to anything: the model's own SDPA differs from it
    sdpa = _outputs(model, Method("sdpa"), root / "plain", ids)
    assert not torch.equal(sdpa["logits"], _outputs(model, Method("dense"), root / "plain", ids)["logits"])
    use_method(model, Method("sdpa"), root / "plain", "tiny")


def test_layers_the_export_leaves_dense_run_dense_s_path(tiny):
    """A layer outside the export's sparse layers runs what ``dense`` runs (it ran the model's SDPA
    before: on an H100 every BLASST row then differed from dense by rounding, KL ~1.7e-3)."""
    model, ids, root = tiny
    exp = _export(root / "some", sparse_layers=[1])
    ref = _outputs(model, Method("dense"), exp, ids)
    for label in ("blasst:0.5", "blasst:0.5:dense"):
        got = _outputs(model, parse_methods(label)[0], exp, ids)
        assert got["skipped"] == 0 and torch.equal(got["logits"], ref["logits"]), label
        assert model.sparsecal_stats["reachable"][0].sum() == 0, "a layer left dense counts nothing"
    use_method(model, Method("sdpa"), exp, "tiny")


def test_skip_nothing_equals_dense_under_a_dispatch_record(tiny):
    """200 tokens, below the record's shortest bucket (256): bsfa and blasst run every layer dense by
    the plan, window:8 covers every candidate, and each runs the SDPA backend the record picks there,
    as ``dense`` does under the same record."""
    model, ids, root = tiny
    exp, short = dispatch_export(root / "disp"), ids[:200]
    ref = _outputs(model, Method("dense", dispatch=True), exp, short)  # eval's dense+dispatch
    for label in ("bsfa:1", "blasst:0.5", "blasst:0.5:dense", "window:8", "window:8:dense"):
        got = _outputs(model, replace(parse_methods(label)[0], dispatch=True), exp, short)
        assert got["skipped"] == 0 and torch.equal(got["logits"], ref["logits"]), label
        assert got["tokens"] == ref["tokens"] and got["ll"] == ref["ll"], label
    use_method(model, Method("sdpa"), exp, "tiny")


def test_skip_nothing_calls_are_dense_calls(tiny):
    """Below its validated lengths BLASST hands the kernels dense's own arguments (not ln lambda =
    -inf, another compiled kernel on a GPU), in prefill and decode; above them its lambda."""
    from sparsecal.integrations.sparsify import call_args

    model, _, root = tiny
    use_method(model, Method("blasst", 0.5), _export(root / "calls"), "tiny")
    state = model._sparsecal_state
    for mode in ("prefill", "decode"):
        assert call_args(state, 0, mode, N, "cpu") == {"dense": True}
        assert call_args(state, 0, mode, VALIDATED, "cpu") == {"log_lambda": math.log(100.0 / VALIDATED)}
    use_method(model, Method("dense"), root / "calls", "tiny")
    assert call_args(model._sparsecal_state, 0, "prefill", N, "cpu") == {"dense": True}
    use_method(model, Method("sdpa"), root / "calls", "tiny")


@pytest.mark.parametrize("label", ["window:3", "window_sink:3"])
def test_window_runs_dense_s_path_exactly_where_it_skips_nothing(tiny, seed, label):
    """Prefill and decode: the window takes dense's own call (``_window_covers``) at exactly the lengths
    where its reference skips no tile. On an H100 the window decode kernel with nothing skipped differs
    from dense's in rounding (batch 32, 9/3 heads, D 64), so a covered decode must not reach it: the
    issue-27 evaluation's window rows at 1K read KL 0 but answer log-likelihoods off dense's."""
    from sparsecal.integrations.sparsify import _window_covers
    from sparsecal.kernels.sparse.reference import sparse_attention, sparse_decode

    model, _, root = tiny
    exp = _export(root / f"cover-{label.replace(':', '')}")
    use_method(model, parse_methods(label)[0], exp, "tiny")
    st = model._sparsecal_state
    g = torch.Generator().manual_seed(seed)
    edge = st.block_n * (st.window + st.sink)  # the last length the decode row covers
    seen = set()
    for n in (edge - 1, edge, edge + 1, edge + st.block_n, edge + st.block_m + 1, 2 * edge + 5):
        q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
        kw = {"window": st.window, "sink": st.sink}
        _, pre = sparse_attention(q, k, v, 0.25, st.block_m, st.block_n, **kw)
        _, dec = sparse_decode(q[:, :, -1:], k, v, 0.25, st.block_m, st.block_n, **kw)
        for mode, counts in (("prefill", pre), ("decode", dec)):
            nothing = int(counts.skipped.sum()) == 0
            assert _window_covers(st, mode, n) == nothing, (label, mode, n)
            seen.add((mode, nothing))
    assert seen == {(m, x) for m in ("prefill", "decode") for x in (True, False)}  # both sides, both modes
    use_method(model, Method("sdpa"), exp, "tiny")
