"""Density (BSFA): predicted vs measured density per length and k with the spread over samples
(the BSFA paper's Table 1 as a chart), and per layer x head heatmaps of one k and length.
Controls: k values of the chart; k, length and quantity of the heatmap."""
from __future__ import annotations

import polars as pl
import streamlit as st

from sparsecal.dashboard import charts_fit, data, ui

QUANTITIES = {
    "measured": ("measured density", 0.0, 1.0, "Viridis"),
    "error": ("measured - predicted density", None, None, "RdBu"),
    "retained_mass_topk": ("mass kept by each sample's own top-k", None, 1.0, "Viridis"),
}


def _table1(root) -> None:
    dens = data.table(root, "bsfa_density")
    ks = sorted(set(dens["k"]))
    chosen = ui.choose_many("k values", ks, key="den_ks", fmt=lambda k: f"k={k}")
    ui.plot(charts_fit.density_vs_length(dens.filter(pl.col("k").is_in(chosen))), key="den_table1")
    with st.expander("Table"):
        st.dataframe(dens.sort(["k", "length"]), hide_index=True)


def _heads(root) -> None:
    heads = data.table(root, "bsfa_heads")
    if not heads.height:
        st.info("bsfa_heads has no rows: the fit measured no sample.")
        return
    c1, c2, c3 = st.columns(3)
    k = ui.choose("k", sorted(set(heads["k"])), key="den_k", where=c1, fmt=lambda k: f"k={k}")
    n = ui.choose("Length", sorted(set(heads["length"])), key="den_len", where=c2, fmt=ui.fmt_len)
    q = ui.choose("Quantity", list(QUANTITIES), key="den_q", where=c3, fmt=lambda x: QUANTITIES[x][0])
    d = heads.filter((pl.col("k") == k) & (pl.col("length") == n)).with_columns(
        (pl.col("measured") - pl.col("predicted")).alias("error"))
    label, lo, hi, scale = QUANTITIES[q]
    if q == "error":
        span = float(d["error"].abs().max() or 0.0) or 1e-3
        lo, hi = -span, span
    ui.plot(charts_fit.layer_head_heatmap(d, q, f"{label} per layer x head (k={k}, {n:,} tokens)",
                                          zmin=lo, zmax=hi, colorscale=scale,
                                          layer_types=data.layer_map(root)[1]), key="den_heads")


def render() -> None:
    root = ui.header("Density (BSFA)", "Thresholds keep each query block's top-k candidate key blocks; "
                     "density = computed / reachable tiles, measured on the fit's validation samples.")
    with ui.section():
        _table1(root)
    st.subheader("Per layer and head")
    with ui.section():
        _heads(root)


render()
