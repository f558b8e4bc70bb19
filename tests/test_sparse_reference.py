"""The plain-torch BSFA/BLASST sparse attention against a float64 full-matrix oracle whose skip
decisions come from the instrumented reference's tile statistics (the capture semantics), uncapped
and soft-capped (the oracle caps its scores, the decisions come from the capped statistics)."""
import math

import pytest
import torch

from sparsecal.formats.geometry import cdiv
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.reduce_reference import bsfa_reduce
from sparsecal.kernels.capture.reference import instrumented_attention
from sparsecal.kernels.sparse.reference import sparse_attention

from bruteforce import capped
from helpers import (
    blasst_cut_log_lambda,
    block_counts_torch,
    bsfa_cut_thresholds,
    candidate_mask,
    cut_point,
    far_tiles,
    sparse_inputs,
)

CASES = [  # (N, H, Hkv, D, BM, BN, dtype)
    (200, 4, 4, 64, 64, 32, torch.float32),
    (333, 6, 2, 128, 64, 32, torch.bfloat16),
    (700, 3, 1, 64, 128, 64, torch.float16),
    (97, 4, 1, 64, 32, 16, torch.float32),
]


def _inputs(seed, n, h, hkv, d, dtype):
    """Plain random inputs (no planted structure: block maxima never tie)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, n, d, generator=g) * 1.5
    k = torch.randn(1, hkv, n, d, generator=g)
    k[:, :, 0] += 3.0  # a sink-like first key so some tiles are far below the running max
    v = torch.randn(1, hkv, n, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _oracle(q, k, v, scale, bm, bn, skip, softcap=0.0):
    """Full-matrix float64 attention (scores capped at ``softcap``) with key blocks ``skip``
    [H, P, Kb] masked out per query block."""
    _, h, n, _ = q.shape
    group = h // k.shape[1]
    kk = k[0].double().repeat_interleave(group, 0)
    vv = v[0].double().repeat_interleave(group, 0)
    s = capped(q[0].double() @ kk.transpose(1, 2) * scale, softcap)
    rows, keys = torch.arange(n), torch.arange(n)
    allowed = keys[None, :] <= rows[:, None]
    block_skip = skip[:, rows // bm][:, :, keys // bn]  # [H, N, N]
    s = s.masked_fill(~allowed | block_skip, -math.inf)
    return torch.softmax(s, dim=-1) @ vv


def _planted(seed, case):
    """helpers.sparse_inputs for one sequence, and its far candidate tiles [H, P, Kb]: every
    threshold and ln(lambda) made by helpers.cut_point skips them."""
    n, h, hkv, d, bm, bn, dtype = case
    q, k, v, far = sparse_inputs(seed, 1, n, h, hkv, d, dtype, bm, bn)
    return q, k, v, far_tiles(far, n, bm, bn, h // hkv)[0]


_candidates = candidate_mask  # [P, Kb]


def _tol(dtype):
    return {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]


@pytest.mark.parametrize("case", CASES)
def test_bsfa_matches_oracle(case, seed):
    n, h, hkv, d, bm, bn, dtype = case
    q, k, v, far = _planted(seed, case)
    scale = d ** -0.5
    _, tiles = instrumented_attention(q, k, v, scale, StatsConfig(block_m=bm, block_n=bn, decode_rows=0))
    p = cdiv(n, bm)
    # thresholds cut the input's own candidate maxima (shorter: the last one is reused)
    thr = bsfa_cut_thresholds(tiles.bmax[None], far[None], _candidates(n, bm, bn), max(1, p - 1))
    out, counts = sparse_attention(q, k, v, scale, bm, bn, thresholds=thr)
    pos = torch.clamp(torch.arange(p), max=thr.shape[1] - 1)
    skip = _candidates(n, bm, bn)[None] & (tiles.bmax < thr[:, pos].unsqueeze(-1))
    torch.testing.assert_close(out[0].double(), _oracle(q, k, v, scale, bm, bn, skip), atol=_tol(dtype), rtol=0)
    assert torch.equal(counts.skipped, skip.sum(dim=(1, 2)))
    assert far.any() and (skip >= far).all()  # every far tile skipped, by construction


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("order", ["forward", "reverse", "sink_local"])
def test_blasst_matches_oracle(case, order, seed):
    n, h, hkv, d, bm, bn, dtype = case
    q, k, v, far = _planted(seed, case)
    scale = d ** -0.5
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=(order,), decode_rows=0)
    _, tiles = instrumented_attention(q, k, v, scale, cfg)
    log_lambda = blasst_cut_log_lambda(tiles.gap[:, 0], far, _candidates(n, bm, bn))  # cuts the input's gaps
    out, counts = sparse_attention(q, k, v, scale, bm, bn, log_lambda=log_lambda, order=order)
    skip = _candidates(n, bm, bn)[None] & (tiles.gap[:, 0] < log_lambda)
    torch.testing.assert_close(out[0].double(), _oracle(q, k, v, scale, bm, bn, skip), atol=_tol(dtype), rtol=0)
    assert torch.equal(counts.skipped, skip.sum(dim=(1, 2)))
    assert far.any() and (skip >= far).all()  # every far tile skipped, by construction


@pytest.mark.parametrize("case", [(97, 16, 1, 64, 32, 16, torch.float32, 4.0),     # MQA, group 16
                                  (70, 4, 2, 256, 32, 16, torch.bfloat16, 3.0)])  # D = 256
def test_softcap_matches_oracle(case, seed):
    """Soft-capped scores: BSFA and BLASST (every order) decide on the capped tile statistics, and
    the output is the capped oracle's over the kept keys."""
    n, h, hkv, d, bm, bn, dtype, cap = case
    q, k, v, far = _planted(seed, case[:7])
    scale = d ** -0.5
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=("forward", "reverse", "sink_local"), decode_rows=0)
    _, tiles = instrumented_attention(q, k, v, scale, cfg, softcap=cap)
    cands = _candidates(n, bm, bn)
    p = cdiv(n, bm)
    thr = bsfa_cut_thresholds(tiles.bmax[None], far[None], cands, p)
    runs = [({"thresholds": thr}, cands[None] & (tiles.bmax < thr.unsqueeze(-1)))]
    for o, order in enumerate(cfg.orders):
        ll = blasst_cut_log_lambda(tiles.gap[:, o], far, cands)
        runs.append(({"log_lambda": ll, "order": order}, cands[None] & (tiles.gap[:, o] < ll)))
    for kw, skip in runs:
        out, counts = sparse_attention(q, k, v, scale, bm, bn, softcap=cap, **kw)
        want = _oracle(q, k, v, scale, bm, bn, skip, cap)
        torch.testing.assert_close(out[0].double(), want, atol=_tol(dtype), rtol=0)
        assert torch.equal(counts.skipped, skip.sum(dim=(1, 2))) and (skip >= far).all()
        plain = _oracle(q, k, v, scale, bm, bn, skip)
        assert float((plain - want).abs().max()) > 10 * _tol(dtype)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [0, 1, 3])
