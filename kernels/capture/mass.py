"""Block mass in Triton: the second pass of the single-order capture, reusing the log-sum-exp.

    mass[h, i, j] = (1 / rows of block i) * sum over valid rows r of block i
                    sum over keys t of block j visible to r of exp(S[r, t] - lse[r])

with S = softmax_scale * q.k and lse the rows' final log-sum-exp (natural log) from the forward
pass (kernels/capture/forward_stats.py or instrumented.py pass 1): exactly
reference.instrumented_attention's TileStats.mass (mean over the block's rows of the softmax
probability in the tile). One program per query block and head (grid P x H, heaviest blocks
first) walks its reachable key blocks once: a QK^T product, one exponential a score and one
cross-row sum a tile; no P.V product, no N x N tensor. GQA is native (head h reads KV head
h // (H / Hkv)); unreachable tiles stay 0. With ``softcap`` S is the capped score
(jit.soft_cap) and lse the capped forward's.

Shape legend
    H query heads   Hkv KV heads   N length   D head dim   P = ceil(N/BM)   Kb = ceil(N/BN)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsecal.formats.geometry import cdiv
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.jit import (
    LAST_COMPILED,
    LOG2E,
    check_fp32_tile,
    check_inputs,
    dot_flags,
    next_pow2,
    query_block,
    softcap_args,
    tile_qk,
)

# (num_warps, num_stages) per head dim on a CUDA GPU (a guess before the H100 sweep of
# sparsecal.bench.capture_single_order; the interpreter ignores them).
# 64/128: best of the H100 mass sweep (triton-capture-single-order-h100.json). D = 256 (not yet
# timed): 128 KiB of shared memory compiled for sm_90 with Triton 3.6; 8 warps for the Q operand.
LAUNCH = {64: (4, 3), 128: (4, 2), 256: (8, 2)}


@triton.jit
def _mass_range(q, k_ptr, stride_kn, rows, lse2, offs_d, j_lo, j_hi, n_ctx, qk_scale, softcap, inv_rows, mass_ptr,
                BN: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
                PREC: tl.constexpr, UPCAST: tl.constexpr):
    """mass_ptr + j <- inv_rows * sum of exp2(scores - lse2) over tile j, for j_lo <= j < j_hi.
    lse2 [BLOCK_M] log2-unit log-sum-exp (+inf on invalid rows, so they add 0). MASKED: causal,
    length and block-width mask (diagonal or ragged blocks); otherwise every key is visible.
    SOFTCAP: scores capped at ``softcap`` (log2 units), as in jit.tile_qk."""
    for j in range(j_lo, j_hi):
        qk, _, _, _ = tile_qk(q, k_ptr, stride_kn, rows, offs_d, j, n_ctx, qk_scale, softcap, BN, BLOCK_N, MASKED,
                              SOFTCAP, PREC, UPCAST)
        if MASKED or SOFTCAP:  # scaled (and -inf where masked: exp2 gives 0 there)
            p = tl.math.exp2(qk - lse2[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        tl.store(mass_ptr + j, tl.sum(tl.sum(p, 1), 0) * inv_rows)


@triton.jit
def _mass_kernel(Q, K, LSE, MASS, sq_h, sq_n, sk_h, sk_n, n_ctx, group, n_qb, n_kb, qk_scale, softcap,
                 HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Grid (P, H). LSE [H, N] f32 natural log; MASS [H, P, Kb] f32 (reachable tiles written)."""
    i, h, hk, rows, row_ok, offs_d, q, n_cand, n_reach = query_block(Q, sq_h, sq_n, group, n_ctx, HEAD_DIM, BM,
                                                                     BN, BLOCK_M)
    lse2 = tl.load(LSE + h * n_ctx + rows, mask=row_ok, other=float("inf")) * 1.4426950408889634
    inv_rows = 1.0 / (tl.minimum((i + 1) * BM, n_ctx) - i * BM).to(tl.float32)
    k_ptr = K + hk * sk_h
    mass_ptr = MASS + (h * n_qb + i) * n_kb
    _mass_range(q, k_ptr, sk_n, rows, lse2, offs_d, 0, n_cand, n_ctx, qk_scale, softcap, inv_rows, mass_ptr,
                BN, BLOCK_N, not EVEN_N, SOFTCAP, PREC, UPCAST)
    _mass_range(q, k_ptr, sk_n, rows, lse2, offs_d, n_cand, n_reach, n_ctx, qk_scale, softcap, inv_rows, mass_ptr,
                BN, BLOCK_N, True, SOFTCAP, PREC, UPCAST)


def block_mass_triton(q, k, lse: torch.Tensor, scale: float, cfg: StatsConfig,
                      launch: tuple | None = None, *, softcap: float = 0.0) -> torch.Tensor:
    """Tile mass from the final log-sum-exp. q [1, H, N, D], k [1, Hkv, N, D] (fp16/bf16/fp32),
    lse [H, N] f32 natural log (the forward's, with the same softcap: the cap c of c * tanh(s / c)
    on every scaled score, 0 or None off). Returns mass [H, P, Kb] f32 (0 where unreachable),
    reference.instrumented_attention's TileStats.mass. launch (num_warps, num_stages) overrides
    LAUNCH."""
    _, h, hkv, n, d = check_inputs(q, k, k)
    check_fp32_tile(q, cfg.block_m, "the Triton mass pass")
    cap_on, cap = softcap_args(softcap)
    if q.shape[0] != 1:
        raise ValueError("the mass pass takes one sequence at a time (batch size 1)")
    if lse.shape != (h, n) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be [H, N] = [{h}, {n}] float32, got {tuple(lse.shape)} {lse.dtype}")
    bm, bn = cfg.block_m, cfg.block_n
    p, kb = cdiv(n, bm), cdiv(n, bn)
    lse = lse.contiguous()
    mass = torch.zeros((h, p, kb), dtype=torch.float32, device=q.device)
    prec, upcast = dot_flags(q.dtype)
    warps, stages = launch or LAUNCH.get(d, (4, 2))
    LAST_COMPILED["mass"] = _mass_kernel[(p, h)](
        q, k, lse, mass, q.stride(1), q.stride(2), k.stride(1), k.stride(2), n, h // hkv, p, kb, scale * LOG2E, cap,
        HEAD_DIM=d, BM=bm, BN=bn, BLOCK_M=next_pow2(bm), BLOCK_N=next_pow2(bn), EVEN_N=bn == next_pow2(bn),
        SOFTCAP=cap_on, PREC=prec, UPCAST=upcast, num_warps=warps, num_stages=stages)
    return mass
