"""Tiles: one sample's raw tiles for a layer and head (block max, gap, mass; runs captured with
--raw), with the BSFA skip mask (fitted thresholds at k) and the BLASST skip mask (calibrated
a/L at a target, in the chosen scan order) overlaid.
Controls: sample, layer, head, scan order, k, BLASST target."""
from __future__ import annotations

import math

import polars as pl
import streamlit as st

from sparsecal.dashboard import charts_fit, charts_run, data, derive, ui

NONE = "none"


def _sample(root, man) -> dict:
    recs = [r for r in data.samples(root) if r.get("raw")]
    if not recs and not (root / "samples").exists():
        raise data.Missing(f"{root} holds no samples (a committed calibration keeps its manifest, fit and export "
                           "only): capture a run with `sparsecal capture ... --raw --out RUN` to see tiles.")
    if not recs:
        raise data.Missing(f"{root} has no raw tiles: capture with `sparsecal capture ... --raw --out RUN` "
                           "(short prompts: raw tiles grow with the square of the length).")
    by_id = {r["id"]: r for r in recs}
    c1, c2, c3, c4 = st.columns([3, 1, 1, 1])
    longest = max(recs, key=lambda r: (r["length"], r["id"]))["id"]
    sid = ui.choose("Sample", list(by_id), key="ti_sample", where=c1, default=longest,
                    fmt=lambda s: f"{by_id[s]['task']} · {by_id[s]['length']:,} tokens · {s}")
    m = man["model"]
    layers, types, _ = data.layer_map(root)  # raw tiles and thresholds are indexed by position in ``layers``
    layer = ui.choose("Layer", range(len(layers)), key="ti_layer", where=c2,
                      fmt=lambda i: charts_fit.layer_label(layers[i], types))
    head = ui.choose("Head", range(m["num_heads"]), key="ti_head", where=c3)
    order = ui.choose("Scan order (gap)", list(man["config"]["orders"]), key="ti_order", where=c4)
    return {"rec": by_id[sid], "layer": layer, "head": head, "order": order}


def _masks(root, sel: dict):
    """(BSFA thresholds [P'] or None, ln lambda or None, a caption) for the controls below."""
    notes = []
    c1, c2 = st.columns(2)
    thr = loglam = None
    with ui.section():
        t, ks = data.fit_thresholds(root)
        k = ui.choose("BSFA k", [NONE] + ks, key="ti_k", where=c1, default=ks[0],
                      fmt=lambda v: "no BSFA mask" if v == NONE else f"k={v}")
        if k != NONE:
            thr = t[ks.index(k), sel["layer"], sel["head"]]
    with ui.section():
        fits = data.table(root, "blasst_fit").filter((pl.col("mode") == "prefill") & (pl.col("order") == sel["order"]))
        targets = sorted(set(fits["target"]))
        tgt = ui.choose("BLASST target", [NONE] + targets, key="ti_target", where=c2,
                        default=targets[0] if targets else NONE,
                        fmt=lambda v: "no BLASST mask" if v == NONE else f"target {v:g} (a/L, {sel['order']})")
        if tgt != NONE:
            lam = derive.law_lambda(fits, "prefill", sel["order"], tgt, sel["rec"]["length"])
            loglam = math.log(lam) if lam else None
            notes.append(f"BLASST λ={lam:.3g} (ln λ={loglam:.2f})" if lam else "no fitted law for this target")
    return thr, loglam, "; ".join(notes)


def render() -> None:
    root = ui.header("Tiles", "Raw tile statistics of one sample, layer and head, with what each method skips. "
                     "Only candidate (fully visible off-diagonal) tiles are ever skipped.")
    with ui.section():
        man = data.manifest(root)
        data.show_damaged(root)
        sel = _sample(root, man)
        thr, loglam, note = _masks(root, sel)
        cfg, n = man["config"], sel["rec"]["length"]
        tiles = data.raw_tiles(root, sel["rec"]["id"], sel["layer"], sel["head"])
        frame = derive.tile_frame(tiles, n, cfg["block_m"], cfg["block_n"], list(cfg["orders"]).index(sel["order"]),
                                  thr, loglam)
        s = derive.mask_summary(frame)
        cols = st.columns(4)
        cols[0].metric("BSFA sparsity", f"{s['bsfa_sparsity']:.3f}")
        cols[1].metric("BSFA retained mass", f"{s['bsfa_retained_mass']:.4f}")
        cols[2].metric("BLASST sparsity", f"{s['blasst_sparsity']:.3f}")
        cols[3].metric("BLASST retained mass", f"{s['blasst_retained_mass']:.4f}")
        st.caption(f"{s['reachable']} reachable tiles. {note}")
        wide = frame["k_block"].max() + 1 > 32  # 2K tokens and more: one chart per row
        for col, value in zip([st.container()] * 3 if wide else st.columns(3), charts_run.TILE_VALUES):
            with col:
                ui.plot(charts_run.tiles_figure(frame, value), key=f"ti_{value}")


render()
