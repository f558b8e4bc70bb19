"""BLASST: sparsity and retained mass vs lambda per length; lambda_best vs L with the fitted a/L
and power laws and their residuals; calibrated vs fixed lambda on held-out samples (Table 5);
per layer x head sparsity at a chosen lambda (the heterogeneity of BLASST's Fig. 7).
Controls: mode, scan order, target; length, lambda and quantity of the heatmap."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import streamlit as st

from sparsecal.dashboard import charts_fit, data, derive, ui


def _controls(root):
    curves = data.table(root, "blasst_curves")
    lam = data.table(root, "blasst_lambda")
    if not curves.height or not lam.height:
        raise data.Missing(f"the fit has no BLASST rows; run `sparsecal fit {root}` with reachable --targets.")
    c1, c2, c3 = st.columns(3)
    mode = ui.choose("Mode", sorted(set(curves["mode"]), key=lambda m: (m != "prefill", m)), key="bl_mode", where=c1,
                     help="prefill: 128-row query blocks; decode: each of the last rows alone")
    orders = [o for o in ("forward", "reverse", "sink_local") if o in set(curves["order"])]
    order = ui.choose("Scan order", orders, key="bl_order", where=c2)
    target = ui.choose("Target sparsity", sorted(set(lam["target"])), key="bl_target", where=c3, fmt=lambda t: f"{t:g}")
    return curves, lam, mode, order, target


def _sel(df: pl.DataFrame, mode: str, order: str, target: float | None = None) -> pl.DataFrame:
    d = df.filter((pl.col("mode") == mode) & (pl.col("order") == order))
    return d if target is None else d.filter((pl.col("target") - target).abs() < 1e-9)


def _law_charts(root, curves, lam, mode, order, target) -> None:
    fits = _sel(data.table(root, "blasst_fit"), mode, order, target)
    marks = pl.DataFrame({"length": sorted(set(curves["length"]))})
    marks = marks.with_columns(pl.col("length").map_elements(
        lambda n: derive.law_lambda(fits, mode, order, target, n), return_dtype=pl.Float64).alias("lambda"))
    ui.plot(charts_fit.sparsity_curves(_sel(curves, mode, order), marks), key="bl_curves")
    c1, c2 = st.columns(2)
    with c1:
        ui.plot(charts_fit.lambda_law(_sel(lam, mode, order, target), fits), key="bl_law")
    with c2:
        with ui.section():
            ev = _sel(data.table(root, "blasst_eval"), mode, order, target)
            ui.plot(charts_fit.table5(ev, target), key="bl_table5")
    st.caption(_deployed_note(fits, target))
    if mode == "decode":
        _group(root, order, target)


def _group(root, order, target) -> None:
    """The decode group decision beside the per-head one (fit's blasst_decode_group)."""
    try:
        g = _sel(data.table(root, "blasst_decode_group"), "decode", order, target)
    except data.Missing:
        st.info("This fit has no group-decision table; run `sparsecal fit` again (a run captured before "
                "decode_group_gap_count has no group statistic).")
        return
    ui.plot(charts_fit.group_decode(g, target), key="bl_group")
    if g.height and g["a_group"].is_not_nan().all():
        r = g.row(0, named=True)
        st.caption(f"A KV group skips a tile only when all its heads would. Its own law reaches the target at "
                   f"a = {r['a_group']:.4g} (the per-head law: a = {r['a_head']:.4g}); the export's decode_group "
                   "carries it and `sparsify(..., decode_decision=\"group\")` applies it.")


def _deployed_note(fits: pl.DataFrame, target: float) -> str:
    """Which law is deployed and over which lengths it holds (fits written before that say less)."""
    dep = fits.filter(pl.col("law") == "a/L")
    if not dep.height or "min_length" not in fits.columns:
        return "Deployed: λ = a/L (this fit predates the recorded validated lengths; run `sparsecal fit` again)."
    r = dep.row(0, named=True)
    return (f"Deployed: λ = a/L with a = {r['a']:.4g} for target {target:g}, validated on {r['lengths']} tokens. "
            f"sparsify runs dense below {r['dense_below']:,} tokens (shorter than any length the target was reached "
            "at, or a/L > 1, where the kernel would skip every candidate tile). The other laws are shown for "
            "comparison: R² in ln λ here, held-out error in `sparsecal fit`'s table.")


def _heads(root, mode, order, target) -> None:
    gcs = data.gap_cum(root)
    if mode not in gcs:
        st.info(f"gap_cum.safetensors has no {mode} histograms (captured with --decode-rows 0?).")
        return
    gc = gcs[mode]
    c1, c2, c3 = st.columns([1, 2, 1])
    n = ui.choose("Length", [int(x) for x in gc.lengths], key="bl_len", where=c1, fmt=ui.fmt_len)
    law = derive.law_lambda(_sel(data.table(root, "blasst_fit"), mode, order, target), mode, order, target, n)
    grid = [float(x) for x in gc.log_lambda]
    default = grid[derive.snap(gc.log_lambda, math.log(law))] if law else grid[-1]
    x = ui.slider_choice("ln lambda", grid, key=f"bl_loglam_{mode}_{order}_{target:g}_{n}", default=default, where=c2,
                         fmt=lambda v: f"{v:g} (λ={np.exp(v):.3g})",
                         help="Skip a candidate tile when its gap is below ln lambda. Starts at the calibrated a/L.")
    q = ui.choose("Quantity", ["sparsity", "retained_mass"], key="bl_q", where=c3)
    layers, types, _ = data.layer_map(root)
    d = derive.head_sparsity_frame(gc, n, order, x, layers)
    mean = float(d[q].mean())
    ui.plot(charts_fit.layer_head_heatmap(
        d, q, f"{mode} {q} per layer x head at ln λ={x:g} ({n:,} tokens, {order}; mean {mean:.3f})",
        zmin=0.0, zmax=1.0 if q == "sparsity" else None, layer_types=types), key="bl_heads")
    if law:
        st.caption(f"The calibrated a/L for target {target:g} gives λ={law:.3g} (ln λ={math.log(law):.2f}) at "
                   f"{n:,} tokens; the grid steps by 0.25 in ln λ.")


def render() -> None:
    root = ui.header("BLASST", "Skip a tile whose row maxima sit more than -ln(lambda) below the running max; "
                     "lambda = a/L calibrated per target sparsity, deployed only over the lengths it was "
                     "validated on (ln lambda > 0 would skip every candidate tile).")
    with ui.section():
        curves, lam, mode, order, target = _controls(root)
        _law_charts(root, curves, lam, mode, order, target)
        st.subheader("Per layer and head at a chosen lambda")
        with ui.section():
            _heads(root, mode, order, target)


render()
