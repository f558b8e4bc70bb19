"""The Triton split-K sparse decode kernel against the plain-torch sparse decode reference
(TRITON_INTERPRET=1): outputs and per-head skip counts for BSFA, BLASST, window and dense."""
import math

import pytest
import torch

from sparsecal.kernels.sparse.reference import sparse_decode
from sparsecal.kernels.sparse.decode import SCHEDULES, sparse_decode_triton

from helpers import sparse_inputs, TOL


CASES = [  # (B, L, H, Hkv, D, BM, BN, dtype)
    (2, 301, 4, 4, 64, 32, 16, torch.float32),
    (3, 250, 8, 2, 64, 64, 16, torch.bfloat16),
    (1, 200, 4, 1, 128, 32, 16, torch.float16),
    (2, 131, 4, 1, 64, 48, 24, torch.float32),
]


def _decode_inputs(seed, b, length, h, hkv, d, dtype):
    q, k, v = sparse_inputs(seed, b, length, h, hkv, d, dtype)
    return q[:, :, -1:].contiguous(), k, v


def _check(case, seed, splits, **kw):
    """Both schedules (gather: kept-tile lists; inline: decided in the attend pass) against the reference."""
    b, length, h, hkv, d, bm, bn, dtype = case
    q, k, v = _decode_inputs(seed, b, length, h, hkv, d, dtype)
    scale = d ** -0.5
    want, counts = sparse_decode(q, k, v, scale, bm, bn, **kw)
    for schedule in SCHEDULES:
        got, skipped = sparse_decode_triton(q, k, v, scale, bm, bn, splits=splits, schedule=schedule, **kw)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
        assert torch.equal(skipped.sum(dim=0), counts.skipped), schedule
    return skipped


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_methods_match_reference(case, splits, seed):
    h, length, bm = case[2], case[1], case[5]
    thr = torch.randn(h, max(1, (length - 1) // bm)) + 3.0  # one position short: the last is reused
    total = 0
    for kw in ({"thresholds": thr}, {"log_lambda": -2.0}, {"window": 3}):
        total += int(_check(case, seed, splits, **kw).sum())
    assert total > 0


@pytest.mark.parametrize("case", CASES[:2])
@pytest.mark.parametrize("order", ["reverse", "sink_local"])
def test_blasst_orders(case, order, seed):
    _check(case, seed, 2, log_lambda=-1.0, order=order)


@pytest.mark.parametrize("case", CASES[:3])
def test_no_op_is_dense(case, seed):
    b, length, h, hkv, d, bm, bn, dtype = case
    q, k, v = _decode_inputs(seed, b, length, h, hkv, d, dtype)
    ref, _ = sparse_decode(q, k, v, d ** -0.5, bm, bn, log_lambda=-math.inf)
    for schedule in SCHEDULES:
        want, _ = sparse_decode_triton(q, k, v, d ** -0.5, bm, bn, dense=True, splits=2, schedule=schedule)
        torch.testing.assert_close(want.float(), ref.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
        for kw in ({"thresholds": torch.full((h, 1), -math.inf)}, {"log_lambda": -math.inf}, {"window": length}):
            got, skipped = sparse_decode_triton(q, k, v, d ** -0.5, bm, bn, splits=2, schedule=schedule, **kw)
            torch.testing.assert_close(got, want, atol=0, rtol=0)
            assert skipped.sum() == 0


@pytest.mark.parametrize("case", CASES[:2])
def test_gather_decisions_across_chunks(case, seed, monkeypatch):
    """The decide kernel takes DECIDE_CHUNK tiles per step: with 4, BLASST's running max, the kept-tile
    list and the counts carry across several steps (and a ragged last one)."""
    from sparsecal.kernels.sparse import decode as triton_sparse_decode

    monkeypatch.setattr(triton_sparse_decode, "DECIDE_CHUNK", 4)
    h, length, bm = case[2], case[1], case[5]
    thr = torch.randn(h, max(1, (length - 1) // bm)) + 3.0
    for kw in ({"thresholds": thr}, {"log_lambda": -2.0}, {"log_lambda": -1.0, "order": "reverse"}, {"window": 5}):
        _check(case, seed, 3, **kw)
