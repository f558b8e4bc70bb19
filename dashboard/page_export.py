"""Export: download the threshold files (thresholds.bsfa.pt, thresholds.safetensors, blasst.json)
with their metadata, look at what they hold, copy the serving engines' files (``sparsecal export
--format``), see the layers left dense and why, the engines' rule simulated per length, and the
dispatch plan (``sparsecal export --break-even``: which layers run the sparse prefill kernel at
which lengths, SDPA elsewhere). Controls: export directory, k and layer of the thresholds heatmap,
BLASST target, dispatch config."""
from __future__ import annotations

from pathlib import Path

import polars as pl
import streamlit as st

from sparsecal.dashboard import charts_dispatch, charts_run, charts_verify, data, derive, ui
from sparsecal.formats import engine_files as F
from sparsecal.formats.errors import UserError
from sparsecal.formats.verify import load_verify

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


LANGUAGE = {"modelopt": "json", "trtllm": "yaml", "sglang": "bash", "vllm": "bash"}
SIM_COLUMNS = {"factors": pl.Utf8, "mode": pl.Utf8, "length": pl.Int64, "samples": pl.Int64, "factor": pl.Float64,
               "lambda": pl.Float64, "target": pl.Float64, "achieved": pl.Float64, "achieved_min": pl.Float64,
               "achieved_max": pl.Float64, "achieved_sparse_layers": pl.Float64, "retained_mass": pl.Float64}


@st.cache_data(show_spinner=False, max_entries=16)
def _engine(export_dir: str, stamp) -> dict:
    """engine.json and the text of every engine file it lists, each read through its checked loader."""
    d = Path(export_dir)
    try:
        man = F.load_engine_manifest(d)
        files = {}
        for fmt, entry in man["formats"].items():
            if fmt in F.LOADERS:
                F.LOADERS[fmt](d)
            files[fmt] = (entry["file"], (d / entry["file"]).read_text())
    except UserError as e:
        raise data.Broken(str(e)) from None
    return {"manifest": man, "files": files}


def _engines(d: Path) -> None:
    """Each engine file ready to copy, with what it was calibrated on."""
    path = Path(d) / F.ENGINE_JSON
    if not path.is_file():
        raise data.Missing(f"{d} has no serving-engine files; write them with `sparsecal export RUN --out {d} "
                           "--format all` from a run captured at the engine's tiles (`sparsecal capture --engine ...`).")
    found = _engine(str(d), (path.stat().st_mtime_ns, path.stat().st_size))
    geo = found["manifest"]["geometry"]
    st.markdown(f"**Serving engines**: calibrated on {geo['block_m']} x {geo['block_n']} tiles (log base "
                f"{geo['log_base']}; {geo['score_scale']}); lambda = factor / kv_len.")
    for fmt, (name, text) in found["files"].items():
        tiles = found["manifest"]["formats"][fmt]["tiles"]
        st.caption(f"`{name}`: {tiles['engine']} ({tiles['kernel']}), {tiles['block_m']} x {tiles['block_n']} tiles, "
                   f"log base {tiles['log_base']}")
        st.code(text, language=LANGUAGE.get(fmt, "text"))


def _layers_and_simulation(d: Path) -> None:
    """The layers left dense with the reason, and achieved vs target sparsity per length."""
    doc = data.export_blasst(d)
    ignored = doc.get("ignored_layers", {})
    st.markdown(f"**Layers left dense** ({len(ignored)} of {doc['num_layers']}): not captured by the run, or "
                "skipping does not pay there.")
    if ignored:
        st.dataframe(pl.DataFrame({"layer": [int(k) for k in ignored], "why": list(ignored.values())}),
                     hide_index=True)
    rows = doc.get("simulation") or []
    st.markdown("**Simulated sparsity** of the engines' rule (lambda = factor / L on the run's own tiles) over the "
                f"{doc.get('validation')} samples: what the engine will skip, per length.")
    if not rows:
        st.info("This export holds no simulation (made by an older sparsecal, or without the run's samples); "
                "export it again with `sparsecal export`.", icon=":material/info:")
        return
    st.dataframe(pl.DataFrame([{k: r.get(k) for k in SIM_COLUMNS} for r in rows], schema=SIM_COLUMNS),
                 hide_index=True)


def _dispatch(d: Path) -> None:
    """The dispatch plan per config (layer x length heatmap) and its summary, or one line when the
    export has none."""
    rec = data.export_blasst(d).get("dispatch")
    if not rec:
        st.info("This export has no dispatch record: every exported layer runs sparse at every length. Measure "
                "the break-even on the serving GPU with `sparsecal bench break-even --run RUN --out FILE` and "
                "export with `--break-even FILE`.", icon=":material/info:")
        return
    src = rec["break_even_file"]
    st.markdown(f"**Dispatch** (break-even measured on {src.get('gpu')}, commit `{src.get('commit')}`, "
                f"{src.get('date')}; margin {rec['margin']:g}): a layer runs the sparse prefill kernel at a length "
                "bucket where its calibrated sparsity reaches the break-even there, SDPA elsewhere; a prefill of N "
                "tokens takes the bucket of the largest calibrated length <= N (below the shortest: SDPA).")
    if not rec["configs"]:
        st.info("The break-even file had rows for none of the exported methods: no config is dispatched.")
        return
    st.dataframe(charts_dispatch.dispatch_table(rec), hide_index=True)
    names = [f"{e['method']} {e['config']}" for e in rec["configs"]]
    pick = ui.choose("Dispatch config", names, key="ex_dispatch")
    ui.plot(charts_dispatch.dispatch_heatmap(rec["configs"][names.index(pick)], rec["lengths"]), key="ex_disp_map")


VERIFY_COLUMNS = ("phase", "target", "length", "samples", "lambda", "predicted", "measured_dense", "error",
                  "measured_masks", "drift", "diagonal")


def _verify(d: Path) -> None:
    """``sparsecal verify``: the consumer's own code run on the export, predicted vs measured."""
    try:
        doc = load_verify(d)
    except UserError as e:
        raise data.Broken(str(e)) from None
    if doc is None:
        st.info(f"Not verified by a consumer yet: `sparsecal verify {d}` runs this export through "
                "Model-Optimizer's own loader and skip-softmax and measures what it skips.", icon=":material/info:")
        return
    st.markdown(f"**Verified by {doc.get('consumer')}** ({doc.get('device')}, {len(doc.get('samples', []))} "
                "samples): predicted = sparsecal's simulation of the consumer's rule on the samples' statistics; "
                "measured = the consumer's own decisions on the same tokens, counted exactly, with no mask applied "
                "(dense statistics) and with each layer's mask applied (drift = masks - dense).")
    rows = doc["rows"]
    st.dataframe(pl.DataFrame([{k: r.get(k) for k in VERIFY_COLUMNS} for r in rows]), hide_index=True)
    ui.plot(charts_verify.verify_chart(rows), key="ex_verify")


def render() -> None:
    root = ui.header("Export", "The files kernels and serving engines read; formats in docs/formats.md.")
    with ui.section():
        d = _directory(root)
        st.caption(f"Export directory: `{d}`")
        _downloads(d)
        with ui.section():
            _bsfa(d)
        with ui.section():
            _blasst(d)
        with ui.section():
            _layers_and_simulation(d)
        with ui.section():
            _dispatch(d)
        with ui.section():
            _engines(d)
        with ui.section():
            _verify(d)


render()
