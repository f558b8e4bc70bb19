"""Shared Triton jit helpers and host helpers of every kernel in sparsecal.kernels.

Host side: ``LOG2E``, ``log2_lambda`` (ln lambda in the kernels' log2 units), ``interpreting``,
``next_pow2``, ``dot_flags`` (exact fp32 products; bf16 upcast in the CPU interpreter),
``softcap_args`` (the SOFTCAP flag and cap of a launch), ``check_inputs`` (q [B, H, N, D], k/v
[B, Hkv, N, D]), ``check_fp32_tile`` (32-bit query tiles a GPU cannot hold) and
``LAST_COMPILED`` (the last launch's compiled kernel per name, for register/spill reports).

Device side (``@triton.jit``): ``dot``, ``soft_cap`` (Gemma 2's logit soft-capping, the one place
every kernel caps its scores), ``query_block`` (one query block's rows and Q tile), ``tile_qk``
(one key tile's scaled scores, masked), ``load_v``, ``softmax_update`` (one online softmax step),
``attend_range`` (a run of key tiles with optional statistics stores) and ``max_fn`` (a
reduction combiner).

Soft-capping: kernels take ``SOFTCAP: tl.constexpr`` and a runtime ``softcap`` (the cap in their
log2 units, ``softcap_args``). SOFTCAP off compiles exactly the uncapped kernel; on, every score
is capped elementwise right after the scale (before any mask, max, exponential or statistic), so
the unmasked tiles, which otherwise fold the scale into the exponent, hand on scaled scores.

Shape legend
    B batch    H query heads    Hkv key/value heads (H % Hkv == 0)    N sequence length
    D head dim (a power of two, 16..256)
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from sparsecal.formats.geometry import TRITON_HEAD_DIMS
from sparsecal.kernels.softcap import check_softcap

LOG2E = 1.4426950408889634


def log2_lambda(log_lambda: float) -> float:
    """ln(lambda) in the kernels' log2 units (-inf, lambda = 0, stays -inf)."""
    return log_lambda * LOG2E if math.isfinite(log_lambda) else log_lambda
LN2 = 0.6931471805599453


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(x: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, int(x) - 1).bit_length())


def dot_flags(dtype: torch.dtype) -> tuple:
    """(PREC, UPCAST) constexprs for ``dot``: exact fp32 products for fp32 inputs; the CPU
    interpreter multiplies bf16 tiles wrongly, so there they are upcast (same values)."""
    prec = "ieee" if dtype == torch.float32 else None
    return prec, interpreting() and dtype == torch.bfloat16


def softcap_args(softcap) -> tuple[bool, float]:
    """(SOFTCAP, softcap) launch arguments for a cap c on the natural-log scores (0 / None: off):
    c * tanh(s / c) in natural units is (c * log2 e) * tanh(s2 / (c * log2 e)) in the kernels' log2
    units s2 = s * log2 e, so the kernels get the cap times log2 e (0.0 when off)."""
    cap = check_softcap(softcap)
    return cap > 0.0, cap * LOG2E


FP32_QBLOCK_LIMIT = 128 * 128  # query-block rows x head dim of 32-bit inputs the GPU kernels hold


def fp32_tile_too_large(dtype: torch.dtype, device_type: str, block_m: int, d: int) -> bool:
    """True when 32-bit inputs make a BLOCK_M x D query tile too large for a GPU kernel's shared
    memory (compiled for sm_90 with Triton 3.6, the instrumented pass 1 needs 289 KiB at 128 x 256
    f32, an H100 has 227 KiB; 64 x 256 and 128 x 128 fit). Only on a CUDA device: the CPU
    interpreter has no such limit."""
    return dtype == torch.float32 and device_type == "cuda" and next_pow2(block_m) * d > FP32_QBLOCK_LIMIT


def check_fp32_tile(q: torch.Tensor, block_m: int, what: str) -> None:
    """ValueError where ``fp32_tile_too_large`` (q [..., D]; the kernel's query blocks of block_m rows)."""
    d = q.shape[-1]
    if fp32_tile_too_large(q.dtype, q.device.type, block_m, d):
        raise ValueError(f"{what}: float32 inputs with head dim {d} and {block_m}-row query blocks need more "
                         f"shared memory than the GPU has; pass bfloat16/float16 inputs or use the plain-torch "
                         f"reference")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Validate q [B, H, N, D], k/v [B, Hkv, N, D]; returns (B, H, Hkv, N, D)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q [B,H,N,D] and k, v [B,Hkv,N,D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, n, d = q.shape
    if k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} (causal self-attention)")
    if h % k.shape[1]:
        raise ValueError(f"{h} query heads are not a multiple of {k.shape[1]} KV heads")
    if d not in TRITON_HEAD_DIMS:
        raise ValueError(f"head dim {d} is not supported by the Triton kernels (powers of two 16..256)")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of float16/bfloat16/float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head-dim) axis")
    return b, h, k.shape[1], n, d


