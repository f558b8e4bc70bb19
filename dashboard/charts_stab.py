"""Charts of the running-max statistics that depend on the scan order (DataFrame -> plotly
Figure): rescales per row and the shortfall of the running max after the first / the first
local blocks. Inputs are the fit tables stab_rescale, stab_rescale_hist and stab_shortfall_hist
(analysis/stabilization.py), any lengths and layers (summed here).

Shape legend: one row per (order, length, layer[, head], bin) as the tables hold them.
"""
from __future__ import annotations

import plotly.graph_objects as go
import polars as pl

from sparsecal.dashboard.charts_fit import color, empty_figure, finish

PREFIX_LABELS = {"first": "after the first block (sink_local: the sink)",
                 "local": "after the first + local blocks (sink_local: sink + diagonal)"}


def _orders(df: pl.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["order"].to_list()))


def rescales_by_order(df: pl.DataFrame) -> go.Figure:
    """Mean running-max rescales per row for each scan order (exact: the tables' per-head means
    weighted by rows). ``df``: stab_rescale rows."""
    title = "Running-max rescales per row, per scan order"
    if not df.height:
        return empty_figure(title)
    agg = (df.with_columns((pl.col("mean_rescales").fill_nan(0) * pl.col("rows")).alias("total"))
           .group_by("order", maintain_order=True).agg(pl.col("total").sum(), pl.col("rows").sum())
           .with_columns((pl.col("total") / pl.col("rows")).alias("mean")))
    fig = go.Figure(go.Bar(x=agg["order"].to_list(), y=agg["mean"].to_list(), marker={"color": [color(i) for i in range(agg.height)]},
                           customdata=agg["rows"].to_list(),
                           hovertemplate="%{x}<br>%{y:.3f} rescales per row (%{customdata:,} rows)<extra></extra>"))
    fig.update_xaxes(title="scan order")
    fig.update_yaxes(title="mean rescales per row", rangemode="tozero")
    return finish(fig, title)


def rescale_distribution(df: pl.DataFrame) -> go.Figure:
    """Share of rows per number of rescales, one line per scan order; the last bin is open (that
    many or more). ``df``: stab_rescale_hist rows."""
    title = "Rescales per row: distribution per scan order"
    if not df.height:
        return empty_figure(title)
    agg = df.group_by(["order", "rescales"]).agg(pl.col("rows").sum(), pl.col("open").any()).sort("rescales")
    fig = go.Figure()
    for i, order in enumerate(_orders(df)):
        d = agg.filter(pl.col("order") == order)
        share = d["rows"] / max(int(d["rows"].sum()), 1)
        labels = [f"{k}+" if o else str(k) for k, o in zip(d["rescales"], d["open"])]
        fig.add_trace(go.Scatter(x=d["rescales"].to_list(), y=share.to_list(), mode="lines+markers", name=order, customdata=labels,
                                 line={"color": color(i)},
                                 hovertemplate=f"{order}<br>%{{customdata}} rescales: %{{y:.1%}} of rows<extra></extra>"))
    fig.update_xaxes(title="rescales per row (the last bin: that many or more)")
    fig.update_yaxes(title="share of rows", tickformat=".0%", rangemode="tozero")
    return finish(fig, title)


def already_final(df: pl.DataFrame) -> go.Figure:
    """Share of rows already at their final max after the first / the first + local blocks,
    per scan order (grouped bars). ``df``: stab_shortfall_hist rows (bin 0 is [0, 0])."""
    title = "Rows already at their final max (shortfall 0), per scan order"
    if not df.height:
        return empty_figure(title)
    agg = (df.group_by(["order", "prefix"], maintain_order=True)
           .agg(pl.col("rows").filter(pl.col("bin_hi") == 0).sum().alias("zero"), pl.col("rows").sum()))
    fig = go.Figure()
    for i, (prefix, label) in enumerate(PREFIX_LABELS.items()):
        d = agg.filter(pl.col("prefix") == prefix)
        fig.add_trace(go.Bar(x=d["order"].to_list(), y=(d["zero"] / d["rows"]).to_list(), name=label, marker={"color": color(i)},
                             customdata=d["zero"].to_list(),
                             hovertemplate=f"%{{x}}<br>{label}: %{{y:.1%}} (%{{customdata:,}} rows)<extra></extra>"))
    fig.update_layout(barmode="group", legend={"orientation": "h", "y": -0.25})
    fig.update_xaxes(title="scan order")
    fig.update_yaxes(title="share of rows", range=[0, 1], tickformat=".0%")
    return finish(fig, title)


def shortfall_cdf(df: pl.DataFrame) -> go.Figure:
    """Cumulative share of rows whose running max is within x nats of the final max, per scan
    order (colour) after the first block (dashed) and the first + local blocks (solid).
    ``df``: stab_shortfall_hist rows; the open bin (> the last edge) never reaches the curve."""
    title = "Shortfall of the running max: final row max minus running max"
    if not df.height:
        return empty_figure(title)
    agg = df.group_by(["order", "prefix", "bin_lo", "bin_hi"]).agg(pl.col("rows").sum()).sort(["bin_hi", "bin_lo"])
    fig = go.Figure()
    for i, order in enumerate(_orders(df)):
        for prefix, dash in (("first", "dash"), ("local", "solid")):
            d = agg.filter((pl.col("order") == order) & (pl.col("prefix") == prefix))
            if not d.height:
                continue
            cum = d["rows"].cum_sum() / max(int(d["rows"].sum()), 1)
            keep = d["bin_hi"].is_finite()
            fig.add_trace(go.Scatter(x=d["bin_hi"].filter(keep).to_list(), y=cum.filter(keep).to_list(), mode="lines",
                                     name=f"{order}, {prefix}", line={"color": color(i), "dash": dash, "shape": "hv"},
                                     hovertemplate=f"{order} ({prefix})<br>shortfall <= %{{x:.2f}}: %{{y:.1%}} of rows"
                                                   "<extra></extra>"))
    fig.update_xaxes(title="shortfall x (nats)", rangemode="tozero")
    fig.update_yaxes(title="share of rows with shortfall <= x", range=[0, 1], tickformat=".0%")
    return finish(fig, title)
