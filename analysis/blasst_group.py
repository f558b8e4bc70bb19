"""BLASST decode under the group decision (issue 28 part 2), from the capture's
``decode_group_gap_count``: a KV group skips a tile for all its G query heads only when every head's
rule skips it, so the group skips fewer tiles than each head, and the V tiles it skips are the V
loads a kernel saves (with GQA a V tile is shared by the group).

``group_rows`` gives, per target and length of the decode calibrations in the exported scan order:
the head-calibrated lambda (the deployed a/L law of the per-head decision), the group's skip share at
that same lambda (its V-skip share: what the group decision delivers if the per-head law is used),
the lambda at which the group reaches the target, and the a/L law fitted to those (``a_group``,
one per target) next to the head law's ``a``.

Shape legend: L layers, H query heads, O scan orders, NG gap bins (blasst_fit.HistSum).
"""
from __future__ import annotations

import math

from sparsecal.analysis.blasst import skipped
from sparsecal.analysis.blasst_fit import HistSum, calibrate


def group_rows(cals: list, sums: dict[int, HistSum], head: dict[int, HistSum], edges, order: str) -> list[dict]:
    """Rows of the blasst_decode_group table (module docstring). ``cals``: (order index, Calibration)
    of the fit; only the decode ones in ``order`` with a head law are used. ``sums``: length ->
    HistSum of decode_group_gap_count / _mass over the calibration samples (empty: a run captured
    before the statistic: no rows); ``head``: the same of decode_gap_count (the per-head decision's
    share at the same lambda, for comparison)."""
    if not sums:
        return []
    rows = []
    for o, head_cal in cals:
        if head_cal.mode != "decode" or head_cal.order != order or head_cal.law is None:
            continue
        grp = calibrate(sums, edges, "decode", o, order, head_cal.target)
        a_group = grp.law.a if grp.law is not None else math.nan
        for n, x_group in zip(grp.lengths, grp.log_lambda):
            s = sums[n]
            lam = float(head_cal.law.predict(n))
            share = float(skipped(s.count[:, :, o].sum((0, 1)), edges, math.log(lam)) / (s.reach * s.heads()))
            h = head[n]
            own = float(skipped(h.count[:, :, o].sum((0, 1)), edges, math.log(lam)) / (h.reach * h.heads()))
            rows.append({"mode": "decode", "order": order, "target": head_cal.target, "length": n,
                         "lambda_head": lam, "head_sparsity_at_head_lambda": own, "group_sparsity_at_head_lambda": share,
                         "lambda_group_best": math.exp(x_group) if not math.isnan(x_group) else math.nan,
                         "a_head": head_cal.law.a, "a_group": a_group, "samples": s.samples})
    return rows


def group_doc(rows: list[dict]) -> list[dict]:
    """fit.json's ``blasst_decode_group``: per target the head and group a/L factors, the group's
    skip share at the head law per length, and ``validity`` (as a decode law's: the lengths where the
    group reached the target, min_length and max_length their ends; None where none did)."""
    out: dict = {}
    for r in rows:
        d = out.setdefault(r["target"], {"target": r["target"], "order": r["order"], "a_head": r["a_head"],
                                         "a_group": None if math.isnan(r["a_group"]) else r["a_group"],
                                         "group_sparsity_at_head_lambda": {}, "validated_lengths": []})
        d["group_sparsity_at_head_lambda"][str(r["length"])] = r["group_sparsity_at_head_lambda"]
        if not math.isnan(r["lambda_group_best"]):
            d["validated_lengths"].append(int(r["length"]))
    for d in out.values():
        lens = sorted(d.pop("validated_lengths"))
        d["validity"] = ({"law": "a/L", "validated_lengths": lens, "min_length": lens[0], "max_length": lens[-1]}
                         if lens and d["a_group"] is not None else None)
    return list(out.values())

