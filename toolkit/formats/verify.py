"""``EXPORT/verify-modelopt.json`` (kind sparsecal-verify), written by ``sparsecal verify``: per phase,
target and length, sparsecal's predicted sparsity and the consumer's measured one (dense statistics,
and with masks applied). Read back with checks by ``load_verify`` (the dashboard's Export page)."""
from __future__ import annotations

import math
from pathlib import Path

from sparsecal.formats.errors import UserError
from sparsecal.formats.files import read_json_manifest
from sparsecal.formats.json_values import first_non_finite

VERIFY_KIND = "sparsecal-verify"
VERIFY_JSON = "verify-modelopt.json"
REMEDY = "run `sparsecal verify EXPORT` again"
FRACTIONS = ("predicted", "measured_dense", "measured_masks")


def _fraction(x) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x <= 1)


def load_verify(export) -> dict | None:
    """The verify document of an export directory, checked (rows with a phase, a target in (0, 1), a
    positive length and sparsities in [0, 1]); None when the export was never verified."""
    path = Path(export) / VERIFY_JSON
    if not path.is_file():
        return None
    doc = read_json_manifest(path, VERIFY_KIND, REMEDY)
    bad = first_non_finite(doc)
    if bad:
        raise UserError(f"{path}: {bad[0]} is {bad[1]}; every number of a verify document is finite: {REMEDY}.")
    rows = doc.get("rows")
    if not isinstance(rows, list):
        raise UserError(f"{path}: rows is not a list; {REMEDY}.")
    for i, r in enumerate(rows):
        ok = (isinstance(r, dict) and r.get("phase") in ("prefill", "decode") and isinstance(r.get("length"), int)
              and r["length"] > 0 and isinstance(r.get("target"), (int, float)) and 0 < r["target"] < 1
              and all(_fraction(r.get(k)) for k in FRACTIONS))
        if not ok:
            raise UserError(f"{path}: row {i} is not a phase, target in (0, 1), length and sparsities in [0, 1]; "
                            f"{REMEDY}.")
    return doc
