"""The group decode kernel over a serving batch (kernels/sparse/decode_group.py): per-row lengths
and a paged KV cache (page pool + block table) against ``reference.sparse_decode_ragged``
(TRITON_INTERPRET=1). Ragged rows: length 1, an awkward length, a multiple of the block, one row
much longer; GQA 1 / 4 / 8, D 64 / 128, fp16 / bf16 / fp32."""
import itertools
import math

import pytest
import torch

from sparsecal.kernels.sparse.decode_group import SparseLaunch, group_decode_triton
from sparsecal.kernels.sparse.decode_group_dense import DenseLaunch
from sparsecal.kernels.sparse.reference import paged_to_rows, sparse_decode_ragged

from helpers import INTERPRETER_WARNINGS, TOL, cut_point, decode_tiles

pytestmark = INTERPRETER_WARNINGS

LENGTHS = (1, 37, 64, 203)   # one key, awkward, a multiple of BN = 16 and of the page, much longer
CASES = [  # (H, Hkv, D, BM, BN, page_size, dtype)
    (1, 1, 64, 32, 16, 32, torch.float32),    # G = 1, two blocks a page
    (4, 1, 64, 64, 16, 16, torch.bfloat16),   # G = 4, page = block
    (8, 1, 128, 32, 16, 32, torch.float16),   # G = 8, D = 128
]


