"""Dense group decode in Triton with a per-shape launch configuration (issue 28 part 1): the group
kernel's ``dense=True`` path (decode_group.py) without the decision machinery, tuned per (D, G,
length) from a table that a GPU sweep (``python -m sparsecal.bench.decode --sweep``) fills.

One program per (key split, KV group) reads each K/V tile once for all G query heads. The loop over
the split's full tiles has no masks and its K and V addresses follow the loop index alone, so the
pipeliner can run both loads ``stages`` tiles ahead; a row's last partial tile is a second, masked
loop of at most one step. Nothing is decided, so the loop tile BLOCK_N need not be the decision tile
BN (the counts are all zero by definition); on a paged cache BLOCK_N divides the page.

Launch options (``DenseLaunch``)
    block_n  loop tile (power of two, 16..256)          warps, stages  num_warps, num_stages
    pps      split-K target: about pps programs per SM   (splits = cdiv(pps * SMs, B * Hkv), each
             split at least MIN_TILES tiles)
    waves    (> 0, replaces pps) splits = the most that fit ``waves`` full waves: floor(waves * SMs *
             occupancy / (B * Hkv)), occupancy (programs an SM holds) from the compiled kernel's
             registers and shared memory, read from a first launch with pps splits whose result is
             discarded (once per process and shape): a wave-quantization tail of at most one
             program per slot, and the same splits on every call
    dot      True: q.K and p.V on tensor cores (G rows padded to 16); False: CUDA-core products
             (broadcast-multiply-sum, G padded to a power of two >= 1: no padding at G = 1)
    evict    K/V loads with eviction_policy="evict_first" (streamed once: keep L2 for others)
    fuse     the last program of a group to finish (an atomic counter per group) merges the splits,
             MERGE_CHUNK splits' partials loaded at once: no merge launch (the counter is a cached
             workspace reset by that program)
    tma      (with dot) K/V tiles read by TMA through descriptors over k/v or the page pool (block
             [1, 1, BLOCK_N, D]) instead of per-thread loads; where the tensors' strides or base
             addresses are not 16-byte aligned, the per-thread loads

``launch_for(d, group, length, batch)`` looks the configuration up in ``DENSE_TABLE`` keyed by (D,
G bucket, length bucket, batch bucket) (``buckets``), else ``DENSE_DEFAULT``: the configuration the
group kernel used before the table (64-key tiles, 4 warps, 3 stages, 4 programs per SM, tensor
cores). An entry may be ``ATTEND``: the decision kernel's attend pass with skipping off, where a
sweep measured it fastest (D = 64 at batch 1).

Shape legend
    B batch   H query heads   Hkv KV heads   G = H / Hkv   GP = G padded (16 with tensor cores)
    D head dim   L cached tokens   T loop tiles of the longest row   S splits
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from sparsecal.kernels.jit import LAST_COMPILED, LOG2E, dot, dot_flags, next_pow2, soft_cap, softcap_args
from sparsecal.kernels.sparse.decode import _merge_splits, sm_count

MIN_TILES = 4   # each split at least this many loop tiles


@triton.jit
def _row(LENS, b, length, RAGGED: tl.constexpr):
    """Row b's cache length (LENS [B] i32 when RAGGED, else the scalar length)."""
    if RAGGED:
        length = tl.load(LENS + b)
    return length


