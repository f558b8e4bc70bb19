"""The Triton split-K sparse decode kernel against the plain-torch sparse decode reference
(TRITON_INTERPRET=1): outputs and per-head skip counts for BSFA, BLASST, window and dense;
uncapped and soft-capped (thresholds cut from the capped tile maxima), D 64/128/256, GQA 1-16, MQA."""
import math

import pytest
import torch

from sparsecal.kernels.sparse.decode import SCHEDULES, sparse_decode_triton
from sparsecal.kernels.sparse.reference import sparse_decode

from bruteforce import capped
from helpers import TOL, blasst_cut_log_lambda, cut_point, decode_tiles, sparse_inputs

# The interpreter's cost grows with the programs (B * Hkv * splits), then the tiles: each case is
# as small as its coverage allows (every L ragged; Kb > 8 where DECIDE_CHUNK = 4 must see a ragged
# last chunk).
CASES = [  # (B, L, H, Hkv, D, BM, BN, dtype)
    (2, 141, 2, 2, 64, 32, 16, torch.float32),    # one query head per KV head
    (1, 150, 8, 2, 64, 64, 16, torch.bfloat16),   # GQA, group 4, two KV heads
    (1, 200, 4, 1, 128, 32, 16, torch.float16),   # D = 128, a single KV head
    (2, 131, 4, 1, 64, 48, 24, torch.float32),    # block sizes that are not powers of two
]


SOFTCAP_CASES = [  # (B, L, H, Hkv, D, BM, BN, dtype, softcap; 0 = off)
    (2, 141, 4, 1, 64, 32, 16, torch.float32, 4.0),      # GQA 4 on one KV head (MQA)
    (1, 150, 16, 1, 256, 64, 16, torch.bfloat16, 3.0),   # D = 256, MQA with 16 query heads
    (1, 130, 16, 1, 256, 32, 16, torch.float16, 0.0),    # the same shape uncapped
]


