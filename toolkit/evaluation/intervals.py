"""95% intervals, exact paired tests and the rounding-floor flag of an evaluation's per-sample rows.

A cell is (length, task[, split]): ``split`` ("seen" | "held-out") joins the key when the rows
carry it. Every method's row of a sample is paired with dense's row of the same sample (the same
prompt), and with the rounding floor's (``FLOOR`` = dense:fp32) where the cell has it.

A cell is **binary** when every score in it (every method's) is 0 or 1; otherwise its scores are
continuous (text; niah_* / cwe / vt answers scored in parts). Statistics of a (method, cell), each
with ``<name>_lo`` and ``<name>_hi``:

    accuracy            mean score. Binary: Wilson score interval; else BCa bootstrap.
    accuracy_diff       mean score - dense's mean score on the same samples. Binary: Tango's score
                        interval of a paired difference of proportions with a continuity
                        correction (evaluation/paired.py); else BCa of the mean paired difference.
    accuracy_rel_dense  the headline. Answer tasks: mean score / dense's mean score (null when
                        dense's mean is below ``MIN_DENSE_SCORE``); binary: 1 + accuracy_diff's
                        interval / dense's mean (dense's accuracy on these samples is the
                        reference; the uncertainty is in the discordant pairs); continuous: BCa of
                        the ratio of means. Text: ppl_ratio.
    ppl_ratio           dense's prompt perplexity / the method's = exp(mean(nll_dense - nll)), every
                        task; BCa.
    top1, kl            means of the per-sample agreement with dense (paired per row); BCa.
    answer_ll_delta     mean of (answer log-likelihood - dense's), teacher-forced, natural log; BCa.

and, without intervals: ``binary``; ``gained``/``lost``, the samples whose primary value (score;
text: -nll) the method raised / lowered against dense (binary: the discordant pairs b and c);
``p_dense``, the two-sided exact sign-test p-value of gained against lost (binary: exact McNemar);
``p_floor`` and ``distinguishable`` (p_floor < 0.05), the same test of the method against
dense:fp32 on the same samples (null for the floor itself and where the cell has no floor rows);
``mdd``, the smallest difference the cell's sample size resolves at alpha 0.05 and power 0.8
(binary answer tasks: exact McNemar power with the floor's own discordance flipping answers both
ways, paired.mdd_binary, in accuracy; else (z_0.975 + z_0.8) sd / sqrt(n), sd the spread of the
floor's paired differences from dense in the primary value: score, for text the mean nll in nats
per token, about the relative perplexity change; null where that spread is 0).

BCa bootstrap (Efron 1987): ``DRAWS`` resamples of the cell's n samples, each applied to the
method's and dense's rows of the same samples (paired) and shared by every method of the cell;
a draw is a weight vector (multinomial counts / n), so every statistic, a smooth function of
column means, is W @ X. Bias correction z0 from the share of draws below the point (ties
count half), acceleration from the closed-form jackknife of the means. Draws are seeded from the
cell, so a finished evaluation's intervals are the same every time it is summarized.

Per point (method, length[, split]) over tasks (``points``): each statistic averaged over the
tasks where it is defined, its interval combined from the tasks' intervals by MOVER (paired.mover;
tasks are independent samples).

Shapes: n samples of a cell, B = DRAWS draws, W [B, n], X [n, k] columns, k <= 2.
"""
from __future__ import annotations

import hashlib

import numpy as np
import polars as pl
from scipy.stats import norm
from scipy.stats import t as t_dist

from sparsecal.capture.prompts.tasks import TEXT_TASKS
from sparsecal.evaluation.paired import ALPHA, mdd_binary, mdd_normal, mover, sign_test_p, tango, wilson

MIN_DENSE_SCORE = 0.2  # dense's mean score below which an answer task has no relative accuracy
DRAWS = 2000
LEVEL = 1 - ALPHA
FLOOR = "dense:fp32"
CELL = ["length", "task"]
STATS = ("accuracy", "accuracy_diff", "accuracy_rel_dense", "ppl_ratio", "top1", "kl", "answer_ll_delta")
VALUED = ("accuracy_diff", "ppl_ratio")  # statistics whose value the summary's means do not already hold
POINT_STATS = ("accuracy_rel_dense", "ppl_ratio", "answer_ll_delta", "top1", "kl")


