"""Decode dispatch (issue 28 part 3), on the CPU: break-even rows per phase and timing (old files
load as prefill, eager), the record's decode entries (round trip, one-line refusals when damaged),
sparsify following the decode plan on a tiny random Llama (reference backend), the export from a
file with and without decode rows, and the break-even bench's --quick decode path (interpreter)."""
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import sparsecal
from sparsecal.bench import breakeven as B
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.cli import app
from sparsecal.formats import dispatch as D
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import load_blasst, write_blasst
from sparsecal.integrations.exports import write_bsfa

from helpers import DISPATCH_LENGTHS, INTERPRETER_WARNINGS, NOOP_BLASST_FACTOR, make_checkpoint

runner = CliRunner()
PTS = [{"sparsity": 0.0, "ms": 10.0}, {"sparsity": 1.0, "ms": 2.0}]  # break-even 0.5 against 6 ms


def _be_doc(decode=True, timing="graph"):
    """Prefill (eager) and decode (``timing``, head decision) rows at head_dim 64, group 2: break-even
    0.5 everywhere; FLASH the faster dense backend of decode, cuDNN of prefill."""
    measured = [{"method": m, "head_dim": 64, "group": 2, "length": n, "points": PTS,
                 "dense": {"CUDNN_ATTENTION": 6.0, "FLASH_ATTENTION": 7.0}}
                for m in D.METHODS for n in DISPATCH_LENGTHS]
    if decode:
        measured += [{"phase": "decode", "timing": timing, "decision": "head", "batch": 1, "method": m,
                      "head_dim": 64, "group": 2, "length": n, "points": PTS,
                      "dense": {"CUDNN_ATTENTION": 7.0, "FLASH_ATTENTION": 6.0}}
                     for m in D.METHODS for n in DISPATCH_LENGTHS]
    geo = {"block_m": 128, "block_n": 64, "heads": 4, "kv_heads": 2, "head_dim": 64}
    return D.break_even_file(measured, geo, {"gpu": "test", "commit": "c0ffee1"})


def _record(decode_layer1, be_doc=None, decode_layer0=0.9):
    """Prefill never sparse (sparsity 0); BSFA k=1 decode topk: layer 0 at ``decode_layer0``, layer 1
    at ``decode_layer1`` per bucket (sparse where >= 0.5)."""
    zero = np.zeros((2, 2))
    dec = {"topk": {"source": "test", "sparsity": np.array([[decode_layer0] * 2, list(decode_layer1)])}}
    cfgs = [{"method": "bsfa", "config": "k=1", "value": 1, "source": "test", "sparsity": zero, "decode": dec},
            {"method": "blasst", "config": "target=0.5", "value": 0.5, "source": "test", "sparsity": zero}]
    return D.dispatch_record(cfgs, DISPATCH_LENGTHS, be_doc or _be_doc(), "be.json", 64, 2)[0]


def _export(out, decode_layer1, decode_layer0=0.9):
    out.mkdir()
    write_bsfa(out, torch.full((1, 2, 4, 8), 1e30), [1], 128, 64, "mean", {"model": "tiny", "sparse_layers": [0, 1],
                                                                           "ignored_layers": {}})
    write_blasst(out, {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": NOOP_BLASST_FACTOR,
                                                                                "decode": None},
                       "target_sparsity": 0.5, "targets": [], "model": "tiny", "num_layers": 2, "num_heads": 4,
                       "q_block_size": 128, "k_block_size": 64, "schema_version": 1, "sparse_layers": [0, 1],
                       "ignored_layers": {}, "dispatch": _record(decode_layer1, None, decode_layer0)})
    return out


def test_rows_per_phase_and_timing_and_old_files(tmp_path):
    doc = _be_doc()
    assert {(r["phase"], r["timing"]) for r in doc["rows"]} == {("prefill", "eager"), ("decode", "graph")}
    assert all(r["break_even"] == 0.5 for r in doc["rows"])
    assert D.timing_for(doc, "prefill", "graph", 64, 2) == "eager" and D.timing_for(doc, "decode", "graph", 64, 2, "head") == "graph"
    assert D.timing_for(doc, "decode", "graph", 64, 2, "group") is None
    old = dict(doc, rows=[{k: v for k, v in r.items() if k not in ("phase", "timing")} for r in doc["rows"]
                          if r["phase"] == "prefill"])
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert {(r["phase"], r["timing"]) for r in D.load_break_even(tmp_path / "old.json")["rows"]} == {("prefill", "eager")}
    bad = json.loads(json.dumps(doc))
    bad["rows"][-1]["decision"] = "both"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match="rows\\[7\\] is not a .*decision, batch") as e:
        D.load_break_even(tmp_path / "bad.json")
    assert "\n" not in str(e.value)


