"""The committed 8B speed rows (data/calibration/llama8b-4l-random-h100-s51 and -s52) read, checked by
evaluation.store.read_timing, as data/bench/NOTES.md "the 8B rows with the kernels as they run after
s50" and "the 8B rows at 128K, s52" quote them (issue 28's end-to-end line)."""
import shutil

import pytest

from sparsecal.evaluation.store import TIMING, read_timing

from helpers import ROOT

S51 = ROOT / "data" / "calibration" / "llama8b-4l-random-h100-s51" / "eval8b" / "timing.parquet"
S52 = ROOT / "data" / "calibration" / "llama8b-4l-random-h100-s52" / "eval8b"


def _read(tmp_path, src) -> list[dict]:
    """The rows of the committed timing table ``src``, read as an eval directory's through read_timing."""
    (tmp_path / TIMING).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, tmp_path / TIMING)
    return list(read_timing(tmp_path).iter_rows(named=True))


@pytest.fixture
def rows(tmp_path):
    return {(r["length"], r["label"]): r for r in _read(tmp_path, S51)}


def test_the_s51_rows_are_the_run_the_notes_describe(rows):
    """32K and 64K, seven configurations each, 4 rounds on an H100, the decode appending in place; 128K
    absent (its process ran out of memory)."""
    assert {n for n, _ in rows} == {32768, 65536} and len(rows) == 14
    assert {r["rounds"] for r in rows.values()} == {4}
    assert {r["speed_device"] for r in rows.values()} == {"NVIDIA H100 80GB HBM3"}
    assert {r["decode_cache"] for r in rows.values()} == {"in_place"}


def test_with_dispatch_every_row_is_within_the_quoted_ranges(rows):
    """With dispatch: TTFT eager 0.984-1.162, graph 0.993-1.178, graph TPOT 0.998-1.045, every decode dense.
    The one eager point below 0.99 (blasst:0.5+dispatch at 32K, 0.984 [0.964, 0.997]) and its twin
    (blasst:0.3+dispatch, 0.990) run no sparse layer: below 65,536 tokens their prefill is dense."""
    disp = {k: r for k, r in rows.items() if k[1].endswith("+dispatch")}
    assert len(disp) == 6
    eager = sorted(r["speedup_ttft"] for r in disp.values())
    assert eager[0] == pytest.approx(0.984, abs=5e-4) and eager[-1] == pytest.approx(1.162, abs=5e-4)
    graph = [r["speedup_ttft_graph"] for r in disp.values()]
    assert min(graph) == pytest.approx(0.993, abs=5e-4) and max(graph) == pytest.approx(1.178, abs=5e-4)
    tpot = [r["speedup_tpot_graph"] for r in disp.values()]
    assert min(tpot) == pytest.approx(0.998, abs=5e-4) and max(tpot) == pytest.approx(1.045, abs=5e-4)
    assert all(r["decode_sparsity"] == 0 for r in disp.values())
    below = [k for k, r in disp.items() if r["speedup_ttft"] < 0.99]
    assert below == [(32768, "blasst:0.5+dispatch")]
    r = rows[below[0]]
    assert (round(r["speedup_ttft_lo"], 3), round(r["speedup_ttft_hi"], 3)) == (0.964, 0.997)
    assert r["sparse_layers"] == 0 and rows[(32768, "blasst:0.3+dispatch")]["sparse_layers"] == 0


def test_the_predicted_rows(rows):
    """dense TTFT 1.006 / 0.997; bsfa:128+dispatch 1.066 / 1.162 (0.94 of its ideal at 64K); blasst:0.5+dispatch
    1.089 at 64K, where it runs sparse at 0.557."""
    assert [round(rows[(n, "dense")]["speedup_ttft"], 3) for n in (32768, 65536)] == [1.006, 0.997]
    assert [round(rows[(n, "bsfa:128+dispatch")]["speedup_ttft"], 3) for n in (32768, 65536)] == [1.066, 1.162]
    r = rows[(65536, "bsfa:128+dispatch")]
    assert r["speedup_ttft"] / r["ideal_ttft"] == pytest.approx(0.94, abs=0.005)
    r = rows[(65536, "blasst:0.5+dispatch")]
    assert round(r["speedup_ttft"], 3) == 1.089 and round(r["sparsity"], 3) == 0.557


def test_the_s52_128k_rows_with_dispatch_hold_the_line_with_intervals(tmp_path):
    """128K, 4 rounds, the +dispatch rows and dense: TTFT eager 1.051 / 1.381 / 1.075, graph TPOT 0.997 / 0.992 /
    0.992, each interval holding 1 and every point at >= 0.99; every decode dense (BSFA by default, BLASST past its
    law's 131072 tokens)."""
    rows = {r["label"]: r for r in _read(tmp_path, S52 / "timing-128k.parquet")}
    assert set(rows) == {"dense", "bsfa:128+dispatch", "blasst:0.5+dispatch"}
    assert {(r["length"], r["rounds"], r["speed_device"]) for r in rows.values()} == {
        (131072, 4, "NVIDIA H100 80GB HBM3")}
    got = {k: (round(r["speedup_ttft"], 3), round(r["speedup_tpot_graph"], 3)) for k, r in rows.items()}
    assert got == {"dense": (1.051, 0.997), "bsfa:128+dispatch": (1.381, 0.992), "blasst:0.5+dispatch": (1.075, 0.992)}
    for r in rows.values():
        assert r["speedup_tpot_graph_lo"] < 1 < r["speedup_tpot_graph_hi"]
        assert r["speedup_ttft_graph"] >= 0.99 and r["decode_sparsity"] == 0
    r = rows["bsfa:128+dispatch"]
    assert round(r["sparsity"], 3) == 0.876 and r["speedup_ttft"] / r["ideal_ttft"] == pytest.approx(0.968, abs=0.001)


def test_the_s52_3_round_rows_have_points_and_no_intervals(tmp_path):
    """3 rounds a side: no 95 % interval (ratio_interval needs 4); the points NOTES quotes."""
    rows = {r["label"]: r for r in _read(tmp_path, S52 / "timing-128k-3rounds.parquet")}
    assert len(rows) == 5 and {r["rounds"] for r in rows.values()} == {3}
    assert all(r["speedup_ttft_lo"] is None and r["speedup_tpot_graph_lo"] is None for r in rows.values())
    assert round(rows["bsfa:128+dispatch"]["speedup_ttft"], 3) == 1.376
    assert sorted(round(r["speedup_tpot_graph"], 3) for r in rows.values()) == [0.984, 0.987, 0.991, 0.993, 0.996]
