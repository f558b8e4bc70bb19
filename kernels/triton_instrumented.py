"""Instrumented causal attention in Triton: the output plus the tile statistics of DESIGN.md.

Same semantics and result as ``reference.instrumented_attention`` (the oracle), in four launches:

pass 1  ``_instr_fwd_kernel`` (grid P x heads): the dense flash forward of triton_dense (output,
        log-sum-exp) over the key blocks in ascending order, which also stores for every row and
        reachable tile the row's block max and block log-sum-exp (two f32 values a row, in a
        packed per-head scratch of the reachable tiles), and the VFA q-init estimate of every row
        (signed-absmax key representatives, a few extra [BM, 64] products).
pass 2  ``triton_tilestats._tile_stats_kernel`` (grid P x heads): reads those per-row values
        back in chunks of tiles and, reusing the log-sum-exp, computes bmax, mass, the gap in all
        three scan orders and t* of every row in every order (no score is recomputed), and in the
        capture path also adds the run's histograms (atomics into one row per head).
decode  ``_decode_kernel`` (grid Kb x row chunks x H): each of the last R rows' max score and mass
        in every key block; ``triton_tilestats._decode_stats_kernel`` turns them into the three
        orders' gaps (and histograms), each row its own block.

``instrumented_attention_triton`` returns the reference's TileStats; ``instrumented_capture_triton``
returns what kernels/reduce.py's ``reduce_tiles`` would make of them (same keys, shapes, dtypes)
with the histograms counted in the kernels, so long captures skip the [H, O, N] t* tensors and the
torch histogram passes. The scratch holds 2 * BM * (reachable tiles) f32 per head; heads run in
chunks that fit ``scratch_bytes``, so memory stays bounded at any length.

Shape legend
    H query heads   Hkv KV heads   N length   D head dim   P = ceil(N/BM)   Kb = ceil(N/BN)
    O = 3 scan orders in the canonical order of geometry.ORDERS   R decode rows   T reachable tiles
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .config import StatsConfig
from .geometry import ORDERS, block_counts, cdiv
from .reference import TileStats, _pad_blocks, signed_absmax_keys
from .triton_dense import LAST_COMPILED, LOG2E, _attend_range, _dot, check_inputs, dot_flags, next_pow2
from .triton_reduce import capture_reduce
from .triton_tilestats import HistLayout, _decode_stats_kernel, _tile_stats_kernel

NEG_INF = float("-inf")
TILE_CHUNK = 16  # tiles per chunk in the statistics pass
QINIT_CHUNK = 64  # key representatives per product in the q-init prologue
# (num_warps, num_stages) of pass 1 per head dim, and of the statistics / decode kernels.
PASS1_LAUNCH = {64: (8, 2), 128: (8, 3)}  # tuned on an H100 (data/bench/NOTES.md)
STATS_LAUNCH = (4, 1)
DECODE_LAUNCH = (4, 1)
EVICT_FIRST = False  # pass-1 scratch stores marked evict-first (launch={"evict_first": ...} overrides)


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
def _instr_fwd_kernel(Q, K, V, KREP, O, LSE, QERR, XY, TOFF,
                      sq_h, sq_n, sk_h, sk_n, sv_h, sv_n, sr_h, sr_j, so_h, so_n,
                      n_ctx, head0, group, num_tiles, qk_scale,
                      HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                      EVEN_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                      QINIT: tl.constexpr, STORE: tl.constexpr, EVICT: tl.constexpr):
    """Pass 1. Grid (P, heads of this chunk). Query block i = rows [i*BM, i*BM + BM) of head
    head0 + program_id(1). O [H, N, D] (strides so_h, so_n); LSE, QERR [H, N] f32 (natural log);
    XY [chunk heads, T, BLOCK_M, 2] f32 scratch (row block max, block log-sum-exp), tile (i, j) at
    TOFF[i] + j. QINIT / STORE off only
    to measure what the q-init prologue and the scratch stores cost."""
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
        m_init = _qinit_max(q, KREP + hk * sr_h, sr_j, offs_d, n_reach, qk_scale, BLOCK_M, BLOCK_R, PREC, UPCAST)
    tile0 = (hl.to(tl.int64) * num_tiles + tl.load(TOFF + i)) * (2 * BLOCK_M)
    xy_ptr = XY + tile0 + offs_m[:, None] * 2 + tl.arange(0, 2)[None, :]
    k_ptr = K + hk * sk_h
    v_ptr = V + hk * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, k_ptr, v_ptr, sk_n, sv_n, rows, offs_d, 0, n_cand,
                                  n_ctx, qk_scale, xy_ptr, BN, BLOCK_N, not EVEN_N, STORE, EVICT, PREC, UPCAST)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, k_ptr, v_ptr, sk_n, sv_n, rows, offs_d, n_cand, n_reach,
                                  n_ctx, qk_scale, xy_ptr, BN, BLOCK_N, True, STORE, EVICT, PREC, UPCAST)
    out = acc / l_i[:, None]
    tl.store(O + h * so_h + rows[:, None] * so_n + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + h * n_ctx + rows, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)
    if QINIT:
        tl.store(QERR + h * n_ctx + rows, (m_init - m_i) * 0.6931471805599453, mask=row_ok)


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
    lse, qinit_err [H, N] f32; with statistics also bmax, mass [H, P, Kb], gap [H, 3, P, Kb],
    tstar_step (i64) / tstar_where (i8) / tstar_norm (f32) [H, 3, N] (unless fused), and with
    fused histograms part [H, W] (HistLayout). Orders as geometry.ORDERS."""

    out: torch.Tensor
    lse: torch.Tensor
    qinit_err: torch.Tensor
    bmax: torch.Tensor | None = None
    mass: torch.Tensor | None = None
    gap: torch.Tensor | None = None
    tstar_step: torch.Tensor | None = None
    tstar_where: torch.Tensor | None = None
    tstar_norm: torch.Tensor | None = None
    part: torch.Tensor | None = None


