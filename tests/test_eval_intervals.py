"""Statistics of evaluation rows (toolkit/evaluation/intervals.py, paired.py): exact paired tests,
Tango's interval of a paired difference of proportions, BCa intervals of ratios, their coverage
measured by simulation, the floor flag and the minimum detectable difference; and the --methods
grammar of decode modes and noise-floor methods."""
import re

import numpy as np
import polars as pl
import pytest
from scipy.stats import binomtest, bootstrap

from sparsecal.evaluation.intervals import DRAWS, Means, _exp, _mean, _ratio, cells, weights
from sparsecal.evaluation.methods import Method, parse_methods, with_dense
from sparsecal.evaluation.paired import mdd_binary, mdd_normal, mover, sign_test_p, tango
from sparsecal.evaluation.summary import noise_floor, points, result_rows, summarize
from sparsecal.formats.errors import UserError


def _rows(np_rng, n, task="niah_single", flip=(), nll_shift=0.0, label="bsfa:16", dense_p=0.7, force=None,
          split=None):
    """Dense, dense:fp32 and one method on n samples: the method's score differs from dense's on
    ``flip``; ``force`` {i: dense score} pins dense's score of those samples."""
    rows = []
    for i in range(n):
        sd = float(np_rng.random() < dense_p) if i not in (force or {}) else force[i]
        nll = 2.0 + 0.1 * np_rng.random()
        sm = 1.0 - sd if i in flip else sd
        fp32_nll = nll + 1e-4 * np_rng.standard_normal()
        for lab, sc, nl, ll in (("dense", sd, nll, -1.0), ("dense:fp32", sd, fp32_nll, -1.0),
                                (label, sm, nll + nll_shift, -1.0 - 0.1 * (i in flip))):
            row = {"sample_id": f"{task}{i}", "label": lab, "method": lab.split(":")[0], "config": lab,
                   "length": 1024, "task": task, "score": sc, "correct": sc == 1.0, "top1": 0.98, "kl": 0.01,
                   "nll": nl, "answer_logprob": ll, "sparsity": 0.5, "decode_sparsity": 0.0, "prefill_s": 0.1,
                   "decode_s": 0.1, "held_out_task": False}
            rows.append(row if split is None else dict(row, split=split))
    return rows


def _one(c: pl.DataFrame, label="bsfa:16", **eq) -> dict:
    for k, v in eq.items():
        c = c.filter(pl.col(k) == v)
    return c.filter(pl.col("label") == label).to_dicts()[0]


def test_exact_sign_test_equals_binomtest():
    """sign_test_p is scipy's two-sided exact binomial test of gained in gained + lost at 1/2."""
    for b, c in ((4, 0), (0, 0), (6, 0), (3, 7), (12, 30), (1, 1)):
        want = 1.0 if b + c == 0 else binomtest(b, b + c, 0.5).pvalue
        assert sign_test_p(b, c) == pytest.approx(want, rel=1e-12), (b, c)


def test_four_one_way_discordant_answers_are_not_a_gain(np_rng):
    """The issue's case: 4 answers of 50 gained, none lost (dense 0.7). Exact p = 0.125, and the
    relative accuracy's interval holds 1; the paired percentile bootstrap this replaces excluded it."""
    force = {i: 0.0 for i in range(4)} | {i: 1.0 for i in range(4, 39)} | {i: 0.0 for i in range(39, 50)}
    r = _one(cells(_rows(np_rng, 50, flip=set(range(4)), force=force))[0])
    assert (r["gained"], r["lost"], r["binary"]) == (4, 0, True) and r["p_dense"] == pytest.approx(0.125)
    assert r["accuracy_diff"] == pytest.approx(0.08) and r["accuracy_diff_lo"] < 0 < r["accuracy_diff_hi"]
    assert r["accuracy_rel_dense_lo"] < 1 < r["accuracy_rel_dense_hi"]
    m, d = np.r_[np.ones(39), np.zeros(11)], np.r_[np.zeros(4), np.ones(35), np.zeros(11)]
    idx = np.random.default_rng(0).integers(0, 50, size=(DRAWS, 50))
    old_lo = np.percentile(m[idx].mean(1) / d[idx].mean(1), 2.5)
    assert old_lo > 1, old_lo