def test_record_with_decode_round_trips_and_refuses_damage():
    rec = json.loads(json.dumps(_record((0.1, 0.7))))
    D.check_dispatch("blasst.json", rec, 2)
    bsfa, blasst = rec["configs"]
    assert rec["timing"] == {"prefill": "eager", "decode": "graph"} and "decode" not in blasst
    assert bsfa["decode"]["modes"]["topk"]["sparse"] == [[True, True], [False, True]]
    assert bsfa["decode"]["dense_backend"] == ["FLASH_ATTENTION"] * 2 and bsfa["dense_backend"] == ["CUDNN_ATTENTION"] * 2
    assert bsfa["decode"]["batch"] == 1  # the decode rows' batch
    edited = json.loads(json.dumps(rec))
    edited["configs"][0]["decode"]["modes"]["topk"]["sparse"][1][0] = True
    with pytest.raises(UserError, match="configs\\[0\\] \\(k=1\\): the sparse flags .* edited") as e:
        D.check_dispatch("blasst.json", edited, 2)
    assert "\n" not in str(e.value)
    for damage in (lambda r: r["configs"][0]["decode"]["modes"]["topk"]["sparsity"].pop(),
                   lambda r: r["configs"][0]["decode"].update(decision="both"),
                   lambda r: r["configs"][0]["decode"]["break_even"].append(0.5),
                   lambda r: r["configs"][0]["decode"].update(batch=0),
                   lambda r: r["timing"].update(decode=None)):
        broken = json.loads(json.dumps(rec))
        damage(broken)
        with pytest.raises(UserError, match="blasst.json: dispatch .*export it again"):
            D.check_dispatch("blasst.json", broken, 2)
    no_decode = _record((0.1, 0.7), _be_doc(decode=False))
    assert no_decode["timing"]["decode"] is None and all("decode" not in c for c in no_decode["configs"])


@pytest.fixture
def tiny_model(tmp_path, seed):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=2, layers=2)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def _prefill_then_step(model, seed, n=300):
    """A prefill of n tokens (bucket 256: every layer's prefill dense by the plan), then one decode
    step against n + 1 keys: (its logits, its counts)."""
    from transformers import DynamicCache

    ids = torch.randint(0, 300, (1, n + 1), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :n], past_key_values=cache, use_cache=True)
        logits = model(ids[:, n:], past_key_values=cache, use_cache=True).logits
    return logits, {k: v.clone() for k, v in model.sparsecal_stats.items()}


