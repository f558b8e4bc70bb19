"""Value checks shared by the Parquet readers: a column's numbers finite and in range.

A rule is (column, lo, hi) or (column, lo, hi, True): the column's non-null values finite and
lo <= x <= hi (None: open; with True, lo < x: a speedup or a time is above 0).
Columns a table does not have, and all-null columns, are skipped; a column that is not numeric
where a number belongs is refused. The first bad value is named in one line (UserError): the
table, the column, the row and the value, then what to do (``redo``).
"""
from __future__ import annotations

from sparsecal.formats.errors import UserError


def check_ranges(df, where: str, rules, redo: str) -> None:
    """Refuse the first value of ``df`` (a polars DataFrame) outside its rule; ``where`` names the table."""
    import polars as pl

    for col, lo, hi, *strict in rules:
        if col not in df.columns or df[col].dtype == pl.Null:
            continue
        if not df[col].dtype.is_numeric():
            raise UserError(f"{where}: column {col} is {df[col].dtype}, not numeric. {redo}")
        x, above = df[col].cast(pl.Float64), bool(strict and strict[0])
        bad = ~x.is_finite()
        if lo is not None:
            bad = bad | ((x <= lo) if above else (x < lo))
        if hi is not None:
            bad = bad | (x > hi)
        bad = bad.fill_null(False)
        if bad.any():
            i = int(bad.arg_true()[0])
            raise UserError(f"{where}: column {col} must be {_span(lo, hi, above)}; row {i} holds {df[col][i]}. "
                            f"{redo}")


def _span(lo, hi, above: bool) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo:g}, {hi:g}]"
    if lo is not None:
        return f"finite and {'>' if above else '>='} {lo:g}"
    return f"finite and <= {hi:g}" if hi is not None else "finite"


def numeric_columns(df) -> list[str]:
    """The numeric columns of a polars DataFrame."""
    return [c for c, t in df.schema.items() if t.is_numeric()]
