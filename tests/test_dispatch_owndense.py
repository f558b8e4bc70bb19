"""The project's dense decode kernel as a decode dispatch backend (issue 28), on the CPU under the
Triton interpreter: the break-even bench's quick decode rows time it (SPARSECAL_DENSE) beside SDPA;
a record picks per length the fastest reproducible decode backend (never cuDNN) while the
break-even stays against the fastest of all; a dispatched dense decode step under that record runs
the group kernel's dense path (for ``dense`` and for a method the plan runs dense alike, the same
logits, the greedy tokens of dense without dispatch); a record written before (cuDNN picked) still
runs Flash; SPARSECAL_DENSE outside decode is refused in one line."""
import json

import numpy as np
import pytest
import torch

import sparsecal
from sparsecal.bench import breakeven as B
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.formats import dispatch as D
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import load_blasst
from sparsecal.kernels.jit import LAST_COMPILED

from helpers import DISPATCH_LENGTHS, INTERPRETER_WARNINGS, tiny_dispatch_export

OWN = D.OWN_DENSE
PTS = [{"sparsity": 0.0, "ms": 10.0}, {"sparsity": 1.0, "ms": 2.0}]  # against d ms: break-even (10 - d) / 8
# decode dense timings per length: at 256 cuDNN fastest of all, the project's kernel of the reproducible
# ones; at 512 cuDNN fastest, Flash of the reproducible ones
DECODE_DENSE = {256: {"CUDNN_ATTENTION": 5.0, "FLASH_ATTENTION": 7.0, OWN: 6.0},
                512: {"CUDNN_ATTENTION": 5.0, "FLASH_ATTENTION": 6.5, OWN: 6.8}}


def _be_doc(decode_dense=None, batch16=None):
    """Prefill rows (cuDNN 6 ms, Flash 7) and graph decode rows of batch 1 (head decision) per length
    with ``decode_dense`` (default DECODE_DENSE) at head_dim 64, group 2, both methods; ``batch16``:
    the dense timings of batch-16 rows too."""
    measured = [{"method": m, "head_dim": 64, "group": 2, "length": n, "points": PTS,
                 "dense": {"CUDNN_ATTENTION": 6.0, "FLASH_ATTENTION": 7.0}} for m in D.METHODS for n in DISPATCH_LENGTHS]
    for batch, dense in ((1, decode_dense or DECODE_DENSE), (16, batch16)):
        measured += [{"phase": "decode", "timing": "graph", "decision": "head", "batch": batch, "method": m,
                      "head_dim": 64, "group": 2, "length": n, "points": PTS, "dense": dense[n]}
                     for m in D.METHODS for n in DISPATCH_LENGTHS] if dense else []
    geo = {"block_m": 128, "block_n": 64, "heads": 4, "kv_heads": 2, "head_dim": 64}
    return D.break_even_file(measured, geo, {"gpu": "test", "commit": "c0ffee1"})


def _record(be_doc=None):
    """Prefill never sparse; BSFA k=1 decode topk sparsity 0.2 on both layers (below every decode
    break-even: every decode step dense by the plan)."""
    zero = np.zeros((2, 2))
    cfgs = [{"method": "bsfa", "config": "k=1", "value": 1, "source": "test", "sparsity": zero,
             "decode": {"topk": {"source": "test", "sparsity": np.full((2, 2), 0.2)}}},
            {"method": "blasst", "config": "target=0.5", "value": 0.5, "source": "test", "sparsity": zero}]
    return json.loads(json.dumps(D.dispatch_record(cfgs, DISPATCH_LENGTHS, be_doc or _be_doc(), "be.json", 64, 2)[0]))