def test_tango_never_claims_what_the_exact_test_does_not():
    """With its continuity correction, Tango's interval excludes 0 only where the exact McNemar
    test rejects at 0.05 (every table with b, c <= 40 at n = 50, 100, 200); without it, it does
    for 4 of 4 one-way. Zero discordant pairs: +-(z^2 + ...)/n, never a point."""
    b, c = (g.ravel() for g in np.meshgrid(np.arange(41), np.arange(41)))
    for n in (50, 100, 200):
        lo, hi = tango(b, c, n)
        excludes = (lo > 0) | (hi < 0)
        assert not np.any(excludes & (sign_test_p(b, c) >= 0.05)), n
        assert np.all((lo <= (b - c) / n) & ((b - c) / n <= hi))
    assert tango(4, 0, 50, cc=0.0)[0] > 0 and tango(4, 0, 50)[0] < 0
    lo, hi = tango(0, 0, 50)
    assert lo == pytest.approx(-hi) and hi > 0.07


REGIMES = [  # (n, P(method right, dense wrong), P(method wrong, dense right)): 0-5 expected discordant pairs
    (50, 0.0, 0.0), (50, 0.01, 0.0), (50, 0.04, 0.0), (50, 0.1, 0.0), (50, 0.02, 0.02), (50, 0.05, 0.05),
    (50, 0.04, 0.01), (100, 0.01, 0.0), (100, 0.02, 0.0), (100, 0.04, 0.0), (100, 0.0, 0.05), (100, 0.02, 0.02),
    (100, 0.005, 0.005), (100, 0.03, 0.01)]


def _old_percentile_diff(np_rng, b, c, n, draws=1000):
    """The paired percentile bootstrap interval of (b - c) / n the summary used before: resampling
    the n pairs draws the discordant counts as a multinomial of the observed shares."""
    bb = np_rng.binomial(n, b[:, None] / n, size=(b.size, draws))
    cc = np_rng.binomial(n - bb, (c / np.maximum(n - b, 1))[:, None])
    return np.percentile((bb - cc) / n, [2.5, 97.5], axis=1)


def test_binary_interval_coverage_by_simulation(np_rng):
    """Tango's interval (paired.tango, as cells uses it) covers the true difference in >= 0.93 of
    4000 simulated tables in every regime of few (0-5 expected) discordant pairs out of 50-100,
    one-way ones included; the old paired percentile bootstrap falls below 0.93 where a one-way
    difference of 2 expected pairs often shows none (its interval is then [0, 0])."""
    reps, worst_old = 4000, 1.0
    for n, pb, pc in REGIMES:
        t = np_rng.multinomial(n, [pb, pc, 1 - pb - pc], size=reps)
        lo, hi = tango(t[:, 0], t[:, 1], n)
        cover = np.mean((lo <= pb - pc + 1e-12) & (pb - pc - 1e-12 <= hi))
        assert cover >= 0.93, (n, pb, pc, cover)
        if (n, pb, pc) in ((50, 0.04, 0.0), (100, 0.02, 0.0)):
            olo, ohi = _old_percentile_diff(np_rng, t[:1000, 0], t[:1000, 1], n)
            worst_old = min(worst_old, np.mean((olo <= pb - pc + 1e-12) & (pb - pc - 1e-12 <= ohi)))
    assert worst_old < 0.9, worst_old


def test_relative_accuracy_coverage_binary(np_rng):
    """1 + Tango / dense's mean covers the true ratio p_method / p_dense in >= 0.93 of tables with
    few discordant pairs (cells where dense scores >= 0.2)."""
    for n, p_dense, pb, pc in ((50, 0.7, 0.04, 0.0), (50, 0.3, 0.04, 0.0), (100, 0.5, 0.0, 0.05),
                               (100, 0.7, 0.02, 0.02), (50, 0.25, 0.1, 0.0)):
        t = np_rng.multinomial(n, [p_dense - pc, pb, pc, 1 - p_dense - pb], size=4000)
        dense = (t[:, 0] + t[:, 2]) / n
        lo, hi = tango(t[:, 1], t[:, 2], n)
        ok = dense >= 0.2
        truth = 1 + (pb - pc) / p_dense
        cover = np.mean(((1 + lo / dense <= truth) & (truth <= 1 + hi / dense))[ok])
        assert cover >= 0.93, (n, p_dense, pb, pc, cover)


