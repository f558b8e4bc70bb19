"""From per-sample rows to the summary, the dashboard's result rows, and the curves table that joins
accuracy to `sparsecal bench` speedups.

Summary: one row per (method, config, length, task) with every metric averaged over samples,
dense's values beside them, and the headline ``accuracy_rel_dense`` with its ``metric``:

    answer tasks (niah_*, vt, cwe)   metric "accuracy": mean score / dense's mean score
                                     (null when dense's mean score is below MIN_DENSE_SCORE: a
                                     task the dense model cannot do says nothing about sparsity,
                                     and a ratio of tiny scores is noise: SmolLM2 scores 0.02 on
                                     cwe at 8K, so one lucky sample reads as 0.75 or 1.5)
    text, text_stdlib                metric "ppl": dense perplexity / the method's (1 = no loss)

Every cell carries the statistics of evaluation/intervals.py: 95% intervals of accuracy,
accuracy_diff, accuracy_rel_dense, ppl_ratio, top-1, KL and ``answer_ll_delta`` (the teacher-forced
log-likelihood of the right answer relative to dense's: a low-noise companion of the score), the
exact paired test against dense (``p_dense``) and against the rounding floor dense:fp32
(``p_floor``, ``distinguishable``), and the minimum detectable difference ``mdd``. With a ``split``
column (seen / held-out task families) a cell is (length, task, split) and a point (method, length,
split).

Curves: per (method, config, length) one configuration: the headline averaged over tasks with its
interval, achieved prefill and decode sparsity, top-1 agreement and KL, joined to its own speed
from the timing phase (evaluation/timing.py: TTFT and TPOT speedups of the same sparsify call,
kept only where the timed counts match the evaluated ones) and to the bench rows of the same
configuration (``bench_speedup_kernel``, ``bench_speedup_ttft``), which join only where method,
config (dispatch included), length and sparsity (within BENCH_SPARSITY_TOL) match: any other
bench row is refused (``check_bench``). ``speedup``: own TTFT, else the bench's kernel, else its TTFT.
"""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from sparsecal.capture.prompts.tasks import TEXT_TASKS
from sparsecal.evaluation.intervals import MIN_DENSE_SCORE, POINT_STATS, cell_keys, cells, with_split
from sparsecal.evaluation.paired import mover
from sparsecal.formats.errors import UserError
from sparsecal.formats.results import SPEED_INTERVALS, SPEEDS, check_values

KEYS = ["method", "config", "length"]
BENCH_SPARSITY_TOL = 0.02  # a bench row joins a point only within this counted sparsity
BENCH_KIND = "sparsecal-bench"


def _answer_ll(df: pl.DataFrame) -> pl.DataFrame:
    """answer_ll_delta per row: its answer log-likelihood minus dense's on the same sample (null
    for rows written before the teacher-forced answer was measured)."""
    if "answer_logprob" not in df.columns:
        return df.with_columns(pl.lit(None, pl.Float64).alias("answer_ll_delta"))
    dense = df.filter(pl.col("label") == "dense").select("sample_id", pl.col("answer_logprob").alias("_ll_dense"))
    return df.join(dense, on="sample_id", how="left").with_columns(
        (pl.col("answer_logprob") - pl.col("_ll_dense")).alias("answer_ll_delta")).drop("_ll_dense")


def summarize(rows: list[dict], ci: tuple | None = None) -> pl.DataFrame:
    """Per (method, config, label, length, task[, split]) means of the row metrics, with dense's
    beside, and the statistics of intervals.cells (``ci``: cells(rows), computed when not given):
    every interval, accuracy_diff, ppl_ratio, the exact tests, ``distinguishable`` and ``mdd``."""
    df = with_split(_answer_ll(pl.DataFrame(rows, infer_schema_length=None)))
    cell = cell_keys(df.columns)
    agg = df.group_by(KEYS + ["label"] + cell[2:] + ["task"]).agg(
        pl.len().alias("samples"), pl.col("score").mean().alias("accuracy"),
        pl.col("correct").cast(pl.Float64).mean().alias("correct"), pl.col("kl").mean(),
        pl.col("top1").mean(), pl.col("nll").mean().exp().alias("ppl"),
        pl.col("sparsity").mean(), pl.col("decode_sparsity").mean(), pl.col("answer_ll_delta").mean(),
        pl.col("prefill_s").mean(), pl.col("decode_s").mean(), pl.col("held_out_task").first())
    dense = agg.filter(pl.col("label") == "dense").select(
        *cell, pl.col("accuracy").alias("accuracy_dense"), pl.col("ppl").alias("ppl_dense"))
    out = agg.join(dense, on=cell, how="left", nulls_equal=True).join(
        (ci or cells(rows))[0], on=["label"] + cell, how="left", nulls_equal=True)  # split may be null
    text = pl.col("task").is_in(TEXT_TASKS)
    rel = (pl.when(text).then(pl.col("ppl_dense") / pl.col("ppl"))
           .when(pl.col("accuracy_dense") >= MIN_DENSE_SCORE).then(pl.col("accuracy") / pl.col("accuracy_dense"))
           .otherwise(None))
    return out.with_columns(rel.alias("accuracy_rel_dense"),
                            pl.when(text).then(pl.lit("ppl")).otherwise(pl.lit("accuracy")).alias("metric")
                            ).sort(["length", "task"] + cell[2:] + ["method", "config"])