def test_window_matches_oracle(case, window, seed):
    """Sliding window: each query block keeps its diagonal and the ``window`` nearest candidates."""
    n, h, hkv, d, bm, bn, dtype = case
    q, k, v = _inputs(seed, n, h, hkv, d, dtype)
    scale = d ** -0.5
    out, counts = sparse_attention(q, k, v, scale, bm, bn, window=window)
    cand, _ = block_counts_torch(n, bm, bn)
    old = torch.arange(cdiv(n, bn))[None, :] < (cand - window)[:, None]  # [P, Kb]
    skip = (_candidates(n, bm, bn) & old).expand(h, -1, -1)
    torch.testing.assert_close(out[0].double(), _oracle(q, k, v, scale, bm, bn, skip), atol=_tol(dtype), rtol=0)
    assert counts.skipped.tolist() == [int(torch.clamp(cand - window, min=0).sum())] * h


@pytest.mark.parametrize("case", CASES)
def test_no_op_thresholds_are_dense(case, seed):
    n, h, hkv, d, bm, bn, dtype = case
    q, k, v = _inputs(seed, n, h, hkv, d, dtype)
    scale = d ** -0.5
    dense, _ = instrumented_attention(q, k, v, scale, StatsConfig(block_m=bm, block_n=bn, decode_rows=0))
    for kw in ({"thresholds": torch.full((h, 3), -math.inf)}, {"log_lambda": -math.inf}, {"window": n}):
        out, counts = sparse_attention(q, k, v, scale, bm, bn, **kw)
        torch.testing.assert_close(out.float(), dense.float(), atol=_tol(dtype), rtol=0)
        assert counts.skipped.sum() == 0
        assert counts.reachable * h == int(block_counts_torch(n, bm, bn)[1].sum()) * h


