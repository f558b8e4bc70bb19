"""formats/dispatch.py: the break-even of given timings, the break-even file and its checks, the
interpolation in log(length), the rule (which layers run sparse) and the export's dispatch record."""
import json
import math

import numpy as np
import pytest

from sparsecal.formats import dispatch as D
from sparsecal.formats.errors import UserError

GEO = {"block_m": 128, "block_n": 64, "heads": 9, "kv_heads": 3, "head_dim": 64, "dtype": "bfloat16"}


def _pts(*pairs):
    return [{"sparsity": s, "ms": ms} for s, ms in pairs]


def test_break_even_at_exact_crossings():
    assert D.break_even(_pts((0.0, 10.0), (0.5, 6.0), (1.0, 2.0)), 8.0) == 0.25  # 10 -> 6 over 0.5 crosses 8 at 0.25
    assert D.break_even(_pts((0.0, 10.0), (0.5, 8.0)), 8.0) == 0.5  # equal to dense is "no slower"
    assert D.break_even(_pts((0.5, 8.0), (0.0, 10.0)), 8.0) == 0.5  # any order of points


def test_break_even_never_and_always():
    assert D.break_even(_pts((0.0, 10.0), (0.9, 8.5)), 8.0) == D.NEVER
    assert D.break_even([], 8.0) == D.NEVER
    # a noisy dip below dense, then slower again at the most skipping point: it does not pay
    assert D.break_even(_pts((0.0, 10.0), (0.5, 7.0), (0.9, 8.1)), 8.0) == D.NEVER
    assert D.break_even(_pts((0.0, 7.0), (0.5, 5.0)), 8.0) == 0.0          # pays without skipping
    assert D.break_even(_pts((0.25, 7.0), (0.5, 5.0)), 8.0) == 0.25        # pays from the first measured point


def test_break_even_takes_the_last_crossing():
    pts = _pts((0.0, 10.0), (0.25, 7.0), (0.5, 9.0), (0.75, 5.0))
    assert D.break_even(pts, 8.0) == pytest.approx(0.5 + (9 - 8) / (9 - 5) * 0.25)


def test_break_even_is_where_the_interpolated_time_meets_dense(np_rng):
    for _ in range(50):
        s = np.sort(np_rng.uniform(0, 1, 6))
        ms = np.sort(np_rng.uniform(1, 10, 6))[::-1]     # skipping more is faster
        dense = float(np_rng.uniform(ms[-1] + 0.01, ms[0] - 0.01))
        be = D.break_even(_pts(*zip(s.tolist(), ms.tolist())), dense)
        assert s[0] <= be <= s[-1]
        assert np.interp(be, s, ms) == pytest.approx(dense, rel=1e-9)
        assert all(t <= dense for x, t in zip(s, ms) if x >= be + 1e-12)


def _measured(method="bsfa", length=1024, dense=None, points=None, head_dim=64, group=3):
    return {"method": method, "head_dim": head_dim, "group": group, "length": length,
            "dense": dense or {"CUDNN_ATTENTION": 8.0, "FLASH_ATTENTION": 9.0},
            "points": points or _pts((0.0, 10.0), (0.5, 6.0), (0.9, 3.0))}


def test_rows_pick_the_fastest_backend_and_round_trip(tmp_path):
    measured = [_measured(length=4096, dense={"CUDNN_ATTENTION": 9.0, "FLASH_ATTENTION": 8.0}),
                _measured(), _measured("blasst", points=_pts((0.0, 12.0), (0.9, 9.0)))]
    doc = D.break_even_file(measured, GEO, {"gpu": "NVIDIA H100", "commit": "abc1234"}, {"name": "r", "model": "m"})
    rows = {(r["method"], r["length"]): r for r in doc["rows"]}
    assert rows[("bsfa", 1024)]["dense_backend"] == "CUDNN_ATTENTION" and rows[("bsfa", 1024)]["break_even"] == 0.25
    assert rows[("bsfa", 4096)]["dense_backend"] == "FLASH_ATTENTION" and rows[("bsfa", 4096)]["dense_ms"] == 8.0
    assert rows[("blasst", 1024)]["break_even"] is None  # never
    D.write_break_even(tmp_path / "be.json", doc)
    back = D.load_break_even(tmp_path / "be.json")
    assert back == json.loads(json.dumps(doc)) and back["gpu"] == "NVIDIA H100"
    assert [r["length"] for r in D.rows_for(back, "bsfa", 64, 3)] == [1024, 4096]