def _point_keys(frame: pl.DataFrame) -> list[str]:
    return ["split"] if "split" in frame.columns else []


def points(summary: pl.DataFrame, ci: tuple) -> pl.DataFrame:
    """Per (method, config, label, length[, split]): prefill and decode sparsity averaged over
    tasks, the tasks where accuracy_rel_dense is defined, and from intervals.cells each of
    accuracy_rel_dense, ppl_ratio, answer_ll_delta, top1 and kl averaged over the tasks that define
    it with its MOVER interval, ``distinguishable`` (any task distinguishable from dense:fp32) and
    ``distinguishable_tasks``."""
    split = _point_keys(summary)
    acc = summary.group_by(KEYS + ["label"] + split).agg(
        pl.col("sparsity").mean(), pl.col("decode_sparsity").mean(),
        pl.col("task").filter(pl.col("accuracy_rel_dense").is_not_null()).sort().str.join(",").alias("tasks"))
    return acc.join(ci[1].drop("tasks"), on=["label", "length"] + split, how="left", nulls_equal=True).sort(KEYS + split)


POINT_COLUMNS = [c for s in POINT_STATS for c in (s, f"{s}_lo", f"{s}_hi")]


def result_rows(summary: pl.DataFrame, ci: tuple) -> list[dict]:
    """The dashboard's Accuracy-speedup rows (toolkit/formats/results.py): one per (method,
    config, length[, split]), the relative accuracy averaged over tasks with its 95% interval
    (the headline the page plots), and beside it the continuous metrics with their intervals."""
    split = _point_keys(summary)
    cols = KEYS + split + ["label"] + POINT_COLUMNS + ["sparsity", "decode_sparsity", "distinguishable",
                                                       "distinguishable_tasks", "tasks"]
    return points(summary, ci).select(cols).rename({"tasks": "task"}).to_dicts()


def read_bench(paths) -> tuple[pl.DataFrame, list[dict]]:
    """Bench rows (method, config, length, speedup[, sparsity, task, dispatch]) and each file's
    provenance. A row with ``dispatch`` true measured the export's dispatch record: its config is
    that of the evaluated ``+dispatch`` method (``k=32 dispatch``)."""
    frames, prov = [], []
    for path in map(Path, paths):
        df, doc = _bench_table(path)
        lacking = [c for c in KEYS + ["speedup"] if c not in df.columns]
        if lacking:
            raise UserError(f"--bench {path} lacks columns {', '.join(lacking)}; it should be written by `sparsecal bench`.")
        check_values(df.select([c for c in ("length", "speedup", "sparsity") if c in df.columns]), f"--bench {path}")
        kind = pl.col("task").fill_null("kernel") if "task" in df.columns else pl.lit("kernel")
        sp = pl.col("sparsity").cast(pl.Float64) if "sparsity" in df.columns else pl.lit(None, pl.Float64)
        disp = pl.col("dispatch").cast(pl.Boolean).fill_null(False) if "dispatch" in df.columns else pl.lit(False)
        config = pl.when(disp & ~pl.col("config").cast(pl.Utf8).str.ends_with(" dispatch")).then(
            pl.col("config").cast(pl.Utf8) + " dispatch").otherwise(pl.col("config").cast(pl.Utf8))
        frames.append(df.select(pl.col("method").cast(pl.Utf8), config.alias("config"),
                                pl.col("length").cast(pl.Int64), pl.col("speedup").cast(pl.Float64),
                                sp.alias("bench_sparsity"), kind.cast(pl.Utf8).alias("kind"),
                                pl.lit(path.name).alias("source")))
        prov.append({"file": str(path), "provenance": doc.get("provenance")})
    return pl.concat(frames) if frames else pl.DataFrame(), prov


