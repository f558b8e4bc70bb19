"""The Triton sparse prefill kernel against the plain-torch sparse reference (TRITON_INTERPRET=1):
outputs and per-head skip counts for BSFA, BLASST (three scan orders), window and dense; uncapped
and soft-capped (thresholds cut from the capped tile statistics), D 64/128/256, GQA 1-16, MQA."""
import math

import pytest
import torch

from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.reference import instrumented_attention
from sparsecal.kernels.dense import attention_dense
from sparsecal.kernels.sparse.prefill import sparse_attention_triton
from sparsecal.kernels.sparse.reference import sparse_attention

from helpers import (
    TOL,
    blasst_cut_log_lambda,
    bsfa_cut_thresholds,
    candidate_mask,
    far_tiles,
    prefill_tiles,
    sparse_inputs,
)

# One program per (sequence, head, query block), one step per reachable tile: the interpreter's
# cost. Each case is as small as its coverage allows (every N ragged for BM and BN, four query blocks
# with up to six candidates, so BLASST and BSFA cut inside each block's candidates).
CASES = [  # (B, N, H, Hkv, D, BM, BN, dtype)
    (1, 120, 2, 2, 64, 32, 16, torch.float32),    # one query head per KV head
    (2, 100, 2, 1, 64, 32, 16, torch.bfloat16),   # a batch; GQA on a single KV head
    (1, 110, 2, 2, 128, 32, 16, torch.float16),   # D = 128
    (1, 131, 4, 1, 64, 48, 24, torch.float32),    # block sizes that are not powers of two; group 4
]


SOFTCAP_CASES = [  # (B, N, H, Hkv, D, BM, BN, dtype, softcap; 0 = off)
    (1, 100, 4, 1, 64, 32, 16, torch.bfloat16, 4.0),     # GQA 4 on one KV head (MQA)
    (1, 70, 16, 1, 256, 32, 16, torch.float32, 3.0),     # D = 256, MQA with 16 query heads
    (1, 70, 16, 1, 256, 32, 16, torch.float16, 0.0),     # the same shape uncapped
]
# (case, method): every method on the first case, the rest where the shape adds coverage
SOFTCAP_RUNS = ([(SOFTCAP_CASES[0], m) for m in ("bsfa", "forward", "reverse", "sink_local")]
                + [(SOFTCAP_CASES[1], m) for m in ("bsfa", "forward", "sink_local")]
                + [(SOFTCAP_CASES[2], m) for m in ("bsfa", "reverse")])


def _reference(q, k, v, scale, bm, bn, **kw):
    outs, skipped = [], []
    for i in range(q.shape[0]):
        o, c = sparse_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], scale, bm, bn, **kw)
        outs.append(o)
        skipped.append(c.skipped)
    return torch.cat(outs), torch.stack(skipped)


def _inputs(case, seed):
    """q, k, v with planted far tiles (helpers.sparse_inputs), and those tiles [B, H, P, Kb]."""
    b, n, h, hkv, d, bm, bn, dtype = case
    q, k, v, far = sparse_inputs(seed, b, n, h, hkv, d, dtype, bm, bn)
    return q, k, v, far_tiles(far, n, bm, bn, h // hkv)


def _check(q, k, v, bm, bn, dtype, must_skip=None, gate_v=True, **kw):
    """Kernel against reference: outputs within tolerance, per-head skip counts exact. must_skip
    [B, H, P, Kb]: tiles the method skips by construction (the planted far tiles)."""
    scale = q.shape[-1] ** -0.5
    want, want_skip = _reference(q, k, v, scale, bm, bn, **kw)
    got, got_skip = sparse_attention_triton(q, k, v, scale, bm, bn, gate_v=gate_v, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
    assert torch.equal(got_skip, want_skip)
    if must_skip is not None:  # the case skips at least every planted far tile, in every head
        assert must_skip.any() and (got_skip >= must_skip.sum(dim=(2, 3))).all()
    return got_skip


def _capped_tiles(q, k, v, bm, bn, order, softcap):
    """helpers.prefill_tiles on soft-capped scores: (bmax, gap in ``order``) [B, H, P, Kb]."""
    if not softcap:
        return prefill_tiles(q, k, v, bm, bn, order)
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=(order,), decode_rows=0)
    stats = [instrumented_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], q.shape[-1] ** -0.5, cfg, softcap=softcap)[1]
             for i in range(q.shape[0])]
    return torch.stack([t.bmax for t in stats]), torch.stack([t.gap[:, 0] for t in stats])