def test_sparsify_follows_the_decode_plan(tiny_model, tmp_path, seed, capsys):
    reach = 301 // 64 + 1
    sparsecal.sparsify(tiny_model, _export(tmp_path / "e", (0.1, 0.7)), method="bsfa", k=1, decode="topk")
    _, st = _prefill_then_step(tiny_model, seed)  # bucket 256: layer 0 decodes sparse, layer 1 dense
    assert (st["reachable"][0] == reach).all() and (st["skipped"][0] == reach - 2).all()  # top-1 + the last block
    assert st["skipped"][1].sum() == 0 and st["reachable"][1].sum() == 0
    # every layer's decode dense by the plan: dense's own decode path (SDPA, the record's decode
    # backend), bit for bit, counting nothing
    sparsecal.sparsify(tiny_model, _export(tmp_path / "d", (0.1, 0.1), 0.2), method="dense")
    want, st = _prefill_then_step(tiny_model, seed)
    assert st["reachable"].sum() == 0
    sparsecal.sparsify(tiny_model, tmp_path / "d", method="bsfa", k=1, decode="topk")
    got, st = _prefill_then_step(tiny_model, seed)
    assert torch.equal(got, want) and st["skipped"].sum() == 0 and st["reachable"].sum() == 0
    state = tiny_model._sparsecal_state
    assert D.bucket(state.plan["lengths"], 301) == 0 and state.plan["decode"]["decision"] == "head"
    # a decode of another batch than the break-even's (batch 1 here) is said once, on stderr
    ids = torch.randint(0, 300, (2, 301), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        pre = tiny_model(ids[:, :300], use_cache=True)
        tiny_model(ids[:, 300:], past_key_values=pre.past_key_values, use_cache=True)
    assert capsys.readouterr().err.count("measured at batch 1, this decode runs batch 2") == 1
    # the group decision has no decode entry in this record: decode runs as without dispatch (sparse)
    sparsecal.sparsify(tiny_model, tmp_path / "d", method="bsfa", k=1, decode="topk", decode_decision="group")
    _, st = _prefill_then_step(tiny_model, seed)
    assert (st["reachable"] == reach).all() and (st["skipped"] > 0).all()
    sparsecal.densify(tiny_model)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bed") / "run"
    write_synthetic_run(root, [1024, 2048], 2, layers=2, heads=4)
    assert runner.invoke(app, ["fit", str(root), "--k", "8", "--targets", "0.5"]).exit_code == 0
    return root


def _file(run, tmp_path, decode: bool, old: bool = False):
    geo, lengths, info = B.geometry(run)
    measured = [{"method": m, "head_dim": 64, "group": 1, "length": n, "points": PTS, "dense": {"FLASH_ATTENTION": 6.0}}
                for m in D.METHODS for n in lengths]
    measured += [{"phase": "decode", "timing": t, "decision": "head", "batch": 16, "method": m, "head_dim": 64,
                  "group": 1, "length": n, "points": PTS, "dense": {"FLASH_ATTENTION": 6.0}}
                 for m in D.METHODS for n in lengths for t in D.TIMINGS] if decode else []
    doc = B.to_file(measured, geo, info)
    if old:  # a file written before phases and timings existed
        doc["rows"] = [{k: v for k, v in r.items() if k not in ("phase", "timing")} for r in doc["rows"]]
    (tmp_path / "be.json").write_text(json.dumps(doc))
    return tmp_path / "be.json"


def test_export_with_and_without_decode_rows(run, tmp_path):
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "old"), "--break-even",
                              str(_file(run, tmp_path, decode=False, old=True))])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "decode is not dispatched" in said and "no graph prefill rows" in said
    rec = load_blasst(tmp_path / "old")["dispatch"]
    assert rec["timing"] == {"prefill": "eager", "decode": None} and all("decode" not in c for c in rec["configs"])
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "new"), "--break-even",
                              str(_file(run, tmp_path, decode=True)), "--dispatch-timing", "eager"])
    assert res.exit_code == 0, res.output
    rec = load_blasst(tmp_path / "new")["dispatch"]  # checked on read
    assert rec["timing"] == {"prefill": "eager", "decode": "eager"}
    modes = {c["config"]: set(c["decode"]["modes"]) for c in rec["configs"]}
    assert modes == {"k=8": {"topk", "thresholds"}, "target=0.5": {"sparse"}}, modes
    blasst = next(c for c in rec["configs"] if c["method"] == "blasst")["decode"]["modes"]["sparse"]["sparsity"]
    assert all(x is None or 0 <= x <= 1 for row in blasst for x in row) and any(x for row in blasst for x in row)
    topk = next(c for c in rec["configs"] if c["method"] == "bsfa")["decode"]["modes"]["topk"]["sparsity"]
    assert topk[0] == pytest.approx([(15 - 8) / 16, (31 - 8) / 32])  # A = (N - 1) // 64 candidates, k = 8
    assert "decode topk" in " ".join(res.output.split())
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "x"), "--break-even",
                              str(tmp_path / "be.json"), "--dispatch-timing", "cuda"])
    assert res.exit_code == 2 and "--dispatch-timing takes graph or eager" in res.output


@INTERPRETER_WARNINGS
def test_bench_quick_decode_rows(run, tmp_path):
    out = tmp_path / "be.json"
    B.main(["--run", str(run), "--out", str(out), "--quick", "--decode-lengths", "200", "--methods", "blasst",
            "--decode-sparsities", "0,0.5", "--rounds", "1"])
    doc = D.load_break_even(out)
    (row,) = doc["rows"]
    assert (row["phase"], row["timing"], row["decision"], row["batch"], row["length"]) == ("decode", "eager", "head", 1, 200)
    assert len(row["points"]) == 2
    assert row["points"][0]["sparsity"] == 0.0 and 0.0 < row["points"][1]["sparsity"] <= 1.0
    assert doc["request"]["quick"] and row["dense_backend"] in D.SDPA_BACKENDS
