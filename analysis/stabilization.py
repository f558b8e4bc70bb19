"""VFA stabilization tables: where each row's running max reaches its final value (sink block,
diagonal blocks, middle) per scan order, the normalized t* distribution, and the Q-init error
quantiles. All samples of a length are pooled (descriptive statistics: no hold-out).

Shape legend: L layers, H heads, O scan orders, NT normalized-t* bins on [0, 1], NQ Q-init bins.
"""
from __future__ import annotations

import numpy as np

from sparsecal.formats.geometry import WHERE

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