def _cudnn_record():
    """A record as written before decode picks were limited to reproducible backends: cuDNN, the
    fastest of all, as every decode entry's backend."""
    rec = _record(_be_doc({n: {"CUDNN_ATTENTION": 5.0, "FLASH_ATTENTION": 7.0} for n in DISPATCH_LENGTHS}))
    rec["configs"][0]["decode"]["by_batch"]["1"]["dense_backend"] = ["CUDNN_ATTENTION"] * 2
    return rec


def test_the_decode_entry_picks_the_fastest_reproducible_backend():
    rec = _record()
    D.check_dispatch("blasst.json", rec, 2)
    bsfa = rec["configs"][0]
    one = bsfa["decode"]["by_batch"]["1"]
    assert one["dense_backend"] == [OWN, "FLASH_ATTENTION"]
    assert one["break_even"] == [0.625, 0.625]  # against cuDNN's 5 ms, the fastest of all: not weakened
    assert bsfa["dense_backend"] == ["CUDNN_ATTENTION"] * 2  # prefill as before
    rows = [r for r in _be_doc()["rows"] if r["phase"] == "decode"]
    assert {r["dense_backend"] for r in rows} == {"CUDNN_ATTENTION"} and {r["dense_ms"] for r in rows} == {5.0}
    # the project's kernel the fastest of all: the row's own dense path, break-even against it
    fast = _be_doc({n: {"FLASH_ATTENTION": 7.0, OWN: 6.0} for n in DISPATCH_LENGTHS})
    assert {(r["dense_backend"], r["break_even"]) for r in fast["rows"] if r["phase"] == "decode"} == {(OWN, 0.5)}
    assert _record(fast)["configs"][0]["decode"]["by_batch"]["1"]["dense_backend"] == [OWN, OWN]
    # rows that timed no reproducible backend: the row's own (a cuDNN pick, decode_backend runs Flash)
    only = _record(_be_doc({n: {"CUDNN_ATTENTION": 5.0} for n in DISPATCH_LENGTHS}))
    assert only["configs"][0]["decode"]["by_batch"]["1"]["dense_backend"] == ["CUDNN_ATTENTION"] * 2


def test_the_project_kernel_outside_decode_is_refused_in_one_line(tmp_path):
    rec = _record()
    rec["configs"][0]["dense_backend"][0] = OWN
    with pytest.raises(UserError, match=f"configs\\[0\\] names {OWN} as a prefill dense backend") as e:
        D.check_dispatch("blasst.json", rec, 2)
    assert "\n" not in str(e.value) and "export it again" in str(e.value)
    rec = _record()
    rec["configs"][0]["decode"]["by_batch"]["1"]["dense_backend"][0] = "TRITON"
    with pytest.raises(UserError, match="configs\\[0\\] does not hold"):
        D.check_dispatch("blasst.json", rec, 2)
    doc = _be_doc()  # a break-even file: a prefill row naming it (as fastest, or timed) is refused
    i = next(i for i, r in enumerate(doc["rows"]) if r["phase"] == "prefill")
    for damage in (lambda r: r.update(dense_backend=OWN), lambda r: r["dense"].update({OWN: 1.0})):
        bad = json.loads(json.dumps(doc))
        damage(bad["rows"][i])
        (tmp_path / "be.json").write_text(json.dumps(bad))
        with pytest.raises(UserError, match=f"rows\\[{i}\\] is not a") as e:
            D.load_break_even(tmp_path / "be.json")
        assert "\n" not in str(e.value)


def _greedy(model, seed, n=300, new=2):
    """A prefill of n tokens (bucket 256: prefill dense by the plan), ``new`` greedy decode steps
    (against n + 1, n + 2 keys: bucket 256): (the tokens, the last step's logits, whether the last
    step ran the group kernel's dense path: its table's launch at batch 1, D = 64, G = 2, the
    attend pass with skipping off, decode_group_dense.DENSE_TABLE)."""
    ids = torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))
    LAST_COMPILED.pop("group_dense", None)
    LAST_COMPILED.pop("group_attend", None)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, n:], out.logits[-1], {"group_dense", "group_attend"} & set(LAST_COMPILED) != set()


