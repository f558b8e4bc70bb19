"""The timing phase's table (EVAL/data/timing.parquet) read back with its values checked.

``read_timing`` is what ``sparsecal eval`` (finish, --time-only) and ``merge-eval-shards`` read:
the records ``evaluation.timing.run_timing`` wrote, refused in one line where a value is impossible,
with the derived attention shares and ideals nulled where they fall outside [0, 1].
"""
from __future__ import annotations

from sparsecal.formats.results import SPEEDS
from sparsecal.formats.table_values import check_ranges

TIMING_REQUIRED = ("label", "length", "ttft_ms", "tpot_ms", "speedup_ttft", "speedup_tpot", "sparsity_match",
                   "decode_sparsity_match", "speed_device")


def read_timing(root):
    """The timing phase's records (EVAL/data/timing.parquet), None before any timing phase; checked:
    readable, TIMING_REQUIRED columns, every time and speedup (and interval end) finite and > 0 where
    present, each interval's lo <= hi, sparsities in [0, 1], counts >= 0, lengths >= 1
    (TIMING_RANGES). A damaged file is one line (UserError) saying how to redo it. Attention shares
    outside [0, 1] and their ideals read as null (``_derived_in_range``)."""
    from pathlib import Path

    import polars as pl

    from sparsecal.evaluation.store import TIMING
    from sparsecal.formats.errors import UserError

    path = Path(root) / TIMING
    if not path.is_file():
        return None
    redo = "delete it and time again (sparsecal eval ... --time-only)"
    try:
        df = pl.read_parquet(path)
    except Exception as e:  # noqa: BLE001 - a damaged table is one line
        raise UserError(f"{path} is not readable ({type(e).__name__}); {redo}.") from None
    lacking = [c for c in TIMING_REQUIRED if c not in df.columns]
    if lacking:
        raise UserError(f"{path} lacks columns {', '.join(lacking)}; {redo}.")
    values = [c for c in df.columns if (c.endswith("_ms") and not c.endswith("rounds_ms")) or c.startswith("speedup_")]
    for c in values:
        try:
            v = df[c].cast(pl.Float64, strict=True).drop_nulls()
        except Exception:  # noqa: BLE001 - text where a time belongs
            raise UserError(f"{path}: column {c} is {df[c].dtype}, not numeric; {redo}.") from None
        if v.len() and not bool((v.is_finite() & (v > 0)).all()):
            raise UserError(f"{path}: column {c} holds a value that is not a finite positive number; {redo}.")
    for name in SPEEDS:
        if f"{name}_lo" in df.columns and f"{name}_hi" in df.columns and bool((df[f"{name}_lo"] > df[f"{name}_hi"]).any()):
            raise UserError(f"{path}: {name}_lo exceeds {name}_hi; {redo}.")
    check_ranges(df, str(path), TIMING_RANGES, "Delete it and time again (sparsecal eval ... --time-only).")
    return _derived_in_range(df)


TIMING_RANGES = ([(c, 0.0, 1.0) for c in ("sparsity", "decode_sparsity", "point_sparsity", "point_decode_sparsity")]
                 + [(c, 0.0, None) for c in ("prefill_skipped", "prefill_reachable", "decode_skipped", "decode_reachable",
                                             "sparse_layers", "row_prefill_reachable", "rounds", "reps", "warmup",
                                             "decode_steps")] + [("length", 1.0, None)])


def _derived_in_range(df):
    """The attention shares and their ideals as a reader may use them: a share outside [0, 1]
    (tables written before shares came from graph replays: an eager host-bound step timed its
    attention-free twin slower than itself) is null, and so is the ideal derived from it."""
    import polars as pl

    for share, ideal in (("attention_share", "ideal_ttft"), ("attention_share_decode", "ideal_tpot")):
        if share not in df.columns or not df[share].dtype.is_numeric():
            continue
        ok = df[share].cast(pl.Float64).is_between(0.0, 1.0).fill_null(False)
        df = df.with_columns(pl.when(ok).then(pl.col(share)).otherwise(None).alias(share))
        if ideal in df.columns:
            df = df.with_columns(pl.when(ok).then(pl.col(ideal)).otherwise(None).alias(ideal))
    return df
