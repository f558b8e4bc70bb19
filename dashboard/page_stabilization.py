"""Stabilization (VFA): where each row's running max settles per scan order (sink block, diagonal
blocks, middle), the distribution of normalized t*, and the Q-init error.
Controls: length and layer (or all), the order and category of the per-head heatmap."""
from __future__ import annotations

import polars as pl
import streamlit as st

from sparsecal.dashboard import charts_fit, data, ui

ALL = -1


def _filters(root):
    where = data.table(root, "stab_where")
    if not where.height:
        raise data.Missing(f"stab_where has no rows; run `sparsecal fit {root}` again.")
    c1, c2 = st.columns(2)
    lengths = [ALL] + sorted(set(where["length"]))
    n = ui.choose("Length", lengths, key="st_len", where=c1, fmt=lambda v: "all lengths" if v == ALL else ui.fmt_len(v))
    layers = [ALL] + sorted(set(where["layer"]))
    layer = ui.choose("Layer", layers, key="st_layer", where=c2, fmt=lambda v: "all layers" if v == ALL else f"layer {v}")
    return where, n, layer


def _pick(df: pl.DataFrame, n: int, layer: int | None) -> pl.DataFrame:
    if n != ALL:
        df = df.filter(pl.col("length") == n)
    if layer is not None and layer != ALL:
        df = df.filter(pl.col("layer") == layer)
    return df


def _heads(where: pl.DataFrame, n: int, layer_types: list | None) -> None:
    c1, c2 = st.columns(2)
    order = ui.choose("Scan order", sorted(set(where["order"])), key="st_order", where=c1)
    cat = ui.choose("Category", ["sink", "diagonal", "middle"], key="st_cat", where=c2)
    d = (_pick(where, n, None).filter(pl.col("order") == order).group_by(["layer", "head"])
         .agg(pl.col("sink").sum(), pl.col("diagonal").sum(), pl.col("middle").sum())
         .with_columns((pl.col(cat) / (pl.col("sink") + pl.col("diagonal") + pl.col("middle"))).alias("share")))
    ui.plot(charts_fit.layer_head_heatmap(d, "share", f"Share of rows settling at the {cat} ({order} order)",
                                          zmin=0.0, zmax=1.0, layer_types=layer_types), key="st_heads")


def render() -> None:
    root = ui.header("Stabilization (VFA)", "Where and when each row's running max reaches its final value, "
                     "and how far a Q-init estimate of it from one key per block lands.")
    with ui.section():
        where, n, layer = _filters(root)
        c1, c2 = st.columns(2)
        with c1:
            ui.plot(charts_fit.where_shares(_pick(where, n, layer)), key="st_where")
        with c2, ui.section():
            ui.plot(charts_fit.tstar_distribution(_pick(data.table(root, "stab_tstar"), n, layer)), key="st_tstar")
        with ui.section():
            ui.plot(charts_fit.qinit_histogram(_pick(data.table(root, "qinit_hist"), n, layer)), key="st_qinit")
        st.subheader("Per layer and head")
        _heads(where, n, data.layer_map(root)[1])


render()
