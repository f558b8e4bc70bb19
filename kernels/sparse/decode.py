"""Block-sparse decode attention in Triton, split along the keys: one new query row per sequence
against a long KV cache, skipping the V load and P.V product of skipped key tiles.

Semantics are ``reference.sparse_decode`` (the oracle): the row r = L - 1 is its own block,
its candidates are the key blocks j < A = r // BN, the last reachable block is always computed, and
a candidate is skipped when

    BSFA     the tile's max score < thresholds[h, min(r // BM, Pt - 1)]
    BLASST   the tile's max score - the running max after it (in scan order) < ln(lambda)
    window   j < A - W   (``sink``: and j >= 1, key block 0 kept; decided by a torch mask)
    topk     the tile's max score < the k-th largest candidate tile max of the head (ties kept;
             A <= k skips nothing): reference.topk_skip_mask on the tile maxima, a torch mask

The BLASST running max runs over all key blocks in scan order, across splits, so the kernel works
in phases (plus a merge):

scores  ``_decode_scores_kernel`` (grid splits x B*Hkv): each program reads its range of K tiles
        once for all query heads of its KV group, stores the scaled scores (f32, log2 units) and
        each head's tile max.
Then one of two schedules (``schedule=``), the same decisions and counts:
gather  (default) ``_decode_decide_kernel`` (grid B*Hkv) decides every tile of the group from the
        tile maxima (BSFA: against the threshold; BLASST forward: the running max; window: the
        index; BLASST reverse / sink_local and topk: a mask made in torch, ``decode_skip_mask``), counts
        each head's skipped tiles and writes the list of tiles some head keeps (a prefix sum);
        ``_decode_gather_kernel`` (grid splits x B*Hkv) then walks its even share of that list:
        no decision in the loop, so the pipeliner runs the index, score and V loads ahead.
inline  ``_decode_attend_kernel`` (grid splits x B*Hkv) decides tile by tile inside the attend
        loop (BLASST forward starting from the max over the earlier splits' tiles) with masked,
        not branched, loads. Measured on an H100 (data/bench/NOTES.md): its loop waits on the
        decide-then-load chain each tile (~3 us), so skipped V loads saved no time at D=64; the
        gather schedule's attend pass scales with the kept tiles.
Either way a V tile is loaded only when some head of the group keeps it (with GQA a V tile is
shared; FSA's point: small groups skip more V loads), heads that keep a tile read their scores back,
and each program leaves a partial (acc, max, sum).
merge   ``_decode_merge_kernel`` (grid B*H) combines the splits.

Soft-capping (``softcap``, Gemma 2): the scores phase caps every scaled score (jit.soft_cap)
before it stores the scores and tile maxima, so every later phase (decisions, the torch mask of
``decode_skip_mask``, the attend passes) reads capped values and needs nothing of the cap.

Memory traffic: K once, the scores (4 * group bytes per key and head, vs 2 * D for K) written and
read once, V only for kept tiles. ``method="dense"`` (no decision, no mask) is the same kernels with
skipping off, the fair baseline.

Shape legend
    B batch   H query heads   Hkv KV heads   G = H / Hkv   L cached tokens (row r = L - 1)
    D head dim   Kb = ceil(L / BN) key blocks   S splits   Pt threshold positions
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsecal.formats.geometry import ORDERS
from sparsecal.kernels.jit import (
    LAST_COMPILED,
    LOG2E,
    dot,
    dot_flags,
    log2_lambda,
    max_fn,
    next_pow2,
    soft_cap,
    softcap_args,
)
from sparsecal.kernels.sparse.reference import check_method, topk_skip_mask, window_skip

DECODE_LAUNCH = (4, 2)  # (num_warps, num_stages) of the two phases on a CUDA GPU


@triton.jit
def _group_program(num_heads, group, GP: tl.constexpr):
    """This program's split, (batch, KV head) index bk, batch b, KV head hk, and its query heads:
    offs_g [GP], g_ok [GP] (real heads of the group), heads [GP] (query head indices)."""
    split = tl.program_id(0)
    bk = tl.program_id(1)
    hkv = num_heads // group
    offs_g = tl.arange(0, GP)
    hk = (bk % hkv).to(tl.int64)
    return split, bk, (bk // hkv).to(tl.int64), hk, offs_g, offs_g < group, hk * group + offs_g


@triton.jit
def _decode_scores_kernel(Q, K, S, TMAX, sq_b, sq_h, sk_b, sk_h, sk_n, length, n_kb, tiles_per_split,
                          num_heads, group, qk_scale, softcap,
                          HEAD_DIM: tl.constexpr, BN: tl.constexpr, BLOCK_N: tl.constexpr, GP: tl.constexpr,
                          SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (S, B * Hkv). Q [B, H, D] (strides sq_b, sq_h); K [B, Hkv, L, D]; S [B, H, Kb * BN] f32
    scaled scores (log2 units, -inf past L; capped at ``softcap``, log2 units, when SOFTCAP); TMAX
    [B, H, Kb] f32 each head's tile max."""
    split, bk, b, hk, offs_g, g_ok, heads = _group_program(num_heads, group, GP)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    k_ptr = K + b * sk_b + hk * sk_h
    s_row = S + (b * num_heads + heads) * (n_kb * BN)    # [GP] row starts
    t_row = TMAX + (b * num_heads + heads) * n_kb
    j0 = split * tiles_per_split
    j1 = tl.minimum(j0 + tiles_per_split, n_kb)
    for j in range(j0, j1):
        keys = j * BN + offs_n
        kmask = (offs_n < BN) & (keys < length)
        kt = tl.load(k_ptr + keys[None, :] * sk_n + offs_d[:, None], mask=kmask[None, :], other=0.0)
        s = dot(q, kt, None, PREC, UPCAST) * qk_scale
        if SOFTCAP:
            s = soft_cap(s, softcap)
        s = tl.where(kmask[None, :], s, float("-inf"))
        tl.store(s_row[:, None] + keys[None, :], s, mask=g_ok[:, None] & (offs_n < BN)[None, :])
        tl.store(t_row + j, tl.max(s, 1), mask=g_ok)


