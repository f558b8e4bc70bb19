"""Two query blocks a program for the Gluon Hopper prefill at head dim 64: each consumer warpgroup
owns a whole query block, so a tile's decision never waits for the other warpgroup.

Same semantics, arguments and results as ``prefill_gluon.sparse_attention_gluon`` (query blocks of
BM = 128 rows, the BSFA / BLASST-forward / window rule over all 128 rows of a block, identical skip
counts), for head dim 64 and key tiles of 64 rows; checked against the reference and timed on the GPU
by bench/prefill_gluon.py (``--variants gluon_pair``), built for sm_90 on CPU machines by
tests/test_prefill_gluon_pair.py.

Why (data/bench/NOTES.md, "prefill-gluon-ws" and "prefill-pair"): in the warp-specialized kernel the
two consumer warpgroups of a program split one block's 128 rows, so every decision (a max over the
128 rows) meets them through a shared-memory exchange; at D = 64, where a tile's tensor work is half
of D = 128's, that kernel with nothing skipped ran at 0.82-0.86 of its own skipping-off form. At
D = 64 one warpgroup holds a whole block (S [128, 64] and the accumulator [128, 64] in f32, 64 + 64
registers a thread), so here the decision is a reduction over the warpgroup's own 4 warps, and the
two warpgroups, each on its own block, run out of step: one's decision under the other's wgmma.

Measured on an H100 (NOTES.md "prefill-pair"): the decision now costs 8-11% of this kernel's own
skipping-off form (13-18% in the warp-specialized one), but that form is 0.90-0.93x the
warp-specialized kernel's (half the warpgroups per SM to hide latency); BSFA at 50% / 75% reaches
0.84-0.88 of the ideal against 0.81-0.85, so ``prefill_pick`` ran it for D = 64 BSFA calls expected
to skip a quarter of their tiles or more from s44 to s46. Since s46 every decision is a vote a warp
(``prefill_gluon._vote_decide``): 0.3-6 % faster again (NOTES.md "the decision by warp votes"). Since
s47 ``prefill_pick`` runs the ws kernel for every D = 64 call (level with this one where it was
picked, faster elsewhere; NOTES.md "prefill_pick at D = 64"); this kernel is a bench variant.

- Program p (heaviest first) owns query blocks 2p (warpgroup 0, the default partition) and 2p + 1
  (warpgroup 1, a worker) of one (batch, head); the last program of an odd block count has only 2p.
- One K/V ring serves both: a 1-warp producer copies the key tiles of the union of the two blocks'
  ranges, in order, into NBUF slots (ready barriers by TMA byte counts, empty barriers with one
  arrival per consumer warpgroup, K and V apart as in ``prefill_gluon_ws``). A warpgroup *passes*
  the ring's tiles outside its own block's range (block 2p reaches two fewer tiles, as BM = 2 BN;
  under a window block 2p + 1 starts two tiles later): it waits for the copies and releases them.
- A warpgroup releases a slot only after that slot's copy of the same use has landed (a skipped tile
  waits for its V): the two warpgroups run apart by up to NBUF tiles, and an empty barrier of count 2
  must not take one warpgroup's release of use n for the other's of use n - 1. The producer issued
  use n's copy only after use n - 1 was released by both, so waiting for the copy orders them.
- One program per SM: 12 warps (2 consumer warpgroups + the producer warp's padded warpgroup) at
  ``maxnreg`` registers, redistributed by setmaxnreg (CONFIG).
- ``two`` (``gluon_pair_two``, the form ``prefill_pick`` ran): the decided tiles go two a decision, both
  score tiles in flight (``_qk_two``) and one exchange of warp votes for both decisions
  (``prefill_gluon._vote_decide``); 3-4 % faster where tiles are skipped, 1-2 % slower with every tile
  kept, BLASST about level (NOTES.md "the paired kernel deciding two tiles in one reduction", s44).

Phases as in ``prefill_gluon_ws``: ring tile ordinal t (key tile lo + t) uses slot t % NBUF in use
n = t // NBUF; consumers wait ready with parity n & 1, the producer waits empty and ready with parity
(n - 1) & 1 before use n >= 1.

Shape legend
    B batch   H query heads   Hkv KV heads   N tokens   D head dim (64)   P = ceil(N/BM) query blocks
    Pt threshold positions   BM = 128 query rows a warpgroup (2 BM a program)   BN = 64 key rows a
    tile   NBUF ring slots
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from sparsecal.kernels.jit import LAST_COMPILED
from sparsecal.kernels.sparse.prefill_gluon import (
    _attend,
    _coords,
    _decided_vals,
    _qk,
    _scores,
    _tma_load,
    _vote_decide,
    launch,
)
from sparsecal.kernels.sparse.prefill_gluon_ws import (
    PRODUCER_REGS,
    _barriers,
    _block_range,
    _issue,
    _program,
    chunked_grid,
)

# The paired grid's heads side by side (``prefill_gluon_ws.grid_chunk``) up to N x D = CHUNK_UP_TO: at 16K 0-3 %
# ahead for BSFA and 3-4 % for BLASST, at 32K level to 2.5 % behind for BSFA at G = 1 (NOTES.md "heads side by
# side in chunks").
CHUNK_UP_TO = 16384 * 64
# One program per SM: 12 warps x 32 threads x 168 = 64512 of the SM's 65536 registers; setmaxnreg
# gives the producer warpgroup 24, the worker consumer 240, the default consumer the rest (240).
CONFIG = {"NBUF": 4, "maxnreg": 168, "WORKER_REGS": 240, "PRODUCER_REGS": PRODUCER_REGS, "TWO": False, "num_warps": 4}
HEAD_DIM, BLOCK_N = 64, 64  # the only geometry this kernel takes (BM = 128 as every Gluon kernel)


@gluon.jit
def _qk_two(q_smem, ring, t, qk_scale, BN: gl.constexpr, NBUF: gl.constexpr, s_layout: gl.constexpr):
    """(S [ROWS, BN] f32 of ring tiles t and t + 1, their row maxima in log2 units): both Q.K^T in
    flight once their K copies landed, each K slot released as soon as its product is done."""
    k_ring, _, k_ready, k_empty, _, _ = ring
    rows: gl.constexpr = q_smem.shape[0]
    d: gl.constexpr = q_smem.shape[1]
    zero = gl.zeros([rows, BN], gl.float32, s_layout)
    mbarrier.wait(k_ready.index(t % NBUF), (t // NBUF) & 1)
    s0 = warpgroup_mma(q_smem, k_ring.index(t % NBUF).reshape([BN, d]).permute((1, 0)), zero, use_acc=False,
                       is_async=True)
    mbarrier.wait(k_ready.index((t + 1) % NBUF), ((t + 1) // NBUF) & 1)
    s1 = warpgroup_mma(q_smem, k_ring.index((t + 1) % NBUF).reshape([BN, d]).permute((1, 0)), zero, use_acc=False,
                       is_async=True)
    s0 = warpgroup_mma_wait(1, deps=(s0,))
    mbarrier.arrive(k_empty.index(t % NBUF))
    m0 = gl.max(s0, 1) * qk_scale
    s1 = warpgroup_mma_wait(0, deps=(s1,))
    mbarrier.arrive(k_empty.index((t + 1) % NBUF))
    return s0, s1, m0, gl.max(s1, 1) * qk_scale


@gluon.jit
def _two_vals(m_i, m0, m1, row_ok, DECIDE: gl.constexpr):
    """The per-row decision values (``_decided_vals``) of two candidate tiles with row maxima m0, m1
    after the running max m_i: the first tile's, the second's with the first kept, and with the first
    skipped (BLASST's value depends on the running max, BSFA's does not)."""
    m_a = gl.maximum(m_i, m0)  # the running max after the first tile when it is kept
    return (_decided_vals(m0, m_a, row_ok, DECIDE), _decided_vals(m1, gl.maximum(m_a, m1), row_ok, DECIDE),
            _decided_vals(m1, gl.maximum(m_i, m1), row_ok, DECIDE))


@gluon.jit
def _step(carry, s, m_ij, keep, ring, t, qk_scale, NBUF: gl.constexpr, WAIT_SKIPPED: gl.constexpr,
          o_layout: gl.constexpr):
    """A decided candidate tile (ring ordinal t, never masked; m_ij its row maxima in log2 units)
    after its decision: kept, the online-softmax update and P.V (``_attend``); skipped, counted (with
    WAIT_SKIPPED once its V copy landed); then its V slot released."""
    acc, l_i, m_i, n_skip = carry
    _, v_ring, _, _, v_ready, v_empty = ring
    bn: gl.constexpr = s.shape[1]
    d: gl.constexpr = acc.shape[1]
    if keep:
        m_new = gl.maximum(m_i, m_ij)
        acc, l_i = _attend(s, m_i, m_new, l_i, acc, qk_scale, v_ring.index(t % NBUF).reshape([bn, d]),
                           v_ready.index(t % NBUF), (t // NBUF) & 1, False, o_layout)
        m_i = m_new
    else:
        if WAIT_SKIPPED:
            mbarrier.wait(v_ready.index(t % NBUF), (t // NBUF) & 1)
        n_skip += 1
    mbarrier.arrive(v_empty.index(t % NBUF))
    return acc, l_i, m_i, n_skip


@gluon.jit
def _pass(ring, t0, count, NBUF: gl.constexpr):
    """Release ring tiles t0 .. t0 + count - 1 unused, each once its K and V copies landed."""
    _, _, k_ready, k_empty, v_ready, v_empty = ring
    for u in range(count):
        slot = (t0 + u) % NBUF
        phase = ((t0 + u) // NBUF) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.arrive(k_empty.index(slot))
        mbarrier.wait(v_ready.index(slot), phase)
        mbarrier.arrive(v_empty.index(slot))


@gluon.jit
def _pair_tile(carry, q_smem, ring, xch, t, j, rows, row_ok, n_ctx, qk_scale, thr, MASKED: gl.constexpr,
               DECIDE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
               s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Key tile j (ring ordinal t) for this warpgroup's block: S = Q.K^T, release K, decide over its
    128 rows (DECIDE 0 compute, 1 BSFA, 2 BLASST), the online-softmax update and P.V when kept,
    release V. carry = (acc [BM, D] f32, l_i [BM], m_i [BM] (log2 units), n_skip)."""
    acc, l_i, m_i, n_skip = carry
    k_ring, v_ring, k_ready, k_empty, v_ready, v_empty = ring
    d: gl.constexpr = q_smem.shape[1]
    slot = t % NBUF
    phase = (t // NBUF) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    s = _qk(q_smem, k_ring.index(slot).reshape([BN, d]), BM, BN, s_layout)
    mbarrier.arrive(k_empty.index(slot))
    s, m_ij = _scores(s, j, rows, n_ctx, qk_scale, MASKED, BN, s_layout)
    m_new = gl.maximum(m_i, m_ij)
    keep = True
    if DECIDE != 0:
        vals = _decided_vals(m_ij, m_new, row_ok, DECIDE)
        keep = _vote_decide(xch, vals, vals, vals, thr, DECIDE, False, s_layout.warps_per_cta[0])[0]
    if keep:
        acc, l_i = _attend(s, m_i, m_new, l_i, acc, qk_scale, v_ring.index(slot).reshape([BN, d]),
                           v_ready.index(slot), phase, MASKED, o_layout)
        m_i = m_new
    else:
        mbarrier.wait(v_ready.index(slot), phase)  # see the module docstring: order the release
        n_skip += 1
    mbarrier.arrive(v_empty.index(slot))
    return acc, l_i, m_i, n_skip


@gluon.jit
def _pair_two(carry, q_smem, ring, xch, t, row_ok, qk_scale, thr, DECIDE: gl.constexpr, BN: gl.constexpr,
              NBUF: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Candidate tiles at ring ordinals t, t + 1 (never masked) for this warpgroup's block with one
    exchange for both decisions (``_vote_decide``); the same decisions, counts and arithmetic as two
    ``_pair_tile`` calls."""
    s0, s1, m0, m1 = _qk_two(q_smem, ring, t, qk_scale, BN, NBUF, s_layout)
    v0, v1k, v1s = _two_vals(carry[2], m0, m1, row_ok, DECIDE)
    keep0, keep1 = _vote_decide(xch, v0, v1k, v1s, thr, DECIDE, True, s_layout.warps_per_cta[0])
    carry = _step(carry, s0, m0, keep0, ring, t, qk_scale, NBUF, True, o_layout)
    return _step(carry, s1, m1, keep1, ring, t + 1, qk_scale, NBUF, True, o_layout)


@gluon.jit
def _pair_segment(carry, q_smem, ring, xch, t0, j0, count, rows, row_ok, n_ctx, qk_scale, thr,
                  MASKED: gl.constexpr, DECIDE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
                  TWO: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Key tiles j0 .. j0 + count - 1 at ring ordinals t0 ..; with TWO (decided tiles only) two tiles a
    decision (``_pair_two``), an odd last one alone (never at BM = 2 BN, where block i has 2 i
    candidates)."""
    if TWO and DECIDE != 0:
        for u in range(count // 2):
            carry = _pair_two(carry, q_smem, ring, xch, t0 + 2 * u, row_ok, qk_scale, thr, DECIDE, BN, NBUF, s_layout,
                              o_layout)
        for u in range(count % 2):
            carry = _pair_tile(carry, q_smem, ring, xch, t0 + count - 1, j0 + count - 1, rows, row_ok, n_ctx,
                               qk_scale, thr, MASKED, DECIDE, BM, BN, NBUF, s_layout, o_layout)
    else:
        for u in range(count):
            carry = _pair_tile(carry, q_smem, ring, xch, t0 + u, j0 + u, rows, row_ok, n_ctx, qk_scale, thr, MASKED,
                               DECIDE, BM, BN, NBUF, s_layout, o_layout)
    return carry


@gluon.jit
def _store(acc, l_i, q_tile, O, so_b, so_h, so_n, i, b, h, n_ctx, BM: gl.constexpr, NW: gl.constexpr,
           o_layout: gl.constexpr):
    """acc / l_i [BM, D] into rows i * BM .. of O [B, H, N, D] (by strides), through the block's
    (dead) Q tile q_tile [BM, D] in shared memory."""
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    q_tile.store(o.to(q_tile.dtype))
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    o = q_tile.load(out_layout)
    orow = i * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
    ocol = gl.arange(0, q_tile.shape[1], layout=gl.SliceLayout(0, out_layout))
    base = O + b.to(gl.int64) * so_b + h.to(gl.int64) * so_h
    gl.store(base + orow.to(gl.int64)[:, None] * so_n + ocol[None, :], o.to(O.dtype.element_ty),
             mask=(orow < n_ctx)[:, None])


@gluon.jit
def _pair_consumer(q_buf, q_bar, ring, xch, O, THR, SKIP, so_b, so_h, so_n, pair, b, h, bh, n_ctx, n_thr, lo, hi,
                   qk_scale, log_lambda2, window, METHOD: gl.constexpr, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
                   BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, NW: gl.constexpr, TWO: gl.constexpr):
    """One warpgroup on query block i = 2 pair + WG over ring tiles lo .. hi - 1: it passes those
    outside its block's range (all of them when the block is past N), then stores its rows and skip
    count (SKIP [B * H, P])."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    n_blocks = (n_ctx + BM - 1) // BM
    i = 2 * pair + WG
    j_lo, n_cand, n_reach = _block_range(i, n_ctx, window, METHOD, BM, BN)
    if i >= n_blocks:
        j_lo = hi
        n_cand = hi
        n_reach = hi
    thr = log_lambda2
    if METHOD == 1:
        thr = gl.load(THR + h * n_thr + gl.minimum(i, n_thr - 1)) * 1.4426950408889634
    rows = i * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    row_ok = rows < n_ctx
    acc = gl.zeros([BM, HEAD_DIM], gl.float32, o_layout)
    l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
    m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    carry = (acc, l_i, m_i, j_lo)
    mbarrier.wait(q_bar.index(0), 0)
    q_tile = q_buf.index(WG).reshape([BM, HEAD_DIM])
    DECIDE: gl.constexpr = METHOD if METHOD < 3 else 0
    _pass(ring, 0, j_lo - lo, NBUF)
    xch_wg = (xch, WG * 4)
    carry = _pair_segment(carry, q_tile, ring, xch_wg, j_lo - lo, j_lo, n_cand - j_lo, rows, row_ok, n_ctx,
                          qk_scale, thr, False, DECIDE, BM, BN, NBUF, TWO, s_layout, o_layout)
    carry = _pair_segment(carry, q_tile, ring, xch_wg, n_cand - lo, n_cand, n_reach - n_cand, rows, row_ok, n_ctx,
                          qk_scale, thr, True, 0, BM, BN, NBUF, TWO, s_layout, o_layout)
    _pass(ring, n_reach - lo, hi - n_reach, NBUF)
    acc, l_i, m_i, n_skip = carry
    if i < n_blocks:
        _store(acc, l_i, q_tile, O, so_b, so_h, so_n, i, b, h, n_ctx, BM, NW, o_layout)
        gl.store(SKIP + bh.to(gl.int64) * n_blocks + i, n_skip)


@gluon.jit
def _pair_producer(q_desc, q_buf, q_bar, ring, src, pair, h, num_heads, Q_ROWS: gl.constexpr,
                   KV_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                   NBUF: gl.constexpr):
    """1 warp: both query blocks (a block past N reads as zeros), then K and V of every ring tile in
    order, as fast as the ring frees."""
    mbarrier.expect(q_bar.index(0), 2 * q_desc.block_type.nbytes)
    for w in gl.static_range(2):
        _tma_load(q_desc, _coords(src[2], h, (2 * pair + w) * BM, Q_ROWS, num_heads, HEAD_DIM), q_bar.index(0),
                  q_buf.index(w))
    for t in range(src[6]):
        _issue(ring, src, t, True, True, KV_ROWS, HEAD_DIM, BN, NBUF)


@gluon.jit
def _pair_fwd_kernel(q_desc, k_desc, v_desc, O, THR, SKIP, so_b, so_h, so_n,
                     n_ctx, num_heads, num_kv, group, n_thr, qk_scale, log_lambda2, window,
                     METHOD: gl.constexpr, Q_ROWS: gl.constexpr, KV_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                     BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, WORKER_REGS: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr, TWO: gl.constexpr, CHUNK: gl.constexpr, num_warps: gl.constexpr):
    """Grid (ceil(P / 2) * CHUNK, B * H / CHUNK), heaviest pairs first, CHUNK heads side by side
    (``_program``); num_warps = 4: consumer warpgroup 0 (the
    default partition, block 2p), consumer warpgroup 1 (block 2p + 1, WORKER_REGS registers) and the
    1-warp producer (PRODUCER_REGS); TWO: decided tiles two a decision (``_pair_two``). Arguments as
    ``prefill_gluon._gluon_fwd_kernel``."""
    pair, bh = _program(CHUNK)
    b = bh // num_heads
    h = bh % num_heads
    n_blocks = (n_ctx + BM - 1) // BM
    lo = _block_range(2 * pair, n_ctx, window, METHOD, BM, BN)[0]
    hi = (gl.minimum((gl.minimum(2 * pair + 1, n_blocks - 1) + 1) * BM, n_ctx) - 1) // BN + 1
    dtype: gl.constexpr = q_desc.dtype
    q_buf = gl.allocate_shared_memory(dtype, [2, 1, BM, HEAD_DIM], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [NBUF, 1, BN, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [NBUF, 1, BN, HEAD_DIM], v_desc.layout)
    q_bar = _barriers(1, 1)
    xch = gl.allocate_shared_memory(gl.float32, [8, BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # votes: rows 4 WG ..
    k_ready = _barriers(NBUF, 1)
    v_ready = _barriers(NBUF, 1)
    k_empty = _barriers(NBUF, 2)  # one arrival (thread 0) per consumer warpgroup
    v_empty = _barriers(NBUF, 2)
    fence_async_shared()
    ring = (k_ring, v_ring, k_ready, k_empty, v_ready, v_empty)
    src = (k_desc, v_desc, b, h // group, num_kv, lo, hi - lo)
    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    gl.warp_specialize([
        (_pair_consumer, (q_buf, q_bar, ring, xch, O, THR, SKIP, so_b, so_h, so_n, pair, b, h, bh, n_ctx, n_thr, lo, hi,
                          qk_scale, log_lambda2, window, METHOD, WG0, HEAD_DIM, BM, BN, NBUF, num_warps, TWO)),
        (_pair_consumer, (q_buf, q_bar, ring, xch, O, THR, SKIP, so_b, so_h, so_n, pair, b, h, bh, n_ctx, n_thr, lo, hi,
                          qk_scale, log_lambda2, window, METHOD, WG1, HEAD_DIM, BM, BN, NBUF, num_warps, TWO)),
        (_pair_producer, (q_desc, q_buf, q_bar, ring, src, pair, h, num_heads, Q_ROWS, KV_ROWS, HEAD_DIM, BM, BN,
                          NBUF)),
    ], [num_warps, 1], [WORKER_REGS, PRODUCER_REGS])


def pair_config(nbuf: int | None = None, two: bool = False, chunk: int = 1) -> dict:
    """Launch constants of ``_pair_fwd_kernel[grid](...)``: CONFIG, with ``nbuf`` ring slots if given;
    ``two``: two decided tiles a decision; ``chunk``: heads side by side in the grid (``_program``)."""
    return dict(CONFIG, NBUF=nbuf or CONFIG["NBUF"], TWO=bool(two), CHUNK=int(chunk))


def sparse_attention_gluon_pair(q, k, v, scale: float, block_m: int, block_n: int, *, thresholds=None,
                                log_lambda: float | None = None, window: int | None = None, order: str = "forward",
                                dense: bool = False, out=None, nbuf: int | None = None, two: bool = False,
                                chunk: int | None = None):
    """``prefill_gluon.sparse_attention_gluon`` run two query blocks a program: same arguments and
    results (q [B, H, N, D], k/v [B, Hkv, N, D] -> (out [B, H, N, D], skipped [B, H] int64));
    ``gluon_supported`` must hold, with head dim 64 and block_n 64; ``two``: two decided tiles a
    decision (``_pair_two``); ``chunk``: heads side by side in the grid (None: ``grid_chunk`` up to
    CHUNK_UP_TO; ``chunked_grid``)."""
    if q.shape[-1] != HEAD_DIM or block_n != BLOCK_N:
        raise ValueError(f"the paired Gluon prefill kernel takes head dim {HEAD_DIM} and block_n {BLOCK_N} only, "
                         f"got {q.shape[-1]} and {block_n}: use prefill_pick.sparse_prefill")
    grid, args, consts, out, skip = launch(q, k, v, scale, block_m, block_n, block_m, thresholds, log_lambda,
                                           window, order, dense, out)
    grid, chunk = chunked_grid((triton.cdiv(grid[0], 2), grid[1]), q, chunk, CHUNK_UP_TO)
    LAST_COMPILED["gluon"] = _pair_fwd_kernel[grid](*args, **consts, **pair_config(nbuf, two, chunk))
    return out, skip.sum(dim=-1, dtype=torch.int64)
