"""Pieces shared by the Triton capture paths (two-pass ``instrumented``, ``single_order``, ``decode_rows``).

``qinit_max`` (jit): VFA's Q-init estimate of a row, the max over reachable key blocks of q . krep
(soft-capped like the scores when SOFTCAP).
``tile_offsets``: where each query block's tiles start in the packed per-row scratch.
``edge_args``: the gap and Q-init bin edges on the device, with (lo, 1/step, count).
``shortfall_args``: the negated, reversed shortfall edges on the device, with (lo, 1/step, count).
``pick``: [H, 3, ...] in geometry.ORDERS -> [H, O, ...] in the configured orders.
``hist_keys``: the in-kernel [H, W] histogram rows (HistLayout) as reduce_reference's keys.

Shape legend
    H query heads   N length   P = ceil(N/BM)   O configured scan orders   W histogram row width
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sparsecal.formats.geometry import ORDERS, block_counts
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.tilestats import HistLayout
from sparsecal.kernels.jit import dot, soft_cap

NEG_INF = float("-inf")


QINIT_CHUNK = 64  # key representatives per product in the q-init prologue


@triton.jit
def qinit_max(q, r_ptr, stride_rj, offs_d, n_reach, qk_scale, softcap,
               BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
               UPCAST: tl.constexpr):
    """[BLOCK_M] max over key blocks j < n_reach of q_r . krep_j * qk_scale (log2 units), capped
    (soft_cap, ``softcap`` in log2 units) when SOFTCAP: tanh is monotone, so capping the max is
    capping every product. r_ptr: this KV head's representatives [Kb, D], row stride stride_rj."""
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    offs_r = tl.arange(0, BLOCK_R)
    for c in range(0, n_reach, BLOCK_R):
        jr = c + offs_r
        ok = jr < n_reach
        kr = tl.load(r_ptr + jr[None, :] * stride_rj + offs_d[:, None], mask=ok[None, :], other=0.0)
        s = tl.where(ok[None, :], dot(q, kr, None, PREC, UPCAST) * qk_scale, float("-inf"))
        best = tl.maximum(best, tl.max(s, 1))
    if SOFTCAP:  # n_reach >= 1: best is finite
        best = soft_cap(best, softcap)
    return best


