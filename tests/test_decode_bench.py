"""bench/decode.py --quick: the decode benchmark end to end on the CPU (TRITON_INTERPRET=1) at a tiny
shape: the kernel checks pass and every variant is timed with its counted sparsity and V-skip share."""
import json
from dataclasses import replace

import pytest

from sparsecal.bench import decode as bench_decode
from sparsecal.bench import decode_report as report
from sparsecal.formats.errors import UserError

from helpers import INTERPRETER_WARNINGS, ROOT


@INTERPRETER_WARNINGS
def test_quick_run(tmp_path):
    out = tmp_path / "decode.json"
    bench_decode.main(["--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "decode" and doc["provenance"]["commit"] is not None
    assert doc["check"]["ok"] and {r["kernel"] for r in doc["check"]["rows"]} == {"group", "ragged", "old", "paged"}
    (shape,) = doc["shapes"]
    rows = {r["variant"]: r for r in shape["rows"]}
    assert {"old_dense", "group_dense", "old_blasst_s50", "group_bsfa_group_s75", "group_blasst_head_s50"} <= set(rows)
    for name, r in rows.items():
        assert r["ms"] > 0 and len(r["rounds_ms"]) == 1 and r["graph_rounds_ms"] is None   # one round, no GPU
        assert r["speedup_vs_sdpa_lo"] is None   # one round: no interval
        if name not in ("old_dense", "group_dense"):
            assert 0.0 < r["v_skip"] <= r["sparsity"] <= 1.0 and r["err_row0"] < 3e-2, name  # bf16 inputs
            assert r["ideal"] == 1.0 / (1.0 - r["v_skip"] / 2.0)


@INTERPRETER_WARNINGS
def test_quick_sweep(tmp_path):
    """--sweep --quick: every dense configuration passes its ragged / paged check, each shape's
    candidates are checked and timed, and the winners make the table."""
    out = tmp_path / "sweep.json"
    bench_decode.main(["--sweep", "--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "decode-sweep" and doc["provenance"]["commit"] is not None
    assert doc["check"] and all(r["ok"] for r in doc["check"])
    (shape,) = doc["shapes"]
    kinds = {r["kind"] for r in shape["rows"]}
    assert kinds == {"dense", "sparse"} and all(r["ok"] and r["ms"] > 0 for r in shape["rows"])
    assert any(r["config"] != "attend" and r["config"]["fuse"] for r in shape["rows"] if r["kind"] == "dense")
    assert any(r["config"] != "attend" and r["config"]["tma"] for r in shape["rows"] if r["kind"] == "dense")
    assert any(r["config"]["fuse"] and r["config"]["step_if"] for r in shape["rows"] if r["kind"] == "sparse")
    assert any(r["config"]["tma"] for r in shape["rows"] if r["kind"] == "sparse")
    assert {"dense", "s75"} <= set(shape["winners"]) and list(doc["table"]) == ["64,4,16384,1"]
    assert all(0.0 < r["v_skip"] <= r["sparsity"] <= 1.0 for r in shape["rows"] if r["kind"] == "sparse")


def test_rounds_alternate_the_order_of_the_variants():
    """timed_rounds (CPU, quick: no graphs) times the variants in speed_stats.round_order: given order, then reversed."""
    calls = []
    variants = {name: ((lambda name=name: calls.append(name)), {}) for name in ("sdpa", "group_dense", "old_dense")}
    eager, graph = bench_decode.timed_rounds(variants, 4, quick=True)
    assert calls == ["sdpa", "group_dense", "old_dense", "old_dense", "group_dense", "sdpa"] * 2
    assert all(len(t) == 4 for t in eager.values()) and graph == {}


def test_reports_say_when_a_runs_rounds_kept_one_order(capsys):
    """decode_report names the committed (pre-s49) targets files as timed in one fixed order; a run that records
    round_order (every bench run since) gets no such line."""
    files = [str(ROOT / "data" / "bench" / "decode-targets-s42-b16-h100-d128.json.gz")]
    report.main(["--targets", *files])
    out = capsys.readouterr().out
    assert f"{files[0]}: Timed in one fixed order every round" in out
    assert report.order_note({"round_order": "alternating"}) == "" and report.order_note({}).startswith("\nTimed")


def test_the_s50_targets_read_as_the_notes_quote_them(capsys):
    """NOTES "the decode targets with alternating rounds" (s50): timed each way round, the counts of s43's fixed-order
    run again: the own dense interval reaches 1.0 at 9 of 18 shapes, the group decision reaches 0.90 of its ideal in
    29 of 36 cells by the median (30 by the upper end), and the dispatched floor is below 0.99 at the same two
    shapes (D=128 G=4 16K, D=64 G=8 64K); the report prints no fixed-order line for these files."""
    files = [str(ROOT / "data" / "bench" / f"decode-targets-s50-b16-h100-d{d}.json.gz") for d in (128, 64)]
    rows = [r for f in files for r in report.targets_rows(report.read(f, "decode"), f)]
    c = report.counts(rows)
    assert (c["shapes"], c["dense_reaching_1"], c["cells"], c["of_ideal_median"], c["of_ideal_hi"]) == (
        18, 9, 36, 29, 30)
    assert c["floor_below"] == [(128, 4, 16384, 0.987), (64, 8, 65536, 0.988)]
    assert all(0.985 < r["own"][0] < 1.01 for r in rows)
    report.main(["--targets", *files])
    assert "fixed order" not in capsys.readouterr().out


def test_speedups_carry_the_interval_of_their_rounds():
    """bench.decode.speedups: ratios of medians against the best SDPA, each with speed_stats'
    interval from exactly the rounds given; graph speedups only where both have graph rounds."""
    from sparsecal.evaluation.speed_stats import ratio_interval

    best, mine = [1.00, 1.02, 0.99, 1.01, 1.00], [0.95, 0.96, 0.94, 0.97, 0.95]
    gbest, gmine = [0.90, 0.91, 0.92, 0.90, 0.91], [0.93, 0.92, 0.94, 0.93, 0.95]
    row = bench_decode.speedups({}, mine, gmine, best, gbest)
    assert row["speedup_vs_sdpa"] == 1.00 / 0.95
    want = ratio_interval(best, mine)
    assert (row["speedup_vs_sdpa_lo"], row["speedup_vs_sdpa_hi"]) == (want["lo"], want["hi"]) and want["lo"] > 1.0
    assert row["graph_speedup_vs_sdpa"] == 0.91 / 0.93 and row["graph_speedup_vs_sdpa_hi"] < 1.0   # slower, surely
    assert "graph_speedup_vs_sdpa" not in bench_decode.speedups({}, mine, "not captured: X", best, gbest)


def test_each_speedup_is_against_the_sdpa_fastest_that_way():
    """The eager and the graph baselines are picked separately (cuDNN can win eager and Flash as a
    graph); capture errors and non-SDPA variants never are."""
    eager = {"sdpa_cudnn_native": [1.0, 1.01, 0.99], "sdpa_flash_native": [1.02, 1.03, 1.02], "group_dense": [0.5]}
    graph = {"sdpa_cudnn_native": [0.95, 0.96, 0.95], "sdpa_flash_native": [0.94, 0.95, 0.94],
             "sdpa_efficient_native": "not captured: RuntimeError: x", "group_dense": [0.1]}
    assert bench_decode.fastest_sdpa(eager) == "sdpa_cudnn_native"
    assert bench_decode.fastest_sdpa(graph) == "sdpa_flash_native"
    assert bench_decode.fastest_sdpa({"group_dense": [0.1]}) is None


def test_sparse_candidates_hold_the_tables_launch_once():
    """The sweep times the table's own launch at every shape (s41's G 4/8 re-sweep left it out where
    the table's launch had 2 stages), beside its fused / staged variants, step_if the other way, and both ways of
    loading K (a TMA entry against its plain twin, s42) at half, once and twice its programs per SM,
    each launch once."""
    from sparsecal.bench.decode_sweep import sparse_candidates
    from sparsecal.kernels.sparse.decode_group import SPARSE_TABLE, sparse_launch_for

    for (d, g, n) in SPARSE_TABLE:
        cands = sparse_candidates(d, g, n, quick=False)
        table = sparse_launch_for(d, g, n)
        names = [c.name() for c in cands]
        assert table in cands and len(names) == len(set(names)), (d, g, n)
        assert replace(table, step_if=not table.step_if) in cands, (d, g, n)
        same = [c for c in cands if c.warps == table.warps and not c.fuse and c.step_if == table.step_if]
        assert {2, 3, 4} == {c.stages for c in same if c.pps == table.pps and c.tma == table.tma}
        for tma in (False, True):
            assert {table.pps // 2, table.pps, table.pps * 2} == {
                c.pps for c in same if c.stages == table.stages and c.tma == tma}, (d, g, n, tma)
            assert {2, 3} <= {c.stages for c in same if c.tma == tma and c.pps == table.pps}


def test_the_dense_check_covers_the_swept_head_dims_only():
    """A sweep of one head dim checks its dense configurations at that head dim's shapes (a cold
    machine spent a whole short call on the check of both, s42); both dims give every shape."""
    from sparsecal.bench.decode_sweep import CHECK_SHAPES, check_shapes

    assert check_shapes((128,)) == [(8, 2, 128)]
    assert check_shapes((64,)) == [(8, 8, 64), (8, 1, 64)]
    assert check_shapes((64, 128)) == list(CHECK_SHAPES)


def test_the_report_counts_the_committed_targets_runs_one_way():
    """bench.decode_report on the committed H100 targets runs (s41, s42): the must-show counts NOTES
    records, counted by the median and by the interval's upper end (s41's notes rounded to two places
    and read 25/36 where the median gives 21), and the two dispatched floors below 0.99."""
    bench = ROOT / "data" / "bench"
    got = {}
    for run in ("s41", "s42"):
        rows = [r for d in (128, 64) for r in report.targets_rows(report.read(bench / f"decode-targets-{run}-b16-h100-d{d}.json.gz",
                                                                     "decode"))]
        got[run] = report.counts(rows)
        assert got[run]["shapes"] == 18 and got[run]["cells"] == 36
        assert "Dense interval reaching 1.0" in report.targets_markdown(rows)
    assert [got[r]["dense_reaching_1"] for r in ("s41", "s42")] == [10, 7]
    assert [(got[r]["of_ideal_median"], got[r]["of_ideal_hi"]) for r in ("s41", "s42")] == [(21, 22), (28, 28)]
    assert [s[:3] for s in got["s42"]["floor_below"]] == [(128, 4, 16384), (64, 8, 65536)]


def test_the_report_holds_a_sweep_against_this_trees_tables():
    """Against the sweeps the sparse table is from (sweep 10 at D=128, the s43 G = 4/8 re-sweeps at both
    head dims) every table launch was timed and is within 3 % of the fastest; sweep 8 did not time this
    tree's TMA entries, nor sweep 10 its D=64 G=4 step_if entry, which is one line each; a file of the
    other benchmark is one line too."""
    bench = ROOT / "data" / "bench"
    runs = {"decode-sweep10-b16-h100-d128.json": 9, "decode-resweep-s43-h100-d128.json": 6,
            "decode-resweep-s43-h100-d64.json": 6}
    for name, count in runs.items():
        rows = report.sweep_rows(report.read(bench / name, "decode-sweep"))
        assert len(rows) == count and all(0.97 <= r[k][4] <= 1.0 for r in rows for k in ("dense", "s50", "s75"))
    with pytest.raises(UserError, match="w2s3p8-tma was not timed"):
        report.sweep_rows(report.read(bench / "decode-sweep8-b16-h100-d128.json", "decode-sweep"))
    with pytest.raises(UserError, match="D=64 G=4 32768: the table's launch bsfa_group_s50_w1s3p16-if-tma was not"):
        report.sweep_rows(report.read(bench / "decode-sweep10-b16-h100-d64.json", "decode-sweep"))
    with pytest.raises(UserError, match="not 'decode'; pass --sweep"):
        report.read(bench / "decode-sweep10-b16-h100-d64.json", "decode")


def test_the_h200_targets_and_the_rate_each_kernel_streams_at_read_as_the_notes_quote_them():
    """NOTES "the issue 28 targets on an H200" (s53): dense interval reaching 1.0 at 11 of 18, sparse at 0.90 of the
    ideal 20 of 36 by the median (21 by the upper end), the two D=64 G=8 floors below 0.99. ``--bandwidth``: at G=1
    the BSFA group decision streams the cache at >= 0.94 of the own dense kernel's rate on both GPUs; at G=4 D=128
    at 0.87-0.94 on the H100 (s50) and 0.72-0.83 on the H200, where the dense kernel streams 4.2-4.5 TB/s."""
    bench = ROOT / "data" / "bench"
    h200 = [report.read(bench / f"decode-targets-s53-b16-h200-d{d}.json.gz", "decode") for d in (128, 64)]
    assert all(doc["provenance"]["gpu"] == "NVIDIA H200" for doc in h200)
    c = report.counts([r for doc in h200 for r in report.targets_rows(doc)])
    assert (c["dense_reaching_1"], c["of_ideal_median"], c["of_ideal_hi"]) == (11, 20, 21)
    assert [s[:3] for s in c["floor_below"]] == [(64, 8, 16384), (64, 8, 32768)]
    h100 = [report.read(bench / f"decode-targets-s50-b16-h100-d{d}.json.gz", "decode") for d in (128, 64)]
    rates = {gpu: [r for doc in docs for r in report.bandwidth_rows(doc)] for gpu, docs in (("h100", h100),
                                                                                           ("h200", h200))}
    for rows in rates.values():
        assert len(rows) == 18 and all(r[f"s{t}"][1] >= 0.94 for r in rows if r["group"] == 1 for t in (50, 75))
    g4 = {gpu: [r[f"s{t}"][1] for r in rows if (r["d"], r["group"]) == (128, 4) for t in (50, 75)]
          for gpu, rows in rates.items()}
    assert 0.87 <= min(g4["h100"]) and max(g4["h100"]) <= 0.94
    assert 0.72 <= min(g4["h200"]) and max(g4["h200"]) <= 0.83
    assert all(4.2 <= r["own"] <= 4.5 for r in rates["h200"] if (r["d"], r["group"]) == (128, 4))
    assert "| 128 | 4 | 16K | 4.21 | 4.23 | 3.30 (0.78) | 3.03 (0.72) |" in report.bandwidth_markdown(rates["h200"])
