"""Block-sparse causal prefill for Hopper GPUs in Gluon: TMA-fed K/V ring, async wgmma, and a
per-tile BSFA / BLASST-forward / window decision that costs no pipelining.

Same semantics as ``reference.sparse_attention`` and its Triton twin ``prefill.sparse_attention_triton``
(which the CPU tests run under the interpreter; Gluon does not run there): query block i (BM rows)
always computes its diagonal key blocks; a candidate key block j < A_i is skipped when

    BSFA     max over the tile's scores                      <  thresholds[h, min(i, Pt - 1)]
    BLASST   max over rows of (tile row max - running max)   <  ln(lambda)   (forward order)
    window   j < A_i - W

Why a second kernel: in the Triton kernel the data-dependent ``if`` around P.V stops Triton 3.6's
software pipeliner, so the K/V loads of the next tiles wait for the decision (data/bench/NOTES.md,
issue 5 and the count-only runs). Here the pipeline is written out: a ring of NBUF shared-memory
slots is filled by TMA copies issued NBUF - 1 tiles ahead, for every tile, whatever the decisions;
a skipped tile only gives its slot back. The decision itself is one vote a warp (``_warp_any``, a
``vote.any`` over the rows the warp holds) and one shared-memory exchange of the warps' votes per tile
(``_vote_decide``; NOTES.md "the decision by warp votes": 1-10 % faster than a cross-warp max).

Rejected after measuring (NOTES.md): issuing the next tile's Q.K^T before this tile's decision
(FA3's intra-warpgroup overlap) needs two score tiles in registers (160-175 a thread at D = 128, one
program per SM) and ptxas serializes the async wgmma around the loop-carried accumulator: 1.2-1.5x
slower than this form at every shape.

One program owns one query block of one (batch, head): BM = 128 rows over ``num_warps`` = 8 warps
(two warpgroups of 64 rows each issue wgmma), key tiles of BN rows. Q, K, V are read through
3-D TMA descriptors (see ``_tma_view``); the output is stored from registers.

Limits (the Triton kernel runs everything else; ``gluon_supported`` says which): a CUDA device
of compute capability 9.x, fp16/bf16, head dim 64 or 128, BM = 128, BN in {64, 128}, no softcap,
BLASST in the forward order only.

Shape legend
    B batch   H query heads   Hkv KV heads   N tokens   D head dim   P = ceil(N/BM) query blocks
    Pt threshold positions   A = A_i candidate key blocks of block i   NBUF ring slots
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from sparsecal.kernels.jit import LAST_COMPILED, LOG2E, log2_lambda
from sparsecal.kernels.sparse.prefill import _check_args

NUM_WARPS = 8
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # renamed in Triton 3.9
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # named thread_barrier in Triton 3.6, barrier in 3.9
# Ring slots per head dim. Two slots keep a program at 98 KiB of shared memory and 128 registers a
# thread at D = 128 (compiled for sm_90, Triton 3.6), so two programs share an SM and one's decision
# overlaps the other's tensor-core work; three slots (1 program per SM) ran 1.2x slower on an H100
# (data/bench/prefill-gluon-h100-*.json, NOTES.md).
NBUF = {64: 2, 128: 2}


def gluon_supported(q: torch.Tensor, block_m: int, block_n: int, method: int, order: str, softcap) -> bool:
    """True when the Gluon kernel runs this call (else the Triton kernel does)."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128) and block_m == 128
            and block_n in (64, 128) and not softcap and (method != 2 or order == "forward"))


def _tma_view(t: torch.Tensor, rows: int):
    """(3-D view, heads-in-rows flag) of t [B, H, N, D] that a TMA descriptor with block [1, rows, D]
    can address: [B * H, N, D] (coordinates (b * H + h, n, 0)) when the heads merge with the batch,
    else [B, N, H * D] (coordinates (b, n, h * D)) when a token's heads are adjacent (the
    [B, N, H, D] storage transformers' attention hands over), else a contiguous copy."""
    b, h, n, d = t.shape
    if t.stride(0) == h * t.stride(1) and t.stride(2) == d:
        return t.as_strided((b * h, n, d), (t.stride(1), d, 1)), True
    if t.stride(1) == d and t.stride(2) == h * d:
        return t.as_strided((b, n, h * d), (t.stride(0), h * d, 1)), False
    return _tma_view(t.contiguous(), rows)


