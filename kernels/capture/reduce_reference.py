"""Reduce one call's TileStats into the additive per-sample forms stored in a run (DESIGN.md).

Everything here is plain torch and runs on whatever device the tiles live on. Counts add across
samples; BSFA thresholds are per sample and are aggregated by the analysis layer.

Shape legend (per layer; the run stacks layers in front)
    H heads, O orders, P query blocks, K = len(k_values), T top block maxima kept,
    NG = len(gap_edges) + 1 gap bins, NQ = len(qinit_edges) + 1, NT = tstar_bins, Kb key blocks

Output keys
    bsfa_threshold     [H, P, K]  f32  midpoint of the k-th and (k+1)-th largest candidate bmax;
                                       -inf where A_i <= k
    bsfa_kept          [H, P, K]  i64  candidates with bmax >= threshold (min(k, A_i) unless ties)
    bsfa_skipped_mass  [H, P, K]  f32  mass of the candidates below the threshold
    bsfa_top_bmax      [H, P, T]  f32  candidate bmax sorted descending, -inf padded
    gap_count          [H, O, NG] i64  candidate tiles per gap bin
    gap_mass           [H, O, NG] f64  their summed mass (a query block's tiles sum to 1)
    decode_gap_count   [H, O, NG] i64  decode rows' candidate tiles per gap bin
    decode_gap_mass    [H, O, NG] f64
    tstar_where        [H, O, 3]  i64  rows whose running max stabilizes at sink/diagonal/middle
    tstar_hist         [H, O, NT] i64  rows per normalized-t* bin on [0, 1]
    qinit_count        [H, NQ]    i64  rows per Q-init error bin
    raw_bmax/raw_mass  [H, P, Kb] f16  only with cfg.raw
    raw_gap            [H, O, P, Kb] f16
"""
from __future__ import annotations

import functools

import torch

from sparsecal.formats.geometry import block_counts
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.reference import TileStats

NEG_INF = float("-inf")


def histogram(values: torch.Tensor, edges: torch.Tensor, weights: torch.Tensor | None = None):
    """Per-group histogram. values [G, C]; edges [E] ascending (float64, tensor or array) -> [G, E + 1].

    Bin 0: x < e_0; bin k: e_{k-1} <= x < e_k; bin E: x >= e_{E-1}. Weights [G, C] sum instead of
    count (float64).
    """
    g, _ = values.shape
    edges = torch.as_tensor(edges)
    nb = edges.numel() + 1
    idx = torch.bucketize(values.double(), edges.to(values.device), right=True)
    flat = (idx + torch.arange(g, device=values.device).unsqueeze(1) * nb).flatten()
    w = None if weights is None else weights.double().flatten()
    out = torch.bincount(flat, weights=w, minlength=g * nb)
    if w is not None:
        out = out.double()  # bincount gives int64 zeros when there is nothing to weigh
    return out.view(g, nb)


def max_candidates(p: int, cfg: StatsConfig) -> int:
    """max_i A_i over P query blocks (A_i grows with i), from shapes alone: no device read."""
    return ((p - 1) * cfg.block_m) // cfg.block_n


