"""Chart builders for the fit pages (Density, BLASST, Stabilization): polars DataFrame -> plotly
Figure, pure functions with no Streamlit, each taking the rows of one fit table (already filtered
by the page's controls; columns as in dashboard/data.py TABLE_COLUMNS).

An empty frame gives a figure that says "no data" rather than an error.
"""
from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22")
WHERE_COLORS = {"sink": "#1f77b4", "diagonal": "#ff7f0e", "middle": "#2ca02c"}


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def empty_figure(title: str, why: str = "no data for this selection") -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=why, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 14})
    fig.update_layout(title={"text": title}, xaxis={"visible": False}, yaxis={"visible": False}, height=300)
    return fig


def finish(fig: go.Figure, title: str, height: int = 420) -> go.Figure:
    fig.update_layout(title={"text": title}, height=height, margin={"l": 60, "r": 20, "t": 60, "b": 50},
                      legend={"orientation": "h", "y": -0.18}, hovermode="closest")
    return fig


def _len_axis(lengths) -> dict:
    """A log2 length axis with a tick at every length."""
    vals = sorted({int(x) for x in lengths})
    return {"type": "log", "tickvals": vals, "ticktext": [f"{v:,}" for v in vals], "title": "prompt length (tokens)"}


# ---- Density (BSFA) ----------------------------------------------------------------------------
def density_vs_length(df: pl.DataFrame) -> go.Figure:
    """BSFA Table 1 as a chart. Rows of bsfa_density: per k (one color) the measured density
    (markers, error bars = min..max over samples) and the predicted (min(k, A_i) + diagonal) /
    reachable (dashed), against length; the head p10-p90 spread is in the hover."""
    title = "BSFA density per length: predicted vs measured"
    if not df.height:
        return empty_figure(title)
    fig = go.Figure()
    label = df["split"][0] if "split" in df.columns else ""
    for i, (k,) in enumerate(sorted(df.select("k").unique().rows())):
        d = df.filter(pl.col("k") == k).sort("length")
        fig.add_trace(go.Scatter(
            x=d["length"], y=d["measured"], mode="lines+markers", name=f"k={k} measured", line={"color": color(i)},
            error_y={"type": "data", "symmetric": False, "array": (d["measured_max"] - d["measured"]).to_list(),
                     "arrayminus": (d["measured"] - d["measured_min"]).to_list()},
            customdata=np.stack([d["head_p10"], d["head_p90"], d["samples"], d["measured_std"]], -1),
            hovertemplate=(f"k={k}<br>%{{x}} tokens<br>measured %{{y:.3f}} (std %{{customdata[3]:.3f}}, "
                           "%{customdata[2]} samples)<br>heads p10-p90 %{customdata[0]:.3f}-%{customdata[1]:.3f}"
                           "<extra></extra>")))
        fig.add_trace(go.Scatter(x=d["length"], y=d["predicted"], mode="lines+markers", name=f"k={k} predicted",
                                 line={"color": color(i), "dash": "dash"}, marker={"symbol": "circle-open"},
                                 hovertemplate=f"k={k}<br>%{{x}} tokens<br>predicted %{{y:.3f}}<extra></extra>"))
    fig.update_xaxes(**_len_axis(df["length"]))
    fig.update_yaxes(title="density (computed / reachable tiles)", rangemode="tozero")
    return finish(fig, f"{title} ({label})")


def layer_head_heatmap(df: pl.DataFrame, value: str, title: str, zmin=None, zmax=None,
                       colorscale: str = "Viridis", fmt: str = ".3f", layer_types: list | None = None) -> go.Figure:
    """Heatmap of ``value`` with layers as rows and heads as columns. ``df`` has layer (the model's
    layer index), head, value (one row per pair; missing pairs are blank). Only the layers in ``df``
    get a row: in a hybrid model those are the captured (full-attention) layers, and the y labels
    say so when ``layer_types`` (per model layer) is given."""
    if not df.height:
        return empty_figure(title)
    layers = sorted(set(df["layer"].to_list()))
    row = {layer: i for i, layer in enumerate(layers)}
    n_h = int(df["head"].max()) + 1
    z = np.full((len(layers), n_h), np.nan)
    vals = df[value].cast(pl.Float64).fill_null(float("nan")).to_numpy()
    z[[row[x] for x in df["layer"].to_list()], df["head"].to_numpy()] = vals
    labels = [layer_label(x, layer_types) for x in layers]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(n_h)), y=labels, zmin=zmin, zmax=zmax,
                               colorscale=colorscale, colorbar={"title": {"text": value}},
                               hovertemplate=f"layer %{{y}}, head %{{x}}<br>{value} %{{z:{fmt}}}<extra></extra>"))
    fig.update_xaxes(title="head", dtick=1)
    fig.update_yaxes(title="layer", autorange="reversed", type="category")
    return finish(fig, title, height=max(380, 16 * len(layers) + 120))


