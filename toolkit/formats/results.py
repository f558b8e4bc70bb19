"""Accuracy-speedup result files: the format the dashboard reads, and reading it.

This module fixes what the dashboard expects from `sparsecal eval` (EVAL/results.json, and
EVAL/curves.parquet once bench files are joined) and `sparsecal bench`.

Where: every ``*.parquet`` and ``*.json`` file directly in RUN/results/ and in each directory given
with ``sparsecal dashboard --results DIR`` (environment variable SPARSECAL_RESULTS).

A file holds rows, one per measured point. Parquet: the rows are the table. JSON: an object
``{"kind": "sparsecal-eval" | "sparsecal-bench", "rows": [...], "provenance": {...}}`` (the
provenance of toolkit/formats/provenance.py: GPU, versions, commit, date).

Row columns (the ones marked * are required, plus at least one of the two measures):

    method *             str    "dense", "bsfa", "blasst", ...
    config *             str    the operating point, e.g. "k=16" or "target=0.5"
    length *             int    prompt length in tokens
    accuracy_rel_dense   float  task accuracy (or fidelity) divided by the dense model's, 1 = no loss
    speedup              float  dense time / sparse time, same inputs, same run (kernel or TTFT)
    sparsity             float  achieved sparsity counted in-kernel (optional)
    decode_sparsity      float  the same for decode steps (optional)
    accuracy_rel_dense_lo, accuracy_rel_dense_hi
                         float  the 95% interval of accuracy_rel_dense (optional; `sparsecal eval`
                                writes a paired bootstrap interval, drawn as error bars)
    speedup_ttft, speedup_tpot
                         float  the point's own time-to-first-token and time-per-output-token
                                speedup against the best SDPA, timed on the evaluated configuration
                                (`sparsecal eval --time`; optional; ``speedup`` is the TTFT one)
    speedup_ttft_graph, speedup_tpot_graph
                         float  the same replayed as CUDA graphs (device time; optional)
    speedup_ttft_lo, speedup_ttft_hi (and _tpot, _ttft_graph, _tpot_graph)
                         float  the 95% interval of each of those speedups (optional; `sparsecal
                                eval` writes an exact distribution-free one from its timing rounds)
    task                 str    evaluation task (optional; accuracies are averaged over tasks)
    metric               str    what accuracy measures, e.g. "accuracy", "top1", "kl" (optional)

    split                str    "seen" | "held-out": task families the calibration captured or not
                                (optional; `sparsecal eval` writes it where it knows the split)

Evaluation files usually carry accuracy_rel_dense and benchmark files speedup; ``curves`` averages
each measure over the rows sharing (method, config, length, split) within one directory (the
point's ``origin``), so an eval row and a bench row of the same point in one directory meet, and
two evaluations in different directories are never averaged together. A point appears on the
chart when it has both measures. The values are checked when read (``check_values``: finite,
speedups > 0, relative accuracies >= 0, sparsities in [0, 1], lengths >= 1, lo <= hi): a file
that breaks one is refused with one line.
"""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from sparsecal.formats.errors import UserError
from sparsecal.formats.table_values import check_ranges

KEYS = ("method", "config", "length")
POINT = KEYS + ("origin", "split")  # a chart point: one directory's rows of one split
MEASURES = ("accuracy_rel_dense", "speedup")
SPEEDS = ("speedup_ttft", "speedup_ttft_graph", "speedup_tpot", "speedup_tpot_graph")   # a point's own timed speeds
SPEED_INTERVALS = tuple(f"{s}_{e}" for s in SPEEDS for e in ("lo", "hi"))            # their 95% intervals
OPTIONAL = ("sparsity", "decode_sparsity", "accuracy_rel_dense_lo", "accuracy_rel_dense_hi", *SPEEDS,
            *SPEED_INTERVALS)
KINDS = ("sparsecal-eval", "sparsecal-bench")
PRODUCERS = ("`sparsecal eval EXPORT --out DIR` (accuracy relative to dense; `--bench FILE` joins speedups "
             "into DIR/curves.parquet) and `sparsecal bench --smollm2` on a GPU (speedup rows, "
             "data/bench/sparse-smollm2-*-rows.json)")


def result_files(dirs) -> list[Path]:
    """Result files directly inside ``dirs`` (missing directories are skipped), sorted."""
    out = []
    for d in dirs:
        d = Path(d)
        if d.is_dir():
            out.extend(sorted(p for p in d.iterdir() if p.suffix in (".parquet", ".json") and p.is_file()))
    return out