@functools.lru_cache(maxsize=64)
def _k_index(k_values: tuple, width: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device tensors (cached: no host-to-device copy, which would wait for the GPU): positions
    k-1 and k of each k in the sorted top ``width`` values (clamped), and the k values."""
    ks = torch.tensor(k_values, dtype=torch.int64)
    return ((ks - 1).clamp(max=width - 1).to(device), ks.clamp(max=width - 1).to(device), ks.to(device))


def bsfa_thresholds(bmax: torch.Tensor, cand: torch.Tensor, cfg: StatsConfig):
    """Per-sample BSFA thresholds and the sorted top candidate block maxima, on bmax's device with
    no host sync. bmax [H, P, Kb]; cand [P] (A_i, geometry.block_counts; a tensor on bmax's device avoids a copy).

    Returns (bsfa_threshold [H, P, K] f32, bsfa_top_bmax [H, P, T] f32, cmask [P, Kb] bool).
    One torch.topk of the candidate-masked bmax (the top max(T, max(k) + 1) values, sorted
    descending) replaces a full sort: the values, and so both outputs, are the same. Ties: equal
    block maxima are equal values, so which tile a sort or topk puts first never changes a value
    (only -0.0 and +0.0 may trade places; they compare equal).
    """
    h, p, kb = bmax.shape
    cmask = torch.arange(kb, device=bmax.device).unsqueeze(0) < cand.unsqueeze(1)  # [P, Kb]
    cb = bmax.masked_fill(~cmask, NEG_INF)
    top = max(1, min(cfg.top_count, max_candidates(p, cfg)))
    width = min(kb, max(top, max(cfg.k_values) + 1))
    vals = cb.topk(width, dim=-1, sorted=True).values  # [H, P, width] descending
    lo, hi, ks = _k_index(tuple(cfg.k_values), width, bmax.device)
    mid = (vals.index_select(-1, lo) + vals.index_select(-1, hi)) / 2  # valid wherever A_i > k
    thr = torch.where(cand.unsqueeze(1) > ks, mid, torch.full_like(mid, NEG_INF))
    top_vals = vals[..., :top]
    if top > width:  # only when the values run out (Kb < T); never for geometry's A_i
        top_vals = torch.nn.functional.pad(top_vals, (0, top - width), value=NEG_INF)
    return thr.float(), top_vals.float(), cmask


def bsfa_reduce(bmax: torch.Tensor, mass: torch.Tensor, cand: torch.Tensor, cfg: StatsConfig):
    """Per-sample BSFA thresholds at cfg.k_values. bmax, mass [H, P, Kb]; cand [P] (A_i).

    Device-side with no host sync when cand lives on bmax's device (a CPU cand or array is copied over).
    kept = A_i minus the candidates strictly below the threshold (ties with it are kept);
    skipped mass sums the same products in the same order as a masked sum would.
    """
    cand = torch.as_tensor(cand).to(bmax.device)
    thr, top_vals, cmask = bsfa_thresholds(bmax, cand, cfg)
    hi = bmax.masked_fill(~cmask, float("inf"))  # non-candidates are never below a threshold
    kept, skipped = [], []
    for x in range(len(cfg.k_values)):  # over the configured k values, not over data
        below = hi < thr[..., x:x + 1]
        kept.append(cand - below.sum(dim=-1))
        skipped.append((mass * below).sum(dim=-1))
    return {
        "bsfa_threshold": thr,
        "bsfa_kept": torch.stack(kept, dim=-1),
        "bsfa_skipped_mass": torch.stack(skipped, dim=-1).float(),
        "bsfa_top_bmax": top_vals,
    }


def _gap_hist(gap, mass, cmask, edges, prefix):
    """gap [H, O, X, Kb], mass [H, X, Kb], cmask [X, Kb] -> counts and masses [H, O, NG]."""
    h, o = gap.shape[:2]
    vals = gap[:, :, cmask].reshape(h * o, -1)
    w = mass[:, cmask].unsqueeze(1).expand(h, o, -1).reshape(h * o, -1)
    return {
        f"{prefix}gap_count": histogram(vals, edges).view(h, o, -1),
        f"{prefix}gap_mass": histogram(vals, edges, w).view(h, o, -1),
    }


def reduce_tiles(t: TileStats, n: int, cfg: StatsConfig) -> dict[str, torch.Tensor]:
    """All per-layer reductions of one call (see the module docstring for keys and shapes)."""
    h, o, _, kb = t.gap.shape
    dev = t.gap.device
    cand = torch.from_numpy(block_counts(n, cfg.block_m, cfg.block_n)[0])
    cols = torch.arange(kb, device=dev)
    out = bsfa_reduce(t.bmax, t.mass, cand, cfg)
    gap_edges = torch.from_numpy(cfg.gap_edges())
    out.update(_gap_hist(t.gap, t.mass, cols < cand.to(dev).unsqueeze(1), gap_edges, ""))
    dec_cand = (t.dec_rows // cfg.block_n).unsqueeze(1)  # decode row r: A = r // BN
    out.update(_gap_hist(t.dec_gap, t.dec_mass, cols < dec_cand, gap_edges, "decode_"))
    where = t.tstar_where.long().reshape(h * o, -1)
    out["tstar_where"] = histogram(where.double(), torch.tensor([0.5, 1.5], dtype=torch.float64)).view(h, o, 3)
    nt = cfg.tstar_bins
    tb = torch.clamp((t.tstar_norm * nt).floor().long(), max=nt - 1).reshape(h * o, -1)
    out["tstar_hist"] = histogram(tb.double(), torch.arange(1, nt, dtype=torch.float64)).view(h, o, nt)
    out["qinit_count"] = histogram(t.qinit_err, torch.from_numpy(cfg.qinit_edges()))
    if cfg.raw:
        out["raw_bmax"] = t.bmax.half()
        out["raw_gap"] = t.gap.half()
        out["raw_mass"] = t.mass.half()
    return out