@triton.jit
def dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in fp32 (acc may be None)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x / cap), elementwise, in x's units (cap in the same units; > 0).

    tanh y = 1 - 2 / (exp(2y) + 1), with exp through exp2 (portable: the GPU, Triton's CPU
    interpreter, every Triton version): exp2 overflowing to +inf gives +cap and underflowing to
    0 gives -cap, no inf / nan. Near 0 the absolute error is a few ulps of cap. Cap before masking:
    -inf maps to -cap."""
    return cap - (2.0 * cap) / (tl.math.exp2(x * (2.8853900817779268 / cap)) + 1.0)


@triton.jit
def query_block(Q, sq_h, sq_n, group, n_ctx, HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """The query block of a grid (P, H) program (heaviest blocks first): (i, h, hk, rows [BLOCK_M],
    row_ok [BLOCK_M], offs_d [D], q [BLOCK_M, D] (zeros on invalid rows), A_i, reachable blocks)."""
    i = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    hk = (tl.program_id(1) // group).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = i * BM + offs_m
    row_ok = (offs_m < BM) & (rows < n_ctx)
    q = tl.load(Q + h * sq_h + rows[:, None] * sq_n + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    n_reach = (tl.minimum((i + 1) * BM, n_ctx) - 1) // BN + 1
    return i, h, hk, rows, row_ok, offs_d, q, (i * BM) // BN, n_reach


@triton.jit
def tile_qk(q, k_ptr, stride_kn, rows, offs_d, j, n_ctx, qk_scale, softcap, BN: tl.constexpr, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Key block j against the query block: (qk [BLOCK_M, BLOCK_N], m_ij [BLOCK_M], keys, kmask
    [BLOCK_N]). MASKED (diagonal or ragged blocks): qk scaled (log2 units) and -inf where a key is
    past the block, the sequence or the row (m_ij -inf where a row sees nothing); otherwise every
    key is visible and qk is unscaled (the exponent folds the scale in), unless SOFTCAP. SOFTCAP:
    qk scaled and capped (soft_cap, cap ``softcap`` in log2 units) in every tile. So qk is scaled
    exactly when MASKED or SOFTCAP (what softmax_update's SCALED says); m_ij is always scaled."""
    offs_n = tl.arange(0, BLOCK_N)
    keys = j * BN + offs_n
    kmask = (offs_n < BN) & (keys < n_ctx)
    if MASKED:
        kt = tl.load(k_ptr + keys[None, :] * stride_kn + offs_d[:, None], mask=kmask[None, :], other=0.0)
        qk = dot(q, kt, None, PREC, UPCAST)
        vis = kmask[None, :] & (keys[None, :] <= rows[:, None])
        s = qk * qk_scale
        if SOFTCAP:
            s = soft_cap(s, softcap)
        qk = tl.where(vis, s, float("-inf"))
        m_ij = tl.max(qk, 1)
    else:
        kt = tl.load(k_ptr + keys[None, :] * stride_kn + offs_d[:, None])
        qk = dot(q, kt, None, PREC, UPCAST)
        if SOFTCAP:
            qk = soft_cap(qk * qk_scale, softcap)
            m_ij = tl.max(qk, 1)
        else:
            m_ij = tl.max(qk, 1) * qk_scale
    return qk, m_ij, keys, kmask


@triton.jit
def load_v(v_ptr, keys, kmask, stride_vn, offs_d, MASKED: tl.constexpr):
    """V rows ``keys`` [BLOCK_N, D] (zeros where kmask is off, only when MASKED)."""
    if MASKED:
        return tl.load(v_ptr + keys[:, None] * stride_vn + offs_d[None, :], mask=kmask[:, None], other=0.0)
    return tl.load(v_ptr + keys[:, None] * stride_vn + offs_d[None, :])


