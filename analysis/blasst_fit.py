"""BLASST calibration over a run: lambda_best per length, the lambda = a/L and power-law fits,
per-layer a, per-head sparsity and sparsity(lambda) curves (the laws compared and the held-out
rows: analysis/blasst_laws.py). Prefill and decode are fitted separately, each scan order on its own.

Shape legend: L layers, H heads, O scan orders, NG gap bins. ``HistSum`` holds one length's gap
histograms summed over samples; ``reach`` and ``npos`` are per (layer, head), so the totals over
a histogram summed across layers and heads are reach * L * H and npos * L * H.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sparsecal.analysis.blasst import fit_inverse_length, fit_power_law, log_lambda_for_sparsity, skipped

MODES = ("prefill", "decode")
CURVE_STRIDE = 5  # curves tables sample every 5th gap edge (0.25 in ln(lambda) by default)


@dataclass
class HistSum:
    """Gap histograms of one mode and length, summed over samples."""

    count: np.ndarray        # [L, H, O, NG] float64
    mass: np.ndarray         # [L, H, O, NG] float64
    reach: float = 0.0       # reachable tiles per (layer, head)
    npos: float = 0.0        # query blocks (prefill) or decode rows per (layer, head)
    samples: int = 0

    @classmethod
    def empty_like(cls, count: np.ndarray) -> HistSum:
        return cls(np.zeros(count.shape), np.zeros(count.shape))

    def add(self, count, mass, reach: float, npos: float) -> None:
        self.count += count
        self.mass += mass
        self.reach += reach
        self.npos += npos
        self.samples += 1

    def heads(self) -> int:
        return self.count.shape[0] * self.count.shape[1]


@dataclass
class Calibration:
    """One (mode, order, target): lambda_best per length and the two laws fitted to it."""

    mode: str
    order: str
    target: float
    lengths: list
    log_lambda: list           # per length, nan where the target is out of reach
    max_sparsity: list         # per length: sparsity at lambda = 1 (every tile with gap < 0)
    law: object = None         # LawFit of lambda = a/L (None if no length reaches the target)
    power: object = None       # LawFit of lambda = a L^-b (None with fewer than 2 lengths)
    fixed_length: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def in_fit(self) -> list[int]:
        return [n for n, x in zip(self.lengths, self.log_lambda) if not math.isnan(x)]

    @property
    def fixed_lambda(self) -> float:
        """lambda_best at ``fixed_length``: one lambda calibrated once and used at every length."""
        return math.exp(self.log_lambda[self.lengths.index(self.fixed_length)])


def calibrate(sums: dict[int, HistSum], edges: np.ndarray, mode: str, o: int, order: str,
              target: float) -> Calibration:
    """lambda_best per length (exact inverse of the summed histogram) and the fits."""
    lengths = sorted(sums)
    logs, maxs = [], []
    for n in lengths:
        s = sums[n]
        c = s.count[:, :, o].sum((0, 1))
        total = s.reach * s.heads()
        logs.append(log_lambda_for_sparsity(c, edges, total, target))
        maxs.append(float(skipped(c, edges, 0.0) / total))
    cal = Calibration(mode, order, target, lengths, logs, maxs)
    fit_n = cal.in_fit
    if fit_n:
        lam = [math.exp(x) for n, x in zip(lengths, logs) if n in fit_n]
        cal.law = fit_inverse_length(fit_n, lam)
        cal.power = fit_power_law(fit_n, lam) if len(fit_n) >= 2 else None
        cal.fixed_length = fit_n[(len(fit_n) - 1) // 2]
    return cal


def unreachable_note(cal: Calibration) -> str | None:
    """The warning for lengths left out of a target's fit, naming the range they can reach."""
    out = [(n, m) for n, x, m in zip(cal.lengths, cal.log_lambda, cal.max_sparsity) if math.isnan(x)]
    if not out:
        return None
    desc = ", ".join(f"{n} tokens reach at most {m:.3f}" for n, m in out)
    return (f"BLASST {cal.mode} ({cal.order}) target {cal.target:g}: left out of the fit: {desc} "
            "(short prompts cannot skip much: most of their tiles set a running max).")


