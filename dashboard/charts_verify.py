"""Chart of ``sparsecal verify`` rows (formats.verify): sparsity per length, sparsecal's prediction
against the consumer's measurement, one panel per phase. Pure functions, no Streamlit."""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sparsecal.dashboard.charts_fit import finish

SERIES = (("predicted", "predicted (sparsecal)", "dash"), ("measured_dense", "measured (dense statistics)", "solid"),
          ("measured_masks", "measured (masks applied)", "dot"))


def verify_chart(rows: list[dict]) -> go.Figure:
    """Sparsity vs prompt length, a line per (target, series), prefill left and decode right."""
    phases = [p for p in ("prefill", "decode") if any(r["phase"] == p for r in rows)]
    fig = make_subplots(rows=1, cols=len(phases), subplot_titles=phases, shared_yaxes=True)
    targets = sorted({r["target"] for r in rows})
    for col, phase in enumerate(phases, 1):
        for t in targets:
            pts = sorted((r for r in rows if r["phase"] == phase and r["target"] == t), key=lambda r: r["length"])
            for key, name, dash in SERIES:
                xs = [r["length"] for r in pts if r.get(key) is not None]
                ys = [r[key] for r in pts if r.get(key) is not None]
                if xs:
                    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", line={"dash": dash},
                                             name=f"S={t:g} {name}", legendgroup=f"{t}", showlegend=col == 1),
                                  row=1, col=col)
        fig.update_xaxes(type="log", title_text="prompt tokens", row=1, col=col)
    fig.update_yaxes(title_text="skipped / reachable tiles", range=[0, 1.02], row=1, col=1)
    return finish(fig, "Predicted vs measured sparsity per length", height=380)
