"""Pass 2 of the Triton instrumented attention: tile statistics from per-row tile values.

Pass 1 (kernels/capture/instrumented.py) leaves, for every row r of a query block and every
reachable key block j, the row's block max X[r, j] and block log-sum-exp Y[r, j] (log2 units),
as (X, Y) pairs. ``tile_stats_kernel`` (one program per query block and head) reads them back in
chunks of TJ tiles, [TJ, BLOCK_M] at a time, and with the rows' final log-sum-exp computes:

- bmax[j] = max_r X, mass[j] = mean_r exp2(Y - lse2);
- gap[j] in the three scan orders: forward (prefix running max), reverse (suffix running max,
  a second sweep) and sink_local (block 0, diagonal blocks, then the other candidates: the
  running max of a later candidate also holds the diagonal max D, found first);
- t* of every row in every order: the row's argmax over tiles with each order's tie rule;
- running-max rescales of every row in every order (the tiles that set a strict new running max,
  found by a (max, first index) scan), and the shortfall of the running max after the first and
  the first geometry.local_prefix scanned blocks;
- optionally (HIST) the additive histograms of kernels/capture/reduce_reference.py: gap counts
  and masses of the candidate tiles and of the diagonal tiles per order, t* where /
  normalized-t* counts, the q-init error counts, VFA's joint statistic counts (max(q-init, block 0
  and diagonal max) - row max, on the q-init bins) and the rescale / shortfall counts, added with
  atomics into one f32 row per head (counts stay exact below 2^24). Bins follow
  torch.bucketize(v.double(), edges, right=True) exactly (an f64 edge table corrects the guess).

Shape legend: H heads, P query blocks, Kb key blocks, N length, W = HistLayout.width histogram
entries per head.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.jit import max_fn


@dataclass(frozen=True)
class HistLayout:
    """Sections of one head's histogram row (f32, counts exact up to 2^24):
    gap counts [3, NBP], gap masses [3, NBP], t* where [3, 4], t* hist [3, TBP], q-init [QBP],
    rescale counts [3, RBP], rescale excess [4], shortfall counts [3, 2, SBP], diagonal-tile gap
    counts [3, NBP] and masses [3, NBP], VFA joint-statistic counts [QBP] on the q-init bins (orders
    as geometry.ORDERS; NBP, TBP, QBP, RBP, SBP the bin counts rounded up to powers of two). The diagonal sections repeat the gap sections' layout, so
    a kernel adds a tile at ``OFF_DG`` (diagonal) or 0 (candidate) plus the same relative offset."""

    ng: int
    nq: int
    nt: int
    nr: int
    ns: int

    @classmethod
    def of(cls, cfg: StatsConfig) -> HistLayout:
        return cls(len(cfg.gap_edges()) + 1, len(cfg.qinit_edges()) + 1, cfg.tstar_bins, cfg.rescale_bins,
                   len(cfg.shortfall_edges()) + 1)

    @property
    def nbp(self) -> int:
        return triton.next_power_of_2(self.ng)

    @property
    def tbp(self) -> int:
        return triton.next_power_of_2(self.nt)

    @property
    def qbp(self) -> int:
        return triton.next_power_of_2(self.nq)

    @property
    def rbp(self) -> int:
        return triton.next_power_of_2(self.nr)

    @property
    def sbp(self) -> int:
        return triton.next_power_of_2(self.ns)

    @property
    def offsets(self) -> dict:
        gc, gm = 0, 3 * self.nbp
        tw = 6 * self.nbp
        th = tw + 12
        qi = th + 3 * self.tbp
        rc = qi + self.qbp
        rx = rc + 3 * self.rbp
        sf = rx + 4
        dg = sf + 6 * self.sbp
        return {"gap_count": gc, "gap_mass": gm, "tstar_where": tw, "tstar_hist": th, "qinit_count": qi,
                "rescale_count": rc, "rescale_excess": rx, "shortfall_count": sf, "diag_gap_count": dg,
                "diag_gap_mass": dg + 3 * self.nbp, "joint_count": dg + 6 * self.nbp,
                "width": dg + 6 * self.nbp + self.qbp}

    def launch_args(self) -> dict:
        """The rescale / shortfall / diagonal-gap sections as the kernels' constexpr arguments."""
        off = self.offsets
        return dict(OFF_RC=off["rescale_count"], OFF_RX=off["rescale_excess"], OFF_SF=off["shortfall_count"],
                    NR=self.nr, RBP=self.rbp, SBP=self.sbp, OFF_DG=off["diag_gap_count"], OFF_JI=off["joint_count"])


