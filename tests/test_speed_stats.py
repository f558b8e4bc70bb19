"""evaluation/speed_stats.py: the exact null distribution of the Mann-Whitney statistic, and the
speedup interval's coverage checked by simulation on round times shaped like the GPU's (a
multiplicative spread, heavy tails, rare slow rounds) at the round counts the benchmarks use."""
import itertools

import numpy as np
import pytest

from sparsecal.evaluation.speed_stats import mann_whitney_cdf, ratio_interval, round_order


@pytest.mark.parametrize("n,m", [(1, 1), (2, 3), (3, 4), (4, 4), (5, 3)])
def test_the_null_distribution_is_the_enumerated_one(n, m):
    counts = np.zeros(n * m + 1)
    for first in itertools.combinations(range(n + m), n):   # positions of the n x's in the pooled order
        counts[sum(p - i for i, p in enumerate(first))] += 1   # y's below each x
    assert np.allclose(mann_whitney_cdf(n, m), np.cumsum(counts) / counts.sum())


def _rounds(rng, trials: int, n: int, scale: float, kind: str) -> np.ndarray:
    if kind == "lognormal":
        e = rng.normal(0.0, 0.03, (trials, n))
    else:   # heavy tails and, one round in ten, a slow round (a capture gone wrong)
        e = 0.01 * rng.standard_t(2, (trials, n)) + np.where(rng.random((trials, n)) < 0.1, 0.08, 0.0)
    return scale * np.exp(e)


@pytest.mark.parametrize("n", [5, 8, 15])
@pytest.mark.parametrize("kind", ["lognormal", "heavy"])
def test_the_interval_keeps_its_coverage(seed, n, kind):
    rng = np.random.default_rng(seed)
    trials, true = 1500, 1.02
    base, other = _rounds(rng, trials, n, 2.6, kind), _rounds(rng, trials, n, 2.6 / true, kind)
    got = [ratio_interval(b, o) for b, o in zip(base, other)]
    level = got[0]["level"]
    assert 0.95 <= level < 0.99
    cover = np.mean([g["lo"] <= true <= g["hi"] for g in got])
    assert cover >= level - 3 * np.sqrt(level * (1 - level) / trials), (cover, level)
    assert abs(np.median([g["ratio"] for g in got]) - true) < 0.005   # the point is centred


def test_an_interval_needs_four_rounds_each_and_bad_times_are_refused():
    assert ratio_interval([1.0, 1.1, 1.2], [1.0, 1.1, 1.2])["lo"] is None
    r = ratio_interval([2.0, 2.1, 2.2, 2.3], [1.0, 1.05, 1.1, 1.15])
    assert r["lo"] == pytest.approx(2.0 / 1.15) and r["hi"] == pytest.approx(2.3 / 1.0) and r["level"] > 0.95
    assert r["lo"] < r["ratio"] < r["hi"]
    for bad in ([], [1.0, float("nan")], [1.0, 0.0], [[1.0]]):
        with pytest.raises(ValueError, match="positive, finite times"):
            ratio_interval(bad, [1.0])


def test_rounds_alternate_so_every_pair_is_timed_each_way_round():
    """round_order: the given order in even rounds, reversed in odd ones; over 2k rounds each ordered pair of
    variants has the first timed before the second in exactly k of them."""
    names = ["sdpa", "cudnn", "own", "sparse"]
    orders = [round_order(names, r) for r in range(6)]
    assert orders[0] == names and orders[1] == names[::-1] and orders[4] == names
    for x, y in itertools.permutations(names, 2):
        assert sum(o.index(x) < o.index(y) for o in orders) == 3
    assert round_order({"a": 1, "b": 2}, 1) == ["b", "a"]   # a dict's keys, as the benchmarks pass them