@triton.jit
def _tile_base(X, BT, b, hk, j, sx_b, sx_h, sx_n, s_bt, BN: tl.constexpr, PAGE: tl.constexpr,
               PAGED: tl.constexpr):
    """Pointer to key 0 of tile j of (row b, KV head hk): X [B, Hkv, L, D] (strides sx_b, sx_h,
    sx_n) or, PAGED, a pool [P, Hkv, PAGE, D] (sx_b the page stride) through BT [B, max_pages]."""
    key0 = j * BN
    if PAGED:
        page = tl.load(BT + b * s_bt + key0 // PAGE).to(tl.int64)
        return X + page * sx_b + hk * sx_h + (key0 % PAGE) * sx_n
    else:
        return X + b * sx_b + hk * sx_h + key0.to(tl.int64) * sx_n


@triton.jit
def _group_merge_kernel(ACC, M, LS, CNT, VCNT, O, SK, VSK, so_b, so_h, num_heads, group, n_split,
                        HEAD_DIM: tl.constexpr, SP: tl.constexpr):
    """Grid (B * H): O[b, h] = sum_s 2^(M_s - m) ACC_s / sum_s 2^(M_s - m) LS_s; SK [B, H] and (the
    group's first head) VSK [B, Hkv] i64 the counts summed over the splits."""
    bh = tl.program_id(0).to(tl.int64)
    b, h, offs_s, s_ok = _merge_splits(ACC, M, LS, O, bh, so_b, so_h, num_heads, n_split, HEAD_DIM, SP)
    tl.store(SK + bh, tl.sum(tl.load(CNT + bh * n_split + offs_s, mask=s_ok, other=0), 0).to(tl.int64))
    if h % group == 0:
        bk = b * (num_heads // group) + h // group
        vc = tl.sum(tl.load(VCNT + bk * n_split + offs_s, mask=s_ok, other=0), 0)
        tl.store(VSK + bk, vc.to(tl.int64))


@dataclass(frozen=True)
class DenseLaunch:
    """One launch configuration of the dense group decode (module docstring)."""
    block_n: int = 64
    warps: int = 4
    stages: int = 3
    pps: int = 4
    dot: bool = True
    evict: bool = False
    fuse: bool = False
    waves: int = 0
    tma: bool = False

    def name(self) -> str:
        """A short label: n64w4s3p4 (or W2 for waves=2) plus -nodot / -evict / -fuse / -tma."""
        flags = ("" if self.dot else "-nodot") + ("-evict" if self.evict else "") + ("-fuse" if self.fuse else "")
        flags += "-tma" if self.tma else ""
        split = f"W{self.waves}" if self.waves else f"p{self.pps}"
        return f"n{self.block_n}w{self.warps}s{self.stages}{split}{flags}"

    def as_dict(self) -> dict:
        return asdict(self)


DENSE_DEFAULT = DenseLaunch()                                    # n64w4s3p4
ATTEND = "attend"   # the group kernel's attend pass with skipping off (decode_group.py), as a table entry
_N128 = DenseLaunch(block_n=128, warps=4, stages=3, waves=2)    # n128w4s3W2
_N128W1 = DenseLaunch(block_n=128, warps=4, stages=3, waves=1)  # n128w4s3W1
_W1P32 = DenseLaunch(warps=1, stages=3, pps=32)                 # n64w1s3p32
LENGTH_BUCKETS = (16384, 32768, 65536, 131072)
# Batch 16 (data/bench/decode-sweep4-h100-d128.json, -d64.json; B=16, H=32, graph replays, 3 rounds): n128w4s3W2 was
# the fastest dense launch at all 9 D=128 shapes (+0.4-1.2 % over the previous entry, n128w8s2W2) and within 0.2 % of
# the fastest at D=64 G=4/8; at D=64 G=1 n64w2s4p8 (+0.5-1.2 % over n64w4s3W1). Swept at 16K-64K: the 131072 bucket
# takes the 65536 entry unmeasured. A later batch-16 sweep of G=4/8 at 16K-32K (decode-sweep6-b16-h100-d128.json,
# -d64.json, with one-wave launches among the candidates) found n128w4s3W1 fastest at D=128 (+1.0-2.2 % over
# n128w4s3W2) and within 0.2 % of the fastest at D=64: those 8 entries are n128w4s3W1.
# Batch 1 (decode-sweep5-b1-h100-d128.json, -d64.json; B=1, H=32, 16K-128K, 2 rounds): one wave of 128-key splits
# (n128w4s3W1) the fastest at all 12 D=128 shapes, 0.992-1.034x cuDNN where n128w4s3W2 ran 0.943-1.026x; at D=64 the
# winner moves with G and length (per entry below), 0.961-1.055x cuDNN.
_B1_D64 = {1: (DENSE_DEFAULT, ATTEND, ATTEND, ATTEND), 4: (ATTEND, _W1P32, DENSE_DEFAULT, DENSE_DEFAULT),
           8: (_N128, ATTEND, _W1P32, DENSE_DEFAULT)}
# Batch 16 again with the chunked fused merge among the candidates (decode-sweep7-b16-h100-d64.json, -d128.json; s40):
# n128w4s3W1-fuse the fastest or within 0.1 % of it at every G = 4/8 shape (D=64 G=8: 0.977-0.979x cuDNN, +0.5-1.1 %
# over the unfused entries) and at D=128 G=1 16K-32K; at D=64 G=1 n128w4s4W2 (0.994-1.000x, +0.7-1.5 % over
# n64w2s4p8); at D=128 G=1 64K n64w2s3p16 (1.000x; the fused launch 0.994x).
# Batch 16 with TMA loads among the candidates (decode-sweep8-b16-h100-d64.json, -d128.json; s41): at D=64 the one-wave
# fused TMA launch n128w4s3W1-fuse-tma is the fastest or within 0.3 % of it at all 9 shapes (G=8 0.991-1.001x cuDNN
# where the s40 entry ran 0.980-0.983x; G=4 1.003-1.010x); at D=128 G=8 n128w4s2W1-fuse-tma the fastest at all three
# lengths (0.994-1.002x); at D=128 G=1 n128w8s2W2 and at G=4 n128w4s3W1 within 0.2 % of the fastest at each length.
_N128W8 = DenseLaunch(block_n=128, warps=8, stages=2, waves=2)                       # n128w8s2W2
_TMA3 = DenseLaunch(block_n=128, warps=4, stages=3, waves=1, fuse=True, tma=True)    # n128w4s3W1-fuse-tma
_TMA2 = DenseLaunch(block_n=128, warps=4, stages=2, waves=1, fuse=True, tma=True)    # n128w4s2W1-fuse-tma
_B16 = {(128, 1): _N128W8, (128, 4): _N128W1, (128, 8): _TMA2, (64, 1): _TMA3, (64, 4): _TMA3, (64, 8): _TMA3}
DENSE_TABLE: dict[tuple[int, int, int, int], DenseLaunch | str] = {
    **{(d, g, n, 16): _B16[(d, g)] for d in (64, 128) for g in (1, 4, 8) for n in LENGTH_BUCKETS},
    **{(128, g, n, 1): _N128W1 for g in (1, 4, 8) for n in LENGTH_BUCKETS},
    **{(64, g, n, 1): _B1_D64[g][i] for g in (1, 4, 8) for i, n in enumerate(LENGTH_BUCKETS)},
}


def buckets(d: int, group: int, length: int, batch: int = 16) -> tuple[int, int, int, int]:
    """The table key: (D, G bucket 1 | 4 (2-4) | 8 (5-8) | 16 (more), length bucket 16384 (< 24K)
    | 32768 (< 48K) | 65536 (< 96K) | 131072, batch bucket 1 (B <= 2) | 16 (more; measured at 1 and
    16 only))."""
    g = 1 if group == 1 else 4 if group <= 4 else 8 if group <= 8 else 16
    n = 16384 if length < 24576 else 32768 if length < 49152 else 65536 if length < 98304 else 131072
    return d, g, n, 1 if batch <= 2 else 16


def launch_for(d: int, group: int, length: int, batch: int = 16) -> DenseLaunch | str:
    """The table's launch for this shape (a DenseLaunch or ATTEND), else DENSE_DEFAULT."""
    return DENSE_TABLE.get(buckets(d, group, length, batch), DENSE_DEFAULT)


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr, EVICT: tl.constexpr):
    """A K/V tile load: masked (other 0) or not, evict-first or not."""
    if MASKED:
        if EVICT:
            x = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        if EVICT:
            x = tl.load(ptrs, eviction_policy="evict_first")
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _dense_tile(acc, m_i, l_i, q, k_base, v_base, sk_n, sv_n, offs_n, offs_d, kmask, qk_scale, softcap,
                MASKED: tl.constexpr, USE_DOT: tl.constexpr, EVICT: tl.constexpr, SOFTCAP: tl.constexpr,
                PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile's online-softmax step for the GP rows: acc [GP, D], m_i, l_i [GP] (log2 units);
    kmask [BLOCK_N] the keys inside the row (MASKED only)."""
    if USE_DOT:
        kt = _load(k_base + offs_n[None, :] * sk_n + offs_d[:, None], kmask[None, :], MASKED, EVICT)
        s = dot(q, kt, None, PREC, UPCAST) * qk_scale
    else:
        k = _load(k_base + offs_n[:, None] * sk_n + offs_d[None, :], kmask[:, None], MASKED, EVICT)
        s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2) * qk_scale
    if SOFTCAP:
        s = soft_cap(s, softcap)
    if MASKED:
        s = tl.where(kmask[None, :], s, float("-inf"))
    v = _load(v_base + offs_n[:, None] * sv_n + offs_d[None, :], kmask[:, None], MASKED, EVICT)
    return _softmax_pv(acc, m_i, l_i, s, v, USE_DOT, PREC, UPCAST)


@triton.jit
def _softmax_pv(acc, m_i, l_i, s, v, USE_DOT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """The online-softmax update from a tile's scores s [GP, BLOCK_N] (log2 units) and its V rows
    v [BLOCK_N, D]: (acc [GP, D], m_i, l_i [GP])."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    if USE_DOT:
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], PREC, UPCAST)
    else:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
    return acc, m_new, l_i


