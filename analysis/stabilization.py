"""VFA stabilization tables: where each row's running max reaches its final value (sink block,
diagonal blocks, middle) per scan order, the normalized t* distribution, the Q-init error
quantiles, and VFA's joint statistic max(Q-init, sink + diagonal max) - true row max (the frozen
max minus the row max: below 0 VFA's frozen phase computes p > 1, far above 0 it scales every p
down; tables ``joint`` / ``joint_hist``, same bins as Q-init; runs captured before it give empty
tables). All samples of a length are pooled (descriptive statistics: no hold-out).

The where shares do not depend on the scan order (the stabilizing block is the block holding the
row's maximum); the running-max rescales per row and the shortfall of the running max after the
first / the first local blocks do (stab_rescale, stab_rescale_hist, stab_shortfall,
stab_shortfall_hist; runs captured before sparsecal 0.2.0 lack them and give empty tables).

Shape legend: L layers, H heads, O scan orders, NT normalized-t* bins on [0, 1], NQ Q-init bins,
NR rescale bins (the last one open), NS shortfall bins (bin 0: exactly 0, the last one open).
"""
from __future__ import annotations

import math

import numpy as np

from sparsecal.formats.geometry import PREFIXES, WHERE
from sparsecal.formats.run import RESCALE_KEYS

SHORTFALL_QUANTILES = (0.5, 0.75, 0.9, 0.95)
# VFA's risk thresholds on the joint statistic (nats): (column, x, below): the share of rows below x
# (frozen max more than |x| under the true max: p > 1 in the frozen phase) or above it.
JOINT_SHARES = (("share_below_1", -1.0, True), ("share_below_5", -5.0, True), ("share_above_5", 5.0, False))

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def hist_quantiles(counts: np.ndarray, edges: np.ndarray, qs=QUANTILES) -> np.ndarray:
    """Quantiles of a histogram, linear inside bins. counts [..., E+1] (bin 0 below e_0, bin E at or
    above e_{E-1}: the open bins are clamped to the outer edges) -> [..., len(qs)]."""
    counts = np.asarray(counts, np.float64)
    step = edges[1] - edges[0]
    x = np.concatenate([[edges[0] - step], edges, [edges[-1] + step]])  # bin b spans x[b]..x[b+1]
    c = np.concatenate([np.zeros(counts.shape[:-1] + (1,)), np.cumsum(counts, -1)], -1)
    out = np.full(counts.shape[:-1] + (len(qs),), np.nan)
    for idx in np.ndindex(counts.shape[:-1]):
        tot = c[idx][-1]
        if tot > 0:
            out[idx] = np.clip(np.interp(np.asarray(qs) * tot, c[idx], x), edges[0], edges[-1])
    return out


def where_rows(where: dict[int, np.ndarray], orders) -> list[dict]:
    """stab_where rows: rows per category, per order, length, layer and head. where[n] [L, H, O, 3]."""
    rows = []
    for n, w in sorted(where.items()):
        for (layer, head, o), _ in np.ndenumerate(w[..., 0]):
            rec = {"order": orders[o], "length": n, "layer": layer, "head": head}
            rec.update({cat: int(w[layer, head, o, c]) for c, cat in enumerate(WHERE)})
            rows.append(rec)
    return rows


def tstar_rows(hist: dict[int, np.ndarray], orders) -> list[dict]:
    """stab_tstar rows: normalized t* histogram per order, length and layer (heads pooled)."""
    rows = []
    for n, h in sorted(hist.items()):
        pooled = h.sum(1)  # [L, O, NT]
        nt = pooled.shape[-1]
        for (layer, o, b), v in np.ndenumerate(pooled):
            rows.append({"order": orders[o], "length": n, "layer": layer, "bin_lo": b / nt,
                         "bin_hi": (b + 1) / nt, "rows": int(v)})
    return rows


def qinit_rows(counts: dict[int, np.ndarray], edges: np.ndarray) -> list[dict]:
    """qinit rows: Q-init error quantiles per length, layer and head. counts[n] [L, H, NQ]."""
    rows = []
    for n, c in sorted(counts.items()):
        q = hist_quantiles(c, edges)
        below = c[..., 0] / np.maximum(c.sum(-1), 1)
        for (layer, head), _ in np.ndenumerate(c[..., 0]):
            rec = {"length": n, "layer": layer, "head": head, "rows": int(c[layer, head].sum()),
                   "share_below_range": float(below[layer, head])}
            rec.update({f"q{round(p * 100):02d}": float(v) for p, v in zip(QUANTILES, q[layer, head])})
            rows.append(rec)
    return rows