@INTERPRETER_WARNINGS
def test_a_dispatched_dense_decode_runs_the_project_kernel(tiny_sdpa_model, tmp_path, seed):
    """Under a record that picks SPARSECAL_DENSE at bucket 256, ``dense`` and BSFA (every decode layer
    dense by the plan) run the group kernel's dense path for decode: the same logits bit for bit,
    counting nothing, the greedy tokens of dense without dispatch (the kernels with skipping off);
    ``dense`` at precision fp32 too. A record written before (cuDNN picked) loads and runs Flash, not the kernel."""
    from sparsecal.integrations.sparsify import dense_first, dispatched_dense

    exp = tiny_dispatch_export(tmp_path / "e", _record())
    sparsecal.sparsify(tiny_sdpa_model, exp, method="dense", dispatch=False)
    base, base_logits, _ = _greedy(tiny_sdpa_model, seed)
    sparsecal.sparsify(tiny_sdpa_model, exp, method="dense")
    assert dense_first(tiny_sdpa_model._sparsecal_state, "decode", 301) == OWN
    tokens, want, ran = _greedy(tiny_sdpa_model, seed)
    assert ran and torch.equal(tokens, base)
    torch.testing.assert_close(want, base_logits, atol=1e-4, rtol=1e-4)
    sparsecal.sparsify(tiny_sdpa_model, exp, method="bsfa", k=1, decode="topk")
    state = tiny_sdpa_model._sparsecal_state
    assert [dispatched_dense(state, layer, "decode", 301, 1) for layer in (0, 1)] == [OWN, OWN]
    assert dispatched_dense(state, 0, "decode", 600, 1) == "FLASH_ATTENTION"  # bucket 512: Flash
    tokens, got, ran = _greedy(tiny_sdpa_model, seed)
    assert ran and torch.equal(got, want) and torch.equal(tokens, base)
    assert tiny_sdpa_model.sparsecal_stats["reachable"].sum() == 0
    sparsecal.sparsify(tiny_sdpa_model, exp, method="dense", precision="fp32")
    tokens, got, ran = _greedy(tiny_sdpa_model, seed)
    assert ran and torch.equal(tokens, base)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    old = tiny_dispatch_export(tmp_path / "old", _cudnn_record())
    assert load_blasst(old)["dispatch"]["configs"][0]["decode"]["by_batch"]["1"]["dense_backend"][0] == "CUDNN_ATTENTION"
    sparsecal.sparsify(tiny_sdpa_model, old, method="bsfa", k=1, decode="topk")
    state = tiny_sdpa_model._sparsecal_state
    assert [dispatched_dense(state, layer, "decode", 301, 1) for layer in (0, 1)] == ["FLASH_ATTENTION"] * 2
    tokens, _, ran = _greedy(tiny_sdpa_model, seed)
    assert not ran and torch.equal(tokens, base)
    sparsecal.densify(tiny_sdpa_model)


def test_the_dense_decode_backend_follows_the_batch(tiny_sdpa_model, tmp_path, seed):
    """Batch 1 rows pick the project's kernel at bucket 256, batch 16 rows Flash (its kernel slower
    there): every dense decode step (``dense`` and a step the plan runs dense alike) runs the pick of
    the largest measured batch <= its own (below batch 1: batch 1's), and a batch-1 generation runs
    the project's kernel."""
    from sparsecal.integrations.sparsify_dense import dense_first, dispatched_dense

    slow = {n: {"CUDNN_ATTENTION": 5.0, "FLASH_ATTENTION": 6.0, OWN: 6.5} for n in DISPATCH_LENGTHS}
    exp = tiny_dispatch_export(tmp_path / "e", _record(_be_doc(batch16=slow)))
    sparsecal.sparsify(tiny_sdpa_model, exp, method="dense")
    state = tiny_sdpa_model._sparsecal_state
    assert state.dense_backends["decode"]["batches"] == [1, 16]
    assert [dense_first(state, "decode", 301, b) for b in (None, 1, 8, 16, 64)] == [OWN, OWN, OWN, "FLASH_ATTENTION",
                                                                                  "FLASH_ATTENTION"]
    sparsecal.sparsify(tiny_sdpa_model, exp, method="bsfa", k=1, decode="topk")
    state = tiny_sdpa_model._sparsecal_state
    assert [dispatched_dense(state, 0, "decode", 301, b) for b in (1, 16)] == [OWN, "FLASH_ATTENTION"]
    _, _, ran = _greedy(tiny_sdpa_model, seed)
    assert ran
    sparsecal.densify(tiny_sdpa_model)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("own") / "run"
    write_synthetic_run(root, [1024, 2048], 2, layers=2, heads=4)
    return root


