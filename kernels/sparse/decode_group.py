"""Group decode in Triton: one program loads each K/V tile once for all G query heads of its KV
group and computes scores, decision and attention in one pass (FSA's loop order: the G query rows
are the M dimension of the tl.dot, padded to 16), split along the keys, then a merge.

Semantics are ``reference.sparse_decode`` (contiguous cache, one length) and
``reference.sparse_decode_ragged`` (per-row lengths [B], contiguous or paged): candidates of row b
are the key blocks j < (L_b - 1) // BN, the last reachable block is always computed, and

    decision="head"   each query head skips a tile by its own rule (as ``decode.py``);
    decision="group"  the KV group skips a tile only when every head's rule skips it, else every head
                      keeps it (``reference.group_skip``): the V load is paid when any head keeps a
                      tile, so the group rule loads as many V tiles and computes more exactly.

Passes
    tmax    (BLASST forward, top-k, the other scan orders) ``_group_tmax_kernel`` reads K once and
            stores each head's tile max TMAX [B, H, Kb]; BLASST forward then decides in the attend
            pass from the running max over TMAX (the max over the earlier splits' tiles first), the
            others from a torch mask ``decode.decode_skip_mask`` makes of TMAX. These decisions are
            known before a tile's K load, so a tile every head skips loads neither K nor V there.
    attend  ``_group_attend_kernel`` (grid S x B*Hkv): per tile K load, scores [GP, BLOCK_N],
            decision (BSFA against thresholds[h, min((L_b - 1) // BM, Pt - 1)], window by index, or
            the pre-pass's), then V of the tile when some head keeps it. The V load of tile j - 1 is
            issued with the K load of tile j (a one-tile lag: the decision that masks a V load never
            waits on a K load issued the same step), and the online-softmax step of tile j - 1 runs
            after both loads. Counts per head (candidates skipped) and per group (tiles every head
            skips: V tiles not loaded), per split.
    merge   ``_group_merge_kernel`` (grid B*H) combines the splits and sums the counts; with one
            split the attend pass writes the output and the counts itself (one launch in all); with
            ``SparseLaunch.fuse`` the group's last attend program to finish (an atomic counter per
            group, left zero) merges its heads' splits in split order and sums the counts (no merge
            launch; decode_group_dense's fused merge, ``fuse`` splits' partials at a time: with one
            or two warps a chunk of 8 [GP, D] f32 partials in flight spills registers).

Launch (``SparseLaunch``, per (D, G bucket, length bucket) from ``SPARSE_TABLE``): num_warps / num_stages of the
tmax and attend passes, ``pps`` the split-K target (about pps attend programs per SM, each split at
least MIN_TILES tiles); ``tma`` has the attend pass read K tiles by TMA where the decision is made in
the loop (BSFA, window, dense) and k allows a descriptor (V keeps its masked per-thread loads: a
tile no head keeps loads no V). A deeper lag (the softmax step of tile j - 2 in step j) was measured slower
at every shape (data/bench/NOTES.md, "decode-sweep 2") and removed.

Dense (``dense=True``) is the attend pass with no decision: K + V read once, no score round trip
(``decode.py`` writes and reads f32 scores, 8 * G bytes per key per group on top of 4 * D).

Serving layout (``block_table``): the cache is a page pool k/v [P, Hkv, page_size, D] and row b's
i-th page is block_table[b, i] (FlashInfer's / vLLM's paged KV layout, HND within a page); page_size
a multiple of BN, so a tile never straddles two pages. ``lengths`` [B] int (each >= 1) gives each
row's cache length; without it every row has L (contiguous: k.shape[2]).

Shape legend
    B batch   H query heads   Hkv KV heads   G = H / Hkv (GP = G padded to a power of two >= 16)
    D head dim   L cached tokens (row r = L_b - 1)   Kb key blocks of the longest row   S splits
    Pt threshold positions   P pages in the pool   max_pages pages per row
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from sparsecal.kernels.jit import LAST_COMPILED, LOG2E, dot, dot_flags, log2_lambda, next_pow2, soft_cap, softcap_args
from sparsecal.kernels.sparse.decode import _decode_step, decode_skip_mask, sm_count
from sparsecal.kernels.sparse.decode_group_dense import (
    ATTEND,
    LENGTH_BUCKETS,
    _counters,
    _fused_merge,
    _group_merge_kernel,
    _row,
    _tile_base,
    _tma_aligned,
    _tma_tile,
    buckets,
    dense_group_decode,
    launch_for,
)
from sparsecal.kernels.sparse.reference import check_decision, check_method

MIN_TILES = 4           # each split at least this many key tiles
DENSE, MASK, BSFA, BLASST, WINDOW = 0, 1, 2, 3, 4   # DECIDE codes (as decode.py's decide kernel)


@dataclass(frozen=True)
class SparseLaunch:
    """One launch configuration of the decision passes (module docstring, "Launch")."""
    warps: int = 4
    stages: int = 3
    pps: int = 4
    fuse: int = 0     # the fused merge, this many splits' partials at a time (0: the merge kernel)
    step_if: bool = False   # the softmax step of a tile only when some head of the group keeps it
    tma: bool = False   # the attend pass reads K tiles by TMA (in-loop decisions; V stays per-thread, masked)

    def name(self) -> str:
        """A short label: w4s3p8 (-fuse2 with the fused merge, 2 splits at a time; -if with step_if;
        -tma with TMA K loads)."""
        return (f"w{self.warps}s{self.stages}p{self.pps}" + (f"-fuse{self.fuse}" if self.fuse else "")
                + ("-if" if self.step_if else "") + ("-tma" if self.tma else ""))

    def as_dict(self) -> dict:
        return asdict(self)


SPARSE_DEFAULT = SparseLaunch()   # the launch before the table: 4 warps, 3 stages, 4 programs per SM
# (D, G bucket) -> launch, from the sweeps of the BSFA group decision at 50 % / 75 % (B=16, H=32, 16K-64K, graph
# replays; data/bench/NOTES.md "decode-sweep 2"): fewer warps per program is the lever (each tile's decision and
# softmax reduce the score tile along the keys: across warps that is a shared-memory round trip and a barrier).
# D=128: 2 warps, 8 programs per SM, fastest at every shape on an H100 (decode-sweep2-h100-d128.json: 0.83-0.95 of
# the ideal, the old w4s3p4 0.64-0.87) and on an H200 (decode-sweep3-h200-d128.json; 1 warp there 2x slower).
# D=64: 1 warp (decode-sweep3-h200-d64.json: fastest at every shape, 1.1-1.6x 4 warps), 32 programs per SM at G=1,
# 16 at G >= 4. Both confirmed on an H100 by the targets run (decode-sweep4-h100-d{128,64}.json: the table's launch
# the fastest of the five tried at all 36 shape x sparsity cells).
# The s40 sweep (decode-sweep8-b16-h100-d128.json, -d64.json; s41; the fused merge, 2 and 4 stages and step_if among
# the candidates) found 2 stages faster where the calls are short: at G=1 everywhere (D=128 3.5-6.6 %, D=64 1.3-3.1 %
# over 3 stages), at D=64 G=8 everywhere (7-10 %), at D=128 G=8 16K-32K (1-12 %) and at D=64 G=4 16K (7 %); 3 stages
# stay faster at D=128 G=4, D=128 G=8 64K and D=64 G=4 32K-64K (2-4 %). The fused merge and step_if won no cell by
# more than the rounds' noise (step_if alone: D=128 G=8 64K at 75 %, 2.8 %, and 4 % slower at 50 %). Hence a length
# bucket (decode_group_dense.buckets). G=16 and the 131072 bucket: unmeasured, the longest measured entry.
# The s42 sweep (decode-sweep10-b16-h100-d128.json, -d64.json; TMA K loads of the decision pass and half / twice the
# table's programs per SM among the candidates; 3 rounds): TMA at 3 stages faster than the table's launch at D=128 G=4
# (2.1-4.1 %, every length), D=128 G=8 64K (2.5-4.7 %) and D=64 G=4 32K-64K (0.8-1.8 %); twice the programs per SM at
# D=128 G=8 32K (w2s2p16: 7.6-10.5 %, rounds within 0.1 %; 2.6-3.5 % slower at 16K) and D=64 G=1 (w1s2p64: 0.4-1.5 %);
# half at D=64 G=8 16K (w1s2p8: 1.3-3.1 %). s43 G=4/8 re-sweep (decode-resweep-s43-h100-d*.json): step_if with TMA
# at D=64 G=4 32K+ (w1s3p16-if-tma) 2.9-3.3 % faster at 75 %, 0.2-0.5 % at 50 %; no other cell gains at both.
_W2S2P8, _W2S2P16, _W2S3P8T = (SparseLaunch(warps=2, stages=2, pps=8), SparseLaunch(warps=2, stages=2, pps=16),
                               SparseLaunch(warps=2, stages=3, pps=8, tma=True))
_W1S2P8, _W1S2P16, _W1S2P64 = (SparseLaunch(warps=1, stages=2, pps=p) for p in (8, 16, 64))
_W1S3P16IT = SparseLaunch(warps=1, stages=3, pps=16, step_if=True, tma=True)
_BY_LENGTH = {  # (D, G bucket) -> the launch at 16K, 32K, 64K (the 131072 bucket takes the 64K one)
    (128, 1): (_W2S2P8,) * 3, (128, 4): (_W2S3P8T,) * 3, (128, 8): (_W2S2P8, _W2S2P16, _W2S3P8T),
    (64, 1): (_W1S2P64,) * 3, (64, 4): (_W1S2P16, _W1S3P16IT, _W1S3P16IT), (64, 8): (_W1S2P8, _W1S2P16, _W1S2P16),
    (128, 16): (SparseLaunch(warps=2, pps=8),) * 3, (64, 16): (SparseLaunch(warps=1, pps=16),) * 3,
}
SPARSE_TABLE: dict[tuple[int, int, int], SparseLaunch] = {
    (d, g, n): by[min(i, 2)] for (d, g), by in _BY_LENGTH.items() for i, n in enumerate(LENGTH_BUCKETS)}


def sparse_launch_for(d: int, group: int, length: int) -> SparseLaunch:
    """The table's launch for this head dim, GQA group and cache length (decode_group_dense.buckets:
    G 1 | 4 (2-4) | 8 (5-8) | 16; length 16384 (< 24K) | 32768 (< 48K) | 65536 (< 96K) | 131072),
    else SPARSE_DEFAULT."""
    return SPARSE_TABLE.get(buckets(d, group, length)[:3], SPARSE_DEFAULT)


@triton.jit
def _spread(flag, like):
    """A scalar flag as a bool tensor shaped like ``like`` (the CPU interpreter cannot AND a tensor
    with a scalar bool)."""
    return (like.to(tl.int32) * 0 + flag.to(tl.int32)) != 0


@triton.jit
def _program(Q, sq_b, sq_h, num_heads, group, HEAD_DIM: tl.constexpr, GP: tl.constexpr):
    """(split, bk, b, hk, g_ok [GP], bh [GP] = b * H + query head, offs_d, q [GP, D] (zero rows past G))."""
    split = tl.program_id(0)
    bk = tl.program_id(1)
    hkv = num_heads // group
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, HEAD_DIM)
    b = (bk // hkv).to(tl.int64)
    hk = (bk % hkv).to(tl.int64)
    g_ok = offs_g < group
    heads = hk * group + offs_g
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    return split, bk, b, hk, g_ok, b * num_heads + heads, offs_d, q


@triton.jit
def _scores(q, k_base, sk_n, offs_d, offs_n, keys, length, qk_scale, softcap, kload, BN: tl.constexpr,
            SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One tile's scaled scores s [GP, BLOCK_N] (log2 units, capped when SOFTCAP, -inf past the
    tile or the row) and its key mask [BLOCK_N]; ``kload`` [BLOCK_N] False skips those keys' loads
    (scores -inf)."""
    kmask = (offs_n < BN) & (keys < length)
    kload = kmask & kload
    kt = tl.load(k_base + offs_n[None, :] * sk_n + offs_d[:, None], mask=kload[None, :], other=0.0)
    s = dot(q, kt, None, PREC, UPCAST) * qk_scale
    if SOFTCAP:
        s = soft_cap(s, softcap)
    return tl.where(kload[None, :], s, float("-inf")), kmask