def layer_label(layer: int, layer_types: list | None) -> str:
    """'5' or, in a model with several layer kinds, '5 full' / '3 sliding'."""
    if not layer_types or len(set(layer_types)) < 2 or layer >= len(layer_types):
        return str(layer)
    return f"{layer} {layer_types[layer].split('_')[0]}"


# ---- BLASST ------------------------------------------------------------------------------------
def sparsity_curves(df: pl.DataFrame, marks: pl.DataFrame | None = None) -> go.Figure:
    """sparsity(lambda) (top) and retained mass(lambda) (bottom), one line per length. ``df``: rows
    of blasst_curves of one mode and order. ``marks``: optional length, lambda of the calibrated
    law, drawn as a marker on each length's curve."""
    title = "BLASST sparsity and retained mass vs lambda"
    if not df.height:
        return empty_figure(title)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        row_heights=[0.6, 0.4])
    for i, (n,) in enumerate(sorted(df.select("length").unique().rows())):
        d = df.filter(pl.col("length") == n).sort("log_lambda")
        lam = np.exp(d["log_lambda"].to_numpy())
        for row, col in ((1, "sparsity"), (2, "retained_mass")):
            fig.add_trace(go.Scatter(x=lam, y=d[col], mode="lines", name=f"{n:,} tokens", legendgroup=str(n),
                                     showlegend=row == 1, line={"color": color(i)},
                                     hovertemplate=f"{n} tokens<br>lambda %{{x:.3g}}<br>{col} %{{y:.4f}}<extra></extra>"),
                          row=row, col=1)
        if marks is not None and marks.height:
            m = marks.filter(pl.col("length") == n)
            if m.height and m["lambda"][0] and m["lambda"][0] > 0:
                x = float(m["lambda"][0])
                y = float(np.interp(math.log(x), d["log_lambda"].to_numpy(), d["sparsity"].to_numpy()))
                fig.add_trace(go.Scatter(x=[x], y=[y], mode="markers", marker={"symbol": "diamond", "size": 10,
                                         "color": color(i)}, name=f"a/L at {n:,}", legendgroup=str(n),
                                         showlegend=False, hovertemplate=f"{n} tokens: calibrated lambda %{{x:.3g}}"
                                         "<br>sparsity %{y:.3f}<extra></extra>"), row=1, col=1)
    fig.update_xaxes(type="log", title="lambda (skip when gap < ln lambda)", row=2, col=1)
    fig.update_xaxes(type="log", row=1, col=1)
    fig.update_yaxes(title="sparsity", row=1, col=1, rangemode="tozero")
    fig.update_yaxes(title="retained mass", row=2, col=1)
    return finish(fig, title, height=560)


def _law_line(fits: pl.DataFrame, law: str, grid: np.ndarray):
    row = fits.filter(pl.col("law") == law)
    if not row.height:
        return None, None
    a, b, r2 = (float(row[c][0]) if row[c][0] is not None else float("nan") for c in ("a", "b", "r2"))
    return a * grid ** (-b), (a, b, r2)


def _holds(fits: pl.DataFrame, law: str) -> str:
    """' (deployed; holds on 2048-8192)' for the deployed law of a fit that records its lengths."""
    row = fits.filter(pl.col("law") == law)
    if not row.height or "deployed" not in fits.columns or not row["deployed"][0]:
        return ""
    return f" (deployed; holds on {row['min_length'][0]:,}-{row['max_length'][0]:,} tokens)"


