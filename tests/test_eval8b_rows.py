"""The committed 8B speed rows (data/calibration/llama8b-4l-random-h100-s51) read, checked by
evaluation.store.read_timing, as data/bench/NOTES.md "the 8B rows with the kernels as they run after
s50" quotes them (issue 28's end-to-end line)."""
import shutil

import pytest

from sparsecal.evaluation.store import TIMING, read_timing

from helpers import ROOT

S51 = ROOT / "data" / "calibration" / "llama8b-4l-random-h100-s51" / "eval8b" / "timing.parquet"


@pytest.fixture
def rows(tmp_path):
    (tmp_path / TIMING).parent.mkdir(parents=True)
    shutil.copy(S51, tmp_path / TIMING)
    df = read_timing(tmp_path)
    return {(r["length"], r["label"]): r for r in df.iter_rows(named=True)}


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
