"""Device reductions of the Triton capture paths in one launch: BSFA kept/skipped, and for the
single-order path the gap, t* and q-init histograms (kernels/capture/reduce_reference.py's semantics).

``_capture_reduce_kernel`` (grid P x H) reads one query block's row of tiles once:

- BSFA: with the thresholds of reduce.bsfa_thresholds (torch.topk, no host sync), the kept count
  A_i - #(candidates with bmax < threshold) and the skipped mass, for every k at once;
- ORDER >= 0 (single-order capture): the gap histograms (count and mass) of that order of the
  candidate tiles (j < A_i) and of the diagonal tiles (A_i <= j < R_i), and the block's rows:
  t* where-category and normalized-t* counts, q-init error and VFA joint-statistic counts (one
  bucket and one atomic add per row each) and running-max rescale /
  shortfall counts (tilestats.row_scan_stats), added with atomics into the histogram row of the
  head (tilestats.HistLayout, at the order's slot of geometry.ORDERS), bins exactly
  torch.bucketize's (f64 edge tables).

Shape legend: H heads, P query blocks, Kb key blocks, N length, K = len(k_values), W histogram
entries per head.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsecal.formats.geometry import ORDERS
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.common import shortfall_args
from sparsecal.kernels.capture.reduce_reference import bsfa_thresholds, top_mass
from sparsecal.kernels.capture.tilestats import HistLayout, bucket, count_bins, hist_add, row_scan_stats

TJ = 64  # tiles per chunk


@triton.jit
def _diag_hist(gap_ptr, mass_ptr, cnt_ptr, sum_ptr, n_cand, n_reach, GEDGES, g_lo, g_inv, n_gedges,
               TJ: tl.constexpr):
    """Gap histogram of a query block's diagonal tiles n_cand <= j < n_reach (gaps at gap_ptr + j,
    masses at mass_ptr + j): counts added at cnt_ptr + bin, masses at sum_ptr + bin."""
    for j0 in range(n_cand, n_reach, TJ):
        jt = j0 + tl.arange(0, TJ)
        ok = jt < n_reach
        m = tl.load(mass_ptr + jt, mask=ok, other=0.0)
        g = tl.load(gap_ptr + jt, mask=ok, other=0.0)
        hist_add(cnt_ptr, sum_ptr, bucket(g, GEDGES, g_lo, g_inv, n_gedges), m, ok)


@triton.jit
def _tstar_counts(TWHERE, TSTEP, r, row_ok, n_reach, part_w, part_t, NT: tl.constexpr, TBP: tl.constexpr):
    """The rows r [BLOCK_M] (valid row_ok) counted into 4 t* where bins at part_w and TBP
    normalized-t* bins at part_t (reference.tstar_norm: step / max(n_reach - 1, 1))."""
    where = tl.load(TWHERE + r, mask=row_ok, other=0).to(tl.int32)
    hit = (where[:, None] == tl.arange(0, 4)[None, :]) & row_ok[:, None]
    w = tl.sum(hit.to(tl.float32), 0)
    tl.atomic_add(part_w + tl.arange(0, 4), w, mask=w > 0, sem="relaxed")
    step = tl.load(TSTEP + r, mask=row_ok, other=0)
    norm = step.to(tl.float32) / tl.maximum(n_reach - 1, 1).to(tl.float32)
    tb = tl.minimum(tl.floor(norm * NT).to(tl.int32), NT - 1)
    hit = (tb[:, None] == tl.arange(0, TBP)[None, :]) & row_ok[:, None]
    t = tl.sum(hit.to(tl.float32), 0)
    tl.atomic_add(part_t + tl.arange(0, TBP), t, mask=t > 0, sem="relaxed")


@triton.jit
def _capture_reduce_kernel(BMAX, MASS, THR, KEPT, SKIP, GAP, TSTEP, TWHERE, QERR, JERR, RESC, SHORT, PART, GEDGES,
                           QEDGES,
                           SEDGES, n_ctx, n_qb, n_kb, n_k, g_lo, g_inv, n_gedges, q_lo, q_inv, n_qedges,
                           s_lo, s_inv, n_sedges,
                           BM: tl.constexpr, BN: tl.constexpr, BLOCK_M: tl.constexpr, TJ: tl.constexpr,
                           KP: tl.constexpr, ORDER: tl.constexpr, W: tl.constexpr, NBP: tl.constexpr,
                           OFF_TW: tl.constexpr, OFF_TH: tl.constexpr, OFF_QI: tl.constexpr,
                           NT: tl.constexpr, TBP: tl.constexpr, OFF_RC: tl.constexpr, OFF_RX: tl.constexpr,
                           OFF_SF: tl.constexpr, NR: tl.constexpr, RBP: tl.constexpr, SBP: tl.constexpr,
                           OFF_DG: tl.constexpr, OFF_JI: tl.constexpr):
    """Grid (P, H). BMAX, MASS, GAP [H, P, Kb] f32 (GAP: the one order's); THR [H, P, K] f32;
    KEPT [H, P, K] i64, SKIP [H, P, K] f32 (written); TSTEP, RESC [H, N] i32, TWHERE [H, N] i8, QERR,
    JERR [H, N] f32 (q-init error, VFA's joint statistic), SHORT [H, 2, N] f32; PART [H, W] f32
    (zeroed by the caller, added into). ORDER -1: BSFA only."""
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    n_cand = (i * BM) // BN
    tiles = (h * n_qb + i) * n_kb
    offs_k = tl.arange(0, KP)
    k_ok = offs_k < n_k
    kp = (h * n_qb + i) * n_k + offs_k
    thr = tl.load(THR + kp, mask=k_ok, other=float("-inf"))
    below_n = tl.zeros([KP], tl.int32)
    below_m = tl.zeros([KP], tl.float32)
    part = PART + h * W
    for j0 in range(0, n_cand, TJ):
        jt = j0 + tl.arange(0, TJ)
        ok = jt < n_cand
        b = tl.load(BMAX + tiles + jt, mask=ok, other=float("inf"))  # never below a threshold
        m = tl.load(MASS + tiles + jt, mask=ok, other=0.0)
        below = b[:, None] < thr[None, :]
        below_n += tl.sum(below.to(tl.int32), 0)
        below_m += tl.sum(tl.where(below, m[:, None], 0.0), 0)
        if ORDER >= 0:
            g = tl.load(GAP + tiles + jt, mask=ok, other=0.0)
            hist_add(part + ORDER * NBP, part + (3 + ORDER) * NBP, bucket(g, GEDGES, g_lo, g_inv, n_gedges), m, ok)
    tl.store(KEPT + kp, (n_cand - below_n).to(tl.int64), mask=k_ok)
    tl.store(SKIP + kp, below_m, mask=k_ok)
    if ORDER >= 0:
        n_reach = (tl.minimum((i + 1) * BM, n_ctx) - 1) // BN + 1
        _diag_hist(GAP + tiles, MASS + tiles, part + OFF_DG + ORDER * NBP, part + OFF_DG + (3 + ORDER) * NBP,
                   n_cand, n_reach, GEDGES, g_lo, g_inv, n_gedges, TJ)
        offs_m = tl.arange(0, BLOCK_M)
        rows = i * BM + offs_m
        row_ok = (offs_m < BM) & (rows < n_ctx)
        r = h * n_ctx + rows
        _tstar_counts(TWHERE, TSTEP, r, row_ok, n_reach, part + OFF_TW + 4 * ORDER, part + OFF_TH + ORDER * TBP,
                      NT, TBP)
        count_bins(tl.load(QERR + r, mask=row_ok, other=0.0), row_ok, part + OFF_QI, QEDGES, q_lo, q_inv, n_qedges)
        count_bins(tl.load(JERR + r, mask=row_ok, other=0.0), row_ok, part + OFF_JI, QEDGES, q_lo, q_inv, n_qedges)
        resc = tl.load(RESC + r, mask=row_ok, other=0)
        sf = SHORT + 2 * h * n_ctx + rows
        sf1 = tl.load(sf, mask=row_ok, other=0.0)
        sf2 = tl.load(sf + n_ctx, mask=row_ok, other=0.0)
        row_scan_stats(resc, sf1, sf2, row_ok, RESC, SHORT, n_ctx, part, ORDER, SEDGES, s_lo, s_inv, n_sedges,
                       OFF_RC, OFF_RX, OFF_SF, False, True, NR, RBP, SBP)


def capture_reduce(bmax, mass, cand, cfg: StatsConfig, edges: tuple, order: str | None = None,
                   gap=None, tstep=None, twhere=None, qerr=None, part=None, resc=None, short=None,
                   jerr=None) -> dict:
    """reduce.bsfa_reduce's six BSFA keys (same values, shapes, dtypes; skipped mass summed in
    another order, so equal to float rounding) with no host sync: the thresholds by
    reduce.bsfa_thresholds, the counts in the kernel. bmax, mass [H, P, Kb]; cand [P] on the
    device. With ``order``: also adds that order's gap histogram (gap [H, P, Kb]) and the row
    histograms (tstep [H, N] i32, twhere [H, N] i8, qerr [H, N], resc [H, N] i32 rescales, short
    [H, 2, N] shortfalls, jerr [H, N] VFA's joint statistic) into part [H, W]
    (instrumented.edge_args gives ``edges``)."""
    h, p, kb = bmax.shape
    thr, top, cmask, top_idx = bsfa_thresholds(bmax, cand, cfg)
    tmass, cmass = top_mass(mass, top, top_idx, cmask)
    kept = torch.empty(thr.shape, dtype=torch.int64, device=bmax.device)
    skipped = torch.empty_like(thr)
    lay = HistLayout.of(cfg)
    off = lay.offsets
    ge, qe, g_lo, g_inv, n_ge, q_lo, q_inv, n_qe = edges
    o = -1 if order is None else ORDERS.index(order)
    se, s_lo, s_inv, n_se = shortfall_args(cfg, bmax.device)
    if order is None:
        gap = tstep = twhere = qerr = part = resc = short = jerr = bmax  # unused
        n = cfg.block_m * p
    else:
        n = tstep.shape[1]
    _capture_reduce_kernel[(p, h)](
        bmax, mass, thr, kept, skipped, gap, tstep, twhere, qerr, jerr, resc, short, part, ge, qe, se,
        n, p, kb, thr.shape[-1], g_lo, g_inv, n_ge, q_lo, q_inv, n_qe, s_lo, s_inv, n_se,
        BM=cfg.block_m, BN=cfg.block_n, BLOCK_M=triton.next_power_of_2(cfg.block_m), TJ=TJ,
        KP=max(2, triton.next_power_of_2(thr.shape[-1])), ORDER=o, W=off["width"], NBP=lay.nbp,
        OFF_TW=off["tstar_where"], OFF_TH=off["tstar_hist"], OFF_QI=off["qinit_count"], NT=lay.nt, TBP=lay.tbp,
        **lay.launch_args(), num_warps=4, num_stages=1)
    return {"bsfa_threshold": thr, "bsfa_kept": kept, "bsfa_skipped_mass": skipped, "bsfa_top_bmax": top,
            "bsfa_top_mass": tmass, "bsfa_cand_mass": cmass}