@triton.jit
def _load_tiles(base, j0, n_reach, row_ok, TJ: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block maxima of tiles j0 .. j0+TJ-1 (pairs at base + (j*BLOCK_M + row)*2): ([TJ, BLOCK_M],
    -inf outside 0 <= j < n_reach and on invalid rows; jt [TJ] tile indices; ok [TJ] in range)."""
    jt = j0 + tl.arange(0, TJ)
    ok = (jt >= 0) & (jt < n_reach)
    ptr = base + (jt[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]) * 2
    return tl.load(ptr, mask=ok[:, None] & row_ok[None, :], other=float("-inf")), jt, ok


@triton.jit
def _load_pairs(base, j0, n_reach, row_ok, TJ: tl.constexpr, BLOCK_M: tl.constexpr):
    """Both values of tiles j0 .. j0+TJ-1: (x, y [TJ, BLOCK_M], jt, ok) as in _load_tiles."""
    jt = j0 + tl.arange(0, TJ)
    ok = (jt >= 0) & (jt < n_reach)
    idx = (jt[:, None, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :, None]) * 2 + tl.arange(0, 2)[None, None, :]
    keep = ok[:, None, None] & row_ok[None, :, None]
    x, y = tl.split(tl.load(base + idx, mask=keep, other=float("-inf")))
    return x, y, jt, ok


@triton.jit
def _gap_of(xv, run):
    """[TJ] max over the rows that see each tile of (row block max - running max), natural units."""
    return tl.max(tl.where(xv > float("-inf"), xv - run, float("-inf")), 1) * 0.6931471805599453


@triton.jit
def bucket(v, EDGES, lo, inv_step, n_edges):
    """torch.bucketize(v.double(), edges, right=True): how many of the f64 edges EDGES[n_edges]
    (about lo + k / inv_step) are <= v. A float guess, then one exact correction each way."""
    f = tl.minimum(tl.maximum((v - lo) * inv_step, -1.0), n_edges * 1.0)
    g = tl.minimum(tl.maximum(tl.floor(f).to(tl.int32) + 1, 0), n_edges)
    v64 = v.to(tl.float64)
    up = tl.load(EDGES + tl.minimum(g, n_edges - 1))
    g = tl.where((g < n_edges) & (v64 >= up), g + 1, g)
    down = tl.load(EDGES + tl.maximum(g - 1, 0))
    return tl.where((g > 0) & (v64 < down), g - 1, g)


@triton.jit
def hist_add(cnt_ptr, sum_ptr, bins, w, valid):
    """Atomically add entries (bin [T], weight [T], valid [T]) to counts at cnt_ptr + bin and
    weight sums at sum_ptr + bin."""
    tl.atomic_add(cnt_ptr + bins, tl.full(bins.shape, 1.0, tl.float32), mask=valid, sem="relaxed")
    tl.atomic_add(sum_ptr + bins, w, mask=valid, sem="relaxed")


@triton.jit
def _argfirst(va, ia, vb, ib):
    """Combine of a (max, first index reaching it) scan: the lexicographic max of (v, -i)."""
    b = (vb > va) | ((vb == va) & (ib < ia))
    return tl.where(b, vb, va), tl.where(b, ib, ia)


@triton.jit
def _arglast(va, ia, vb, ib):
    """Combine of a (max, last index reaching it) scan: the lexicographic max of (v, i)."""
    b = (vb > va) | ((vb == va) & (ib > ia))
    return tl.where(b, vb, va), tl.where(b, ib, ia)


@triton.jit
def _records(xv, jt, carry, REVERSE: tl.constexpr):
    """Running max of a chunk xv [TJ, BLOCK_M] (tiles jt [TJ], scanned ascending, or descending
    with REVERSE) after ``carry`` [BLOCK_M], and rec [TJ, BLOCK_M]: the tiles where it rises
    strictly (above carry and above every tile of the chunk scanned before)."""
    idx = tl.broadcast_to(jt[:, None], xv.shape)
    if REVERSE:
        v, first = tl.associative_scan((xv, idx), 0, _arglast, reverse=True)
    else:
        v, first = tl.associative_scan((xv, idx), 0, _argfirst)
    return tl.maximum(v, carry[None, :]), (first == idx) & (xv > carry[None, :])


@triton.jit
def _shortfall_add(sf, row_ok, ptr, SEDGES, s_lo, s_inv, n_sedges):
    """Count rows into shortfall bins at ptr: bucketize(sf, edges, right=False) from the negated,
    reversed edges SEDGES (= -edges[::-1]) and bucket's right=True rule."""
    b = n_sedges - bucket(tl.where(row_ok, -sf, 0.0), SEDGES, s_lo, s_inv, n_sedges)
    tl.atomic_add(ptr + b, tl.full(b.shape, 1.0, tl.float32), mask=row_ok, sem="relaxed")


@triton.jit
def row_scan_stats(resc, sf1, sf2, row_ok, resc_ptr, sf_ptr, sf_stride, part, o, SEDGES, s_lo, s_inv, n_sedges,
                   OFF_RC: tl.constexpr, OFF_RX: tl.constexpr, OFF_SF: tl.constexpr, STORE: tl.constexpr,
                   HIST: tl.constexpr, NR: tl.constexpr, RBP: tl.constexpr, SBP: tl.constexpr):
    """One order's rescales resc [BLOCK_M] (int) and shortfalls sf1, sf2 [BLOCK_M] (natural units)
    of a block's rows: stored (STORE: resc_ptr, sf_ptr and sf_ptr + sf_stride per row) and/or
    counted into the head's histogram row ``part`` at order slot o (HIST: NR rescale bins, the
    excess over the last, two shortfall histograms)."""
    if STORE:
        tl.store(resc_ptr, resc.to(tl.int64), mask=row_ok)
        tl.store(sf_ptr, sf1, mask=row_ok)
        tl.store(sf_ptr + sf_stride, sf2, mask=row_ok)
    if HIST:
        hit = (tl.minimum(resc, NR - 1)[:, None] == tl.arange(0, RBP)[None, :]) & row_ok[:, None]
        c = tl.sum(hit.to(tl.float32), 0)
        tl.atomic_add(part + OFF_RC + o * RBP + tl.arange(0, RBP), c, mask=c > 0, sem="relaxed")
        ex = tl.sum(tl.where(row_ok, tl.maximum(resc - (NR - 1), 0), 0).to(tl.float32), 0)
        tl.atomic_add(part + OFF_RX + o, ex, mask=ex > 0, sem="relaxed")
        _shortfall_add(sf1, row_ok, part + OFF_SF + 2 * o * SBP, SEDGES, s_lo, s_inv, n_sedges)
        _shortfall_add(sf2, row_ok, part + OFF_SF + (2 * o + 1) * SBP, SEDGES, s_lo, s_inv, n_sedges)


@triton.jit
def _argmax_update(xv, jt, pos_s, best, t_f, t_r, p_s):
    """Running per-row argmax over tiles with each order's tie rule: t_f the smallest j (forward),
    t_r the largest j (reverse), p_s the smallest sink_local position, all reaching ``best``."""
    cm = tl.max(xv, 0)
    hit = (xv == cm[None, :]) & (xv > float("-inf"))
    first = tl.min(tl.where(hit, jt[:, None], 1 << 30), 0)
    last = tl.max(tl.where(hit, jt[:, None], -1), 0)
    first_s = tl.min(tl.where(hit, pos_s[:, None], 1 << 30), 0)
    better = cm > best
    tie = (cm == best) & (cm > float("-inf"))
    t_f = tl.where(better, first, t_f)
    t_r = tl.where(better | tie, last, t_r)
    p_s = tl.where(better, first_s, tl.where(tie, tl.minimum(p_s, first_s), p_s))
    return tl.maximum(best, cm), t_f, t_r, p_s


@triton.jit
def _forward_sweep(x_base, lse2, row_ok, n_rows, n_cand, n_reach, d_max,
                   bmax_ptr, mass_ptr, gapf_ptr, gaps_ptr, part, EDGES, lo, inv_step, n_edges,
                   TJ: tl.constexpr, BLOCK_M: tl.constexpr, HIST: tl.constexpr, NBP: tl.constexpr,
                   OFF_DG: tl.constexpr):
    """Ascending chunks: bmax, mass, forward and sink_local gaps (stored at ptr + j), the per-row
    argmax state for t*, and (HIST) the gap histograms added into part (candidate tiles at the gap
    sections, diagonal tiles at the diagonal sections OFF_DG, HistLayout). Also per
    row: new running maxima in forward order (n_f, the first included) and in sink_local order
    after block 0 (n_s), block 0's max x0, and the maxima of the first n_loc blocks (pre_f), the
    last n_loc (suf_r) and the last block (x_last), n_loc = geometry.local_prefix."""
    neg = tl.full([BLOCK_M], float("-inf"), tl.float32)
    carry_f = neg
    x0 = tl.load(x_base + tl.arange(0, BLOCK_M) * 2, mask=row_ok, other=float("-inf"))  # block 0
    carry_d = x0
    best, pre_f, suf_r, x_last = neg, neg, neg, neg
    n_f = tl.zeros([BLOCK_M], tl.int32)
    n_s = tl.zeros([BLOCK_M], tl.int32)
    n_loc = tl.minimum(1 + n_reach - n_cand, n_reach)
    t_f = tl.zeros([BLOCK_M], tl.int32)
    t_r = tl.zeros([BLOCK_M], tl.int32)
    p_s = tl.zeros([BLOCK_M], tl.int32)
    d0 = tl.maximum(n_cand, 1)
    for j0 in range(0, n_reach, TJ):
        xv, yv, jt, ok = _load_pairs(x_base, j0, n_reach, row_ok, TJ, BLOCK_M)
        mass = tl.sum(tl.math.exp2(yv - lse2[None, :]), 1) / n_rows
        tl.store(bmax_ptr + jt, tl.max(xv, 1) * 0.6931471805599453, mask=ok)
        tl.store(mass_ptr + jt, mass, mask=ok)
        run_f, rec_f = _records(xv, jt, carry_f, False)
        is_diag = jt >= n_cand
        xd = tl.where(is_diag[:, None], xv, float("-inf"))
        run_d, rec_d = _records(xd, jt, carry_d, False)  # sink_local: block 0, then the diagonal
        later_cand = (jt >= 1) & (jt < n_cand)  # sink_local scans these after every diagonal block
        rec_s = rec_d | (rec_f & later_cand[:, None] & (xv > d_max[None, :]))
        n_f += tl.sum(rec_f.to(tl.int32), 0)
        n_s += tl.sum(rec_s.to(tl.int32), 0)
        pre_f = tl.maximum(pre_f, tl.max(tl.where((jt < n_loc)[:, None], xv, float("-inf")), 0))
        suf_r = tl.maximum(suf_r, tl.max(tl.where((jt >= n_reach - n_loc)[:, None], xv, float("-inf")), 0))
        x_last = tl.maximum(x_last, tl.max(tl.where((jt == n_reach - 1)[:, None], xv, float("-inf")), 0))
        run_s = tl.where(later_cand[:, None], tl.maximum(run_f, d_max[None, :]),
                         tl.where(is_diag[:, None], run_d, run_f))
        g_f = _gap_of(xv, run_f)
        g_s = _gap_of(xv, run_s)
        tl.store(gapf_ptr + jt, g_f, mask=ok)
        tl.store(gaps_ptr + jt, g_s, mask=ok)
        if HIST:
            sec = part + tl.where(jt < n_cand, 0, OFF_DG)  # [TJ] candidate or diagonal sections
            hist_add(sec, sec + 3 * NBP, bucket(g_f, EDGES, lo, inv_step, n_edges), mass, ok)
            hist_add(sec + 2 * NBP, sec + 5 * NBP, bucket(g_s, EDGES, lo, inv_step, n_edges), mass, ok)
        carry_f = tl.maximum(carry_f, tl.max(xv, 0))
        carry_d = tl.maximum(carry_d, tl.max(xd, 0))
        pos_s = tl.where(jt == 0, 0, tl.where(jt >= d0, jt - d0 + 1, n_reach - d0 + jt))
        best, t_f, t_r, p_s = _argmax_update(xv, jt, pos_s, best, t_f, t_r, p_s)
    return t_f, t_r, p_s, best, n_f, n_s, x0, pre_f, suf_r, x_last


@triton.jit
def _reverse_sweep(x_base, row_ok, n_cand, n_reach, gapr_ptr, mass_ptr, part, EDGES, lo, inv_step, n_edges,
                   TJ: tl.constexpr, BLOCK_M: tl.constexpr, HIST: tl.constexpr, NBP: tl.constexpr,
                   OFF_DG: tl.constexpr):
    """Descending chunks: reverse-order gaps (suffix running maxima) at ptr + j; (HIST) their
    histograms (candidate and diagonal tiles, as _forward_sweep's), with the masses the forward
    sweep stored, added into part. Returns the new running maxima per row [BLOCK_M] in reverse
    order (the first finite one included)."""
    carry = tl.full([BLOCK_M], float("-inf"), tl.float32)
    n_r = tl.zeros([BLOCK_M], tl.int32)
    for c in range(0, tl.cdiv(n_reach, TJ)):
        xv, jt, ok = _load_tiles(x_base, n_reach - (c + 1) * TJ, n_reach, row_ok, TJ, BLOCK_M)
        run, rec = _records(xv, jt, carry, True)
        n_r += tl.sum(rec.to(tl.int32), 0)
        g_r = _gap_of(xv, run)
        tl.store(gapr_ptr + jt, g_r, mask=ok)
        if HIST:
            mass = tl.load(mass_ptr + jt, mask=ok, other=0.0)
            sec = part + tl.where(jt < n_cand, 0, OFF_DG)  # [TJ] candidate or diagonal sections
            hist_add(sec + NBP, sec + 4 * NBP, bucket(g_r, EDGES, lo, inv_step, n_edges), mass, ok)
        carry = tl.maximum(carry, tl.max(xv, 0))
    return n_r


@triton.jit
def _order_rows(step, j, n_cand, n_reach, row_ok, step_ptr, where_ptr, norm_ptr, part_w, part_t,
                STORE: tl.constexpr, HIST: tl.constexpr, NT: tl.constexpr, TBP: tl.constexpr):
    """One order's t* per row: scan step, where code of block j (0 sink, 1 diagonal, 2 middle),
    step / (reachable - 1); stored (STORE) and/or counted into 4 where bins and TBP t* bins (HIST)."""
    code = tl.where(j == 0, 0, tl.where(j >= n_cand, 1, 2))
    norm = step.to(tl.float32) / tl.maximum(n_reach - 1, 1).to(tl.float32)
    if STORE:
        tl.store(step_ptr, step.to(tl.int64), mask=row_ok)
        tl.store(where_ptr, code.to(tl.int8), mask=row_ok)
        tl.store(norm_ptr, norm, mask=row_ok)
    if HIST:
        hit = (code[:, None] == tl.arange(0, 4)[None, :]) & row_ok[:, None]
        w = tl.sum(hit.to(tl.float32), 0)
        tl.atomic_add(part_w + tl.arange(0, 4), w, mask=w > 0, sem="relaxed")
        tb = tl.minimum(tl.floor(norm * NT).to(tl.int32), NT - 1)
        hit = (tb[:, None] == tl.arange(0, TBP)[None, :]) & row_ok[:, None]
        t = tl.sum(hit.to(tl.float32), 0)
        tl.atomic_add(part_t + tl.arange(0, TBP), t, mask=t > 0, sem="relaxed")


@triton.jit
def count_bins(v, row_ok, ptr, EDGES, lo, inv_step, n_edges):
    """Count the rows' values v [BLOCK_M] (valid row_ok) into bins at ptr (bucket's rule): one
    atomic add per row."""
    bins = bucket(tl.where(row_ok, v, 0.0), EDGES, lo, inv_step, n_edges)
    tl.atomic_add(ptr + bins, tl.full(bins.shape, 1.0, tl.float32), mask=row_ok, sem="relaxed")


@triton.jit
def _row_stats(t_f, t_r, p_s, n_cand, n_reach, rows, row_ok, n_ctx, h, TSTEP, TWHERE, TNORM, part,
               QERR, JERR, QEDGES, q_lo, q_inv, n_qedges, local, best, OFF_TW: tl.constexpr, OFF_TH: tl.constexpr,
               OFF_QI: tl.constexpr, OFF_JI: tl.constexpr, STORE: tl.constexpr, HIST: tl.constexpr,
               NT: tl.constexpr, TBP: tl.constexpr, QBP: tl.constexpr):
    """t* of every row in the three orders (TSTEP/TWHERE/TNORM [H, 3, N]) and the row histograms,
    and VFA's joint statistic max(q-init error, (local - best) ln 2) per row (JERR [H, N] with
    STORE; counted at OFF_JI with HIST): local = max over block 0 and the diagonal blocks, best =
    the row max (log2 units), both already in registers."""
    d0 = tl.maximum(n_cand, 1)
    n_diag = n_reach - d0
    j_s = tl.where(p_s == 0, 0, tl.where(p_s <= n_diag, d0 + p_s - 1, p_s - n_diag))
    r = h * 3 * n_ctx + rows
    _order_rows(t_f, t_f, n_cand, n_reach, row_ok, TSTEP + r, TWHERE + r, TNORM + r,
                part + OFF_TW, part + OFF_TH, STORE, HIST, NT, TBP)
    r += n_ctx
    _order_rows(n_reach - 1 - t_r, t_r, n_cand, n_reach, row_ok, TSTEP + r, TWHERE + r, TNORM + r,
                part + OFF_TW + 4, part + OFF_TH + TBP, STORE, HIST, NT, TBP)
    r += n_ctx
    _order_rows(p_s, j_s, n_cand, n_reach, row_ok, TSTEP + r, TWHERE + r, TNORM + r,
                part + OFF_TW + 8, part + OFF_TH + 2 * TBP, STORE, HIST, NT, TBP)
    qerr = tl.load(QERR + h * n_ctx + rows, mask=row_ok, other=0.0)
    # exact: x -> fl(x * ln 2) and the subtraction are monotone, so this is fl(max(m_init, local) - best) ln 2
    jerr = tl.maximum(qerr, (local - best) * 0.6931471805599453)
    if STORE:
        tl.store(JERR + h * n_ctx + rows, jerr, mask=row_ok)
    if HIST:
        count_bins(qerr, row_ok, part + OFF_QI, QEDGES, q_lo, q_inv, n_qedges)
        count_bins(jerr, row_ok, part + OFF_JI, QEDGES, q_lo, q_inv, n_qedges)


@triton.jit
def _rescale_rows(best, n_f, n_s, x0, pre_f, suf_r, x_last, n_r, d_max, rows, row_ok, n_ctx, h, RESC, SHORT, part,
                  SEDGES, s_lo, s_inv, n_sedges,
                  OFF_RC: tl.constexpr, OFF_RX: tl.constexpr, OFF_SF: tl.constexpr, STORE: tl.constexpr,
                  HIST: tl.constexpr, NR: tl.constexpr, RBP: tl.constexpr, SBP: tl.constexpr):
    """Rescales and shortfalls of every row in the three orders (RESC [H, 3, N] i64, SHORT
    [H, 3, 2, N] f32 with STORE; histograms with HIST) from the sweeps' per-row state
    (_forward_sweep's best, n_f, n_s, x0, pre_f, suf_r, x_last, log2 units; _reverse_sweep's n_r)."""
    ln2 = 0.6931471805599453
    r = h * 3 * n_ctx + rows
    s = h * 6 * n_ctx + rows
    row_scan_stats(n_f - 1, (best - x0) * ln2, (best - pre_f) * ln2, row_ok, RESC + r, SHORT + s, n_ctx, part, 0,
                   SEDGES, s_lo, s_inv, n_sedges, OFF_RC, OFF_RX, OFF_SF, STORE, HIST, NR, RBP, SBP)
    row_scan_stats(n_r - 1, (best - x_last) * ln2, (best - suf_r) * ln2, row_ok, RESC + r + n_ctx,
                   SHORT + s + 2 * n_ctx, n_ctx, part, 1, SEDGES, s_lo, s_inv, n_sedges, OFF_RC, OFF_RX, OFF_SF,
                   STORE, HIST, NR, RBP, SBP)
    row_scan_stats(n_s, (best - x0) * ln2, (best - tl.maximum(x0, d_max)) * ln2, row_ok, RESC + r + 2 * n_ctx,
                   SHORT + s + 4 * n_ctx, n_ctx, part, 2, SEDGES, s_lo, s_inv, n_sedges, OFF_RC, OFF_RX, OFF_SF,
                   STORE, HIST, NR, RBP, SBP)


@triton.jit
def tile_stats_kernel(XY, TOFF, LSE, QERR, JERR, BMAX, MASS, GAP, TSTEP, TWHERE, TNORM, RESC, SHORT, PART,
                       GEDGES, QEDGES, SEDGES, n_ctx, head0, num_tiles, n_qb, n_kb,
                       g_lo, g_inv, n_gedges, q_lo, q_inv, n_qedges, s_lo, s_inv, n_sedges,
                       BM: tl.constexpr, BN: tl.constexpr, BLOCK_M: tl.constexpr, TJ: tl.constexpr,
                       STORE_TSTAR: tl.constexpr, HIST: tl.constexpr, HIST_ROWS: tl.constexpr,
                       W: tl.constexpr, NBP: tl.constexpr, OFF_TW: tl.constexpr, OFF_TH: tl.constexpr,
                       OFF_QI: tl.constexpr, NT: tl.constexpr, TBP: tl.constexpr, QBP: tl.constexpr,
                       OFF_RC: tl.constexpr, OFF_RX: tl.constexpr, OFF_SF: tl.constexpr, NR: tl.constexpr,
                       RBP: tl.constexpr, SBP: tl.constexpr, OFF_DG: tl.constexpr, OFF_JI: tl.constexpr):
    """Grid (P, heads of this chunk). Query block i = program_id(0) of head head0 + program_id(1);
    its tile j's pairs at XY[((pid1 * num_tiles + TOFF[i] + j) * BLOCK_M + row) * 2 + (0, 1)]. BMAX, MASS [H, P, Kb];
    GAP [H, 3, P, Kb] (forward, reverse, sink_local); TSTEP/TWHERE/TNORM/RESC [H, 3, N]; SHORT
    [H, 3, 2, N]; JERR [H, N] VFA's joint statistic (stored with STORE_TSTAR); PART [H, W] (zeroed
    by the caller; histograms are added into it).

    VFA's joint statistic costs no extra pass: block 0's max x0 and the diagonal max d_max are the
    per-row registers the sink_local scan already keeps, the row max ``best`` comes out of the
    forward sweep, and the q-init error is the value the row histogram already loads; one max, and
    (HIST_ROWS) one more bucket and atomic add per row, against TJ x BLOCK_M tile values a chunk."""
    i = tl.program_id(0)
    h = (head0 + tl.program_id(1)).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    rows = i * BM + offs_m
    row_ok = (offs_m < BM) & (rows < n_ctx)
    n_rows = (tl.minimum((i + 1) * BM, n_ctx) - i * BM).to(tl.float32)
    n_cand = (i * BM) // BN
    n_reach = (tl.minimum((i + 1) * BM, n_ctx) - 1) // BN + 1
    tile0 = (tl.program_id(1).to(tl.int64) * num_tiles + tl.load(TOFF + i)) * (2 * BLOCK_M)
    lse2 = tl.load(LSE + h * n_ctx + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    d_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for j0 in range(tl.maximum(n_cand, 1), n_reach, TJ):
        xv, _, _ = _load_tiles(XY + tile0, j0, n_reach, row_ok, TJ, BLOCK_M)
        d_max = tl.maximum(d_max, tl.max(xv, 0))
    tiles = (h * n_qb + i) * n_kb
    ostride = n_qb * n_kb
    gap0 = GAP + ((h * 3) * n_qb + i) * n_kb
    part = PART + h * W
    t_f, t_r, p_s, best, n_f, n_s, x0, pre_f, suf_r, x_last = _forward_sweep(
        XY + tile0, lse2, row_ok, n_rows, n_cand, n_reach, d_max, BMAX + tiles, MASS + tiles,
        gap0, gap0 + 2 * ostride, part, GEDGES, g_lo, g_inv, n_gedges, TJ, BLOCK_M, HIST, NBP, OFF_DG)
    if HIST:
        tl.debug_barrier()  # the reverse sweep reads the masses this program stored
    n_r = _reverse_sweep(XY + tile0, row_ok, n_cand, n_reach, gap0 + ostride, MASS + tiles, part,
                         GEDGES, g_lo, g_inv, n_gedges, TJ, BLOCK_M, HIST, NBP, OFF_DG)
    _row_stats(t_f, t_r, p_s, n_cand, n_reach, rows, row_ok, n_ctx, h, TSTEP, TWHERE, TNORM, part,
               QERR, JERR, QEDGES, q_lo, q_inv, n_qedges, tl.maximum(x0, d_max), best, OFF_TW, OFF_TH, OFF_QI,
               OFF_JI, STORE_TSTAR, HIST_ROWS, NT, TBP, QBP)
    _rescale_rows(best, n_f, n_s, x0, pre_f, suf_r, x_last, n_r, d_max, rows, row_ok, n_ctx, h, RESC, SHORT,
                  part, SEDGES, s_lo, s_inv, n_sedges, OFF_RC, OFF_RX, OFF_SF, STORE_TSTAR, HIST_ROWS, NR, RBP, SBP)


@triton.jit
def decode_stats_kernel(DX, DM, GAP, PART, GEDGES, r_first, n_dec, n_kb, g_lo, g_inv, n_gedges,
                         BN: tl.constexpr, ROWS: tl.constexpr, TJ: tl.constexpr, W: tl.constexpr,
                         NBP: tl.constexpr, HIST: tl.constexpr, OFF_DG: tl.constexpr):
    """Decode rows, each its own block (BM = 1): row r has A = r // BN candidates and diagonal block
    A. Grid (ceil(R / ROWS), H). DX, DM [H, R, Kb]: row block maxima (natural units) and masses;
    GAP [H, 3, R, Kb] gaps per order (forward, reverse, sink_local); PART [H, W] (HIST: the gap
    histograms of the candidate tiles j < A and of the diagonal tile j = A added, as in
    tile_stats_kernel)."""
    h = tl.program_id(1).to(tl.int64)
    rr = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r_ok = rr < n_dec
    a = (r_first + rr) // BN
    base = (h * n_dec + rr) * n_kb  # [ROWS]
    x0 = tl.load(DX + base, mask=r_ok, other=float("-inf"))
    xa = tl.load(DX + base + a, mask=r_ok & (a >= 1), other=float("-inf"))
    gstride = n_dec * n_kb
    gap = (GAP + h * 3 * gstride + rr * n_kb)[:, None]  # [ROWS, 1] row starts of the forward order
    part = PART + h * W
    carry = tl.full([ROWS], float("-inf"), tl.float32)
    for j0 in range(0, n_kb, TJ):
        j = j0 + tl.arange(0, TJ)[None, :]
        ok = r_ok[:, None] & (j < n_kb)
        x = tl.load(DX + base[:, None] + j, mask=ok, other=float("-inf"))
        run_f = tl.maximum(tl.associative_scan(x, 1, max_fn), carry[:, None])
        later_cand = (j >= 1) & (j < a[:, None])
        diag = (j == a[:, None]) & (a[:, None] >= 1)
        run_s = tl.where(later_cand, tl.maximum(run_f, xa[:, None]),
                         tl.where(diag, tl.maximum(x0, xa)[:, None], run_f))
        g_f = tl.where(x > float("-inf"), (x - run_f), float("-inf"))
        g_s = tl.where(x > float("-inf"), (x - run_s), float("-inf"))
        tl.store(gap + j, g_f, mask=ok)
        tl.store(gap + 2 * gstride + j, g_s, mask=ok)
        if HIST:
            seen = ok & (j <= a[:, None])  # the candidates and the diagonal: the row sees no later block
            sec = part + tl.where(j < a[:, None], 0, OFF_DG)  # [ROWS, TJ] candidate or diagonal sections
            m = tl.load(DM + base[:, None] + j, mask=seen, other=0.0)
            hist_add(sec, sec + 3 * NBP, bucket(g_f, GEDGES, g_lo, g_inv, n_gedges), m, seen)
            hist_add(sec + 2 * NBP, sec + 5 * NBP, bucket(g_s, GEDGES, g_lo, g_inv, n_gedges), m, seen)
        carry = tl.max(run_f, 1)  # run_f holds the carry (a max-accumulate here trips Triton 3.6)
    carry = tl.full([ROWS], float("-inf"), tl.float32)
    for c in range(0, tl.cdiv(n_kb, TJ)):
        j = n_kb - (c + 1) * TJ + tl.arange(0, TJ)[None, :]
        ok = r_ok[:, None] & (j >= 0) & (j < n_kb)
        x = tl.load(DX + base[:, None] + j, mask=ok, other=float("-inf"))
        run_r = tl.maximum(tl.associative_scan(x, 1, max_fn, reverse=True), carry[:, None])
        g_r = tl.where(x > float("-inf"), (x - run_r), float("-inf"))
        tl.store(gap + gstride + j, g_r, mask=ok)
        if HIST:
            seen = ok & (j <= a[:, None])
            sec = part + tl.where(j < a[:, None], 0, OFF_DG)
            m = tl.load(DM + base[:, None] + j, mask=seen, other=0.0)
            hist_add(sec + NBP, sec + 4 * NBP, bucket(g_r, GEDGES, g_lo, g_inv, n_gedges), m, seen)
        carry = tl.max(run_r, 1)