def test_point_interval_coverage_by_simulation(np_rng):
    """A point's interval (MOVER over its tasks) of the mean accuracy difference over two binary
    tasks of 50 samples, one with a one-way loss of 2 expected answers: coverage >= 0.93."""
    regimes = ((0.0, 0.04), (0.02, 0.02))  # (gained, lost) probabilities per task
    tabs = [np_rng.multinomial(50, [pb, pc, 1 - pb - pc], size=4000) for pb, pc in regimes]
    ends = [tango(t[:, 0], t[:, 1], 50) for t in tabs]
    points = np.stack([(t[:, 0] - t[:, 1]) / 50 for t in tabs], -1)
    _, lo, hi = mover(points, np.stack([e[0] for e in ends], -1), np.stack([e[1] for e in ends], -1))
    truth = np.mean([pb - pc for pb, pc in regimes])
    assert np.mean((lo <= truth + 1e-12) & (truth - 1e-12 <= hi)) >= 0.93
    assert mover([0.5], [0.4], [0.7]) == pytest.approx((0.5, 0.4, 0.7))


def test_ratio_bca_coverage_by_simulation(np_rng):
    """The perplexity ratio exp(mean(nll_dense - nll)) and a ratio of mean fractional scores,
    BCa with the small-sample expansion on weight draws as the cells' (500 here): coverage >= 0.93
    over 4000 simulated cells each, skewed per-sample differences (gamma shape 2, skewness 1.4, at
    n = 50 and 100). Shape 0.5 (skewness 2.8) is at the edge: 0.93-0.95 at n = 100 (asserted
    >= 0.92), about 0.93 at n = 50, where BCa covers more than the plain percentile interval of
    the same draws (about 0.92)."""
    reps, found = 4000, {}
    for n, shape in ((50, 2.0), (100, 2.0), (100, 0.5), (50, 0.5)):
        w = weights(f"coverage/{n}", n, 500)
        x = -np_rng.gamma(shape, 0.02 / shape, size=(reps, n)) + np_rng.normal(0, 0.01, size=(reps, n))
        _, lo, hi = Means(w, x).interval(_exp)
        truth = np.exp(-0.02)
        found[(n, shape)] = np.mean((lo <= truth) & (truth <= hi))
        draws = np.exp(np.einsum("bn,rn->rb", w, x))
        plo, phi = np.percentile(draws, [2.5, 97.5], axis=1)
        found[(n, shape, "percentile")] = np.mean((plo <= truth) & (truth <= phi))
    assert all(found[k] >= 0.93 for k in ((50, 2.0), (100, 2.0))), found
    assert found[(100, 0.5)] >= 0.92 and found[(50, 0.5)] > found[(50, 0.5, "percentile")], found
    # ratio of two means of scores in parts (dense and a method losing some parts)
    n, w = 50, weights("coverage/ratio", 50, 1000)
    d = np_rng.integers(0, 5, size=(reps, n)) / 4
    m = np.clip(d - (np_rng.random((reps, n)) < 0.1) / 4, 0, 1)
    truth = (0.5 - 0.1 / 4 * 0.8) / 0.5  # E[m] / E[d]: a part is lost where d > 0 (P 0.8)
    _, lo, hi = Means(w, m, d).interval(_ratio)
    assert np.mean((lo <= truth) & (truth <= hi)) >= 0.93


def test_bca_agrees_with_scipy(np_rng):
    """One cell's BCa interval of a skewed mean is scipy.stats.bootstrap's BCa within Monte Carlo
    error and the small-sample expansion (about 3% of the half-width at n = 60)."""
    x = np_rng.gamma(2.0, 1.0, 60)
    v, lo, hi = Means(weights("scipy", 60), x).interval(_mean)
    ref = bootstrap((x,), np.mean, method="BCa", n_resamples=10000, random_state=np_rng).confidence_interval
    width = ref.high - ref.low
    assert abs(lo - ref.low) < 0.12 * width and abs(hi - ref.high) < 0.12 * width, (lo, hi, ref)
    assert hi - v > v - lo  # the skew is kept: a longer upper arm


