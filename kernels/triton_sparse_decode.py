"""Block-sparse decode attention in Triton, split along the keys: one new query row per sequence
against a long KV cache, skipping the V load and P.V product of skipped key tiles.

Semantics are ``sparse_reference.sparse_decode`` (the oracle): the row r = L - 1 is its own block,
its candidates are the key blocks j < A = r // BN, the last reachable block is always computed, and
a candidate is skipped when

    BSFA     the tile's max score < thresholds[h, min(r // BM, Pt - 1)]
    BLASST   the tile's max score - the running max after it (in scan order) < ln(lambda)
    window   j < A - W

The BLASST running max runs over all key blocks in scan order, across splits, so the kernel works
in two phases (plus a merge):

phase 1 ``_decode_scores_kernel`` (grid splits x B*Hkv): each program reads its range of K tiles
        once for all query heads of its KV group, stores the scaled scores (f32, log2 units) and
        each head's tile max.
phase 2 ``_decode_attend_kernel`` (same grid): decides from the tile maxima (BSFA: against the
        threshold; BLASST forward: the running max, starting from the max over the earlier splits'
        tiles; window: the index), or reads a mask made in torch (BLASST reverse / sink_local,
        ``decode_skip_mask``). For its tiles, heads that keep the tile read their
        scores back; the V tile is loaded only when some head of the group keeps it (with GQA a V
        tile is shared; FSA's point: small groups skip more V loads). Skipped loads are masked,
        not branched around. Each program counts the tiles each head skipped and leaves a partial
        (acc, max, sum).
merge   ``_decode_merge_kernel`` (grid B*H) combines the splits.

The attend loop takes a chunk of ``tiles_per_step`` (TILES) key tiles per iteration: it decides
for all TILES tiles at once ([GP, TILES]; BLASST's running max advances tile by tile inside the
chunk through a cumulative max), then issues the masked S and V loads of TILES * BN keys and does
one online-softmax step. Why: each step's loads depend on its decision (load the tile maxima or
the mask, compare, then load S and V under that mask), so the software pipeliner cannot run the
S/V loads ahead and every step pays about two global-memory latencies. With one tile per step
(H100, B=16, L=32768, H=32, D=64, G=1, bf16, 256 tiles per program) the pass streamed S and V at
3.1 TB/s with skipping off (713 us), but took the same 725 us when BLASST forward skipped 50% or
75% of the V tiles (0.8-1.6 TB/s of moved bytes): latency-bound, about 2.8 us a step. A chunk
pays that chain once per TILES tiles.

Memory traffic: K once, the scores (4 * group bytes per key and head, vs 2 * D for K) written and
read once, V only for kept tiles. ``method="dense"`` (no decision, no mask) is the same kernels with
skipping off, the fair baseline.

Shape legend
    B batch   H query heads   Hkv KV heads   G = H / Hkv   L cached tokens (row r = L - 1)
    D head dim   Kb = ceil(L / BN) key blocks   S splits   Pt threshold positions
    GP = max(16, next_pow2(G)) head rows per program   TILES key tiles per attend step
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .geometry import ORDERS, scan_order
from .triton_dense import LAST_COMPILED, LOG2E, _dot, dot_flags, next_pow2
from .triton_tilestats import _max_fn

DECODE_LAUNCH = (4, 2)  # (num_warps, num_stages) of the two phases on a CUDA GPU
TILES_PER_STEP = 4  # key tiles per iteration of the attend loop (one decision latency per chunk)


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
                          num_heads, group, qk_scale,
                          HEAD_DIM: tl.constexpr, BN: tl.constexpr, BLOCK_N: tl.constexpr, GP: tl.constexpr,
                          PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (S, B * Hkv). Q [B, H, D] (strides sq_b, sq_h); K [B, Hkv, L, D]; S [B, H, Kb * BN] f32
    scaled scores (log2 units, -inf past L); TMAX [B, H, Kb] f32 each head's tile max."""
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
        s = _dot(q, kt, None, PREC, UPCAST) * qk_scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        tl.store(s_row[:, None] + keys[None, :], s, mask=g_ok[:, None] & (offs_n < BN)[None, :])
        tl.store(t_row + j, tl.max(s, 1), mask=g_ok)