@triton.jit
def _attend_start(V, sv_b, sv_h, num_heads, group, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  GP: tl.constexpr):
    """An attend program's indices and empty partials: (split, bk, offs_g, g_ok [GP], bh [GP] (batch *
    H + query head), offs_d, offs_n, its KV head's V pointer, acc [GP, D], m_i, l_i [GP])."""
    split, bk, b, hk, offs_g, g_ok, heads = _group_program(num_heads, group, GP)
    return (split, bk, offs_g, g_ok, b * num_heads + heads, tl.arange(0, HEAD_DIM), tl.arange(0, BLOCK_N),
            V + b * sv_b + hk * sv_h, tl.zeros([GP, HEAD_DIM], tl.float32), tl.full([GP], float("-inf"), tl.float32),
            tl.zeros([GP], tl.float32))


@triton.jit
def _attend_store(ACC, M, LS, bh, split, n_split, g_ok, offs_d, acc, m_i, l_i, HEAD_DIM: tl.constexpr):
    """Store a program's partial (acc [GP, D], m_i, l_i [GP]) at [b, h, split]; returns the slots."""
    part = bh * n_split + split
    tl.store(ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])
    tl.store(M + part, m_i, mask=g_ok)
    tl.store(LS + part, l_i, mask=g_ok)
    return part


