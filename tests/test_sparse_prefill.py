"""The Triton sparse prefill kernel against the plain-torch sparse reference (TRITON_INTERPRET=1):
outputs and per-head skip counts for BSFA, BLASST (three scan orders), window and dense."""
import math

import numpy as np
import pytest
import torch

from sparsecal.formats.stats_config import StatsConfig

from sparsecal.kernels.capture.reference import instrumented_attention
from sparsecal.kernels.sparse.reference import sparse_attention
from sparsecal.kernels.dense import attention_dense
from sparsecal.kernels.sparse.prefill import sparse_attention_triton

from helpers import block_counts_torch, sparse_inputs, TOL

CASES = [  # (B, N, H, Hkv, D, BM, BN, dtype)
    (1, 200, 4, 4, 64, 32, 16, torch.float32),
    (2, 173, 4, 1, 64, 32, 16, torch.bfloat16),
    (1, 150, 2, 2, 128, 32, 16, torch.float16),
    (1, 131, 4, 1, 64, 48, 24, torch.float32),   # block sizes that are not powers of two
]


def _reference(q, k, v, scale, bm, bn, **kw):
    outs, skipped = [], []
    for i in range(q.shape[0]):
        o, c = sparse_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], scale, bm, bn, **kw)
        outs.append(o)
        skipped.append(c.skipped)
    return torch.cat(outs), torch.stack(skipped)


def _check(q, k, v, bm, bn, dtype, min_skipped=1, gate_v=True, **kw):
    scale = q.shape[-1] ** -0.5
    want, want_skip = _reference(q, k, v, scale, bm, bn, **kw)
    got, got_skip = sparse_attention_triton(q, k, v, scale, bm, bn, gate_v=gate_v, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
    assert torch.equal(got_skip, want_skip)
    assert got_skip.sum() >= min_skipped  # the case really skips something
    return got_skip


def _median_bmax_thresholds(q, k, v, bm, bn, seed):
    """Thresholds near each query block's median candidate block max: partial skipping."""
    _, tiles = instrumented_attention(q[:1], k[:1], v[:1], q.shape[-1] ** -0.5,
                                      StatsConfig(block_m=bm, block_n=bn, decode_rows=0))
    cand, _ = block_counts_torch(q.shape[2], bm, bn)
    kb = torch.arange(tiles.bmax.shape[-1])
    middle = tiles.bmax[:, (kb[None, :] < cand[:, None]) & (kb[None, :] > 0)]  # candidates past the sink
    rng = np.random.default_rng(seed)
    thr = rng.normal(float(middle.median()), 0.3 * float(middle.std()), (q.shape[1], max(1, tiles.bmax.shape[1] - 1)))
    return torch.from_numpy(thr).float()  # one position short: the last one is reused


@pytest.mark.parametrize("case", CASES)
def test_bsfa_matches_reference(case, seed):
    b, n, h, hkv, d, bm, bn, dtype = case
    q, k, v = sparse_inputs(seed, b, n, h, hkv, d, dtype)
    thr = _median_bmax_thresholds(q, k, v, bm, bn, seed)
    for gate_v in (True, False):
        _check(q, k, v, bm, bn, dtype, thresholds=thr, gate_v=gate_v)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("order", ["forward", "reverse", "sink_local"])
def test_blasst_matches_reference(case, order, seed):
    b, n, h, hkv, d, bm, bn, dtype = case
    q, k, v = sparse_inputs(seed, b, n, h, hkv, d, dtype)
    _check(q, k, v, bm, bn, dtype, log_lambda=-2.0, order=order)


@pytest.mark.parametrize("case", CASES[:2])
def test_window_matches_reference(case, seed):
    b, n, h, hkv, d, bm, bn, dtype = case
    q, k, v = sparse_inputs(seed, b, n, h, hkv, d, dtype)
    for w in (0, 2):
        _check(q, k, v, bm, bn, dtype, window=w)


@pytest.mark.parametrize("case", CASES)
def test_no_op_is_dense(case, seed):
    """thresholds -inf, lambda = 0 and dense=True all give the dense kernel's output, nothing skipped."""
    b, n, h, hkv, d, bm, bn, dtype = case
    q, k, v = sparse_inputs(seed, b, n, h, hkv, d, dtype)
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
    q, k, v = sparse_inputs(seed, b, n, h, hkv, d, dtype)
    scale = d ** -0.5
    dense, _ = sparse_attention(q[:1], k[:1], v[:1], scale, bm, bn, thresholds=torch.full((h, 1), -math.inf))
    thr = _median_bmax_thresholds(q, k, v, bm, bn, seed)
    for kw in ({"thresholds": thr}, {"log_lambda": -2.0, "order": "reverse"}):
        _, want_skip = _reference(q, k, v, scale, bm, bn, **kw)
        got, got_skip = sparse_attention_triton(q, k, v, scale, bm, bn, count_only=True, **kw)
        assert torch.equal(got_skip, want_skip) and want_skip.sum() > 0
        torch.testing.assert_close(got[:1].float(), dense.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
    with pytest.raises(ValueError, match="count_only"):  # the window has no per-tile decision to count
        sparse_attention_triton(q, k, v, scale, bm, bn, window=1, count_only=True)


def test_out_buffer_and_errors(seed):
    q, k, v = sparse_inputs(seed, 1, 70, 2, 1, 64, torch.float32)
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
