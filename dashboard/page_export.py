"""Export: download the threshold files (thresholds.bsfa.pt, thresholds.safetensors, blasst.json)
with their metadata, and look at what they hold.
Controls: export directory, k and layer of the thresholds heatmap, BLASST target."""
from __future__ import annotations

from pathlib import Path

import polars as pl
import streamlit as st

from sparsecal.dashboard import charts_run, data, derive, ui

MIME = {".pt": "application/octet-stream", ".safetensors": "application/octet-stream", ".json": "application/json"}


def _directory(root) -> Path:
    found = data.export_dirs(root)
    other = st.text_input("Another export directory", key="ex_other", placeholder="/path/to/export (optional)")
    if other.strip():
        return Path(other.strip()).expanduser()
    if not found:
        raise data.Missing(f"{root} has no export yet; write one with `sparsecal export {root} --out {root}/export`.")
    return ui.choose("Export directory", [str(d) for d in found], key="ex_dir", fmt=lambda d: Path(d).name)


def _downloads(d: Path) -> None:
    cols = st.columns(len(data.EXPORT_NAMES))
    for col, name in zip(cols, data.EXPORT_NAMES):
        path = Path(d) / name
        if path.is_file():
            col.download_button(f"{name} ({path.stat().st_size / 1024:.0f} KB)", data.file_bytes(path),
                                file_name=name, mime=MIME[path.suffix], key=f"ex_dl_{name}", icon=":material/download:")
        else:
            col.info(f"{name} is missing; `sparsecal export` writes it.")


def _bsfa(d: Path) -> None:
    meta = data.export_bsfa_meta(d)
    thr, ks = data.fit_thresholds_file(Path(d) / "thresholds.safetensors")
    st.markdown(f"**BSFA thresholds** `{meta['shape']}` = [num_k, layers, heads, query blocks]; "
                f"the `.pt` twin holds the same tensor in the BSFA reference's dict layout.")
    c1, c2 = st.columns(2)
    k = ui.choose("k", ks, key="ex_k", where=c1, fmt=lambda v: f"k={v}")
    layer = ui.choose("Layer", range(thr.shape[1]), key="ex_layer", where=c2)
    ui.plot(charts_run.thresholds_heatmap(derive.thresholds_frame(thr, ks, k, layer), k, layer), key="ex_thr")
    with st.expander("thresholds.safetensors metadata"):
        st.json(meta["metadata"])


def _blasst(d: Path) -> None:
    doc = data.export_blasst(d)
    entries = {e["target_sparsity"]: e for e in doc.get("targets", [])} or {doc["target_sparsity"]: doc}
    tgt = ui.choose("BLASST target", sorted(entries), key="ex_target", default=doc["target_sparsity"],
                    fmt=lambda t: f"{t:g}" + (" (the file's main target)" if t == doc["target_sparsity"] else ""))
    e = entries[tgt]
    f = e["threshold_scale_factor"]
    st.markdown(f"**BLASST** ({doc.get('scan_order')} order): lambda = factor / L with factor "
                + ", ".join(f"{m} **{v:.4g}**" for m, v in f.items() if v is not None)
                + f"; calibrated on {doc.get('samples')} samples of {', '.join(map(str, doc.get('lengths', [])))} tokens"
                + f", validated {doc.get('validation')}.")
    rows = [{"mode": r["mode"], "length": int(r["length"]), "lambda": r.get("lambda"), "lambda_best": r.get("lambda_best"),
             "achieved": r.get("achieved")} for r in e.get("per_length", [])]
    per = pl.DataFrame(rows, schema={"mode": pl.Utf8, "length": pl.Int64, "lambda": pl.Float64,
                                     "lambda_best": pl.Float64, "achieved": pl.Float64})
    ui.plot(charts_run.export_lambda_chart(per), key="ex_lambda")
    with st.expander("blasst.json"):
        st.json({k: v for k, v in doc.items() if k != "targets"})


def render() -> None:
    root = ui.header("Export", "The files kernels and serving engines read; formats in the README's "
                     "\"Fit and export\".")
    with ui.section():
        d = _directory(root)
        st.caption(f"Export directory: `{d}`")
        _downloads(d)
        with ui.section():
            _bsfa(d)
        with ui.section():
            _blasst(d)


render()