def _descriptor(t: torch.Tensor, rows: int):
    view, heads_in_rows = _tma_view(t, rows)
    d = t.shape[-1]
    gdt = gl.float16 if t.dtype == torch.float16 else gl.bfloat16
    layout = gl.NVMMASharedLayout.get_default_for([1, rows, d], gdt)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [1, rows, d], layout), heads_in_rows


@gluon.jit
def _coords(b, h, n0, HEADS_IN_ROWS: gl.constexpr, num_heads, HEAD_DIM: gl.constexpr):
    """TMA coordinates of rows n0.. of head h of batch b (see _tma_view)."""
    if HEADS_IN_ROWS:
        return [b * num_heads + h, n0, 0]
    else:
        return [b, n0, h * HEAD_DIM]


@gluon.jit
def _issue(k_desc, v_desc, k_ring, v_ring, k_bar, v_bar, t, j, b, hk, num_kv, KV_ROWS: gl.constexpr,
           HEAD_DIM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr):
    """TMA copies of key/value tile j into ring slot t % NBUF (t: the tile's ordinal in this program)."""
    slot = t % NBUF
    c = _coords(b, hk, j * BN, KV_ROWS, num_kv, HEAD_DIM)
    mbarrier.expect(k_bar.index(slot), k_desc.block_type.nbytes)
    _tma_load(k_desc, c, k_bar.index(slot), k_ring.index(slot))
    mbarrier.expect(v_bar.index(slot), v_desc.block_type.nbytes)
    _tma_load(v_desc, c, v_bar.index(slot), v_ring.index(slot))


@gluon.jit
def _refill(k_desc, v_desc, k_ring, v_ring, k_bar, v_bar, t, j, t_end, b, hk, num_kv, KV_ROWS: gl.constexpr,
            HEAD_DIM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr):
    """At tile j (ordinal t), once every warp is done with tile t - 1: copy tile j + NBUF - 1 into its slot."""
    if t + NBUF - 1 < t_end:
        _issue(k_desc, v_desc, k_ring, v_ring, k_bar, v_bar, t + NBUF - 1, j + NBUF - 1, b, hk, num_kv, KV_ROWS,
               HEAD_DIM, BN, NBUF)


@gluon.jit
def _scores(s, j, rows, n_ctx, qk_scale, MASKED: gl.constexpr, BN: gl.constexpr, s_layout: gl.constexpr):
    """(s, m_ij) of key tile j: when MASKED (the diagonal, keys past N) s is masked and scaled to
    log2 units, else left raw (scaled where it is used); m_ij [rows] its row maxima in log2 units."""
    if MASKED:
        keys = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        vis = (keys[None, :] <= rows[:, None]) & (keys[None, :] < n_ctx)
        s = gl.where(vis, s * qk_scale, float("-inf"))
        m_ij = gl.max(s, 1)
    else:
        m_ij = gl.max(s, 1) * qk_scale
    return s, m_ij


@gluon.jit
def _qk(q_smem, k_tile, ROWS: gl.constexpr, BN: gl.constexpr, s_layout: gl.constexpr):
    """S [ROWS, BN] f32 = Q.K^T of q_smem [ROWS, D] and k_tile [BN, D] (shared memory) by wgmma, waited for."""
    return warpgroup_mma_wait(0, deps=(_qk_start(q_smem, k_tile, ROWS, BN, s_layout),))


