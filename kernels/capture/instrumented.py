"""Instrumented causal attention in Triton: the output plus the tile statistics of DESIGN.md.

Same semantics and result as ``reference.instrumented_attention`` (the oracle), in four launches:

pass 1  ``_instr_fwd_kernel`` (grid P x heads): the dense flash forward of dense (output,
        log-sum-exp) over the key blocks in ascending order, which also stores for every row and
        reachable tile the row's block max and block log-sum-exp (two f32 values a row, in a
        packed per-head scratch of the reachable tiles), and the VFA q-init estimate of every row
        (signed-absmax key representatives, a few extra [BM, 64] products).
pass 2  ``tilestats.tile_stats_kernel`` (grid P x heads): reads those per-row values
        back in chunks of tiles and, reusing the log-sum-exp, computes bmax, mass, the gap in all
        three scan orders, t*, running-max rescales and shortfalls of every row in every order,
        VFA's joint statistic max(q-init, block 0 and diagonal max) - row max (no score is
        recomputed: both maxima are registers the sink_local scan keeps anyway), and in the
        capture path also adds the run's histograms (atomics into one row per head).
decode  ``_decode_kernel`` (grid Kb x row chunks x H): each of the last R rows' max score and mass
        in every key block; ``tilestats.decode_stats_kernel`` turns them into the three
        orders' gaps (and histograms), each row its own block.

``instrumented_attention_triton`` returns the reference's TileStats; ``instrumented_capture_triton``
returns what kernels/capture/reduce_reference.py's ``reduce_tiles`` would make of them (same keys, shapes, dtypes)
with the histograms counted in the kernels, so long captures skip the [H, O, N] t* tensors and the
torch histogram passes. The scratch holds 2 * BM * (reachable tiles) f32 per head; heads run in
chunks that fit ``scratch_bytes``, so memory stays bounded at any length. ``softcap`` caps every
score in pass 1 and the decode kernel (jit.soft_cap); pass 2 reads the capped per-row values.

Shape legend
    H query heads   Hkv KV heads   N length   D head dim   P = ceil(N/BM)   Kb = ceil(N/BN)
    O = 3 scan orders in the canonical order of geometry.ORDERS   R decode rows   T reachable tiles
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparsecal.formats.geometry import cdiv
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.common import (
    NEG_INF,
    QINIT_CHUNK,
    edge_args,
    hist_keys,
    pick,
    qinit_max,
    shortfall_args,
    tile_offsets,
)
from sparsecal.kernels.capture.decode_rows import decode_forward
from sparsecal.kernels.capture.reduce import capture_reduce
from sparsecal.kernels.capture.reduce_reference import decode_bsfa_reduce, group_gap_hist
from sparsecal.kernels.capture.reference import TileStats, pad_blocks, signed_absmax_keys
from sparsecal.kernels.capture.tilestats import HistLayout, tile_stats_kernel
from sparsecal.kernels.jit import (
    LAST_COMPILED,
    LOG2E,
    attend_range,
    check_fp32_tile,
    check_inputs,
    dot_flags,
    next_pow2,
    softcap_args,
)

TILE_CHUNK = 16  # tiles per chunk in the statistics pass
# (num_warps, num_stages) of pass 1 per head dim, and of the statistics / decode kernels.
# D = 256 (not yet timed; (8, 1) passed bench.check on an H100): BM = 128 rows of Q are 64 KiB
# (16-bit), each K, V tile 32 KiB, and Triton 3.6 gives every pipelined loop its own buffers.
# Compiled for sm_90 with Triton 3.6: 1 stage takes 128 KiB of shared memory, 2 stages 193 KiB (a
# candidate for a timing sweep), 3 stages 257 KiB (over an H100's 227 KiB).
PASS1_LAUNCH = {64: (8, 2), 128: (8, 3), 256: (8, 1)}  # 64/128 tuned on an H100 (data/bench/NOTES.md)
STATS_LAUNCH = (4, 1)
EVICT_FIRST = False  # pass-1 scratch stores marked evict-first (launch={"evict_first": ...} overrides)


@triton.jit
def _instr_fwd_kernel(Q, K, V, KREP, O, LSE, QERR, XY, TOFF,
                      sq_h, sq_n, sk_h, sk_n, sv_h, sv_n, sr_h, sr_j, so_h, so_n,
                      n_ctx, head0, group, num_tiles, qk_scale, softcap,
                      HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                      EVEN_N: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                      QINIT: tl.constexpr, STORE: tl.constexpr, EVICT: tl.constexpr):
    """Pass 1. Grid (P, heads of this chunk). Query block i = rows [i*BM, i*BM + BM) of head
    head0 + program_id(1). O [H, N, D] (strides so_h, so_n); LSE, QERR [H, N] f32 (natural log);
    XY [chunk heads, T, BLOCK_M, 2] f32 scratch (row block max, block log-sum-exp), tile (i, j) at
    TOFF[i] + j. SOFTCAP: every score (and the q-init estimate) capped at ``softcap`` (log2
    units). QINIT / STORE off only to measure what the q-init prologue and the scratch stores cost."""
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
    if QINIT:
        m_init = qinit_max(q, KREP + hk * sr_h, sr_j, offs_d, n_reach, qk_scale, softcap, BLOCK_M, BLOCK_R, SOFTCAP,
                           PREC, UPCAST)
    tile0 = (hl.to(tl.int64) * num_tiles + tl.load(TOFF + i)) * (2 * BLOCK_M)
    xy_ptr = XY + tile0 + offs_m[:, None] * 2 + tl.arange(0, 2)[None, :]
    k_ptr = K + hk * sk_h
    v_ptr = V + hk * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, l_i, m_i = attend_range(acc, l_i, m_i, q, k_ptr, v_ptr, sk_n, sv_n, rows, offs_d, 0, n_cand,
                                  n_ctx, qk_scale, softcap, xy_ptr, BN, BLOCK_N, not EVEN_N, STORE, EVICT, SOFTCAP,
                                  PREC, UPCAST)
    acc, l_i, m_i = attend_range(acc, l_i, m_i, q, k_ptr, v_ptr, sk_n, sv_n, rows, offs_d, n_cand, n_reach,
                                  n_ctx, qk_scale, softcap, xy_ptr, BN, BLOCK_N, True, STORE, EVICT, SOFTCAP,
                                  PREC, UPCAST)
    out = acc / l_i[:, None]
    tl.store(O + h * so_h + rows[:, None] * so_n + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + h * n_ctx + rows, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)
    if QINIT:
        tl.store(QERR + h * n_ctx + rows, (m_init - m_i) * 0.6931471805599453, mask=row_ok)


@dataclass
class ForwardResult:
    """What passes 1 and 2 return. out [1, H, N, D] (a [1, N, H, D] buffer seen transposed);
    lse, qinit_err [H, N] f32; with statistics also bmax, mass [H, P, Kb], gap [H, 3, P, Kb],
    tstar_step (i64) / tstar_where (i8) / tstar_norm (f32) / rescales (i64) [H, 3, N],
    shortfall (f32) [H, 3, 2, N] and joint_err (f32) [H, N] (unless fused), and with fused
    histograms part [H, W]
    (HistLayout). Orders as geometry.ORDERS."""

    out: torch.Tensor
    lse: torch.Tensor
    qinit_err: torch.Tensor
    bmax: torch.Tensor | None = None
    mass: torch.Tensor | None = None
    gap: torch.Tensor | None = None
    tstar_step: torch.Tensor | None = None
    tstar_where: torch.Tensor | None = None
    tstar_norm: torch.Tensor | None = None
    rescales: torch.Tensor | None = None
    shortfall: torch.Tensor | None = None
    joint_err: torch.Tensor | None = None
    part: torch.Tensor | None = None


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
    return STATS_LAUNCH


def _stat_buffers(h: int, n: int, p: int, kb: int, device, fused: bool, width: int) -> dict:
    f32 = dict(dtype=torch.float32, device=device)
    out = dict(bmax=torch.full((h, p, kb), NEG_INF, **f32), mass=torch.zeros((h, p, kb), **f32),
               gap=torch.full((h, 3, p, kb), NEG_INF, **f32))
    if fused:
        out["part"] = torch.zeros((h, width), **f32)
    else:
        out.update(tstar_step=torch.empty((h, 3, n), dtype=torch.int64, device=device),
                   tstar_where=torch.empty((h, 3, n), dtype=torch.int8, device=device),
                   tstar_norm=torch.empty((h, 3, n), **f32),
                   rescales=torch.empty((h, 3, n), dtype=torch.int64, device=device),
                   shortfall=torch.empty((h, 3, 2, n), **f32), joint_err=torch.empty((h, n), **f32))
    return out


def _tile_stats(res: ForwardResult, xy, toff, qerr, cfg, geom: dict, launch, fused: bool) -> None:
    """Launch pass 2 on one chunk of heads. geom: n, head0, heads, blocks, kb, num_tiles."""
    lay = HistLayout.of(cfg)
    off = lay.offsets
    ge, qe, g_lo, g_inv, n_ge, q_lo, q_inv, n_qe = edge_args(cfg, res.lse.device)
    se, s_lo, s_inv, n_se = shortfall_args(cfg, res.lse.device)
    dummy = res.bmax
    per_row = [x if x is not None else dummy for x in
               (res.tstar_step, res.tstar_where, res.tstar_norm, res.rescales, res.shortfall)]
    warps, stages = _launch("stats", 0, launch)
    LAST_COMPILED["stats"] = tile_stats_kernel[(geom["blocks"], geom["heads"])](
        xy, toff, res.lse, qerr, dummy if res.joint_err is None else res.joint_err, res.bmax, res.mass, res.gap,
        *per_row,
        res.part if res.part is not None else dummy, ge, qe, se,
        geom["n"], geom["head0"], geom["num_tiles"], geom["blocks"], geom["kb"],
        g_lo, g_inv, n_ge, q_lo, q_inv, n_qe, s_lo, s_inv, n_se,
        BM=cfg.block_m, BN=cfg.block_n, BLOCK_M=next_pow2(cfg.block_m),
        TJ=(launch or {}).get("tile_chunk", TILE_CHUNK), STORE_TSTAR=not fused, HIST=fused, HIST_ROWS=fused, W=off["width"], NBP=lay.nbp, OFF_TW=off["tstar_where"],
        OFF_TH=off["tstar_hist"], OFF_QI=off["qinit_count"], NT=lay.nt, TBP=lay.tbp, QBP=lay.qbp,
        **lay.launch_args(), num_warps=warps, num_stages=stages)


def instrumented_forward(q, k, v, scale: float, cfg: StatsConfig, stats: bool = True,
                         scratch_bytes: int | None = None, launch: dict | None = None,
                         fused: bool = False, parts: tuple = ("qinit", "scratch"), *,
                         softcap: float = 0.0) -> ForwardResult:
    """Passes 1 and 2 (pass 1 alone with stats=False). q [1, H, N, D], k/v [1, Hkv, N, D];
    softcap: the cap c of c * tanh(s / c) on every scaled score (0 or None: off).

    fused: pass 2 counts the run's histograms (ForwardResult.part) instead of storing t*.
    ``launch`` overrides (num_warps, num_stages) per kernel, {"pass1": (w, s), "stats": (w, s)},
    the statistics pass's tiles per chunk, {"tile_chunk": TJ}, and {"evict_first": bool} for the
    pass-1 scratch stores. ``parts`` drops pass-1 work
    for cost measurements only ("qinit", "scratch").
    """
    _, h, hkv, n, d = check_inputs(q, k, v)
    if q.shape[0] != 1:
        raise ValueError("instrumented attention takes one sequence at a time (batch size 1)")
    check_fp32_tile(q, cfg.block_m, "the Triton capture")
    cap_on, cap = softcap_args(softcap)
    bm, bn, dev = cfg.block_m, cfg.block_n, q.device
    p, kb = cdiv(n, bm), cdiv(n, bn)
    block_m = next_pow2(bm)
    toff, num_tiles, _ = tile_offsets(n, bm, bn, dev)
    krep = signed_absmax_keys(pad_blocks(k[0], bn), bn)  # [Hkv, Kb, D]
    out = torch.empty((1, n, h, d), dtype=q.dtype, device=dev).transpose(1, 2)
    lse = torch.empty((h, n), dtype=torch.float32, device=dev)
    qerr = torch.empty((h, n), dtype=torch.float32, device=dev)
    width = HistLayout.of(cfg).offsets["width"]
    res = ForwardResult(out, lse, qerr, **(_stat_buffers(h, n, p, kb, dev, fused, width) if stats else {}))
    chunk = max(1, min(h, (scratch_bytes or scratch_budget(dev)) // (2 * num_tiles * block_m * 4)))
    chunk = cdiv(h, cdiv(h, chunk))
    xy = torch.empty((chunk, num_tiles, block_m, 2), dtype=torch.float32, device=dev)
    prec, upcast = dot_flags(q.dtype)
    warps, stages = _launch("pass1", d, launch)
    qs, ks, vs, os_ = q[0].stride(), k[0].stride(), v[0].stride(), out[0].stride()
    for h0 in range(0, h, chunk):
        heads = min(chunk, h - h0)
        LAST_COMPILED["pass1"] = _instr_fwd_kernel[(p, heads)](
            q, k, v, krep, out, lse, qerr, xy, toff, qs[0], qs[1], ks[0], ks[1], vs[0], vs[1],
            krep.stride(0), krep.stride(1), os_[0], os_[1], n, h0, h // hkv, num_tiles, scale * LOG2E, cap,
            HEAD_DIM=d, BM=bm, BN=bn, BLOCK_M=block_m, BLOCK_N=next_pow2(bn), BLOCK_R=QINIT_CHUNK,
            EVEN_N=bn == next_pow2(bn), SOFTCAP=cap_on, PREC=prec, UPCAST=upcast, QINIT="qinit" in parts,
            STORE="scratch" in parts, EVICT=(launch or {}).get("evict_first", EVICT_FIRST),
            num_warps=warps, num_stages=stages)
        if stats:
            geom = dict(n=n, head0=h0, heads=heads, blocks=p, kb=kb, num_tiles=num_tiles)
            _tile_stats(res, xy, toff, qerr, cfg, geom, launch, fused)
    return res


def instrumented_attention_triton(q, k, v, scale: float, cfg: StatsConfig, scratch_bytes: int | None = None,
                                  launch: dict | None = None, *, softcap: float = 0.0):
    """Drop-in for ``reference.instrumented_attention`` on the Triton kernels.

    q [1, H, N, D], k/v [1, Hkv, N, D] (fp16/bf16; fp32 accepted); softcap as the reference's.
    Returns (out [1, H, N, D] in q.dtype, TileStats with the reference's fields, shapes and dtypes,
    orders as cfg.orders).
    """
    res = instrumented_forward(q, k, v, scale, cfg, True, scratch_bytes, launch, softcap=softcap)
    rows, dec_gap, dec_mass, _, dec_bmax = decode_forward(q, k, res.lse, scale, cfg, launch, softcap=softcap)
    stats = TileStats(res.bmax, pick(res.gap, cfg), res.mass, pick(res.tstar_step, cfg),
                      pick(res.tstar_where, cfg), pick(res.tstar_norm, cfg), res.qinit_err,
                      pick(dec_gap, cfg), dec_mass, rows, pick(res.rescales, cfg), pick(res.shortfall, cfg),
                      dec_bmax=dec_bmax, joint_err=res.joint_err, group=q.shape[1] // k.shape[1])
    return res.out, stats


def fused_reduce(res: ForwardResult, decode: tuple, n: int, cfg: StatsConfig, group: int = 1) -> dict:
    """kernels/capture/reduce_reference.py's reduce_tiles output (same keys, shapes, dtypes) from the fused passes;
    decode = decode_forward(..., fused=True)'s result; ``group`` G = H / Hkv. No host sync (BSFA in reduce)."""
    dev = res.bmax.device
    cand = tile_offsets(n, cfg.block_m, cfg.block_n, dev)[2]
    edges = edge_args(cfg, dev)
    out = capture_reduce(res.bmax, res.mass, cand, cfg, edges)
    out.update(decode_bsfa_reduce(decode[4], decode[2], n, cfg))
    out.update(hist_keys(res.part, decode[3], cfg))
    out.update(group_gap_hist(pick(decode[1], cfg), decode[2], decode[0], group, edges[0], cfg.block_n))
    if cfg.raw:
        out["raw_bmax"] = res.bmax.half()
        out["raw_gap"] = pick(res.gap, cfg).half()
        out["raw_mass"] = res.mass.half()
    return out


def instrumented_capture_triton(q, k, v, scale: float, cfg: StatsConfig, scratch_bytes: int | None = None,
                                launch: dict | None = None, *, softcap: float = 0.0, mark=None):
    """The two-pass capture path: (out [1, H, N, D], the per-sample reductions of one call) with the
    histograms counted in the kernels; equal to reduce_tiles(instrumented_attention_triton(...)).
    All three orders are computed at once (``pipeline.capture_triton`` picks this path for two or
    three configured orders). softcap as in instrumented_forward; ``mark()`` (optional) is called
    between the kernels and the reductions."""
    res = instrumented_forward(q, k, v, scale, cfg, True, scratch_bytes, launch, fused=True, softcap=softcap)
    decode = decode_forward(q, k, res.lse, scale, cfg, launch, fused=True, softcap=softcap)
    if mark is not None:
        mark()
    return res.out, fused_reduce(res, decode, q.shape[2], cfg, q.shape[1] // k.shape[1])