def hist_share_below(counts: np.ndarray, edges: np.ndarray, x: float) -> np.ndarray:
    """Share of the rows below x from histograms counts [..., E+1] on edges [E] (bins as
    hist_quantiles): exact where x is an edge, linear inside a bin; nan without rows."""
    counts = np.asarray(counts, np.float64)
    i = int(np.searchsorted(edges, x, side="right"))  # bins 0..i-1 lie below edges[i-1] <= x
    below = counts[..., :i].sum(-1)
    if 0 < i < len(edges):
        below = below + counts[..., i] * (x - edges[i - 1]) / (edges[i] - edges[i - 1])
    tot = counts.sum(-1)
    return np.where(tot > 0, below / np.maximum(tot, 1), np.nan)


def joint_rows(counts: dict[int, np.ndarray], edges: np.ndarray) -> list[dict]:
    """joint rows: VFA's joint statistic per length, layer and head, counts[n] [L, H, NQ]: the
    qinit columns (quantiles, share_below_range), share_above_range (the open top bin) and the
    JOINT_SHARES."""
    rows = qinit_rows(counts, edges)
    extra = []
    for n, c in sorted(counts.items()):
        tot = np.maximum(c.sum(-1), 1)
        cols = {"share_above_range": c[..., -1] / tot}
        cols.update({name: (hist_share_below(c, edges, x) if below else 1.0 - hist_share_below(c, edges, x))
                     for name, x, below in JOINT_SHARES})
        for (layer, head), _ in np.ndenumerate(c[..., 0]):
            extra.append({k: float(v[layer, head]) for k, v in cols.items()})
    return [dict(r, **e) for r, e in zip(rows, extra)]


def joint_bands(joint, joint_hist, bands: int = 6) -> list[dict]:
    """fit's console summary of VFA's joint statistic: consecutive layer bands (at most ``bands``,
    near-equal sizes), all lengths and heads pooled: rows, the median (joint_hist's bins, linear
    inside a bin, the open bins clamped to their finite edge) and the JOINT_SHARES (row-weighted
    from the joint table). joint, joint_hist: the fit tables (polars DataFrames)."""
    import polars as pl

    layers = sorted(set(joint["layer"].to_list()))
    out = []
    for band in np.array_split(np.asarray(layers), min(bands, len(layers))):
        j = joint.filter(pl.col("layer").is_in(band.tolist()))
        rows = int(j["rows"].sum())
        rec = {"layers": f"{band[0]}-{band[-1]}" if len(band) > 1 else str(band[0]), "rows": rows}
        h = joint_hist.filter(pl.col("layer").is_in(band.tolist()))
        h = h.with_columns(pl.when(pl.col("bin_lo").is_infinite()).then(pl.col("bin_hi")).otherwise(pl.col("bin_lo"))
                           .alias("bin_lo"))
        rec["median"] = hist_median(h) if rows else math.nan
        for name, _, _ in JOINT_SHARES:
            rec[name] = float((j[name].fill_nan(0) * j["rows"]).sum() / rows) if rows else math.nan
        out.append(rec)
    return out


def qinit_hist_rows(counts: dict[int, np.ndarray], edges: np.ndarray) -> list[dict]:
    """qinit_hist rows: Q-init error histogram per length and layer (heads pooled), non-empty bins.
    Open bins get the outer edges with a half-open side (bin_lo or bin_hi = +-inf)."""
    lo = np.concatenate([[-np.inf], edges])
    hi = np.concatenate([edges, [np.inf]])
    rows = []
    for n, c in sorted(counts.items()):
        pooled = c.sum(1)
        for (layer, b), v in np.ndenumerate(pooled):
            if v:
                rows.append({"length": n, "layer": layer, "bin_lo": float(lo[b]), "bin_hi": float(hi[b]),
                             "rows": int(v)})
    return rows


