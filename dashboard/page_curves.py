"""Accuracy-speedup: accuracy relative to dense against speedup over dense, per method and length,
from the evaluation and benchmark result files of RUN/results/ and `--results DIR` (format in
toolkit/formats/results.py). Until such files exist the page says which commands make them.
Controls: the result directory and the split (seen / held-out task families) where there are
several, methods and lengths shown, and, where `sparsecal eval --time` timed the points themselves,
whether the x axis is each point's own TTFT or TPOT speedup, eager or replayed as a CUDA graph
(with its 95% interval from the timing rounds as a horizontal error bar where it has one)."""
from __future__ import annotations

import polars as pl
import streamlit as st

from sparsecal.dashboard import charts_run, data, ui
from sparsecal.formats import results
from sparsecal.formats.errors import UserError

# the x axis when the points carry their own timings: prefill (TTFT) or decode (TPOT) speedup
SPEEDS = {"TTFT (prefill)": "speedup_ttft", "TPOT (decode)": "speedup_tpot",
          "TTFT, CUDA graph (device time)": "speedup_ttft_graph", "TPOT, CUDA graph (device time)": "speedup_tpot_graph"}


def _load(dirs) -> tuple[pl.DataFrame, list[str]]:
    frames, problems = [], []
    for path in results.result_files(dirs):
        try:
            frames.append(results.read_result_file(path))
        except UserError as e:
            problems.append(str(e))
    return results.curves(frames), problems


def _one_evaluation(pts: pl.DataFrame) -> pl.DataFrame:
    """The points of one result directory and one split (seen / held-out task families), chosen
    where there are several: points of two evaluations or splits are never drawn as one."""
    origins = sorted(o for o in set(pts["origin"]) if o is not None)
    if len(origins) > 1:
        origin = ui.choose("Evaluation (result directory)", origins, key="cu_origin", default=origins[-1])
        pts = pts.filter(pl.col("origin") == origin)
    splits = sorted((s for s in set(pts["split"]) if s is not None), reverse=True)  # seen first
    if splits:
        split = ui.choose("Task families", splits, key="cu_split", help="seen: captured by the calibration; "
                          "held-out: never captured")
        pts = pts.filter(pl.col("split") == split)
    return pts


def render() -> None:
    root = ui.header("Accuracy-speedup", "What the thresholds cost in accuracy and gain in speed, from "
                     "evaluation and benchmark result files.")
    dirs = data.result_dirs(root)
    pts, problems = _load(dirs)
    for p in problems:
        st.error(p, icon=":material/error:")
    if not pts.height:
        st.info("No evaluation or benchmark results yet. They are made by " + results.PRODUCERS +
                "; the dashboard reads `*.parquet` and `*.json` result files from "
                + ", ".join(f"`{d}`" for d in dirs) + " (add directories with `sparsecal dashboard RUN --results DIR`).",
                icon=":material/hourglass_empty:")
        return
    pts = _one_evaluation(pts)
    c1, c2 = st.columns(2)
    methods = ui.choose_many("Methods", sorted(set(pts["method"])), key="cu_methods", where=c1)
    lengths = ui.choose_many("Lengths", sorted(set(pts["length"])), key="cu_lengths", where=c2, fmt=ui.fmt_len)
    shown = pts.filter(pl.col("method").is_in(methods) & pl.col("length").is_in(lengths))
    timed = [k for k, c in SPEEDS.items() if shown[c].is_not_null().any()]
    of = None
    if "TPOT (decode)" in timed:  # timed by `sparsecal eval --time`: each point's own speed
        of = SPEEDS[ui.choose("Speedup of", timed, key="cu_speed")]
        shown = shown.with_columns(pl.col(of).alias("speedup"))
    # the interval of the point's own timed speed (the default speedup is its own TTFT where timed)
    own = pl.col("speedup") == pl.col(of or "speedup_ttft")
    shown = shown.with_columns(*[pl.when(own).then(pl.col(f"{of or 'speedup_ttft'}_{e}")).alias(f"speedup_{e}")
                                 for e in ("lo", "hi")])
    ui.plot(charts_run.accuracy_speedup(shown), key="cu_chart")
    st.dataframe(shown, hide_index=True)


render()
