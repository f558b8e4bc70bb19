"""A speedup with a distribution-free interval from two sets of timing rounds.

Two configurations timed in rounds (each round one value, e.g. the median of a CUDA graph's
replays) give two independent samples of times. Their ratio is read on the log scale, where a
speedup is a shift: with x = log(baseline's rounds) [n] and y = log(configuration's rounds) [m],

    point     the Hodges-Lehmann shift, the median of the n * m differences x_i - y_j, as a ratio
              exp(.) (> 1: the configuration is faster);
    interval  the Mann-Whitney inversion (Lehmann 1963; Hollander & Wolfe ch. 4): with the
              differences sorted d_(1) <= ... <= d_(nm), [exp d_(k), exp d_(nm + 1 - k)], k the
              largest count with P(U <= k - 1) <= alpha / 2 under the null, U the Mann-Whitney
              statistic, its exact distribution from the Gaussian binomial coefficient.

The coverage is at least 1 - alpha for any continuous distribution of round times that the two
configurations share up to a scale factor (a shift of the logs), whatever its shape or tails;
rounds spread by things outside the kernel (a capture's memory, clocks) widen the interval rather
than bias it. The smallest samples with an interval at alpha = 0.05: n = m = 4 (k = 1).
tests/test_speed_stats.py checks the coverage by simulation.

Shapes: n, m rounds of the two configurations; N = n * m differences.
"""
from __future__ import annotations

import numpy as np

ALPHA = 0.05
ROUND_ORDER = "alternating"  # what a result file records when its rounds were timed in ``round_order``


def round_order(names, r: int) -> list:
    """The order round r (0, 1, ..) of a round-robin times its variants in: as given in even rounds, reversed in
    odd ones, so over an even number of rounds every pair is timed once each way round. In a fixed order the second
    of two identical kernels timed back to back read 2-5 % slower (prefill, D = 128 64K, an H100;
    data/bench/NOTES.md, s49): a bias of the position that no interval from the rounds can see, since
    ``ratio_interval`` assumes rounds that differ by a scale factor only."""
    return list(names) if r % 2 == 0 else list(reversed(list(names)))


def mann_whitney_cdf(n: int, m: int) -> np.ndarray:
    """P(U <= u) for u = 0 .. n * m under the null (no ties): the coefficients of the Gaussian
    binomial [n + m choose n]_q = prod_{i=1..n} (1 - q^(m + i)) / (1 - q^i), normalized."""
    poly = np.zeros(n * m + 1)
    poly[0] = 1.0
    for i in range(1, n + 1):
        poly[m + i:] -= poly[:n * m + 1 - (m + i)].copy()        # times (1 - q^(m + i))
        for u in range(i, n * m + 1):                             # divided by (1 - q^i)
            poly[u] += poly[u - i]
    return np.cumsum(poly / poly.sum())


def ratio_interval(base, other, alpha: float = ALPHA) -> dict:
    """{"ratio", "median_ratio", "lo", "hi", "level"}: how many times faster ``other`` is than
    ``base`` (ratio of times base / other: Hodges-Lehmann, and the ratio of the medians the tables
    quote) and its exact interval (module docstring); lo and hi are None where the samples are too
    small for one at this alpha (level then None)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        x, y = np.log(np.asarray(base, dtype=float)), np.log(np.asarray(other, dtype=float))
    if x.ndim != 1 or y.ndim != 1 or not len(x) or not len(y) or not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("ratio_interval needs two non-empty 1-d samples of positive, finite times")
    d = np.sort((x[:, None] - y[None, :]).ravel())
    out = {"ratio": float(np.exp(np.median(d))), "median_ratio": float(np.median(base) / np.median(other)),
           "lo": None, "hi": None, "level": None}
    cdf = mann_whitney_cdf(len(x), len(y))
    k = int(np.searchsorted(cdf, alpha / 2, side="right"))     # P(U <= k - 1) <= alpha / 2
    if k >= 1:
        out.update(lo=float(np.exp(d[k - 1])), hi=float(np.exp(d[len(d) - k])), level=float(1 - 2 * cdf[k - 1]))
    return out
