"""bench/ttft.py on the CPU (reference backend, a tiny random 2-layer Llama): which variants it
times, the sparsity it counts over all layers with and without dispatch, the ideal it derives from
the attention share, and the joinable rows. Timings themselves are not asserted (they are
measured on the GPU); the export is built so that dispatch must run one layer dense."""
import json

import pytest

from sparsecal.bench import ttft

from helpers import block_counts_torch, dispatch_export, make_checkpoint


def test_ideal_speedup_is_the_attention_share_at_the_kernel_ideal():
    assert ttft.ideal_speedup(0.6, 0.5) == pytest.approx(1 / 0.85)  # the 8B example: ~1.18x
    assert ttft.ideal_speedup(0.6, 0.75) == pytest.approx(1 / 0.775)
    assert ttft.ideal_speedup(0.0, 0.9) == 1.0 and ttft.ideal_speedup(1.0, 1.0) == 2.0


def test_run_counts_sparsity_over_all_layers_and_dispatch(tmp_path, seed):
    model = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=2, layers=2)
    # bucket 256 (a 333-token prompt): the plan runs layer 0 sparse and layer 1 (calibrated 0.1) dense;
    # BSFA k=1 with thresholds 1e30 skips every candidate tile of a sparse layer
    export = dispatch_export(tmp_path / "export")
    out = tmp_path / "ttft.json"
    ttft.main(["--model", str(model), "--export", str(export), "--lengths", "333", "--rounds", "2", "--reps", "1",
               "--warmup", "0",
               "--min-k", "1", "--device", "cpu", "--dtype", "float32", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["provenance"]["versions"]["torch"] and doc["model"].startswith(str(model.resolve()))
    rows = {(r["variant"], r.get("config")): r for r in doc["rows"]}
    assert set(rows) == {("sdpa", None), ("rest", None), ("every_layer", "k=1"), ("dispatch", "k=1"),
                         ("every_layer", "blocks=32")}
    every, disp = rows["every_layer", "k=1"], rows["dispatch", "k=1"]
    cand = 4 * int(block_counts_torch(333, 128, 64)[0].sum())  # every candidate (off-diagonal) tile, 4 heads
    reach = sum(every["reachable"])
    assert every["skipped"] == [cand, cand] and every["sparse_layers"] == 2 and reach > 2 * cand
    assert every["sparsity"] == disp["sparsity_every_layer"] == 2 * cand / reach
    assert disp["skipped"] == [cand, 0] and disp["reachable"][1] == 0 and disp["sparse_layers"] == 1
    assert disp["sparsity"] == cand / reach
    share = every["attention_share"]
    assert all(r["attention_share"] == share and r["baseline"] == "sdpa" and r["timing"] == "eager"
               for r in rows.values())
    assert every["ideal"] == pytest.approx(ttft.ideal_speedup(share, 2 * cand / reach)) == disp["ideal"]
    assert disp["speedup"] == pytest.approx(rows["sdpa", None]["ms"] / disp["ms"])
    assert all(len(r["rounds_ms"]) == 2 and r["ms"] == pytest.approx(sum(r["rounds_ms"]) / 2) for r in rows.values())
    assert disp["of_ideal"] == pytest.approx(disp["speedup"] / disp["ideal"])
    joined = json.loads((tmp_path / "ttft-rows.json").read_text())
    assert joined["kind"] == "sparsecal-bench"
    assert [(r["method"], r["config"], r["length"], r["sparsity"], r["task"]) for r in joined["rows"]] == [
        ("bsfa", "k=1", 333, cand / sum(disp["reachable"]), "ttft"),  # counted as eval counts it
        ("window", "blocks=32", 333, rows["every_layer", "blocks=32"]["sparsity"], "ttft")]
