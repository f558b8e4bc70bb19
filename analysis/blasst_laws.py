"""BLASST lambda laws side by side, scored honestly, and the deployed law under the runtime policy.

Per (mode, scan order), three laws of lambda(L, S) are fitted to the calibration samples'
lambda_best (analysis/blasst_fit.py), each scored by R^2 in ln(lambda) over a target's lengths in
the fit and by its held-out error per length (achieved sparsity minus the target):

- ``a/L``:   lambda = a_S / L, a_S by least squares in lambda per target (BLASST's Algorithm 2).
             This is the law the export deploys (blasst.json's threshold_scale_factor).
- ``power``: lambda = a_S * L^-b_S, least squares in ln(lambda) per target (>= 2 lengths).
- ``exp``:   lambda = A exp(B S) / L across the fitted targets S (the form NVIDIA Model-Optimizer
             exports; A, B from analysis.engine_law.fit_exp_law over the (S, a_S) pairs). Fitted and
             reported only from EXP_MIN_TARGETS = 3 targets: through two it passes through both
             (S, a_S) points and is a/L itself (same R^2, same errors), not a third law.

Held-out rows add ``fixed`` (lambda_best at the median fitted length, used at every length) and
``deployed``: the a/L law as ``sparsify`` runs it (formats.exports.blasst_runtime_lambda): dense
(nothing skipped, every tile's mass kept) below the shortest length the target was reached at
(``min_length``) and wherever a/L > 1. The other rows apply their lambda as the kernel would, at
every length: ln(lambda) > 0 skips every candidate tile (``saturated``).

Sparsity is reported over reachable tiles (``achieved``: skipped / reachable, diagonal tiles kept)
and over candidate tiles (``achieved_candidates``: skipped / candidates; the gap histograms hold
every candidate tile, so candidates = the histogram's total).

Shape legend: L layers, H heads, O scan orders, NG gap bins (HistSum of analysis/blasst_fit.py).
"""
from __future__ import annotations

import math

import numpy as np

from sparsecal.analysis.blasst import LawFit, law_at, skipped
from sparsecal.analysis.blasst_fit import Calibration, HistSum
from sparsecal.analysis.engine_law import fit_exp_law
from sparsecal.formats.exports import blasst_dense_below, blasst_runtime_lambda

LAWS = ("a/L", "power", "exp")
DEPLOYED_LAW = "a/L"
FORMULAS = {"a/L": "lambda = a / L", "power": "lambda = a * L^-b", "exp": "lambda = A * exp(B * S) / L"}
EXP_MIN_TARGETS = 3  # with two targets A exp(B S) interpolates both a_S exactly: it equals a/L


def _points(cal: Calibration) -> tuple[list, list]:
    """(lengths, lambda_best) of the lengths in the fit."""
    pts = [(n, math.exp(x)) for n, x in zip(cal.lengths, cal.log_lambda) if not math.isnan(x)]
    return [n for n, _ in pts], [lam for _, lam in pts]


def fit_laws(cals: list[Calibration]) -> dict[int, dict]:
    """{id(cal): {"a/L": LawFit, "power": LawFit or None, "exp": (LawFit, A, B) or None}}.
    The exp law is fitted once per (mode, order) across its targets, then scored per target."""
    out = {id(c): {"a/L": c.law, "power": c.power, "exp": None} for c in cals}
    groups: dict[tuple, list] = {}
    for c in cals:
        if c.law is not None:
            groups.setdefault((c.mode, c.order), []).append(c)
    for group in groups.values():
        if len({c.target for c in group}) < EXP_MIN_TARGETS:
            continue
        law = fit_exp_law([c.target for c in group], [c.law.a for c in group])
        for c in group:
            lens, lams = _points(c)
            out[id(c)]["exp"] = (law_at(lens, lams, law.predict(c.target), 1.0), law.a, law.b)
    return out


def exp_note(targets) -> str | None:
    """The line ``fit`` prints when the exp law was not fitted (fewer than EXP_MIN_TARGETS targets)."""
    n = len(set(targets))
    if n >= EXP_MIN_TARGETS:
        return None
    return (f"exp law A*exp(B*S)/L not fitted: it needs >= {EXP_MIN_TARGETS} targets (this fit has {n}; through "
            "two it passes through both points and equals a/L)")


def _law_fit(laws: dict, name: str) -> LawFit | None:
    got = laws.get(name)
    return got[0] if isinstance(got, tuple) else got


def validity(cal: Calibration) -> dict | None:
    """Where the deployed law holds: the lengths the target was reached at (fitted there, checked on
    held-out samples there), their ends, and the length below which sparsify runs dense."""
    lens = cal.in_fit
    if not lens or cal.law is None:
        return None
    return {"law": DEPLOYED_LAW, "validated_lengths": lens, "min_length": lens[0], "max_length": lens[-1],
            "dense_below": blasst_dense_below(cal.law.a, lens[0])}


