"""The house rules a reader relies on (docs/architecture.md "Size"): no source file past MAX_FILE
lines and no function past MAX_FUNCTION lines, in the project's own Python (kernels, analysis,
dashboard, the toolkit package, scripts and these tests). A file or function that grows past
them is split, never let through: that is what keeps each piece readable in one screen."""
from __future__ import annotations

import ast
import subprocess

from helpers import ROOT

MAX_FILE = 600
MAX_FUNCTION = 60


def _sources() -> list:
    """The tracked Python files (symlinked copies under toolkit/ counted once, at their real path)."""
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if not (ROOT / line).is_symlink()]


def test_no_file_or_function_is_past_the_house_limits():
    files = _sources()
    assert len(files) > 100, len(files)   # the listing found the tree
    long_files, long_functions = [], []
    for path in files:
        text = path.read_text()
        if text.count("\n") > MAX_FILE:
            long_files.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long_files, f"files past {MAX_FILE} lines: split them: {long_files}"
    assert not long_functions, f"functions past {MAX_FUNCTION} lines: split them: {long_functions}"
