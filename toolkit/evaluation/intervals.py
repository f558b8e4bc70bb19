"""Paired bootstrap 95% intervals of an evaluation's per-sample rows.

Every method's row of a sample is paired with dense's row of the same sample (the same prompt).
One bootstrap draw resamples the n samples of a (length, task) cell with replacement and
recomputes each statistic from the method's and dense's rows of the drawn samples: the same draw
for both sides (paired), and for every method of the cell. The 2.5 and 97.5 percentiles of
``DRAWS`` draws are the interval. Draws are seeded from (length, task), so the intervals of a
finished evaluation are the same every time it is summarized.

Statistics of a (method, length, task) cell, each with ``<name>_lo`` and ``<name>_hi``:

    accuracy            mean score
    accuracy_rel_dense  answer tasks: mean score / dense's mean score (null when dense's mean over
                        all samples is below ``MIN_DENSE_SCORE``); text: dense perplexity / the
                        method's = exp(mean nll_dense - mean nll)
    top1, kl            means of the per-sample agreement with dense (already paired per row)
    answer_ll_delta     mean of (answer log-likelihood - dense's), teacher-forced, natural log:
                        0 = dense's certainty about the right answer, < 0 = less certain

Per (method, length) over tasks (``points``): accuracy_rel_dense averaged over the tasks where it
is defined, each task resampled with its own draw, so the interval of the average is the
percentile interval of the averaged draws.

Shapes: n samples of a cell, B = DRAWS draws, idx [B, n].
"""
from __future__ import annotations

import hashlib

import numpy as np
import polars as pl

from sparsecal.capture.prompts.tasks import TEXT_TASKS

MIN_DENSE_SCORE = 0.2  # dense's mean score below which an answer task has no relative accuracy
DRAWS = 2000
LEVEL = 0.95
CELL = ["length", "task"]
STATS = ("accuracy", "accuracy_rel_dense", "top1", "kl", "answer_ll_delta")


def _draws(length: int, task: str, n: int) -> np.ndarray:
    """idx [DRAWS, n]: the cell's bootstrap resamples, seeded from the cell."""
    seed = int.from_bytes(hashlib.sha256(f"{length}/{task}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, n, size=(DRAWS, n))


def _percentiles(x: np.ndarray) -> tuple[float | None, float | None]:
    x = x[np.isfinite(x)]
    if not x.size:
        return None, None
    lo, hi = np.percentile(x, [50 * (1 - LEVEL), 50 * (1 + LEVEL)])
    return float(lo), float(hi)


def _rel(task: str, m: dict, d: dict, idx) -> np.ndarray | None:
    """accuracy_rel_dense per draw (idx [B, n]) or at the point (idx [n]); None where undefined."""
    if task in TEXT_TASKS:
        return np.exp(d["nll"][idx].mean(-1) - m["nll"][idx].mean(-1))
    if d["score"].mean() < MIN_DENSE_SCORE:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        return m["score"][idx].mean(-1) / d["score"][idx].mean(-1)


def _cell_stats(task: str, m: dict, d: dict, idx: np.ndarray) -> dict:
    """The statistics' draws [B] of one method in one cell."""
    out = {"accuracy": m["score"][idx].mean(-1), "top1": m["top1"][idx].mean(-1), "kl": m["kl"][idx].mean(-1),
           "accuracy_rel_dense": _rel(task, m, d, idx)}
    if "answer_logprob" in m:
        out["answer_ll_delta"] = (m["answer_logprob"] - d["answer_logprob"])[idx].mean(-1)
    return out


def _arrays(rows: pl.DataFrame, ids: list[str]) -> dict | None:
    """A method's columns as arrays in the order of ``ids`` (None when a sample is missing)."""
    by = rows.unique("sample_id", keep="last")
    if not set(ids) <= set(by["sample_id"]):
        return None
    by = pl.DataFrame({"sample_id": ids}).join(by, on="sample_id", how="left", maintain_order="left")
    cols = ["score", "top1", "kl", "nll"] + [c for c in ("answer_logprob",) if c in by.columns
                                             and by[c].null_count() == 0]
    return {c: by[c].cast(pl.Float64).to_numpy() for c in cols}


def cells(rows: list[dict]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(per-cell intervals: label, length, task, <stat>_lo/_hi; per-point rel: label, length,
    accuracy_rel_dense and its _lo/_hi averaged over the tasks where it is defined)."""
    df = pl.DataFrame(rows, infer_schema_length=None)
    out, draws_by_point = [], {}
    for (length, task), cell in df.group_by(CELL, maintain_order=True):
        dense = cell.filter(pl.col("label") == "dense")
        ids = sorted(set(dense["sample_id"]))
        d = _arrays(dense, ids) if ids else None
        if d is None:
            continue
        idx = _draws(length, task, len(ids))
        for (label,), rows_m in cell.group_by(["label"], maintain_order=True):
            m = _arrays(rows_m, ids)
            if m is None:
                continue
            st = _cell_stats(task, m, d, idx)
            rec = {"label": label, "length": length, "task": task}
            for name in STATS:
                rec[f"{name}_lo"], rec[f"{name}_hi"] = (None, None) if st.get(name) is None else _percentiles(st[name])
            out.append(rec)
            if st["accuracy_rel_dense"] is not None:
                point = _rel(task, m, d, np.arange(len(ids)))
                draws_by_point.setdefault((label, length), []).append((float(point), st["accuracy_rel_dense"]))
    return _frame(out), _points(draws_by_point)


def _frame(recs: list[dict]) -> pl.DataFrame:
    schema = {"label": pl.Utf8, "length": pl.Int64, "task": pl.Utf8,
              **{f"{s}_{e}": pl.Float64 for s in STATS for e in ("lo", "hi")}}
    return pl.DataFrame(recs, schema=schema)


def _points(by_point: dict) -> pl.DataFrame:
    recs = []
    for (label, length), parts in by_point.items():
        mean_draws = np.mean([p[1] for p in parts], axis=0)
        lo, hi = _percentiles(mean_draws)
        recs.append({"label": label, "length": length, "accuracy_rel_dense": float(np.mean([p[0] for p in parts])),
                     "accuracy_rel_dense_lo": lo, "accuracy_rel_dense_hi": hi,
                     "tasks": len(parts)})
    return pl.DataFrame(recs, schema={"label": pl.Utf8, "length": pl.Int64, "accuracy_rel_dense": pl.Float64,
                                      "accuracy_rel_dense_lo": pl.Float64, "accuracy_rel_dense_hi": pl.Float64,
                                      "tasks": pl.Int64})