def _bench_table(path: Path) -> tuple[pl.DataFrame, dict]:
    """A bench file's rows and its JSON document ({} for Parquet); any unreadable file is one line."""
    try:
        if path.suffix == ".parquet":
            return pl.read_parquet(path), {}
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("kind") != BENCH_KIND or not isinstance(doc.get("rows"), list):
            raise UserError(f"--bench {path} is not a `sparsecal bench` result "
                            f"(expected {{\"kind\": \"{BENCH_KIND}\", \"rows\": [...]}}).")
        return pl.DataFrame(doc["rows"], infer_schema_length=None), doc
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line
        raise UserError(f"--bench {path} is not readable ({type(e).__name__}: {e}).") from None


SPEED = [*SPEEDS, "ideal_ttft", "ideal_tpot", "attention_share",
         "attention_share_decode", "timed_sparsity", "timed_decode_sparsity", "sparse_layers", "sparsity_match",
         "decode_sparsity_match", "speed_device"]


def _col(frame: pl.DataFrame, name: str) -> pl.Expr:
    """A column, or nulls where an older timing file lacks it."""
    return pl.col(name) if name in frame.columns else pl.lit(None, pl.Float64)


def own_speed(timing: pl.DataFrame) -> pl.DataFrame:
    """Per (label, length) the timing phase's speed of that very configuration (timing.py): TTFT
    speedups (and their intervals) kept only where the timed prefill sparsity matched the evaluated
    one, TPOT where the decode sparsity did (a --speed-only evaluation has nothing to match: kept)."""
    ok = lambda c: pl.col(c).fill_null(True)  # null: no rows to compare with
    return timing.select(
        "label", "length",
        *[pl.when(ok("sparsity_match" if "ttft" in c else "decode_sparsity_match")).then(_col(timing, c)).alias(c)
          for c in (*SPEEDS, *SPEED_INTERVALS)],
        "ideal_ttft", "ideal_tpot", "attention_share", "attention_share_decode",
        pl.col("sparsity").alias("timed_sparsity"), pl.col("decode_sparsity").alias("timed_decode_sparsity"),
        "sparse_layers", "sparsity_match", "decode_sparsity_match", "speed_device")