@triton.jit
def softmax_update(acc, l_i, m_i, m_new, qk, v, qk_scale, SCALED: tl.constexpr, PREC: tl.constexpr,
                    UPCAST: tl.constexpr):
    """Online-softmax step of one key tile: (acc, l_i) rescaled to the new running max m_new and
    the tile's P.V added. qk [BLOCK_M, BLOCK_N] are scaled scores (log2 units, -inf where masked)
    when SCALED (tile_qk's MASKED or SOFTCAP), else unscaled; a SCALED tile may leave a row with
    nothing seen (m_new = -inf)."""
    if SCALED:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_ref[:, None])
    else:
        m_ref = m_new
        p = tl.math.exp2(qk * qk_scale - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = dot(p.to(v.dtype), v, acc * alpha[:, None], PREC, UPCAST)
    return acc, l_i


@triton.jit
def attend_range(acc, l_i, m_i, q, k_ptr, v_ptr, stride_kn, stride_vn, rows, offs_d, j_lo, j_hi,
                  n_ctx, qk_scale, softcap, xy_ptr,
                  BN: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, STATS: tl.constexpr,
                  EVICT: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Online-softmax update of one query block over key blocks j_lo .. j_hi-1, ascending.

    acc [BLOCK_M, D] f32 unnormalized output; l_i, m_i [BLOCK_M] f32 running sum and max (log2
    units); q [BLOCK_M, D]; rows [BLOCK_M] query row indices; key block j covers keys j*BN + [0, BN).
    MASKED: apply the causal, length and block-width mask (diagonal or ragged blocks); otherwise
    every key of the block is visible to every row and nothing is checked.
    SOFTCAP: every scaled score capped (soft_cap, ``softcap`` in log2 units) before anything else.
    STATS: store each row's block max and block log-sum-exp (log2 units, -inf where the row sees
    nothing) as a pair at xy_ptr + j*2*BLOCK_M (xy_ptr [BLOCK_M, 2] pointers: row r, then 0 for
    the max, 1 for the log-sum-exp). One paired store costs one layout change through shared
    memory instead of two; EVICT marks it evict-first.
    """
    offs_n = tl.arange(0, BLOCK_N)
    for j in range(j_lo, j_hi):
        keys = j * BN + offs_n
        if MASKED:
            kmask = (offs_n < BN) & (keys < n_ctx)
            kt = tl.load(k_ptr + keys[None, :] * stride_kn + offs_d[:, None], mask=kmask[None, :], other=0.0)
            v = tl.load(v_ptr + keys[:, None] * stride_vn + offs_d[None, :], mask=kmask[:, None], other=0.0)
            qk = dot(q, kt, None, PREC, UPCAST)
            vis = kmask[None, :] & (keys[None, :] <= rows[:, None])
            s = qk * qk_scale
            if SOFTCAP:
                s = soft_cap(s, softcap)
            qk = tl.where(vis, s, float("-inf"))
            m_ij = tl.max(qk, 1)
            m_new = tl.maximum(m_i, m_ij)
            p = tl.math.exp2(qk - m_new[:, None])
        else:
            kt = tl.load(k_ptr + keys[None, :] * stride_kn + offs_d[:, None])
            v = tl.load(v_ptr + keys[:, None] * stride_vn + offs_d[None, :])
            qk = dot(q, kt, None, PREC, UPCAST)
            if SOFTCAP:  # capped elementwise: the scale cannot be folded into the exponent
                qk = soft_cap(qk * qk_scale, softcap)
                m_ij = tl.max(qk, 1)
                m_new = tl.maximum(m_i, m_ij)
                p = tl.math.exp2(qk - m_new[:, None])
            else:
                m_ij = tl.max(qk, 1) * qk_scale
                m_new = tl.maximum(m_i, m_ij)
                p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        l_ij = tl.sum(p, 1)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + l_ij
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], PREC, UPCAST)
        if STATS:
            xy = tl.join(m_ij, m_new + tl.math.log2(l_ij))
            if EVICT:
                tl.store(xy_ptr + j * (2 * rows.shape[0]), xy, eviction_policy="evict_first")
            else:
                tl.store(xy_ptr + j * (2 * rows.shape[0]), xy)
        m_i = m_new
    return acc, l_i, m_i


LAST_COMPILED: dict = {}  # kernel name -> the last launch's compiled kernel (n_regs, n_spills)


@triton.jit
def max_fn(a, b):
    return tl.maximum(a, b)