def lambda_law(lam: pl.DataFrame, fits: pl.DataFrame) -> go.Figure:
    """lambda_best vs L (log-log) with the fitted a/L and a L^-b laws (top) and the residuals of
    ln lambda_best against each law (bottom). ``lam``: blasst_lambda rows of one mode, order and
    target; ``fits``: the blasst_fit rows of the same (law 'a/L' and 'power')."""
    title = "lambda_best vs prompt length, with the fitted laws"
    pts = lam.filter(pl.col("lambda_best").is_not_null() & pl.col("lambda_best").is_not_nan()).sort("length")
    if not pts.height:
        return empty_figure(title, "no length reaches this target: nothing was fitted")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.68, 0.32])
    L = pts["length"].to_numpy().astype(np.float64)
    y = pts["lambda_best"].to_numpy()
    fig.add_trace(go.Scatter(x=L, y=y, mode="markers", name="lambda_best (calibration samples)",
                             marker={"size": 10, "color": "black"},
                             hovertemplate="%{x} tokens<br>lambda_best %{y:.4g}<extra></extra>"), row=1, col=1)
    grid = np.geomspace(L.min() / 1.3, L.max() * 1.3, 60)
    for i, (law, label) in enumerate((("a/L", "a/L"), ("power", "a·L^-b"), ("exp", "A·e^(BS)/L"))):
        line, p = _law_line(fits, law, grid)
        if line is None:
            continue
        name = f"{label}: a={p[0]:.4g}" + (f", b={p[1]:.3f}" if law == "power" else "") + \
            (f", R²={p[2]:.3f}" if math.isfinite(p[2]) else "") + _holds(fits, law)
        fig.add_trace(go.Scatter(x=grid, y=line, mode="lines", name=name, line={"color": color(i), "dash": ("solid", "dash", "dot")[i]},
                                 hovertemplate=f"{label}<br>%{{x:.0f}} tokens<br>lambda %{{y:.4g}}<extra></extra>"), row=1, col=1)
        res = np.log(y) - np.log(p[0] * L ** (-p[1]))
        fig.add_trace(go.Scatter(x=L, y=res, mode="markers+lines", name=f"residual {label}", showlegend=False,
                                 marker={"color": color(i)}, line={"color": color(i), "dash": ("solid", "dash", "dot")[i]},
                                 hovertemplate=f"{label}<br>%{{x}} tokens<br>ln residual %{{y:.3f}}<extra></extra>"),
                      row=2, col=1)
    fig.add_hline(y=0, line={"color": "grey", "width": 1}, row=2, col=1)
    fig.update_xaxes(**_len_axis(L), row=2, col=1)
    fig.update_xaxes(type="log", row=1, col=1)
    fig.update_yaxes(type="log", title="lambda", row=1, col=1)
    fig.update_yaxes(title="ln residual", row=2, col=1)
    return finish(fig, title, height=560)


def table5(ev: pl.DataFrame, target: float) -> go.Figure:
    """BLASST Table 5 as a chart: held-out achieved sparsity per length for the calibrated a/L (as
    the kernel applies it at every length: past lambda = 1 it skips every candidate), the deployed
    a/L (sparsify's policy: dense below the validated lengths and where a/L > 1) and one fixed lambda
    (bars, error = std over samples), the target as a line. ``ev``: blasst_eval rows of one mode,
    order and target (older fits have no deployed rows)."""
    title = f"Held-out sparsity: calibrated a/L, deployed a/L and fixed λ (target {target:g})"
    if not ev.height:
        return empty_figure(title, "no held-out evaluation for this target")
    agg = (ev.group_by(["length", "method"]).agg(pl.col("achieved").mean().alias("mean"),
                                                 pl.col("achieved").std().fill_null(0).alias("std"),
                                                 pl.col("retained_mass").mean().alias("mass"),
                                                 pl.col("lambda").mean().alias("lam"), pl.len().alias("n"))
           .sort(["method", "length"]))
    fig = go.Figure()
    for i, method in enumerate(("a/L", "fixed", "deployed")):
        d = agg.filter(pl.col("method") == method)
        if not d.height:
            continue
        fig.add_trace(go.Bar(x=[f"{n:,}" for n in d["length"]], y=d["mean"], name=method, marker={"color": color(i)},
                             error_y={"type": "data", "array": d["std"].to_list()},
                             customdata=np.stack([d["mass"], d["lam"], d["n"]], -1),
                             hovertemplate=(f"{method}<br>%{{x}} tokens<br>sparsity %{{y:.3f}}<br>retained mass "
                                            "%{customdata[0]:.4f}<br>lambda %{customdata[1]:.3g} (%{customdata[2]} samples)"
                                            "<extra></extra>")))
    return _bars_to_target(fig, target, "achieved sparsity", title)


def _bars_to_target(fig: go.Figure, target: float, y_title: str, title: str) -> go.Figure:
    """Grouped bars per prompt length (categories) against the target sparsity (a dotted line)."""
    fig.add_hline(y=target, line={"dash": "dot", "color": "black"}, annotation_text=f"target {target:g}")
    fig.update_layout(barmode="group")
    fig.update_xaxes(title="prompt length (tokens)", type="category")
    fig.update_yaxes(title=y_title, rangemode="tozero")
    return finish(fig, title)