def test_break_even_file_refusals(tmp_path):
    doc = D.break_even_file([_measured()], GEO, {"gpu": None})
    path = tmp_path / "be.json"
    for edit, needle in ((lambda d: d["rows"][0].update(break_even=0.9), "not what its points give"),
                         (lambda d: d["rows"][0]["points"][0].update(sparsity=1.5), r"rows\[0\]"),
                         (lambda d: d["rows"].append(dict(d["rows"][0])), "two rows"),
                         (lambda d: d["geometry"].pop("head_dim"), "geometry"),
                         (lambda d: d.update(kind="sparsecal-run"), "not a sparsecal-break-even"),
                         (lambda d: d.update(schema_version=0), "schema version 0")):
        bad = json.loads(json.dumps(doc))
        edit(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(UserError, match=needle):
            D.load_break_even(path)
    with pytest.raises(UserError, match="does not exist"):
        D.load_break_even(tmp_path / "none.json")
    with pytest.raises(UserError, match="no SDPA backend"):
        D.break_even_rows([_measured(dense={"x": 1.0}) | {"dense": {}}])


def test_merged_files_keep_every_row_and_refuse_a_key_twice():
    """merge_break_even: rows of two files side by side (decode rows of two batches at one key but
    the batch), the files listed; a row twice, another GPU or another geometry refused in one line."""
    def dec(batch):
        return dict(_measured(), phase="decode", timing="graph", decision="head", batch=batch)

    a = D.break_even_file([_measured(), dec(16)], GEO, {"gpu": "H100", "commit": "a1", "date": "d1"})
    b = D.break_even_file([dec(1)], GEO, {"gpu": "H100", "commit": "b2", "date": "d2"})
    merged = D.merge_break_even([("a.json", a), ("b.json", b)])
    assert [(r["phase"], r.get("batch")) for r in merged["rows"]] == [("decode", 1), ("decode", 16), ("prefill", None)]
    assert [(f["name"], f["commit"]) for f in merged["files"]] == [("a.json", "a1"), ("b.json", "b2")]
    assert D.decode_batches(merged, "bsfa", 64, 3, "graph", "head") == [1, 16]
    for other, needle in ((a, ("a.json and b.json both hold a row for decode graph head bsfa head_dim 64 group 3 "
                               "length 1024 batch 16")),
                          (dict(b, gpu="A100"), "b.json was measured on A100"),
                          (dict(b, geometry=dict(GEO, block_n=128)), "block_n 128")):
        with pytest.raises(UserError, match=needle) as e:
            D.merge_break_even([("a.json", a), ("b.json", other)])
        assert "\n" not in str(e.value)


def test_check_model_names_the_mismatch():
    doc = D.break_even_file([_measured()], GEO, {})
    D.check_model("be.json", doc, 64, 3, 128, 64)
    with pytest.raises(UserError, match="measured for head_dim 64 group 3, but the model has head_dim 128 group 4"):
        D.check_model("be.json", doc, 128, 4, 128, 64)
    with pytest.raises(UserError, match="128 x 64 tiles, but the run is calibrated at 128 x 128"):
        D.check_model("be.json", doc, 64, 3, 128, 128)


def _rows(*pairs):
    return [{"length": n, "break_even": b, "dense_backend": "CUDNN_ATTENTION" if n < 3000 else "FLASH_ATTENTION"}
            for n, b in pairs]


def test_interpolation_in_log_length_and_the_nearest_outside():
    rows = _rows((1024, 0.4), (4096, 0.6))
    be, ext, backends = D.break_even_at(rows, [512, 1024, 2048, 4096, 8192])
    np.testing.assert_allclose(be, [0.4, 0.4, 0.5, 0.6, 0.6])  # 2048 is half-way in log(length)
    assert ext.tolist() == [True, False, False, False, True]
    assert backends == ["CUDNN_ATTENTION", "CUDNN_ATTENTION", "CUDNN_ATTENTION", "FLASH_ATTENTION", "FLASH_ATTENTION"]
    be, _, _ = D.break_even_at(_rows((1024, 0.4), (4096, None)), [1024, 2048, 4096])
    assert be[0] == 0.4 and math.isinf(be[1]) and math.isinf(be[2])  # never at either end: never between
    be, ext, _ = D.break_even_at(_rows((2048, 0.3)), [1024, 2048, 4096])
    assert be.tolist() == [0.3, 0.3, 0.3] and ext.tolist() == [True, False, True]


def test_plan_runs_sparse_iff_sparsity_reaches_break_even():
    sparsity = [[0.5, 0.5, 0.2], [0.3, np.nan, 0.9], [0.4, 0.95, 0.97]]
    be = [0.4, math.inf, 0.9]
    assert D.plan(sparsity, be).tolist() == [[True, False, False], [False, False, True], [True, False, True]]
    assert D.plan(sparsity, be, margin=0.05).tolist() == [[True, False, False], [False, False, False],
                                                           [False, False, True]]
    assert D.plan(np.zeros((2, 1)), [0.0]).tolist() == [[True], [True]]  # pays without skipping


def test_bucket_is_the_largest_calibrated_length_at_or_below():
    lengths = [1024, 2048, 4096]
    assert [D.bucket(lengths, n) for n in (100, 1023, 1024, 2047, 2048, 5000, 10 ** 6)] == [None, None, 0, 0, 1, 2, 2]


def _record(margin=0.0):
    be_doc = D.break_even_file([_measured(length=1024), _measured(length=4096, points=_pts((0.0, 10.0), (0.9, 7.0)))],
                               GEO, {"gpu": "G", "commit": "c0ffee1", "date": "2026-12-01"})
    cfgs = [{"method": "bsfa", "config": "k=16", "value": 16, "source": "held-out",
             "sparsity": [[0.3, 0.2], [0.5, 0.2], [np.nan, np.nan]]},
            {"method": "blasst", "config": "target=0.5", "value": 0.5, "source": "held-out",
             "sparsity": [[0.9, 0.9], [0.1, 0.1], [np.nan, np.nan]]}]
    return D.dispatch_record(cfgs, [1024, 2048], be_doc, "be.json", 64, 3, margin)


def test_dispatch_record_applies_the_rule_and_validates():
    rec, missing = _record()
    assert missing == ["blasst"] and [c["config"] for c in rec["configs"]] == ["k=16"]
    e = D.find_config(rec, "bsfa", 16)
    # break-even 0.25 at 1024; at 4096 0 + (10 - 8) / 3 * 0.9 = 0.6; 2048 half-way in log(length): 0.425
    assert e["break_even"] == pytest.approx([0.25, 0.425]) and e["extrapolated"] == [False, False]
    assert e["sparse"] == [[True, False], [True, False], [False, False]]
    assert e["sparsity"][2] == [None, None] and rec["break_even_file"]["commit"] == "c0ffee1"
    assert D.find_config(rec, "bsfa", 32) is None and D.find_config(None, "bsfa", 16) is None
    doc = json.loads(json.dumps(rec))
    D.check_dispatch("blasst.json", doc, 3)
    doc["configs"][0]["sparse"][1][1] = True
    with pytest.raises(UserError, match="not the rule applied"):
        D.check_dispatch("blasst.json", doc, 3)
    with pytest.raises(UserError, match="per layer \\(4\\)"):
        D.check_dispatch("blasst.json", json.loads(json.dumps(rec)), 4)
    assert _record(margin=0.3)[0]["configs"][0]["sparse"] == [[False, False], [False, False], [False, False]]


def test_layer_ranges():
    assert D.layer_ranges([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8" and D.layer_ranges([]) == "-"
