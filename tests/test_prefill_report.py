"""bench/prefill_report.py: the prefill targets table for the kernel prefill_pick runs, read from the
committed H100 runs, and its one-line answers to files it cannot read."""
import gzip
import json
import subprocess
import sys

import pytest

from sparsecal.bench import prefill_report as report
from sparsecal.formats.errors import UserError

from helpers import ROOT

BENCH = ROOT / "data" / "bench"
# In order: a later file's shapes replace an earlier file's. s46's 16K runs are of the kernels as they run now
# (the decision by warp votes); the other shapes are of earlier trees, which the report's last column names.
D64 = (BENCH / "prefill-gluon-h100-d64-s44b-64k.json.gz", BENCH / "prefill-gluon-h100-d64-s45-16k32k.json.gz",
       BENCH / "prefill-gluon-h100-d64-s46-16k.json.gz")
D128 = (BENCH / "prefill-gluon-h100-d128-s43.json.gz", BENCH / "prefill-gluon-h100-d128-s45-16k.json.gz",
        BENCH / "prefill-gluon-h100-d128-s46-16k.json.gz")
RUNS = (*D64, *D128)


def test_the_committed_runs_read_as_the_notes_count_them():
    """9 shapes a head dim, 16K from s46's run of the vote kernels, the rest from earlier trees. The
    picked kernel per cell (at D=64 the ws kernel except BSFA expected to skip, the two-tile paired
    kernel; at D=128 the one-partition kernel with nothing skipped) and the counts NOTES "the decision by
    warp votes" quotes: nothing skipped at its goal 5 of 36 (D=128 only), at 0.90 of the ideal by the
    median 13 of 72, all D=64 BSFA, every 16K cell of it among them."""
    rows, notes = report.latest_rows(RUNS)
    assert len(rows) == 18 and {(r["d"], r["n"]) for r in rows} == {(d, n) for d in (64, 128)
                                                                      for n in (16384, 32768, 65536)}
    assert len(notes) == 9 and sum("s46-16k" in x.split(" replaces ")[0] for x in notes) == 6
    by = {(r["d"], r["n"], r["group"]): r for r in rows}
    assert by[(64, 32768, 4)]["bsfa_s50"][0] == "gluon_pair_two" and by[(64, 32768, 4)]["blasst_s50"][0] == "gluon_ws"
    assert by[(64, 32768, 4)]["bsfa_s0"][0] == "gluon_ws" and by[(64, 32768, 4)]["blasst_s75"][0] == "gluon_ws"
    assert by[(128, 32768, 4)]["bsfa_s0"][0] == "gluon" and by[(128, 32768, 4)]["bsfa_s75"][0] == "gluon_ws"
    assert {r["run"] for r in rows if r["n"] == 16384} == {"95fe9ee f90b5a145cf9"}
    assert {r["run"] for r in rows if r["n"] > 16384} == {"72c36f2", "41b858f", "f48cf69"}
    at_goal = sorted((r["d"], r["n"], r["group"], m) for r in rows for m in report.METHODS
                     if r[f"{m}_s0"][1][0] >= report.NOTHING_SKIPPED[r["d"]])
    assert at_goal == [(128, 16384, 1, "blasst"), (128, 32768, 1, "blasst"), (128, 32768, 1, "bsfa"),
                       (128, 32768, 4, "bsfa"), (128, 32768, 8, "bsfa")], at_goal
    at_ideal = sorted((r["d"], r["n"], s, r["group"], m) for r in rows for m in report.METHODS for s in (50, 75)
                      if r[f"{m}_s{s}"][1][0] >= report.OF_IDEAL)
    assert at_ideal == [(64, 16384, s, g, "bsfa") for s in (50, 75) for g in (1, 4, 8)] + [
        (64, 32768, 50, 1, "bsfa")] + [(64, n, 75, g, "bsfa") for n in (32768, 65536) for g in (1, 4, 8)], at_ideal
    c = report.counts(rows)
    assert c == {"shapes": 18, "zero_cells": 36, "zero_at_goal": 5, "sparse_cells": 72, "of_ideal_median": 13,
                 "of_ideal_hi": 25}
    zero64 = [r["bsfa_s0"][1][0] for r in rows if r["d"] == 64 and r["n"] == 16384]
    assert 0.89 < min(zero64) and max(zero64) < 0.92
    text = report.targets_markdown(rows)
    assert text.count("\n| ") == 18 and "5/36" in text and "13/72 by the median" in text and "| 95fe9ee" in text


def test_a_file_without_the_picked_kernel_or_with_a_damaged_value_is_one_line(tmp_path):
    doc = report.read(RUNS[0])
    for shape in doc["targets"]:
        shape["rows"] = [r for r in shape["rows"] if not r["variant"].startswith("gluon_pair")]
    with pytest.raises(UserError, match=r"gluon_pair_two_bsfa_s50, the kernel prefill_pick runs there, was not timed; "
                                        r"run the benchmark with --variants gluon_pair_two"):
        report.targets_rows(doc, "d64")
    doc = report.read(D128[0])
    doc["targets"][0]["rows"][-1]["of_ideal_best"] = float("nan")  # gluon_ws_blasst_s75, picked at 75 %
    with pytest.raises(UserError, match="not a finite number"):
        report.targets_rows(doc, "d128")


def test_other_files_are_refused_with_one_line_and_exit_code_2(tmp_path):
    decode = BENCH / "decode-targets-s43-b16-h100-d64.json.gz"
    with pytest.raises(UserError, match="'decode' benchmark without prefill targets"):
        report.read(decode)
    bad = tmp_path / "x.json.gz"
    bad.write_bytes(gzip.compress(b"{not json"))
    with pytest.raises(UserError, match="not a readable prefill benchmark file"):
        report.read(bad)
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    r = subprocess.run([sys.executable, "-m", "sparsecal.bench.prefill_report", str(tmp_path / "list.json")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and r.stdout.strip().count("\n") == 0 and "'list' benchmark" in r.stdout, r
    assert "Traceback" not in r.stderr
