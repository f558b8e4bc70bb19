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
    bsfa_top_mass      [H, P, T]  f32  the mass of those tiles, in the same order (0 where padded):
                                       the skipped mass at any threshold t is bsfa_cand_mass minus
                                       the masses of the stored maxima >= t (exact while fewer than
                                       T pass or A_i <= T; else an upper bound on the skipped mass)
    bsfa_cand_mass     [H, P]     f32  the summed mass of the query block's candidate tiles
    decode_bsfa_threshold     [H, R, K]  f32  the same per decode row r (its own block, BM = 1:
    decode_bsfa_kept          [H, R, K]  i64  candidates j < r // BN, max over the row's keys in
    decode_bsfa_skipped_mass  [H, R, K]  f32  block j; the mass is the row's softmax mass), R =
    decode_bsfa_top_bmax      [H, R, Td] f32  min(decode_rows, N) rows N - R .. N - 1, Td =
    decode_bsfa_top_mass      [H, R, Td] f32  max(1, min(T setting, (N - 1) // BN)); kept at the
    decode_bsfa_cand_mass     [H, R]     f32  row's own threshold = what decode top-k keeps
    gap_count          [H, O, NG] i64  candidate tiles per gap bin
    gap_mass           [H, O, NG] f64  their summed mass (a query block's tiles sum to 1)
    decode_gap_count   [H, O, NG] i64  decode rows' candidate tiles per gap bin
    decode_gap_mass    [H, O, NG] f64
    diag_gap_count     [H, O, NG] i64  diagonal tiles (A_i <= j < R_i) per gap bin: the tiles the
    diag_gap_mass      [H, O, NG] f64  BSFA rule always computes, which a consumer's rule may skip
    decode_diag_gap_count [H, O, NG] i64  each decode row's own last reachable block (j = r // BN)
    decode_diag_gap_mass  [H, O, NG] f64  per gap bin, and its mass
    decode_group_gap_count [H, O, NG] i64 the decode rows' candidate tiles per bin of the group gap
    decode_group_gap_mass  [H, O, NG] f64 (head h: the max of the gaps of its KV group's G heads,
                                       group_gap; the group decision skips a tile for all G heads iff
                                       that is below ln lambda) and head h's mass in them: the same
                                       counts on every head of a group, so sums over heads and bins
                                       read as decode_gap_count's (the group's V-skip share)
    tstar_where        [H, O, 3]  i64  rows whose running max stabilizes at sink/diagonal/middle
    tstar_hist         [H, O, NT] i64  rows per normalized-t* bin on [0, 1]
    qinit_count        [H, NQ]    i64  rows per Q-init error bin
    joint_count        [H, NQ]    i64  rows per bin of VFA's joint statistic (TileStats.joint_err:
                                       max(Q-init, exact max over block 0 and the diagonal blocks)
                                       - true row max), on the Q-init error's edges; prefill rows
                                       only (the decode rows carry no Q-init estimate)
    rescale_count      [H, O, NR] i64  rows per number of running-max rescales (NR = rescale_bins;
                                       the last bin: NR - 1 or more)
    rescale_excess     [H, O]     i64  sum over the rows of max(rescales - (NR - 1), 0): the mean is
                                       (sum_k k * count_k + excess) / rows, exact
    shortfall_count    [H, O, 2, NS] i64  rows per running-max shortfall bin (NS = len(shortfall_edges)
                                       + 1; bin 0: exactly 0), prefix 0 after the first scanned
                                       block, prefix 1 after the first local_prefix blocks
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


def bsfa_thresholds(bmax: torch.Tensor, cand: torch.Tensor, cfg: StatsConfig, most: int | None = None):
    """Per-sample BSFA thresholds and the sorted top candidate block maxima, on bmax's device with
    no host sync. bmax [H, P, Kb]; cand [P] (A_i, geometry.block_counts; a tensor on bmax's device avoids a copy);
    most: max(cand) known from shapes (default the prefill max_candidates(P); decode rows pass theirs).

    Returns (bsfa_threshold [H, P, K] f32, bsfa_top_bmax [H, P, T] f32, cmask [P, Kb] bool,
    top_idx [H, P, T] int64 the key block of each sorted value, 0 where padded).
    One torch.topk of the candidate-masked bmax (the top max(T, max(k) + 1) values, sorted
    descending) replaces a full sort: the values, and so both outputs, are the same. Ties: equal
    block maxima are equal values, so which tile a sort or topk puts first never changes a value
    (only -0.0 and +0.0 may trade places; they compare equal).
    """
    _, p, kb = bmax.shape
    cmask = torch.arange(kb, device=bmax.device).unsqueeze(0) < cand.unsqueeze(1)  # [P, Kb]
    cb = bmax.masked_fill(~cmask, NEG_INF)
    top = max(1, min(cfg.top_count, max_candidates(p, cfg) if most is None else most))
    width = min(kb, max(top, max(cfg.k_values) + 1))
    vals, idx = cb.topk(width, dim=-1, sorted=True)  # [H, P, width] descending
    lo, hi, ks = _k_index(tuple(cfg.k_values), width, bmax.device)
    mid = (vals.index_select(-1, lo) + vals.index_select(-1, hi)) / 2  # valid wherever A_i > k
    thr = torch.where(cand.unsqueeze(1) > ks, mid, torch.full_like(mid, NEG_INF))
    top_vals, top_idx = vals[..., :top], idx[..., :top]
    if top > width:  # only when the values run out (Kb < T); never for geometry's A_i
        top_vals = torch.nn.functional.pad(top_vals, (0, top - width), value=NEG_INF)
        top_idx = torch.nn.functional.pad(top_idx, (0, top - width))
    return thr.float(), top_vals.float(), cmask, top_idx


def top_mass(mass: torch.Tensor, top_vals: torch.Tensor, top_idx: torch.Tensor, cmask: torch.Tensor):
    """The mass of the sorted top candidates and of all candidates. mass [H, P, Kb]; top_vals,
    top_idx [H, P, T] (bsfa_thresholds); cmask [P, Kb] -> (top_mass [H, P, T] f32, 0 where padded;
    cand_mass [H, P] f32)."""
    tm = mass.gather(-1, top_idx).masked_fill(top_vals == NEG_INF, 0.0)
    return tm.float(), (mass * cmask).sum(dim=-1).float()


def bsfa_reduce(bmax: torch.Tensor, mass: torch.Tensor, cand: torch.Tensor, cfg: StatsConfig,
                most: int | None = None, prefix: str = ""):
    """Per-sample BSFA thresholds at cfg.k_values. bmax, mass [H, P, Kb]; cand [P] (A_i); most:
    max(cand) from shapes (bsfa_thresholds); prefix: "decode_" for the decode rows' keys.

    Device-side with no host sync when cand lives on bmax's device (a CPU cand or array is copied over).
    kept = A_i minus the candidates strictly below the threshold (ties with it are kept);
    skipped mass sums the same products in the same order as a masked sum would.
    """
    cand = torch.as_tensor(cand).to(bmax.device)
    thr, top_vals, cmask, top_idx = bsfa_thresholds(bmax, cand, cfg, most)
    tmass, cmass = top_mass(mass, top_vals, top_idx, cmask)
    hi = bmax.masked_fill(~cmask, float("inf"))  # non-candidates are never below a threshold
    kept, skipped = [], []
    for x in range(len(cfg.k_values)):  # over the configured k values, not over data
        below = hi < thr[..., x:x + 1]
        kept.append(cand - below.sum(dim=-1))
        skipped.append((mass * below).sum(dim=-1))
    return {
        f"{prefix}bsfa_threshold": thr,
        f"{prefix}bsfa_kept": torch.stack(kept, dim=-1),
        f"{prefix}bsfa_skipped_mass": torch.stack(skipped, dim=-1).float(),
        f"{prefix}bsfa_top_bmax": top_vals,
        f"{prefix}bsfa_top_mass": tmass,
        f"{prefix}bsfa_cand_mass": cmass,
    }


def decode_bsfa_reduce(dec_bmax: torch.Tensor, dec_mass: torch.Tensor, n: int, cfg: StatsConfig) -> dict:
    """The decode rows' BSFA keys (module docstring), each row its own block: dec_bmax, dec_mass
    [H, R, Kb] of the last R = min(decode_rows, N) rows -> decode_bsfa_* keys. No host sync."""
    r_first = max(n - cfg.decode_rows, 0)
    cand = torch.arange(r_first, n, device=dec_bmax.device) // cfg.block_n  # A_r = r // BN
    return bsfa_reduce(dec_bmax, dec_mass, cand, cfg, most=(n - 1) // cfg.block_n, prefix="decode_")


def _gap_hist(gap, mass, cmask, edges, prefix):
    """gap [H, O, X, Kb], mass [H, X, Kb], cmask [X, Kb] -> counts and masses [H, O, NG]."""
    h, o = gap.shape[:2]
    vals = gap[:, :, cmask].reshape(h * o, -1)
    w = mass[:, cmask].unsqueeze(1).expand(h, o, -1).reshape(h * o, -1)
    return {
        f"{prefix}gap_count": histogram(vals, edges).view(h, o, -1),
        f"{prefix}gap_mass": histogram(vals, edges, w).view(h, o, -1),
    }


def group_gap(gap: torch.Tensor, group: int) -> torch.Tensor:
    """gap [H, ...] -> [H, ...]: each head's value replaced by the max over its KV group's ``group``
    adjacent heads (reference.group_skip's rule: every head below ln lambda iff the max is)."""
    if group == 1:
        return gap
    h, rest = gap.shape[0], gap.shape[1:]
    g = gap.reshape(h // group, group, *rest).amax(dim=1, keepdim=True)
    return g.expand(h // group, group, *rest).reshape(gap.shape)


def group_gap_hist(dec_gap, dec_mass, dec_rows, group: int, edges: torch.Tensor, block_n: int) -> dict:
    """decode_group_gap_count / decode_group_gap_mass [H, O, NG] (module docstring) from dec_gap
    [H, O, R, Kb], dec_mass [H, R, Kb], dec_rows [R] and the gap edges [NG - 1] (f64, on the tiles'
    device). Histogram's bins (bucketize, right=True); no host synchronisation: the tiles that are no
    candidate (j >= r // BN) go to a spare bin that is dropped, not through a boolean index."""
    h, o, r, kb = dec_gap.shape
    nb = edges.numel() + 1
    cand = torch.arange(kb, device=dec_gap.device) < (dec_rows // block_n).unsqueeze(1)  # [R, Kb]
    idx = torch.bucketize(group_gap(dec_gap, group).double(), edges, right=True)
    idx = torch.where(cand, idx, nb).reshape(h * o, r * kb)
    count = torch.zeros((h * o, nb + 1), dtype=torch.int64, device=idx.device)
    count.scatter_add_(1, idx, torch.ones_like(idx))
    w = dec_mass.double().unsqueeze(1).expand(h, o, r, kb).reshape(h * o, r * kb)
    mass = torch.zeros((h * o, nb + 1), dtype=torch.float64, device=idx.device).scatter_add_(1, idx, w)
    return {"decode_group_gap_count": count[:, :nb].reshape(h, o, nb),
            "decode_group_gap_mass": mass[:, :nb].reshape(h, o, nb)}


def rescale_reduce(rescales: torch.Tensor, shortfall: torch.Tensor, cfg: StatsConfig) -> dict[str, torch.Tensor]:
    """rescales [H, O, N] int, shortfall [H, O, 2, N] -> rescale_count [H, O, NR], rescale_excess
    [H, O], shortfall_count [H, O, 2, NS] (module docstring). Shortfall bins are
    torch.bucketize(x, edges, right=False): bin 0 is x <= 0 (x = 0: shortfall is never negative)."""
    h, o, n = rescales.shape
    top = cfg.rescale_bins - 1
    r = rescales.long().reshape(h * o, n)
    count = torch.zeros((h * o, cfg.rescale_bins), dtype=torch.int64, device=r.device)
    count.scatter_add_(1, r.clamp(max=top), torch.ones_like(r))
    edges = torch.from_numpy(cfg.shortfall_edges()).to(shortfall.device)
    sb = torch.bucketize(shortfall.double().reshape(h * o * 2, n), edges, right=False)
    sc = torch.zeros((h * o * 2, edges.numel() + 1), dtype=torch.int64, device=r.device)
    sc.scatter_add_(1, sb, torch.ones_like(sb))
    return {"rescale_count": count.view(h, o, -1), "rescale_excess": (r - top).clamp(min=0).sum(-1).view(h, o),
            "shortfall_count": sc.view(h, o, 2, -1)}


def gap_reduce(t: TileStats, n: int, cfg: StatsConfig) -> dict[str, torch.Tensor]:
    """The gap histograms (module docstring): candidate tiles j < A_i and diagonal tiles
    A_i <= j < R_i of the query blocks, and of the decode rows (candidates j < r // BN, the
    diagonal j = r // BN)."""
    kb = t.gap.shape[-1]
    dev = t.gap.device
    cand, reach = (torch.from_numpy(x).to(dev).unsqueeze(1) for x in block_counts(n, cfg.block_m, cfg.block_n))
    cols = torch.arange(kb, device=dev)
    edges = torch.from_numpy(cfg.gap_edges())
    dec_cand = (t.dec_rows // cfg.block_n).unsqueeze(1)  # decode row r: A = r // BN
    out = _gap_hist(t.gap, t.mass, cols < cand, edges, "")
    out.update(_gap_hist(t.dec_gap, t.dec_mass, cols < dec_cand, edges, "decode_"))
    out.update(_gap_hist(t.gap, t.mass, (cols >= cand) & (cols < reach), edges, "diag_"))
    out.update(_gap_hist(t.dec_gap, t.dec_mass, cols == dec_cand, edges, "decode_diag_"))
    return out


def reduce_tiles(t: TileStats, n: int, cfg: StatsConfig) -> dict[str, torch.Tensor]:
    """All per-layer reductions of one call (see the module docstring for keys and shapes)."""
    h, o = t.gap.shape[:2]
    cand = torch.from_numpy(block_counts(n, cfg.block_m, cfg.block_n)[0])
    out = bsfa_reduce(t.bmax, t.mass, cand, cfg)
    out.update(decode_bsfa_reduce(t.dec_bmax, t.dec_mass, n, cfg))
    out.update(gap_reduce(t, n, cfg))
    where = t.tstar_where.long().reshape(h * o, -1)
    out["tstar_where"] = histogram(where.double(), torch.tensor([0.5, 1.5], dtype=torch.float64)).view(h, o, 3)
    nt = cfg.tstar_bins
    tb = torch.clamp((t.tstar_norm * nt).floor().long(), max=nt - 1).reshape(h * o, -1)
    out["tstar_hist"] = histogram(tb.double(), torch.arange(1, nt, dtype=torch.float64)).view(h, o, nt)
    out["qinit_count"] = histogram(t.qinit_err, torch.from_numpy(cfg.qinit_edges()))
    if t.joint_err is not None:  # every capture path fills it; a TileStats built without it has none
        out["joint_count"] = histogram(t.joint_err, torch.from_numpy(cfg.qinit_edges()))
    out.update(rescale_reduce(t.rescales, t.shortfall, cfg))
    edges = torch.from_numpy(cfg.gap_edges()).to(t.dec_gap.device)
    out.update(group_gap_hist(t.dec_gap, t.dec_mass, t.dec_rows, t.group, edges, cfg.block_n))
    if cfg.raw:
        out["raw_bmax"] = t.bmax.half()
        out["raw_gap"] = t.gap.half()
        out["raw_mass"] = t.mass.half()
    return out
