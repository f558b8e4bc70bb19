"""Dense causal flash-attention forward in Triton: the project's own baseline kernel.

One program owns one query block of one (batch, query head) and walks the key blocks in ascending
order with an online softmax (base-2 exponentials, the softmax scale folded into ``qk_scale``).
The key blocks split into two loops: candidates that every row sees fully (no mask, no bounds
checks) and the diagonal blocks (causal + length mask). GQA is native: query head h reads KV head
h // (H // Hkv); K/V are never copied. Any N works (the ragged last blocks are masked). With
``softcap`` c > 0 every scaled score s becomes c * tanh(s / c) first (Gemma 2; jit.soft_cap; the
uncapped kernel is compiled unchanged). Its plain-torch reference is
``dense_reference.attention_reference``.

Shape legend
    B batch    H query heads    Hkv key/value heads (H % Hkv == 0)    N sequence length
    D head dim (a power of two, 16..256)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsecal.kernels.jit import (
    LAST_COMPILED,
    LOG2E,
    attend_range,
    check_inputs,
    dot_flags,
    interpreting,
    softcap_args,
)


@triton.jit
def _dense_fwd_kernel(Q, K, V, O, LSE,
                      sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n,
                      n_ctx, num_heads, group, qk_scale, softcap,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (ceil(N / BLOCK_M), B * H). O [B, H, N, D] (any strides, last axis contiguous); LSE
    [B, H, N] f32, natural log. The heaviest query blocks (most key blocks) start first."""
    i = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = bh % num_heads
    hk = (h // group).to(tl.int64)
    h = h.to(tl.int64)
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < n_ctx
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_n + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_ptr = K + b * sk_b + hk * sk_h
    v_ptr = V + b * sv_b + hk * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_cand = (i * BLOCK_M) // BLOCK_N
    n_reach = (tl.minimum((i + 1) * BLOCK_M, n_ctx) - 1) // BLOCK_N + 1
    acc, l_i, m_i = attend_range(acc, l_i, m_i, q, k_ptr, v_ptr, sk_n, sv_n, rows, offs_d, 0, n_cand,
                                  n_ctx, qk_scale, softcap, LSE, BLOCK_N, BLOCK_N, False, False, False, SOFTCAP,
                                  PREC, UPCAST)
    acc, l_i, m_i = attend_range(acc, l_i, m_i, q, k_ptr, v_ptr, sk_n, sv_n, rows, offs_d, n_cand, n_reach,
                                  n_ctx, qk_scale, softcap, LSE, BLOCK_N, BLOCK_N, True, False, False, SOFTCAP,
                                  PREC, UPCAST)
    out = acc / l_i[:, None]
    o_ptr = O + b * so_b + h * so_h + rows[:, None] * so_n + offs_d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * n_ctx + rows, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim on a CUDA GPU; tuned on an H100 by
# sparsecal.bench.capture_instrumented (see data/bench/NOTES.md). The interpreter ignores warps/stages.
# D = 256 (not yet timed): K and V tiles of 64 x 256 16-bit values are 32 KiB each; two stages take
# 160 KiB of shared memory (compiled for sm_90 with Triton 3.6; an H100 has 227 KiB); 8 warps halve
# the [64, 256] f32 accumulator's registers per thread.
DENSE_CONFIGS = {64: (128, 64, 8, 3), 128: (128, 128, 8, 3), 256: (64, 64, 8, 2)}
# 32-bit inputs double every tile (and fp32's FMA products need more layout scratch): the 16-bit
# D = 128 config needs 384 KiB with them (compiled for sm_90 with Triton 3.6 and 3.9), so D >= 128
# takes smaller tiles: 112 KiB at D = 128, 96 KiB at D = 256 (one stage).
DENSE_CONFIGS_32BIT = {128: (64, 64, 4, 2), 256: (32, 32, 4, 1)}


def gpu_config(d: int, dtype: torch.dtype) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) on a CUDA GPU for head dim d and the input dtype."""
    if dtype == torch.float32 and d in DENSE_CONFIGS_32BIT:
        return DENSE_CONFIGS_32BIT[d]
    return DENSE_CONFIGS.get(d, (64, 64, 4, 2))


def dense_config(d: int, config: tuple | None = None, dtype: torch.dtype = torch.bfloat16) -> tuple:
    if config is not None:
        return tuple(config)
    if interpreting():
        return (32, 16, 4, 1)
    return gpu_config(d, dtype)


def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    config: tuple | None = None, out: torch.Tensor | None = None, *, softcap: float = 0.0):
    """Causal attention. q [B, H, N, D], k/v [B, Hkv, N, D] (fp16/bf16; fp32 accepted).

    Returns (out [B, H, N, D] in q.dtype, lse [B, H, N] f32 natural-log log-sum-exp of each row's
    scaled (capped) scores). ``config`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the
    tuned default; ``out`` may be given (any strides with a contiguous last axis), e.g. a
    [B, N, H, D] buffer seen through ``.transpose(1, 2)``. ``softcap``: the cap c of c * tanh(s / c)
    on every scaled score (0 or None: off).
    """
    b, h, hkv, n, d = check_inputs(q, k, v)
    cap_on, cap = softcap_args(softcap)
    scale = d ** -0.5 if scale is None else float(scale)
    block_m, block_n, warps, stages = dense_config(d, config, q.dtype)
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    prec, upcast = dot_flags(q.dtype)
    grid = (triton.cdiv(n, block_m), b * h)
    LAST_COMPILED["dense"] = _dense_fwd_kernel[grid](
        q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], n, h, h // hkv,
        scale * LOG2E, cap, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, SOFTCAP=cap_on, PREC=prec, UPCAST=upcast,
        num_warps=warps, num_stages=stages)
    return out, lse


def flops_causal(b: int, h: int, n: int, d: int) -> float:
    """FLOPs of causal attention forward as GPU.md counts them: 2 * 2 * B * H * N^2 * D / 2."""
    return 2.0 * b * h * n * n * d
