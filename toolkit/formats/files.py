"""Atomic writes and the checked reader of JSON manifests.

Every file sparsecal writes goes through a temporary name in the same directory and one
``os.replace``, so a reader sees the old file or the new one, never half of one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from sparsecal.formats.errors import UserError
from sparsecal.formats.version import SCHEMA_VERSION


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` and rename the result onto ``path`` (mode 0644)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to path via a temporary file and an atomic rename."""
    atomic_write(path, lambda p: Path(p).write_text(text))


def read_json_manifest(path: Path, kind: str, remedy: str) -> dict:
    """The JSON manifest at ``path``, checked to be of ``kind`` at this sparsecal's schema version;
    anything else is one UserError line ending in ``remedy`` (what the user should do)."""
    try:
        man = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({getattr(e, 'msg', type(e).__name__)}); {remedy}.") from None
    if not isinstance(man, dict) or man.get("kind") != kind:
        found = man.get("kind") if isinstance(man, dict) else type(man).__name__
        raise UserError(f"{path} holds a {found!r}, not a {kind} manifest; {remedy}.")
    check_schema(path, man.get("schema_version"), remedy)
    return man


def check_schema(path, found, remedy: str) -> None:
    """Refuse a file of another schema version (``found`` may be the int or its string)."""
    if str(found) != str(SCHEMA_VERSION):
        raise UserError(f"{path} has schema version {found}; this sparsecal reads {SCHEMA_VERSION}: {remedy}.")