@triton.jit
def _chunk_keep(TMAX, SKIP, SKIPV, bh, bk, j, j1, n_kb, n_cand, g_ok, thr, run, log_lambda2, window,
                TILES: tl.constexpr, DECIDE: tl.constexpr):
    """The decisions for the chunk of tiles j .. j + TILES - 1 (tiles past the split's end j1 are
    neither kept nor skipped). bh [GP] rows of TMAX, SKIP; thr, run [GP] as in the attend kernel.
    Returns keep [GP, TILES] (a real head computes the tile), vkeep [TILES] (the V tile is loaded),
    skipped [GP] i32 (candidate tiles skipped) and the running max [GP] after the chunk."""
    tiles = j + tl.arange(0, TILES)                      # [TILES]
    t_ok = g_ok[:, None] & (tiles < j1)[None, :]         # [GP, TILES]
    t_at = bh[:, None] * n_kb + tiles[None, :]
    if DECIDE == 0:
        keep = t_ok
    elif DECIDE == 1:
        keep = tl.load(SKIP + t_at, mask=t_ok, other=1) == 0
    elif DECIDE == 4:
        keep = (tiles >= n_cand - window)[None, :]
    else:
        tm = tl.load(TMAX + t_at, mask=t_ok, other=float("-inf"))
        if DECIDE == 2:
            keep = tm >= thr[:, None]
        else:  # the running max after each tile: the chunk's cumulative max joined to the carried one
            cur = tl.maximum(tl.associative_scan(tm, 1, _max_fn), run[:, None])
            keep = tl.where(tm >= cur, 0.0, tm - cur) >= log_lambda2
            run = tl.max(cur, 1)
    keep = t_ok & (keep | (tiles >= n_cand)[None, :])   # the last (diagonal) tile is always computed
    if DECIDE == 1:
        vkeep = tl.load(SKIPV + bk * n_kb + tiles, mask=tiles < j1, other=1) == 0
    else:
        vkeep = tl.max(keep.to(tl.int32), 0) > 0
    return keep, vkeep, tl.sum((t_ok & ~keep).to(tl.int32), 1), run


