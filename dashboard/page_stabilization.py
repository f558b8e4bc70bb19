"""Stabilization (VFA): where each row's running max settles per scan order (sink block, diagonal
blocks, middle), the distribution of normalized t*, the Q-init error beside VFA's frozen max
(max(Q-init, sink + diagonal max)) minus the true row max, and what the scan order
changes: running-max rescales per row and the shortfall after the first / first + local blocks.
Controls: length and layer (or all), the order and category of the per-head heatmap, the order
and metric of the per-head rescale heatmap."""
from __future__ import annotations

import polars as pl
import streamlit as st

from sparsecal.dashboard import charts_fit, charts_stab, data, ui

ALL = -1
JOINT_TITLE = "VFA frozen max minus true row max"
JOINT_COLS = ("share_below_1", "share_below_5", "share_above_5")
ORDER_NOTE = ("The where shares above are the same for every scan order: they count the block that holds "
              "each row's maximum, whichever order the blocks are scanned in. What the order changes is how "
              "often the running max rises on the way (each rise is an O(D) rescale of the accumulator) and "
              "how far it still is from the final max after the first blocks.")
METRICS = {"mean rescales per row": ("stab_rescale", "mean_rescales", None),
           "share at the final max after the first block": ("stab_shortfall", "share_zero", "first"),
           "share at the final max after the first + local blocks": ("stab_shortfall", "share_zero", "local")}


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


def _joint(root, n: int, layer: int) -> None:
    """VFA's frozen max minus the true row max (same bins as Q-init) and its risk shares."""
    hist = _pick(data.joint_table(root, "joint_hist"), n, layer)
    ui.plot(charts_fit.qinit_histogram(hist, title=JOINT_TITLE), key="st_joint")
    j = _pick(data.joint_table(root, "joint"), n, layer)
    rows = max(int(j["rows"].sum()), 1)
    share = {c: float((j[c].fill_nan(0) * j["rows"]).sum() / rows) for c in JOINT_COLS}
    st.caption(f"Frozen max = max(Q-init, sink + diagonal max). Rows whose frozen max is more than 1 nat below "
               f"the true max (p > 1 in VFA's frozen phase): "
               f"{share['share_below_1']:.2%}; more than 5 below: {share['share_below_5']:.2%}; more than 5 "
               f"above (every p scaled down): {share['share_above_5']:.2%}.")


def _heads(where: pl.DataFrame, n: int, layer_types: list | None) -> None:
    c1, c2 = st.columns(2)
    order = ui.choose("Scan order", sorted(set(where["order"])), key="st_order", where=c1)
    cat = ui.choose("Category", ["sink", "diagonal", "middle"], key="st_cat", where=c2)
    d = (_pick(where, n, None).filter(pl.col("order") == order).group_by(["layer", "head"])
         .agg(pl.col("sink").sum(), pl.col("diagonal").sum(), pl.col("middle").sum())
         .with_columns((pl.col(cat) / (pl.col("sink") + pl.col("diagonal") + pl.col("middle"))).alias("share")))
    ui.plot(charts_fit.layer_head_heatmap(d, "share", f"Share of rows settling at the {cat} ({order} order)",
                                          zmin=0.0, zmax=1.0, layer_types=layer_types), key="st_heads")


def _rescales(root, n: int, layer: int, layer_types: list | None) -> None:
    """Rescales and shortfall per scan order (one info line for a run captured without them)."""
    st.subheader("Rescales and shortfall per scan order")
    st.markdown(ORDER_NOTE)
    with ui.section():
        rescale = data.rescale_table(root, "stab_rescale")
        c1, c2 = st.columns(2)
        with c1:
            ui.plot(charts_stab.rescales_by_order(_pick(rescale, n, layer)), key="st_rescales")
        with c2:
            ui.plot(charts_stab.rescale_distribution(_pick(data.rescale_table(root, "stab_rescale_hist"), n, layer)),
                    key="st_rescale_dist")
        hist = _pick(data.rescale_table(root, "stab_shortfall_hist"), n, layer)
        c1, c2 = st.columns(2)
        with c1:
            ui.plot(charts_stab.already_final(hist), key="st_final")
        with c2:
            ui.plot(charts_stab.shortfall_cdf(hist), key="st_shortfall")
        c1, c2 = st.columns(2)
        order = ui.choose("Scan order", sorted(set(rescale["order"])), key="st_rs_order", where=c1)
        metric = ui.choose("Per-head value", list(METRICS), key="st_rs_metric", where=c2)
        name, col, prefix = METRICS[metric]
        df = _pick(data.rescale_table(root, name), n, None).filter(pl.col("order") == order)
        if prefix:
            df = df.filter(pl.col("prefix") == prefix)
        d = (df.with_columns((pl.col(col).fill_nan(0) * pl.col("rows")).alias("w")).group_by(["layer", "head"])
             .agg(pl.col("w").sum(), pl.col("rows").sum()).with_columns((pl.col("w") / pl.col("rows")).alias(col)))
        ui.plot(charts_fit.layer_head_heatmap(d, col, f"{metric[0].upper()}{metric[1:]} ({order} order)",
                                              zmin=0.0, zmax=None if prefix is None else 1.0,
                                              layer_types=layer_types), key="st_rs_heads")


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
        c1, c2 = st.columns(2)
        with c1, ui.section():
            ui.plot(charts_fit.qinit_histogram(_pick(data.table(root, "qinit_hist"), n, layer)), key="st_qinit")
        with c2, ui.section():
            _joint(root, n, layer)
        st.subheader("Per layer and head")
        _heads(where, n, data.layer_map(root)[1])
        _rescales(root, n, layer, data.layer_map(root)[1])


render()
