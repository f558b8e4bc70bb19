"""Overview: the run's model, geometry and statistics config, its prompts (task, length, answer)
and samples, the package versions that captured it, and what its fit holds.
Control: task filter of the prompt table and chart."""
from __future__ import annotations

import polars as pl
import streamlit as st

from sparsecal.dashboard import charts_run, data, derive, ui


def _model(man: dict, n_done: int | None) -> None:
    m, cfg = man["model"], man["config"]
    st.markdown(f"**Model** `{m['id']}` ({m.get('model_type', '?')}), {man.get('dtype', '?')} on the "
                f"{man.get('backend', '?')} backend")
    lengths = sorted({int(s.get("length", 0)) for s in man.get("samples", [])})
    cols = st.columns(5)
    cols[0].metric("layers x heads", f"{m['num_layers']} x {m['num_heads']}",
                   help=f"{m.get('num_kv_heads', '?')} KV heads, head_dim {m.get('head_dim', '?')}")
    cols[1].metric("KV heads", str(m.get("num_kv_heads", "?")))
    cols[2].metric("blocks BM x BN", f"{cfg['block_m']} x {cfg['block_n']}")
    planned = len(man.get("samples", []))
    if n_done is None:
        cols[3].metric("samples", f"{planned} (not here)", help="captured, but their statistics are not in this "
                       "directory (a committed calibration keeps its manifest, fit and export only)")
    else:
        cols[3].metric("samples", f"{n_done} / {planned}", help="finished / planned")
    cols[4].metric("lengths", f"{lengths[0]:,}-{lengths[-1]:,}" if lengths else "-", help=", ".join(map(str, lengths)))
    st.caption(f"k values {', '.join(map(str, cfg['k_values']))}; scan orders {', '.join(cfg['orders'])}; "
               f"gap bins every {cfg['gap_step']} on [{cfg['gap_lo']}, 0]; decode rows {cfg.get('decode_rows')}; "
               f"raw tiles {'yes' if cfg.get('raw') else 'no'}; max context {m.get('max_context')}; "
               f"created {man.get('created', '?')}, updated {man.get('updated', '?')}")
    _layers(man)


def _layers(man: dict) -> None:
    """The layer kinds of a hybrid model (or a --layers capture): which layers were captured, and why not."""
    from sparsecal.formats.run import captured_layers

    types, notes = man["model"].get("layer_types"), man.get("layer_notes", {})
    if not types or (len(set(types)) < 2 and not notes):
        return
    ui.plot(charts_run.layer_map_chart(types, captured_layers(man), notes), key="ov_layers")
    reasons: dict[str, list[str]] = {}
    for i, why in notes.items():
        reasons.setdefault(why, []).append(i)
    st.caption("Captured: full-attention layers; statistics, fits and exports cover only them. " +
               " ".join(f"Layers {', '.join(ids)}: {why}." for why, ids in reasons.items()))


def _prompts(prompts: pl.DataFrame) -> None:
    tasks = sorted(set(prompts["task"]))
    chosen = ui.choose_many("Tasks", tasks, key="ov_tasks")
    shown = prompts.filter(pl.col("task").is_in(chosen))
    ui.plot(charts_run.samples_chart(shown), key="ov_samples")
    st.dataframe(shown.select("task", "length", "answer", "finished", "raw", "seconds", "id", "seed"),
                 hide_index=True, height=min(400, 36 + 35 * max(shown.height, 1)))


def _fit(doc: dict) -> None:
    st.subheader("Fit")
    req = doc["request"]
    st.markdown(f"Fitted {doc.get('created', '?')}: k {', '.join(map(str, doc['k_values']))}, BLASST targets "
                f"{', '.join(f'{t:g}' for t in req['targets'])} ({req['order']} order exported), "
                f"{req['aggregation']} aggregation, validation **{doc['validation']}** on "
                f"{len(doc['split']['test']) or len(doc['split']['train'])} samples "
                f"({len(doc['split']['train'])} calibration), lengths {', '.join(map(str, doc['lengths']))}.")
    for w in doc.get("warnings", []):
        st.warning(w, icon=":material/warning:")


def _absent(root) -> bool:
    """A run whose samples folder is not there at all although it planned samples: a committed
    calibration (manifest, fit and export only), not a capture that has not started."""
    from pathlib import Path

    return not (Path(root) / "samples").exists() and (Path(root) / data.FIT / "fit.json").is_file()


def _fitted(root, prompts: pl.DataFrame) -> pl.DataFrame:
    """``finished`` as 'used by the fit' for a run whose samples are not committed."""
    split = data.fit_doc(root).get("split", {})
    used = [str(x) for part in ("train", "test") for x in split.get(part, [])]
    return prompts.with_columns(pl.col("id").is_in(used).alias("finished"))


def render() -> None:
    root = ui.header("Overview", "What was captured, on which model, with which settings.")
    with ui.section():
        man = data.manifest(root)
        recs = data.samples(root)
        absent = _absent(root)
        _model(man, None if absent else len(recs))
        data.show_damaged(root)
        if absent:
            st.info("This run's samples are not in this directory (a committed calibration keeps its manifest, fit "
                    "and export only): the pages that read samples (Tiles) have nothing to show; the prompts below "
                    "count as finished where the fit used them. Its README.md has the command that captures them.",
                    icon=":material/info:")
        st.subheader("Prompts")
        prompts = derive.prompts_frame(man, recs)
        _prompts(_fitted(root, prompts) if absent else prompts)
        with st.expander("Versions that captured the run"):
            st.json(man.get("versions", {}))
    with ui.section():
        _fit(data.fit_doc(root))


render()