def test_mdd_binary_is_the_power_threshold(np_rng):
    """At delta = mdd_binary the exact McNemar test rejects in >= 0.8 of simulated tables, a
    quarter-sample step below in < 0.8; more rounding flips need a larger difference."""
    for n, psi0 in ((50, 0.0), (100, 0.1)):
        mdd = mdd_binary(n, psi0)
        powers = []
        for delta in (mdd, mdd - 1 / (4 * n)):
            t = np_rng.multinomial(n, [psi0 / 2 + delta, psi0 / 2, 1 - psi0 - delta], size=20000)
            powers.append(np.mean(sign_test_p(t[:, 0], t[:, 1]) < 0.05))
        assert powers[0] >= 0.79 and powers[1] < 0.81, (n, psi0, mdd, powers)
    assert mdd_binary(50, 0.1) > mdd_binary(50, 0.0) > mdd_binary(100, 0.0)
    assert mdd_normal(1.0, 100) == pytest.approx((1.959964 + 0.841621) / 10, rel=1e-5)


def test_distinguishable_from_rounding(np_rng):
    """A method flipping 8 answers one way differs from dense:fp32 (exact p < 0.05); one flipping
    2 does not; the floor itself has no flag; a cell without floor rows has none."""
    lose8 = {i: 1.0 for i in range(8)}
    c, p = cells(_rows(np_rng, 60, flip=set(lose8), force=lose8)
                 + _rows(np_rng, 60, task="vt", flip={0, 1}, force={0: 1.0, 1: 1.0}))
    assert _one(c, task="niah_single")["distinguishable"] is True
    assert _one(c, task="vt")["distinguishable"] is False
    assert _one(c, "dense:fp32", task="vt")["distinguishable"] is None
    assert _one(p)["distinguishable"] is True and _one(p)["distinguishable_tasks"] == "niah_single"
    r = _one(c, task="vt")
    assert r["mdd"] == pytest.approx(mdd_binary(60, 0.0)) and r["p_floor"] == pytest.approx(0.5)
    no_floor = [x for x in _rows(np_rng, 30) if x["label"] != "dense:fp32"]
    assert _one(cells(no_floor)[0])["distinguishable"] is None


def test_identical_method_and_continuous_metrics(np_rng):
    """A method equal to dense: p = 1, no discordance, the log-likelihood delta and ppl ratio
    intervals are points at 0 and 1, the accuracy difference's interval is Tango's +-0.1 (50 0/1
    answers cannot pin a difference closer)."""
    r = _one(cells(_rows(np_rng, 50))[0])
    assert (r["gained"], r["lost"], r["p_dense"]) == (0, 0, 1.0)
    assert r["answer_ll_delta_lo"] == r["answer_ll_delta_hi"] == 0.0 and r["ppl_ratio_lo"] == r["ppl_ratio_hi"] == 1.0
    assert r["accuracy_diff_lo"] == pytest.approx(-r["accuracy_diff_hi"]) and 0.05 < r["accuracy_diff_hi"] < 0.15