@triton.jit
def _decode_step(acc, m_i, l_i, s, v, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Online-softmax step of one key tile: s [GP, BLOCK_N] f32 scores (log2 units, -inf where not
    computed), v [BLOCK_N, D]; returns (acc [GP, D], m_i, l_i [GP]) updated."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = dot(p.to(v.dtype), v, acc * alpha[:, None], PREC, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _decode_decide_kernel(TMAX, THR, SKIP, IDX, NKEEP, HSKIP, CNT, length, n_kb, num_heads, group, n_thr, thr_pos,
                          log_lambda2, window, BN: tl.constexpr, GP: tl.constexpr, CH: tl.constexpr,
                          DECIDE: tl.constexpr):
    """Grid (B * Hkv): the gather schedule's decision and kept-tile list of one KV group, CH tiles at
    a time. DECIDE as in the attend kernel (0 keep all, 1 SKIP [B, H, Kb] i8 from torch, 2 BSFA
    against THR [H, n_thr] at thr_pos, 3 BLASST forward: running max over the tiles in order, 4
    window). Writes HSKIP [B, H, Kb] i8 (1 = the head skips the tile), IDX [B, Hkv, Kb] i32 (the
    tiles some head keeps, ascending, first NKEEP [B, Hkv] of them) and CNT [B, H] i32 (candidate
    tiles each head skips). TMAX [B, H, Kb] f32 tile maxima, log2 units."""
    bk = tl.program_id(0)
    hkv = num_heads // group
    b = bk // hkv
    offs_g = tl.arange(0, GP)
    g_ok = offs_g < group
    heads = (bk % hkv) * group + offs_g                              # [GP]
    bh = (b * num_heads + heads).to(tl.int64)
    offs_c = tl.arange(0, CH)
    n_cand = (length - 1) // BN                                       # candidate tiles; the last is not one
    thr = tl.zeros([GP], tl.float32)
    if DECIDE == 2:
        thr = tl.load(THR + heads * n_thr + thr_pos, mask=g_ok, other=0.0) * 1.4426950408889634
    run = tl.full([GP], float("-inf"), tl.float32)
    n_keep = tl.zeros([], tl.int32)
    n_skip = tl.zeros([GP], tl.int32)
    for c in range(0, n_kb, CH):
        tiles = c + offs_c                                            # [CH]
        ok = (tiles < n_kb)[:, None] & g_ok[None, :]                  # [CH, GP]
        at = bh[None, :] * n_kb + tiles[:, None]
        if DECIDE == 0:
            keep = ok
        elif DECIDE == 1:
            keep = ok & (tl.load(SKIP + at, mask=ok, other=1) == 0)
        elif DECIDE == 4:
            keep = ok & (tiles >= n_cand - window)[:, None]
        else:
            tm = tl.load(TMAX + at, mask=ok, other=float("-inf"))
            if DECIDE == 2:
                keep = ok & (tm >= thr[None, :])
            else:
                run_c = tl.maximum(tl.associative_scan(tm, 0, max_fn), run[None, :])
                keep = ok & (tl.where(tm >= run_c, 0.0, tm - run_c) >= log_lambda2)
                run = tl.max(run_c, 0)
        keep = keep | (ok & (tiles >= n_cand)[:, None])               # the last tile is always computed
        n_skip += tl.sum((ok & ~keep).to(tl.int32), 0)
        tl.store(HSKIP + at, (~keep).to(tl.int8), mask=ok)
        gkeep = tl.max(keep.to(tl.int32), 1)                          # [CH] some head keeps the tile
        pos = n_keep + tl.cumsum(gkeep, 0) - 1
        tl.store(IDX + bk.to(tl.int64) * n_kb + pos, tiles, mask=gkeep > 0)
        n_keep += tl.sum(gkeep, 0)
    tl.store(NKEEP + bk, n_keep)
    tl.store(CNT + bh, n_skip, mask=g_ok)


