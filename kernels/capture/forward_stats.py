"""Single-pass instrumented causal forward in Triton: output, LSE and one order's tile statistics.

One launch (grid P x H). The program of query block i walks its reachable key blocks in the
chosen scan order (geometry.scan_order) with the dense kernel's online softmax and, per tile,
reduces what the softmax already has in registers: the row block maxima m_ij and the running max
m_new after the tile. From them, with one two-operand cross-row reduction and two scalar stores a
tile, come

    bmax[h, i, j] = max over valid rows of m_ij                       (natural units)
    gap[h, i, j]  = max over valid rows seeing the tile of (m_ij - m_new)

and, per row in registers, t* = the last scan step where the running max strictly increased
(= the first step at which it reaches its final value) and that block's where-category
(geometry.where_code), stored once at the end together with the VFA q-init error (the
signed-absmax key representatives of kernels/capture/reference.py and instrumented's prologue),
the running-max rescales (steps where the max rises from a finite value), the shortfalls of
the running max after the first and after the first geometry.local_prefix scan steps, and VFA's
joint statistic max(q-init estimate, max over block 0 and the diagonal blocks) - row max.

Cost of the joint statistic: the max over block 0 and the diagonal blocks is one more [BLOCK_M]
register (m_sl), updated per tile by one select and one max of the row maxima m_ij that the
online softmax has already reduced from the [BLOCK_M, BLOCK_N] scores; no score, load or
cross-row reduction is added. At the end it costs one [BLOCK_M] f32 store (4 bytes a row, like
the q-init error); the reduce kernel counts it with one bucket and one atomic add per row.

Each order is a sequence of contiguous segments of key blocks, each walked in one direction:
candidate blocks (every row sees every key: no mask) and diagonal blocks (causal/length mask):

    forward     candidates 0..A-1 up, diagonal A..R-1 up
    reverse     diagonal R-1..A down, candidates A-1..0 down
    sink_local  block 0, diagonal max(A,1)..R-1 up, candidates 1..A-1 up

Semantics are those of reference.instrumented_attention for one order (TileStats.bmax,
gap[:, o], tstar_step/where[:, o], rescales[:, o], shortfall[:, o], qinit_err), with
``softcap`` on the capped scores (jit.soft_cap in every tile and on the q-init estimate; SOFTCAP
off compiles the uncapped kernel).

Shape legend
    H query heads   Hkv KV heads   N length   D head dim   P = ceil(N/BM)   Kb = ceil(N/BN)
    A = A_i candidate key blocks of query block i   R = reachable key blocks of query block i
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsecal.formats.geometry import ORDERS, cdiv
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.common import QINIT_CHUNK, qinit_max
from sparsecal.kernels.capture.reference import pad_blocks, signed_absmax_keys
from sparsecal.kernels.jit import (
    LAST_COMPILED,
    LOG2E,
    check_fp32_tile,
    check_inputs,
    dot_flags,
    load_v,
    next_pow2,
    query_block,
    softcap_args,
    softmax_update,
    tile_qk,
)

# (num_warps, num_stages) per head dim on a CUDA GPU, from the H100 sweep of
# sparsecal.bench.capture_forward_stats (data/bench/NOTES.md); the interpreter ignores them.
# D = 256 (not yet timed): up to three loops, each with its own buffers on Triton 3.6 (K and V tiles
# of 32 KiB, Q 64 KiB); compiled for sm_90 with Triton 3.6, sink_local takes 96 KiB of shared
# memory with one stage and 257 KiB with two (over an H100's 227 KiB).
LAUNCH = {64: (4, 3), 128: (8, 3), 256: (8, 1)}


@triton.jit
def _max_pair(a, b, c, d):
    return tl.maximum(a, c), tl.maximum(b, d)


@triton.jit
def _store_tile(row_b, row_g, j, bmax_ptr, gap_ptr):
    """bmax/gap of tile j from its per-row values [BLOCK_M] (log2 units; -inf rows ignored)."""
    t_b, t_g = tl.reduce((row_b, row_g), 0, _max_pair)
    tl.store(bmax_ptr + j, t_b * 0.6931471805599453)
    tl.store(gap_ptr + j, t_g * 0.6931471805599453)


@triton.jit
def _scan_segment(acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl, q, k_ptr, v_ptr, stride_kn, stride_vn,
                  rows, row_ok, offs_d, j_first, j_dir, count, step0, n_cand, n_loc, n_ctx, qk_scale, softcap,
                  bmax_ptr, gap_ptr,
                  BN: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
                  PREC: tl.constexpr, UPCAST: tl.constexpr, STATS: tl.constexpr):
    """Online softmax over key blocks j_first + t*j_dir (t < count, scan steps step0 + t), with
    per-tile bmax/gap stores (bmax_ptr/gap_ptr + j, natural units) and per-row t* tracking.

    acc [BLOCK_M, D] f32; l_i, m_i [BLOCK_M] f32 (log2 units); t_step [BLOCK_M] i32, t_where
    [BLOCK_M] i32; n_up [BLOCK_M] i32 rescales so far; m_first / m_loc [BLOCK_M] the running max
    after scan step 0 / step n_loc - 1; m_sl [BLOCK_M] the max over the sink block 0 and the
    diagonal blocks j >= A seen so far (VFA's exact local max); rows, row_ok [BLOCK_M]. MASKED as in jit.attend_range; a masked tile
    may leave a row with nothing seen yet (m_new = -inf), which the exponentials guard against.
    SOFTCAP: scores capped at ``softcap`` (log2 units), as in jit.tile_qk.
    STATS off: the plain scan (no bmax/gap/t*), only to measure what the statistics cost.
    """
    for t in range(count):
        j = j_first + t * j_dir
        qk, m_ij, keys, kmask = tile_qk(q, k_ptr, stride_kn, rows, offs_d, j, n_ctx, qk_scale, softcap, BN, BLOCK_N,
                                         MASKED, SOFTCAP, PREC, UPCAST)
        v = load_v(v_ptr, keys, kmask, stride_vn, offs_d, MASKED)
        m_new = tl.maximum(m_i, m_ij)
        acc, l_i = softmax_update(acc, l_i, m_i, m_new, qk, v, qk_scale, MASKED or SOFTCAP, PREC, UPCAST)
        if STATS:
            row_b = tl.where(row_ok, m_ij, float("-inf"))
            gap = tl.where(m_ij >= m_new, 0.0, m_ij - m_new)  # exactly 0 where the max rises (no fma rounding)
            row_g = tl.where(row_ok & (m_ij > float("-inf")), gap, float("-inf"))
            _store_tile(row_b, row_g, j, bmax_ptr, gap_ptr)
            up = m_ij > m_i
            t_step = tl.where(up, step0 + t, t_step)
            t_where = tl.where(up, tl.where(j == 0, 0, tl.where(j >= n_cand, 1, 2)), t_where)
            n_up += (up & (m_i > float("-inf"))).to(tl.int32)
            m_first = tl.where(step0 + t == 0, m_new, m_first)
            m_loc = tl.where(step0 + t == n_loc - 1, m_new, m_loc)
            m_sl = tl.where((j == 0) | (j >= n_cand), tl.maximum(m_sl, m_ij), m_sl)  # sink + diagonal
        m_i = m_new
    return acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl


@triton.jit
def _softmax_state(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The online softmax before the first tile: acc [BLOCK_M, D] 0, row sums 0, row maxima -inf."""
    return (tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.full([BLOCK_M], float("-inf"), tl.float32))


@triton.jit
def _row_state(BLOCK_M: tl.constexpr):
    """Per-row scan state before the first tile: t* step and where (0), rescales (0), the running
    max after step 0 and after the local prefix, and the sink + diagonal max (-inf)."""
    zero = tl.zeros([BLOCK_M], tl.int32)
    neg = tl.full([BLOCK_M], float("-inf"), tl.float32)
    return zero, zero, zero, neg, neg, neg


@triton.jit
def _store_rows(LSE, QERR, JERR, TSTEP, TWHERE, RESC, SHORT, h, n_ctx, rows, row_ok, l_i, m_i, m_init, t_step,
                t_where, n_up, m_first, m_loc, m_sl):
    """Per-row results of the [H, N] outputs (natural-log LSE, q-init error, VFA's joint statistic
    max(m_init, m_sl) - m_i, t*, rescales) and of SHORT [H, 2, N] (shortfalls after the first /
    the local prefix, natural units)."""
    offs = h * n_ctx + rows
    tl.store(LSE + offs, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)
    tl.store(QERR + offs, (m_init - m_i) * 0.6931471805599453, mask=row_ok)
    tl.store(JERR + offs, (tl.maximum(m_init, m_sl) - m_i) * 0.6931471805599453, mask=row_ok)
    tl.store(TSTEP + offs, t_step, mask=row_ok)
    tl.store(TWHERE + offs, t_where.to(tl.int8), mask=row_ok)
    tl.store(RESC + offs, n_up, mask=row_ok)
    sf = SHORT + 2 * h * n_ctx + rows
    tl.store(sf, (m_i - m_first) * 0.6931471805599453, mask=row_ok)
    tl.store(sf + n_ctx, (m_i - m_loc) * 0.6931471805599453, mask=row_ok)


@triton.jit
def _fwd_stats_kernel(Q, K, V, KREP, O, LSE, BMAX, GAP, TSTEP, TWHERE, QERR, RESC, SHORT, JERR,
                      sq_h, sq_n, sk_h, sk_n, sv_h, sv_n, sr_h, sr_j, so_h, so_n,
                      n_ctx, group, n_qb, n_kb, qk_scale, softcap,
                      ORDER: tl.constexpr, HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                      EVEN_N: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                      STATS: tl.constexpr):
    """Grid (P, H); query block i (heaviest first) of head program_id(1). ORDER 0 forward, 1
    reverse, 2 sink_local. O [H, N, D] (strides so_h, so_n); LSE, QERR, JERR [H, N] f32 natural log;
    TSTEP, RESC [H, N] i32, TWHERE [H, N] i8, SHORT [H, 2, N] f32; BMAX, GAP [H, P, Kb] f32 (only
    reachable tiles written).
    SOFTCAP: scores and the q-init estimate capped at ``softcap`` (log2 units)."""
    i, h, hk, rows, row_ok, offs_d, q, n_cand, n_reach = query_block(Q, sq_h, sq_n, group, n_ctx, HEAD_DIM, BM,
                                                                      BN, BLOCK_M)
    m_init = qinit_max(q, KREP + hk * sr_h, sr_j, offs_d, n_reach, qk_scale, softcap, BLOCK_M, BLOCK_R, SOFTCAP,
                       PREC, UPCAST)
    k_ptr, v_ptr = K + hk * sk_h, V + hk * sv_h
    tile = (h * n_qb + i) * n_kb
    acc, l_i, m_i = _softmax_state(BLOCK_M, HEAD_DIM)
    t_step, t_where, n_up, m_first, m_loc, m_sl = _row_state(BLOCK_M)
    n_loc = tl.minimum(1 + n_reach - n_cand, n_reach)  # geometry.local_prefix
    n_diag = n_reach - n_cand
    bp, gp = BMAX + tile, GAP + tile
    # segments (first block, direction, count, first step, masked); see the module docstring
    if ORDER == 0:
        acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl = _scan_segment(
            acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d,
            0, 1, n_cand, 0, n_cand, n_loc, n_ctx, qk_scale, softcap, bp, gp,
            BN, BLOCK_N, not EVEN_N, SOFTCAP, PREC, UPCAST, STATS)
        acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl = _scan_segment(
            acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d,
            n_cand, 1, n_diag, n_cand, n_cand, n_loc, n_ctx, qk_scale, softcap, bp, gp,
            BN, BLOCK_N, True, SOFTCAP, PREC, UPCAST, STATS)
    elif ORDER == 1:
        acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl = _scan_segment(
            acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d,
            n_reach - 1, -1, n_diag, 0, n_cand, n_loc, n_ctx, qk_scale, softcap, bp, gp,
            BN, BLOCK_N, True, SOFTCAP, PREC, UPCAST, STATS)
        acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl = _scan_segment(
            acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d,
            n_cand - 1, -1, n_cand, n_diag, n_cand, n_loc, n_ctx, qk_scale, softcap, bp, gp,
            BN, BLOCK_N, not EVEN_N, SOFTCAP, PREC, UPCAST, STATS)
    else:
        d0 = tl.maximum(n_cand, 1)
        acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl = _scan_segment(
            acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d,
            0, 1, 1, 0, n_cand, n_loc, n_ctx, qk_scale, softcap, bp, gp,
            BN, BLOCK_N, True, SOFTCAP, PREC, UPCAST, STATS)
        acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl = _scan_segment(
            acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d,
            d0, 1, n_reach - d0, 1, n_cand, n_loc, n_ctx, qk_scale, softcap, bp, gp,
            BN, BLOCK_N, True, SOFTCAP, PREC, UPCAST, STATS)
        acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl = _scan_segment(
            acc, l_i, m_i, t_step, t_where, n_up, m_first, m_loc, m_sl, q, k_ptr, v_ptr, sk_n, sv_n, rows, row_ok, offs_d,
            1, 1, n_cand - 1, 1 + n_reach - d0, n_cand, n_loc, n_ctx, qk_scale, softcap, bp, gp,
            BN, BLOCK_N, not EVEN_N, SOFTCAP, PREC, UPCAST, STATS)
    tl.store(O + h * so_h + rows[:, None] * so_n + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=row_ok[:, None])
    _store_rows(LSE, QERR, JERR, TSTEP, TWHERE, RESC, SHORT, h, n_ctx, rows, row_ok, l_i, m_i, m_init, t_step,
                t_where, n_up, m_first, m_loc, m_sl)


def instrumented_forward_triton(q, k, v, scale: float, cfg: StatsConfig, order: str, launch: tuple | None = None,
                                stats: bool = True, *, softcap: float = 0.0):
    """One launch: causal attention plus one scan order's tile statistics.

    q [1, H, N, D], k/v [1, Hkv, N, D] (fp16/bf16; fp32 accepted); order one of geometry.ORDERS;
    launch (num_warps, num_stages) overrides LAUNCH; softcap: the cap c of c * tanh(s / c) on every
    scaled score (0 or None: off). Returns (out [1, H, N, D] in q.dtype,
    lse [H, N] f32 natural log, bmax [H, P, Kb] f32, gap [H, P, Kb] f32 (-inf where unreachable),
    tstar_step [H, N] i32, tstar_where [H, N] i8, qinit_err [H, N] f32, rescales [H, N] i32,
    shortfall [H, 2, N] f32, joint_err [H, N] f32), equal to reference.instrumented_attention's bmax,
    gap[:, o], tstar_step/where[:, o], qinit_err, rescales[:, o], shortfall[:, o], joint_err.
    stats=False runs the same scan without bmax/gap/t* (left -inf / unset), to measure their cost.
    """
    _, h, hkv, n, d = check_inputs(q, k, v)
    if q.shape[0] != 1:
        raise ValueError("instrumented attention takes one sequence at a time (batch size 1)")
    if order not in ORDERS:
        raise ValueError(f"Unknown scan order '{order}'. Available: {', '.join(ORDERS)}.")
    check_fp32_tile(q, cfg.block_m, "the Triton capture")
    cap_on, cap = softcap_args(softcap)
    bm, bn, dev = cfg.block_m, cfg.block_n, q.device
    p, kb = cdiv(n, bm), cdiv(n, bn)
    krep = signed_absmax_keys(pad_blocks(k[0], bn), bn)  # [Hkv, Kb, D]
    out = torch.empty_like(q)
    f32 = {"dtype": torch.float32, "device": dev}
    lse, qerr, jerr = torch.empty((h, n), **f32), torch.empty((h, n), **f32), torch.empty((h, n), **f32)
    bmax, gap = torch.full((h, p, kb), float("-inf"), **f32), torch.full((h, p, kb), float("-inf"), **f32)
    tstep = torch.empty((h, n), dtype=torch.int32, device=dev)
    twhere = torch.empty((h, n), dtype=torch.int8, device=dev)
    resc = torch.empty((h, n), dtype=torch.int32, device=dev)
    short = torch.empty((h, 2, n), **f32)
    prec, upcast = dot_flags(q.dtype)
    warps, stages = launch or LAUNCH.get(d, (4, 2))
    qs, ks, vs, os_ = q[0].stride(), k[0].stride(), v[0].stride(), out[0].stride()
    LAST_COMPILED["forward_stats"] = _fwd_stats_kernel[(p, h)](
        q, k, v, krep, out, lse, bmax, gap, tstep, twhere, qerr, resc, short, jerr,
        qs[0], qs[1], ks[0], ks[1], vs[0], vs[1],
        krep.stride(0), krep.stride(1), os_[0], os_[1], n, h // hkv, p, kb, scale * LOG2E, cap,
        ORDER=ORDERS.index(order), HEAD_DIM=d, BM=bm, BN=bn, BLOCK_M=next_pow2(bm), BLOCK_N=next_pow2(bn),
        BLOCK_R=QINIT_CHUNK, EVEN_N=bn == next_pow2(bn), SOFTCAP=cap_on, PREC=prec, UPCAST=upcast,
        STATS=stats, num_warps=warps, num_stages=stages)
    return out, lse, bmax, gap, tstep, twhere, qerr, resc, short, jerr
