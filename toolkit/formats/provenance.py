"""Who, where and when of a result file (benchmark or evaluation): machine, versions, commit, date,
and ``source``, a digest of the package's Python files as they ran.

The commit names a git revision where the copy has one (``SPARSECAL_COMMIT`` or the copy's HEAD); a
copy made from a working tree may carry a HEAD older than its files, so ``source`` is what identifies
the code: ``python -m sparsecal.formats.provenance --at REV`` prints the digest of a revision's files
(from git) and without ``--at`` the digest of the importable package, to compare with a file's; and
``--check FILE ...`` compares each result file's ``source`` with the digest of the commit it names
(``check_file``), one line a file, exit code 2 when one does not hold: a copy's stale HEAD or a
mistyped ``--commit`` shows there, not in a reader's conclusions.

Torch-free: the GPU name and torch's thread count are read from an already imported torch (every
caller that measures something has imported it), so reading or writing provenance never loads it.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import functools
import hashlib
import importlib.util
import os
import platform
import subprocess
import sys

from sparsecal.formats.errors import UserError
from sparsecal.formats.json_values import read_file
from sparsecal.formats.run import versions

# The package's directories in the repository (pyproject.toml's [tool.setuptools.package-dir]) and its
# packages (its packages list); tests/test_provenance.py holds both to pyproject.toml.
PACKAGE_DIRS = {"sparsecal": "toolkit", "sparsecal.kernels": "kernels", "sparsecal.analysis": "analysis",
                "sparsecal.dashboard": "dashboard"}
PACKAGES = ("sparsecal", "sparsecal.formats", "sparsecal.capture", "sparsecal.capture.prompts",
            "sparsecal.integrations", "sparsecal.evaluation", "sparsecal.bench", "sparsecal.cli",
            "sparsecal.kernels", "sparsecal.kernels.capture", "sparsecal.kernels.sparse",
            "sparsecal.analysis", "sparsecal.dashboard")


def _split(package: str) -> tuple[str, list[str]]:
    """(the PACKAGE_DIRS entry that holds ``package``, the rest of its dotted name)."""
    base = max((p for p in PACKAGE_DIRS if package == p or package.startswith(p + ".")), key=len)
    return base, package[len(base) + 1:].split(".") if package != base else []


def repo_dir(package: str) -> str:
    """A package's directory in the repository: sparsecal.kernels.sparse -> kernels/sparse."""
    base, rest = _split(package)
    return "/".join([PACKAGE_DIRS[base], *rest])


def digest(files) -> str:
    """12 hex digits of sha256 over (package/file name, bytes) pairs, in name order."""
    h = hashlib.sha256()
    for name, data in sorted(files):
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:12]


def _installed_files():
    """(package/file.py, bytes) of every package's own .py files where they are imported from (only the
    PACKAGE_DIRS entries are looked up, so nothing below them is imported)."""
    roots = {}
    for base in PACKAGE_DIRS:
        spec = importlib.util.find_spec(base)
        if spec is None or not spec.submodule_search_locations:
            raise OSError(f"{base} not found")
        roots[base] = spec.submodule_search_locations[0]
    for pkg in PACKAGES:
        base, rest = _split(pkg)
        where = os.path.join(roots[base], *rest)
        for f in os.listdir(where):
            path = os.path.join(where, f)
            if f.endswith(".py") and os.path.isfile(path):
                with open(path, "rb") as fh:
                    yield f"{pkg}/{f}", fh.read()


def _git_files(rev: str, root: str):
    """(package/file.py, bytes) of every package's own .py files at git revision ``rev`` of ``root``."""
    for pkg in PACKAGES:
        d = repo_dir(pkg)
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{d}"], cwd=root, capture_output=True,
                               text=True, check=True, timeout=60).stdout.split()
        for f in names:
            if f.endswith(".py"):
                yield f"{pkg}/{f}", subprocess.run(["git", "show", f"{rev}:{d}/{f}"], cwd=root, capture_output=True,
                                                   check=True, timeout=60).stdout


def revision_digest(rev: str, repo: str = ".") -> str:
    """``digest`` of the package's files at git revision ``rev`` of the repository at ``repo``."""
    return digest(_git_files(rev, repo))


@functools.lru_cache(maxsize=1)
def source_digest() -> str | None:
    """``digest`` of the importable package's files (None where they cannot be read); read once a
    process, as its code was imported."""
    try:
        return digest(_installed_files())
    except OSError:
        return None


def provenance() -> dict:
    torch = sys.modules.get("torch")  # the caller's torch, never imported here
    commit = os.environ.get("SPARSECAL_COMMIT")  # a copy without its own git metadata names its commit
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=os.path.dirname(__file__), timeout=10,
                                          check=False).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit, "source": source_digest(), "host_cpu": cpu, "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads() if torch else None,
        "gpu": torch.cuda.get_device_name() if torch and torch.cuda.is_available() else None,
        "versions": versions(),
    }


@functools.cache
def _commit_digest(commit: str, repo: str) -> str:
    """``revision_digest`` of a commit a result file names (a hash: fixed, so read once a process,
    however many files name it)."""
    return revision_digest(commit, repo)


def check_file(path, repo: str = ".") -> tuple[bool, str]:
    """(holds, one line) for a result file (.json / .json.gz with ``provenance``): does its ``source``
    equal the digest of the files at its ``commit`` in ``repo``? Without a ``source`` (files older than
    the digest) or without a commit it cannot be checked, which is said, not counted as holding."""
    doc = read_file(path, "result")
    prov = doc.get("provenance") if isinstance(doc, dict) else None
    if not isinstance(prov, dict):
        return False, f"{path}: no provenance"
    commit, source = prov.get("commit"), prov.get("source")
    if not source or not commit:
        return False, f"{path}: commit {commit or '-'}, no source digest: cannot be checked"
    try:
        at = _commit_digest(str(commit), repo)
    except (OSError, subprocess.SubprocessError):
        return False, f"{path}: commit {commit} is not a revision of {repo}; its source {source} names the code"
    if at != source:
        return False, f"{path}: source {source} is not commit {commit}'s ({at}): the file ran other code"
    return True, f"{path}: source {source} is commit {commit}'s"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparsecal.formats.provenance",
                                 description="The source digest a result file's provenance records.")
    ap.add_argument("--at", metavar="REV", help="a git revision of the repository (default: the importable package)")
    ap.add_argument("--repo", default=".", help="the repository for --at and --check (default: here)")
    ap.add_argument("--check", nargs="+", metavar="FILE", help="result files whose source digest is checked "
                                                               "against the commit they name")
    args = ap.parse_args(argv)
    if args.check:
        results = [check_file(p, args.repo) for p in args.check]
        print("\n".join(line for _, line in results))
        if not all(ok for ok, _ in results):
            raise SystemExit(2)
        return
    if args.at is None:
        print(source_digest())
        return
    try:
        print(revision_digest(args.at, args.repo))
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", None) or ""
        msg = (err.decode(errors="replace") if isinstance(err, bytes) else err).strip().splitlines()
        raise UserError(f"cannot read revision {args.at!r} of the repository at {args.repo}: "
                        f"{msg[0] if msg else e}; pass a commit of this repository (git log).") from None


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        print(f"error: {err}")
        raise SystemExit(2) from None