class RescaleSums:
    """The rescale and shortfall histograms of the samples that have them, summed per length
    (int64): rescale_count [L, H, O, NR], rescale_excess [L, H, O], shortfall_count [L, H, O, 2, NS].
    ``missing`` counts the samples captured without them (before sparsecal 0.2.0)."""

    def __init__(self):
        self.sums: dict[int, dict[str, np.ndarray]] = {}
        self.missing = 0

    def add(self, arrays: dict, length: int) -> None:
        if any(k not in arrays for k in RESCALE_KEYS):
            self.missing += 1
            return
        acc = self.sums.setdefault(length, {})
        for k in RESCALE_KEYS:
            a = np.asarray(arrays[k]).astype(np.int64)
            acc[k] = acc[k] + a if k in acc else a


def mean_rescales(count: np.ndarray, excess: np.ndarray) -> np.ndarray:
    """Exact mean rescales per row from count [..., NR] (last bin: NR - 1 or more) and the summed
    excess over NR - 1 [...]; nan where there are no rows."""
    count = np.asarray(count, np.float64)
    total = (count * np.arange(count.shape[-1])).sum(-1) + excess
    rows = count.sum(-1)
    return np.where(rows > 0, total / np.maximum(rows, 1), np.nan)


def int_quantile(count: np.ndarray, q: float) -> float:
    """The q-quantile of integer values k with count [NR] rows each: the smallest k whose
    cumulative share reaches q (an open last bin reads as its lower end)."""
    tot = count.sum()
    if tot <= 0:
        return float("nan")
    return float(np.searchsorted(np.cumsum(count), q * tot - 1e-9 * tot))


def shortfall_quantiles(counts: np.ndarray, edges: np.ndarray, qs=SHORTFALL_QUANTILES) -> np.ndarray:
    """Quantiles of shortfall histograms, counts [..., NS] on edges [NS - 1] (e_0 = 0; bin 0 the
    point 0, bin k (e_{k-1}, e_k], the open last bin clamped to e_{-1}), linear inside bins
    -> [..., len(qs)] (nan without rows)."""
    counts = np.asarray(counts, np.float64)
    x = np.concatenate([[0.0], edges, [edges[-1]]])  # the cumulative count c[b + 1] is reached at x[b + 1]
    c = np.concatenate([np.zeros(counts.shape[:-1] + (1,)), np.cumsum(counts, -1)], -1)
    out = np.full(counts.shape[:-1] + (len(qs),), np.nan)
    for idx in np.ndindex(counts.shape[:-1]):
        if c[idx][-1] > 0:
            out[idx] = np.interp(np.asarray(qs) * c[idx][-1], c[idx], x)
    return out


def rescale_rows(acc: RescaleSums, orders) -> list[dict]:
    """stab_rescale rows per order, length, layer and head: rows, mean_rescales (exact), share_zero
    (rows never rescaled), q50 / q90 (integer quantiles), open_rows (rows in the open last bin)."""
    rows = []
    for n, a in sorted(acc.sums.items()):
        c, ex = a["rescale_count"], a["rescale_excess"]
        mean = mean_rescales(c, ex)
        for (layer, head, o), m in np.ndenumerate(mean):
            cc = c[layer, head, o]
            tot = int(cc.sum())
            rows.append({"order": orders[o], "length": n, "layer": layer, "head": head, "rows": tot,
                         "mean_rescales": float(m), "share_zero": float(cc[0] / max(tot, 1)),
                         "q50": int_quantile(cc, 0.5), "q90": int_quantile(cc, 0.9), "open_rows": int(cc[-1])})
    return rows


def rescale_hist_rows(acc: RescaleSums, orders) -> list[dict]:
    """stab_rescale_hist rows: rows per number of rescales, per order, length and layer (heads
    pooled), non-empty bins; ``open`` marks the last bin (that many rescales or more)."""
    rows = []
    for n, a in sorted(acc.sums.items()):
        pooled = a["rescale_count"].sum(1)  # [L, O, NR]
        last = pooled.shape[-1] - 1
        for (layer, o, k), v in np.ndenumerate(pooled):
            if v:
                rows.append({"order": orders[o], "length": n, "layer": layer, "rescales": k, "open": k == last,
                             "rows": int(v)})
    return rows


