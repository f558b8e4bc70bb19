"""BLASST calibration math on synthetic gap histograms with known answers."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from sparsecal.analysis.blasst import fit_inverse_length, fit_power_law, log_lambda_for_sparsity, skipped, sparsity
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.reduce_reference import histogram

EDGES = StatsConfig().gap_edges()


def hist(gaps):
    return histogram(torch.as_tensor(gaps, dtype=torch.float64)[None], EDGES)[0].numpy()


def test_skipped_exact_at_edges_and_between(seed):
    rng = np.random.default_rng(seed)
    gaps = np.concatenate([-rng.exponential(4.0, 5000), np.zeros(300)])  # 300 tiles set a new max
    counts, edges = hist(gaps), EDGES
    for k in rng.integers(1, len(edges), 20):
        assert skipped(counts, edges, edges[k]) == np.sum(gaps < edges[k])
    for x in rng.uniform(-20, -0.1, 20):
        assert abs(skipped(counts, edges, x) - np.sum(gaps < x)) <= max(counts) + 1
    assert skipped(counts, edges, 0.0) == 5000  # gap == 0 tiles are never skipped


def test_inverse_recovers_quantile(seed):
    rng = np.random.default_rng(seed)
    gaps = rng.normal(-8, 2, 20000).clip(max=0)
    counts, edges = hist(gaps), EDGES
    for target in (0.1, 0.5, 0.7, 0.9):
        x = log_lambda_for_sparsity(counts, edges, reachable=len(gaps), target=target)
        assert abs(sparsity(counts, edges, len(gaps), x) - target) < 1e-9
        assert abs(np.mean(gaps < x) - target) < 0.01  # exact to 0.01 against the raw values
    assert math.isnan(log_lambda_for_sparsity(counts, edges, reachable=len(gaps) * 2, target=0.9))


@pytest.mark.parametrize("a,target", [(200.0, 0.5), (500.0, 0.7)])
def test_fit_recovers_a_over_l(seed, a, target):
    """Gaps drawn so that P(gap < ln(a/L)) = target at every length: the fits give a and b = 1."""
    rng = np.random.default_rng(seed)
    lengths = np.array([1024, 2048, 4096, 8192, 16384, 32768])
    lam_best = []
    for n in lengths:
        gaps = np.log(a / n) - norm.ppf(target) + rng.normal(0, 1, 40000)
        counts = hist(np.minimum(gaps, 0.0))
        lam_best.append(math.exp(log_lambda_for_sparsity(counts, EDGES, len(gaps), target)))
    inv, free = fit_inverse_length(lengths, lam_best), fit_power_law(lengths, lam_best)
    assert inv.a == pytest.approx(a, rel=0.05) and inv.b == 1.0 and inv.r2 > 0.99
    assert free.b == pytest.approx(1.0, abs=0.03) and free.a == pytest.approx(a, rel=0.25)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-30, 0), min_size=1, max_size=200), st.floats(-26, 0), st.floats(-26, 0))
def test_sparsity_monotone_in_lambda(gaps, x1, x2):
    counts = hist(np.array(gaps))
    lo, hi = sorted((x1, x2))
    assert skipped(counts, EDGES, lo) <= skipped(counts, EDGES, hi) + 1e-9
