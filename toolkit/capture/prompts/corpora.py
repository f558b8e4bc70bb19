"""Natural-text corpora that ship offline with every CPython install, one per text task.

    text          the Python language reference, ``pydoc_data.topics`` (tasks.source_text)
    text_stdlib   the docstrings of a fixed list of standard-library modules, read from their
                  source files with ``ast`` (nothing is imported or executed)

The second corpus is another body of text by other authors (library documentation written
beside the code: usage notes, argument descriptions, examples) than the first (the language
reference), so an evaluation can run on text its calibration never saw. Both are normalized to
ASCII the same way, so that token-level trimming never splits a multi-byte character. A module
file the install lacks is refused in one line (a Python without its standard library sources).
"""
from __future__ import annotations

import ast
import functools
import sysconfig
from pathlib import Path

from sparsecal.formats.errors import UserError

STDLIB_SOURCE = "stdlib docstrings"
MIN_DOCSTRING = 200  # characters: shorter docstrings are one-line summaries, not prose
# Pure-Python standard-library modules whose docstrings are at least 15% of their source (the
# parse is the cost: about 1.1 MB of source), each a file or a package's __init__.py. The corpus
# is 230-264 thousand characters on CPython 3.9-3.13 (3.11: 250 thousand; Debian 12's 3.11.2 too)
STDLIB_MODULES = (
    "configparser", "difflib", "doctest", "fractions", "inspect", "ipaddress", "logging", "optparse",
    "random", "shutil", "smtplib", "statistics", "textwrap", "threading", "typing", "unittest.case",
    "urllib.parse", "uuid",
)
_ASCII = str.maketrans({
    "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-",
    "\u2014": "--", "\u2026": "...", "\u00b0": " degrees", "\u00df": "ss",
})


def ascii_text(text: str) -> str:
    """``text`` with typographic quotes and dashes made ASCII and any other non-ASCII dropped."""
    return text.translate(_ASCII).encode("ascii", "ignore").decode("ascii")


def _module_file(root: Path, name: str) -> Path:
    """The source file of standard-library module ``name`` under ``root``."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    raise UserError(f"the standard-library source of module {name} is not under {root}; the text_stdlib "
                    "task needs CPython's .py sources (install the full Python, not a minimal one).")


def _docstrings(path: Path) -> list[str]:
    """The module's, classes' and functions' docstrings of at least ``MIN_DOCSTRING`` characters,
    in source order."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = (ast.get_docstring(n) for n in [tree, *_definitions(tree.body)])
    return [d for d in docs if d and len(d) >= MIN_DOCSTRING]


def _definitions(body: list):
    """The classes and functions of a statement list and of their bodies (and of if/try blocks
    there), in source order."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
            yield from _definitions(node.body)
        elif isinstance(node, (ast.If, ast.Try)):
            yield from _definitions(node.body)
            yield from _definitions(node.orelse)


@functools.lru_cache(maxsize=1)
def stdlib_text() -> str:
    """The docstrings of ``STDLIB_MODULES`` (in that order), separated by blank lines, as ASCII."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [doc for name in STDLIB_MODULES for doc in _docstrings(_module_file(root, name))]
    return ascii_text("\n\n".join(parts) + "\n\n")
