"""bench/decode.py --quick: the decode benchmark end to end on the CPU (TRITON_INTERPRET=1) at a tiny
shape: the kernel checks pass and every variant is timed with its counted sparsity and V-skip share."""
import json

from sparsecal.bench import decode as bench_decode

from helpers import INTERPRETER_WARNINGS


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
        assert r["ms"] > 0
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
    assert {"dense", "s75"} <= set(shape["winners"]) and list(doc["table"]) == ["64,4,16384,1"]
    assert all(0.0 < r["v_skip"] <= r["sparsity"] <= 1.0 for r in shape["rows"] if r["kind"] == "sparse")