def serving_batch(seed, case):
    """q [B, H, 1, D]; page pools k/v [P, Hkv, page, D] whose pages are handed out in a shuffled
    order (block table [B, max_pages] int32, unused slots -1); the same caches contiguous
    [B, Hkv, Lmax, D] (zero past each row); lengths [B] int32. Key 0 of each row is a sink."""
    h, hkv, d, _, _, page, dtype = case
    g = torch.Generator().manual_seed(seed)
    b, lmax = len(LENGTHS), max(LENGTHS)
    pages = [-(-n // page) for n in LENGTHS]
    n_pool = sum(pages) + 3                                        # a few pages no row uses
    kp, vp = torch.randn(n_pool, hkv, page, d, generator=g), torch.randn(n_pool, hkv, page, d, generator=g)
    order = torch.randperm(n_pool, generator=g)
    table = torch.full((b, max(pages)), -1, dtype=torch.int32)
    q = torch.randn(b, h, 1, d, generator=g)
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[start:start + n].int()
        start += n
        kp[table[i, 0], :, 0] += 6.0 * q[i, :, 0].view(hkv, h // hkv, d).mean(1)  # the row's sink key
    kp, vp, q = kp.to(dtype), vp.to(dtype), q.to(dtype)
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    kc, vc = torch.zeros(b, hkv, lmax, d, dtype=dtype), torch.zeros(b, hkv, lmax, d, dtype=dtype)
    for i, (kr, vr) in enumerate(zip(paged_to_rows(kp, table, lens), paged_to_rows(vp, table, lens))):
        kc[i, :, : LENGTHS[i]], vc[i, :, : LENGTHS[i]] = kr, vr
    return q, kp, vp, table, kc, vc, lens


def thresholds(q, kc, bn):
    """BSFA thresholds [H, 1]: per head a cut among the candidate tile maxima of every row."""
    vals = [[] for _ in range(q.shape[1])]
    for i, n in enumerate(LENGTHS):
        tmax, _ = decode_tiles(q[i:i + 1], kc[i:i + 1, :, :n], bn)
        for hh in range(q.shape[1]):
            vals[hh].append(tmax[0, hh, : (n - 1) // bn])
    return torch.tensor([[cut_point(torch.cat(v))] for v in vals])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"G{c[0] // c[1]}-D{c[2]}-{str(c[6])[6:]}")
def test_ragged_and_paged_match_reference(case, seed):
    """Paged BSFA (per head), ragged contiguous BLASST (group decision) and paged top-k (per head)
    equal the row-by-row reference in outputs, per-row skip counts and group V-skip counts; the
    paged and contiguous kernels agree exactly on the same caches."""
    q, kp, vp, table, kc, vc, lens = serving_batch(seed, case)
    _, _, d, bm, bn, _, dtype = case
    scale = d ** -0.5
    fused = SparseLaunch(warps=1, pps=4, fuse=2)   # the last program of a group merges (rows past a split: empty)
    runs = [({"thresholds": thresholds(q, kc, bn)}, "head", True, 2, None),
            ({"log_lambda": -2.0}, "group", False, 2, None),
            ({"topk": 2}, "head", True, 1, None),
            ({"log_lambda": -2.0}, "group", True, 3, fused),
            ({"thresholds": thresholds(q, kc, bn)}, "head", False, 5, fused),
            ({"log_lambda": -2.0}, "group", True, 2, SparseLaunch(warps=1, pps=4, step_if=True)),
            ({"thresholds": thresholds(q, kc, bn)}, "head", True, 2, SparseLaunch(warps=1, pps=4, tma=True)),
            ({"thresholds": thresholds(q, kc, bn)}, "head", False, 3, SparseLaunch(warps=1, pps=4, fuse=2, tma=True))]
    for kw, decision, paged, splits, launch in runs:
        k, v, bt = (kp, vp, table) if paged else (kc, vc, None)
        want, sk, vsk, _ = sparse_decode_ragged(q, k, v, lens, scale, bm, bn, block_table=bt, decision=decision, **kw)
        got, skipped, v_skipped = group_decode_triton(q, k, v, scale, bm, bn, lengths=lens, block_table=bt,
                                                      decision=decision, splits=splits, launch=launch, **kw)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
        assert torch.equal(skipped, sk) and torch.equal(v_skipped, vsk), (kw, decision)
        assert sk[-1].sum() > 0 and sk[0].sum() == 0            # the long row skips, the one-key row cannot
    tile = DenseLaunch(block_n=bn)   # one loop tile for both (the dense loop tile otherwise follows the page)
    dense_paged, *_ = group_decode_triton(q, kp, vp, scale, bm, bn, lengths=lens, block_table=table, dense=True,
                                          dense_launch=tile)
    dense_flat, *_ = group_decode_triton(q, kc, vc, scale, bm, bn, lengths=lens, dense=True, dense_launch=tile)
    want, *_ = sparse_decode_ragged(q, kc, vc, lens, scale, bm, bn, log_lambda=-math.inf)
    assert torch.equal(dense_paged, dense_flat)
    torch.testing.assert_close(dense_flat.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_tma_key_loads_read_only_the_rows_keys(seed):
    """SparseLaunch(tma=True): BSFA and window decisions read K by TMA; keys past a row's length (in
    the cache and in a page's unused rows) hold NaN and change nothing; BLASST forward (decided before
    the K load) and k whose strides a descriptor cannot take keep the per-thread loads (same result);
    also with step_if at 3 stages (the D=64 G=4 32K+ table launch, s43), where the group skips tiles."""
    from sparsecal.kernels.sparse.decode_group import _k_descriptor

    case = CASES[1]
    q, kp, vp, table, kc, vc, lens = serving_batch(seed, case)
    _, _, d, bm, bn, page, dtype = case
    thr = thresholds(q, kc, bn)
    for i, n in enumerate(LENGTHS):
        kc[i, :, n:], vc[i, :, n:] = float("nan"), float("nan")
        if n % page:
            last = int(table[i, (n - 1) // page])
            kp[last, :, n % page:], vp[last, :, n % page:] = float("nan"), float("nan")
    odd = torch.zeros(*kc.shape[:-1], d + 4, dtype=dtype)[..., :d]   # 136-byte rows: no descriptor
    odd.copy_(kc)
    assert _k_descriptor(kc, bn) is not None and _k_descriptor(odd, bn) is None and _k_descriptor(kc, 24) is None
    launches = (SparseLaunch(warps=1, pps=4, tma=True), SparseLaunch(warps=1, stages=3, pps=4, step_if=True, tma=True))
    for kw, decision in (({"thresholds": thr}, "group"), ({"window": 2}, "head"), ({"log_lambda": -2.0}, "group")):
        for (k, v, bt), launch in itertools.product(((kc, vc, None), (kp, vp, table), (odd, vc, None)), launches):
            want, sk, vsk, _ = sparse_decode_ragged(q, k, v, lens, d ** -0.5, bm, bn, block_table=bt,
                                                    decision=decision, **kw)
            got, skipped, v_skipped = group_decode_triton(q, k, v, d ** -0.5, bm, bn, lengths=lens, block_table=bt,
                                                          decision=decision, splits=2, launch=launch, **kw)
            assert not got.isnan().any(), (kw, decision)
            torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
            assert torch.equal(skipped, sk) and torch.equal(v_skipped, vsk), (kw, decision)
            assert vsk.sum() > 0, (kw, decision)   # step_if drops some tile's softmax step


def test_layout_errors():
    q = torch.zeros(2, 4, 1, 64)
    pool = torch.zeros(6, 1, 24, 64)
    with pytest.raises(ValueError, match="multiple of BN"):
        group_decode_triton(q, pool, pool, 0.125, 32, 16, dense=True, lengths=torch.tensor([3, 4]),
                            block_table=torch.zeros(2, 3, dtype=torch.int32))
    pool = torch.zeros(6, 1, 32, 64)
    with pytest.raises(ValueError, match="lengths"):
        group_decode_triton(q, pool, pool, 0.125, 32, 16, dense=True, block_table=torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least one"):
        sparse_decode_ragged(q, torch.zeros(2, 1, 8, 64), torch.zeros(2, 1, 8, 64), [0, 3], 0.125, 32, 16, window=1)