def with_split(df: pl.DataFrame) -> pl.DataFrame:
    """Rows written before the ``split`` column existed: it follows from ``held_out_task``."""
    if "split" in df.columns:
        return df.with_columns(pl.col("split").cast(pl.Utf8))  # all null: typed as text all the same
    if "held_out_task" not in df.columns:
        return df
    held = pl.col("held_out_task")
    return df.with_columns(pl.when(held.is_null()).then(None).when(held).then(pl.lit("held-out"))
                           .otherwise(pl.lit("seen")).cast(pl.Utf8).alias("split"))


def cell_keys(columns) -> list[str]:
    """The cell key: (length, task, split) where the rows carry a split, else (length, task)."""
    return CELL + ["split"] if "split" in columns else list(CELL)


def weights(key: str, n: int, draws: int = DRAWS) -> np.ndarray:
    """W [draws, n]: the cell's bootstrap resamples as multinomial counts / n, seeded from ``key``."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=draws) / n


def bca(point, draws, jack, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """BCa interval (lo [...], hi [...]) of a statistic from its value ``point`` [...], its
    bootstrap ``draws`` [..., B] and its leave-one-out jackknife values ``jack`` [..., n], with
    the small-sample expansion: z_{1-alpha/2} becomes sqrt(n / (n-1)) t_{n-1, 1-alpha/2}.
    Non-finite draws (a ratio over a draw whose denominator is 0) are left out; none left: nan."""
    point, jack = np.asarray(point, float), np.asarray(jack, float)
    draws = np.where(np.isfinite(draws), draws, np.nan)
    n, b = jack.shape[-1], np.sum(~np.isnan(draws), -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = (np.sum(draws < point[..., None], -1) + 0.5 * np.sum(draws == point[..., None], -1)) / b
        z0 = norm.ppf(np.clip(share, 0.5 / b, 1 - 0.5 / b))
        ok = np.isfinite(jack)
        jack = np.where(ok, jack, 0.0)
        d = np.where(ok, jack.sum(-1, keepdims=True) / np.maximum(ok.sum(-1, keepdims=True), 1) - jack, 0.0)
        ss = np.sum(d * d, -1)
        a = np.where(ss > 0, np.sum(d ** 3, -1) / (6 * ss ** 1.5), 0.0)
    half = np.sqrt(n / (n - 1)) * t_dist.ppf((1 + level) / 2, n - 1) if n > 1 else norm.ppf((1 + level) / 2)
    z = np.array([-half, half])
    zz = z0[..., None] + z
    q = norm.cdf(z0[..., None] + zz / (1 - a[..., None] * zz))                  # [..., 2]
    srt = np.sort(draws, -1)                                                      # nan last
    pos = q * np.maximum(b - 1, 0)[..., None]
    i = np.clip(np.floor(np.nan_to_num(pos)).astype(int), 0, draws.shape[-1] - 1)
    j = np.minimum(i + 1, np.maximum(b - 1, 0)[..., None])
    f = pos - i
    ends = np.take_along_axis(srt, i, -1) * (1 - f) + np.take_along_axis(srt, j, -1) * f
    ends = np.where((b > 0)[..., None] & np.isfinite(point)[..., None], ends, np.nan)
    return ends[..., 0], ends[..., 1]


class Means:
    """A statistic that is a function ``g`` of the means of sample columns ``cols`` (each
    [..., n]; x = their stack [..., n, k]): its value, draws and jackknife, so that any g gets its
    BCa interval. ``w`` [B, n]: the draws' weights."""

    def __init__(self, w: np.ndarray, *cols):
        self.x = np.stack([np.asarray(c, float) for c in cols], -1)
        n = self.x.shape[-2]
        self.mean = self.x.mean(-2)                                            # [..., k]
        self.draws = np.einsum("bn,...nk->...bk", w, self.x)                   # [..., B, k]
        self.jack = (n * self.mean[..., None, :] - self.x) / max(n - 1, 1)     # [..., n, k]

    def interval(self, g) -> tuple:
        """(value, lo, hi) of g(means), g mapping [..., k] to [...]: floats for one statistic,
        arrays [...] for a batch; None for an end that is not finite."""
        with np.errstate(divide="ignore", invalid="ignore"):
            point = g(self.mean)
            lo, hi = bca(point, g(self.draws), g(self.jack))
        if np.ndim(point) == 0:
            return tuple(float(v) if np.isfinite(v) else None for v in (point, lo, hi))
        return point, lo, hi


def _mean(v):
    return v[..., 0]


def _ratio(v):
    return v[..., 0] / v[..., 1]


