"""Chart builders for the run pages (Overview, Tiles, Accuracy-speedup, Export): polars DataFrame
-> plotly Figure, pure functions with no Streamlit.

Inputs: ``derive.prompts_frame`` rows (Overview), ``derive.tile_frame`` rows (Tiles),
``results.curves`` rows (Accuracy-speedup), ``derive.thresholds_frame`` rows and blasst.json's
``per_length`` rows (Export).
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import polars as pl

from sparsecal.dashboard.charts_fit import color, empty_figure, finish
from sparsecal.dashboard.derive import pareto_front

TILE_VALUES = {
    "bmax": ("block max score (nats)", "Viridis"),
    "gap": ("gap: tile row max - running max (nats)", "Cividis"),
    "mass": ("softmax mass of the tile", "YlGnBu"),
}


def samples_chart(df: pl.DataFrame) -> go.Figure:
    """Samples per length and task (stacked bars); unfinished planned samples as a hatched bar."""
    title = "Samples per length and task"
    if not df.height:
        return empty_figure(title, "no samples planned")
    agg = df.group_by(["task", "length", "finished"]).agg(pl.len().alias("n")).sort(["task", "length"])
    fig = go.Figure()
    for i, (task,) in enumerate(sorted(agg.select("task").unique().rows())):
        for done in (True, False):
            d = agg.filter((pl.col("task") == task) & (pl.col("finished") == done))
            if not d.height:
                continue
            fig.add_trace(go.Bar(x=[f"{n:,}" for n in d["length"]], y=d["n"], name=task if done else f"{task} (planned)",
                                 marker={"color": color(i), "pattern": {"shape": "" if done else "/"},
                                         "opacity": 1.0 if done else 0.4},
                                 hovertemplate=f"{task}<br>%{{x}} tokens<br>%{{y}} " +
                                 ("finished" if done else "not captured yet") + "<extra></extra>"))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="prompt length (tokens)", type="category",
                     categoryorder="array", categoryarray=[f"{n:,}" for n in sorted(set(df["length"]))])
    fig.update_yaxes(title="samples", dtick=1)
    return finish(fig, title, height=360)


SKIP_COLORS = ("rgba(255,255,255,0.8)", "rgba(255,65,54,0.7)", "rgba(255,150,0,0.9)")  # BSFA, BLASST, both


def _skip_overlay(tiles: pl.DataFrame, p: int, kb: int, show_bsfa: bool, show_blasst: bool) -> list:
    """Traces tinting the skipped tiles (1 BSFA, 2 BLASST, 3 both) over the heatmap, as one raster
    heatmap (cheap to draw at 8K: 64 x 128 tiles), plus legend entries with the counts."""
    code = np.zeros((p, kb))
    i, j = tiles["q_block"].to_numpy(), tiles["k_block"].to_numpy()
    if show_bsfa:
        code[i, j] += tiles["bsfa_skip"].to_numpy()
    if show_blasst:
        code[i, j] += 2 * tiles["blasst_skip"].to_numpy()
    if not code.any():
        return []
    scale = [[0.0, SKIP_COLORS[0]], [1 / 3, SKIP_COLORS[0]], [1 / 3, SKIP_COLORS[1]], [2 / 3, SKIP_COLORS[1]],
             [2 / 3, SKIP_COLORS[2]], [1.0, SKIP_COLORS[2]]]
    out = [go.Heatmap(z=np.where(code > 0, code, np.nan), zmin=0.5, zmax=3.5, colorscale=scale, showscale=False,
                      hoverinfo="skip", name="skipped")]
    counts = (("BSFA skips", int(tiles["bsfa_skip"].sum()) if show_bsfa else 0),
              ("BLASST skips", int(tiles["blasst_skip"].sum()) if show_blasst else 0),
              ("both skip", int((code == 3).sum())))
    for (name, n), c in zip(counts, SKIP_COLORS):
        if n:
            out.append(go.Scatter(x=[None], y=[None], mode="markers", name=f"{name} ({n})",
                                  marker={"symbol": "square", "size": 12, "color": c, "line": {"width": 1, "color": "grey"}}))
    return out


def tiles_figure(tiles: pl.DataFrame, value: str, show_bsfa: bool = True, show_blasst: bool = True,
                 title: str | None = None) -> go.Figure:
    """Heatmap of one tile quantity (``value`` in TILE_VALUES) over query block (rows) x key block
    (columns), blank where unreachable, with the skipped candidate tiles tinted: white for BSFA,
    red for BLASST, orange for both (legend with counts). ``tiles``: derive.tile_frame rows."""
    label, scale = TILE_VALUES[value]
    title = title or label
    if not tiles.height:
        return empty_figure(title)
    p, kb = int(tiles["q_block"].max()) + 1, int(tiles["k_block"].max()) + 1
    z = np.full((p, kb), np.nan)
    z[tiles["q_block"].to_numpy(), tiles["k_block"].to_numpy()] = tiles[value].fill_null(float("nan")).to_numpy()
    fig = go.Figure(go.Heatmap(z=z, colorscale=scale, colorbar={"title": {"text": value}}, name=value,
                               zmax=0.0 if value == "gap" else None,
                               hovertemplate=f"query block %{{y}}, key block %{{x}}<br>{value} %{{z:.4g}}<extra></extra>"))
    fig.add_traces(_skip_overlay(tiles, p, kb, show_bsfa, show_blasst))
    fig.update_xaxes(title="key block", range=[-0.5, kb - 0.5], constrain="domain", dtick=1 if kb <= 24 else None,
                     showgrid=False, zeroline=False)
    fig.update_yaxes(title="query block", autorange="reversed", scaleanchor="x", constrain="domain",
                     dtick=1 if p <= 24 else None, showgrid=False, zeroline=False)
    fig.update_layout(legend={"orientation": "h", "y": -0.15})
    return finish(fig, title, height=int(min(720, max(320, 1000 * p / kb + 160))))


def accuracy_speedup(df: pl.DataFrame) -> go.Figure:
    """Accuracy relative to dense vs speedup over dense: one curve per (method, length) through its
    configurations (sorted by speedup), the points on each length's Pareto front ringed, the dense
    point at (1, 1). Where the rows carry accuracy_rel_dense_lo/_hi (the evaluation's paired
    bootstrap 95% interval) or speedup_lo/_hi (the timing rounds' 95% interval), each point gets
    that interval as a vertical / horizontal error bar. ``df``: results.curves rows with both
    measures."""
    title = "Accuracy vs speedup (relative to dense)"
    d = df.filter(pl.col("accuracy_rel_dense").is_not_null() & pl.col("speedup").is_not_null()) if df.height else df
    if not d.height:
        return empty_figure(title, "no point has both an accuracy and a speedup")
    fig = go.Figure()
    dashes = ("solid", "dash", "dot", "dashdot", "longdash")
    lengths = sorted(set(d["length"]))
    for i, (method,) in enumerate(sorted(d.select("method").unique().rows())):
        for j, n in enumerate(lengths):
            g = d.filter((pl.col("method") == method) & (pl.col("length") == n)).sort("speedup")
            if not g.height:
                continue
            fig.add_trace(go.Scatter(
                x=g["speedup"], y=g["accuracy_rel_dense"], mode="lines+markers", name=f"{method} @ {n:,}",
                line={"color": color(i), "dash": dashes[j % len(dashes)]}, text=g["config"],
                error_y=_error_bars(g, "accuracy_rel_dense"),
                error_x=_error_bars(g, "speedup"),
                customdata=g["sparsity"].fill_null(float("nan")),
                hovertemplate=(f"{method} %{{text}}<br>{n} tokens<br>speedup %{{x:.2f}}x<br>accuracy / dense "
                               "%{y:.3f}<br>sparsity %{customdata:.3f}<extra></extra>")))
    front = pareto_front(d)
    fig.add_trace(go.Scatter(x=front["speedup"], y=front["accuracy_rel_dense"], mode="markers", name="Pareto front",
                             marker={"symbol": "circle-open", "size": 16, "color": "black", "line": {"width": 2}},
                             text=front["method"] + " " + front["config"], hovertemplate=(
                                 "Pareto: %{text}<br>speedup %{x:.2f}x<br>accuracy / dense %{y:.3f}<extra></extra>")))
    fig.add_trace(go.Scatter(x=[1.0], y=[1.0], mode="markers", name="dense", marker={"symbol": "star", "size": 14,
                                                                                 "color": "black"}))
    fig.update_xaxes(title="speedup over dense (x)")
    fig.update_yaxes(title="accuracy relative to dense")
    return finish(fig, title, height=480)


def _error_bars(g: pl.DataFrame, col: str) -> dict | None:
    """Asymmetric error bars of ``col`` from ``col``_lo/_hi (none when the rows have no interval)."""
    if f"{col}_lo" not in g.columns or f"{col}_hi" not in g.columns or g[f"{col}_lo"].null_count() == g.height:
        return None
    y = g[col]
    up = (g[f"{col}_hi"] - y).fill_null(0.0).clip(lower_bound=0.0)
    down = (y - g[f"{col}_lo"]).fill_null(0.0).clip(lower_bound=0.0)
    return {"type": "data", "symmetric": False, "array": up.to_list(), "arrayminus": down.to_list(),
            "thickness": 1.2, "width": 4}


def thresholds_heatmap(df: pl.DataFrame, k: int, layer: int) -> go.Figure:
    """BSFA thresholds of one k and layer: heads (rows) x query block (columns); blank where the
    threshold is -inf (every candidate kept). ``df``: derive.thresholds_frame rows."""
    title = f"BSFA thresholds, k={k}, layer {layer} (blank: -inf, all candidates kept)"
    if not df.height:
        return empty_figure(title)
    h, p = int(df["head"].max()) + 1, int(df["q_block"].max()) + 1
    z = np.full((h, p), np.nan)
    z[df["head"].to_numpy(), df["q_block"].to_numpy()] = df["threshold"].fill_null(float("nan")).to_numpy()
    fig = go.Figure(go.Heatmap(z=z, colorscale="Viridis", colorbar={"title": {"text": "threshold"}},
                               hovertemplate="head %{y}, query block %{x}<br>threshold %{z:.3f}<extra></extra>"))
    fig.update_xaxes(title="query block (128-token rows by default)")
    fig.update_yaxes(title="head", autorange="reversed", dtick=1)
    return finish(fig, title, height=360)


def export_lambda_chart(per_length: pl.DataFrame) -> go.Figure:
    """blasst.json's per-length rows: the exported lambda = factor / L per mode (lines) next to
    lambda_best (markers), log-log. Columns: mode, length, lambda, lambda_best."""
    title = "Exported BLASST lambda = threshold_scale_factor / L"
    if not per_length.height:
        return empty_figure(title)
    fig = go.Figure()
    for i, (mode,) in enumerate(sorted(per_length.select("mode").unique().rows())):
        d = per_length.filter(pl.col("mode") == mode).sort("length")
        fig.add_trace(go.Scatter(x=d["length"], y=d["lambda"], mode="lines", name=f"{mode}: exported",
                                 line={"color": color(i)}))
        fig.add_trace(go.Scatter(x=d["length"], y=d["lambda_best"], mode="markers", name=f"{mode}: lambda_best",
                                 marker={"color": color(i), "size": 9}))
    fig.update_xaxes(type="log", title="prompt length (tokens)")
    fig.update_yaxes(type="log", title="lambda")
    return finish(fig, title, height=380)


LAYER_KINDS = {"full_attention": 0, "sliding_attention": 1, "chunked_attention": 2}


def layer_map_chart(layer_types: list[str], captured: list[int], notes: dict) -> go.Figure:
    """One cell per model layer, coloured by attention type, marked captured or dense (hover: why)."""
    n = len(layer_types)
    z = [[LAYER_KINDS.get(t, 3) for t in layer_types]]
    text = [["●" if i in captured else "" for i in range(n)]]
    hover = [[f"layer {i}: {t.replace('_', ' ')}<br>" + ("captured" if i in captured else notes.get(str(i), "dense"))
              for i, t in enumerate(layer_types)]]
    scale = [[0.0, "#1f77b4"], [0.33, "#1f77b4"], [0.33, "#ff7f0e"], [0.66, "#ff7f0e"], [0.66, "#2ca02c"],
             [0.9, "#2ca02c"], [0.9, "#7f7f7f"], [1.0, "#7f7f7f"]]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(n)), y=["layer"], zmin=0, zmax=3, colorscale=scale, showscale=False,
                               text=text, texttemplate="%{text}", customdata=hover, xgap=2,
                               hovertemplate="%{customdata}<extra></extra>"))
    fig.update_xaxes(title="layer (● captured; blue full, orange sliding, green chunked, grey other)", dtick=1)
    fig.update_yaxes(showticklabels=False)
    return finish(fig, "Attention type per layer", height=190)