def lambda_rows(cal: Calibration) -> list[dict]:
    """blasst_lambda table rows: lambda_best per length next to both laws."""
    rows = []
    for n, x, m in zip(cal.lengths, cal.log_lambda, cal.max_sparsity):
        law = float(cal.law.predict(n)) if cal.law else math.nan
        power = float(cal.power.predict(n)) if cal.power else math.nan
        rows.append({"mode": cal.mode, "order": cal.order, "target": cal.target, "length": n,
                     "lambda_best": math.exp(x) if not math.isnan(x) else math.nan,
                     "log_lambda_best": x, "max_sparsity": m, "in_fit": not math.isnan(x),
                     "lambda_law": law, "lambda_power": power,
                     "residual_law": x - math.log(law) if cal.law and not math.isnan(x) else math.nan})
    return rows


def layer_rows(cal: Calibration, sums: dict[int, HistSum], edges, o: int) -> list[dict]:
    """Per-layer a of the a/L law (heads and samples pooled): the spread across layers."""
    n_layers, n_heads = next(iter(sums.values())).count.shape[:2]
    rows = []
    for layer in range(n_layers):
        pts = []
        for n in sorted(sums):
            s = sums[n]
            x = log_lambda_for_sparsity(s.count[layer, :, o].sum(0), edges, s.reach * n_heads, cal.target)
            if not math.isnan(x):
                pts.append((n, math.exp(x)))
        f = fit_inverse_length(*zip(*pts)) if pts else None
        rows.append({"mode": cal.mode, "order": cal.order, "target": cal.target, "layer": layer,
                     "a": f.a if f else math.nan, "r2": f.r2 if f else math.nan, "n_lengths": len(pts)})
    return rows


def head_rows(cal: Calibration, sums: dict[int, HistSum], edges, o: int) -> list[dict]:
    """Per (layer, head) sparsity and retained mass at the calibrated a/L, per length."""
    if cal.law is None:
        return []
    rows = []
    for n in sorted(sums):
        s = sums[n]
        x = math.log(float(cal.law.predict(n)))
        sp = skipped(s.count[:, :, o], edges, x) / s.reach
        rm = 1.0 - skipped(s.mass[:, :, o], edges, x) / s.npos
        for (layer, head), v in np.ndenumerate(sp):
            rows.append({"mode": cal.mode, "order": cal.order, "target": cal.target, "length": n,
                         "layer": layer, "head": head, "sparsity": float(v), "retained_mass": float(rm[layer, head])})
    return rows


def curve_rows(mode: str, orders, sums: dict[int, HistSum], edges: np.ndarray) -> list[dict]:
    """sparsity(lambda) (over reachable and over candidate tiles) and retained mass(lambda) per length
    and order, at every CURVE_STRIDE-th edge up to ln(lambda) = 0. Any ln(lambda) > 0 skips every
    candidate: sparsity = ``candidate_share`` (candidates / reachable), sparsity_candidates = 1."""
    rows = []
    pick = np.arange(len(edges) - 1, -1, -CURVE_STRIDE)[::-1]
    for n in sorted(sums):
        s = sums[n]
        for o, order in enumerate(orders):
            cc = np.cumsum(s.count[:, :, o].sum((0, 1)))
            cm = np.cumsum(s.mass[:, :, o].sum((0, 1)))
            for e in pick:  # tiles with gap < edges[e] are bins 0..e
                rows.append({"mode": mode, "order": order, "length": n, "log_lambda": float(edges[e]),
                             "sparsity": float(cc[e] / (s.reach * s.heads())),
                             "sparsity_candidates": float(cc[e] / max(cc[-1], 1.0)),
                             "candidate_share": float(cc[-1] / (s.reach * s.heads())),
                             "retained_mass": float(1.0 - cm[e] / (s.npos * s.heads()))})
    return rows