def _exp(v):
    return np.exp(v[..., 0])


def _arrays(rows: pl.DataFrame, ids: list[str]) -> dict | None:
    """A method's columns as arrays in the order of ``ids`` (None when a sample is missing)."""
    by = rows.unique("sample_id", keep="last")
    if not set(ids) <= set(by["sample_id"]):
        return None
    by = pl.DataFrame({"sample_id": ids}).join(by, on="sample_id", how="left", maintain_order="left")
    cols = ["score", "top1", "kl", "nll"] + [c for c in ("answer_logprob",) if c in by.columns
                                             and by[c].null_count() == 0]
    return {c: by[c].cast(pl.Float64).to_numpy() for c in cols}


def _primary(task: str, a: dict) -> np.ndarray:
    """The value a sample's test compares [n]: the score; text: -nll (higher is better)."""
    return -a["nll"] if task in TEXT_TASKS else a["score"]


def _signs(task: str, m: dict, ref: dict) -> tuple[int, int]:
    """(gained, lost): samples whose primary value the method raised / lowered against ``ref``."""
    diff = _primary(task, m) - _primary(task, ref)
    return int(np.sum(diff > 0)), int(np.sum(diff < 0))


def _binary_stats(m: dict, d: dict) -> dict:
    """accuracy (Wilson), accuracy_diff (Tango) and the relative accuracy of a 0/1 cell."""
    n = m["score"].size
    gained, lost = _signs("", m, d)
    lo, hi = wilson(m["score"].sum(), n)
    out = {"accuracy": (float(m["score"].mean()), float(lo), float(hi))}
    dlo, dhi = tango(gained, lost, n)
    diff = (gained - lost) / n
    out["accuracy_diff"] = (diff, float(dlo), float(dhi))
    pd_ = float(d["score"].mean())
    if pd_ >= MIN_DENSE_SCORE:
        out["accuracy_rel_dense"] = (1 + diff / pd_, 1 + float(dlo) / pd_, 1 + float(dhi) / pd_)
    return out


def _continuous_stats(task: str, m: dict, d: dict, w: np.ndarray) -> dict:
    """accuracy, accuracy_diff and the relative accuracy of a cell of fractional scores (BCa)."""
    out = {"accuracy": Means(w, m["score"]).interval(_mean),
           "accuracy_diff": Means(w, m["score"] - d["score"]).interval(_mean)}
    if task not in TEXT_TASKS and d["score"].mean() >= MIN_DENSE_SCORE:
        out["accuracy_rel_dense"] = Means(w, m["score"], d["score"]).interval(_ratio)
    return out


def method_stats(task: str, binary: bool, m: dict, d: dict, w: np.ndarray) -> dict:
    """Every statistic of one method in one cell: name -> (value, lo, hi)."""
    out = _binary_stats(m, d) if binary else _continuous_stats(task, m, d, w)
    out["ppl_ratio"] = Means(w, d["nll"] - m["nll"]).interval(_exp)
    if task in TEXT_TASKS:
        out["accuracy_rel_dense"] = out["ppl_ratio"]
    out["top1"] = Means(w, m["top1"]).interval(_mean)
    out["kl"] = Means(w, m["kl"]).interval(_mean)
    if "answer_logprob" in m and "answer_logprob" in d:
        out["answer_ll_delta"] = Means(w, m["answer_logprob"] - d["answer_logprob"]).interval(_mean)
    return out


def floor_mdd(task: str, binary: bool, floor: dict | None, d: dict) -> float | None:
    """The cell's minimum detectable difference at alpha 0.05 and power 0.8 (module docstring)."""
    if floor is None:
        return None
    n = d["score"].size
    if binary and task not in TEXT_TASKS:
        return mdd_binary(n, float(np.mean(floor["score"] != d["score"])))
    sd = (_primary(task, floor) - _primary(task, d)).std(ddof=1) if n > 1 else 0.0
    return float(mdd_normal(sd, n)) if sd > 0 else None  # the floor moves nothing: no noise scale


def _record(label: str, key: dict, st: dict, tests: dict) -> dict:
    rec = dict(label=label, **key, **tests)
    for name in STATS:
        v, lo, hi = st.get(name, (None, None, None))
        rec[f"{name}_lo"], rec[f"{name}_hi"] = lo, hi
        if name in VALUED:
            rec[name] = v
    return rec


