"""Chart and table of an export's dispatch plan (blasst.json ``dispatch``, formats.dispatch): pure
functions, no Streamlit.

Input: one config entry of the record (``break_even`` [NL], ``extrapolated`` [NL], ``sparsity``
[L][NL] with null for layers the export leaves dense, ``sparse`` [L][NL]) and the record's
calibrated ``lengths`` [NL]. Shape legend: L model layers, NL calibrated lengths.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import polars as pl

from sparsecal.dashboard.charts_fit import finish

# 0: dense (SDPA), 1: sparse kernel, 2: the export leaves the layer dense (no calibrated sparsity)
DISPATCH_SCALE = [[0.0, "#c9d3df"], [0.33, "#c9d3df"], [0.33, "#d62728"], [0.66, "#d62728"],
                  [0.66, "#7f7f7f"], [1.0, "#7f7f7f"]]


def _cell(s, be, ext: bool, sparse: bool) -> str:
    if s is None:
        return "left dense by the export"
    be_text = "never pays" if be is None else f"break-even {be:.3f}" + (" (nearest measured length)" if ext else "")
    return f"{'sparse kernel' if sparse else 'SDPA'}<br>calibrated sparsity {s:.3f}<br>{be_text}"


def dispatch_heatmap(entry: dict, lengths: list[int]) -> go.Figure:
    """Layers (rows) x calibrated lengths (columns): red where the layer runs the sparse prefill
    kernel, light where it runs SDPA, grey where the export leaves it dense; hover: the
    calibrated sparsity and the break-even there."""
    n_layers = len(entry["sparse"])
    z = np.array([[2 if s is None else int(on) for s, on in zip(srow, prow)]
                  for srow, prow in zip(entry["sparsity"], entry["sparse"])], float).reshape(n_layers, len(lengths))
    hover = [[_cell(s, be, ext, on) for s, be, ext, on in zip(srow, entry["break_even"], entry["extrapolated"], prow)]
             for srow, prow in zip(entry["sparsity"], entry["sparse"])]
    text = [["" if s is None else f"{s:.2f}" for s in srow] for srow in entry["sparsity"]]
    x = [f"{n:,}" for n in lengths]
    fig = go.Figure(go.Heatmap(z=z.tolist(), x=x, y=list(range(n_layers)), zmin=0, zmax=2, colorscale=DISPATCH_SCALE,
                               showscale=False, text=text, texttemplate="%{text}", customdata=hover, xgap=2, ygap=1,
                               hovertemplate="layer %{y}, %{x} tokens<br>%{customdata}<extra></extra>"))
    count = [sum(row[j] for row in entry["sparse"]) for j in range(len(lengths))]
    fig.update_xaxes(title="prefill bucket: calibrated length (tokens); sparse layers " +
                     ", ".join(f"{c}/{n_layers}" for c in count), type="category")
    fig.update_yaxes(title="layer (cell: calibrated sparsity)", autorange="reversed", dtick=1)
    title = (f"Dispatch of {entry['method']} {entry['config']}: red = sparse kernel, light = SDPA, "
             "grey = left dense by the export")
    return finish(fig, title, height=max(320, 22 * n_layers + 140))


def dispatch_table(rec: dict) -> pl.DataFrame:
    """One row per config: per length the break-even (* nearest measured length) and the sparse
    layers' count."""
    rows = []
    for e in rec["configs"]:
        row = {"config": f"{e['method']} {e['config']}"}
        for j, n in enumerate(rec["lengths"]):
            be = e["break_even"][j]
            row[f"{n} break-even"] = ("never" if be is None else f"{be:.3f}") + ("*" if e["extrapolated"][j] else "")
            row[f"{n} sparse layers"] = sum(r[j] for r in e["sparse"])
        rows.append(row)
    return pl.DataFrame(rows)