@triton.jit
def _softmax_step(s, v, acc, m_i, l_i, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step over a chunk: s [GP, N] f32 scores (log2 units, -inf = masked),
    v [N, D], acc [GP, D], m_i, l_i [GP]. Returns the updated (acc, m_i, l_i)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PREC, UPCAST)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _decode_attend_kernel(S, V, TMAX, THR, SKIP, SKIPV, ACC, M, LS, CNT, sv_b, sv_h, sv_n, length, n_kb,
                          tiles_per_split, n_split, num_heads, group, n_thr, thr_pos, log_lambda2, window,
                          HEAD_DIM: tl.constexpr, BN: tl.constexpr, BLOCK_N: tl.constexpr, GP: tl.constexpr,
                          TILES: tl.constexpr, DECIDE: tl.constexpr, PRE_TILES: tl.constexpr,
                          PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (S, B * Hkv); each iteration takes a chunk of TILES key tiles (N = TILES * BLOCK_N key
    slots, slot o is key (j + o // BLOCK_N) * BN + o % BLOCK_N, valid when o % BLOCK_N < BN, its
    tile < j1 and the key < L). DECIDE: 0 keep everything; 1 read SKIP [B, H, Kb] i8 (1 = skip)
    and SKIPV [B, Hkv, Kb] i8 (1 = the whole group skips: no V load), made by
    ``decode_skip_mask``; 2 BSFA (THR [H, n_thr] f32 natural units, read at thr_pos); 3 BLASST in
    forward order (the running max before this split is the max of TMAX [B, H, Kb] over the
    earlier tiles, PRE_TILES at a time, log2 units; log_lambda2 = ln(lambda) * log2(e)); 4 window
    (keep the last ``window`` candidates). No branch: skipped scores S [B, H, Kb * BN] f32 and V
    [B, Hkv, L, D] rows are masked loads (no memory traffic). Partials ACC [B, H, S, D] f32, M, LS
    [B, H, S] f32 (log2 units); CNT [B, H, S] i32 candidate tiles skipped."""
    split, bk, b, hk, _, g_ok, heads = _group_program(num_heads, group, GP)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_k = tl.arange(0, TILES * BLOCK_N)              # [N] the chunk's key slots
    in_tile = offs_k % BLOCK_N
    bh = b * num_heads + heads                           # [GP]
    v_ptr = V + b * sv_b + hk * sv_h
    acc = tl.zeros([GP, HEAD_DIM], tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    n_skip = tl.zeros([GP], tl.int32)
    j0 = split * tiles_per_split
    j1 = tl.minimum(j0 + tiles_per_split, n_kb)
    n_cand = (length - 1) // BN
    thr = tl.zeros([GP], tl.float32)
    run = tl.full([GP], float("-inf"), tl.float32)
    if DECIDE == 2:
        thr = tl.load(THR + heads * n_thr + thr_pos, mask=g_ok, other=0.0) * 1.4426950408889634
    if DECIDE == 3:  # the forward running max before this split's first tile
        offs_c = tl.arange(0, PRE_TILES)
        for c in range(0, j0, PRE_TILES):
            t = tl.load(TMAX + bh[:, None] * n_kb + c + offs_c[None, :],
                        mask=g_ok[:, None] & ((c + offs_c) < j0)[None, :], other=float("-inf"))
            run = tl.maximum(run, tl.max(t, 1))
    for j in range(j0, j1, TILES):
        keys = (j + offs_k // BLOCK_N) * BN + in_tile
        keep, vkeep, skipped, run = _chunk_keep(TMAX, SKIP, SKIPV, bh, bk.to(tl.int64), j, j1, n_kb, n_cand, g_ok,
                                                thr, run, log_lambda2, window, TILES, DECIDE)
        n_skip += skipped
        keep_k = tl.reshape(tl.broadcast_to(keep[:, :, None], (GP, TILES, BLOCK_N)), (GP, TILES * BLOCK_N))
        vrow = tl.reshape(tl.broadcast_to(vkeep[:, None], (TILES, BLOCK_N)), (TILES * BLOCK_N,))
        vrow = vrow & (in_tile < BN) & (keys < length)  # vkeep is false past j1
        s = tl.load(S + bh[:, None] * (n_kb * BN) + keys[None, :], mask=keep_k & (in_tile < BN)[None, :],
                    other=float("-inf"))
        v = tl.load(v_ptr + keys[:, None] * sv_n + offs_d[None, :], mask=vrow[:, None], other=0.0)
        acc, m_i, l_i = _softmax_step(s, v, acc, m_i, l_i, PREC, UPCAST)
    part = bh * n_split + split
    tl.store(ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])
    tl.store(M + part, m_i, mask=g_ok)
    tl.store(LS + part, l_i, mask=g_ok)
    tl.store(CNT + part, n_skip, mask=g_ok)


@triton.jit
def _decode_merge_kernel(ACC, M, LS, O, so_b, so_h, num_heads, n_split,
                         HEAD_DIM: tl.constexpr, SP: tl.constexpr):
    """Grid (B * H): O[b, h] = sum_s 2^(M_s - m) ACC_s / sum_s 2^(M_s - m) LS_s."""
    bh = tl.program_id(0).to(tl.int64)
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


def num_splits(batch_kv: int, n_kb: int, device) -> int:
    """Splits along the keys so that about four programs per SM run (each at least 4 tiles)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(triton.cdiv(4 * sms, batch_kv), triton.cdiv(n_kb, 4)))


def decode_skip_mask(tmax: torch.Tensor, length: int, block_m: int, block_n: int, *, thresholds=None,
                     log_lambda=None, window=None, order: str = "forward") -> torch.Tensor:
    """Which key tiles each head skips. tmax [B, H, Kb] f32 tile maxima (log2 units) -> [B, H, Kb] bool."""
    _, h, kb = tmax.shape
    r = length - 1
    a = r // block_n
    cand = torch.arange(kb, device=tmax.device) < a
    if window is not None:
        return (torch.arange(kb, device=tmax.device) < a - window).expand_as(tmax).clone()
    if thresholds is not None:
        thr = thresholds[:, min(r // block_m, thresholds.shape[1] - 1)].to(tmax) * LOG2E
        return cand & (tmax < thr.view(1, h, 1))
    seq = torch.tensor(scan_order(order, a, kb), device=tmax.device)
    running = torch.cummax(tmax[..., seq], dim=-1).values
    gap = torch.empty_like(tmax)
    gap[..., seq] = tmax[..., seq] - running
    ll2 = log_lambda * LOG2E if math.isfinite(log_lambda) else log_lambda
    return cand & (gap < ll2)


def sparse_decode_triton(q, k, v, scale: float, block_m: int, block_n: int, *, thresholds=None,
                         log_lambda: float | None = None, window: int | None = None, order: str = "forward",
                         dense: bool = False, splits: int | None = None, launch: tuple | None = None,
                         tiles_per_step: int = TILES_PER_STEP):
    """One decode step; the Triton twin of ``sparse_reference.sparse_decode``.

    q [B, H, 1, D], k/v [B, Hkv, L, D] (the row sits at L - 1; fp16/bf16, fp32 accepted); exactly
    one of thresholds [H, Pt], log_lambda, window, or dense=True. ``splits`` key ranges (default
    ``num_splits``); ``launch`` (num_warps, num_stages); ``tiles_per_step`` key tiles per iteration
    of the attend loop (a power of two; the split ranges need not be multiples of it). Returns
    (out [B, H, 1, D] in q.dtype, skipped [B, H] int64 candidate tiles skipped, counted by the kernel).
    """
    from .triton_sparse import _method_code

    method = _method_code(thresholds, log_lambda, window, dense)
    b, h, one, d = q.shape
    if one != 1 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != b or h % k.shape[1] or k.shape[3] != d:
        raise ValueError(f"decode takes q [B,H,1,D] and k, v [B,Hkv,L,D], got {tuple(q.shape)}, {tuple(k.shape)}")
    if order not in ORDERS:
        raise ValueError(f"Unknown scan order '{order}'. Available: {', '.join(ORDERS)}.")
    if tiles_per_step < 1 or tiles_per_step & (tiles_per_step - 1):
        raise ValueError(f"tiles_per_step must be a power of two, got {tiles_per_step}")
    hkv, length = k.shape[1], k.shape[2]
    group, kb = h // hkv, triton.cdiv(length, block_n)
    gp, bn_pad = next_pow2(group), next_pow2(block_n)
    n_split = splits or num_splits(b * hkv, kb, q.device)
    tps = triton.cdiv(kb, n_split)
    n_split = triton.cdiv(kb, tps)
    dev, f32 = q.device, torch.float32
    s = torch.empty((b, h, kb * block_n), dtype=f32, device=dev)
    tmax = torch.empty((b, h, kb), dtype=f32, device=dev)
    prec, upcast = dot_flags(q.dtype)
    warps, stages = launch or DECODE_LAUNCH
    q2 = q[:, :, 0]
    grid = (n_split, b * hkv)
    common = dict(HEAD_DIM=d, BN=block_n, BLOCK_N=bn_pad, GP=gp, PREC=prec, UPCAST=upcast,
                  num_warps=warps, num_stages=stages)
    LAST_COMPILED["decode_scores"] = _decode_scores_kernel[grid](
        q2, k, s, tmax, q2.stride(0), q2.stride(1), k.stride(0), k.stride(1), k.stride(2), length, kb, tps,
        h, group, scale * LOG2E, **common)
    # the decision: in the attend kernel (BSFA, window, BLASST forward), else a torch mask
    decide = {0: 0, 1: 2, 3: 4}.get(method, 3 if order == "forward" else 1)
    skip = skip_v = thr = tmax  # placeholders the kernel does not read
    if decide == 1:
        mask = decode_skip_mask(tmax, length, block_m, block_n, log_lambda=log_lambda, order=order)
        skip, skip_v = mask.to(torch.int8), mask.view(b, hkv, group, kb).all(dim=2).to(torch.int8)
    if decide == 2:
        thr = thresholds.to(device=dev, dtype=f32).contiguous()
    ll2 = 0.0 if log_lambda is None else (log_lambda * LOG2E if math.isfinite(log_lambda) else log_lambda)
    acc = torch.empty((b, h, n_split, d), dtype=f32, device=dev)
    m, ls = torch.empty((b, h, n_split), dtype=f32, device=dev), torch.empty((b, h, n_split), dtype=f32, device=dev)
    cnt = torch.empty((b, h, n_split), dtype=torch.int32, device=dev)
    LAST_COMPILED["decode_attend"] = _decode_attend_kernel[grid](
        s, v, tmax, thr, skip, skip_v, acc, m, ls, cnt, v.stride(0), v.stride(1), v.stride(2), length, kb, tps,
        n_split, h, group, thr.shape[-1], min((length - 1) // block_m, thr.shape[-1] - 1), ll2,
        0 if window is None else int(window), TILES=tiles_per_step, DECIDE=decide,
        PRE_TILES=64, **common)
    out = torch.empty_like(q)
    _decode_merge_kernel[(b * h,)](acc, m, ls, out, out.stride(0), out.stride(1), h, n_split,
                                   HEAD_DIM=d, SP=next_pow2(n_split, 2), num_warps=4)
    return out, cnt.sum(dim=-1, dtype=torch.int64)