@functools.lru_cache(maxsize=64)
def tile_offsets(n: int, bm: int, bn: int, device) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Start of query block i's tiles in the packed scratch ([P] i64 on device), the count T of
    reachable tiles (tile (i, j) sits at offsets[i] + j), and A_i ([P] i64 on device). Cached, so
    a call makes no host-to-device copy (which would wait for the GPU)."""
    cand, reach = (torch.from_numpy(x) for x in block_counts(n, bm, bn))
    offsets = torch.zeros_like(reach)
    offsets[1:] = reach.cumsum(0)[:-1]
    return offsets.to(device), int(reach.sum()), cand.to(device)


@functools.lru_cache(maxsize=16)
def _edge_tables(gap_lo, gap_step, qinit_lo, qinit_hi, qinit_step, device) -> tuple:
    cfg = StatsConfig(gap_lo=gap_lo, gap_step=gap_step, qinit_lo=qinit_lo, qinit_hi=qinit_hi, qinit_step=qinit_step)
    return torch.from_numpy(cfg.gap_edges()).to(device), torch.from_numpy(cfg.qinit_edges()).to(device)


def edge_args(cfg: StatsConfig, device) -> tuple:
    """f64 edge tables (cached on the device) and (lo, 1/step, count) of the gap and q-init bins."""
    ge, qe = _edge_tables(cfg.gap_lo, cfg.gap_step, cfg.qinit_lo, cfg.qinit_hi, cfg.qinit_step, device)
    return (ge, qe, cfg.gap_lo, 1.0 / cfg.gap_step, ge.numel(), cfg.qinit_lo, 1.0 / cfg.qinit_step, qe.numel())


@functools.lru_cache(maxsize=16)
def _shortfall_table(hi, step, device) -> torch.Tensor:
    edges = StatsConfig(shortfall_hi=hi, shortfall_step=step).shortfall_edges()
    return torch.from_numpy(-edges[::-1].copy()).to(device)


def shortfall_args(cfg: StatsConfig, device) -> tuple:
    """(-edges[::-1] as an f64 table cached on the device, -shortfall_hi, 1/step, count): the
    shortfall bins of reduce_reference.rescale_reduce through tilestats.bucket's right=True rule
    (tilestats._shortfall_add)."""
    se = _shortfall_table(cfg.shortfall_hi, cfg.shortfall_step, device)
    return se, -cfg.shortfall_hi, 1.0 / cfg.shortfall_step, se.numel()


@functools.lru_cache(maxsize=16)
def _order_index(sel: tuple, device) -> torch.Tensor:
    return torch.tensor(sel, dtype=torch.int64).to(device)


def pick(t: torch.Tensor, cfg: StatsConfig) -> torch.Tensor:
    """[H, 3, ...] in geometry.ORDERS -> [H, O, ...] in cfg.orders (a slice, or an index cached on
    the device: a list index would be copied to the device and wait for it each call)."""
    sel = tuple(ORDERS.index(o) for o in cfg.orders)
    if sel == tuple(range(sel[0], sel[0] + len(sel))):
        return t if len(sel) == 3 else t[:, sel[0]:sel[0] + len(sel)]
    return t.index_select(1, _order_index(sel, t.device))


def _hist_section(part: torch.Tensor, cfg: StatsConfig, key: str, bins: int, per_order: int | None):
    """[H, W] histogram rows -> the [H, O, bins] (or [H, bins]) histogram under ``key``."""
    start = HistLayout.of(cfg).offsets[key]
    if per_order is None:
        return part[:, start:start + bins]
    sec = part[:, start:start + 3 * per_order].view(part.shape[0], 3, per_order)[..., :bins]
    return pick(sec, cfg)


def hist_keys(part: torch.Tensor, dpart: torch.Tensor, cfg: StatsConfig) -> dict:
    """reduce_tiles' histogram keys (gap, decode gap, diagonal and decode diagonal gap, t*, q-init,
    VFA joint statistic, rescale and shortfall counts; f64 masses) from the in-kernel [H, W] rows of
    the tiles (part) and of the decode rows (dpart)."""
    lay = HistLayout.of(cfg)
    part, dpart = part.double(), dpart.double()
    sf0 = lay.offsets["shortfall_count"]
    sf = part[:, sf0:sf0 + 6 * lay.sbp].view(part.shape[0], 3, 2, lay.sbp)
    return {
        "gap_count": _hist_section(part, cfg, "gap_count", lay.ng, lay.nbp).round().long(),
        "gap_mass": _hist_section(part, cfg, "gap_mass", lay.ng, lay.nbp).contiguous(),
        "decode_gap_count": _hist_section(dpart, cfg, "gap_count", lay.ng, lay.nbp).round().long(),
        "decode_gap_mass": _hist_section(dpart, cfg, "gap_mass", lay.ng, lay.nbp).contiguous(),
        "diag_gap_count": _hist_section(part, cfg, "diag_gap_count", lay.ng, lay.nbp).round().long(),
        "diag_gap_mass": _hist_section(part, cfg, "diag_gap_mass", lay.ng, lay.nbp).contiguous(),
        "decode_diag_gap_count": _hist_section(dpart, cfg, "diag_gap_count", lay.ng, lay.nbp).round().long(),
        "decode_diag_gap_mass": _hist_section(dpart, cfg, "diag_gap_mass", lay.ng, lay.nbp).contiguous(),
        "tstar_where": _hist_section(part, cfg, "tstar_where", 3, 4).round().long(),
        "tstar_hist": _hist_section(part, cfg, "tstar_hist", lay.nt, lay.tbp).round().long(),
        "qinit_count": _hist_section(part, cfg, "qinit_count", lay.nq, None).round().long(),
        "joint_count": _hist_section(part, cfg, "joint_count", lay.nq, None).round().long(),
        "rescale_count": _hist_section(part, cfg, "rescale_count", lay.nr, lay.rbp).round().long(),
        "rescale_excess": _hist_section(part, cfg, "rescale_excess", 1, 1)[..., 0].round().long(),
        "shortfall_count": pick(sf[..., :lay.ns], cfg).round().long(),
    }
