"""Warp-specialized variant of the Gluon Hopper prefill kernel (``prefill_gluon``): a 1-warp TMA
producer and two consumer warpgroups that never wait for each other except to agree on a decision.

Same semantics, arguments and results as ``prefill_gluon.sparse_attention_gluon`` (query blocks of
BM = 128 rows, the BSFA / BLASST-forward / window rule evaluated over all 128 rows of the block,
identical skip counts), so it can be swapped in. Experimental: built for sm_90 on CPU machines
(tests/test_prefill_gluon_ws.py), checked and timed on the GPU by bench/prefill_gluon.py
(``--variants gluon_ws``).

What it changes (NOTES.md "prefill-gluon": the cross-warp max of the decision put both warpgroups
in lockstep twice per tile, and the refill waited for it):

- A producer warp (``_producer``) copies K and V of every tile into an NBUF-slot ring, guarded per
  slot by ready barriers (TMA transaction counts) and empty barriers (one arrival per consumer
  warpgroup). K and V have separate barriers, so a K slot is refilled as soon as both warpgroups
  finished Q.K^T on it, without waiting for their P.V. No consumer issues a copy or orders one.
- Each consumer warpgroup (``_consumer``, 4 warps, 64 of the block's 128 query rows) is its own
  partition with its own Q half, accumulator and softmax state; it runs Q.K^T, softmax and P.V for
  its rows at its own pace.
- The decision (``_agree``) needs all 128 rows. By default (MEET 2, both head dims) the 8 consumer warps
  meet at one barrier that ORs each thread's "one of my rows keeps the tile" (``prefill_gluon._bar_any``,
  one ``bar.red.or.pred``; no shared memory). The other form (MEET 0, the D = 128 default until s50):
  each warp of each warpgroup votes once (``prefill_gluon._warp_any``, one ``vote.any``) into a 2-entry
  shared-memory exchange, the warpgroup syncs its own 4 warps, arrives on the entry's mbarrier (2 arrivals
  a phase), waits for the other warpgroup's arrival, and every thread reads the 8 votes. Either way, both
  warpgroups take the same decision: the BM = 128 semantics are unchanged.
- Without a producer warp (D = 128) warpgroup 0 issues the copies; in a dense call it issues K(t + 1) while
  tile t's Q.K^T wgmma runs and V(t + 1) while its P.V wgmma runs (``late_for``), so the issue (warpgroup
  barriers, ring waits, the copy) overlaps tensor-core work; a call that decides issues K before the Q.K^T and V
  after the decision (there the late form measured level to slower).
- A skipped tile only arrives on its V slot's empty barrier; the producer waits for that slot's
  previous V copy to land before refilling it (a skipped tile never waits for its V).
- Grid order (``_program``, shared with the paired kernel): heaviest query block first within a head;
  up to N x D = CHUNK_UP_TO (``grid_chunk``) CHUNK_HEADS heads side by side, so the last heads' longest
  blocks do not start last (the tail at 16K was ~6 % of the run; NOTES.md "heads side by side in chunks").

Phases: tile t (its ordinal in the program, 0 ..) uses ring slot t % NBUF in use n = t // NBUF; the
consumer waits ready[slot] with parity n & 1, the producer waits empty[slot] with parity (n - 1) & 1
before use n >= 1 (both consumers have released use n - 1), and the decision of tile t uses exchange
entry t % 2 with parity (t // 2) & 1 (the decided tiles are ordinals 0 .. n_cand - 1, consecutive).
No barrier can run two phases ahead of a waiter: a slot is refilled only after both consumers
released its previous use, and a warpgroup writes exchange entry t % 2 again (tile t + 2) only after
the other warpgroup arrived for tile t + 1, which it does after reading tile t's values. An empty
barrier (2 arrivals a use) never takes one warpgroup's release of use n for the other's of use n - 1:
a release follows the wait for that use's copy, except a skipped tile's V release, and a skipped tile
was decided at the meeting of both warpgroups, so the other one is past use n - 1 of the slot. A decision
without that meeting (each warpgroup alone) breaks this; the paired kernel, whose warpgroups never meet, waits
for a skipped tile's V copy instead (NOTES.md, s47 diagnostic forms: their call hung).

Shape legend
    B batch   H query heads   Hkv KV heads   N tokens   D head dim   P = ceil(N/BM) query blocks
    Pt threshold positions   BM = 128 query rows a program (HALF = 64 a consumer warpgroup)
    BN key rows a tile   NBUF ring slots
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma_wait,
)

from sparsecal.kernels.jit import LAST_COMPILED
from sparsecal.kernels.sparse.prefill_gluon import (
    _attend_start,
    _bar_any,
    _coords,
    _cta_barrier,
    _decided_vals,
    _qk_start,
    _scores,
    _tma_load,
    _warp_any,
    _warps_any,
    launch,
)

CONSUMER_WARPS = 4  # one warpgroup per consumer partition (the launch's num_warps: the default partition)
PRODUCER_WARPS = gl.constexpr(1)
# Per head dim and producer choice: (ring slots, launch registers a thread (.maxnreg), registers the
# worker partitions ask setmaxnreg for: consumer warpgroup 1 [, producer]). Two programs per SM need
# launch registers x threads <= 32768: with a producer warp the program has 12 warps (the producer's
# warpgroup is padded, 24 registers), so 80 launch registers leave the consumers 104 + 112; a consumer
# needs ~96 at D = 64 and 128 at D = 128 (fewer spill), so D = 128 runs without a producer warp (warpgroup 0
# issues the copies) at 2 programs per SM, or with one at 1 program per SM and a deep ring.
CONFIG = {(64, True): (4, 80, 112), (64, False): (4, 128, 128),
          (128, True): (5, None, 240), (128, False): (2, 128, 128)}
PRODUCER_REGS = 24
PRODUCER = {64: True, 128: False}  # default per head dim
# Where warpgroup 0 issues the copies when it is their issuer (D = 128), per head dim, for dense calls (``late_for``;
# ``_ws_tile``'s LATE): under its wgmma. Dense at D = 128: 8-15 % faster than before the Q.K^T / after the decision
# (16K-32K, G 1/8, two runs), 6.5-11 % at 64K (timed first and second), ahead of cuDNN in some runs; calls that
# decide stay as they were (with LATE: level at 16K, 3-12 % slower at 32K timed second, up to 5 points of which the
# bench's fixed order may hold, ``bench.sparse.round_order``); data/bench/NOTES.md "the copies issued under the wgmma",
# s49.
LATE_DENSE = {64: False, 128: True}
# How the two warpgroups agree on a decision, per head dim (``_agree``'s MEET): 2, at one barrier with an OR
# (D = 64: 1-6 % faster than the votes with nothing skipped, 3-10 % at 50 / 75 %, s47; D = 128: 0.7-5.6 % faster
# at 50 / 75 % in all 12 cells, the interval above 1 in 8, 16K-64K, 4 rounds in alternating order, s50, where s47's
# fixed order had timed it second and read it slower); 0, votes through shared memory and an mbarrier (the D = 128
# default until s50; with nothing skipped it is 1-5 % ahead there, but those calls run ``prefill_gluon``,
# prefill_pick's WS_FROM). Removed: votes at a named barrier (MEET 1 until s47, level with both) and each
# warpgroup's own rows first (MEET 3, s50-s51: slower than MEET 2 in every cell where tiles are skipped, its own
# warpgroup's barriers costing more than the wait they saved). data/bench/NOTES.md "the decision at a barrier with
# an OR" (s47), "the D = 128 meeting again with alternating rounds" (s50), "the own rows first, timed" (s51).
MEET = {64: 2, 128: 2}
# The grid's order (``_program``): CHUNK_HEADS heads side by side where N x D is at most CHUNK_UP_TO (measured
# ahead at D = 64 16K-32K and D = 128 16K, behind at D = 64 64K BLASST and D = 128 32K, where the chunk's K/V
# tiles no longer stay in L2; data/bench/NOTES.md "heads side by side in chunks", s45), one head after the other
# above it.
CHUNK_HEADS, CHUNK_UP_TO = 4, 32768 * 64


def grid_chunk(n: int, d: int, heads: int, up_to: int = CHUNK_UP_TO) -> int:
    """Heads side by side in the grid for a call of N = n tokens, head dim d and ``heads`` query heads."""
    return CHUNK_HEADS if n * d <= up_to and heads % CHUNK_HEADS == 0 else 1


def chunked_grid(grid: tuple[int, int], q: torch.Tensor, chunk: int | None, up_to: int = CHUNK_UP_TO):
    """(grid (programs x C, B x H / C), C) of a call q [B, H, N, D] whose grid one head after the other is
    ``grid``: C = ``chunk``, or ``grid_chunk`` when None; 1 where C does not divide H."""
    if chunk is None:
        chunk = grid_chunk(q.shape[2], q.shape[-1], q.shape[1], up_to)
    chunk = chunk if q.shape[1] % chunk == 0 else 1
    return (grid[0] * chunk, grid[1] // chunk), chunk


@gluon.jit
def _load(desc, bufs, ready, empty, tn, c, NBUF: gl.constexpr):
    """TMA copy of one tile (ordinal tn) into slot tn % NBUF once the slot's previous use (tn - NBUF) was
    released by both warpgroups and its copy landed (a skipped tile does not wait for its V)."""
    slot = tn % NBUF
    if tn >= NBUF:
        prev = ((tn // NBUF) + 1) & 1  # parity of use tn // NBUF - 1 of this slot
        mbarrier.wait(empty.index(slot), prev)
        mbarrier.wait(ready.index(slot), prev)
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
    _tma_load(desc, c, ready.index(slot), bufs.index(slot))


@gluon.jit
def _issue(ring, src, tn, DO_K: gl.constexpr, DO_V: gl.constexpr, KV_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
           BN: gl.constexpr, NBUF: gl.constexpr):
    """K and/or V of tile ordinal tn (key tile j_lo + tn); nothing past the program's last tile.
    ring = (k_ring, v_ring [NBUF, 1, BN, D], k_ready, k_empty, v_ready, v_empty [NBUF, 1] mbarriers),
    src = (k_desc, v_desc, b, hk, num_kv, j_lo, t_end)."""
    k_ring, v_ring, k_ready, k_empty, v_ready, v_empty = ring
    k_desc, v_desc, b, hk, num_kv, j_lo, t_end = src
    if tn < t_end:
        c = _coords(b, hk, (j_lo + tn) * BN, KV_ROWS, num_kv, HEAD_DIM)
        if DO_K:
            _load(k_desc, k_ring, k_ready, k_empty, tn, c, NBUF)
        if DO_V:
            _load(v_desc, v_ring, v_ready, v_empty, tn, c, NBUF)


@gluon.jit
def _load_q(q_desc, q_buf, q_bar, b, h, i, num_heads, Q_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
            BM: gl.constexpr):
    """Both halves [HALF, D] of query block i into q_buf [2, 1, HALF, D], on one barrier."""
    HALF: gl.constexpr = BM // 2
    mbarrier.expect(q_bar.index(0), 2 * q_desc.block_type.nbytes)
    for w in gl.static_range(2):
        _tma_load(q_desc, _coords(b, h, i * BM + w * HALF, Q_ROWS, num_heads, HEAD_DIM), q_bar.index(0),
                  q_buf.index(w))


@gluon.jit
def _producer(q_desc, q_buf, q_bar, ring, src, i, h, num_heads, Q_ROWS: gl.constexpr, KV_ROWS: gl.constexpr,
              HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr):
    """1 warp: Q, then K and V of every tile of the program, in order, as fast as the ring frees."""
    _load_q(q_desc, q_buf, q_bar, src[2], h, i, num_heads, Q_ROWS, HEAD_DIM, BM)
    for t in range(src[6]):
        _issue(ring, src, t, True, True, KV_ROWS, HEAD_DIM, BN, NBUF)


@gluon.jit
def _agree(red, dec_bar, e, vals, thr, WG: gl.constexpr, BM: gl.constexpr, NW: gl.constexpr, MEET: gl.constexpr):
    """The block's decision at exchange e: does some row of its 128 reach thr (vals: this warpgroup's
    64 rows [HALF], -inf where a row is past N)? MEET 2: one barrier with an OR of the 8 consumer warps
    (``prefill_gluon._bar_any`` at named barrier 15, which Triton's partitions do not use; the producer
    warp never takes it; no shared memory). MEET 0: each warp votes once (``_warp_any``) into row e % 2
    of red [2, BM]; after both warpgroups arrived through the entry's mbarrier, every thread reads the 8
    warps' votes (``_warps_any``)."""
    HALF: gl.constexpr = BM // 2
    if MEET == 2:
        keep = _bar_any(vals >= thr, HALF // (8 * NW), 15, 2 * NW * 32, WG)
    else:
        entry = red.index(e % 2)
        flags = _warp_any(vals >= thr, HALF // (8 * NW))
        entry.slice(WG * HALF, HALF).store(flags)
        _cta_barrier()  # this warpgroup's 4 warps wrote their votes before its thread 0 arrives
        mbarrier.arrive(dec_bar.index(e % 2))
        mbarrier.wait(dec_bar.index(e % 2), (e // 2) & 1)
        keep = _warps_any(entry, NW)
    return keep


@gluon.jit
def _ws_tile(carry, q_smem, ring, src, red, dec_bar, t, j, rows, row_ok, n_ctx, qk_scale, thr,
             MASKED: gl.constexpr, DECIDE: gl.constexpr, WG: gl.constexpr, ISSUER: gl.constexpr,
             KV_ROWS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
             NW: gl.constexpr, MEET: gl.constexpr, LATE: gl.constexpr, s_layout: gl.constexpr,
             o_layout: gl.constexpr):
    """One key tile j (ordinal t) for this warpgroup's HALF rows: S = Q.K^T, release K, decide
    (DECIDE 0 compute, 1 BSFA, 2 BLASST; at exchange t), online-softmax update and P.V when kept,
    release V. ISSUER (warpgroup 0 when there is no producer warp) copies tile t + NBUF - 1's K before
    the Q.K^T and its V after the decision, or, LATE, K while the Q.K^T wgmma runs and V while the P.V
    wgmma runs (a skipped tile's V after its decision). carry = (acc [HALF, D] f32, l_i [HALF], m_i
    [HALF] (log2 units), n_skip)."""
    acc, l_i, m_i, n_skip = carry
    k_ring, v_ring, k_ready, k_empty, v_ready, v_empty = ring
    d: gl.constexpr = q_smem.shape[1]
    if ISSUER and not LATE:
        _issue(ring, src, t + NBUF - 1, True, False, KV_ROWS, d, BN, NBUF)
    slot = t % NBUF
    phase = (t // NBUF) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    s = _qk_start(q_smem, k_ring.index(slot).reshape([BN, d]), BM // 2, BN, s_layout)
    if ISSUER and LATE:
        _issue(ring, src, t + NBUF - 1, True, False, KV_ROWS, d, BN, NBUF)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(slot))
    s, m_ij = _scores(s, j, rows, n_ctx, qk_scale, MASKED, BN, s_layout)
    m_new = gl.maximum(m_i, m_ij)
    keep = True
    if DECIDE != 0:
        keep = _agree(red, dec_bar, t, _decided_vals(m_ij, m_new, row_ok, DECIDE), thr, WG, BM, NW, MEET)
    if ISSUER and not LATE:
        _issue(ring, src, t + NBUF - 1, False, True, KV_ROWS, d, BN, NBUF)
    if keep:
        acc, l_i = _attend_start(s, m_i, m_new, l_i, acc, qk_scale, v_ring.index(slot).reshape([BN, d]),
                                 v_ready.index(slot), phase, MASKED, o_layout)
        if ISSUER and LATE:
            _issue(ring, src, t + NBUF - 1, False, True, KV_ROWS, d, BN, NBUF)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        m_i = m_new
    else:
        if ISSUER and LATE:
            _issue(ring, src, t + NBUF - 1, False, True, KV_ROWS, d, BN, NBUF)
        n_skip += 1
    mbarrier.arrive(v_empty.index(slot))
    return acc, l_i, m_i, n_skip


@gluon.jit
def _ws_segment(carry, q_smem, ring, src, red, dec_bar, t0, j0, count, rows, row_ok, n_ctx, qk_scale, thr,
                MASKED: gl.constexpr, DECIDE: gl.constexpr, WG: gl.constexpr, ISSUER: gl.constexpr,
                KV_ROWS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, NW: gl.constexpr,
                MEET: gl.constexpr, LATE: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Tiles j0 .. j0 + count - 1, ordinals t0 .. (one ring and one tile order across segments); the
    ISSUER copies NBUF - 1 tiles ahead."""
    for u in range(count):
        carry = _ws_tile(carry, q_smem, ring, src, red, dec_bar, t0 + u, j0 + u, rows, row_ok, n_ctx, qk_scale,
                         thr, MASKED, DECIDE, WG, ISSUER, KV_ROWS, BM, BN, NBUF, NW, MEET, LATE, s_layout,
                         o_layout)
    return carry


@gluon.jit
def _epilogue(acc, l_i, q_half, O, SKIP, so_b, so_h, so_n, i, b, h, bh, n_skip, n_ctx, CHUNK: gl.constexpr,
              WG: gl.constexpr, BM: gl.constexpr, NW: gl.constexpr, o_layout: gl.constexpr):
    """acc / l_i [HALF, D] into this warpgroup's rows of O [B, H, N, D] (by strides), through its own
    (dead) Q half q_half [HALF, D] in shared memory; warpgroup 0 stores the skip count in SKIP [B * H, P]."""
    HALF: gl.constexpr = BM // 2
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    q_half.store(o.to(q_half.dtype))
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    o = q_half.load(out_layout)
    orow = i * BM + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, out_layout))
    ocol = gl.arange(0, q_half.shape[1], layout=gl.SliceLayout(0, out_layout))
    base = O + b.to(gl.int64) * so_b + h.to(gl.int64) * so_h
    gl.store(base + orow.to(gl.int64)[:, None] * so_n + ocol[None, :], o.to(O.dtype.element_ty),
             mask=(orow < n_ctx)[:, None])
    if WG == 0:
        gl.store(SKIP + bh.to(gl.int64) * (gl.num_programs(0) // CHUNK) + i, n_skip)


@gluon.jit
def _consumer(q_desc, q_buf, q_bar, ring, src, red, dec_bar, O, SKIP, so_b, so_h, so_n, i, h, bh, num_heads,
              n_ctx, n_cand, qk_scale, thr, DECIDE: gl.constexpr, WG: gl.constexpr, ISSUER: gl.constexpr,
              Q_ROWS: gl.constexpr, KV_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, NBUF: gl.constexpr, NW: gl.constexpr, CHUNK: gl.constexpr, MEET: gl.constexpr,
              LATE: gl.constexpr):
    """One warpgroup (NW = 4 warps): rows i * BM + WG * HALF .. + HALF - 1 over every tile of the block
    (the ISSUER also loads Q and the first NBUF - 1 tiles), then its rows of O."""
    HALF: gl.constexpr = BM // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    j_lo = src[5]
    n_reach = j_lo + src[6]
    if ISSUER:
        _load_q(q_desc, q_buf, q_bar, src[2], h, i, num_heads, Q_ROWS, HEAD_DIM, BM)
        for t in gl.static_range(NBUF - 1):
            _issue(ring, src, t, True, True, KV_ROWS, HEAD_DIM, BN, NBUF)
    rows = i * BM + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    row_ok = rows < n_ctx
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
    l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
    m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    carry = (acc, l_i, m_i, i * 0 + j_lo)
    mbarrier.wait(q_bar.index(0), 0)
    q_half = q_buf.index(WG).reshape([HALF, HEAD_DIM])
    carry = _ws_segment(carry, q_half, ring, src, red, dec_bar, 0, j_lo, n_cand - j_lo, rows, row_ok, n_ctx,
                        qk_scale, thr, False, DECIDE, WG, ISSUER, KV_ROWS, BM, BN, NBUF, NW, MEET, LATE, s_layout,
                        o_layout)
    carry = _ws_segment(carry, q_half, ring, src, red, dec_bar, n_cand - j_lo, n_cand, n_reach - n_cand, rows,
                        row_ok, n_ctx, qk_scale, thr, True, 0, WG, ISSUER, KV_ROWS, BM, BN, NBUF, NW, MEET,
                        LATE, s_layout, o_layout)
    acc, l_i, m_i, n_skip = carry
    _epilogue(acc, l_i, q_half, O, SKIP, so_b, so_h, so_n, i, src[2], h, bh, n_skip, n_ctx, CHUNK, WG, BM, NW,
              o_layout)


@gluon.jit
def _program(CHUNK: gl.constexpr):
    """(n - 1 - the program's rank: heaviest first, b * H + h) of a grid (n * CHUNK, B * H / CHUNK): the
    CHUNK heads of a chunk side by side, rank by rank, the chunks one after the other (CHUNK = 1: one
    head after the other)."""
    if CHUNK == 1:
        return gl.num_programs(0) - 1 - gl.program_id(0), gl.program_id(1)
    else:
        return (gl.num_programs(0) // CHUNK - 1 - gl.program_id(0) // CHUNK,
                gl.program_id(1) * CHUNK + gl.program_id(0) % CHUNK)


@gluon.jit
def _barriers(n: gl.constexpr, count: gl.constexpr):
    """n mbarriers [n, 1], each initialized to expect ``count`` arrivals a phase."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(n):
        mbarrier.init(bars.index(s), count=count)
    return bars


@gluon.jit
def _block_range(i, n_ctx, window, METHOD: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """(first key tile, first diagonal tile, end tile) of query block i."""
    n_cand = (i * BM) // BN
    j_lo = n_cand * 0
    if METHOD == 3:
        j_lo = gl.maximum(n_cand - window, 0)
    return j_lo, n_cand, (gl.minimum((i + 1) * BM, n_ctx) - 1) // BN + 1


@gluon.jit
def _ws_fwd_kernel(q_desc, k_desc, v_desc, O, THR, SKIP, so_b, so_h, so_n,
                   n_ctx, num_heads, num_kv, group, n_thr, qk_scale, log_lambda2, window,
                   METHOD: gl.constexpr, Q_ROWS: gl.constexpr, KV_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                   BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, PRODUCER: gl.constexpr,
                   WORKER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, CHUNK: gl.constexpr,
                   MEET: gl.constexpr, LATE: gl.constexpr, num_warps: gl.constexpr):
    """Grid (P * CHUNK, B * H / CHUNK), heaviest query blocks first, CHUNK heads side by side
    (``_program``); num_warps = 4: consumer warpgroup 0 (the default
    partition), consumer warpgroup 1 (a worker, WORKER_REGS registers) and, when PRODUCER, a 1-warp
    producer (PRODUCER_REGS). Arguments as ``prefill_gluon._gluon_fwd_kernel``
    except q_desc, whose block is one consumer's half [1, BM / 2, D]."""
    i, bh = _program(CHUNK)
    b = bh // num_heads
    h = bh % num_heads
    dtype: gl.constexpr = q_desc.dtype
    q_buf = gl.allocate_shared_memory(dtype, [2, 1, BM // 2, HEAD_DIM], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [NBUF, 1, BN, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [NBUF, 1, BN, HEAD_DIM], v_desc.layout)
    red = gl.allocate_shared_memory(gl.float32, [2, BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # MEET 0's votes
    q_bar = _barriers(1, 1)
    k_ready = _barriers(NBUF, 1)
    v_ready = _barriers(NBUF, 1)
    k_empty = _barriers(NBUF, 2)  # one arrival (thread 0) per consumer warpgroup
    v_empty = _barriers(NBUF, 2)
    dec_bar = _barriers(2, 2)  # MEET 0: both warpgroups arrive on exchange e's entry e % 2
    fence_async_shared()

    j_lo, n_cand, n_reach = _block_range(i, n_ctx, window, METHOD, BM, BN)
    thr = log_lambda2
    if METHOD == 1:
        thr = gl.load(THR + h * n_thr + gl.minimum(i, n_thr - 1)) * 1.4426950408889634
    ring = (k_ring, v_ring, k_ready, k_empty, v_ready, v_empty)
    src = (k_desc, v_desc, b, h // group, num_kv, j_lo, n_reach - j_lo)
    DECIDE: gl.constexpr = METHOD if METHOD < 3 else 0
    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    ISSUER: gl.constexpr = 1  # warpgroup 0 without a producer warp
    NOT_ISSUER: gl.constexpr = 0
    if PRODUCER:
        gl.warp_specialize([
            (_consumer, (q_desc, q_buf, q_bar, ring, src, red, dec_bar, O, SKIP, so_b, so_h, so_n, i, h, bh,
                         num_heads, n_ctx, n_cand, qk_scale, thr, DECIDE, WG0, NOT_ISSUER, Q_ROWS, KV_ROWS,
                         HEAD_DIM, BM, BN, NBUF, num_warps, CHUNK, MEET, LATE)),
            (_consumer, (q_desc, q_buf, q_bar, ring, src, red, dec_bar, O, SKIP, so_b, so_h, so_n, i, h, bh,
                         num_heads, n_ctx, n_cand, qk_scale, thr, DECIDE, WG1, NOT_ISSUER, Q_ROWS, KV_ROWS,
                         HEAD_DIM, BM, BN, NBUF, num_warps, CHUNK, MEET, LATE)),
            (_producer, (q_desc, q_buf, q_bar, ring, src, i, h, num_heads, Q_ROWS, KV_ROWS, HEAD_DIM, BM, BN,
                         NBUF)),
        ], [num_warps, PRODUCER_WARPS], [WORKER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_desc, q_buf, q_bar, ring, src, red, dec_bar, O, SKIP, so_b, so_h, so_n, i, h, bh,
                         num_heads, n_ctx, n_cand, qk_scale, thr, DECIDE, WG0, ISSUER, Q_ROWS, KV_ROWS,
                         HEAD_DIM, BM, BN, NBUF, num_warps, CHUNK, MEET, LATE)),
            (_consumer, (q_desc, q_buf, q_bar, ring, src, red, dec_bar, O, SKIP, so_b, so_h, so_n, i, h, bh,
                         num_heads, n_ctx, n_cand, qk_scale, thr, DECIDE, WG1, NOT_ISSUER, Q_ROWS, KV_ROWS,
                         HEAD_DIM, BM, BN, NBUF, num_warps, CHUNK, MEET, LATE)),
        ], [num_warps], [WORKER_REGS])


def late_for(d: int, method: int, producer: bool | None = None) -> bool:
    """Whether a call of head dim d and ``method`` (``prefill.method_code``) issues its copies under the wgmma by
    default: LATE_DENSE[d] for a dense call (method 0) of the form without a producer warp, else not."""
    producer = PRODUCER[d] if producer is None else bool(producer)
    return method == 0 and not producer and LATE_DENSE[d]


def ws_config(d: int, producer: bool | None = None, nbuf: int | None = None, chunk: int = 1,
              meet: int | None = None, late: bool = False) -> dict:
    """Launch constants of the kernel for head dim d: the CONFIG row (producer warp or not), as
    keyword arguments of ``_ws_fwd_kernel[grid](...)`` (maxnreg None: Triton's choice); ``chunk``: heads
    side by side in the grid (``_program``); ``meet``: how the two warpgroups agree on a decision (``_agree``;
    None: MEET[d]; 0 votes and an mbarrier, 2 one barrier with an OR); ``late``: warpgroup 0 issues each copy
    while one of its wgmma runs (``_ws_tile``'s LATE; without a producer warp only)."""
    producer = PRODUCER[d] if producer is None else bool(producer)
    slots, maxnreg, worker = CONFIG[(d, producer)]
    if meet not in (None, 0, 2):
        raise ValueError(f"meet is 0 (votes and an mbarrier) or 2 (one barrier with an OR), got {meet!r}")
    if late and producer:
        raise ValueError("late copies are warpgroup 0's: the form without a producer warp takes them")
    kw = {"NBUF": nbuf or slots, "PRODUCER": producer, "WORKER_REGS": worker, "PRODUCER_REGS": PRODUCER_REGS,
          "CHUNK": int(chunk), "MEET": MEET[d] if meet is None else int(meet), "LATE": bool(late),
          "num_warps": CONSUMER_WARPS}
    if maxnreg is not None:
        kw["maxnreg"] = maxnreg
    return kw


def sparse_attention_gluon_ws(q, k, v, scale: float, block_m: int, block_n: int, *, thresholds=None,
                              log_lambda: float | None = None, window: int | None = None, order: str = "forward",
                              dense: bool = False, out: torch.Tensor | None = None, nbuf: int | None = None,
                              producer: bool | None = None, chunk: int | None = None, meet: int | None = None,
                              late: bool | None = None):
    """``prefill_gluon.sparse_attention_gluon`` run by the warp-specialized kernel: same arguments and
    results (q [B, H, N, D], k/v [B, Hkv, N, D] -> (out [B, H, N, D], skipped [B, H] int64));
    ``gluon_supported`` must hold. producer: a 1-warp TMA producer partition (default per head dim,
    PRODUCER), else consumer warpgroup 0 issues the copies; nbuf: ring slots (default CONFIG); chunk:
    heads side by side in the grid (None: ``grid_chunk``); meet, late: ``ws_config``'s (late None:
    ``late_for``)."""
    grid, args, consts, out, skip = launch(q, k, v, scale, block_m, block_n, block_m // 2, thresholds,
                                           log_lambda, window, order, dense, out)
    grid, chunk = chunked_grid(grid, q, chunk)
    d = q.shape[-1]
    kw = ws_config(d, producer, nbuf, chunk, meet, late_for(d, consts["METHOD"], producer) if late is None else late)
    LAST_COMPILED["gluon"] = _ws_fwd_kernel[grid](*args, **consts, **kw)
    return out, skip.sum(dim=-1, dtype=torch.int64)