def curves(summary: pl.DataFrame | None, bench: pl.DataFrame, ci: tuple | None,
           timing: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per (method, config, length) one configuration: its accuracy (``points``; null without
    rows), its own speed from the timing phase (``own_speed``) and the bench rows of the same
    configuration (``bench_speedup_kernel``, ``bench_speedup_ttft``; ``check_bench`` has refused any
    that does not match). ``speedup``: the point's own TTFT speedup, else the bench's kernel, else
    its TTFT."""
    acc = points(summary, ci) if summary is not None else timing.select(*KEYS, "label", pl.col("sparsity"),
                                                                        pl.col("decode_sparsity"))
    out = acc
    if timing is not None and timing.height:
        out = out.join(own_speed(timing), on=["label", "length"], how="left")
    else:
        out = out.with_columns(*[pl.lit(None, pl.Float64).alias(c) for c in ("speedup_ttft", "speedup_tpot")])
    if bench.height:
        speed = bench.group_by(KEYS).agg(
            pl.col("speedup").filter(pl.col("kind") == "kernel").mean().alias("bench_speedup_kernel"),
            pl.col("speedup").filter(pl.col("kind") == "ttft").mean().alias("bench_speedup_ttft"),
            pl.col("bench_sparsity").mean(), pl.col("source").unique().sort().str.join(",").alias("bench_sources"))
        out = out.join(speed, on=KEYS, how="left")
    else:
        out = out.with_columns(pl.lit(None, pl.Float64).alias("bench_speedup_kernel"),
                               pl.lit(None, pl.Float64).alias("bench_speedup_ttft"))
    return out.with_columns(pl.coalesce("speedup_ttft", "bench_speedup_kernel", "bench_speedup_ttft")
                            .alias("speedup"), pl.lit(summary is not None).alias("accuracy_meaningful")).sort(KEYS)


def unmatched_bench(bench: pl.DataFrame, points_: pl.DataFrame) -> list[str]:
    """Bench rows that no evaluated configuration matches: no (method, config, length) point, no
    recorded sparsity, or a sparsity more than BENCH_SPARSITY_TOL from the point's (``points_``:
    the evaluated points, with ``sparsity``)."""
    if not bench.height:
        return []
    j = bench.join(points_.select(*KEYS, pl.col("sparsity").alias("_eval_sparsity")), on=KEYS, how="left")
    out = []
    for r in j.sort(KEYS).to_dicts():
        at = f"{r['method']} {r['config']} @ {r['length']} ({r['source']})"
        if r["_eval_sparsity"] is None:
            out.append(f"bench point {at} has no evaluated configuration")
        elif r["bench_sparsity"] is None:
            out.append(f"bench point {at} records no sparsity to match the evaluated {r['_eval_sparsity']:.3f}")
        elif abs(r["bench_sparsity"] - r["_eval_sparsity"]) > BENCH_SPARSITY_TOL:
            out.append(f"bench point {at} ran sparsity {r['bench_sparsity']:.3f}, the evaluated configuration "
                       f"{r['_eval_sparsity']:.3f}")
    return out


def check_bench(bench: pl.DataFrame, points_: pl.DataFrame) -> None:
    """Refuse, in one line, bench rows that are not the evaluated configuration (``unmatched_bench``)."""
    bad = unmatched_bench(bench, points_)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UserError(f"--bench: {bad[0]}{more}; a bench row joins only the same method, config (dispatch "
                        f"included) and length with sparsity within {BENCH_SPARSITY_TOL}: leave the file out, or "
                        "time the evaluated configuration itself with `sparsecal eval ... --time`.")


def noise_floor(summary: pl.DataFrame) -> list[dict]:
    """Per noise-floor method (evaluation/methods.py FLOORS) and length[, split], over every task:
    samples, the answers it flips against dense (``gained``/``lost``, summed over answer tasks),
    and top-1, KL, ppl_ratio, answer_ll_delta and accuracy_rel_dense against dense, each the mean
    over the tasks defining it with the MOVER interval of the tasks' intervals."""
    from sparsecal.evaluation.methods import FLOORS

    f = summary.filter(pl.col("label").is_in(list(FLOORS)))
    out = []
    for (label, length, *rest), g in f.group_by(["label", "length"] + _point_keys(f), maintain_order=True):
        rec = {"label": label, "length": length, **({"split": rest[0]} if rest else {}),
               "samples": int(g["samples"].sum())}
        ans = g.filter(~pl.col("task").is_in(TEXT_TASKS))
        rec["gained"], rec["lost"] = int(ans["gained"].fill_null(0).sum()), int(ans["lost"].fill_null(0).sum())
        for s in ("top1", "kl", "ppl_ratio", "answer_ll_delta", "accuracy_rel_dense"):
            h = g.filter(pl.col(s).is_not_null() & pl.col(f"{s}_lo").is_not_null() & pl.col(f"{s}_hi").is_not_null())
            v, lo, hi = mover(h[s], h[f"{s}_lo"], h[f"{s}_hi"]) if h.height else (None, None, None)
            rec.update({s: v, f"{s}_lo": lo, f"{s}_hi": hi})
        out.append(rec)
    return sorted(out, key=lambda r: (r["label"], r["length"], r.get("split") or ""))


def split_rows(summary: pl.DataFrame) -> list[dict]:
    """Per (method, config, label, length, split): the seen and held-out task families reported
    apart: ``accuracy_rel_dense`` averaged over the split's tasks where it is defined, top-1, KL
    and ``answer_ll_delta`` averaged over its tasks, ``samples`` summed, ``tasks`` (comma-separated).
    Empty when no row knows its split."""
    if summary is None or "split" not in summary.columns:
        return []
    f = summary.filter(pl.col("split").is_not_null())
    if not f.height:
        return []
    out = f.group_by(KEYS + ["label", "split"]).agg(
        pl.col("samples").sum(), pl.col("accuracy_rel_dense").mean(), pl.col("top1").mean(), pl.col("kl").mean(),
        pl.col("answer_ll_delta").mean(), pl.col("task").sort().str.join(",").alias("tasks"))
    return out.sort(KEYS + ["split"], descending=[False, False, False, True]).to_dicts()
