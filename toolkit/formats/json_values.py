"""Value checks shared by the JSON readers: the numbers themselves, not only their types.

Python's json module reads NaN, Infinity and -Infinity as floats, so a file edited by hand or
written by a buggy tool can carry them into every number a reader trusts; ``first_non_finite``
finds the first such number and names where it is.
"""
from __future__ import annotations

import math


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


def in_range(x, lo: float, hi: float | None = None) -> bool:
    """A number (not a bool) with lo <= x (<= hi); None is not in range."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= lo
    return ok and (hi is None or x <= hi)
