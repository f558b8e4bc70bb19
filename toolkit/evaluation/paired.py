"""Exact and score-based statistics of paired 0/1 outcomes, and the power figures of a cell.

A 0/1 cell pairs a method's score with dense's score on the same n samples: the 2x2 table
a (both right), b (method right, dense wrong: ``gained``), c (method wrong, dense right: ``lost``),
d (both wrong). Only the discordant pairs b and c carry information on the difference of the two
accuracies, delta = (b - c) / n; with a handful of them a bootstrap of the samples claims more
than the data hold (4 discordant answers all one way read as a significant 5% gain), so:

    sign_test_p     two-sided exact McNemar p-value: the sign test of b against b + c trials at
                    1/2, min(1, 2 * P(Bin(b + c, 1/2) <= min(b, c))); 1 when b + c = 0. For
                    continuous values it is the sign test of the nonzero paired differences.
    tango           Tango's (1998) score interval of delta: every delta whose score statistic
                    (|b - c - n delta| - cc) / sqrt(n (2 q(delta) + delta (1 - delta))) is at most
                    z_{1-alpha/2}, q(delta) the maximum-likelihood P(c-cell) under delta, cc = 1
                    count (Edwards' continuity correction of McNemar's statistic carried to every
                    delta). It keeps its coverage with zero discordant pairs, where Newcombe's
                    square-and-add interval collapses to a point (b = c = 0 gives phi = 1), and
                    with cc = 1 it never excludes 0 where the exact test keeps it (checked for
                    b, c <= 40 at n = 50, 100, 200; without it, 4 of 4 one-way reads as a
                    difference that the exact p = 0.125 does not support). Cost: about 40%
                    wider than uncorrected with a handful of discordant pairs.
    wilson          Wilson's score interval of one proportion (a method's own accuracy).
    mover           Zou & Donner's MOVER interval of a mean of independent estimates from each
                    one's interval (a point averaged over its tasks).
    mdd_binary      the smallest accuracy difference an exact McNemar test at alpha 0.05 detects
                    with power 0.8 on n samples, given the rounding floor's discordance.
    mdd_normal      (z_{1-alpha/2} + z_{power}) * sd / sqrt(n) for a continuous paired difference.

Shapes: every function takes arrays of one shape [...] (or scalars) and returns that shape.
"""
from __future__ import annotations

import numpy as np
from scipy.stats import binom, norm

ALPHA = 0.05
POWER = 0.8
CC = 1.0  # Tango's continuity correction (counts): the interval then never excludes 0 where the exact test keeps it
_BISECT = 60  # halvings of [-1, 1]: 2^-59 < 1e-17, below float64 resolution of a difference


def sign_test_p(gained, lost) -> np.ndarray:
    """Two-sided exact sign-test (exact McNemar) p-value of ``gained`` against ``lost`` [...]."""
    b, c = np.asarray(gained), np.asarray(lost)
    return np.minimum(1.0, 2.0 * binom.cdf(np.minimum(b, c), b + c, 0.5))


