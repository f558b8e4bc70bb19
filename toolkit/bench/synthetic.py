"""Synthetic runs with known answers, in the real run format (for tests and the fit benchmark).

Per sample of length n, every (layer, head):
- candidate block maxima: A_i iid N(0, 1) per position, of which the top T are stored sorted
  (as capture does); the BSFA threshold at k
  is the midpoint of the k-th and (k+1)-th (-inf when A_i <= k), exactly as capture computes it;
- candidate-tile gaps drawn so that the BLASST law holds: P(gap < ln(a / n)) over candidates is
  target * reachable / candidates, i.e. sparsity(lambda = a / n) = target at every length
  (decode rows the same with a_decode); each tile's mass is 1 / reachable of its block;
- or, with ``law`` = (A, B, b), gaps uniform on [ln A - b ln n, ln A - b ln n + B * C / R] (C, R the
  candidate and reachable tiles; above 0 counts as gap == 0) so that lambda_best(S, n) = A exp(B S) n^-b
  exactly for every target S <= C / R, prefill and decode alike: the a/L, a L^-b and A exp(B S) / L
  laws then have known parameters (b = 1: all three hold; b != 1: only the power law does);
- stabilization, Q-init, rescale and shortfall histograms: random counts (no known answer, shape
  only; the analysis is checked against these counts read back); VFA's joint statistic: the Q-init
  counts with half of each bin below 0 moved into the bin at 0 (the joint statistic is never below
  the Q-init error; no extra random draw, so the other arrays stay what they were);
- BSFA retained-mass arrays (each reachable tile of a position weighs 1 / reachable) and the decode
  rows' BSFA arrays (row r its own block, A_r = r // BN iid N(0, 1) candidate maxima); the decode
  group gap histograms: every head one KV group whose gap is head 0's + ln 1.5 (``_group_hists``); with
  ``exact_bsfa`` every position's candidate maxima are 0, -1, -2, ... in every sample, so fitted
  thresholds keep exactly min(k, A) and measured density equals predicted (prefill and decode).

Shape legend: L layers, H heads, P query blocks, K k values, T top maxima, O orders, NG gap bins.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from scipy.special import ndtri
from scipy.stats import norm

from sparsecal.formats.geometry import block_counts
from sparsecal.formats.stats_config import StatsConfig


def model_info(layers: int, heads: int) -> dict:
    return {"id": f"synthetic-{layers}x{heads}", "spec": "synthetic", "model_type": "llama",
            "num_layers": layers, "num_heads": heads, "num_kv_heads": heads, "head_dim": 64,
            "max_context": 1 << 20, "vocab_size": 1000}


def _gap_hist(rng, n_tiles: np.ndarray, mass_per_tile: np.ndarray, cdf, edges: np.ndarray,
              shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Counts and masses [*shape, NG] of gaps min(0, g), P(g < x) = cdf(x), over n_tiles.sum() tiles;
    the mass of a bin is its count times the mean tile mass (tiles of block g weigh mass_per_tile[g])."""
    probs = np.diff(np.concatenate([[0.0], cdf(edges), [1.0]]))  # last bin: gap == 0
    total = int(n_tiles.sum())
    count = rng.multinomial(total, probs, size=shape).astype(np.float64)
    mean_mass = float((n_tiles * mass_per_tile).sum() / max(total, 1))
    return count, count * mean_mass


def _top_normals(rng, cand: np.ndarray, t_len: int, lead: tuple) -> np.ndarray:
    """The T largest of A_p iid N(0, 1) draws per position, sorted descending, -inf padded:
    [*lead, P, T]. Exact order statistics without drawing all A_p values: the largest of m
    uniforms is U^(1/m), so ln u_(i) = -sum_{j<=i} E_j / (A_p - j) with E_j ~ Exp(1)."""
    j = np.arange(t_len)
    div = cand[:, None] - j[None, :]                                  # [P, T]
    valid = div > 0
    e = rng.standard_exponential(lead + (len(cand), t_len))
    log_u = -np.cumsum(e / np.where(valid, div, 1), axis=-1)
    return np.where(valid, ndtri(np.exp(log_u)), -np.inf)