def test_text_cells_test_the_perplexity_and_points_combine_tasks(np_rng):
    """Text: the method's nll higher on every sample is 50 lost of 50 (p tiny) and distinguishable;
    its relative accuracy is the ppl ratio (a constant shift: a point interval). The point
    averages each metric over the tasks defining it, its interval the MOVER of theirs; summary,
    result rows and noise floor carry the new columns."""
    rows = _rows(np_rng, 50, task="text", nll_shift=0.05, dense_p=0.5) + _rows(np_rng, 50, flip={1, 2})
    ci = cells(rows)
    t = _one(ci[0], task="text")
    assert (t["gained"], t["lost"]) == (0, 50) and t["p_dense"] < 1e-10 and t["distinguishable"]
    assert t["accuracy_rel_dense_lo"] == t["ppl_ratio_lo"] == pytest.approx(np.exp(-0.05)) == t["ppl_ratio_hi"]
    a, pt = _one(ci[0], task="niah_single"), _one(ci[1])
    rel_a = _one(summarize(rows, ci), task="niah_single")["accuracy_rel_dense"]
    want = mover([rel_a, t["ppl_ratio"]], [a["accuracy_rel_dense_lo"], t["ppl_ratio_lo"]],
                 [a["accuracy_rel_dense_hi"], t["ppl_ratio_hi"]])
    assert (pt["accuracy_rel_dense"], pt["accuracy_rel_dense_lo"], pt["accuracy_rel_dense_hi"]) == pytest.approx(want)
    summ = summarize(rows, ci)
    res = _one(pl.DataFrame(result_rows(summ, ci)))
    assert res["task"] == "niah_single,text" and res["ppl_ratio"] == pytest.approx((1 + np.exp(-0.05)) / 2)
    assert res["answer_ll_delta_lo"] < res["answer_ll_delta"] < res["answer_ll_delta_hi"] <= 0
    assert {"p_dense", "p_floor", "distinguishable", "mdd", "accuracy_diff", "ppl_ratio"} <= set(summ.columns)
    floor = noise_floor(summ)[0]
    assert floor["label"] == "dense:fp32" and floor["gained"] == floor["lost"] == 0 and floor["samples"] == 100


def test_cells_and_points_keyed_by_split(np_rng):
    """Rows with a split column: a cell per (length, task, split), a point per (method, length,
    split); the same task seen and held out stays two cells."""
    lose10 = dict.fromkeys(range(10), 1.0)
    held = _rows(np_rng, 30, flip=set(lose10), force=lose10, split="held-out")
    rows = _rows(np_rng, 30, split="seen") + [dict(r, sample_id="h" + r["sample_id"]) for r in held]
    ci = cells(rows)
    assert sorted(ci[0].filter(pl.col("label") == "bsfa:16")["split"]) == ["held-out", "seen"]
    assert _one(ci[0], split="seen")["lost"] + _one(ci[0], split="seen")["gained"] == 0
    pts = points(summarize(rows, ci), ci)
    assert sorted(pts.filter(pl.col("label") == "bsfa:16")["split"]) == ["held-out", "seen"]
    assert _one(pts, split="held-out")["distinguishable"] is True


def test_missing_dense_rows_give_no_interval(np_rng):
    """A method lacking a sample dense has (an evaluation still running) gets no interval yet."""
    rows = [r for r in _rows(np_rng, 6) if not (r["label"] == "bsfa:16" and r["sample_id"] == "niah_single0")]
    c, _ = cells(rows)
    assert c.filter(c["label"] == "bsfa:16").height == 0


def test_decode_modes_and_floors_in_the_grammar():
    ms = with_dense(parse_methods("bsfa:16,32:topk,8:thresholds,blasst:0.5,0.5:dense,window:4:dense,sdpa"))
    assert [m.label for m in ms] == ["dense", "dense:fp32", "bsfa:16", "bsfa:32:topk", "bsfa:8:thresholds",
                                     "blasst:0.5", "blasst:0.5:dense", "window:4:dense", "sdpa"]
    assert ms[3].sparsify_kwargs == {"method": "bsfa", "k": 32, "decode": "topk", "dispatch": False}
    assert ms[1].sparsify_kwargs == {"method": "dense", "precision": "fp32", "dispatch": False} and ms[1].is_floor
    assert ms[2].decode_mode == "dense" and ms[5].decode_mode == "sparse" and ms[-1].sparsify_kwargs == {}
    assert parse_methods("bsfa:16:dense") == [Method("bsfa", 16)]  # the default is not written
    for bad, why in (("bsfa:16:sparse", "not a decode mode of bsfa"), ("blasst:0.5:topk", "not a decode mode"),
                     ("bsfa:16:topk:x", "NAME:VALUE[:DECODE]")):
        with pytest.raises(UserError, match=re.escape(why)):
            parse_methods(bad)