def shortfall_rows(acc: RescaleSums, orders, edges: np.ndarray) -> list[dict]:
    """stab_shortfall rows per order, prefix (first / local), length, layer and head: rows,
    share_zero (rows already at their final max), share_above_range, q50, q75, q90, q95."""
    rows = []
    for n, a in sorted(acc.sums.items()):
        c = a["shortfall_count"]  # [L, H, O, 2, NS]
        q = shortfall_quantiles(c, edges)
        for (layer, head, o, x), _ in np.ndenumerate(c[..., 0]):
            cc = c[layer, head, o, x]
            tot = max(int(cc.sum()), 1)
            rec = {"order": orders[o], "prefix": PREFIXES[x], "length": n, "layer": layer, "head": head,
                   "rows": int(cc.sum()), "share_zero": float(cc[0] / tot), "share_above_range": float(cc[-1] / tot)}
            rec.update({f"q{round(p * 100):02d}": float(v) for p, v in zip(SHORTFALL_QUANTILES, q[layer, head, o, x])})
            rows.append(rec)
    return rows


def shortfall_hist_rows(acc: RescaleSums, orders, edges: np.ndarray) -> list[dict]:
    """stab_shortfall_hist rows: rows per shortfall bin, per order, prefix, length and layer (heads
    pooled), non-empty bins; bin 0 is [0, 0] (already final), the last (hi, inf]."""
    lo = np.concatenate([[0.0], edges])
    hi = np.concatenate([[0.0], edges[1:], [np.inf]])
    rows = []
    for n, a in sorted(acc.sums.items()):
        pooled = a["shortfall_count"].sum(1)  # [L, O, 2, NS]
        for (layer, o, x, b), v in np.ndenumerate(pooled):
            if v:
                rows.append({"order": orders[o], "prefix": PREFIXES[x], "length": n, "layer": layer,
                             "bin_lo": float(lo[b]), "bin_hi": float(hi[b]), "rows": int(v)})
    return rows


def rescale_frames(acc: RescaleSums, orders, edges: np.ndarray) -> dict[str, list[dict]]:
    """The four rescale / shortfall tables of the fit directory (empty lists for an old run)."""
    return {"stab_rescale": rescale_rows(acc, orders), "stab_rescale_hist": rescale_hist_rows(acc, orders),
            "stab_shortfall": shortfall_rows(acc, orders, edges),
            "stab_shortfall_hist": shortfall_hist_rows(acc, orders, edges)}


def order_summary(rescale, shortfall_hist) -> list[dict]:
    """Per scan order, all lengths, layers and heads pooled: rows, mean rescales per row, and per
    prefix the share of rows already at their final max and the median shortfall. rescale and
    shortfall_hist: the stab_rescale and stab_shortfall_hist tables (polars DataFrames)."""
    import polars as pl

    out = []
    for order in dict.fromkeys(rescale["order"].to_list()):
        r = rescale.filter(pl.col("order") == order)
        rows = int(r["rows"].sum())
        rec = {"order": order, "rows": rows,
               "mean_rescales": float((r["mean_rescales"].fill_nan(0) * r["rows"]).sum() / max(rows, 1))}
        for prefix in PREFIXES:
            h = shortfall_hist.filter((pl.col("order") == order) & (pl.col("prefix") == prefix))
            tot = int(h["rows"].sum()) if h.height else 0
            zero = h.filter(pl.col("bin_hi") == 0)["rows"].sum()
            rec[f"{prefix}_share_zero"] = float(zero / tot) if tot else math.nan
            rec[f"{prefix}_median"] = hist_median(h) if tot else math.nan
        out.append(rec)
    return out


def hist_median(h) -> float:
    """Median of stab_shortfall_hist rows (bin_lo, bin_hi, rows; equal bins of several layers or
    lengths summed), linear inside bins, the open bin clamped to its lower edge."""
    import polars as pl

    agg = h.group_by(["bin_lo", "bin_hi"]).agg(pl.col("rows").sum()).sort(["bin_hi", "bin_lo"])
    lo, hi = agg["bin_lo"].to_numpy(), agg["bin_hi"].to_numpy()
    hi = np.where(np.isinf(hi), lo, hi)
    c = np.cumsum(agg["rows"].to_numpy().astype(np.float64))
    half = c[-1] / 2
    b = int(np.searchsorted(c, half))
    before = c[b - 1] if b else 0.0
    return float(lo[b] + (hi[b] - lo[b]) * (half - before) / max(c[b] - before, 1e-300))