@triton.jit
def _scores_tma(q, K, BT, b, hk, j, s_bt, offs_n, keys, length, qk_scale, softcap, BN: tl.constexpr,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
                SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``_scores`` of every key of tile j with its K rows read by TMA (descriptor K, block [1, 1,
    BLOCK_N, D], BLOCK_N == BN): (s [GP, BLOCK_N], kmask [BLOCK_N]); keys past the row score -inf
    whatever their rows hold."""
    kt = _tma_tile(K, BT, b, hk, j, s_bt, BLOCK_N, HEAD_DIM, PAGE, PAGED)
    s = dot(q, tl.trans(kt), None, PREC, UPCAST) * qk_scale
    if SOFTCAP:
        s = soft_cap(s, softcap)
    kmask = (offs_n < BN) & (keys < length)
    return tl.where(kmask[None, :], s, float("-inf")), kmask


@triton.jit
def _tile_scores(q, K, BT, b, hk, j, sk_b, sk_h, sk_n, s_bt, offs_d, offs_n, keys, length, qk_scale, softcap,
                 BN: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                 PAGED: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Every key's score of tile j for an in-loop decision: (s [GP, BLOCK_N], kmask [BLOCK_N]), K
    read by TMA (``_scores_tma``) or per thread (``_scores``)."""
    if TMA:
        s, kmask = _scores_tma(q, K, BT, b, hk, j, s_bt, offs_n, keys, length, qk_scale, softcap, BN, BLOCK_N,
                               HEAD_DIM, PAGE, PAGED, SOFTCAP, PREC, UPCAST)
    else:
        k_base = _tile_base(K, BT, b, hk, j, sk_b, sk_h, sk_n, s_bt, BN, PAGE, PAGED)
        s, kmask = _scores(q, k_base, sk_n, offs_d, offs_n, keys, length, qk_scale, softcap, offs_n >= 0, BN,
                           SOFTCAP, PREC, UPCAST)
    return s, kmask


@triton.jit
def _keep(tm, pre_keep, j, n_cand, thr, ll2, window, run, g_ok, DECIDE: tl.constexpr, GROUP: tl.constexpr):
    """The tile's decision: (keep [GP] per head, gkeep (some head keeps it), run [GP]). tm [GP] tile
    maxima (log2 units); pre_keep [GP] the torch mask's keep (DECIDE 1); run the BLASST running max
    before this tile (DECIDE 3, returned updated). The last reachable tile (j >= n_cand) is kept."""
    if DECIDE == 0:
        keep = g_ok
    elif DECIDE == 1:
        keep = g_ok & pre_keep
    elif DECIDE == 2:
        keep = g_ok & (tm >= thr)
    elif DECIDE == 3:
        run = tl.maximum(run, tm)
        keep = g_ok & (tl.where(tm >= run, 0.0, tm - run) >= ll2)
    else:
        keep = g_ok & (tl.zeros(g_ok.shape, tl.int32) + j >= n_cand - window)
    keep = keep | (g_ok & (tl.zeros(g_ok.shape, tl.int32) + j >= n_cand))
    gkeep = tl.max(keep.to(tl.int32), 0) > 0
    if GROUP:
        keep = g_ok & _spread(gkeep, g_ok)
    return keep, gkeep, run


@triton.jit
def _pre_decision(TMAX, SKIP, bh, j, n_kb, g_ok, DECIDE: tl.constexpr):
    """(tm [GP], pre_keep [GP]) read before tile j's K load: TMAX [B, H, Kb] for BLASST forward,
    SKIP [B, H, Kb] i8 (1 = skip) for the torch mask."""
    tm = tl.zeros(bh.shape, tl.float32)
    pre_keep = g_ok
    if DECIDE == 3:
        tm = tl.load(TMAX + bh * n_kb + j, mask=g_ok, other=float("-inf"))
    if DECIDE == 1:
        pre_keep = tl.load(SKIP + bh * n_kb + j, mask=g_ok, other=1) == 0
    return tm, pre_keep


@triton.jit
def _prefix_max(TMAX, bh, g_ok, j0, n_kb, CHUNK: tl.constexpr):
    """BLASST forward: each head's running max over tiles 0 .. j0 - 1 (TMAX [B, H, Kb] log2 units)."""
    offs_c = tl.arange(0, CHUNK)
    run = tl.full(bh.shape, float("-inf"), tl.float32)
    for c in range(0, j0, CHUNK):
        t = tl.load(TMAX + bh[:, None] * n_kb + c + offs_c[None, :],
                    mask=g_ok[:, None] & ((c + offs_c) < j0)[None, :], other=float("-inf"))
        run = tl.maximum(run, tl.max(t, 1))
    return run


@triton.jit
def _kept_step(acc, m_i, l_i, s, v, kept, STEP_IF: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """The online-softmax step of one tile (``_decode_step``); with STEP_IF only when some head kept
    the tile (``kept``): a tile no head keeps has all scores -inf and zero V rows, its step changes
    nothing, and skipping it saves the exp2 of the score tile and the P.V product."""
    if STEP_IF:
        if kept:
            acc, m_i, l_i = _decode_step(acc, m_i, l_i, s, v, PREC, UPCAST)
    else:
        acc, m_i, l_i = _decode_step(acc, m_i, l_i, s, v, PREC, UPCAST)
    return acc, m_i, l_i


@triton.jit
def _group_tmax_kernel(Q, K, BT, LENS, TMAX, sq_b, sq_h, sk_b, sk_h, sk_n, s_bt, length, n_kb, tiles_per_split,
                       num_heads, group, qk_scale, softcap, HEAD_DIM: tl.constexpr, BN: tl.constexpr,
                       BLOCK_N: tl.constexpr, GP: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
                       RAGGED: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (S, B * Hkv): TMAX [B, H, Kb] f32 each head's tile max (log2 units, capped) of the
    row's tiles (tiles past a row's length are not written)."""
    split, _pid, b, hk, g_ok, bh, offs_d, q = _program(Q, sq_b, sq_h, num_heads, group, HEAD_DIM, GP)
    length = _row(LENS, b, length, RAGGED)
    offs_n = tl.arange(0, BLOCK_N)
    j0 = split * tiles_per_split
    j1 = tl.minimum(j0 + tiles_per_split, tl.cdiv(length, BN))
    for j in range(j0, j1):
        k_base = _tile_base(K, BT, b, hk, j, sk_b, sk_h, sk_n, s_bt, BN, PAGE, PAGED)
        s, _ok = _scores(q, k_base, sk_n, offs_d, offs_n, j * BN + offs_n, length, qk_scale, softcap,
                         offs_n >= 0, BN, SOFTCAP, PREC, UPCAST)
        tl.store(TMAX + bh * n_kb + j, tl.max(s, 1), mask=g_ok)


@triton.jit
def _decision_state(THR, TMAX, bh, g_ok, j0, n_kb, length, block_m, n_thr, num_heads, DECIDE: tl.constexpr,
                    GP: tl.constexpr):
    """(thr [GP] the heads' BSFA thresholds at this row's position in log2 units (DECIDE 2), run [GP]
    the BLASST running max before split tile j0 from the pre-pass maxima TMAX (DECIDE 3)); zeros and
    -inf otherwise."""
    thr = tl.zeros([GP], tl.float32)
    if DECIDE == 2:
        pos = tl.minimum((length - 1) // block_m, n_thr - 1)
        thr = tl.load(THR + (bh % num_heads) * n_thr + pos, mask=g_ok, other=0.0) * 1.4426950408889634
    run = tl.full([GP], float("-inf"), tl.float32)
    if DECIDE == 3:
        run = _prefix_max(TMAX, bh, g_ok, j0, n_kb, 64)
    return thr, run


@triton.jit
def _group_attend_kernel(Q, K, V, BT, LENS, THR, TMAX, SKIP, ACC, M, LS, CNT, VCNT, CTR, SKD, VSKD, O,
                         sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, s_bt, so_b, so_h, length, n_kb,
                         tiles_per_split, n_split, num_heads, group, qk_scale, softcap, block_m, n_thr, ll2, window,
                         HEAD_DIM: tl.constexpr, BN: tl.constexpr, BLOCK_N: tl.constexpr, GP: tl.constexpr,
                         PAGE: tl.constexpr, PAGED: tl.constexpr, RAGGED: tl.constexpr, DECIDE: tl.constexpr,
                         GROUP: tl.constexpr, PRE: tl.constexpr, DIRECT: tl.constexpr, FUSE: tl.constexpr,
                         FCH: tl.constexpr, STEP_IF: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr,
                         PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (S, B * Hkv): one split of one KV group (module docstring). DECIDE 0 dense, 1 torch mask
    SKIP [B, H, Kb] i8, 2 BSFA (THR [H, n_thr] natural units), 3 BLASST forward (TMAX [B, H, Kb],
    ll2 = ln(lambda) log2 e), 4 window; PRE: DECIDE 1 or 3 (decided before the K load). Partials ACC [B, H, S, D], M, LS [B, H, S] f32 (log2 units)
    and counts CNT [B, H, S], VCNT [B, Hkv, S] i32; DIRECT (S = 1): O [B, H, 1, D] and the counts
    (CNT [B, H], VCNT [B, Hkv] i64) written here; FUSE: the partials, then the group's last program
    (CTR [B * Hkv] i32, zero between calls) writes O and the summed counts SKD [B, H], VSKD [B, Hkv] i64,
    FCH splits' partials at a time. TMA (not with PRE): K a TMA descriptor (``_scores_tma``)."""
    split, bk, b, hk, g_ok, bh, offs_d, q = _program(Q, sq_b, sq_h, num_heads, group, HEAD_DIM, GP)
    length = _row(LENS, b, length, RAGGED)
    offs_n = tl.arange(0, BLOCK_N)
    j0 = split * tiles_per_split
    j1 = tl.minimum(j0 + tiles_per_split, tl.cdiv(length, BN))
    n_cand = (length - 1) // BN
    thr, run = _decision_state(THR, TMAX, bh, g_ok, j0, n_kb, length, block_m, n_thr, num_heads, DECIDE, GP)
    acc = tl.zeros([GP, HEAD_DIM], tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    n_skip = tl.zeros([GP], tl.int32)
    v_skip = tl.zeros([], tl.int32)
    s_prev = tl.full([GP, BLOCK_N], float("-inf"), tl.float32)    # tile j - 1's kept scores
    v_prev = _tile_base(V, BT, b, hk, j0 * 0, sv_b, sv_h, sv_n, s_bt, BN, PAGE, PAGED)
    vm_prev = offs_n < 0                                             # tile j - 1's V rows to load
    gk_prev = tl.zeros([], tl.int32) > 0                             # some head keeps tile j - 1
    for j in range(j0, j1):
        v = tl.load(v_prev + offs_n[:, None] * sv_n + offs_d[None, :], mask=vm_prev[:, None], other=0.0)
        keys = j * BN + offs_n
        if PRE:  # decided from the pre-pass before the K load: a tile no head keeps loads no K
            k_base = _tile_base(K, BT, b, hk, j, sk_b, sk_h, sk_n, s_bt, BN, PAGE, PAGED)
            tm, pre_keep = _pre_decision(TMAX, SKIP, bh, j, n_kb, g_ok, DECIDE)
            keep, gkeep, run = _keep(tm, pre_keep, j, n_cand, thr, ll2, window, run, g_ok, DECIDE, GROUP)
            s, kmask = _scores(q, k_base, sk_n, offs_d, offs_n, keys, length, qk_scale, softcap,
                               _spread(gkeep, offs_n), BN, SOFTCAP, PREC, UPCAST)
        else:
            s, kmask = _tile_scores(q, K, BT, b, hk, j, sk_b, sk_h, sk_n, s_bt, offs_d, offs_n, keys, length, qk_scale,
                                    softcap, BN, BLOCK_N, HEAD_DIM, PAGE, PAGED, TMA, SOFTCAP, PREC, UPCAST)
            keep, gkeep, run = _keep(tl.max(s, 1), g_ok, j, n_cand, thr, ll2, window, run, g_ok, DECIDE, GROUP)
        acc, m_i, l_i = _kept_step(acc, m_i, l_i, s_prev, v, gk_prev, STEP_IF, PREC, UPCAST)   # tile j - 1
        n_skip += (g_ok & ~keep).to(tl.int32)
        v_skip += (~gkeep).to(tl.int32)
        s_prev = tl.where(keep[:, None], s, float("-inf"))
        v_prev = _tile_base(V, BT, b, hk, j, sv_b, sv_h, sv_n, s_bt, BN, PAGE, PAGED)
        vm_prev = kmask & _spread(gkeep, offs_n)
        gk_prev = gkeep
    v = tl.load(v_prev + offs_n[:, None] * sv_n + offs_d[None, :], mask=vm_prev[:, None], other=0.0)
    acc, m_i, l_i = _kept_step(acc, m_i, l_i, s_prev, v, gk_prev, STEP_IF, PREC, UPCAST)
    _epilogue(ACC, M, LS, CNT, VCNT, CTR, SKD, VSKD, O, acc, m_i, l_i, n_skip, v_skip, b, bk, bh, g_ok, offs_d, split,
              n_split, so_b, so_h, num_heads, HEAD_DIM, GP, DIRECT, FUSE, FCH)


@triton.jit
def _epilogue(ACC, M, LS, CNT, VCNT, CTR, SKD, VSKD, O, acc, m_i, l_i, n_skip, v_skip, b, bk, bh, g_ok, offs_d, split,
              n_split, so_b, so_h, num_heads, HEAD_DIM: tl.constexpr, GP: tl.constexpr, DIRECT: tl.constexpr,
              FUSE: tl.constexpr, FCH: tl.constexpr):
    """An attend program's end (``_group_attend_kernel``'s outputs): DIRECT the output and the
    counts; else its split's partials and counts, then with FUSE the group's last program merges."""
    if DIRECT:
        out = acc / l_i[:, None]
        heads = bh % num_heads
        tl.store(O + b * so_b + heads[:, None] * so_h + offs_d[None, :], out.to(O.dtype.element_ty), mask=g_ok[:, None])
        tl.store(CNT + bh, n_skip.to(tl.int64), mask=g_ok)
        tl.store(VCNT + bk, v_skip.to(tl.int64))
    else:
        part = bh * n_split + split
        tl.store(ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])
        tl.store(M + part, m_i, mask=g_ok)
        tl.store(LS + part, l_i, mask=g_ok)
        tl.store(CNT + part, n_skip, mask=g_ok)
        tl.store(VCNT + bk.to(tl.int64) * n_split + split, v_skip)
        if FUSE:
            tl.debug_barrier()    # every thread's partial stores before the release below
            done = tl.atomic_add(CTR + bk, 1, sem="acq_rel")
            if done == n_split - 1:
                tl.debug_barrier()
                _fused_merge(ACC, M, LS, O, bh, g_ok, offs_d, b, so_b, so_h, num_heads, n_split, HEAD_DIM, GP, FCH)
                _fused_counts(CNT, VCNT, SKD, VSKD, bh, bk, g_ok, n_split, FCH)
                tl.atomic_xchg(CTR + bk, 0)


@triton.jit
def _fused_counts(CNT, VCNT, SKD, VSKD, bh, bk, g_ok, n_split, CH: tl.constexpr):
    """The group's last program: SKD [B, H] each head's skipped candidates and VSKD [B, Hkv] the
    group's V tiles not loaded (i64), the sums of the S splits' counts CNT [B, H, S], VCNT [B, Hkv, S]
    (L1 bypassed: the other programs wrote them), CH splits at a time."""
    offs_c = tl.arange(0, CH)
    sk = tl.zeros(bh.shape, tl.int64)
    vs = tl.zeros([CH], tl.int64)
    for c in range(0, n_split, CH):
        s_ok = (c + offs_c) < n_split
        sk += tl.sum(tl.load(CNT + bh[:, None] * n_split + c + offs_c[None, :], mask=g_ok[:, None] & s_ok[None, :],
                             other=0, cache_modifier=".cg").to(tl.int64), 1)
        vs += tl.load(VCNT + bk.to(tl.int64) * n_split + c + offs_c, mask=s_ok, other=0,
                      cache_modifier=".cg").to(tl.int64)
    tl.store(SKD + bh, sk, mask=g_ok)
    tl.store(VSKD + bk, tl.sum(vs, 0))


def group_splits(batch_kv: int, n_kb: int, device, pps: int = SPARSE_DEFAULT.pps) -> int:
    """Splits along the keys: about ``pps`` attend programs per SM, each with at least MIN_TILES
    tiles (8 SMs stand in for the CPU interpreter)."""
    return max(1, min(triton.cdiv(pps * sm_count(device), batch_kv), triton.cdiv(n_kb, MIN_TILES)))


def _check_layout(q, k, v, block_n: int, lengths, block_table) -> tuple:
    """(Hkv, L bound, Kb of the longest row, page size or 0) after the layout checks."""
    b, h, one, d = q.shape
    if one != 1 or k.dim() != 4 or k.shape != v.shape or h % k.shape[1] or k.shape[3] != d or k.stride(-1) != 1 \
            or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"decode takes q [B,H,1,D] and k, v [B,Hkv,L,D] or page pools [P,Hkv,page,D] "
                         f"(contiguous head dim), got {tuple(q.shape)}, {tuple(k.shape)}")
    if block_table is None:
        if k.shape[0] != b:
            raise ValueError(f"k/v hold {k.shape[0]} rows, q {b}")
        bound, page = k.shape[2], 0
    else:
        page = k.shape[2]
        if block_table.dim() != 2 or block_table.shape[0] != b or page % block_n:
            raise ValueError(f"block_table must be [B={b}, max_pages] and the page size ({page}) a multiple of "
                             f"BN ({block_n})")
        bound = block_table.shape[1] * page
    if lengths is not None and (lengths.dim() != 1 or lengths.shape[0] != b):
        raise ValueError(f"lengths must be [B={b}], got {tuple(lengths.shape)}")
    if lengths is None and block_table is not None:
        raise ValueError("a paged cache needs the row lengths")
    return k.shape[1], bound, triton.cdiv(bound, block_n), page


def _mask_for(tmax, lengths, bound: int, block_m: int, block_n: int, kw: dict) -> torch.Tensor:
    """The torch-made skip mask [B, H, Kb] i8 (top-k, BLASST reverse / sink_local) from the pre-pass's
    tile maxima: decode_skip_mask per row length (one length: at once)."""
    if lengths is None:
        return decode_skip_mask(tmax, bound, block_m, block_n, **kw).to(torch.int8)
    mask = torch.zeros(tmax.shape, dtype=torch.int8, device=tmax.device)
    for i, n in enumerate(lengths.tolist()):
        kb = triton.cdiv(n, block_n)
        mask[i:i + 1, :, :kb] = decode_skip_mask(tmax[i:i + 1, :, :kb], n, block_m, block_n, **kw).to(torch.int8)
    return mask


def _split_buffers(q, hkv: int, n_split: int) -> tuple:
    """The attend pass's outputs besides ``out``: with one split (the pass writes the output and
    the final counts itself) no partials and int64 counts [B, H] / [B, Hkv]; else the partials
    (acc [B, H, S, D], m and l [B, H, S] float32) and per-split int32 counts [B, H, S] / [B, Hkv, S]."""
    b, h, _, d = q.shape
    dev, f32 = q.device, torch.float32
    if n_split == 1:
        return ((q, q, q), torch.empty((b, h), dtype=torch.int64, device=dev),
                torch.empty((b, hkv), dtype=torch.int64, device=dev))
    part = (torch.empty((b, h, n_split, d), dtype=f32, device=dev),
            torch.empty((b, h, n_split), dtype=f32, device=dev), torch.empty((b, h, n_split), dtype=f32, device=dev))
    return (part, torch.empty((b, h, n_split), dtype=torch.int32, device=dev),
            torch.empty((b, hkv, n_split), dtype=torch.int32, device=dev))


def group_decode_triton(q, k, v, scale: float, block_m: int, block_n: int, *, thresholds=None,
                        log_lambda: float | None = None, window: int | None = None, order: str = "forward",
                        topk: int | None = None, dense: bool = False, decision: str = "head", lengths=None,
                        block_table=None, splits: int | None = None, launch: SparseLaunch | None = None,
                        softcap: float = 0.0, dense_launch=None):
    """One decode step with the group kernel; the Triton twin of ``reference.sparse_decode`` (one
    length) and ``reference.sparse_decode_ragged`` (``lengths`` and / or ``block_table``).

    q [B, H, 1, D]; k/v [B, Hkv, L, D] (fp16/bf16/fp32) or page pools [P, Hkv, page_size, D] with
    block_table [B, max_pages] int32 and lengths [B] int32 on q's device. Exactly one of
    thresholds [H, Pt], log_lambda, window, topk, or dense=True; ``decision`` "head" | "group".
    ``launch`` the decision passes' SparseLaunch (None: ``sparse_launch_for`` the shape); ``dense=True`` runs
    decode_group_dense with ``dense_launch`` (a DenseLaunch; None: its table's entry for the shape;
    "attend" (ATTEND): the attend pass with skipping off, the path before the table, which the table
    also names where a sweep measured it fastest).
    Returns (out [B, H, 1, D] in q.dtype, skipped [B, H] int64 candidate tiles each head skipped,
    v_skipped [B, Hkv] int64 tiles every head of the group skipped: V tiles not loaded).
    """
    decide = _decide_code(thresholds, log_lambda, window, topk, dense, decision, order)
    hkv, bound, kb, page = _check_layout(q, k, v, block_n, lengths, block_table)
    if decide == DENSE:
        dense_launch = dense_launch or launch_for(q.shape[-1], q.shape[1] // hkv, bound, q.shape[0])
        if dense_launch != ATTEND:
            return dense_group_decode(q, k, v, scale, lengths=lengths, block_table=block_table, bound=bound,
                                      page=page, splits=splits, cfg=dense_launch, softcap=softcap)
    b, h, _, d = q.shape
    dev, f32 = q.device, torch.float32
    cfg = launch or sparse_launch_for(d, h // hkv, bound)
    n_split = splits or group_splits(b * hkv, kb, dev, cfg.pps)
    tps = triton.cdiv(kb, n_split)
    n_split = triton.cdiv(kb, tps)
    prec, upcast = dot_flags(q.dtype)
    cap_on, cap = softcap_args(softcap)
    lens = lengths.to(device=dev, dtype=torch.int32) if lengths is not None else q
    bt = block_table.to(device=dev, dtype=torch.int32) if block_table is not None else q
    common = {"HEAD_DIM": d, "BN": block_n, "BLOCK_N": next_pow2(block_n), "GP": next_pow2(h // hkv),
              "PAGE": max(page, 1), "PAGED": block_table is not None, "RAGGED": lengths is not None, "SOFTCAP": cap_on,
              "PREC": prec, "UPCAST": upcast, "num_warps": cfg.warps, "num_stages": cfg.stages}
    q2 = q[:, :, 0]
    strides = (q2.stride(0), q2.stride(1), k.stride(0), k.stride(1), k.stride(2))
    tmax = skip = q
    if decide in (MASK, BLASST):
        tmax = torch.empty((b, h, kb), dtype=f32, device=dev)
        LAST_COMPILED["group_tmax"] = _group_tmax_kernel[(n_split, b * hkv)](
            q2, k, bt, lens, tmax, *strides, bt.stride(0) if block_table is not None else 0, bound, kb, tps, h,
            h // hkv, scale * LOG2E, cap, **common)
    if decide == MASK:
        skip = _mask_for(tmax, lengths, bound, block_m, block_n,
                         {"log_lambda": log_lambda, "order": order, "topk": topk})
    thr = thresholds.to(device=dev, dtype=f32).contiguous() if decide == BSFA else q
    tail = (bound, kb, tps, n_split, h, h // hkv, scale * LOG2E, cap, block_m, thr.shape[-1] if decide == BSFA else 1,
            0.0 if log_lambda is None else log2_lambda(log_lambda), int(window or 0))
    pre = decide in (MASK, BLASST)
    kx = _k_descriptor(k, block_n) if cfg.tma and not pre else None
    flags = {"DECIDE": decide, "GROUP": decision == "group", "PRE": pre, "STEP_IF": cfg.step_if,
             "TMA": kx is not None, **common}
    return _attend(q, k, v, (bt, lens, thr, tmax, skip), strides + (v.stride(0), v.stride(1), v.stride(2),
                   bt.stride(0) if block_table is not None else 0), tail, flags, cfg.fuse, kx)


def _decide_code(thresholds, log_lambda, window, topk, dense: bool, decision: str, order: str) -> int:
    """The attend pass's DECIDE code of a call's method (one of thresholds, log_lambda, window,
    topk, dense; checked): DENSE, BSFA, WINDOW, BLASST (forward order), else MASK (a precomputed
    skip mask: top-k, BLASST in another order)."""
    from sparsecal.kernels.sparse.prefill import method_code

    if topk is not None:
        check_method(thresholds, log_lambda, window, topk)
        if dense:
            raise ValueError("method 'dense' takes no topk")
    check_decision(decision)
    method = 4 if topk is not None else method_code(thresholds, log_lambda, window, dense)
    return {0: DENSE, 1: BSFA, 3: WINDOW, 4: MASK}.get(method, BLASST if order == "forward" else MASK)


def _k_descriptor(k, block_n: int):
    """A TMA descriptor over k [B, Hkv, L, D] or the page pool [P, Hkv, page, D] (block [1, 1,
    block_n, D]) where a power-of-two block_n and k's 16-byte aligned base and strides allow one, else None
    (the per-thread loads)."""
    if block_n != next_pow2(block_n) or not _tma_aligned(k):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, block_n, k.shape[-1]])


def _attend(q, k, v, inputs: tuple, strides: tuple, tail: tuple, flags: dict, chunk: int, kx=None) -> tuple:
    """The attend pass (grid S x B*Hkv) and the merge: one launch when S = 1 or ``chunk`` (the last
    program of a group merges, ``chunk`` splits at a time), else the merge kernel. inputs (BT, LENS,
    THR, TMAX, SKIP); strides up to s_bt; tail the kernel's scalars from ``length``; kx a TMA
    descriptor over k (flags["TMA"]). Returns (out, skipped [B, H], v_skipped [B, Hkv])."""
    b, h, _, d = q.shape
    hkv, n_split = k.shape[1], tail[3]
    dev = q.device
    out = torch.empty_like(q)
    direct, fuse = n_split == 1, chunk > 0 and n_split > 1
    part, cnt, vcnt = _split_buffers(q, hkv, n_split)
    skipped = torch.empty((b, h), dtype=torch.int64, device=dev) if not direct else cnt
    v_skipped = torch.empty((b, hkv), dtype=torch.int64, device=dev) if not direct else vcnt
    ctr = _counters(b * hkv, dev) if fuse else q
    LAST_COMPILED["group_attend"] = _group_attend_kernel[(n_split, b * hkv)](
        q[:, :, 0], k if kx is None else kx, v, *inputs, *part, cnt, vcnt, ctr, skipped, v_skipped, out, *strides,
        out.stride(0),
        out.stride(1), *tail, DIRECT=direct, FUSE=fuse, FCH=max(chunk, 1), **flags)
    if not (direct or fuse):
        _group_merge_kernel[(b * h,)](*part, cnt, vcnt, out, skipped, v_skipped, out.stride(0), out.stride(1), h,
                                      h // hkv, n_split, HEAD_DIM=d, SP=next_pow2(n_split, 2), num_warps=4)
    return out, skipped, v_skipped


def decode_tile_maxima(q, k, scale: float, block_n: int, lengths=None, block_table=None) -> torch.Tensor:
    """Each head's decode-row tile maxima [B, H, Kb] f32 in natural units (the tmax pre-pass; tiles
    past a row's length hold no value): operating points of a benchmark without an L x D copy of K."""
    hkv, bound, kb, page = _check_layout(q, k, k, block_n, lengths, block_table)
    b, h, _, d = q.shape
    n_split = group_splits(b * hkv, kb, q.device)
    tps = triton.cdiv(kb, n_split)
    prec, upcast = dot_flags(q.dtype)
    tmax = torch.full((b, h, kb), float("-inf"), dtype=torch.float32, device=q.device)
    lens = lengths.to(device=q.device, dtype=torch.int32) if lengths is not None else q
    bt = block_table.to(device=q.device, dtype=torch.int32) if block_table is not None else q
    q2 = q[:, :, 0]
    _group_tmax_kernel[(triton.cdiv(kb, tps), b * hkv)](
        q2, k, bt, lens, tmax, q2.stride(0), q2.stride(1), k.stride(0), k.stride(1), k.stride(2),
        bt.stride(0) if block_table is not None else 0, bound, kb, tps, h, h // hkv, scale * LOG2E, 0.0,
        HEAD_DIM=d, BN=block_n, BLOCK_N=next_pow2(block_n), GP=next_pow2(h // hkv), PAGE=max(page, 1),
        PAGED=block_table is not None, RAGGED=lengths is not None, SOFTCAP=False, PREC=prec, UPCAST=upcast)
    return tmax / LOG2E
