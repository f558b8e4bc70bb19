"""Instrumented causal attention in Triton: the output plus the tile statistics of DESIGN.md.

Same semantics and result as ``reference.instrumented_attention`` (the oracle), in three launches:

pass 1  ``_instr_fwd_kernel`` (grid P x heads): the dense flash forward of triton_dense (output,
        log-sum-exp) over the key blocks in ascending order, which also stores for every row and
        reachable tile the row's block max and block log-sum-exp (two f32 values a row, in a
        packed per-head scratch of the reachable tiles), and the VFA q-init estimate of every row
        (signed-absmax key representatives, a few extra [BM, 64] products).
pass 2  ``_tile_stats_kernel`` (grid P x heads): reads those per-row values back in chunks of
        tiles and, reusing the log-sum-exp, computes bmax, mass, the gap in all three scan orders
        (prefix, suffix and sink-local running maxima) and t* for every row in every order. No
        score is recomputed; each order costs a scan over [TJ, BM] chunks, not a pass over keys.
decode  ``_decode_kernel`` (grid Kb x row chunks x H): per-row block maxima and masses of the last
        R rows, each row its own block; their gaps come from ``reference.scan_rows``.

The scratch holds 2 * BM * (reachable tiles) f32 per head; heads run in chunks that fit
``scratch_bytes``, so memory stays bounded at any length.

Shape legend
    H query heads   Hkv KV heads   N length   D head dim   P = ceil(N/BM)   Kb = ceil(N/BN)
    O = 3 scan orders in the canonical order of geometry.ORDERS   R decode rows   T reachable tiles
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .config import StatsConfig
from .geometry import ORDERS, block_counts, cdiv, num_candidates, scan_order
from .reference import TileStats, _pad_blocks, scan_rows, signed_absmax_keys
from .triton_dense import (LN2, LOG2E, _attend_range, _dot, check_inputs, dot_flags, interpreting,
                           next_pow2)

NEG_INF = float("-inf")
TILE_CHUNK = 16  # tiles per chunk in the statistics pass
QINIT_CHUNK = 64  # key representatives per product in the q-init prologue
# (num_warps, num_stages) of pass 1 per head dim, and of the statistics / decode kernels.
PASS1_LAUNCH = {64: (4, 3), 128: (8, 3)}
STATS_LAUNCH = (8, 1)
DECODE_LAUNCH = (4, 1)


@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


@triton.jit
def _qinit_max(q, r_ptr, stride_rj, offs_d, n_reach, qk_scale,
               BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """[BLOCK_M] max over key blocks j < n_reach of q_r . krep_j * qk_scale (log2 units).
    r_ptr: this KV head's representatives [Kb, D], row stride stride_rj."""
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    offs_r = tl.arange(0, BLOCK_R)
    for c in range(0, n_reach, BLOCK_R):
        jr = c + offs_r
        ok = jr < n_reach
        kr = tl.load(r_ptr + jr[None, :] * stride_rj + offs_d[:, None], mask=ok[None, :], other=0.0)
        s = tl.where(ok[None, :], _dot(q, kr, None, PREC, UPCAST) * qk_scale, float("-inf"))
        best = tl.maximum(best, tl.max(s, 1))
    return best