@gluon.jit
def _qk_start(q_smem, k_tile, ROWS: gl.constexpr, BN: gl.constexpr, s_layout: gl.constexpr):
    """``_qk`` without the wait: S of the wgmma still in flight (the caller waits before it reads S)."""
    zero = gl.zeros([ROWS, BN], gl.float32, s_layout)
    return warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _decided_vals(m_ij, m_new, row_ok, DECIDE: gl.constexpr):
    """The per-row value a tile's decision takes the max of over the block's rows (m_ij the row
    maxima, m_new the running maxima after the tile, both log2 units; DECIDE 1 BSFA: the row max, 2
    BLASST: row max - running max, 0 where the tile raises it), -inf for rows past N (row_ok false)."""
    if DECIDE == 1:
        vals = m_ij
    else:
        vals = gl.where(m_ij >= m_new, 0.0, m_ij - m_new)
    return gl.where(row_ok, vals, float("-inf"))


@triton.constexpr_function
def _thread_any(n):
    """PTX that sets predicate p when one of the n i32 (0 / 1) inputs $n .. $2n-1 of this thread is set
    (the rows it holds); inside a block declaring ``.reg .pred p; .reg .b32 t;``."""
    ors = "".join(f"or.b32 t, t, ${n + i}; " for i in range(1, n))
    return f"mov.b32 t, ${n}; {ors}setp.ne.b32 p, t, 0; "


@triton.constexpr_function
def _vote_asm(n):
    """PTX of one vote.any a warp over the n elements a thread holds (``_thread_any``): outputs $0 ..
    $n-1 f32 1.0 or 0.0, the same in all n."""
    movs = "".join(f"mov.b32 ${i}, $0; " for i in range(1, n))
    return (f"{{ .reg .pred p; .reg .b32 t; {_thread_any(n)}"
            f"vote.sync.any.pred p, p, 0xffffffff; selp.f32 $0, 0f3F800000, 0f00000000, p; {movs}}}")


@triton.constexpr_function
def _bar_any_asm(n, bar, threads, site):
    """PTX of one barrier with an OR (``bar.red.or.pred``, what CUDA's __syncthreads_or is) at named barrier
    ``bar`` of ``threads`` threads, over the n elements of every thread that meets there
    (``_thread_any``), into the predicate register %scany<site> that ``_bar_read_asm`` reads (declared
    here: one site a call site and kernel); the outputs $0 .. $n-1 are zeros, unused."""
    zeros = "".join(f"mov.b32 ${i}, 0; " for i in range(n))
    return (f".reg .pred %scany{site}; {{ .reg .pred p; .reg .b32 t; {_thread_any(n)}"
            f"bar.red.or.pred %scany{site}, {bar}, {threads}, p; }} {zeros}")


@triton.constexpr_function
def _bar_read_asm(site):
    """PTX of 1 or 0 from the predicate register ``_bar_any_asm`` set at ``site``."""
    return f"selp.u32 $0, 1, 0, %scany{site};"


@triton.constexpr_function
def _pack_constraints(n):
    """Inline-asm constraints of n i32 outputs and n i32 inputs (one asm a thread over its n elements)."""
    return ",".join(["=r"] * n + ["r"] * n)


@gluon.jit
def _warp_any(hits, PACK: gl.constexpr):
    """1.0 in every element of a warp where some element of ``hits`` (i1 [rows], PACK of them a
    thread: the rows of a wgmma accumulator slice, rows / (8 * warps)) is true, else 0.0: one
    ``vote.any`` a warp instead of a shuffle tree (f32 [rows], warp-uniform)."""
    gl.static_assert(PACK == 2 or PACK == 4, "a vote takes the 2 or 4 rows a thread holds")
    return gl.inline_asm_elementwise(_vote_asm(PACK), _pack_constraints(PACK), [hits.to(gl.int32)],
                                     dtype=gl.float32, is_pure=False, pack=PACK)