@functools.lru_cache(maxsize=64)
def tile_offsets(n: int, bm: int, bn: int, device) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Start of query block i's tiles in the packed scratch ([P] i64 on device), the count T of
    reachable tiles (tile (i, j) sits at offsets[i] + j), and A_i ([P] i64 on device). Cached, so
    a call makes no host-to-device copy (which would wait for the GPU)."""
    cand, reach = block_counts(n, bm, bn)
    offsets = torch.zeros_like(reach)
    offsets[1:] = reach.cumsum(0)[:-1]
    return offsets.to(device), int(reach.sum()), cand.to(device)


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


def _stat_buffers(h: int, n: int, p: int, kb: int, device, fused: bool, width: int) -> dict:
    f32 = dict(dtype=torch.float32, device=device)
    out = dict(bmax=torch.full((h, p, kb), NEG_INF, **f32), mass=torch.zeros((h, p, kb), **f32),
               gap=torch.full((h, 3, p, kb), NEG_INF, **f32))
    if fused:
        out["part"] = torch.zeros((h, width), **f32)
    else:
        out.update(tstar_step=torch.empty((h, 3, n), dtype=torch.int64, device=device),
                   tstar_where=torch.empty((h, 3, n), dtype=torch.int8, device=device),
                   tstar_norm=torch.empty((h, 3, n), **f32))
    return out


@functools.lru_cache(maxsize=16)
def _edge_tables(gap_lo, gap_step, qinit_lo, qinit_hi, qinit_step, device) -> tuple:
    cfg = StatsConfig(gap_lo=gap_lo, gap_step=gap_step, qinit_lo=qinit_lo, qinit_hi=qinit_hi, qinit_step=qinit_step)
    return cfg.gap_edges().to(device), cfg.qinit_edges().to(device)


def _edge_args(cfg: StatsConfig, device) -> tuple:
    """f64 edge tables (cached on the device) and (lo, 1/step, count) of the gap and q-init bins."""
    ge, qe = _edge_tables(cfg.gap_lo, cfg.gap_step, cfg.qinit_lo, cfg.qinit_hi, cfg.qinit_step, device)
    return (ge, qe, cfg.gap_lo, 1.0 / cfg.gap_step, ge.numel(), cfg.qinit_lo, 1.0 / cfg.qinit_step, qe.numel())


def _tile_stats(res: ForwardResult, xy, toff, qerr, cfg, geom: dict, launch, fused: bool) -> None:
    """Launch pass 2 on one chunk of heads. geom: n, head0, heads, blocks, kb, num_tiles."""
    lay = HistLayout.of(cfg)
    off = lay.offsets
    ge, qe, g_lo, g_inv, n_ge, q_lo, q_inv, n_qe = _edge_args(cfg, res.lse.device)
    dummy = res.bmax
    warps, stages = _launch("stats", 0, launch)
    LAST_COMPILED["stats"] = _tile_stats_kernel[(geom["blocks"], geom["heads"])](
        xy, toff, res.lse, qerr, res.bmax, res.mass, res.gap,
        res.tstar_step if res.tstar_step is not None else dummy,
        res.tstar_where if res.tstar_where is not None else dummy,
        res.tstar_norm if res.tstar_norm is not None else dummy,
        res.part if res.part is not None else dummy, ge, qe,
        geom["n"], geom["head0"], geom["num_tiles"], geom["blocks"], geom["kb"],
        g_lo, g_inv, n_ge, q_lo, q_inv, n_qe,
        BM=cfg.block_m, BN=cfg.block_n, BLOCK_M=next_pow2(cfg.block_m),
        TJ=(launch or {}).get("tile_chunk", TILE_CHUNK), STORE_TSTAR=not fused, HIST=fused, HIST_ROWS=fused, W=off["width"], NBP=lay.nbp, OFF_TW=off["tstar_where"],
        OFF_TH=off["tstar_hist"], OFF_QI=off["qinit_count"], NT=lay.nt, TBP=lay.tbp, QBP=lay.qbp,
        num_warps=warps, num_stages=stages)


def instrumented_forward(q, k, v, scale: float, cfg: StatsConfig, stats: bool = True,
                         scratch_bytes: int | None = None, launch: dict | None = None,
                         fused: bool = False, parts: tuple = ("qinit", "scratch")) -> ForwardResult:
    """Passes 1 and 2 (pass 1 alone with stats=False). q [1, H, N, D], k/v [1, Hkv, N, D].

    fused: pass 2 counts the run's histograms (ForwardResult.part) instead of storing t*.
    ``launch`` overrides (num_warps, num_stages) per kernel, {"pass1": (w, s), "stats": (w, s)},
    the statistics pass's tiles per chunk, {"tile_chunk": TJ}, and {"evict_first": bool} for the
    pass-1 scratch stores. ``parts`` drops pass-1 work
    for cost measurements only ("qinit", "scratch").
    """
    _, h, hkv, n, d = check_inputs(q, k, v)
    if q.shape[0] != 1:
        raise ValueError("instrumented attention takes one sequence at a time (batch size 1)")
    bm, bn, dev = cfg.block_m, cfg.block_n, q.device
    p, kb = cdiv(n, bm), cdiv(n, bn)
    block_m = next_pow2(bm)
    toff, num_tiles, _ = tile_offsets(n, bm, bn, dev)
    krep = signed_absmax_keys(_pad_blocks(k[0], bn), bn)  # [Hkv, Kb, D]
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
            krep.stride(0), krep.stride(1), os_[0], os_[1], n, h0, h // hkv, num_tiles, scale * LOG2E,
            HEAD_DIM=d, BM=bm, BN=bn, BLOCK_M=block_m, BLOCK_N=next_pow2(bn), BLOCK_R=QINIT_CHUNK,
            EVEN_N=bn == next_pow2(bn), PREC=prec, UPCAST=upcast, QINIT="qinit" in parts,
            STORE="scratch" in parts, EVICT=(launch or {}).get("evict_first", EVICT_FIRST),
            num_warps=warps, num_stages=stages)
        if stats:
            geom = dict(n=n, head0=h0, heads=heads, blocks=p, kb=kb, num_tiles=num_tiles)
            _tile_stats(res, xy, toff, qerr, cfg, geom, launch, fused)
    return res


def decode_forward(q, k, lse: torch.Tensor, scale: float, cfg: StatsConfig, launch: dict | None = None,
                   fused: bool = False):
    """Decode-mode statistics of the last R = min(cfg.decode_rows, N) rows, each its own block.

    q [1, H, N, D], k [1, Hkv, N, D], lse [H, N] (natural log, from pass 1). Returns (rows [R],
    gap [H, 3, R, Kb] in geometry.ORDERS, mass [H, R, Kb], and with fused the candidate tiles' gap
    histograms [H, W] (HistLayout), else None) as reference.decode_tiles defines them.
    """
    _, h, n, d = q.shape
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
        warps, stages = _launch("decode", d, launch)
        _decode_kernel[(kb, cdiv(n_dec, block_r), h)](
            q, k, lse, rmax, mass, q.stride(1), q.stride(2), k.stride(1), k.stride(2), n, r_first, n_dec,
            h // k.shape[1], scale * LOG2E, kb, HEAD_DIM=d, BN=bn, BLOCK_N=next_pow2(bn), BLOCK_R=block_r,
            PREC=prec, UPCAST=upcast, num_warps=warps, num_stages=stages)
        ge, _, g_lo, g_inv, n_ge = _edge_args(cfg, dev)[:5]
        _decode_stats_kernel[(cdiv(n_dec, 16), h)](
            rmax, mass, gap, part if fused else gap, ge, r_first, n_dec, kb, g_lo, g_inv, n_ge,
            BN=bn, ROWS=16, TJ=32, W=lay.offsets["width"], NBP=lay.nbp, HIST=fused, num_warps=4, num_stages=1)
    return torch.arange(r_first, n, device=dev), gap, mass, part


@functools.lru_cache(maxsize=16)
def _order_index(sel: tuple, device) -> torch.Tensor:
    return torch.tensor(sel, dtype=torch.int64).to(device)


def _pick(t: torch.Tensor, cfg: StatsConfig) -> torch.Tensor:
    """[H, 3, ...] in geometry.ORDERS -> [H, O, ...] in cfg.orders (a slice, or an index cached on
    the device: a list index would be copied to the device and wait for it each call)."""
    sel = tuple(ORDERS.index(o) for o in cfg.orders)
    if sel == tuple(range(sel[0], sel[0] + len(sel))):
        return t if len(sel) == 3 else t[:, sel[0]:sel[0] + len(sel)]
    return t.index_select(1, _order_index(sel, t.device))


def instrumented_attention_triton(q, k, v, scale: float, cfg: StatsConfig, scratch_bytes: int | None = None,
                                  launch: dict | None = None):
    """Drop-in for ``reference.instrumented_attention`` on the Triton kernels.

    q [1, H, N, D], k/v [1, Hkv, N, D] (fp16/bf16; fp32 accepted). Returns (out [1, H, N, D] in
    q.dtype, TileStats with the reference's fields, shapes and dtypes, orders as cfg.orders).
    """
    res = instrumented_forward(q, k, v, scale, cfg, True, scratch_bytes, launch)
    rows, dec_gap, dec_mass, _ = decode_forward(q, k, res.lse, scale, cfg, launch)
    stats = TileStats(res.bmax, _pick(res.gap, cfg), res.mass, _pick(res.tstar_step, cfg),
                      _pick(res.tstar_where, cfg), _pick(res.tstar_norm, cfg), res.qinit_err,
                      _pick(dec_gap, cfg), dec_mass, rows)
    return res.out, stats


def _hist_section(part: torch.Tensor, cfg: StatsConfig, key: str, bins: int, per_order: int | None):
    """[H, W] histogram rows -> the [H, O, bins] (or [H, bins]) histogram under ``key``."""
    start = HistLayout.of(cfg).offsets[key]
    if per_order is None:
        return part[:, start:start + bins]
    sec = part[:, start:start + 3 * per_order].view(part.shape[0], 3, per_order)[..., :bins]
    return _pick(sec, cfg)


def hist_keys(part: torch.Tensor, dpart: torch.Tensor, cfg: StatsConfig) -> dict:
    """reduce_tiles' histogram keys (gap, decode gap, t* and q-init counts; f64 masses) from the
    in-kernel [H, W] rows of the tiles (part) and of the decode rows (dpart)."""
    lay = HistLayout.of(cfg)
    part, dpart = part.double(), dpart.double()
    return {
        "gap_count": _hist_section(part, cfg, "gap_count", lay.ng, lay.nbp).round().long(),
        "gap_mass": _hist_section(part, cfg, "gap_mass", lay.ng, lay.nbp).contiguous(),
        "decode_gap_count": _hist_section(dpart, cfg, "gap_count", lay.ng, lay.nbp).round().long(),
        "decode_gap_mass": _hist_section(dpart, cfg, "gap_mass", lay.ng, lay.nbp).contiguous(),
        "tstar_where": _hist_section(part, cfg, "tstar_where", 3, 4).round().long(),
        "tstar_hist": _hist_section(part, cfg, "tstar_hist", lay.nt, lay.tbp).round().long(),
        "qinit_count": _hist_section(part, cfg, "qinit_count", lay.nq, None).round().long(),
    }


def fused_reduce(res: ForwardResult, decode: tuple, n: int, cfg: StatsConfig) -> dict:
    """kernels/reduce.py's reduce_tiles output (same keys, shapes, dtypes) from the fused passes;
    decode = decode_forward(..., fused=True)'s result. No host sync (BSFA in triton_reduce)."""
    dev = res.bmax.device
    cand = tile_offsets(n, cfg.block_m, cfg.block_n, dev)[2]
    out = capture_reduce(res.bmax, res.mass, cand, cfg, _edge_args(cfg, dev))
    out.update(hist_keys(res.part, decode[3], cfg))
    if cfg.raw:
        out["raw_bmax"] = res.bmax.half()
        out["raw_gap"] = _pick(res.gap, cfg).half()
        out["raw_mass"] = res.mass.half()
    return out


def instrumented_capture_triton(q, k, v, scale: float, cfg: StatsConfig, scratch_bytes: int | None = None,
                                launch: dict | None = None, single_pass: bool | None = None):
    """The capture path: (out [1, H, N, D], the per-sample reductions of one call) with the
    histograms counted in the kernels; equal to reduce_tiles(instrumented_attention_triton(...)).

    single_pass (default: exactly one order in cfg.orders) runs triton_single_order's path (the
    single-pass forward for that order + the mass pass); otherwise passes 1 and 2 here, which
    compute all three orders at once."""
    if single_pass is None:
        single_pass = len(cfg.orders) == 1
    if single_pass:
        from .triton_single_order import single_order_capture_triton

        return single_order_capture_triton(q, k, v, scale, cfg, launch)
    res = instrumented_forward(q, k, v, scale, cfg, True, scratch_bytes, launch, fused=True)
    decode = decode_forward(q, k, res.lse, scale, cfg, launch, fused=True)
    return res.out, fused_reduce(res, decode, q.shape[2], cfg)