@INTERPRETER_WARNINGS
def test_bench_quick_decode_rows_time_the_project_kernel(run, tmp_path):
    out = tmp_path / "be.json"
    B.main(["--run", str(run), "--out", str(out), "--quick", "--decode-lengths", "130", "--methods", "blasst",
            "--decode-sparsities", "0", "--rounds", "1"])
    (row,) = D.load_break_even(out)["rows"]
    assert row["phase"] == "decode" and set(row["dense"]) == {"FLASH_ATTENTION", "MATH", OWN}
    assert row["dense"][OWN] > 0 and row["dense_ms"] == min(row["dense"].values())
    assert row["dense_backend"] == min(row["dense"], key=row["dense"].get)


def test_where_the_project_kernel_runs_a_dense_decode_step(monkeypatch):
    """One query token, no window, chunk, softcap or sinks, D <= 128 (what the bench times), on CUDA or
    under the interpreter; elsewhere the step runs SDPA with Flash first."""
    from sparsecal.integrations.sparsify_dense import own_dense_runs

    q = torch.zeros(1, 4, 1, 64)
    assert own_dense_runs(q, None, None, {})
    assert not own_dense_runs(torch.zeros(1, 4, 2, 64), None, None, {})
    assert not own_dense_runs(torch.zeros(1, 4, 1, 256), None, None, {})
    assert not own_dense_runs(torch.zeros(1, 4, 1, 80), None, None, {})
    assert not own_dense_runs(q, 128, None, {}) and not own_dense_runs(q, None, 256, {})
    assert not own_dense_runs(q, None, None, {"softcap": 30.0})
    assert not own_dense_runs(q, None, None, {"s_aux": torch.zeros(4)})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not own_dense_runs(q, None, None, {})


def test_a_forward_that_counts_nothing_zeroes_nothing(tiny_sdpa_model, tmp_path):
    """Layer 0 zeroes the counts only when a layer wrote them since: under a plan that runs every
    layer dense a forward launches no zero_ after the first, and counts written before (a sparse
    forward's) still read zero after the next forward that counts nothing."""
    exp = tiny_dispatch_export(tmp_path / "e", _record())
    sparsecal.sparsify(tiny_sdpa_model, exp, method="bsfa", k=1, decode="topk")
    ids = torch.randint(0, 300, (1, 300), generator=torch.Generator().manual_seed(1))

    def zeroes():
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            tiny_sdpa_model(ids)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::zero_")

    assert zeroes() == 2  # the first forward: both stored tensors once (the totals are their sums)
    assert zeroes() == 0
    state, stats = tiny_sdpa_model._sparsecal_state, tiny_sdpa_model.sparsecal_stats
    for t in stats.held():  # as a sparse forward leaves them
        t.fill_(7)
    assert int(stats["skipped"][0, 0]) == 7  # one row
    state.counts_written = True
    assert zeroes() == 2 and all(int(t.abs().sum()) == 0 for t in stats.values())
    sparsecal.densify(tiny_sdpa_model)