def test_sample_thresholds_keep_exactly_k(seed):
    """A sample's own BSFA thresholds (capture's midpoint rule) keep min(k, A_i) candidates each."""
    n, h, d, bm, bn = 900, 3, 64, 64, 32
    q, k, v = _inputs(seed, n, h, 1, d, torch.float32)
    cfg = StatsConfig(block_m=bm, block_n=bn, k_values=(2, 5), decode_rows=0)
    _, tiles = instrumented_attention(q, k, v, d ** -0.5, cfg)
    cand, reach = block_counts_torch(n, bm, bn)
    thr = bsfa_reduce(tiles.bmax, tiles.mass, cand, cfg)["bsfa_threshold"]  # [H, P, K]
    for ki, kval in enumerate(cfg.k_values):
        _, counts = sparse_attention(q, k, v, d ** -0.5, bm, bn, thresholds=thr[..., ki])
        want = int((cand - torch.clamp(cand, max=kval)).sum())
        assert counts.skipped.tolist() == [want] * h
        assert counts.candidates == int(cand.sum()) and counts.reachable == int(reach.sum())


def test_argument_errors():
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="exactly one"):
        sparse_attention(q, q, q, 1.0, 4, 4)
    with pytest.raises(ValueError, match="exactly one"):
        sparse_attention(q, q, q, 1.0, 4, 4, thresholds=torch.zeros(2, 1), log_lambda=0.0)
    with pytest.raises(ValueError, match="exactly one"):
        sparse_attention(q, q, q, 1.0, 4, 4, log_lambda=0.0, window=2)
    with pytest.raises(ValueError, match="window"):
        sparse_attention(q, q, q, 1.0, 4, 4, window=-1)
    with pytest.raises(ValueError, match="heads"):
        sparse_attention(q, q, q, 1.0, 4, 4, thresholds=torch.zeros(3, 1))


@pytest.mark.parametrize("length,bm,bn,cap", [(1, 64, 32, 0.0), (130, 64, 32, 0.0), (513, 128, 64, 0.0),
                                              (70, 32, 16, 3.0)])
def test_decode_is_the_last_prefill_row_as_its_own_block(length, bm, bn, cap, seed, rng):
    """Decode of row L-1 equals the prefill reference on L tokens with BM = 1, read at the last row:
    same candidates (r // BN), same thresholds position (r // BM), same gaps; soft-capped too."""
    from sparsecal.kernels.sparse.reference import sparse_decode

    h, hkv, d = 4, 2, 64
    q, k, v, far = sparse_inputs(seed, 1, length, h, hkv, d, torch.float32, bm, bn)
    scale = d ** -0.5
    r = length - 1
    _, tiles = instrumented_attention(q, k, v, scale, StatsConfig(block_m=1, block_n=bn, decode_rows=0), softcap=cap)
    cand = torch.arange(cdiv(length, bn)) < r // bn
    far = far[0].repeat_interleave(h // hkv, dim=0) & cand  # [H, Kb] the decode row's far candidates
    # the decode row's threshold (the last position) cuts its own candidate maxima; the other rows'
    # thresholds (prefill with BM = 1 reads them, the decode row must not) are random
    thr = torch.randn(h, cdiv(length, bm), generator=rng) + 3.0
    for hh in range(h):
        row = tiles.bmax[hh, r]
        thr[hh, -1] = cut_point(row[cand & ~far[hh]], float(row[far[hh]].max()) if far[hh].any() else -math.inf)
    log_lambda = blasst_cut_log_lambda(tiles.gap[:, 0, r], far, cand)
    row_thr = thr[:, torch.clamp(torch.arange(length) // bm, max=thr.shape[1] - 1)]  # per row = per BM=1 block
    for kw, kw_row in (({"thresholds": thr}, {"thresholds": row_thr}),
                       ({"log_lambda": log_lambda}, {"log_lambda": log_lambda}), ({"window": 2}, {"window": 2})):
        want, wc = sparse_attention(q, k, v, scale, 1, bn, softcap=cap, **kw_row)
        qq, kk, vv = q[:, :, -1:].repeat(2, 1, 1, 1), k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)
        got, gc = sparse_decode(qq, kk, vv, scale, bm, bn, softcap=cap, **kw)
        torch.testing.assert_close(got, want[:, :, -1:].expand(2, -1, -1, -1), atol=2e-5, rtol=0)
        assert gc.candidates == 2 * (r // bn) and gc.reachable == 2 * (r // bn + 1)
        if "thresholds" in kw:
            skip = cand & (tiles.bmax[:, r] < row_thr[:, r:r + 1])
        elif "window" in kw:
            skip = (cand & (torch.arange(cand.numel()) < r // bn - 2)).expand(h, -1)
        else:
            skip = cand & (tiles.gap[:, 0, r] < log_lambda)
        assert torch.equal(gc.skipped, 2 * skip.sum(dim=-1))
        if "window" not in kw:  # every far tile skipped, by construction
            assert (skip >= far).all() and (far.any() or r // bn < 2)
        if length > 500 and "thresholds" in kw:
            assert 0 < gc.skipped.sum() < gc.candidates * h  # partial skipping: the test can see it
