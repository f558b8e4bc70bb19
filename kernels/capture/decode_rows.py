"""Decode rows of the Triton capture: each of the last R rows is a query block of its own (BM = 1).

``decode_forward`` runs ``_decode_kernel`` (each row's max score and mass in every key block) and
``tilestats.decode_stats_kernel`` (the three orders' gaps and, fused, their histograms), as
``reference.decode_tiles`` defines them (``softcap``: on the capped scores).

Shape legend
    H query heads   Hkv KV heads   N length   D head dim   R decode rows   Kb = ceil(N/BN)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsecal.formats.geometry import cdiv
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.common import NEG_INF, edge_args
from sparsecal.kernels.capture.tilestats import HistLayout, decode_stats_kernel
from sparsecal.kernels.jit import LOG2E, dot, dot_flags, next_pow2, soft_cap, softcap_args

DECODE_LAUNCH = (4, 1)


@triton.jit
def _decode_kernel(Q, K, LSE, DX, DM, sq_h, sq_n, sk_h, sk_n, n_ctx, r_first, n_dec, group, qk_scale, softcap, n_kb,
                   HEAD_DIM: tl.constexpr, BN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Decode rows. Grid (Kb, ceil(R / BLOCK_R), H). DX [H, R, Kb] f32 each row's max score in key
    block j (natural units, -inf where the row sees none of it); DM [H, R, Kb] its softmax mass.
    SOFTCAP: scores capped at ``softcap`` (log2 units) first."""
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
    s = dot(q, kt, None, PREC, UPCAST) * qk_scale
    if SOFTCAP:
        s = soft_cap(s, softcap)
    s = tl.where(kmask[None, :] & (keys[None, :] <= rows[:, None]), s, float("-inf"))
    lse2 = tl.load(LSE + h * n_ctx + rows, mask=r_ok, other=0.0) * 1.4426950408889634
    out = (h * n_dec + offs_r) * n_kb + j
    tl.store(DX + out, tl.max(s, 1) * 0.6931471805599453, mask=r_ok)
    tl.store(DM + out, tl.sum(tl.math.exp2(s - lse2[:, None]), 1), mask=r_ok)


def decode_forward(q, k, lse: torch.Tensor, scale: float, cfg: StatsConfig, launch: dict | None = None,
                   fused: bool = False, *, softcap: float = 0.0):
    """Decode-mode statistics of the last R = min(cfg.decode_rows, N) rows, each its own block.

    q [1, H, N, D], k [1, Hkv, N, D], lse [H, N] (natural log, from pass 1 with the same softcap:
    the cap c of c * tanh(s / c) on every scaled score, 0 or None off). Returns (rows [R],
    gap [H, 3, R, Kb] in geometry.ORDERS, mass [H, R, Kb], with fused the gap histograms of the
    candidate and the diagonal tiles [H, W] (HistLayout) else None, rmax [H, R, Kb] each row's max
    score per key block) as reference.decode_tiles defines them.
    """
    _, h, n, d = q.shape
    cap_on, cap = softcap_args(softcap)
    bn, dev = cfg.block_n, q.device
    kb = cdiv(n, bn)
    r_first = max(n - cfg.decode_rows, 0)
    n_dec = n - r_first
    f32 = dict(dtype=torch.float32, device=dev)
    rmax = torch.full((h, n_dec, kb), NEG_INF, **f32)
    mass = torch.zeros((h, n_dec, kb), **f32)
    gap = torch.full((h, 3, n_dec, kb), NEG_INF, **f32)
    lay = HistLayout.of(cfg)
    part = torch.zeros((h, lay.offsets["width"]), **f32) if fused else None
    if n_dec:
        block_r = min(64, next_pow2(n_dec))
        prec, upcast = dot_flags(q.dtype)
        warps, stages = (launch or {}).get("decode", DECODE_LAUNCH)
        _decode_kernel[(kb, cdiv(n_dec, block_r), h)](
            q, k, lse, rmax, mass, q.stride(1), q.stride(2), k.stride(1), k.stride(2), n, r_first, n_dec,
            h // k.shape[1], scale * LOG2E, cap, kb, HEAD_DIM=d, BN=bn, BLOCK_N=next_pow2(bn), BLOCK_R=block_r,
            SOFTCAP=cap_on, PREC=prec, UPCAST=upcast, num_warps=warps, num_stages=stages)
        ge, _, g_lo, g_inv, n_ge = edge_args(cfg, dev)[:5]
        decode_stats_kernel[(cdiv(n_dec, 16), h)](
            rmax, mass, gap, part if fused else gap, ge, r_first, n_dec, kb, g_lo, g_inv, n_ge,
            BN=bn, ROWS=16, TJ=32, W=lay.offsets["width"], NBP=lay.nbp, HIST=fused,
            OFF_DG=lay.offsets["diag_gap_count"], num_warps=4, num_stages=1)
    return torch.arange(r_first, n, device=dev), gap, mass, part, rmax