def _decode_inputs(seed, case):
    """The last row of helpers.sparse_inputs as the decode query, and the planted far candidate
    tiles of that row [B, H, Kb] (every far block lies before the row's own block)."""
    b, length, h, hkv, d, bm, bn, dtype = case
    q, k, v, far = sparse_inputs(seed, b, length, h, hkv, d, dtype, bm, bn)
    cand = torch.arange(far.shape[-1]) < (length - 1) // bn
    return q[:, :, -1:].contiguous(), k, v, far.repeat_interleave(h // hkv, dim=1) & cand


def _capped_tiles(q, k, bn, order="forward", softcap=0.0):
    """helpers.decode_tiles on soft-capped scores: (tile max, gap in ``order``) [B, H, Kb]."""
    if not softcap:
        return decode_tiles(q, k, bn, order)
    from sparsecal.formats.geometry import scan_order
    from sparsecal.kernels.capture.reference import scan_rows

    b, h, _, d = q.shape
    length = k.shape[2]
    kb, r = -(-length // bn), length - 1
    s = capped((q.double() * d ** -0.5) @ k.double().repeat_interleave(h // k.shape[1], dim=1).transpose(-1, -2),
               softcap).float()
    tmax = torch.nn.functional.pad(s, (0, kb * bn - length), value=-math.inf).view(b * h, 1, kb, bn).amax(-1)
    gap, _ = scan_rows(tmax, scan_order(order, r // bn, kb), tmax.amax(-1))
    return tmax.view(b, h, kb), gap.view(b, h, kb)


def _thresholds(q, k, far, case, softcap=0.0):
    """BSFA thresholds [H, Pt] from the row's own (capped) tile maxima, one position short: the row
    reads the last one (min(r // BM, Pt - 1)), a cut that skips the far tiles and part of the others
    with no tile max near it (helpers.cut_point). The positions the row must not read skip everything."""
    _, length, h, _, _, bm, bn, _ = case[:8]
    tmax, _ = _capped_tiles(q, k, bn, softcap=softcap)
    cand = torch.arange(tmax.shape[-1]) < (length - 1) // bn
    thr = torch.full((h, max(1, (length - 1) // bm)), math.inf)
    for hh in range(h):
        f, vals = far[:, hh], tmax[:, hh]
        thr[hh, -1] = cut_point(vals[cand & ~f], float(vals[f].max()) if f.any() else -math.inf)
    return thr


def _log_lambda(q, k, far, case, order="forward", softcap=0.0):
    """ln(lambda) from the row's own (capped) tile gaps in ``order``: skips the far tiles and part
    of the others."""
    _, length, _, _, _, _, bn, _ = case[:8]
    _, gap = _capped_tiles(q, k, bn, order, softcap)
    return blasst_cut_log_lambda(gap, far, torch.arange(gap.shape[-1]) < (length - 1) // bn)


def _check(case, inputs, splits, must_skip=None, schedules=SCHEDULES, **kw):
    """Both schedules (gather: kept-tile lists; inline: decided in the attend pass) against the
    reference. must_skip [B, H, Kb]: tiles the method skips by construction (the far tiles)."""
    b, length, h, hkv, d, bm, bn, dtype = case
    q, k, v, _ = inputs
    scale = d ** -0.5
    want, counts = sparse_decode(q, k, v, scale, bm, bn, **kw)
    for schedule in schedules:
        got, skipped = sparse_decode_triton(q, k, v, scale, bm, bn, splits=splits, schedule=schedule, **kw)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
        assert torch.equal(skipped.sum(dim=0), counts.skipped), schedule
        if must_skip is not None:  # every planted far tile at least, in every sequence and head
            assert must_skip.any() and (skipped >= must_skip.sum(-1)).all()
    return skipped


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_methods_match_reference(case, splits, seed):
    inputs = _decode_inputs(seed, case)
    q, k, _, far = inputs
    _check(case, inputs, splits, far, thresholds=_thresholds(q, k, far, case))
    _check(case, inputs, splits, far, log_lambda=_log_lambda(q, k, far, case))
    _check(case, inputs, splits, window=3)


@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=lambda c: f"H{c[2]}-kv{c[3]}-D{c[4]}-{str(c[7])[6:]}-cap{c[8]}")
def test_softcap_matches_reference(case, seed):
    """Soft-capped scores: BSFA thresholds and BLASST ln(lambda) (forward: decided in the kernels;
    reverse: the torch mask) cut from the capped tile maxima; outputs and skip counts of the capped
    reference in both schedules. A cap that bites changes the output."""
    cap = case[8]
    inputs = _decode_inputs(seed, case[:8])
    q, k, v, far = inputs
    _check(case[:8], inputs, 2, far, softcap=cap, thresholds=_thresholds(q, k, far, case, cap))
    for order in ("forward", "reverse"):
        _check(case[:8], inputs, 2, far, softcap=cap, order=order, log_lambda=_log_lambda(q, k, far, case, order, cap))
    if cap:
        scale = q.shape[-1] ** -0.5
        plain, _ = sparse_decode(q, k, v, scale, case[5], case[6], log_lambda=-math.inf)
        got, _ = sparse_decode_triton(q, k, v, scale, case[5], case[6], dense=True, softcap=cap)
        assert float((plain.float() - got.float()).abs().max()) > 10 * TOL[case[7]][0]


def test_softcap_errors(seed):
    q, k, v, _ = _decode_inputs(seed, CASES[0])
    for fn in (sparse_decode, sparse_decode_triton):
        with pytest.raises(ValueError, match="softcap"):
            fn(q, k, v, 0.125, 32, 16, log_lambda=-1.0, softcap=-3.0)


@pytest.mark.parametrize("case", CASES[:2])
@pytest.mark.parametrize("order", ["reverse", "sink_local"])
def test_blasst_orders(case, order, seed):
    inputs = _decode_inputs(seed, case)
    q, k, _, far = inputs
    _check(case, inputs, 2, far, log_lambda=_log_lambda(q, k, far, case, order), order=order)


@pytest.mark.parametrize("case", CASES[:3])
def test_no_op_is_dense(case, seed):
    b, length, h, hkv, d, bm, bn, dtype = case
    q, k, v, _ = _decode_inputs(seed, case)
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
    list and the counts carry across several steps (and a ragged last one). Only the gather schedule
    has a decide kernel."""
    from sparsecal.kernels.sparse import decode as triton_sparse_decode

    monkeypatch.setattr(triton_sparse_decode, "DECIDE_CHUNK", 4)
    inputs = _decode_inputs(seed, case)
    q, k, _, far = inputs
    for kw in ({"thresholds": _thresholds(q, k, far, case)}, {"log_lambda": _log_lambda(q, k, far, case)},
               {"log_lambda": _log_lambda(q, k, far, case, "reverse"), "order": "reverse"}):
        _check(case, inputs, 3, far, schedules=("gather",), **kw)
    _check(case, inputs, 3, schedules=("gather",), window=5)


TOPK_CASES = [  # (B, L, H, Hkv, D, BM, BN, dtype): GQA groups 1, 4, 8; D 64 / 128; every L ragged
    (2, 141, 2, 2, 64, 32, 16, torch.float32),    # group 1, two different sequences
    (2, 150, 8, 2, 64, 64, 16, torch.bfloat16),   # group 4
    (1, 200, 8, 1, 128, 32, 16, torch.float16),   # group 8 (MQA), D = 128
]


@pytest.mark.parametrize("case", TOPK_CASES, ids=lambda c: f"B{c[0]}-H{c[2]}-kv{c[3]}-D{c[4]}-{str(c[7])[6:]}")
def test_topk_matches_reference(case, seed):
    """Decode top-k: outputs and skip counts of both schedules equal the reference's at several k,
    including k = 0 (only the last block), k >= A (nothing skipped) and the planted far tiles
    (skipped at a k below the ordinary candidates)."""
    inputs = _decode_inputs(seed, case)
    q, k, _, far = inputs
    a = (case[1] - 1) // case[6]
    n_far = int(far.sum(-1).max())                  # the far tiles are every head's lowest tile maxima
    for kk in (0, 3, a - n_far, a, a + 5):
        skipped = _check(case, inputs, 2, far if 0 < kk <= a - n_far else None, topk=kk)
        assert (skipped == max(a - kk, 0)).all()    # random draws: no ties, exactly k candidates kept


def _tie_inputs(b, length, h, hkv, d, bn, dtype, seed):
    """Integer-valued q and k (every score exact in fp32, fp16 and bf16 at scale 1/8) whose
    candidate key block 2 is copied into blocks 4 and 6 of every sequence: three candidates with the
    same tile max in every head."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (b, h, 1, d), generator=g).float()
    k = torch.randint(-3, 4, (b, hkv, length, d), generator=g).float()
    v = torch.randn(b, hkv, length, d, generator=g)
    for j in (4, 6):
        k[:, :, j * bn:(j + 1) * bn] = k[:, :, 2 * bn:3 * bn]
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_topk_ties_are_kept(dtype, seed):
    """A tie built on purpose: k set so that the k-th largest candidate tile max is the value three
    candidate blocks share; every one of them is kept (k + 2 candidates where that head's tie sits at
    the k-th place), in both schedules, equal to the reference."""
    b, length, h, hkv, d, bm, bn = 2, 149, 4, 1, 64, 32, 16
    q, k, v = _tie_inputs(b, length, h, hkv, d, bn, dtype, seed)
    scale, a = 0.125, (length - 1) // bn
    s = (q.float() * scale) @ k.float().repeat_interleave(h // hkv, 1).transpose(-1, -2)
    tmax = torch.nn.functional.pad(s, (0, -length % bn), value=-math.inf).view(b, h, -1, bn).amax(-1)[..., :a]
    tied = tmax[..., 2]                                              # [B, H] the shared value
    assert torch.equal(tmax[..., 4], tied) and torch.equal(tmax[..., 6], tied)
    kk = int((tmax[0, 0] > tied[0, 0]).sum()) + 1                   # the tie is the k-th largest of (0, 0)
    want, counts = sparse_decode(q, k, v, scale, bm, bn, topk=kk)
    kept = a - (tmax < tmax.topk(kk, dim=-1).values[..., -1:]).sum(-1)
    assert kept[0, 0] == kk + 2
    assert torch.equal(counts.skipped, (a - kept).sum(0))
    for schedule in SCHEDULES:
        got, skipped = sparse_decode_triton(q, k, v, scale, bm, bn, topk=kk, splits=3, schedule=schedule)
        assert torch.equal(skipped, a - kept), schedule
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_topk_argument_errors(seed):
    q, k, v, _ = _decode_inputs(seed, CASES[0])
    for fn in (sparse_decode, sparse_decode_triton):
        with pytest.raises(ValueError, match="exactly one"):
            fn(q, k, v, 0.125, 32, 16, topk=2, window=1)
        with pytest.raises(ValueError, match="topk"):
            fn(q, k, v, 0.125, 32, 16, topk=-1)
    with pytest.raises(ValueError, match="dense"):
        sparse_decode_triton(q, k, v, 0.125, 32, 16, topk=2, dense=True)


def test_scan_orders_from_slices_are_the_geometry_orders():
    """decode.in_scan_order / from_scan_order (slices, no index uploaded) put a row's key blocks in
    exactly formats.geometry.scan_order's order and back, for every order, row and candidate count."""
    from sparsecal.formats.geometry import ORDERS, scan_order
    from sparsecal.kernels.sparse.decode import from_scan_order, in_scan_order

    for kb in range(1, 12):
        x = torch.arange(kb)
        for a in range(0, kb + 1):
            for order in ORDERS:
                seq = in_scan_order(x, order, a)
                assert seq.tolist() == scan_order(order, a, kb), (order, a, kb)
                assert torch.equal(from_scan_order(seq, order, a), x)