def read_result_file(path: Path) -> pl.DataFrame:
    """One result file as rows with KEYS, the measures it has, and ``source`` (its file name)."""
    path = Path(path)
    try:
        if path.suffix == ".parquet":
            df = pl.read_parquet(path)
        else:
            doc = json.loads(path.read_text())
            if not isinstance(doc, dict) or doc.get("kind") not in KINDS or not isinstance(doc.get("rows"), list):
                raise UserError(f"{path} is not a result file: expected {{\"kind\": one of {', '.join(KINDS)}, "
                                "\"rows\": [...]}.")
            df = pl.DataFrame(doc["rows"], infer_schema_length=None)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - an unreadable file is one line on the page
        raise UserError(f"{path} is not a readable result file ({type(e).__name__}).") from None
    lacking = [c for c in KEYS if c not in df.columns]
    if lacking or not any(m in df.columns for m in MEASURES):
        raise UserError(f"{path} lacks columns {', '.join(lacking) or ' or '.join(MEASURES)}; see the "
                        "Accuracy-speedup format in toolkit/formats/results.py.")
    keep = [c for c in KEYS + MEASURES + OPTIONAL if c in df.columns]
    check_values(df.select(keep), str(path))
    split = pl.col("split").cast(pl.Utf8) if "split" in df.columns else pl.lit(None, pl.Utf8)
    return df.select(keep + (["split"] if "split" in df.columns else [])).with_columns(
        pl.col("method").cast(pl.Utf8), pl.col("config").cast(pl.Utf8), pl.col("length").cast(pl.Int64),
        pl.lit(path.name).alias("source"), pl.lit(path.parent.name).alias("origin"), split.alias("split"))


RANGES = {"sparsity": (0.0, 1.0), "decode_sparsity": (0.0, 1.0), "length": (1.0, None)}


def _rule(col: str) -> tuple:
    """(col, lo, hi[, strict]) of check_ranges: speedups (and their interval ends) above 0, the
    relative accuracy at least 0 (its interval ends only finite: a paired interval of a ratio near 0
    may reach below it), RANGES, else finite."""
    if col.startswith("speedup"):
        return col, 0.0, None, True
    if col == "accuracy_rel_dense":
        return col, 0.0, None
    return (col, *RANGES.get(col, (None, None)))


def check_values(df: pl.DataFrame, where: str) -> None:
    """The values themselves: every measure numeric and finite where present, speedups above 0,
    accuracies at least 0, sparsities in [0, 1], lengths >= 1, each interval's lo <= hi. A file
    (``where``: its name in the message) that breaks one is refused with one line naming the
    column, the first bad row and its value."""
    redo = "Re-run its producer or remove the file."
    cols = [c for c in df.columns if c not in ("method", "config")]
    for col in cols:   # text where a number belongs (a numeric column stored as strings casts strictly)
        try:
            df = df.with_columns(df[col].cast(pl.Float64, strict=True).alias(col))
        except Exception:  # noqa: BLE001 - a text or nested column where a number belongs
            raise UserError(f"{where}: column {col} is not numeric ({df[col].dtype}); {redo}") from None
    check_ranges(df, where, [_rule(c) for c in cols], redo)
    for col in cols:
        if col.endswith("_lo") and col[:-3] + "_hi" in df.columns:
            flip = (df[col] > df[col[:-3] + "_hi"]).fill_null(False)
            if flip.any():
                i = int(flip.arg_true()[0])
                raise UserError(f"{where}: row {i} has {col} {df[col][i]} above {col[:-3]}_hi "
                                f"{df[col[:-3] + '_hi'][i]}; {redo}")


def curves(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """Points of the accuracy-speedup chart: per (method, config, length, origin, split) the mean of
    each measure over the rows of that directory and split. Columns: POINT, accuracy_rel_dense,
    speedup, OPTIONAL (null when no file has it), sources (files that contributed, comma-separated). Empty frames give no rows.
    An evaluation writes one row per point (its interval belongs to that row); when several files
    give one point an interval, the mean of their ends is shown."""
    cols = {"method": pl.Utf8, "config": pl.Utf8, "length": pl.Int64, "origin": pl.Utf8, "split": pl.Utf8}
    num = {c: pl.Float64 for c in MEASURES + OPTIONAL}
    frames = [f.with_columns([pl.col(c).cast(pl.Float64) for c in MEASURES + OPTIONAL if c in f.columns])
              for f in frames if f.height]
    if not frames:
        return pl.DataFrame(schema={**cols, **num, "sources": pl.Utf8})
    frames = [f.with_columns([pl.lit(None, pl.Utf8).alias(c) for c in ("origin", "split") if c not in f.columns])
              for f in frames]
    full = pl.concat([f.with_columns([pl.lit(None, pl.Float64).alias(c) for c in num if c not in f.columns])
                      .select(list(cols) + list(num) + ["source"]) for f in frames], how="vertical_relaxed")
    agg = full.group_by(list(POINT)).agg(
        *[pl.col(c).mean() for c in num],
        pl.col("source").unique().sort().str.join(", ").alias("sources"))
    return agg.sort(list(POINT), nulls_last=True)
