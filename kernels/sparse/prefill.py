"""Block-sparse causal prefill attention in Triton: BSFA, BLASST and the sliding-window baseline.

Same semantics as ``reference.sparse_attention`` (the oracle): query block i (BM rows)
always computes its diagonal key blocks; a candidate key block j < A_i is skipped when

    BSFA     max over the tile's scores  <  thresholds[h, min(i, Pt - 1)]
    BLASST   max over rows of (row max of the tile - running max after it)  <  ln(lambda)
    window   j < A_i - W   (``sink``: and j >= 1, key block 0 kept as StreamingLLM's sink)

A skipped tile costs its K load and Q.K^T product (needed for the decision) and nothing else:
no exponentials, no P.V product, and with ``gate_v`` no V load either. One program owns one query
block of one (batch, head) and walks its key blocks with the dense kernel's online softmax
(dense); BLASST walks them in the calibrated scan order (forward, reverse, sink_local, as
in forward_stats), BSFA and window walk forward (their decisions do not depend on the
order). Each program stores how many tiles it skipped; ``method="dense"`` is the same kernel with
skipping off (the fair "skipping off" baseline at the run geometry).

Block geometry is the export's (BM x BN, default 128 x 64): thresholds and skip decisions are per
BM x BN tile. GQA is native (query head h reads KV head h // (H / Hkv)); any N (ragged blocks
masked); fp16/bf16 (fp32 accepted). ``softcap`` (Gemma 2): every scaled score s is replaced by
c * tanh(s / c) (jit.soft_cap) before the decision and the softmax, so thresholds and ln(lambda)
apply to the capped tile maxima and gaps; SOFTCAP off compiles the uncapped kernel.

Shape legend
    B batch   H query heads   Hkv KV heads   N tokens   D head dim   P = ceil(N/BM) query blocks
    Pt threshold positions (an export's max_num_blocks)   A = A_i candidate key blocks of block i
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sparsecal.formats.geometry import ORDERS, block_counts, cdiv
from sparsecal.kernels.jit import (
    LAST_COMPILED,
    LOG2E,
    check_fp32_tile,
    check_inputs,
    dot_flags,
    interpreting,
    load_v,
    log2_lambda,
    next_pow2,
    softcap_args,
    softmax_update,
    tile_qk,
)
from sparsecal.kernels.sparse.reference import check_method

SPARSE_METHODS = ("dense", "bsfa", "blasst", "window")
# (num_warps, num_stages) per head dim on a CUDA GPU; the interpreter ignores them.
# D = 256 (not yet timed): the query block is BM = 128 rows (the export's geometry, not a choice),
# so Q alone is 64 KiB (16-bit) and K, V tiles 32 KiB each; Triton 3.6 gives each of up to three
# loops its own buffers: compiled for sm_90 with Triton 3.6, sink_local takes 96 KiB of shared
# memory with one stage and 256 KiB with two (over an H100's 227 KiB). 8 warps for the [128, 256]
# f32 accumulator.
# 64/128: the launch sweeps of sparse-h100-d{64,128}.json (16K, G=4).
LAUNCH = {64: (8, 3), 128: (8, 3), 256: (8, 1)}


@triton.jit
def _sparse_segment(acc, l_i, m_i, n_skip, q, k_ptr, v_ptr, stride_kn, stride_vn, rows, row_ok, offs_d,
                    j_first, j_dir, count, n_ctx, qk_scale, softcap, thr,
                    BN: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, METHOD: tl.constexpr,
                    GATE_V: tl.constexpr, DO_SKIP: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                    UPCAST: tl.constexpr):
    """Online softmax over key blocks j_first + t * j_dir (t < count), skipping per METHOD.

    acc [BLOCK_M, D] f32; l_i, m_i [BLOCK_M] f32 (log2 units); n_skip i32 tiles skipped so far;
    thr the program's threshold in log2 units (BSFA: the tile max's; BLASST: ln(lambda)).
    METHOD 0 computes every tile (dense, or diagonal blocks); 1 BSFA; 2 BLASST (candidates only).
    MASKED: causal/length/block-width mask (diagonal or ragged blocks). DO_SKIP False (count_only):
    the decision is made and counted but every tile is computed (the decision's cost, measured).
    SOFTCAP: scores capped at ``softcap`` (log2 units), as in jit.tile_qk.
    """
    for t in range(count):
        j = j_first + t * j_dir
        qk, m_ij, keys, kmask = tile_qk(q, k_ptr, stride_kn, rows, offs_d, j, n_ctx, qk_scale, softcap, BN, BLOCK_N,
                                         MASKED, SOFTCAP, PREC, UPCAST)
        if not GATE_V:
            v = load_v(v_ptr, keys, kmask, stride_vn, offs_d, MASKED)
        m_new = tl.maximum(m_i, m_ij)
        if METHOD == 0:
            keep = True
        elif METHOD == 1:
            keep = tl.max(tl.where(row_ok, m_ij, float("-inf")), 0) >= thr
        else:
            # a row whose max rises has gap exactly 0 (no fused-multiply rounding at lambda = 1)
            gap = tl.where(m_ij >= m_new, 0.0, m_ij - m_new)
            keep = tl.max(tl.where(row_ok, gap, float("-inf")), 0) >= thr
        if METHOD == 0 or not DO_SKIP:  # every tile computed (count_only: the decision is only counted)
            if METHOD != 0:
                n_skip += 1 - keep.to(tl.int32)
            if GATE_V:
                v = load_v(v_ptr, keys, kmask, stride_vn, offs_d, MASKED)
            acc, l_i = softmax_update(acc, l_i, m_i, m_new, qk, v, qk_scale, MASKED or SOFTCAP, PREC, UPCAST)
            m_i = m_new
        elif keep:
            if GATE_V:
                v = load_v(v_ptr, keys, kmask, stride_vn, offs_d, MASKED)
            acc, l_i = softmax_update(acc, l_i, m_i, m_new, qk, v, qk_scale, MASKED or SOFTCAP, PREC, UPCAST)
            m_i = m_new
        else:
            n_skip += 1
    return acc, l_i, m_i, n_skip


@triton.jit
def _scan(acc, l_i, m_i, n_skip, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d, n_cand, n_reach, n_ctx, qk_scale,
          softcap, thr, window, sink, METHOD: tl.constexpr, ORDER: tl.constexpr, BN: tl.constexpr,
          BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, GATE_V: tl.constexpr, DO_SKIP: tl.constexpr,
          SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """A query block's key blocks in the method's scan order (``_sparse_fwd_kernel``'s METHOD and
    ORDER): the diagonal blocks n_cand .. n_reach - 1 always computed, the candidates before them
    decided (BSFA, BLASST) or windowed; returns (acc, l_i, m_i, n_skip)."""
    n_diag = n_reach - n_cand
    CAND: tl.constexpr = 0 if METHOD == 3 else METHOD  # the window has no per-tile decision
    if METHOD == 2 and ORDER == 1:  # reverse: diagonal blocks down, then candidates down
        acc, l_i, m_i, n_skip = _sparse_segment(
            acc, l_i, m_i, n_skip, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d, n_reach - 1, -1, n_diag,
            n_ctx, qk_scale, softcap, thr, BN, BLOCK_N, True, 0, GATE_V, DO_SKIP, SOFTCAP, PREC, UPCAST)
        acc, l_i, m_i, n_skip = _sparse_segment(
            acc, l_i, m_i, n_skip, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d, n_cand - 1, -1, n_cand,
            n_ctx, qk_scale, softcap, thr, BN, BLOCK_N, not EVEN_N, 2, GATE_V, DO_SKIP, SOFTCAP, PREC, UPCAST)
    elif METHOD == 2 and ORDER == 2:  # sink_local: block 0, diagonal up, candidates 1.. up
        d0 = tl.maximum(n_cand, 1)
        acc, l_i, m_i, n_skip = _sparse_segment(
            acc, l_i, m_i, n_skip, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d, 0, 1, 1,
            n_ctx, qk_scale, softcap, thr, BN, BLOCK_N, True, 0, GATE_V, DO_SKIP, SOFTCAP, PREC, UPCAST)
        acc, l_i, m_i, n_skip = _sparse_segment(
            acc, l_i, m_i, n_skip, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d, d0, 1, n_reach - d0,
            n_ctx, qk_scale, softcap, thr, BN, BLOCK_N, True, 0, GATE_V, DO_SKIP, SOFTCAP, PREC, UPCAST)
        acc, l_i, m_i, n_skip = _sparse_segment(
            acc, l_i, m_i, n_skip, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d, 1, 1, n_cand - 1,
            n_ctx, qk_scale, softcap, thr, BN, BLOCK_N, not EVEN_N, 2, GATE_V, DO_SKIP, SOFTCAP, PREC, UPCAST)
    else:  # forward: candidates up (the window starts at A - W), then the diagonal blocks up
        j_lo = 0
        if METHOD == 3:
            j_lo = tl.maximum(n_cand - window, 0)
            s0 = tl.minimum(sink, j_lo)  # 1: block 0 is outside the window and kept as the sink
            acc, l_i, m_i, n_skip = _sparse_segment(
                acc, l_i, m_i, n_skip, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d, 0, 1, s0,
                n_ctx, qk_scale, softcap, thr, BN, BLOCK_N, not EVEN_N, 0, GATE_V, DO_SKIP, SOFTCAP, PREC, UPCAST)
            n_skip += j_lo - s0
        acc, l_i, m_i, n_skip = _sparse_segment(
            acc, l_i, m_i, n_skip, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d, j_lo, 1, n_cand - j_lo,
            n_ctx, qk_scale, softcap, thr, BN, BLOCK_N, not EVEN_N, CAND, GATE_V, DO_SKIP, SOFTCAP, PREC, UPCAST)
        acc, l_i, m_i, n_skip = _sparse_segment(
            acc, l_i, m_i, n_skip, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d, n_cand, 1, n_diag,
            n_ctx, qk_scale, softcap, thr, BN, BLOCK_N, True, 0, GATE_V, DO_SKIP, SOFTCAP, PREC, UPCAST)
    return acc, l_i, m_i, n_skip


@triton.jit
def _sparse_fwd_kernel(Q, K, V, O, THR, SKIP,
                       sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n,
                       n_ctx, num_heads, group, n_thr, qk_scale, softcap, log_lambda2, window, sink,
                       METHOD: tl.constexpr, ORDER: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       EVEN_N: tl.constexpr, GATE_V: tl.constexpr, DO_SKIP: tl.constexpr, SOFTCAP: tl.constexpr,
                       PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (P, B * H), heaviest query blocks first. METHOD 0 dense, 1 BSFA, 2 BLASST, 3 window;
    ORDER (BLASST) 0 forward, 1 reverse, 2 sink_local. THR [H, n_thr] f32 natural units (BSFA);
    log_lambda2 = ln(lambda) * log2(e) (BLASST); window = W, sink 1 keeps block 0 (window). O [B, H, N, D] by strides;
    SKIP [B * H, P] i32 tiles skipped by each program. SOFTCAP: scores capped (``softcap``, log2)."""
    i = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = bh % num_heads
    hk = (h // group).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = i * BM + offs_m
    row_ok = (offs_m < BM) & (rows < n_ctx)
    q = tl.load(Q + b * sq_b + h.to(tl.int64) * sq_h + rows[:, None] * sq_n + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_ptr = K + b * sk_b + hk * sk_h
    v_ptr = V + b * sv_b + hk * sv_h
    n_cand = (i * BM) // BN
    n_reach = (tl.minimum((i + 1) * BM, n_ctx) - 1) // BN + 1
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    n_skip = tl.zeros([], tl.int32)
    if METHOD == 1:
        thr = tl.load(THR + h * n_thr + tl.minimum(i, n_thr - 1)) * 1.4426950408889634
    else:
        thr = log_lambda2
    acc, l_i, m_i, n_skip = _scan(acc, l_i, m_i, n_skip, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d, n_cand,
                                  n_reach, n_ctx, qk_scale, softcap, thr, window, sink, METHOD, ORDER, BN, BLOCK_N,
                                  EVEN_N, GATE_V, DO_SKIP, SOFTCAP, PREC, UPCAST)
    o_ptr = O + b * so_b + h.to(tl.int64) * so_h + rows[:, None] * so_n + offs_d[None, :]
    tl.store(o_ptr, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(SKIP + bh.to(tl.int64) * tl.num_programs(0) + i, n_skip)


def method_code(thresholds, log_lambda, window, dense: bool, sink: bool = False) -> int:
    """0 dense, 1 BSFA, 2 BLASST, 3 window (the reference's argument rules, plus dense)."""
    if dense:
        if any(x is not None for x in (thresholds, log_lambda, window)) or sink:
            raise ValueError("method 'dense' takes no thresholds, log_lambda, window or sink")
        return 0
    check_method(thresholds, log_lambda, window, sink=sink)
    return 1 if thresholds is not None else 2 if log_lambda is not None else 3


def _check_args(q, k, v, block_m, thresholds, log_lambda, window, order, dense, count_only,
                sink: bool = False) -> tuple:
    """(B, H, Hkv, N, D, method code, thresholds [H, Pt] f32 on q's device or a [1, 1] placeholder)
    after the argument checks of sparse_attention_triton."""
    b, h, hkv, n, d = check_inputs(q, k, v)
    check_fp32_tile(q, block_m, "the Triton sparse prefill")
    method = method_code(thresholds, log_lambda, window, dense, sink)
    if order not in ORDERS:
        raise ValueError(f"Unknown scan order '{order}'. Available: {', '.join(ORDERS)}.")
    if count_only and method not in (1, 2):
        raise ValueError("count_only counts a per-tile decision: give thresholds (BSFA) or log_lambda (BLASST)")
    if method == 1:
        if thresholds.dim() != 2 or thresholds.shape[0] != h:
            raise ValueError(f"thresholds must be [H={h}, positions], got {tuple(thresholds.shape)}")
        thr = thresholds.to(device=q.device, dtype=torch.float32).contiguous()
    else:
        thr = torch.zeros((1, 1), dtype=torch.float32, device=q.device)
    return b, h, hkv, n, d, method, thr


def sparse_attention_triton(q, k, v, scale: float, block_m: int, block_n: int, *, thresholds=None,
                            log_lambda: float | None = None, window: int | None = None, order: str = "forward",
                            dense: bool = False, gate_v: bool = True, count_only: bool = False,
                            out: torch.Tensor | None = None, launch: tuple | None = None, softcap: float = 0.0,
                            sink: bool = False):
    """Block-sparse causal attention; the Triton twin of ``reference.sparse_attention``.

    q [B, H, N, D], k/v [B, Hkv, N, D]; exactly one of thresholds [H, Pt] (BSFA, natural units of
    the scaled (capped) scores), log_lambda (BLASST, scan ``order``), window (blocks; ``sink``: key
    block 0 kept too), or dense=True.
    gate_v: load V only for computed tiles (else V is prefetched with K). count_only: decide and
    count as the method does but compute every tile (dense output; what deciding costs, measured
    without the skip). out: optional [B, H, N, D] buffer (any strides, last axis contiguous).
    launch: (num_warps, num_stages). softcap: the cap c of c * tanh(s / c) on every scaled score
    (0 or None: off). Returns (out [B, H, N, D] in q.dtype, skipped [B, H] int64 candidate tiles
    skipped).
    """
    b, h, hkv, n, d, method, thr = _check_args(q, k, v, block_m, thresholds, log_lambda, window, order, dense,
                                               count_only, sink)
    cap_on, cap = softcap_args(softcap)
    ll2 = 0.0 if log_lambda is None else log2_lambda(log_lambda)
    p = cdiv(n, block_m)
    if out is None:
        out = torch.empty_like(q)
    skip = torch.empty((b * h, p), dtype=torch.int32, device=q.device)
    prec, upcast = dot_flags(q.dtype)
    warps, stages = launch or LAUNCH.get(d, (4, 2))
    LAST_COMPILED["sparse"] = _sparse_fwd_kernel[(p, b * h)](
        q, k, v, out, thr, skip, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        n, h, h // hkv, thr.shape[1], scale * LOG2E, cap, ll2, 0 if window is None else int(window), int(sink),
        METHOD=method, ORDER=ORDERS.index(order) if method == 2 else 0, HEAD_DIM=d, BM=block_m, BN=block_n,
        BLOCK_M=next_pow2(block_m), BLOCK_N=next_pow2(block_n), EVEN_N=block_n == next_pow2(block_n),
        GATE_V=gate_v, DO_SKIP=not count_only, SOFTCAP=cap_on, PREC=prec, UPCAST=upcast, num_warps=warps,
        num_stages=stages)
    return out, skip.view(b, h, p).sum(dim=-1, dtype=torch.int64)


@functools.lru_cache(maxsize=256)
def candidate_tiles(n: int, block_m: int, block_n: int) -> tuple[int, int]:
    """(candidate tiles, reachable tiles) of one head of an N-token causal prefill (cached: the
    sparse backend asks once per layer and forward)."""
    cand, reach = block_counts(n, block_m, block_n)
    return int(cand.sum()), int(reach.sum())


__all__ = ["SPARSE_METHODS", "candidate_tiles", "interpreting", "sparse_attention_triton"]