def wilson(x, n, level: float = 1 - ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval (lo, hi) [...] of x successes in n trials."""
    x, n = np.asarray(x, float), np.asarray(n, float)
    z = norm.ppf(0.5 + level / 2)
    p = x / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return mid - half, mid + half


def _tango_score(b, c, n, delta, cc: float) -> np.ndarray:
    """Tango's score statistic [...] of the table (b, c, n) at the difference ``delta``, its
    numerator moved ``cc`` towards 0 (a continuity correction; 0 = none)."""
    a2 = 2 * n
    b2 = -b - c + (2 * n - b + c) * delta
    c2 = -c * delta * (1 - delta)
    q = (np.sqrt(np.maximum(b2 * b2 - 4 * a2 * c2, 0.0)) - b2) / (2 * a2)
    var = n * (2 * q + delta * (1 - delta))
    num = b - c - n * delta
    num = np.sign(num) * np.maximum(np.abs(num) - cc, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = num / np.sqrt(var)
    # var is 0 only where delta is +-1 and the table agrees with it exactly
    return np.where(var > 0, t, np.where(num >= 0, 0.0, -np.inf))


def tango(gained, lost, n, level: float = 1 - ALPHA, cc: float = CC) -> tuple[np.ndarray, np.ndarray]:
    """Tango's score interval (lo, hi) [...] of the paired difference (gained - lost) / n.

    The score statistic falls as delta grows, so each end is found by bisection on [-1, 1]:
    lo is where it crosses +z, hi where it crosses -z."""
    b, c, n = (np.asarray(v, float) for v in (gained, lost, n))
    b, c, n = np.broadcast_arrays(b, c, n)
    z = norm.ppf(0.5 + level / 2)
    ends = []
    for target in (z, -z):
        lo, hi = np.full(b.shape, -1.0), np.full(b.shape, 1.0)
        for _ in range(_BISECT):
            mid = (lo + hi) / 2
            above = _tango_score(b, c, n, mid, cc) > target
            lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
        ends.append((lo + hi) / 2)
    point = (b - c) / n
    return np.minimum(ends[0], point), np.maximum(ends[1], point)


def mover(points, los, his) -> tuple:
    """(mean, lo, hi) of the mean of independent estimates ``points`` [..., k] with intervals
    ``los``/``his`` [..., k] (MOVER: the mean's distance to each end is the root sum of squares of
    the estimates' distances to theirs, each divided by k). Floats for one mean, else [...]."""
    p, lo, hi = (np.asarray(v, float) for v in (points, los, his))
    k = p.shape[-1]
    m = p.mean(-1)
    out = (m, m - np.sqrt(np.sum((p - lo) ** 2, -1)) / k, m + np.sqrt(np.sum((hi - p) ** 2, -1)) / k)
    return tuple(float(v) for v in out) if m.ndim == 0 else out


def mdd_binary(n: int, floor_discordance: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest accuracy difference delta that the two-sided exact McNemar test at ``alpha``
    detects with probability >= ``power`` on ``n`` paired 0/1 samples.

    Model: the rounding floor's discordant proportion psi0 (dense:fp32 against dense) flips
    answers both ways with equal odds, and the method adds delta one way, so the discordant count
    is D ~ Bin(n, psi0 + delta) and the gains among them Bin(D, (psi0/2 + delta) / (psi0 + delta)).
    Power(delta) = sum_D P(D) P(the test rejects | D), exactly; delta runs over a grid of 1/(4n).
    Returns 1.0 when no delta up to 1 - psi0 reaches the power."""
    d = np.arange(n + 1)
    # per D: the largest k with 2 P(Bin(D, 1/2) >= k) <= alpha (gains at or above it reject)
    ks = np.arange(n + 1)
    p_two = np.minimum(1.0, 2 * binom.sf(ks[None, :] - 1, d[:, None], 0.5))  # [D, k]: P(X >= k) both ways
    ok = (p_two <= alpha) & (ks[None, :] >= (d[:, None] + 1) / 2)
    k_hi = np.where(ok.any(1), np.argmax(ok, 1), n + 2)  # [D]
    grid = np.arange(1, 4 * n + 1) / (4 * n)
    grid = grid[grid <= 1 - floor_discordance]
    psi = floor_discordance + grid  # [G]
    q = (floor_discordance / 2 + grid) / psi
    p_reject = binom.sf(k_hi[None, :] - 1, d[None, :], q[:, None]) + binom.cdf(d[None, :] - k_hi[None, :], d[None, :],
                                                                                 q[:, None])
    p_reject = np.where(k_hi[None, :] <= d[None, :], p_reject, 0.0)  # [G, D]
    pw = (binom.pmf(d[None, :], n, psi[:, None]) * p_reject).sum(1)
    hit = np.nonzero(pw >= power)[0]
    return float(grid[hit[0]]) if hit.size else 1.0


def mdd_normal(sd, n, alpha: float = ALPHA, power: float = POWER):
    """(z_{1-alpha/2} + z_{power}) * sd / sqrt(n) [...]: the smallest mean paired difference a
    two-sided test at ``alpha`` detects with ``power`` when the differences have spread ``sd``."""
    return (norm.ppf(1 - alpha / 2) + norm.ppf(power)) * np.asarray(sd, float) / np.sqrt(np.asarray(n, float))