@triton.jit
def _instr_fwd_kernel(Q, K, V, KREP, O, LSE, QERR, X, Y, TOFF,
                      sq_h, sq_n, sk_h, sk_n, sv_h, sv_n, sr_h, sr_j, so_h, so_n,
                      n_ctx, head0, group, num_tiles, qk_scale,
                      HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                      EVEN_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Pass 1. Grid (P, heads of this chunk). Query block i = rows [i*BM, i*BM + BM) of head
    head0 + program_id(1). O [H, N, D] (strides so_h, so_n); LSE, QERR [H, N] f32 (natural log);
    X, Y [chunk heads, T, BLOCK_M] f32 scratch, tile (i, j) at TOFF[i] + j."""
    i = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest query blocks first
    hl = tl.program_id(1)
    h = (head0 + hl).to(tl.int64)
    hk = ((head0 + hl) // group).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = i * BM + offs_m
    row_ok = (offs_m < BM) & (rows < n_ctx)
    q = tl.load(Q + h * sq_h + rows[:, None] * sq_n + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    n_cand = (i * BM) // BN
    n_reach = (tl.minimum((i + 1) * BM, n_ctx) - 1) // BN + 1
    m_init = _qinit_max(q, KREP + hk * sr_h, sr_j, offs_d, n_reach, qk_scale, BLOCK_M, BLOCK_R, PREC, UPCAST)
    tile0 = (hl.to(tl.int64) * num_tiles + tl.load(TOFF + i)) * BLOCK_M
    x_ptr = X + tile0 + offs_m
    y_ptr = Y + tile0 + offs_m
    k_ptr = K + hk * sk_h
    v_ptr = V + hk * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, k_ptr, v_ptr, sk_n, sv_n, rows, offs_d, 0, n_cand,
                                  n_ctx, qk_scale, x_ptr, y_ptr, BN, BLOCK_N, not EVEN_N, True, PREC, UPCAST)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, k_ptr, v_ptr, sk_n, sv_n, rows, offs_d, n_cand, n_reach,
                                  n_ctx, qk_scale, x_ptr, y_ptr, BN, BLOCK_N, True, True, PREC, UPCAST)
    out = acc / l_i[:, None]
    tl.store(O + h * so_h + rows[:, None] * so_n + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + h * n_ctx + rows, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)
    tl.store(QERR + h * n_ctx + rows, (m_init - m_i) * 0.6931471805599453, mask=row_ok)


@triton.jit
def _load_tiles(base, j0, n_reach, row_ok, TJ: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per-row values of tiles j0 .. j0+TJ-1: ([TJ, BLOCK_M], -inf outside 0 <= j < n_reach and on
    invalid rows; jt [TJ] tile indices; ok [TJ] in range)."""
    jt = j0 + tl.arange(0, TJ)
    ok = (jt >= 0) & (jt < n_reach)
    ptr = base + jt[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    return tl.load(ptr, mask=ok[:, None] & row_ok[None, :], other=float("-inf")), jt, ok


@triton.jit
def _gap_of(xv, run):
    """[TJ] max over the rows that see each tile of (row block max - running max), log2 units."""
    return tl.max(tl.where(xv > float("-inf"), xv - run, float("-inf")), 1)


@triton.jit
def _argmax_update(xv, jt, pos_s, best, t_f, t_r, p_s):
    """Running per-row argmax over tiles with each order's tie rule: t_f the smallest j (forward),
    t_r the largest j (reverse), p_s the smallest sink_local position, all reaching ``best``."""
    cm = tl.max(xv, 0)
    hit = (xv == cm[None, :]) & (xv > float("-inf"))
    first = tl.min(tl.where(hit, jt[:, None], 1 << 30), 0)
    last = tl.max(tl.where(hit, jt[:, None], -1), 0)
    first_s = tl.min(tl.where(hit, pos_s[:, None], 1 << 30), 0)
    better = cm > best
    tie = (cm == best) & (cm > float("-inf"))
    t_f = tl.where(better, first, t_f)
    t_r = tl.where(better | tie, last, t_r)
    p_s = tl.where(better, first_s, tl.where(tie, tl.minimum(p_s, first_s), p_s))
    return tl.maximum(best, cm), t_f, t_r, p_s


@triton.jit
def _forward_sweep(x_base, y_base, lse2, row_ok, n_rows, n_cand, n_reach, d_max,
                   bmax_ptr, mass_ptr, gapf_ptr, gaps_ptr, TJ: tl.constexpr, BLOCK_M: tl.constexpr):
    """Ascending chunks of tiles: bmax, mass, forward and sink_local gaps (stored at ptr + j) and
    the per-row argmax state for t*. d_max [BLOCK_M]: max over the diagonal blocks j >= max(A, 1)."""
    neg = tl.full([BLOCK_M], float("-inf"), tl.float32)
    carry_f = neg
    carry_d = tl.load(x_base + tl.arange(0, BLOCK_M), mask=row_ok, other=float("-inf"))  # block 0
    best = neg
    t_f = tl.zeros([BLOCK_M], tl.int32)
    t_r = tl.zeros([BLOCK_M], tl.int32)
    p_s = tl.zeros([BLOCK_M], tl.int32)
    d0 = tl.maximum(n_cand, 1)
    for j0 in range(0, n_reach, TJ):
        xv, jt, ok = _load_tiles(x_base, j0, n_reach, row_ok, TJ, BLOCK_M)
        yv, _, _ = _load_tiles(y_base, j0, n_reach, row_ok, TJ, BLOCK_M)
        tl.store(bmax_ptr + jt, tl.max(xv, 1) * 0.6931471805599453, mask=ok)
        tl.store(mass_ptr + jt, tl.sum(tl.math.exp2(yv - lse2[None, :]), 1) / n_rows, mask=ok)
        run_f = tl.maximum(tl.associative_scan(xv, 0, _max_fn), carry_f[None, :])
        is_diag = jt >= n_cand
        xd = tl.where(is_diag[:, None], xv, float("-inf"))
        run_d = tl.maximum(tl.associative_scan(xd, 0, _max_fn), carry_d[None, :])
        later_cand = (jt >= 1) & (jt < n_cand)  # sink_local scans these after every diagonal block
        run_s = tl.where(later_cand[:, None], tl.maximum(run_f, d_max[None, :]),
                         tl.where(is_diag[:, None], run_d, run_f))
        tl.store(gapf_ptr + jt, _gap_of(xv, run_f) * 0.6931471805599453, mask=ok)
        tl.store(gaps_ptr + jt, _gap_of(xv, run_s) * 0.6931471805599453, mask=ok)
        carry_f = tl.maximum(carry_f, tl.max(xv, 0))
        carry_d = tl.maximum(carry_d, tl.max(xd, 0))
        pos_s = tl.where(jt == 0, 0, tl.where(jt >= d0, jt - d0 + 1, n_reach - d0 + jt))
        best, t_f, t_r, p_s = _argmax_update(xv, jt, pos_s, best, t_f, t_r, p_s)
    return t_f, t_r, p_s


@triton.jit
def _reverse_sweep(x_base, row_ok, n_reach, gapr_ptr, TJ: tl.constexpr, BLOCK_M: tl.constexpr):
    """Descending chunks of tiles: reverse-order gaps (suffix running maxima), stored at ptr + j."""
    carry = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for c in range(0, tl.cdiv(n_reach, TJ)):
        xv, jt, ok = _load_tiles(x_base, n_reach - (c + 1) * TJ, n_reach, row_ok, TJ, BLOCK_M)
        run = tl.maximum(tl.associative_scan(xv, 0, _max_fn, reverse=True), carry[None, :])
        tl.store(gapr_ptr + jt, _gap_of(xv, run) * 0.6931471805599453, mask=ok)
        carry = tl.maximum(carry, tl.max(xv, 0))


@triton.jit
def _store_tstar(step_ptr, where_ptr, norm_ptr, row_ok, step, j, n_cand, n_reach):
    """One order's t*: scan step, where code of block j (0 sink, 1 diagonal, 2 middle), step/(nr-1)."""
    code = tl.where(j == 0, 0, tl.where(j >= n_cand, 1, 2))
    tl.store(step_ptr, step.to(tl.int64), mask=row_ok)
    tl.store(where_ptr, code.to(tl.int8), mask=row_ok)
    tl.store(norm_ptr, step.to(tl.float32) / tl.maximum(n_reach - 1, 1).to(tl.float32), mask=row_ok)


@triton.jit
def _tile_stats_kernel(X, Y, TOFF, LSE, BMAX, MASS, GAP, TSTEP, TWHERE, TNORM,
                       n_ctx, head0, num_tiles, n_qb, n_kb,
                       BM: tl.constexpr, BN: tl.constexpr, BLOCK_M: tl.constexpr, TJ: tl.constexpr):
    """Pass 2. Grid (P, heads of this chunk). BMAX, MASS [H, P, Kb]; GAP [H, 3, P, Kb] (forward,
    reverse, sink_local); TSTEP (i64), TWHERE (i8), TNORM (f32) [H, 3, N]."""
    i = tl.program_id(0)
    hl = tl.program_id(1)
    h = (head0 + hl).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    rows = i * BM + offs_m
    row_ok = (offs_m < BM) & (rows < n_ctx)
    n_rows = (tl.minimum((i + 1) * BM, n_ctx) - i * BM).to(tl.float32)
    n_cand = (i * BM) // BN
    n_reach = (tl.minimum((i + 1) * BM, n_ctx) - 1) // BN + 1
    tile0 = (hl.to(tl.int64) * num_tiles + tl.load(TOFF + i)) * BLOCK_M
    x_base = X + tile0
    lse2 = tl.load(LSE + h * n_ctx + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    d_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for j0 in range(tl.maximum(n_cand, 1), n_reach, TJ):
        xv, _, _ = _load_tiles(x_base, j0, n_reach, row_ok, TJ, BLOCK_M)
        d_max = tl.maximum(d_max, tl.max(xv, 0))
    tiles = (h * n_qb + i) * n_kb
    ostride = n_qb * n_kb
    gap0 = ((h * 3) * n_qb + i) * n_kb
    t_f, t_r, p_s = _forward_sweep(x_base, Y + tile0, lse2, row_ok, n_rows, n_cand, n_reach, d_max,
                                   BMAX + tiles, MASS + tiles, GAP + gap0, GAP + gap0 + 2 * ostride, TJ, BLOCK_M)
    _reverse_sweep(x_base, row_ok, n_reach, GAP + gap0 + ostride, TJ, BLOCK_M)
    d0 = tl.maximum(n_cand, 1)
    n_diag = n_reach - d0
    j_s = tl.where(p_s == 0, 0, tl.where(p_s <= n_diag, d0 + p_s - 1, p_s - n_diag))
    r0 = h * 3 * n_ctx + rows
    _store_tstar(TSTEP + r0, TWHERE + r0, TNORM + r0, row_ok, t_f, t_f, n_cand, n_reach)
    r1 = r0 + n_ctx
    _store_tstar(TSTEP + r1, TWHERE + r1, TNORM + r1, row_ok, n_reach - 1 - t_r, t_r, n_cand, n_reach)
    r2 = r1 + n_ctx
    _store_tstar(TSTEP + r2, TWHERE + r2, TNORM + r2, row_ok, p_s, j_s, n_cand, n_reach)


@triton.jit
def _decode_kernel(Q, K, LSE, DX, DM, sq_h, sq_n, sk_h, sk_n, n_ctx, r_first, n_dec, group, qk_scale, n_kb,
                   HEAD_DIM: tl.constexpr, BN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Decode rows. Grid (Kb, ceil(R / BLOCK_R), H). DX [H, R, Kb] f32 each row's max score in key
    block j (natural units, -inf where the row sees none of it); DM [H, R, Kb] its softmax mass."""
    j = tl.program_id(0)
    h = tl.program_id(2).to(tl.int64)
    hk = (tl.program_id(2) // group).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = r_first + offs_r
    r_ok = offs_r < n_dec
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + h * sq_h + rows[:, None] * sq_n + offs_d[None, :], mask=r_ok[:, None], other=0.0)
    offs_n = tl.arange(0, BLOCK_N)
    keys = j * BN + offs_n
    kmask = (offs_n < BN) & (keys < n_ctx)
    kt = tl.load(K + hk * sk_h + keys[None, :] * sk_n + offs_d[:, None], mask=kmask[None, :], other=0.0)
    s = _dot(q, kt, None, PREC, UPCAST) * qk_scale
    s = tl.where(kmask[None, :] & (keys[None, :] <= rows[:, None]), s, float("-inf"))
    lse2 = tl.load(LSE + h * n_ctx + rows, mask=r_ok, other=0.0) * 1.4426950408889634
    out = (h * n_dec + offs_r) * n_kb + j
    tl.store(DX + out, tl.max(s, 1) * 0.6931471805599453, mask=r_ok)
    tl.store(DM + out, tl.sum(tl.math.exp2(s - lse2[:, None]), 1), mask=r_ok)


@dataclass
class ForwardResult:
    """What passes 1 and 2 return. out [1, H, N, D] (a [1, N, H, D] buffer seen transposed);
    lse, qinit_err [H, N] f32; with statistics also bmax, mass [H, P, Kb], gap [H, 3, P, Kb] and
    tstar_step (i64) / tstar_where (i8) / tstar_norm (f32) [H, 3, N], orders as geometry.ORDERS."""

    out: torch.Tensor
    lse: torch.Tensor
    qinit_err: torch.Tensor
    bmax: torch.Tensor | None = None
    mass: torch.Tensor | None = None
    gap: torch.Tensor | None = None
    tstar_step: torch.Tensor | None = None
    tstar_where: torch.Tensor | None = None
    tstar_norm: torch.Tensor | None = None


def tile_offsets(n: int, bm: int, bn: int, device) -> tuple[torch.Tensor, int]:
    """Start of query block i's tiles in the packed scratch ([P] i64 on device) and the count T of
    reachable tiles (tile (i, j) sits at offsets[i] + j)."""
    _, reach = block_counts(n, bm, bn)
    offsets = torch.zeros_like(reach)
    offsets[1:] = reach.cumsum(0)[:-1]
    return offsets.to(device), int(reach.sum())


def scratch_budget(device: torch.device) -> int:
    """Default bytes for the per-row tile scratch: 1/8 of the GPU's memory up to 4 GiB."""
    if device.type == "cuda":
        return min(4 << 30, torch.cuda.get_device_properties(device).total_memory // 8)
    return 256 << 20


def _launch(kind: str, d: int, launch: dict | None) -> tuple[int, int]:
    if launch and kind in launch:
        return tuple(launch[kind])
    if kind == "pass1":
        return PASS1_LAUNCH.get(d, (4, 2))
    return STATS_LAUNCH if kind == "stats" else DECODE_LAUNCH


def _stat_buffers(h: int, n: int, p: int, kb: int, device) -> dict:
    f32 = dict(dtype=torch.float32, device=device)
    return dict(bmax=torch.full((h, p, kb), NEG_INF, **f32), mass=torch.zeros((h, p, kb), **f32),
                gap=torch.full((h, 3, p, kb), NEG_INF, **f32),
                tstar_step=torch.empty((h, 3, n), dtype=torch.int64, device=device),
                tstar_where=torch.empty((h, 3, n), dtype=torch.int8, device=device),
                tstar_norm=torch.empty((h, 3, n), **f32))


def instrumented_forward(q, k, v, scale: float, cfg: StatsConfig, stats: bool = True,
                         scratch_bytes: int | None = None, launch: dict | None = None) -> ForwardResult:
    """Passes 1 and 2 (pass 1 alone with stats=False). q [1, H, N, D], k/v [1, Hkv, N, D].

    ``launch`` overrides (num_warps, num_stages) per kernel, {"pass1": (w, s), "stats": (w, s)},
    and the statistics pass's tiles per chunk, {"tile_chunk": TJ}.
    """
    _, h, hkv, n, d = check_inputs(q, k, v)
    if q.shape[0] != 1:
        raise ValueError("instrumented attention takes one sequence at a time (batch size 1)")
    bm, bn, dev = cfg.block_m, cfg.block_n, q.device
    p, kb = cdiv(n, bm), cdiv(n, bn)
    block_m, block_n = next_pow2(bm), next_pow2(bn)
    toff, num_tiles = tile_offsets(n, bm, bn, dev)
    krep = signed_absmax_keys(_pad_blocks(k[0], bn), bn)  # [Hkv, Kb, D]
    out = torch.empty((1, n, h, d), dtype=q.dtype, device=dev).transpose(1, 2)
    lse = torch.empty((h, n), dtype=torch.float32, device=dev)
    qerr = torch.empty((h, n), dtype=torch.float32, device=dev)
    res = ForwardResult(out, lse, qerr, **(_stat_buffers(h, n, p, kb, dev) if stats else {}))
    per_head = 2 * num_tiles * block_m * 4
    chunk = max(1, min(h, (scratch_bytes or scratch_budget(dev)) // per_head))
    chunk = cdiv(h, cdiv(h, chunk))
    xs = torch.empty((chunk, num_tiles, block_m), dtype=torch.float32, device=dev)
    ys = torch.empty_like(xs)
    prec, upcast = dot_flags(q.dtype)
    w1, s1 = _launch("pass1", d, launch)
    w2, s2 = _launch("stats", d, launch)
    qs, ks, vs, os_ = q[0].stride(), k[0].stride(), v[0].stride(), out[0].stride()
    for h0 in range(0, h, chunk):
        heads = min(chunk, h - h0)
        _instr_fwd_kernel[(p, heads)](
            q, k, v, krep, out, lse, qerr, xs, ys, toff, qs[0], qs[1], ks[0], ks[1], vs[0], vs[1],
            krep.stride(0), krep.stride(1), os_[0], os_[1], n, h0, h // hkv, num_tiles, scale * LOG2E,
            HEAD_DIM=d, BM=bm, BN=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=QINIT_CHUNK,
            EVEN_N=bn == block_n, PREC=prec, UPCAST=upcast, num_warps=w1, num_stages=s1)
        if stats:
            _tile_stats_kernel[(p, heads)](
                xs, ys, toff, lse, res.bmax, res.mass, res.gap, res.tstar_step, res.tstar_where,
                res.tstar_norm, n, h0, num_tiles, p, kb,
                BM=bm, BN=bn, BLOCK_M=block_m, TJ=(launch or {}).get("tile_chunk", TILE_CHUNK),
                num_warps=w2, num_stages=s2)
    return res


def decode_stats(q, k, lse: torch.Tensor, scale: float, cfg: StatsConfig, launch: dict | None = None):
    """Decode-mode statistics of the last R = min(cfg.decode_rows, N) rows, each its own block.

    q [1, H, N, D], k [1, Hkv, N, D], lse [H, N] (natural log, from pass 1). Returns (rows [R],
    gap [H, O, R, Kb] in cfg.orders, mass [H, R, Kb]) exactly as reference.decode_tiles defines them.
    """
    _, h, n, d = q.shape
    bn, orders, dev = cfg.block_n, cfg.orders, q.device
    kb = cdiv(n, bn)
    r_first = max(n - cfg.decode_rows, 0)
    n_dec = n - r_first
    rmax = torch.full((h, n_dec, kb), NEG_INF, dtype=torch.float32, device=dev)
    mass = torch.zeros((h, n_dec, kb), dtype=torch.float32, device=dev)
    if n_dec:
        block_r = min(64, next_pow2(n_dec))
        prec, upcast = dot_flags(q.dtype)
        warps, stages = _launch("decode", d, launch)
        _decode_kernel[(kb, cdiv(n_dec, block_r), h)](
            q, k, lse, rmax, mass, q.stride(1), q.stride(2), k.stride(1), k.stride(2), n, r_first, n_dec,
            h // k.shape[1], scale * LOG2E, kb, HEAD_DIM=d, BN=bn, BLOCK_N=next_pow2(bn), BLOCK_R=block_r,
            PREC=prec, UPCAST=upcast, num_warps=warps, num_stages=stages)
    gap = torch.full((h, len(orders), n_dec, kb), NEG_INF, dtype=torch.float32, device=dev)
    r = r_first
    while r < n:  # rows within one key block share their reachable blocks and scan orders
        r_end, nr = min(n, (r // bn + 1) * bn), r // bn + 1
        block = rmax[:, r - r_first: r_end - r_first, :nr]
        for o, order in enumerate(orders):
            g, _ = scan_rows(block, scan_order(order, num_candidates(r, 1, bn), nr), block.amax(dim=-1))
            gap[:, o, r - r_first: r_end - r_first, :nr] = g
        r = r_end
    return torch.arange(r_first, n, device=dev), gap, mass


def instrumented_attention_triton(q, k, v, scale: float, cfg: StatsConfig, scratch_bytes: int | None = None,
                                  launch: dict | None = None):
    """Drop-in for ``reference.instrumented_attention`` on the Triton kernels.

    q [1, H, N, D], k/v [1, Hkv, N, D] (fp16/bf16; fp32 accepted). Returns (out [1, H, N, D] in
    q.dtype, TileStats with the reference's fields, shapes and dtypes, orders as cfg.orders).
    """
    res = instrumented_forward(q, k, v, scale, cfg, True, scratch_bytes, launch)
    rows, dec_gap, dec_mass = decode_stats(q, k, res.lse, scale, cfg, launch)
    sel = [ORDERS.index(o) for o in cfg.orders]

    def pick(t):
        return t if sel == [0, 1, 2] else t[:, sel]

    stats = TileStats(res.bmax, pick(res.gap), res.mass, pick(res.tstar_step), pick(res.tstar_where),
                      pick(res.tstar_norm), res.qinit_err, dec_gap, dec_mass, rows)
    return res.out, stats