@triton.jit
def _tma_tile(X, BT, b, hk, j, s_bt, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
              PAGED: tl.constexpr):
    """Tile j [BLOCK_N, D] of (row b, KV head hk) through a TMA descriptor X (block [1, 1, BLOCK_N,
    D]) over k/v [B, Hkv, L, D] or, PAGED, the pool [P, Hkv, PAGE, D] through BT [B, max_pages];
    keys past the tensor read as 0."""
    key0 = j * BLOCK_N
    if PAGED:
        page = tl.load(BT + b * s_bt + key0 // PAGE)
        x = X.load([page, hk.to(tl.int32), (key0 % PAGE).to(tl.int32), 0])
    else:
        x = X.load([b.to(tl.int32), hk.to(tl.int32), key0.to(tl.int32), 0])
    return tl.reshape(x, [BLOCK_N, HEAD_DIM])


@triton.jit
def _dense_tile_tma(acc, m_i, l_i, q, K, V, BT, b, hk, j, s_bt, kmask, qk_scale, softcap, MASKED: tl.constexpr,
                    SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr):
    """``_dense_tile`` on tensor cores with K and V tiles read by TMA (descriptors K, V); MASKED: the
    keys outside kmask [BLOCK_N] score -inf and their V rows (another row's keys, or a page's unused
    rows) count as 0."""
    k = _tma_tile(K, BT, b, hk, j, s_bt, BLOCK_N, HEAD_DIM, PAGE, PAGED)
    v = _tma_tile(V, BT, b, hk, j, s_bt, BLOCK_N, HEAD_DIM, PAGE, PAGED)
    s = dot(q, tl.trans(k), None, PREC, UPCAST) * qk_scale
    if SOFTCAP:
        s = soft_cap(s, softcap)
    if MASKED:
        s = tl.where(kmask[None, :], s, float("-inf"))
        v = tl.where(kmask[:, None], v, 0.0)
    return _softmax_pv(acc, m_i, l_i, s, v, True, PREC, UPCAST)


MERGE_CHUNK = tl.constexpr(8)   # splits whose partials the fused merge loads at once


@triton.jit
def _fused_merge(ACC, M, LS, O, bh, g_ok, offs_d, b, so_b, so_h, num_heads, n_split, HEAD_DIM: tl.constexpr,
                 GP: tl.constexpr, CH: tl.constexpr):
    """The last program of a group: O rows of its heads from the S partials (L1 bypassed: the other
    programs wrote them), CH splits at a time: a chunk's loads (M, LS [GP, CH], each split's ACC
    rows) depend on nothing computed, so they are in flight together and the merge, which sits on
    the group's critical path after the atomic, pays about S / CH memory latencies instead of S."""
    offs_c = tl.arange(0, CH)
    acc = tl.zeros([GP, HEAD_DIM], tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    ls = tl.zeros([GP], tl.float32)
    for c in range(0, n_split, CH):
        ok = g_ok[:, None] & (c + offs_c < n_split)[None, :]
        idx = bh[:, None] * n_split + c + offs_c[None, :]
        m_c = tl.load(M + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_c = tl.load(LS + idx, mask=ok, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(m_c, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        w_c = tl.math.exp2(m_c - m_ref[:, None])   # [GP, CH]; 0 past S
        w_old = tl.math.exp2(m - m_ref)
        ls = ls * w_old + tl.sum(w_c * l_c, 1)
        acc = acc * w_old[:, None]
        for i in tl.static_range(CH):
            part = bh * n_split + c + i
            a_i = tl.load(ACC + part[:, None] * HEAD_DIM + offs_d[None, :],
                          mask=(g_ok & (part < (bh + 1) * n_split))[:, None], other=0.0, cache_modifier=".cg")
            acc += a_i * tl.sum(tl.where(offs_c[None, :] == i, w_c, 0.0), 1)[:, None]
        m = m_new
    heads = bh % num_heads
    tl.store(O + b * so_b + heads[:, None] * so_h + offs_d[None, :], (acc / ls[:, None]).to(O.dtype.element_ty),
             mask=g_ok[:, None])


@triton.jit
def _group_dense_kernel(Q, K, V, BT, LENS, ACC, M, LS, CNT, VCNT, CTR, O,
                        sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, s_bt, so_b, so_h, length,
                        tiles_per_split, n_split, num_heads, group, qk_scale, softcap,
                        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, GP: tl.constexpr, PAGE: tl.constexpr,
                        PAGED: tl.constexpr, RAGGED: tl.constexpr, USE_DOT: tl.constexpr, EVICT: tl.constexpr,
                        DIRECT: tl.constexpr, FUSE: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr,
                        PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (S, B * Hkv): one split of one KV group, no decision (TMA: K, V are TMA descriptors). DIRECT (S = 1) writes O [B, H, 1,
    D] and zero counts CNT [B, H], VCNT [B, Hkv] i64; else partials ACC [B, H, S, D], M, LS [B, H,
    S] f32 and zero counts CNT [B, H, S], VCNT [B, Hkv, S] i32 for the merge kernel, or, FUSE, the
    partials and the group's last program (CTR [B * Hkv] i32, zero between calls) merges them into O
    and writes the DIRECT counts."""
    split = tl.program_id(0)
    bk = tl.program_id(1)
    hkv = num_heads // group
    b = (bk // hkv).to(tl.int64)
    hk = (bk % hkv).to(tl.int64)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < group
    heads = hk * group + offs_g
    bh = b * num_heads + heads
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    length = _row(LENS, b, length, RAGGED)
    j0 = split * tiles_per_split
    j1 = tl.minimum(j0 + tiles_per_split, tl.cdiv(length, BLOCK_N))
    jf = tl.maximum(tl.minimum(j1, length // BLOCK_N), j0)
    acc = tl.zeros([GP, HEAD_DIM], tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    for j in range(j0, jf):
        if TMA:
            acc, m_i, l_i = _dense_tile_tma(acc, m_i, l_i, q, K, V, BT, b, hk, j, s_bt, offs_n >= 0, qk_scale, softcap,
                                            False, SOFTCAP, PREC, UPCAST, BLOCK_N, HEAD_DIM, PAGE, PAGED)
        else:
            k_base = _tile_base(K, BT, b, hk, j, sk_b, sk_h, sk_n, s_bt, BLOCK_N, PAGE, PAGED)
            v_base = _tile_base(V, BT, b, hk, j, sv_b, sv_h, sv_n, s_bt, BLOCK_N, PAGE, PAGED)
            acc, m_i, l_i = _dense_tile(acc, m_i, l_i, q, k_base, v_base, sk_n, sv_n, offs_n, offs_d, offs_n >= 0,
                                        qk_scale, softcap, False, USE_DOT, EVICT, SOFTCAP, PREC, UPCAST)
    for j in range(jf, j1):   # the row's last, partial tile (at most one step)
        if TMA:
            acc, m_i, l_i = _dense_tile_tma(acc, m_i, l_i, q, K, V, BT, b, hk, j, s_bt, j * BLOCK_N + offs_n < length,
                                            qk_scale, softcap, True, SOFTCAP, PREC, UPCAST, BLOCK_N, HEAD_DIM, PAGE,
                                            PAGED)
        else:
            k_base = _tile_base(K, BT, b, hk, j, sk_b, sk_h, sk_n, s_bt, BLOCK_N, PAGE, PAGED)
            v_base = _tile_base(V, BT, b, hk, j, sv_b, sv_h, sv_n, s_bt, BLOCK_N, PAGE, PAGED)
            acc, m_i, l_i = _dense_tile(acc, m_i, l_i, q, k_base, v_base, sk_n, sv_n, offs_n, offs_d,
                                        j * BLOCK_N + offs_n < length, qk_scale, softcap, True, USE_DOT, EVICT,
                                        SOFTCAP, PREC, UPCAST)
    _dense_epilogue(ACC, M, LS, CNT, VCNT, CTR, O, acc, m_i, l_i, b, bk, bh, g_ok, offs_d, split, n_split, so_b, so_h,
                    num_heads, HEAD_DIM, GP, DIRECT, FUSE)


@triton.jit
def _dense_epilogue(ACC, M, LS, CNT, VCNT, CTR, O, acc, m_i, l_i, b, bk, bh, g_ok, offs_d, split, n_split, so_b, so_h,
                    num_heads, HEAD_DIM: tl.constexpr, GP: tl.constexpr, DIRECT: tl.constexpr, FUSE: tl.constexpr):
    """A dense program's end (``_group_dense_kernel``'s outputs): DIRECT the output and zero counts;
    else its split's partials, then (FUSE) the group's last program merges, or zero per-split counts."""
    if DIRECT:
        tl.store(O + b * so_b + (bh % num_heads)[:, None] * so_h + offs_d[None, :],
                 (acc / l_i[:, None]).to(O.dtype.element_ty), mask=g_ok[:, None])
        tl.store(CNT + bh, tl.zeros([GP], tl.int64), mask=g_ok)
        tl.store(VCNT + bk, tl.zeros([], tl.int64))
    else:
        part = bh * n_split + split
        tl.store(ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])
        tl.store(M + part, m_i, mask=g_ok)
        tl.store(LS + part, l_i, mask=g_ok)
        if FUSE:
            tl.debug_barrier()    # every thread's partial stores before the release below
            done = tl.atomic_add(CTR + bk, 1, sem="acq_rel")
            if done == n_split - 1:
                tl.debug_barrier()
                _fused_merge(ACC, M, LS, O, bh, g_ok, offs_d, b, so_b, so_h, num_heads, n_split, HEAD_DIM, GP,
                             MERGE_CHUNK)
                tl.store(CNT + bh, tl.zeros([GP], tl.int64), mask=g_ok)
                tl.store(VCNT + bk, tl.zeros([], tl.int64))
                tl.atomic_xchg(CTR + bk, 0)
        else:
            tl.store(CNT + part, tl.zeros([GP], tl.int32), mask=g_ok)
            tl.store(VCNT + bk.to(tl.int64) * n_split + split, tl.zeros([], tl.int32))


_COUNTERS: dict = {}   # device -> int32 workspace of the fused merge's group counters (zero between calls)


def _counters(n: int, device) -> torch.Tensor:
    """At least n zeroed group counters on ``device`` (allocated once per device and size: the
    kernels leave them zero, so CUDA-graph replays need no memset, and an eager warm-up's buffer
    serves a later capture). One workspace a device: fused calls on one stream run one after
    another; two fused calls running at once on two streams of a device would share counters."""
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


_OCCUPANCY: dict = {}   # (device, DenseLaunch, D, GP, dtype) -> programs one SM holds (from the compiled kernel)


def occupancy(compiled, warps: int, device) -> int:
    """Programs of a compiled kernel one SM holds: min over its shared memory, registers and warps
    (device properties where torch has them, else an H100's 228 KiB / 64K registers)."""
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    n_regs = int(getattr(compiled, "n_regs", 0) or 0)
    by_smem = smem // (shared + 1024) if shared else 32
    by_regs = regs // (n_regs * 32 * warps) if n_regs else 32
    return max(1, min(by_smem, by_regs, 64 // warps, 32))


def dense_splits(batch_kv: int, n_tiles: int, cfg: DenseLaunch, device, occ: int | None = None) -> int:
    """Splits along the keys: ``cfg.waves`` full waves when the occupancy ``occ`` is known, else
    about cfg.pps programs per SM; each split at least MIN_TILES loop tiles (8 SMs, occupancy 1,
    stand in for the CPU interpreter)."""
    sms = sm_count(device)
    if cfg.waves and (occ or device.type != "cuda"):
        want = max(1, cfg.waves * sms * (occ or 1) // batch_kv)
    else:
        want = triton.cdiv(cfg.pps * sms, batch_kv)
    return max(1, min(want, triton.cdiv(n_tiles, MIN_TILES)))


def loop_tile(cfg: DenseLaunch, page: int) -> int:
    """The loop tile: cfg.block_n, on a paged cache the largest power of two <= it dividing the page."""
    bn = cfg.block_n
    while page and page % bn:
        bn //= 2
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"dense decode needs a power-of-two loop tile >= 16 dividing the page size ({page}), "
                         f"got block_n {cfg.block_n}")
    return bn


def dense_group_decode(q, k, v, scale: float, *, lengths=None, block_table=None, bound: int, page: int,
                       cfg: DenseLaunch, splits: int | None = None, softcap: float = 0.0):
    """Dense decode with the group kernel (decode_group.group_decode_triton's ``dense=True``: layout
    checked and the launch ``cfg`` looked up there, ``launch_for``): q [B, H, 1, D]; k/v [B, Hkv, L, D]
    or page pools [P, Hkv, page, D] with block_table [B, max_pages] and lengths [B]; bound the
    longest row's cache bound. Returns (out [B, H, 1, D], zeros [B, H] i64, zeros [B, Hkv] i64).

    The split count is a function of the shape and the device alone, so every call of a shape sums
    the same partials in the same order (bit-identical results, the first call of a process too): a
    ``waves`` launch whose occupancy is not known yet runs once with ``pps`` splits to compile and
    read it, and that result is replaced by the launch with the wave-fitted splits."""
    b, h, _, d = q.shape
    hkv = k.shape[1]
    bn = loop_tile(cfg, page)
    dev = q.device
    n_tiles = triton.cdiv(bound, bn)
    occ_key = (str(dev), cfg, d, next_pow2(h // hkv, 16 if cfg.dot else 1), q.dtype)
    args = (q, k, v, scale, lengths, block_table, bound, page, cfg, bn, softcap)
    if splits is None and cfg.waves and dev.type == "cuda" and occ_key not in _OCCUPANCY:
        compiled = _launch(*args, dense_splits(b * hkv, n_tiles, cfg, dev))[3]
        _OCCUPANCY[occ_key] = occupancy(compiled, cfg.warps, dev)
    n_split = splits or dense_splits(b * hkv, n_tiles, cfg, dev, _OCCUPANCY.get(occ_key))
    return _launch(*args, n_split)[:3]


def _launch(q, k, v, scale: float, lengths, block_table, bound: int, page: int, cfg: DenseLaunch, bn: int,
            softcap: float, n_split: int) -> tuple:
    """One dense group decode with about ``n_split`` splits (fewer when the tiles divide so):
    (out [B, H, 1, D], zeros [B, H] i64, zeros [B, Hkv] i64, the attend kernel's compiled launch)."""
    b, h, _, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    dev, f32 = q.device, torch.float32
    tps = triton.cdiv(triton.cdiv(bound, bn), n_split)
    n_split = triton.cdiv(triton.cdiv(bound, bn), tps)
    direct, fuse = n_split == 1, cfg.fuse and n_split > 1
    prec, upcast = dot_flags(q.dtype)
    cap_on, cap = softcap_args(softcap)
    lens = lengths.to(device=dev, dtype=torch.int32) if lengths is not None else q
    bt = block_table.to(device=dev, dtype=torch.int32) if block_table is not None else q
    out = torch.empty_like(q)
    if direct or fuse:
        cnt = torch.empty((b, h), dtype=torch.int64, device=dev)
        vcnt = torch.empty((b, hkv), dtype=torch.int64, device=dev)
    else:
        cnt = torch.empty((b, h, n_split), dtype=torch.int32, device=dev)
        vcnt = torch.empty((b, hkv, n_split), dtype=torch.int32, device=dev)
    part = (q, q, q) if direct else (torch.empty((b, h, n_split, d), dtype=f32, device=dev),
                                     torch.empty((b, h, n_split), dtype=f32, device=dev),
                                     torch.empty((b, h, n_split), dtype=f32, device=dev))
    ctr = _counters(b * hkv, dev) if fuse else q
    kx, vx, tma = _kv_args(k, v, cfg, bn)
    q2 = q[:, :, 0]
    compiled = _group_dense_kernel[(n_split, b * hkv)](
        q2, kx, vx, bt, lens, *part, cnt, vcnt, ctr, out, q2.stride(0), q2.stride(1), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), bt.stride(0) if block_table is not None else 0,
        out.stride(0), out.stride(1), bound, tps, n_split, h, group, scale * LOG2E, cap,
        HEAD_DIM=d, BLOCK_N=bn, GP=next_pow2(group, 16 if cfg.dot else 1), PAGE=max(page, 1),
        PAGED=block_table is not None, RAGGED=lengths is not None, USE_DOT=cfg.dot, EVICT=cfg.evict,
        DIRECT=direct, FUSE=fuse, TMA=tma, SOFTCAP=cap_on, PREC=prec, UPCAST=upcast, num_warps=cfg.warps,
        num_stages=cfg.stages)
    LAST_COMPILED["group_dense"] = compiled
    if direct or fuse:
        return out, cnt, vcnt, compiled
    skipped = torch.empty((b, h), dtype=torch.int64, device=dev)
    v_skipped = torch.empty((b, hkv), dtype=torch.int64, device=dev)
    _group_merge_kernel[(b * h,)](*part, cnt, vcnt, out, skipped, v_skipped, out.stride(0), out.stride(1), h,
                                  group, n_split, HEAD_DIM=d, SP=next_pow2(n_split, 2), num_warps=4)
    return out, skipped, v_skipped, compiled


def _kv_args(k, v, cfg: DenseLaunch, bn: int) -> tuple:
    """(K, V, TMA) arguments of the dense kernel: TMA descriptors over k and v (block [1, 1, bn, D]) when
    ``cfg.tma`` (with ``cfg.dot``) and both tensors' base addresses and strides are 16-byte aligned,
    else the tensors themselves."""
    if not (cfg.tma and cfg.dot and _tma_aligned(k) and _tma_aligned(v)):
        return k, v, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    block = [1, 1, bn, k.shape[-1]]
    return (TensorDescriptor(k, list(k.shape), list(k.stride()), block),
            TensorDescriptor(v, list(v.shape), list(v.stride()), block), True)


def _tma_aligned(t: torch.Tensor) -> bool:
    """A 4-D tensor a TMA descriptor can address: 16-byte aligned base and outer strides, unit inner stride."""
    e = t.element_size()
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(st * e % 16 == 0 for st in t.stride()[:-1])