def _bsfa_thresholds(q, k, v, far, bm, bn, softcap=0.0):
    """Thresholds from the input's own (capped) block maxima, one position short (the last one is
    reused): each skips the far tiles and part of the others, no tile max near it (helpers.cut_point)."""
    bmax, _ = _capped_tiles(q, k, v, bm, bn, "forward", softcap)
    p = bmax.shape[2]
    return bsfa_cut_thresholds(bmax, far, candidate_mask(q.shape[2], bm, bn), max(1, p - 1))


def _log_lambda(q, k, v, far, bm, bn, order, softcap=0.0):
    """ln(lambda) from the input's own (capped) tile gaps in ``order``: skips the far tiles and part
    of the others, no gap near it (helpers.cut_point)."""
    _, gap = _capped_tiles(q, k, v, bm, bn, order, softcap)
    return blasst_cut_log_lambda(gap, far, candidate_mask(q.shape[2], bm, bn))


@pytest.mark.parametrize("case", CASES)
def test_bsfa_matches_reference(case, seed):
    bm, bn, dtype = case[5:]
    q, k, v, far = _inputs(case, seed)
    thr = _bsfa_thresholds(q, k, v, far, bm, bn)
    for gate_v in (True, False):
        _check(q, k, v, bm, bn, dtype, far, thresholds=thr, gate_v=gate_v)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("order", ["forward", "reverse", "sink_local"])
def test_blasst_matches_reference(case, order, seed):
    bm, bn, dtype = case[5:]
    q, k, v, far = _inputs(case, seed)
    _check(q, k, v, bm, bn, dtype, far, log_lambda=_log_lambda(q, k, v, far, bm, bn, order), order=order)


@pytest.mark.parametrize("case", CASES[:2])
def test_window_matches_reference(case, seed):
    b, n, h, hkv, d, bm, bn, dtype = case
    q, k, v, _ = _inputs(case, seed)
    cand = candidate_mask(n, bm, bn)
    for w in (0, 2):  # every candidate but the w nearest of each query block, whatever the input
        old = cand & (torch.arange(cand.shape[1]) < (cand.sum(1, keepdim=True) - w))
        assert (_check(q, k, v, bm, bn, dtype, window=w) == int(old.sum())).all() and old.any()


@pytest.mark.parametrize("case", CASES)
def test_no_op_is_dense(case, seed):
    """thresholds -inf, lambda = 0 and dense=True all give the dense kernel's output, nothing skipped."""
    b, n, h, hkv, d, bm, bn, dtype = case
    q, k, v, _ = _inputs(case, seed)
    scale = d ** -0.5
    want, _ = attention_dense(q, k, v, scale)
    for kw in ({"thresholds": torch.full((h, 2), -math.inf)}, {"log_lambda": -math.inf}, {"dense": True},
               {"window": n}):
        got, skipped = sparse_attention_triton(q, k, v, scale, bm, bn, **kw)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
        assert skipped.sum() == 0


