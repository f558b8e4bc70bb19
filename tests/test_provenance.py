"""formats/provenance.py: the source digest a result file records identifies the package's files, the
same read from the importable package and from a git revision, and its command answers bad input in
one line, and checks a result file's digest against the commit it names."""
import json
import subprocess
import sys

import pytest

from sparsecal.formats import provenance as pv

from helpers import ROOT


def test_the_package_layout_is_pyprojects():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert pv.PACKAGE_DIRS == cfg["package-dir"] and list(pv.PACKAGES) == cfg["packages"]
    assert [pv.repo_dir(p) for p in ("sparsecal", "sparsecal.bench", "sparsecal.kernels.sparse", "sparsecal.dashboard")] \
        == ["toolkit", "toolkit/bench", "kernels/sparse", "dashboard"]


def _repo_files():
    for pkg in pv.PACKAGES:
        for path in sorted((ROOT / pv.repo_dir(pkg)).glob("*.py")):
            yield f"{pkg}/{path.name}", path.read_bytes()


def test_the_digest_is_the_repositorys_files_and_changes_with_any_of_them():
    files = list(_repo_files())
    assert len(files) > 100 and pv.source_digest() == pv.digest(files)
    assert pv.provenance()["source"] == pv.source_digest()
    name, data = files[len(files) // 2]
    assert pv.digest([*files[:len(files) // 2], (name, data + b" "), *files[len(files) // 2 + 1:]]) != pv.digest(files)
    assert pv.digest(files[::-1]) == pv.digest(files)          # order-free


def test_a_revision_digest_is_its_files():
    """On a checkout whose package files are those of HEAD (CI's clean clone), ``--at HEAD`` gives the
    importable package's digest."""
    dirs = sorted({pv.PACKAGE_DIRS[p] for p in pv.PACKAGE_DIRS})
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *dirs], cwd=ROOT, capture_output=True, text=True,
                           check=False)
    if dirty.returncode != 0 or dirty.stdout.strip():
        pytest.skip("package files differ from HEAD here (a working copy with changes)")
    r = subprocess.run([sys.executable, "-m", "sparsecal.formats.provenance", "--at", "HEAD"], cwd=ROOT,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.strip() == pv.source_digest(), r


@pytest.mark.parametrize("args", [["--at", "no-such-revision"], ["--at", "HEAD", "--repo", "/no/such/dir"]])
def test_a_bad_revision_is_one_line_and_exit_code_2(args):
    r = subprocess.run([sys.executable, "-m", "sparsecal.formats.provenance", *args], cwd=ROOT, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 2 and r.stdout.startswith("error: ") and len(r.stdout.splitlines()) == 1, r
    assert "Traceback" not in r.stderr


def _result(tmp_path, name, prov):
    path = tmp_path / name
    path.write_text(json.dumps({"benchmark": "x", "provenance": prov}))
    return path


def test_check_holds_only_where_the_source_is_the_named_commits(tmp_path):
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    at_head = pv.revision_digest(head, str(ROOT))
    ok, line = pv.check_file(_result(tmp_path, "a.json", {"commit": head, "source": at_head}), str(ROOT))
    assert ok and at_head in line and head in line
    ok, line = pv.check_file(_result(tmp_path, "b.json", {"commit": head, "source": "0" * 12}), str(ROOT))
    assert not ok and "ran other code" in line
    ok, line = pv.check_file(_result(tmp_path, "c.json", {"commit": "0000000", "source": at_head}), str(ROOT))
    assert not ok and "not a revision" in line
    ok, line = pv.check_file(_result(tmp_path, "d.json", {"commit": head}), str(ROOT))
    assert not ok and "cannot be checked" in line


def test_check_answers_one_line_a_file_and_exit_code_2_when_one_does_not_hold(tmp_path):
    bad = _result(tmp_path, "bad.json", {"commit": "0000000", "source": "0" * 12})
    r = subprocess.run([sys.executable, "-m", "sparsecal.formats.provenance", "--check", str(bad),
                        str(_result(tmp_path, "old.json", {"commit": "abc"}))], cwd=ROOT, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 2 and len(r.stdout.splitlines()) == 2 and "Traceback" not in r.stderr, r
    (tmp_path / "junk.json").write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "sparsecal.formats.provenance", "--check", str(tmp_path / "junk.json")],
                       cwd=ROOT, capture_output=True, text=True, check=False)
    assert r.returncode == 2 and r.stdout.startswith("error: ") and len(r.stdout.splitlines()) == 1, r