def _measure(s: HistSum, edges, o: int, log_lambda: float) -> dict:
    """One sample at ln(lambda): sparsity over reachable and candidate tiles, retained mass."""
    c, m = s.count[:, :, o].sum((0, 1)), s.mass[:, :, o].sum((0, 1))
    skip = float(skipped(c, edges, log_lambda))
    return {"achieved": skip / (s.reach * s.heads()), "achieved_candidates": skip / max(float(c.sum()), 1.0),
            "retained_mass": float(1.0 - skipped(m, edges, log_lambda) / (s.npos * s.heads()))}


def _lambdas(cal: Calibration, laws: dict, n: int) -> list[tuple[str, float, float]]:
    """(method, lambda of the law, ln(lambda) applied) for one length; deployed: -inf when dense."""
    out = []
    for name in LAWS:
        f = _law_fit(laws, name)
        if f is not None:
            lam = float(f.predict(n))
            out.append((name, lam, math.log(lam)))
    out.append(("fixed", cal.fixed_lambda, math.log(cal.fixed_lambda)))
    lam = float(cal.law.predict(n))
    run = blasst_runtime_lambda(cal.law.a, n, min(cal.in_fit))
    out.append(("deployed", lam, -math.inf if run is None else math.log(run)))
    return out


def eval_rows(cal: Calibration, laws: dict, samples: list[tuple[int, HistSum]], edges, o: int) -> list[dict]:
    """blasst_eval rows: per held-out sample and method (the three laws, fixed, deployed) the
    lambda, whether the runtime runs dense (``dense``) or the kernel skips every candidate
    (``saturated``: ln(lambda) > 0), achieved sparsity (reachable and candidate tiles), its error
    against the target and the retained mass."""
    if cal.law is None:
        return []
    rows = []
    for n, s in samples:
        for method, lam, x in _lambdas(cal, laws, n):
            got = _measure(s, edges, o, x)
            rows.append({"mode": cal.mode, "order": cal.order, "target": cal.target, "length": n, "method": method,
                         "lambda": lam, "log_lambda_applied": x, "dense": x == -math.inf, "saturated": x > 0.0,
                         **got, "error": got["achieved"] - cal.target})
    return rows


def _mean_by_length(ev: list[dict], method: str, key: str) -> dict[int, float]:
    by: dict[int, list] = {}
    for r in ev:
        if r["method"] == method:
            by.setdefault(r["length"], []).append(r[key])
    return {n: float(np.mean(v)) for n, v in sorted(by.items())}


def fit_rows(cals: list[Calibration], laws: dict, evals: dict) -> list[dict]:
    """blasst_fit rows: per (mode, order, target, law) a, b, R^2 in ln(lambda) over the fitted lengths,
    A and B of the exp law, the lengths the law was fitted on, whether it is the deployed one, and
    the largest |held-out error| over the fitted lengths."""
    rows = []
    for c in cals:
        v = validity(c)
        for name in LAWS:
            f, got = _law_fit(laws[id(c)], name), laws[id(c)].get(name)
            if f is None:
                continue
            err = _mean_by_length(evals[id(c)], name, "error")
            fitted = [abs(e) for n, e in err.items() if n in c.in_fit]
            rows.append({"mode": c.mode, "order": c.order, "target": c.target, "law": name, "a": f.a, "b": f.b,
                         "r2": f.r2, "n_lengths": len(c.in_fit), "fixed_length": c.fixed_length,
                         "s_a": got[1] if isinstance(got, tuple) else math.nan,
                         "s_b": got[2] if isinstance(got, tuple) else math.nan,
                         "min_length": v["min_length"], "max_length": v["max_length"],
                         "lengths": ",".join(map(str, c.in_fit)), "deployed": name == DEPLOYED_LAW,
                         "dense_below": v["dense_below"] if name == DEPLOYED_LAW else None,
                         "heldout_max_abs_error": max(fitted) if fitted else math.nan})
    return rows


def _num(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def doc_extra(cal: Calibration, laws: dict, ev: list[dict]) -> dict:
    """fit.json (and blasst.json ``fit``) additions for one calibration: every law with R^2, the
    deployed law and the lengths it holds on, held-out means per length and method."""
    if cal.law is None:
        return {}
    out = {}
    for name in LAWS:
        f, got = _law_fit(laws, name), laws.get(name)
        if f is not None:
            out[name] = {"formula": FORMULAS[name], "a": f.a, "b": f.b, "r2": _num(f.r2)}
            if isinstance(got, tuple):
                out[name].update(A=got[1], B=got[2])
    held = []
    for method in LAWS + ("fixed", "deployed"):
        means = {k: _mean_by_length(ev, method, k) for k in ("achieved", "achieved_candidates", "error", "retained_mass")}
        held += [{"method": method, "length": n, **{k: means[k][n] for k in means}} for n in means["achieved"]]
    return {"laws": out, "deployed": validity(cal), "held_out": held}