@triton.jit
def _decode_gather_kernel(S, V, IDX, NKEEP, HSKIP, ACC, M, LS, sv_b, sv_h, sv_n, length, n_kb, n_split,
                          num_heads, group, HEAD_DIM: tl.constexpr, BN: tl.constexpr, BLOCK_N: tl.constexpr,
                          GP: tl.constexpr, HEAD_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (S, B * Hkv): the attend pass over the kept tiles only. IDX [B, Hkv, Kb] i32 the tiles
    some head of the group keeps, ascending, first NKEEP [B, Hkv] i32 of them; this program takes
    its share ceil(NKEEP / S) of that list. HEAD_MASK: HSKIP [B, H, Kb] i8 (1 = this head skips a
    tile its group keeps: its scores stay -inf). The loop has no decision: the tile index is a load
    that depends only on the loop counter, so the pipeliner runs it (and the S and V loads it
    addresses) ahead. Partials ACC [B, H, S, D] f32, M, LS [B, H, S] f32 (log2 units)."""
    split, bk, offs_g, g_ok, bh, offs_d, offs_n, v_ptr, acc, m_i, l_i = _attend_start(
        V, sv_b, sv_h, num_heads, group, HEAD_DIM, BLOCK_N, GP)
    n_keep = tl.load(NKEEP + bk)
    share = tl.cdiv(n_keep, n_split)
    t0 = split * share
    t1 = tl.minimum(t0 + share, n_keep)
    for t in range(t0, t1):
        j = tl.load(IDX + bk.to(tl.int64) * n_kb + t)
        keys = j * BN + offs_n
        kmask = (offs_n < BN) & (keys < length)
        rows = g_ok
        if HEAD_MASK:
            rows = g_ok & (tl.load(HSKIP + bh * n_kb + j, mask=g_ok, other=1) == 0)
        s = tl.load(S + bh[:, None] * (n_kb * BN) + keys[None, :], mask=rows[:, None] & (offs_n < BN)[None, :],
                    other=float("-inf"))
        v = tl.load(v_ptr + keys[:, None] * sv_n + offs_d[None, :], mask=kmask[:, None], other=0.0)
        acc, m_i, l_i = _decode_step(acc, m_i, l_i, s, v, PREC, UPCAST)
    _attend_store(ACC, M, LS, bh, split, n_split, g_ok, offs_d, acc, m_i, l_i, HEAD_DIM)


@triton.jit
def _decode_attend_kernel(S, V, TMAX, THR, SKIP, SKIPV, ACC, M, LS, CNT, sv_b, sv_h, sv_n, length, n_kb,
                          tiles_per_split, n_split, num_heads, group, n_thr, thr_pos, log_lambda2, window,
                          HEAD_DIM: tl.constexpr, BN: tl.constexpr, BLOCK_N: tl.constexpr, GP: tl.constexpr,
                          DECIDE: tl.constexpr, CHUNK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (S, B * Hkv). DECIDE: 0 keep everything; 1 read SKIP [B, H, Kb] i8 (1 = skip) and
    SKIPV [B, Hkv, Kb] i8 (1 = the whole group skips: no V load), made by ``decode_skip_mask``;
    2 BSFA (THR [H, n_thr] f32 natural units, read at thr_pos); 3 BLASST in forward order (the
    running max before this split is the max of TMAX [B, H, Kb] over the earlier tiles, log2
    units; log_lambda2 = ln(lambda) * log2(e)); 4 window (keep the last ``window`` candidates).
    No branch: skipped scores and V rows are masked loads (no memory traffic), so the loop stays
    software-pipelined. Partials ACC [B, H, S, D] f32, M, LS [B, H, S] f32 (log2 units); CNT
    [B, H, S] i32 candidate tiles skipped."""
    split, bk, offs_g, g_ok, bh, offs_d, offs_n, v_ptr, acc, m_i, l_i = _attend_start(
        V, sv_b, sv_h, num_heads, group, HEAD_DIM, BLOCK_N, GP)
    n_skip = tl.zeros([GP], tl.int32)
    j0 = split * tiles_per_split
    j1 = tl.minimum(j0 + tiles_per_split, n_kb)
    n_cand = (length - 1) // BN
    thr = tl.zeros([GP], tl.float32)
    run = tl.full([GP], float("-inf"), tl.float32)
    if DECIDE == 2:
        thr = tl.load(THR + (bh % num_heads) * n_thr + thr_pos, mask=g_ok, other=0.0) * 1.4426950408889634
    if DECIDE == 3:  # the forward running max before this split's first tile
        offs_c = tl.arange(0, CHUNK)
        for c in range(0, j0, CHUNK):
            t = tl.load(TMAX + bh[:, None] * n_kb + c + offs_c[None, :],
                        mask=g_ok[:, None] & ((c + offs_c) < j0)[None, :], other=float("-inf"))
            run = tl.maximum(run, tl.max(t, 1))
    for j in range(j0, j1):
        keys = j * BN + offs_n
        kmask = (offs_n < BN) & (keys < length)
        if DECIDE == 0:
            keep = g_ok
        elif DECIDE == 1:
            keep = (tl.load(SKIP + bh * n_kb + j, mask=g_ok, other=1) == 0) & g_ok
        elif DECIDE == 4:
            keep = g_ok & ((offs_g * 0 + j) >= n_cand - window)
        else:
            tm = tl.load(TMAX + bh * n_kb + j, mask=g_ok, other=float("-inf"))
            if DECIDE == 2:
                keep = g_ok & (tm >= thr)
            else:
                run = tl.maximum(run, tm)
                keep = g_ok & (tl.where(tm >= run, 0.0, tm - run) >= log_lambda2)
        keep = keep | (g_ok & ((offs_g * 0 + j) >= n_cand))  # the last (diagonal) tile is always computed
        n_skip += (g_ok & ~keep).to(tl.int32)
        if DECIDE == 1:
            skip_v = tl.load(SKIPV + bk.to(tl.int64) * n_kb + j).to(tl.int32)
        else:
            skip_v = 1 - tl.max(keep.to(tl.int32), 0)
        vmask = kmask & ((offs_n * 0 + skip_v) == 0)
        s = tl.load(S + bh[:, None] * (n_kb * BN) + keys[None, :], mask=keep[:, None] & (offs_n < BN)[None, :],
                    other=float("-inf"))
        v = tl.load(v_ptr + keys[:, None] * sv_n + offs_d[None, :], mask=vmask[:, None], other=0.0)
        acc, m_i, l_i = _decode_step(acc, m_i, l_i, s, v, PREC, UPCAST)
    part = _attend_store(ACC, M, LS, bh, split, n_split, g_ok, offs_d, acc, m_i, l_i, HEAD_DIM)
    tl.store(CNT + part, n_skip, mask=g_ok)


@triton.jit
def _merge_splits(ACC, M, LS, O, bh, so_b, so_h, num_heads, n_split, HEAD_DIM: tl.constexpr, SP: tl.constexpr):
    """O[b, h] = sum_s 2^(M_s - m) ACC_s / sum_s 2^(M_s - m) LS_s for row ``bh`` = b * H + h of the
    split-K partials; returns (b, h, offs_s, s_ok) for the callers' counters."""
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < n_split
    m = tl.load(M + bh * n_split + offs_s, mask=s_ok, other=float("-inf"))
    ls = tl.load(LS + bh * n_split + offs_s, mask=s_ok, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_all))
    acc = tl.load(ACC + (bh * n_split + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(ls * w, 0)
    b = bh // num_heads
    h = bh % num_heads
    tl.store(O + b * so_b + h * so_h + offs_d, out.to(O.dtype.element_ty))
    return b, h, offs_s, s_ok


@triton.jit
def _decode_merge_kernel(ACC, M, LS, O, so_b, so_h, num_heads, n_split,
                         HEAD_DIM: tl.constexpr, SP: tl.constexpr):
    """Grid (B * H): the splits of one row merged (_merge_splits)."""
    _merge_splits(ACC, M, LS, O, tl.program_id(0).to(tl.int64), so_b, so_h, num_heads, n_split, HEAD_DIM, SP)


_SMS: dict = {}  # device -> its SM count (asked once: a decode step asks per layer)


def sm_count(device) -> int:
    """The device's SM count, cached per device; 8 stand in for the CPU interpreter."""
    if device.type != "cuda":
        return 8
    key = str(device)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[key]


def num_splits(batch_kv: int, n_kb: int, device) -> int:
    """Splits along the keys so that about four programs per SM run (each at least 4 tiles)."""
    return max(1, min(triton.cdiv(4 * sm_count(device), batch_kv), triton.cdiv(n_kb, 4)))


def decode_skip_mask(tmax: torch.Tensor, length: int, block_m: int, block_n: int, *, thresholds=None,
                     log_lambda=None, window=None, order: str = "forward", topk: int | None = None,
                     sink: bool = False) -> torch.Tensor:
    """Which key tiles each head skips. tmax [B, H, Kb] f32 tile maxima (log2 units) -> [B, H, Kb] bool."""
    _, h, kb = tmax.shape
    r = length - 1
    a = r // block_n
    if topk is not None:  # log2 units rank like natural ones: the reference's decision exactly
        return topk_skip_mask(tmax, a, int(topk))
    cand = torch.arange(kb, device=tmax.device) < a
    if window is not None:
        return window_skip(kb, a, window, sink, tmax.device).expand_as(tmax).clone()
    if thresholds is not None:
        thr = thresholds[:, min(r // block_m, thresholds.shape[1] - 1)].to(tmax) * LOG2E
        return cand & (tmax < thr.view(1, h, 1))
    seq = in_scan_order(tmax, order, a)
    return cand & (from_scan_order(seq - torch.cummax(seq, dim=-1).values, order, a) < log2_lambda(log_lambda))


def in_scan_order(x: torch.Tensor, order: str, a: int) -> torch.Tensor:
    """x [..., Kb] (one value per key block of a row with ``a`` candidates) in ``order``'s scan
    order (formats.geometry.scan_order), made from slices on x's device: no index uploaded."""
    kb = x.shape[-1]
    if order == "forward":
        return x
    if order == "reverse":
        return x.flip(-1)
    if order != "sink_local":
        raise ValueError(f"Unknown scan order '{order}'. Available: {', '.join(ORDERS)}.")
    d0 = min(max(a, 1), kb)  # the first diagonal block after block 0
    return torch.cat([x[..., :1], x[..., d0:], x[..., 1:d0]], dim=-1)


def from_scan_order(y: torch.Tensor, order: str, a: int) -> torch.Tensor:
    """The inverse of ``in_scan_order``: y [..., Kb] in scan order -> block order."""
    kb = y.shape[-1]
    if order == "forward":
        return y
    if order == "reverse":
        return y.flip(-1)
    n_diag = kb - min(max(a, 1), kb)  # diagonal blocks besides block 0
    return torch.cat([y[..., :1], y[..., 1 + n_diag:], y[..., 1:1 + n_diag]], dim=-1)


SCHEDULES = ("gather", "inline")
TOPK = 4  # method code of decode top-k (prefill.method_code: 0 dense, 1 BSFA, 2 BLASST, 3 window)
DECIDE_CHUNK = 64  # key tiles per step of the decide kernel


def sparse_decode_triton(q, k, v, scale: float, block_m: int, block_n: int, *, thresholds=None,
                         log_lambda: float | None = None, window: int | None = None, order: str = "forward",
                         dense: bool = False, schedule: str = "gather", splits: int | None = None,
                         launch: tuple | None = None, softcap: float = 0.0, topk: int | None = None,
                         sink: bool = False):
    """One decode step; the Triton twin of ``reference.sparse_decode``.

    q [B, H, 1, D], k/v [B, Hkv, L, D] (the row sits at L - 1; fp16/bf16, fp32 accepted); exactly
    one of thresholds [H, Pt], log_lambda, window, topk (the k largest tile maxima per head, ties
    kept; decided in torch from the tile maxima, DECIDE=1), or dense=True. schedule: "gather" (the decision
    made in torch from the tile maxima, the attend pass walks the list of kept tiles; skipped counted
    from that decision) or "inline" (decided tile by tile in the attend pass, counted there).
    softcap: the cap c of c * tanh(s / c) on every scaled score (0 or None: off).
    Returns (out [B, H, 1, D] in q.dtype, skipped [B, H] int64 candidate tiles skipped).
    """
    from sparsecal.kernels.sparse.prefill import method_code

    if topk is not None:
        check_method(thresholds, log_lambda, window, topk)
        if dense:
            raise ValueError("method 'dense' takes no topk")
    method = TOPK if topk is not None else method_code(thresholds, log_lambda, window, dense, sink)
    b, h, one, d = q.shape
    if one != 1 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != b or h % k.shape[1] or k.shape[3] != d:
        raise ValueError(f"decode takes q [B,H,1,D] and k, v [B,Hkv,L,D], got {tuple(q.shape)}, {tuple(k.shape)}")
    if order not in ORDERS:
        raise ValueError(f"Unknown scan order '{order}'. Available: {', '.join(ORDERS)}.")
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown decode schedule '{schedule}'. Available: {', '.join(SCHEDULES)}.")
    cap_on, cap = softcap_args(softcap)
    hkv, length = k.shape[1], k.shape[2]
    kb = triton.cdiv(length, block_n)
    n_split = splits or num_splits(b * hkv, kb, q.device)
    tps = triton.cdiv(kb, n_split)
    n_split = triton.cdiv(kb, tps)
    f32 = torch.float32
    s = torch.empty((b, h, kb * block_n), dtype=f32, device=q.device)
    tmax = torch.empty((b, h, kb), dtype=f32, device=q.device)
    warps, stages = launch or DECODE_LAUNCH
    prec, upcast = dot_flags(q.dtype)
    common = dict(HEAD_DIM=d, BN=block_n, BLOCK_N=next_pow2(block_n), GP=next_pow2(h // hkv),
                  PREC=prec, UPCAST=upcast, num_warps=warps, num_stages=stages)
    q2 = q[:, :, 0]
    LAST_COMPILED["decode_scores"] = _decode_scores_kernel[(n_split, b * hkv)](
        q2, k, s, tmax, q2.stride(0), q2.stride(1), k.stride(0), k.stride(1), k.stride(2), length, kb, tps,
        h, h // hkv, scale * LOG2E, cap, SOFTCAP=cap_on, **common)
    part = (torch.empty((b, h, n_split, d), dtype=f32, device=q.device),
            torch.empty((b, h, n_split), dtype=f32, device=q.device), torch.empty((b, h, n_split), dtype=f32, device=q.device))
    dec = _decision(tmax, method, dict(thresholds=thresholds, log_lambda=log_lambda, window=window, order=order,
                                       topk=topk, sink=sink), length, block_m, block_n)
    run = _attend_gather if schedule == "gather" else _attend_inline
    skipped = run(s, v, tmax, part, dec, length, block_n, tps, common)
    out = torch.empty_like(q)
    _decode_merge_kernel[(b * h,)](*part, out, out.stride(0), out.stride(1), h, n_split,
                                   HEAD_DIM=d, SP=next_pow2(n_split, 2), num_warps=4)
    return out, skipped


def _decision(tmax, method: int, kw: dict, length: int, block_m: int, block_n: int) -> dict:
    """What the decide / attend kernels read about the method: DECIDE (0 none, 1 torch mask, 2
    BSFA, 3 BLASST forward, 4 window), THR [H, Pt] f32, the torch mask [B, H, Kb] (BLASST reverse /
    sink_local and topk, else None) and the scalar arguments (placeholders where the kernel reads nothing)."""
    thresholds, log_lambda, window, order = kw["thresholds"], kw["log_lambda"], kw["window"], kw["order"]
    decide = {0: 0, 1: 2, 3: 1 if kw.get("sink") else 4, TOPK: 1}.get(method, 3 if order == "forward" else 1)
    mask = None
    if decide == 1:  # BLASST reverse / sink_local, topk, the window with a sink: a mask made in torch
        mask = decode_skip_mask(tmax, length, block_m, block_n, log_lambda=log_lambda, order=order, topk=kw["topk"],
                                window=window if method == 3 else None, sink=bool(kw.get("sink")))
    thr = thresholds.to(device=tmax.device, dtype=torch.float32).contiguous() if decide == 2 else tmax
    return {"decide": decide, "thr": thr, "mask": mask, "n_thr": thr.shape[-1],
            "thr_pos": min((length - 1) // block_m, thr.shape[-1] - 1),
            "ll2": 0.0 if log_lambda is None else log2_lambda(log_lambda), "window": int(window or 0)}


def _attend_gather(s, v, tmax, part, dec: dict, length: int, block_n: int, tps: int, common: dict) -> torch.Tensor:
    """The decide kernel (kept-tile lists) and the gather attend pass; returns skipped [B, H] int64
    counted by the decide kernel."""
    b, h, kb = tmax.shape
    hkv = v.shape[1]
    n_split = part[1].shape[-1]
    skip = tmax if dec["mask"] is None else dec["mask"].to(torch.int8)
    idx = torch.empty((b, hkv, kb), dtype=torch.int32, device=v.device)
    n_keep = torch.empty((b, hkv), dtype=torch.int32, device=v.device)
    hskip = torch.empty((b, h, kb), dtype=torch.int8, device=v.device)
    cnt = torch.empty((b, h), dtype=torch.int32, device=v.device)
    LAST_COMPILED["decode_decide"] = _decode_decide_kernel[(b * hkv,)](
        tmax, dec["thr"], skip, idx, n_keep, hskip, cnt, length, kb, h, h // hkv, dec["n_thr"], dec["thr_pos"],
        dec["ll2"], dec["window"], BN=block_n, GP=common["GP"], CH=DECIDE_CHUNK, DECIDE=dec["decide"], num_warps=4)
    LAST_COMPILED["decode_gather"] = _decode_gather_kernel[(n_split, b * hkv)](
        s, v, idx, n_keep, hskip, *part, v.stride(0), v.stride(1), v.stride(2), length, kb, n_split, h, h // hkv,
        HEAD_MASK=dec["decide"] != 0 and h > hkv, **common)
    return cnt.to(torch.int64)


def _attend_inline(s, v, tmax, part, dec: dict, length: int, block_n: int, tps: int, common: dict) -> torch.Tensor:
    """The attend pass deciding tile by tile; returns skipped [B, H] int64 counted by the kernel."""
    b, h, kb = tmax.shape
    hkv, n_split = v.shape[1], part[1].shape[-1]
    skip = skip_v = tmax  # placeholders the kernel does not read
    if dec["mask"] is not None:
        skip = dec["mask"].to(torch.int8)
        skip_v = dec["mask"].view(b, hkv, h // hkv, kb).all(dim=2).to(torch.int8)
    cnt = torch.empty((b, h, n_split), dtype=torch.int32, device=v.device)
    LAST_COMPILED["decode_attend"] = _decode_attend_kernel[(n_split, b * hkv)](
        s, v, tmax, dec["thr"], skip, skip_v, *part, cnt, v.stride(0), v.stride(1), v.stride(2), length, kb, tps,
        n_split, h, h // hkv, dec["n_thr"], dec["thr_pos"], dec["ll2"], dec["window"], DECIDE=dec["decide"],
        CHUNK=64, **common)
    return cnt.sum(dim=-1, dtype=torch.int64)