@pytest.mark.parametrize("case", CASES[:3])
def test_count_only_counts_and_computes_everything(case, seed):
    """count_only: the method's skip counts (the reference's), the dense output."""
    b, n, h, hkv, d, bm, bn, dtype = case
    q, k, v, far = _inputs(case, seed)
    scale = d ** -0.5
    dense, _ = sparse_attention(q[:1], k[:1], v[:1], scale, bm, bn, thresholds=torch.full((h, 1), -math.inf))
    thr = _bsfa_thresholds(q, k, v, far, bm, bn)
    for kw in ({"thresholds": thr}, {"log_lambda": _log_lambda(q, k, v, far, bm, bn, "reverse"), "order": "reverse"}):
        _, want_skip = _reference(q, k, v, scale, bm, bn, **kw)
        got, got_skip = sparse_attention_triton(q, k, v, scale, bm, bn, count_only=True, **kw)
        assert torch.equal(got_skip, want_skip)
        assert (want_skip >= far.sum(dim=(2, 3))).all()  # the far tiles at least, by construction
        torch.testing.assert_close(got[:1].float(), dense.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
    with pytest.raises(ValueError, match="count_only"):  # the window has no per-tile decision to count
        sparse_attention_triton(q, k, v, scale, bm, bn, window=1, count_only=True)


@pytest.mark.parametrize("case,method", SOFTCAP_RUNS,
                         ids=[f"{m}-H{c[2]}-kv{c[3]}-D{c[4]}-{str(c[7])[6:]}-cap{c[8]}" for c, m in SOFTCAP_RUNS])
def test_softcap_matches_reference(case, method, seed):
    """Soft-capped scores: BSFA thresholds and BLASST ln(lambda) cut from the capped statistics;
    outputs and skip counts of the capped reference (every planted far tile skipped). A cap that
    bites changes the output (the same method on uncapped scores differs)."""
    cap = case[8]
    bm, bn, dtype = case[5:8]
    q, k, v, far = _inputs(case[:8], seed)
    if method == "bsfa":
        kw = {"thresholds": _bsfa_thresholds(q, k, v, far, bm, bn, cap)}
    else:
        kw = {"log_lambda": _log_lambda(q, k, v, far, bm, bn, method, cap), "order": method}
    _check(q, k, v, bm, bn, dtype, far, softcap=cap, **kw)
    if cap:
        scale = q.shape[-1] ** -0.5
        capped, _ = _reference(q, k, v, scale, bm, bn, softcap=cap, **kw)
        plain, _ = _reference(q, k, v, scale, bm, bn, **kw)
        assert float((plain.float() - capped.float()).abs().max()) > 10 * TOL[dtype][0]


def test_out_buffer_and_errors(seed):
    q, k, v, _ = sparse_inputs(seed, 1, 70, 2, 1, 64, torch.float32, 32, 16)
    buf = torch.empty(1, 70, 2, 64)
    got, _ = sparse_attention_triton(q, k, v, 0.125, 32, 16, log_lambda=-1.0, out=buf.transpose(1, 2))
    want, _ = sparse_attention_triton(q, k, v, 0.125, 32, 16, log_lambda=-1.0)
    assert torch.equal(buf.transpose(1, 2), want) and got.data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match="exactly one"):
        sparse_attention_triton(q, k, v, 0.125, 32, 16)
    with pytest.raises(ValueError, match="thresholds must be"):
        sparse_attention_triton(q, k, v, 0.125, 32, 16, thresholds=torch.zeros(3, 1))
    with pytest.raises(ValueError, match="scan order"):
        sparse_attention_triton(q, k, v, 0.125, 32, 16, log_lambda=-1.0, order="sideways")
    with pytest.raises(ValueError, match="softcap"):
        sparse_attention_triton(q, k, v, 0.125, 32, 16, log_lambda=-1.0, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        sparse_attention(q, k, v, 0.125, 32, 16, log_lambda=-1.0, softcap=-1.0)
    assert torch.equal(sparse_attention_triton(q, k, v, 0.125, 32, 16, log_lambda=-1.0, softcap=None)[0], want)


def test_fp32_query_tiles_a_gpu_cannot_hold():
    """32-bit 128 x 256 query tiles exceed a GPU kernel's shared memory (the host functions raise
    ValueError there, on CUDA only); 16-bit inputs, smaller tiles and the CPU interpreter pass."""
    from sparsecal.kernels.jit import fp32_tile_too_large

    for dtype, device, block_m, d, refused in ((torch.float32, "cuda", 128, 256, True),
                                               (torch.float32, "cuda", 80, 256, True),
                                               (torch.float32, "cuda", 64, 256, False),
                                               (torch.float32, "cuda", 128, 128, False),
                                               (torch.bfloat16, "cuda", 128, 256, False),
                                               (torch.float32, "cpu", 128, 256, False)):
        assert fp32_tile_too_large(dtype, device, block_m, d) == refused, (dtype, device, block_m, d)