def group_decode(g: pl.DataFrame, target: float) -> go.Figure:
    """BLASST decode under the group decision, per length: at the per-head law's lambda the share of
    decode tiles the per-head decision skips and the share every head of a KV group skips (the V
    tiles the group kernel does not load), bars; the target as a line. ``g``: blasst_decode_group rows
    of one order and target."""
    title = f"Decode: per-head against group decision at the per-head law (target {target:g})"
    if not g.height:
        return empty_figure(title, "no group statistic in this run (captured before it; capture again)")
    g = g.sort("length")
    x = [f"{n:,}" for n in g["length"]]
    fig = go.Figure()
    for i, (col, name) in enumerate((("head_sparsity_at_head_lambda", "per-head decision"),
                                     ("group_sparsity_at_head_lambda", "group decision (V tiles skipped)"))):
        fig.add_trace(go.Bar(x=x, y=g[col], name=name, marker={"color": color(i)},
                             customdata=np.stack([g["lambda_head"], g["lambda_group_best"]], -1),
                             hovertemplate=(f"{name}<br>%{{x}} tokens<br>sparsity %{{y:.3f}} at λ %{{customdata[0]:.3g}}"
                                            "<br>the group reaches the target at λ %{customdata[1]:.3g}<extra></extra>")))
    return _bars_to_target(fig, target, "decode sparsity (of reachable tiles)", title)


# ---- Stabilization -----------------------------------------------------------------------------
def where_shares(df: pl.DataFrame) -> go.Figure:
    """Share of rows whose running max settles at the sink block, the diagonal blocks or in the
    middle, per scan order (stacked). ``df``: stab_where rows (any layers, heads; summed)."""
    title = "Where the running max stabilizes, per scan order"
    if not df.height:
        return empty_figure(title)
    agg = df.group_by("order").agg(pl.col(c).sum() for c in WHERE_COLORS).sort("order")
    tot = sum(agg[c] for c in WHERE_COLORS).cast(pl.Float64)
    fig = go.Figure()
    for c, col in WHERE_COLORS.items():
        share = (agg[c] / tot).fill_nan(0)
        fig.add_trace(go.Bar(x=agg["order"], y=share, name=c, marker={"color": col},
                             customdata=agg[c], hovertemplate=f"%{{x}}<br>{c}: %{{y:.1%}} (%{{customdata}} rows)<extra></extra>"))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title="share of rows", range=[0, 1], tickformat=".0%")
    fig.update_xaxes(title="scan order")
    return finish(fig, title)


def tstar_distribution(df: pl.DataFrame) -> go.Figure:
    """Distribution of normalized t* (scan step of stabilization / (reachable blocks - 1)) per scan
    order, as the share of rows in each bin. ``df``: stab_tstar rows (layers summed)."""
    title = "Normalized t*: when the running max reaches its final value"
    if not df.height:
        return empty_figure(title)
    agg = df.group_by(["order", "bin_lo", "bin_hi"]).agg(pl.col("rows").sum()).sort(["order", "bin_lo"])
    fig = go.Figure()
    for i, (order,) in enumerate(sorted(agg.select("order").unique().rows())):
        d = agg.filter(pl.col("order") == order)
        share = d["rows"] / max(int(d["rows"].sum()), 1)
        fig.add_trace(go.Scatter(x=(d["bin_lo"] + d["bin_hi"]) / 2, y=share, mode="lines+markers", name=order,
                                 line={"color": color(i), "shape": "hvh"},
                                 hovertemplate=f"{order}<br>t* in %{{x:.3f}}±0.025<br>%{{y:.1%}} of rows<extra></extra>"))
    fig.update_xaxes(title="normalized t* (0 = first block scanned, 1 = last)", range=[0, 1])
    fig.update_yaxes(title="share of rows", tickformat=".0%", rangemode="tozero")
    return finish(fig, title)


def qinit_histogram(df: pl.DataFrame, clip: float = 10.0,
                    title: str = "Q-init error: estimated minus true row max") -> go.Figure:
    """Q-init error (estimated minus true row max, nats) histogram, or VFA's frozen max minus the
    true row max (joint_hist rows, same bins). ``df``: qinit_hist / joint_hist rows (layers
    summed); the open outer bins and anything beyond +-clip are drawn at the clip edges."""
    if not df.height:
        return empty_figure(title)
    mid = ((df["bin_lo"].clip(-clip - 0.25, clip + 0.25) + df["bin_hi"].clip(-clip - 0.25, clip + 0.25)) / 2
           ).clip(-clip, clip)
    agg = df.with_columns(mid.alias("mid")).group_by("mid").agg(pl.col("rows").sum()).sort("mid")
    share = agg["rows"] / max(int(agg["rows"].sum()), 1)
    fig = go.Figure(go.Bar(x=agg["mid"], y=share, marker={"color": color(0)},
                           hovertemplate="error %{x:.2f}<br>%{y:.2%} of rows<extra></extra>"))
    fig.add_vline(x=0, line={"dash": "dot", "color": "black"})
    fig.update_xaxes(title=f"error (nats), clipped to ±{clip:g}; > 0 overestimates the max")
    fig.update_yaxes(title="share of rows", tickformat=".1%")
    return finish(fig, title)