def synthetic_stats(rng, n: int, cfg: StatsConfig, layers: int, heads: int, a: float, a_decode: float,
                    target: float, law: tuple | None = None, exact_bsfa: bool = False) -> dict[str, torch.Tensor]:
    """One sample's statistics in the run format (see the module docstring)."""
    cand, reach = block_counts(n, cfg.block_m, cfg.block_n)
    p, ks = len(cand), cfg.k_values
    t_len = max(1, min(cfg.top_count, int(cand.max())))
    top = _top_values(rng, cand, t_len, (layers, heads), exact_bsfa)
    thr = np.full((layers, heads, p, len(ks)), -np.inf)
    for i, k in enumerate(ks):
        ok = cand > k
        if k < t_len:
            thr[:, :, ok, i] = (top[:, :, ok, k - 1] + top[:, :, ok, k]) / 2
    edges = cfg.gap_edges()
    out = {}
    rows = np.arange(max(n - cfg.decode_rows, 0), n)
    for prefix, law_a, n_t, r_t, group_tiles, group_mass in (
            ("", a, cand.sum(), reach.sum(), cand, 1.0 / reach),
            ("decode_", a_decode, (rows // cfg.block_n).sum(), (rows // cfg.block_n + 1).sum(),
             rows // cfg.block_n, 1.0 / (rows // cfg.block_n + 1))):
        c, m = _gap_hist(rng, group_tiles, group_mass, _gap_cdf(n, law_a, target, r_t / max(n_t, 1), law),
                         edges, (layers, heads))
        out[f"{prefix}gap_count"] = torch.from_numpy(np.repeat(c[:, :, None], len(cfg.orders), 2)).int()
        out[f"{prefix}gap_mass"] = torch.from_numpy(np.repeat(m[:, :, None], len(cfg.orders), 2)).float()
    o = len(cfg.orders)
    out.update({
        "bsfa_threshold": torch.from_numpy(thr).float(),
        "bsfa_kept": torch.from_numpy(np.broadcast_to(np.minimum(np.array(ks)[None], cand[:, None]),
                                                      (layers, heads, p, len(ks))).copy()).int(),
        "bsfa_skipped_mass": torch.from_numpy(rng.uniform(0, 0.1, (layers, heads, p, len(ks)))).float(),
        "bsfa_top_bmax": torch.from_numpy(top).float(),
        **_bsfa_mass(top, cand, reach), **_decode_bsfa(rng, n, cfg, (layers, heads), exact_bsfa),
        "tstar_where": torch.from_numpy(rng.integers(0, 50, (layers, heads, o, 3))).int(),
        "tstar_hist": torch.from_numpy(rng.integers(0, 50, (layers, heads, o, cfg.tstar_bins))).int(),
        "qinit_count": torch.from_numpy(rng.integers(0, 5, (layers, heads, len(cfg.qinit_edges()) + 1))).int(),
        "rescale_count": torch.from_numpy(rng.integers(0, 50, (layers, heads, o, cfg.rescale_bins))).int(),
        "rescale_excess": torch.from_numpy(rng.integers(0, 20, (layers, heads, o))).int(),
        "shortfall_count": torch.from_numpy(
            rng.integers(0, 5, (layers, heads, o, 2, len(cfg.shortfall_edges()) + 1))).int(),
        "candidates": torch.from_numpy(cand), "reachable": torch.from_numpy(reach),
        "input_ids": torch.from_numpy(rng.integers(0, 1000, n)).int(),
    })
    out["joint_count"] = _joint_from_qinit(out["qinit_count"].numpy(), cfg)
    out.update(_group_hists(out["decode_gap_count"].numpy(), out["decode_gap_mass"].numpy(), cfg))
    return out


GROUP_SHIFT = math.log(1.5)  # synthetic group gap = the first head's gap + ln 1.5 (capped at 0)


def _group_hists(count: np.ndarray, mass: np.ndarray, cfg: StatsConfig) -> dict:
    """decode_group_gap_count / _mass [L, H, O, NG]: every head in one KV group whose gap is head 0's
    plus GROUP_SHIFT (whole bins, the overflow into the last bin, gap >= 0): the group skips at lambda
    what head 0 skips at lambda / 1.5. No random draw (the other arrays stay what they were)."""
    k = round(GROUP_SHIFT / cfg.gap_step)
    out = {}
    for key, h in (("count", count), ("mass", mass)):
        g = np.zeros_like(h[:, :1])
        g[..., k:] = h[:, :1, ..., :-k]
        g[..., -1] += h[:, :1, ..., -k:].sum(-1)
        out[f"decode_group_gap_{key}"] = torch.from_numpy(np.repeat(g, h.shape[1], 1))
    return {"decode_group_gap_count": out["decode_group_gap_count"].int(),
            "decode_group_gap_mass": out["decode_group_gap_mass"].float()}


def _joint_from_qinit(qinit: np.ndarray, cfg: StatsConfig) -> torch.Tensor:
    """[L, H, NQ] synthetic joint counts: each q-init bin below 0 gives half its rows (rounded
    down) to the bin starting at 0."""
    zero = int(np.searchsorted(cfg.qinit_edges(), 0.0, side="right"))
    joint = qinit.astype(np.int64).copy()
    moved = joint[..., :zero] // 2
    joint[..., :zero] -= moved
    joint[..., zero] += moved.sum(-1)
    return torch.from_numpy(joint).int()


def _gap_cdf(n: int, a: float, target: float, ratio: float, law: tuple | None):
    """P(gap < x) of the module docstring's two constructions; ratio = reachable / candidates."""
    if law is None:
        shift = math.log(a / n) - norm.ppf(min(target * ratio, 0.999))
        return lambda x: norm.cdf(x - shift)
    big_a, big_b, b = law
    lo, width = math.log(big_a) - b * math.log(n), big_b / ratio
    return lambda x: np.clip((x - lo) / width, 0.0, 1.0)


def _top_values(rng, cand: np.ndarray, t_len: int, lead: tuple, exact: bool) -> np.ndarray:
    """[*lead, X, T] sorted candidate maxima: normal order statistics, or with ``exact`` the same
    values -0, -1, -2, ... at every position of every sample (-inf padded), so the fitted thresholds
    are every sample's own and the measured density equals the predicted one."""
    if not exact:
        return _top_normals(rng, cand, t_len, lead)
    vals = np.where(np.arange(t_len)[None, :] < cand[:, None], -np.arange(t_len, dtype=np.float64)[None, :], -np.inf)
    return np.broadcast_to(vals, lead + vals.shape).copy()


def _bsfa_mass(top: np.ndarray, cand: np.ndarray, reach: np.ndarray, prefix: str = "") -> dict:
    """bsfa_top_mass [*lead, X, T] and bsfa_cand_mass [*lead, X]: every reachable tile of a position
    weighs 1 / reachable (as the gap histograms' masses)."""
    w = (1.0 / reach)[:, None]
    return {f"{prefix}bsfa_top_mass": torch.from_numpy(np.where(np.isfinite(top), w, 0.0)).float(),
            f"{prefix}bsfa_cand_mass": torch.from_numpy(np.broadcast_to(cand / reach, top.shape[:-1]).copy()).float()}


def _decode_bsfa(rng, n: int, cfg: StatsConfig, lead: tuple, exact: bool) -> dict:
    """The decode rows' BSFA keys (reduce_reference.decode_bsfa_reduce's), row r its own block with
    A_r = r // BN candidates drawn as the prefill ones; own threshold, kept min(k, A_r), skipped mass
    (A_r - kept) / (A_r + 1)."""
    rows = np.arange(max(n - cfg.decode_rows, 0), n)
    cand, ks = rows // cfg.block_n, np.array(cfg.k_values)
    t_len = max(1, min(cfg.top_count, (n - 1) // cfg.block_n))
    top = _top_values(rng, cand, t_len, lead, exact)
    thr = np.full(lead + (len(rows), len(ks)), -np.inf)
    for i, k in enumerate(ks):
        ok = cand > k
        if k < t_len:
            thr[..., ok, i] = (top[..., ok, k - 1] + top[..., ok, k]) / 2
    kept = np.minimum(ks[None], cand[:, None])
    skipped = (cand[:, None] - kept) / (cand[:, None] + 1.0)
    full = lambda x: torch.from_numpy(np.broadcast_to(x, lead + x.shape).copy())
    return {"decode_bsfa_threshold": torch.from_numpy(thr).float(), "decode_bsfa_kept": full(kept).int(),
            "decode_bsfa_skipped_mass": full(skipped).float(), "decode_bsfa_top_bmax": torch.from_numpy(top).float(),
            **_bsfa_mass(top, cand, cand + 1, "decode_")}


def write_synthetic_run(root: Path, lengths, samples: int, layers: int = 2, heads: int = 2, a: float = 300.0,
                        a_decode: float = 30.0, target: float = 0.5, seed: int = 0,
                        cfg: StatsConfig | None = None, progress=None, law: tuple | None = None,
                        exact_bsfa: bool = False):
    """A run directory of ``samples`` synthetic samples per length; returns the RunStore. ``law``:
    (A, B, b) for gaps with lambda_best(S, n) = A exp(B S) n^-b (module docstring)."""
    from sparsecal.formats.run import RunStore

    cfg = cfg or StatsConfig()
    store = RunStore.create_or_resume(root, model_info(layers, heads), cfg.to_dict(), "float32", "synthetic")
    rng = np.random.default_rng(seed)
    records = []
    for n in lengths:
        for s in range(samples):
            rec = {"id": f"synthetic-{n}-{s:04d}", "task": "synthetic", "length": n, "seed": seed,
                   "index": s, "answer": [], "meta": {}}
            records.append(rec)
    store.plan(records)
    for i, rec in enumerate(records):
        stats = synthetic_stats(rng, rec["length"], cfg, layers, heads, a, a_decode, target, law, exact_bsfa)
        store.write_sample(dict(rec, seconds=0.0, backend="synthetic"), stats)
        if progress:
            progress(i + 1, len(records))
    return store
