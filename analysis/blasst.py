"""BLASST calibration from gap histograms: sparsity(lambda), its inverse, and the lambda laws.

A tile is skipped iff gap < ln(lambda). Gap histograms (kernels/capture/reduce_reference.py) have bins
    0: gap < e_0,   k: e_{k-1} <= gap < e_k  (k = 1 .. E-1),   E: gap >= e_{E-1} = 0.
``skipped(x)`` counts tiles with gap < x, taking tiles as spread evenly inside a bin, so the curve
is exact at every edge and linear between edges (bin 0 is spread over one bin width below e_0).
Its inverse is solved exactly on that piecewise-linear curve: no grid search.

Saturation (lambda >= 1), exactly as the kernels compare ``gap < ln(lambda)``: gaps are <= 0, so
ln(lambda) = 0 skips the tiles with gap < 0 (every bin but the last, which holds gap == 0), and any
ln(lambda) > 0 skips every candidate tile, gap == 0 ones included (the whole histogram). Nothing is
clamped: x > 0 is not treated as "just under 1".

Shape legend: counts [..., NB] with NB = len(edges) + 1; edges [E] ascending, last edge 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _knots(counts: np.ndarray, edges: np.ndarray):
    """(x knots [E+1], cumulative skipped counts at the knots [..., E+1])."""
    step = edges[1] - edges[0] if len(edges) > 1 else 1.0
    x = np.concatenate([[edges[0] - step], edges])
    c = np.concatenate([np.zeros(counts.shape[:-1] + (1,)), np.cumsum(counts[..., :-1], axis=-1)], axis=-1)
    return x, c


def skipped(counts: np.ndarray, edges: np.ndarray, log_lambda: float) -> np.ndarray:
    """Tiles with gap < log_lambda, per leading index. counts [..., NB] -> [...].

    log_lambda > 0 counts every tile (the kernels skip every candidate there); 0 counts gap < 0."""
    counts = np.asarray(counts, np.float64)
    xv = float(log_lambda)
    if xv > 0.0:
        return counts.sum(-1)
    x, c = _knots(counts, np.asarray(edges, np.float64))
    if xv <= x[0]:
        return np.zeros(c.shape[:-1])
    k = min(int(np.searchsorted(x, xv, side="right")) - 1, len(x) - 2)
    frac = (xv - x[k]) / (x[k + 1] - x[k])
    return c[..., k] + frac * (c[..., k + 1] - c[..., k])


def sparsity(counts, edges, reachable, log_lambda) -> np.ndarray:
    """Skipped tiles over reachable tiles (diagonal tiles count as kept). For the sparsity over
    candidate tiles pass reachable = counts.sum(-1) (the histograms hold every candidate tile)."""
    return skipped(counts, edges, log_lambda) / np.asarray(reachable, np.float64)


def log_lambda_for_sparsity(counts: np.ndarray, edges: np.ndarray, reachable: float, target: float) -> float:
    """The ln(lambda) at which sparsity reaches ``target`` for one histogram [NB].

    Returns nan when the target is beyond reach (more than the tiles with gap < 0 over reachable).
    """
    x, c = _knots(np.asarray(counts, np.float64), np.asarray(edges, np.float64))
    want = target * float(reachable)
    if want > c[-1] or c[-1] == 0:
        return float("nan")
    k = int(np.searchsorted(c, want, side="left"))
    if k == 0:
        return float(x[0])
    lo, hi = c[k - 1], c[k]
    return float(x[k - 1] + (want - lo) / (hi - lo) * (x[k] - x[k - 1]))


@dataclass(frozen=True)
class LawFit:
    """lambda = a * L**-b fitted to (L, lambda) points; b is fixed to 1 for the paper's a/L law."""

    a: float
    b: float
    r2: float               # coefficient of determination in ln(lambda)
    residuals: tuple        # ln(lambda) - ln(fit) per point

    def predict(self, length) -> np.ndarray:
        return self.a * np.asarray(length, np.float64) ** -self.b


def _law(lengths, lambdas, a, b) -> LawFit:
    y = np.log(lambdas)
    res = y - (np.log(a) - b * np.log(lengths))
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((res ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return LawFit(float(a), float(b), r2, tuple(float(r) for r in res))


def law_at(lengths, lambdas, a: float, b: float) -> LawFit:
    """A given law lambda = a * L^-b scored against (L, lambda) points: R^2 and residuals in ln(lambda)."""
    return _law(np.asarray(lengths, np.float64), np.asarray(lambdas, np.float64), a, b)


def fit_inverse_length(lengths, lambdas) -> LawFit:
    """Least squares of lambda = a / L in lambda space (BLASST's calibration):
    a = sum(lambda_i / L_i) / sum(1 / L_i^2)."""
    lengths, lambdas = np.asarray(lengths, np.float64), np.asarray(lambdas, np.float64)
    a = float((lambdas / lengths).sum() / (1.0 / lengths ** 2).sum())
    return _law(lengths, lambdas, a, 1.0)


def fit_power_law(lengths, lambdas) -> LawFit:
    """Free power law lambda = a * L^-b by least squares on ln(lambda) = ln(a) - b ln(L)."""
    lengths, lambdas = np.asarray(lengths, np.float64), np.asarray(lambdas, np.float64)
    slope, intercept = np.polyfit(np.log(lengths), np.log(lambdas), 1)
    return _law(lengths, lambdas, float(np.exp(intercept)), float(-slope))
