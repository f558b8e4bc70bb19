"""An engine's fixed law fitted where the user's traffic is (numpy, torch-free).

A serving engine applies lambda = factor / L at every length L: one factor per phase (the scalar
formats) or Model-Optimizer's factor(S) = a * exp(b * S). The sparsity it reaches at L is read off
the run's gap histograms (analysis.blasst: a tile is skipped iff its gap < ln(lambda); ln(lambda)
> 0 skips every candidate tile). Given weights over lengths, the factor for a target S is the one
that minimises the weighted squared sparsity error sum_L w_L (S_L(factor) - S)^2, found on a grid
in ln(factor) (step GRID_STEP); the a * exp(b * S) law is then fitted (least squares in ln(factor))
through the best factors of the fitted targets.

Sparsity is "over the layers that skip" (``sparse`` mask): the mean over those layers of each
layer's skipped / reachable tiles, which is what Model-Optimizer's calibrator means by a target
(it averages the per-call sparsity over the enabled sparse-attention modules; ignored modules are
not among them). A scalar file skips on every layer (an all-true mask).

Weights are given at any length inside the calibrated range: a length between two calibrated
lengths puts its weight on both, linearly in ln(length) (``calibrated_weights``).

Shape legend: L' captured layers, H heads, NG gap bins (E + 1 with E edges), NX grid points.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sparsecal.analysis.blasst import _knots
from sparsecal.analysis.engine_law import ExpLaw, fit_exp_law
from sparsecal.formats.errors import UserError

GRID_STEP = 0.002   # ln(factor) resolution of the best-factor search (0.2 % in the factor)
ABOVE = 0.5         # the search reaches ln(longest length) + ABOVE (lambda > 1 everywhere past it)


def calibrated_weights(weights: dict, lengths, what: str = "--length-weights") -> dict[int, float]:
    """{length: weight} at any lengths within [min(lengths), max(lengths)] -> {calibrated length:
    weight}, normalised to sum 1; a length between two calibrated ones splits its weight between
    them linearly in ln(length). One UserError line for a length outside the calibrated range."""
    cal = sorted(int(n) for n in lengths)
    total = float(sum(weights.values()))
    if not weights or total <= 0:
        raise UserError(f"{what}: no positive weight; give LENGTH:WEIGHT pairs such as 1024:0.5,4096:0.5.")
    outside = sorted(n for n in weights if not cal[0] <= n <= cal[-1])
    if outside:
        share = sum(weights[n] for n in outside) / total
        raise UserError(f"{what}: {len(outside)} length(s) ({_span(outside)} tokens, {share:.0%} of the weight) lie "
                        f"outside the calibrated lengths {cal[0]}-{cal[-1]}: the run has no statistics there; capture "
                        "at those lengths too, or leave them out.")
    out = {n: 0.0 for n in cal}
    for n, w in weights.items():
        k = int(np.searchsorted(cal, n))
        if cal[k] == n:
            out[n] += w / total
            continue
        lo, hi = cal[k - 1], cal[k]
        t = (math.log(n) - math.log(lo)) / (math.log(hi) - math.log(lo))
        out[lo] += (1.0 - t) * w / total
        out[hi] += t * w / total
    return out


def _span(ns: list[int]) -> str:
    return str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"


@dataclass(frozen=True)
class Curve:
    """One length's sparsity over the layers that skip, as a function of ln(lambda): piecewise
    linear on the gap knots up to 0, and ``full`` (every candidate tile) above 0."""

    x: np.ndarray       # [E + 1] knots in ln(lambda)
    s: np.ndarray       # [E + 1] skipped / reachable tiles at the knots
    full: float         # every candidate tile / reachable tiles (ln(lambda) > 0)

    def at(self, log_lambda) -> np.ndarray:
        """Sparsity at each ln(lambda) (any shape)."""
        x = np.asarray(log_lambda, np.float64)
        return np.where(x > 0.0, self.full, np.interp(x, self.x, self.s, left=0.0))


def curves(hists: dict, edges, sparse: np.ndarray, diagonal: bool = False) -> dict[int, Curve]:
    """{length: Curve} of summed histograms {length: Hist} (count [L', H, NG]) over the ``sparse``
    layers ([L'] bool); lengths whose sparse layers have no reachable tile are left out. With
    ``diagonal`` (Model-Optimizer's rule: every reachable tile is a candidate, and lambda >= 1 skips
    them all) the diagonal tiles' histograms count too where the samples have them."""
    out = {}
    keep = np.asarray(sparse, bool)
    for n, h in hists.items():
        counts = np.asarray(h.count, np.float64)[keep].sum((0, 1))     # [NG]
        with_diag = diagonal and h.diag is not None
        if with_diag:
            counts = counts + np.asarray(h.diag, np.float64)[keep].sum((0, 1))
        reach = h.reach * int(np.sum(sparse)) * h.count.shape[1]
        if reach <= 0:
            continue
        x, c = _knots(counts, np.asarray(edges, np.float64))
        out[int(n)] = Curve(x, c / reach, 1.0 if with_diag else float(counts.sum() / reach))
    return out


def sparsity_at(cur: dict, factor: float) -> dict[int, float]:
    """{length: sparsity the engine reaches there at lambda = factor / length}."""
    return {n: float(c.at(math.log(factor / n))) for n, c in cur.items()}


def weighted_error(cur: dict, weights: dict, factor: float, target: float) -> float:
    """sqrt(sum_L w_L (S_L(factor) - target)^2) over the weighted lengths (weights summing to 1)."""
    got = sparsity_at({n: cur[n] for n in weights if weights[n] > 0}, factor)
    return math.sqrt(sum(weights[n] * (s - target) ** 2 for n, s in got.items()))


def best_factor(cur: dict, weights: dict, target: float) -> float:
    """The factor minimising the weighted squared sparsity error at ``target`` (the smallest on a
    flat optimum: the lowest lambda that does as well)."""
    used = {n: w for n, w in weights.items() if w > 0 and n in cur}
    if not used:
        raise UserError("no calibrated length with a weight has statistics on the layers that skip; give weights "
                        "on the calibrated lengths.")
    lo = min(math.log(n) + cur[n].x[0] for n in used)
    hi = max(math.log(n) for n in used) + ABOVE
    grid = np.arange(lo, hi + GRID_STEP, GRID_STEP)                                                # [NX]
    err = sum(w * (cur[n].at(grid - math.log(n)) - target) ** 2 for n, w in used.items())
    return float(math.exp(grid[int(np.argmin(err))]))


def fit_law(cur: dict, weights: dict, targets) -> ExpLaw:
    """factor(S) = a * exp(b * S) through the best factor of each target (at least two targets)."""
    targets = sorted({float(t) for t in targets})
    return fit_exp_law(targets, [best_factor(cur, weights, t) for t in targets])

