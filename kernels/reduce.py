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

import torch

from .config import StatsConfig
from .geometry import block_counts
from .reference import TileStats

NEG_INF = float("-inf")


def histogram(values: torch.Tensor, edges: torch.Tensor, weights: torch.Tensor | None = None):
    """Per-group histogram. values [G, C]; edges [E] ascending (float64) -> [G, E + 1].

    Bin 0: x < e_0; bin k: e_{k-1} <= x < e_k; bin E: x >= e_{E-1}. Weights [G, C] sum instead of
    count (float64).
    """
    g, _ = values.shape
    nb = edges.numel() + 1
    idx = torch.bucketize(values.double(), edges.to(values.device), right=True)
    flat = (idx + torch.arange(g, device=values.device).unsqueeze(1) * nb).flatten()
    w = None if weights is None else weights.double().flatten()
    out = torch.bincount(flat, weights=w, minlength=g * nb)
    if w is not None:
        out = out.double()  # bincount gives int64 zeros when there is nothing to weigh
    return out.view(g, nb)


def bsfa_reduce(bmax: torch.Tensor, mass: torch.Tensor, cand: torch.Tensor, cfg: StatsConfig):
    """Per-sample BSFA thresholds at cfg.k_values. bmax, mass [H, P, Kb]; cand [P] (A_i)."""
    h, p, kb = bmax.shape
    cand = cand.to(bmax.device)
    cmask = torch.arange(kb, device=bmax.device).unsqueeze(0) < cand.unsqueeze(1)  # [P, Kb]
    cb = bmax.masked_fill(~cmask, NEG_INF)
    vals = cb.sort(dim=-1, descending=True).values
    thr, kept, skipped = [], [], []
    for k in cfg.k_values:
        if k < kb:
            mid = (vals[..., k - 1] + vals[..., k]) / 2
        else:
            mid = torch.full((h, p), NEG_INF, device=bmax.device)
        t = torch.where(cand.unsqueeze(0) > k, mid, torch.full_like(mid, NEG_INF))
        below = cmask & (cb < t.unsqueeze(-1))
        thr.append(t)
        kept.append((cmask & ~below).sum(dim=-1))
        skipped.append((mass * below).sum(dim=-1))
    top = max(1, min(cfg.top_count, int(cand.max())))
    top_vals = torch.full((h, p, top), NEG_INF, device=bmax.device)
    width = min(top, kb)
    top_vals[..., :width] = vals[..., :width]
    return {
        "bsfa_threshold": torch.stack(thr, dim=-1).float(),
        "bsfa_kept": torch.stack(kept, dim=-1),
        "bsfa_skipped_mass": torch.stack(skipped, dim=-1).float(),
        "bsfa_top_bmax": top_vals.float(),
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
    cand, _ = block_counts(n, cfg.block_m, cfg.block_n)
    cols = torch.arange(kb, device=dev)
    out = bsfa_reduce(t.bmax, t.mass, cand, cfg)
    gap_edges = cfg.gap_edges()
    out.update(_gap_hist(t.gap, t.mass, cols < cand.to(dev).unsqueeze(1), gap_edges, ""))
    dec_cand = (t.dec_rows // cfg.block_n).unsqueeze(1)  # decode row r: A = r // BN
    out.update(_gap_hist(t.dec_gap, t.dec_mass, cols < dec_cand, gap_edges, "decode_"))
    where = t.tstar_where.long().reshape(h * o, -1)
    out["tstar_where"] = histogram(where.double(), torch.tensor([0.5, 1.5], dtype=torch.float64)).view(h, o, 3)
    nt = cfg.tstar_bins
    tb = torch.clamp((t.tstar_norm * nt).floor().long(), max=nt - 1).reshape(h * o, -1)
    out["tstar_hist"] = histogram(tb.double(), torch.arange(1, nt, dtype=torch.float64)).view(h, o, nt)
    out["qinit_count"] = histogram(t.qinit_err, cfg.qinit_edges())
    if cfg.raw:
        out["raw_bmax"] = t.bmax.half()
        out["raw_gap"] = t.gap.half()
        out["raw_mass"] = t.mass.half()
    return out