@gluon.jit
def _bar_any(hits, PACK: gl.constexpr, BAR: gl.constexpr, THREADS: gl.constexpr, SITE: gl.constexpr):
    """Whether some element of ``hits`` (i1 [rows], PACK = rows / (8 * warps) of them a thread: a wgmma
    accumulator's row slice) is true in any of the THREADS threads that meet at named barrier BAR (all
    of them must): one ``bar.red.or.pred``, no shared memory, no shuffles; a scalar i1, the same in every
    one of those threads. The barrier's result reaches the scalar through a predicate register shared by
    two inline-asm statements (SITE names it; unique per call site within a kernel), because a Triton
    scalar cannot be taken from a distributed tensor without a reduction across warps."""
    gl.inline_asm_elementwise(_bar_any_asm(PACK, BAR, THREADS, SITE), _pack_constraints(PACK), [hits.to(gl.int32)],
                              dtype=gl.int32, is_pure=False, pack=PACK)
    got = gl.inline_asm_elementwise(_bar_read_asm(SITE), "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    return got != 0


@gluon.jit
def _warps_any(flags, NW: gl.constexpr):
    """Whether any warp's flag is set, from flags [ROWS] f32 in shared memory written by
    ``_warp_any`` (row r's warp flag; 16 consecutive rows a warp, the wgmma layout's row block):
    every thread reads one row of every 16 (broadcast loads, no shuffles) and reduces in registers."""
    ROWS: gl.constexpr = flags.shape[0]
    every: gl.constexpr = gl.BlockedLayout([ROWS // 16, 1], [1, 32], [1, NW], [1, 0])
    reps = flags.reshape([ROWS // 16, 16]).slice(0, 1, dim=1).load(every)
    return gl.max(gl.max(reps, 1), 0) > 0.0


@gluon.jit
def _vote_decide(xch, v0, v1k, v1s, thr, DECIDE: gl.constexpr, TWO: gl.constexpr, NW: gl.constexpr):
    """A tile's decision (TWO false: keep0, some row of v0 >= thr) or two tiles' (keep0, keep1; the
    second from v1k when the first is kept, else from v1s, BLASST only) over rows this warpgroup
    holds all of, by warp votes (``_warp_any``: one a warp and decision) through rows x0 .. x0 + 2 of
    xch = (buf [R, ROWS] f32 in shared memory, x0), this warpgroup's own, read back by every thread
    (``_warps_any``) between two barriers of the warpgroup (the first: every warp read the previous
    decision's votes)."""
    buf, x0 = xch
    ROWS: gl.constexpr = v0.shape[0]
    PACK: gl.constexpr = ROWS // (8 * NW)
    f0 = _warp_any(v0 >= thr, PACK)
    if TWO:
        f1k = _warp_any(v1k >= thr, PACK)
        if DECIDE == 2:
            f1s = _warp_any(v1s >= thr, PACK)
    _cta_barrier()
    buf.index(x0).store(f0)
    if TWO:
        buf.index(x0 + 1).store(f1k)
        if DECIDE == 2:
            buf.index(x0 + 2).store(f1s)
    _cta_barrier()
    keep0 = _warps_any(buf.index(x0), NW)
    keep1 = keep0
    if TWO:
        keep1 = _warps_any(buf.index(x0 + 1), NW)
        if DECIDE == 2:
            keep1 = gl.where(keep0, keep1, _warps_any(buf.index(x0 + 2), NW))
    return keep0, keep1


@gluon.jit
def _attend(s, m_i, m_new, l_i, acc, qk_scale, v_tile, v_ready, phase, MASKED: gl.constexpr,
            o_layout: gl.constexpr):
    """A kept tile: the online-softmax update of (acc [rows, D] f32, l_i [rows]) to the new row max
    m_new, then P.V as async wgmma with P from registers, once the tile's V copy (v_tile [BN, D] in
    shared memory, barrier v_ready at ``phase``) has landed; waited for."""
    acc, l_i = _attend_start(s, m_i, m_new, l_i, acc, qk_scale, v_tile, v_ready, phase, MASKED, o_layout)
    return warpgroup_mma_wait(0, deps=(acc,)), l_i


@gluon.jit
def _attend_start(s, m_i, m_new, l_i, acc, qk_scale, v_tile, v_ready, phase, MASKED: gl.constexpr,
                  o_layout: gl.constexpr):
    """``_attend`` without its last wait: (acc of the P.V wgmma still in flight, l_i); the caller waits
    (``warpgroup_mma_wait``) before it reads acc."""
    if MASKED:
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_ref[:, None])
    else:
        m_ref = m_new
        p = gl.exp2(s * qk_scale - m_ref[:, None])
    alpha = gl.exp2(m_i - m_ref)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(v_tile.dtype), gl.DotOperandLayout(0, o_layout, 2))
    mbarrier.wait(v_ready, phase)
    acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
    return acc, l_i


@gluon.jit
def _tile(carry, q_smem, k_desc, v_desc, k_ring, v_ring, k_bar, v_bar, xch, t, j, t_end, b, hk, num_kv,
          rows, row_ok, n_ctx, qk_scale, thr,
          MASKED: gl.constexpr, DECIDE: gl.constexpr, KV_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
          BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """One key tile j (ordinal t of t_end): refill the ring NBUF - 1 tiles ahead, S = Q.K^T, decide
    (DECIDE 0 compute, 1 BSFA, 2 BLASST), then the online-softmax update and P.V when kept.
    carry = (acc [BM, D] f32, l_i [BM], m_i [BM] (log2 units), n_skip)."""
    acc, l_i, m_i, n_skip = carry
    if DECIDE == 0:  # no decision, no cross-warp reduction: a barrier orders the refill after tile t - 1
        _cta_barrier()
        _refill(k_desc, v_desc, k_ring, v_ring, k_bar, v_bar, t, j, t_end, b, hk, num_kv, KV_ROWS, HEAD_DIM, BN, NBUF)
    slot = t % NBUF
    phase = (t // NBUF) & 1
    mbarrier.wait(k_bar.index(slot), phase)
    s = _qk(q_smem, k_ring.index(slot).reshape([BN, q_smem.shape[1]]), BM, BN, s_layout)
    s, m_ij = _scores(s, j, rows, n_ctx, qk_scale, MASKED, BN, s_layout)
    m_new = gl.maximum(m_i, m_ij)
    keep = True
    if DECIDE != 0:
        vals = _decided_vals(m_ij, m_new, row_ok, DECIDE)
        keep = _vote_decide(xch, vals, vals, vals, thr, DECIDE, False, s_layout.warps_per_cta[0])[0]
        # the decision's cross-warp exchange synchronized the warps: tile t - 1 is done everywhere
        _refill(k_desc, v_desc, k_ring, v_ring, k_bar, v_bar, t, j, t_end, b, hk, num_kv, KV_ROWS, HEAD_DIM, BN,
                NBUF)
    if keep:
        acc, l_i = _attend(s, m_i, m_new, l_i, acc, qk_scale, v_ring.index(slot).reshape([BN, q_smem.shape[1]]),
                           v_bar.index(slot), phase, MASKED, o_layout)
        m_i = m_new
    else:  # the slot's V copy must land before the slot is refilled
        mbarrier.wait(v_bar.index(slot), phase)
        n_skip += 1
    return acc, l_i, m_i, n_skip


@gluon.jit
def _segment(carry, q_smem, k_desc, v_desc, k_ring, v_ring, k_bar, v_bar, xch, t0, j0, count, t_end, b, hk,
             num_kv, rows, row_ok, n_ctx, qk_scale, thr,
             MASKED: gl.constexpr, DECIDE: gl.constexpr, KV_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
             BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Tiles j0 .. j0 + count - 1, ordinals t0 .. (one ring and one tile order across segments)."""
    for u in range(count):
        carry = _tile(carry, q_smem, k_desc, v_desc, k_ring, v_ring, k_bar, v_bar, xch, t0 + u, j0 + u, t_end, b,
                      hk, num_kv, rows, row_ok, n_ctx, qk_scale, thr, MASKED, DECIDE, KV_ROWS, HEAD_DIM, BM, BN, NBUF,
                      s_layout, o_layout)
    return carry


@gluon.jit
def _ring_barriers(NBUF: gl.constexpr):
    """(q_bar [1, 1], k_bar [NBUF, 1], v_bar [NBUF, 1]) mbarriers, each expecting one arrival a phase."""
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    for s in gl.static_range(NBUF):
        mbarrier.init(k_bar.index(s), count=1)
        mbarrier.init(v_bar.index(s), count=1)
    return q_bar, k_bar, v_bar


@gluon.jit
def _invalidate(q_bar, k_bar, v_bar, NBUF: gl.constexpr):
    """Retire the barriers of ``_ring_barriers``."""
    mbarrier.invalidate(q_bar.index(0))
    for s in gl.static_range(NBUF):
        mbarrier.invalidate(k_bar.index(s))
        mbarrier.invalidate(v_bar.index(s))


@gluon.jit
def _store_out(acc, l_i, n_skip, O, SKIP, so_b, so_h, so_n, i, b, h, bh, n_ctx, BM: gl.constexpr,
               HEAD_DIM: gl.constexpr, NW: gl.constexpr, o_layout: gl.constexpr):
    """acc / l_i [BM, D] into rows i * BM .. of O [B, H, N, D] (by strides), and the program's skip
    count into SKIP [B * H, P]."""
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    o = gl.convert_layout(o.to(O.dtype.element_ty), out_layout)
    orow = i * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
    ocol = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_layout))
    base = O + b.to(gl.int64) * so_b + h.to(gl.int64) * so_h
    gl.store(base + orow.to(gl.int64)[:, None] * so_n + ocol[None, :], o, mask=(orow < n_ctx)[:, None])
    gl.store(SKIP + bh.to(gl.int64) * gl.num_programs(0) + i, n_skip)


@gluon.jit
def _gluon_fwd_kernel(q_desc, k_desc, v_desc, O, THR, SKIP, so_b, so_h, so_n,
                      n_ctx, num_heads, num_kv, group, n_thr, qk_scale, log_lambda2, window,
                      METHOD: gl.constexpr, Q_ROWS: gl.constexpr, KV_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, num_warps: gl.constexpr):
    """Grid (P, B * H), heaviest query blocks first. METHOD 0 dense, 1 BSFA, 2 BLASST (forward),
    3 window. THR [H, n_thr] f32 natural units; log_lambda2 = ln(lambda) log2(e); O [B, H, N, D] by
    strides; SKIP [B * H, P] i32 candidate tiles skipped per program."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    i = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    hk = h // group
    dtype: gl.constexpr = q_desc.dtype
    q_buf = gl.allocate_shared_memory(dtype, [1, BM, HEAD_DIM], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [NBUF, 1, BN, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [NBUF, 1, BN, HEAD_DIM], v_desc.layout)
    q_bar, k_bar, v_bar = _ring_barriers(NBUF)
    xch = (gl.allocate_shared_memory(gl.float32, [1, BM], gl.SwizzledSharedLayout(1, 1, 1, [0])), 0)  # votes

    n_cand = (i * BM) // BN
    n_reach = (gl.minimum((i + 1) * BM, n_ctx) - 1) // BN + 1
    j_lo = 0
    if METHOD == 3:
        j_lo = gl.maximum(n_cand - window, 0)
    t_end = n_reach - j_lo
    mbarrier.expect(q_bar.index(0), q_desc.block_type.nbytes)
    _tma_load(q_desc, _coords(b, h, i * BM, Q_ROWS, num_heads, HEAD_DIM), q_bar.index(0), q_buf)
    for t in gl.static_range(NBUF - 1):
        if t < t_end:
            _issue(k_desc, v_desc, k_ring, v_ring, k_bar, v_bar, t, j_lo + t, b, hk, num_kv, KV_ROWS, HEAD_DIM, BN,
                   NBUF)

    rows = i * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    row_ok = rows < n_ctx
    if METHOD == 1:
        thr = gl.load(THR + h * n_thr + gl.minimum(i, n_thr - 1)) * 1.4426950408889634
    else:
        thr = log_lambda2
    acc = gl.zeros([BM, HEAD_DIM], gl.float32, o_layout)
    l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
    m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    n_skip = i * 0 + j_lo
    carry = (acc, l_i, m_i, n_skip)
    mbarrier.wait(q_bar.index(0), 0)
    q_smem = q_buf.reshape([BM, HEAD_DIM])
    DECIDE: gl.constexpr = METHOD if METHOD < 3 else 0
    carry = _segment(carry, q_smem, k_desc, v_desc, k_ring, v_ring, k_bar, v_bar, xch, 0, j_lo, n_cand - j_lo,
                     t_end, b, hk, num_kv, rows, row_ok, n_ctx, qk_scale, thr, False, DECIDE, KV_ROWS,
                     HEAD_DIM, BM, BN, NBUF, s_layout, o_layout)
    carry = _segment(carry, q_smem, k_desc, v_desc, k_ring, v_ring, k_bar, v_bar, xch, n_cand - j_lo, n_cand,
                     n_reach - n_cand, t_end, b, hk, num_kv, rows, row_ok, n_ctx, qk_scale, thr, True, 0, KV_ROWS,
                     HEAD_DIM, BM, BN, NBUF, s_layout, o_layout)
    acc, l_i, m_i, n_skip = carry
    _invalidate(q_bar, k_bar, v_bar, NBUF)
    _store_out(acc, l_i, n_skip, O, SKIP, so_b, so_h, so_n, i, b, h, bh, n_ctx, BM, HEAD_DIM, num_warps, o_layout)


def sparse_attention_gluon(q, k, v, scale: float, block_m: int, block_n: int, *, thresholds=None,
                           log_lambda: float | None = None, window: int | None = None, order: str = "forward",
                           dense: bool = False, out: torch.Tensor | None = None, nbuf: int | None = None):
    """The Gluon kernel with ``sparse_attention_triton``'s arguments and results (q [B, H, N, D],
    k/v [B, Hkv, N, D] -> (out [B, H, N, D], skipped [B, H] int64)); ``gluon_supported`` must hold."""
    grid, args, consts, out, skip = launch(q, k, v, scale, block_m, block_n, block_m, thresholds, log_lambda,
                                           window, order, dense, out)
    LAST_COMPILED["gluon"] = _gluon_fwd_kernel[grid](*args, **consts, NBUF=nbuf or NBUF[q.shape[-1]],
                                                      num_warps=NUM_WARPS)
    return out, skip.sum(dim=-1, dtype=torch.int64)


def launch(q, k, v, scale: float, block_m: int, block_n: int, q_block: int, thresholds, log_lambda, window,
           order: str, dense: bool, out):
    """What both Gluon kernels' hosts share, after the argument checks: (grid, positional arguments,
    METHOD / Q_ROWS / KV_ROWS / HEAD_DIM / BM / BN, out [B, H, N, D], skip [B, H, P] int32 that the
    kernel fills); Q is read in q_block-row boxes, K and V in BN-row boxes through TMA views."""
    b, h, hkv, n, d, method, thr = _check_args(q, k, v, block_m, thresholds, log_lambda, window, order, dense,
                                               False)
    if not gluon_supported(q, block_m, block_n, method, order, None):
        raise ValueError("the Gluon prefill kernel does not take this call (gluon_supported)")
    p = triton.cdiv(n, block_m)
    if out is None:
        out = torch.empty_like(q)
    skip = torch.empty((b * h, p), dtype=torch.int32, device=q.device)
    q_desc, q_rows = _descriptor(q, q_block)
    k_desc, k_rows = _descriptor(k, block_n)
    v_desc, v_rows = _descriptor(v, block_n)
    if k_rows != v_rows:
        v_desc, v_rows = _descriptor(v.contiguous() if k_rows else v.transpose(1, 2).contiguous().transpose(1, 2),
                                     block_n)
    ll2 = 0.0 if log_lambda is None else log2_lambda(log_lambda)
    args = (q_desc, k_desc, v_desc, out, thr, skip, *out.stride()[:3], n, h, hkv, h // hkv, thr.shape[1],
            scale * LOG2E, ll2, 0 if window is None else int(window))
    consts = {"METHOD": method, "Q_ROWS": q_rows, "KV_ROWS": k_rows, "HEAD_DIM": d, "BM": block_m, "BN": block_n}
    return (p, b * h), args, consts, out, skip.view(b, h, p)
