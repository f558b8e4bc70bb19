"""Value checks shared by the JSON readers: the numbers themselves, not only their types.

Python's json module reads NaN, Infinity and -Infinity as floats, so a file edited by hand or
written by a buggy tool can carry them into every number a reader trusts; ``first_non_finite``
finds the first such number and names where it is.
"""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

from sparsecal.formats.errors import UserError


def first_non_finite(doc, where: str = "") -> tuple[str, float] | None:
    """(field path like ``per_length[3].lambda``, value) of the first NaN or infinite number in a
    JSON document (dicts and lists walked in order), else None."""
    if isinstance(doc, float) and not math.isfinite(doc):
        return where or "(the document)", doc
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        sub = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        found = first_non_finite(value, sub)
        if found:
            return found
    return None


def finite_number(x) -> bool:
    """An int or float (not a bool) that is finite."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def positive_int(x) -> bool:
    """An int (not a bool) above 0."""
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def in_range(x, lo: float, hi: float | None = None) -> bool:
    """A finite number with lo <= x (<= hi); None is not in range."""
    return finite_number(x) and x >= lo and (hi is None or x <= hi)


def fit_values(doc: dict) -> str | None:
    """None when fit.json's values are possible: lengths and k values positive integers, the split
    two lists of sample ids, every BLASST factor a finite positive number; else what is wrong."""
    for key in ("lengths", "k_values"):
        v = doc.get(key)
        if not isinstance(v, list) or not v or not all(map(positive_int, v)):
            return f"{key} is {v!r}, not a list of positive integers"
    split = doc.get("split")
    if not isinstance(split, dict) or not all(isinstance(split.get(k), list) for k in ("train", "test")):
        return "split does not list the train and test sample ids"
    for c in doc.get("blasst") or []:
        a = c.get("a") if isinstance(c, dict) else None
        if not finite_number(a) or a <= 0:
            return f"a BLASST factor (a) is {a!r}, not a finite positive number"
    return None


def read_file(path, what: str):
    """The JSON document of a benchmark file (.json, or .json.gz as the GPU runs leave them), or one
    UserError line naming ``what`` it should have been."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return json.loads(raw)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not a readable {what} file ({type(e).__name__}); pass the .json or .json.gz "
                        "the benchmark wrote.") from None