def _cell(key: dict, cell: pl.DataFrame) -> list[tuple[dict, dict]]:
    """(record, statistics) per method of one cell; none when dense lacks it."""
    task = key["task"]
    dense = cell.filter(pl.col("label") == "dense")
    ids = sorted(set(dense["sample_id"]))
    d = _arrays(dense, ids) if ids else None
    if d is None:
        return []
    binary = bool(cell["score"].is_in([0.0, 1.0]).all())
    w = weights("/".join(str(key[k]) for k in key), len(ids))
    floor_rows = cell.filter(pl.col("label") == FLOOR)
    floor = _arrays(floor_rows, ids) if floor_rows.height else None
    mdd = floor_mdd(task, binary, floor, d)
    out = []
    for (label,), rows_m in cell.group_by(["label"], maintain_order=True):
        m = _arrays(rows_m, ids)
        if m is None:
            continue
        gained, lost = _signs(task, m, d)
        tests = {"binary": binary, "gained": gained, "lost": lost, "p_dense": float(sign_test_p(gained, lost)),
                 "p_floor": None, "distinguishable": None, "mdd": mdd}
        if floor is not None and label != FLOOR:
            tests["p_floor"] = float(sign_test_p(*_signs(task, m, floor)))
            tests["distinguishable"] = tests["p_floor"] < ALPHA
        st = method_stats(task, binary, m, d, w)
        out.append((_record(label, key, st, tests), st))
    return out


def cells(rows: list[dict]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(per-cell statistics: label, the cell key, STATS' _lo/_hi, VALUED values and the tests;
    per-point statistics: label, length[, split], POINT_STATS with _lo/_hi, tasks, distinguishable)."""
    df = with_split(pl.DataFrame(rows, infer_schema_length=None))
    keys = cell_keys(df.columns)
    recs, by_point = [], {}
    for vals, cell in df.group_by(keys, maintain_order=True):
        key = dict(zip(keys, vals))
        for rec, st in _cell(key, cell):
            recs.append(rec)
            pkey = (rec["label"], key["length"]) + ((key["split"],) if "split" in key else ())
            by_point.setdefault(pkey, []).append((key["task"], st, rec["distinguishable"]))
    return _frame(recs, keys), _points(by_point, keys)


def _frame(recs: list[dict], keys: list[str]) -> pl.DataFrame:
    schema = {"label": pl.Utf8, "length": pl.Int64, "task": pl.Utf8, **({"split": pl.Utf8} if "split" in keys else {}),
              "binary": pl.Boolean, "gained": pl.Int64, "lost": pl.Int64, "p_dense": pl.Float64,
              "p_floor": pl.Float64, "distinguishable": pl.Boolean, "mdd": pl.Float64,
              **{f"{s}_{e}": pl.Float64 for s in STATS for e in ("lo", "hi")}, **{s: pl.Float64 for s in VALUED}}
    return pl.DataFrame(recs, schema=schema)


def _points(by_point: dict, keys: list[str]) -> pl.DataFrame:
    """Per point: each POINT_STATS averaged over the tasks that define it, with its MOVER interval."""
    recs = []
    for pkey, parts in by_point.items():
        rec = dict(zip(["label", "length"] + (["split"] if "split" in keys else []), pkey))
        for name in POINT_STATS:
            have = [st[name] for _, st, _ in parts if st.get(name) and st[name][0] is not None]
            whole = have and all(x is not None and np.isfinite(x) for t in have for x in t)
            v, lo, hi = (mover(*zip(*have)) if whole else  # a cell too small for an interval: the value alone
                         (float(np.mean([t[0] for t in have])), None, None) if have else (None, None, None))
            rec.update({name: v, f"{name}_lo": lo, f"{name}_hi": hi})
        rec["tasks"] = len([1 for _, st, _ in parts if st.get("accuracy_rel_dense")])
        flags = [f for _, _, f in parts if f is not None]
        rec["distinguishable"] = any(flags) if flags else None
        rec["distinguishable_tasks"] = ",".join(sorted(t for t, _, f in parts if f)) or None
        recs.append(rec)
    schema = {"label": pl.Utf8, "length": pl.Int64, **({"split": pl.Utf8} if "split" in keys else {}),
              **{f"{s}{e}": pl.Float64 for s in POINT_STATS for e in ("", "_lo", "_hi")},
              "tasks": pl.Int64, "distinguishable": pl.Boolean, "distinguishable_tasks": pl.Utf8}
    return pl.DataFrame(recs, schema=schema)
