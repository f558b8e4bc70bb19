"""Decode dispatch (issue 28 part 3), on the CPU: break-even rows per phase and timing (old files
load as prefill, eager), the record's decode entries per measured batch (round trip, one-line
refusals when damaged; records written before batches still load), sparsify following the decode
plan of the batch it runs on a tiny random Llama (reference backend), the export from a file with
and without decode rows and from several files merged, and the break-even bench's --quick decode
path (interpreter) at one and two batches."""
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
from sparsecal.formats.exports import load_blasst

from helpers import DISPATCH_LENGTHS, INTERPRETER_WARNINGS, tiny_dispatch_export

runner = CliRunner()
PTS = [{"sparsity": 0.0, "ms": 10.0}, {"sparsity": 1.0, "ms": 2.0}]  # break-even 0.5 against 6 ms


def _be_doc(decode=True, timing="graph", batches=None, cudnn_decode=False):
    """Prefill (eager) and decode (``timing``, head decision) rows at head_dim 64, group 2: prefill
    break-even 0.5; decode per batch {batch: FLASH's dense ms} (default {1: 6.0}: break-even 0.5;
    1.5 ms: never, faster than every point); FLASH the faster dense backend of decode (``cudnn_decode``:
    cuDNN, 1 ms faster), cuDNN of prefill."""
    measured = [{"method": m, "head_dim": 64, "group": 2, "length": n, "points": PTS,
                 "dense": {"CUDNN_ATTENTION": 6.0, "FLASH_ATTENTION": 7.0}}
                for m in D.METHODS for n in DISPATCH_LENGTHS]
    if decode:
        measured += [{"phase": "decode", "timing": timing, "decision": "head", "batch": b, "method": m,
                      "head_dim": 64, "group": 2, "length": n, "points": PTS,
                      "dense": {"CUDNN_ATTENTION": ms + (-1.0 if cudnn_decode else 1.0), "FLASH_ATTENTION": ms}}
                     for b, ms in (batches or {1: 6.0}).items() for m in D.METHODS for n in DISPATCH_LENGTHS]
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


def _old_layout(rec, batch=True):
    """A record as written before decode batches: each decode entry its one batch's entry
    (``batch``: False drops the batch, as records before it)."""
    rec = json.loads(json.dumps(rec))
    for c in rec["configs"]:
        if c.get("decode"):
            ((_, view),) = D.decode_views(c["decode"])
            drop = ("fastest_backend",) if batch else ("fastest_backend", "batch")  # both came later
            c["decode"] = {k: v for k, v in view.items() if k not in drop}
    return rec


def _export(out, decode_layer1, decode_layer0=0.9, batches=None, old=False, cudnn_decode=False):
    """A 2-layer export whose record is _record's (``batches``, ``cudnn_decode`` as _be_doc's; ``old``:
    the layout before decode batches)."""
    be = _be_doc(batches=batches, cudnn_decode=cudnn_decode) if batches or cudnn_decode else None
    rec = _record(decode_layer1, be, decode_layer0)
    if cudnn_decode:  # as records written before decode entries picked only reproducible backends: cuDNN's
        for c in rec["configs"]:
            for e in (c["decode"]["by_batch"] if c.get("decode") else {}).values():
                e["dense_backend"] = ["CUDNN_ATTENTION"] * len(e["dense_backend"])
    return tiny_dispatch_export(out, _old_layout(rec) if old else rec)


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
    assert bsfa["decode"]["batches"] == [1] and set(bsfa["decode"]["by_batch"]) == {"1"}  # the decode rows' batch
    one = bsfa["decode"]["by_batch"]["1"]
    assert one["sparse"]["topk"] == [[True, True], [False, True]] and one["break_even"] == [0.5, 0.5]
    assert bsfa["decode"]["modes"]["topk"]["sparsity"] == [[0.9, 0.9], [0.1, 0.7]]
    assert one["dense_backend"] == ["FLASH_ATTENTION"] * 2 and bsfa["dense_backend"] == ["CUDNN_ATTENTION"] * 2
    edited = json.loads(json.dumps(rec))
    edited["configs"][0]["decode"]["by_batch"]["1"]["sparse"]["topk"][1][0] = True
    with pytest.raises(UserError, match="configs\\[0\\] \\(k=1\\): the sparse flags .* edited") as e:
        D.check_dispatch("blasst.json", edited, 2)
    assert "\n" not in str(e.value)
    for damage in (lambda r: r["configs"][0]["decode"]["modes"]["topk"]["sparsity"].pop(),
                   lambda r: r["configs"][0]["decode"].update(decision="both"),
                   lambda r: r["configs"][0]["decode"]["by_batch"]["1"]["break_even"].append(0.5),
                   lambda r: r["configs"][0]["decode"].update(batches=[0]),
                   lambda r: r["configs"][0]["decode"].update(batches=[1, 16]),  # no entry for batch 16
                   lambda r: r["configs"][0]["decode"]["by_batch"]["1"]["sparse"].pop("topk"),
                   lambda r: r["timing"].update(decode=None)):
        broken = json.loads(json.dumps(rec))
        damage(broken)
        with pytest.raises(UserError, match="blasst.json: dispatch .*export it again"):
            D.check_dispatch("blasst.json", broken, 2)
    no_decode = _record((0.1, 0.7), _be_doc(decode=False))
    assert no_decode["timing"]["decode"] is None and all("decode" not in c for c in no_decode["configs"])


def _prefill_then_step(model, seed, n=300, batch=1):
    """A prefill of ``batch`` rows of n tokens (bucket 256: every layer's prefill dense by the plan),
    then one decode step against n + 1 keys: (its logits, its counts)."""
    from transformers import DynamicCache

    ids = torch.randint(0, 300, (batch, n + 1), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :n], past_key_values=cache, use_cache=True)
        logits = model(ids[:, n:], past_key_values=cache, use_cache=True).logits
    return logits, {k: v.clone() for k, v in model.sparsecal_stats.items()}


def test_sparsify_follows_the_decode_plan(tiny_sdpa_model, tmp_path, seed, capsys):
    reach = 301 // 64 + 1
    sparsecal.sparsify(tiny_sdpa_model, _export(tmp_path / "e", (0.1, 0.7)), method="bsfa", k=1, decode="topk")
    _, st = _prefill_then_step(tiny_sdpa_model, seed)  # bucket 256: layer 0 decodes sparse, layer 1 dense
    assert (st["reachable"][0] == reach).all() and (st["skipped"][0] == reach - 2).all()  # top-1 + the last block
    assert st["skipped"][1].sum() == 0 and st["reachable"][1].sum() == 0
    # every layer's decode dense by the plan: dense's own decode path (SDPA, the record's decode
    # backend), bit for bit, counting nothing
    sparsecal.sparsify(tiny_sdpa_model, _export(tmp_path / "d", (0.1, 0.1), 0.2), method="dense")
    want, st = _prefill_then_step(tiny_sdpa_model, seed)
    assert st["reachable"].sum() == 0
    sparsecal.sparsify(tiny_sdpa_model, tmp_path / "d", method="bsfa", k=1, decode="topk")
    got, st = _prefill_then_step(tiny_sdpa_model, seed)
    assert torch.equal(got, want) and st["skipped"].sum() == 0 and st["reachable"].sum() == 0
    state = tiny_sdpa_model._sparsecal_state
    assert D.bucket(state.plan["lengths"], 301) == 0 and state.plan["decode"]["decision"] == "head"
    # a decode of another batch than the break-even's (batch 1 here) is said once, on stderr
    ids = torch.randint(0, 300, (2, 301), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        pre = tiny_sdpa_model(ids[:, :300], use_cache=True)
        tiny_sdpa_model(ids[:, 300:], past_key_values=pre.past_key_values, use_cache=True)
    assert capsys.readouterr().err.count("measured at batch 1, this decode runs batch 2") == 1
    # the group decision has no decode entry in this record: decode runs as without dispatch (sparse)
    sparsecal.sparsify(tiny_sdpa_model, tmp_path / "d", method="bsfa", k=1, decode="topk", decode_decision="group")
    _, st = _prefill_then_step(tiny_sdpa_model, seed)
    assert (st["reachable"] == reach).all() and (st["skipped"] > 0).all()
    sparsecal.densify(tiny_sdpa_model)


def test_a_dispatched_dense_decode_never_runs_cudnn_first(tiny_sdpa_model, tmp_path, seed):
    """cuDNN's SDPA decode is not reproducible run to run (H100, data/bench/NOTES.md): where a
    record written before decode picks left it out picked it for decode (the fastest of all), a dense decode step under dispatch tries Flash first, for ``dense``
    and for a method the plan runs dense alike; prefill keeps the record's cuDNN."""
    from sparsecal.integrations.sparsify import dense_first, dispatched_dense

    exp = _export(tmp_path / "e", (0.1, 0.1), 0.2, cudnn_decode=True)
    sparsecal.sparsify(tiny_sdpa_model, exp, method="dense")
    state = tiny_sdpa_model._sparsecal_state
    assert state.dense_backends["decode"]["picks"][0][0] == "CUDNN_ATTENTION"  # the record as measured
    assert dense_first(state, "decode", 301) == "FLASH_ATTENTION" and dense_first(state, "prefill", 301) == "CUDNN_ATTENTION"
    want, _ = _prefill_then_step(tiny_sdpa_model, seed)
    sparsecal.sparsify(tiny_sdpa_model, exp, method="bsfa", k=1, decode="topk")
    state = tiny_sdpa_model._sparsecal_state
    assert [dispatched_dense(state, layer, "decode", 301, 1) for layer in (0, 1)] == ["FLASH_ATTENTION"] * 2
    got, st = _prefill_then_step(tiny_sdpa_model, seed)
    assert torch.equal(got, want) and st["skipped"].sum() == 0
    sparsecal.densify(tiny_sdpa_model)


def test_the_record_names_the_fastest_decode_backend_beside_the_reproducible_one():
    """Where cuDNN's decode is the fastest, a decode entry's dense_backend is the fastest reproducible
    backend (Flash) and fastest_backend cuDNN, the backend the break-even was measured against; a
    damaged fastest_backend is refused in one line; a record written before it reads its dense_backend."""
    rec = json.loads(json.dumps(_record((0.1, 0.7), _be_doc(cudnn_decode=True))))
    D.check_dispatch("blasst.json", rec, 2)
    e = rec["configs"][0]["decode"]["by_batch"]["1"]
    assert e["dense_backend"] == ["FLASH_ATTENTION"] * 2 and e["fastest_backend"] == ["CUDNN_ATTENTION"] * 2
    e["fastest_backend"] = ["CUDNN_ATTENTION", "XLA"]
    with pytest.raises(UserError, match="configs\\[0\\] does not hold") as err:
        D.check_dispatch("blasst.json", rec, 2)
    assert "\n" not in str(err.value)
    del e["fastest_backend"]
    D.check_dispatch("blasst.json", rec, 2)
    assert D.decode_views(rec["configs"][0]["decode"])[0][1]["fastest_backend"] == ["FLASH_ATTENTION"] * 2


def test_decode_dense_fastest_runs_the_fastest_backend(tiny_sdpa_model, tmp_path, seed):
    """sparsify(..., decode_dense="fastest"): a dense decode step under the record tries its fastest
    backend first (cuDNN here), for ``dense`` and for layers the plan runs dense; the default stays
    reproducible (Flash); prefill is not affected; an unknown choice is one line before any work."""
    from sparsecal.integrations.sparsify import dense_first, dispatched_dense

    exp = tiny_dispatch_export(tmp_path / "e", _record((0.1, 0.1), _be_doc(cudnn_decode=True), 0.2))
    for choice, want in (("reproducible", "FLASH_ATTENTION"), ("fastest", "CUDNN_ATTENTION")):
        sparsecal.sparsify(tiny_sdpa_model, exp, method="dense", decode_dense=choice)
        state = tiny_sdpa_model._sparsecal_state
        assert dense_first(state, "decode", 301) == want and dense_first(state, "prefill", 301) == "CUDNN_ATTENTION"
        sparsecal.sparsify(tiny_sdpa_model, exp, method="bsfa", k=1, decode="topk", decode_dense=choice)
        state = tiny_sdpa_model._sparsecal_state
        assert [dispatched_dense(state, layer, "decode", 301, 1) for layer in (0, 1)] == [want] * 2
    got, st = _prefill_then_step(tiny_sdpa_model, seed)  # runs on the CPU whatever comes first
    assert torch.isfinite(got).all() and st["skipped"].sum() == 0
    sparsecal.densify(tiny_sdpa_model)
    with pytest.raises(UserError, match="unknown decode_dense 'cudnn'; use one of reproducible, fastest"):
        sparsecal.sparsify(tiny_sdpa_model, exp, method="dense", decode_dense="cudnn")
    assert not hasattr(tiny_sdpa_model, "_sparsecal_state")


TWO_BATCHES = {1: 1.5, 16: 6.0}  # decode break-even: never at batch 1, 0.5 at batch 16


def test_a_record_of_two_batches():
    """Decode rows of batches 1 and 16 side by side in one file (the batch is part of the row key);
    the record keeps per batch the break-even, backends and sparse flags, the sparsity once."""
    doc = _be_doc(batches=TWO_BATCHES)
    assert sorted({r["batch"] for r in doc["rows"] if r["phase"] == "decode"}) == [1, 16]
    assert len(D.rows_for(doc, "bsfa", 64, 2, "decode", "graph", "head")) == 4
    assert [r["batch"] for r in D.rows_for(doc, "bsfa", 64, 2, "decode", "graph", "head", 16)] == [16, 16]
    rec = json.loads(json.dumps(_record((0.1, 0.7), doc)))
    D.check_dispatch("blasst.json", rec, 2)
    dec = rec["configs"][0]["decode"]
    assert dec["batches"] == [1, 16] and set(dec["by_batch"]) == {"1", "16"}
    assert dec["by_batch"]["1"]["break_even"] == [None, None] and dec["by_batch"]["16"]["break_even"] == [0.5, 0.5]
    assert dec["by_batch"]["1"]["sparse"]["topk"] == [[False, False], [False, False]]
    assert dec["by_batch"]["16"]["sparse"]["topk"] == [[True, True], [False, True]]
    assert [b for b, _ in D.decode_views(dec)] == [1, 16]
    assert rec["break_even_file"]["decode_measured_lengths"]["bsfa"] == {"1": DISPATCH_LENGTHS, "16": DISPATCH_LENGTHS}
    for damage in (lambda d: d["by_batch"]["1"]["sparse"]["topk"][0].__setitem__(0, True),  # an edited flag
                   lambda d: d.update(batches=[16, 1]), lambda d: d["by_batch"].pop("16")):
        broken = json.loads(json.dumps(rec))
        damage(broken["configs"][0]["decode"])
        with pytest.raises(UserError, match="blasst.json: dispatch configs\\[0\\]") as e:
            D.check_dispatch("blasst.json", broken, 2)
        assert "\n" not in str(e.value)


def test_a_decode_step_follows_the_entry_of_its_batch(tiny_sdpa_model, tmp_path, seed, capsys):
    """Batch 1 decodes dense (its rows never pay), batch 16 sparse on layer 0 (its rows break even at
    0.5); batch 4 follows batch 1's entry, batch 20 batch 16's, and only the latter is said (once)."""
    reach = 301 // 64 + 1
    sparsecal.sparsify(tiny_sdpa_model, _export(tmp_path / "e", (0.1, 0.7), batches=TWO_BATCHES), method="bsfa", k=1,
                       decode="topk")
    for batch, sparse in ((1, False), (16, True), (4, False), (20, True), (24, True)):
        _, st = _prefill_then_step(tiny_sdpa_model, seed, batch=batch)
        if sparse:  # layer 0 through the top-1 kernel (top-1 + the last block kept per row and head); layer 1 dense
            assert (st["reachable"][0] == reach * batch).all() and (st["skipped"][0] == (reach - 2) * batch).all()
        else:
            assert st["reachable"][0].sum() == 0, batch
        assert st["reachable"][1].sum() == 0 and st["skipped"][1].sum() == 0
    err = capsys.readouterr().err
    assert err.count("measured at batches 1, 16, this decode runs batch 20: it follows batch 16's") == 1, err
    assert "runs batch 4" not in err and "runs batch 24" not in err
    sparsecal.densify(tiny_sdpa_model)


@pytest.mark.parametrize("batch", [True, False])
def test_a_record_written_before_batches_loads_and_behaves_as_before(tiny_sdpa_model, tmp_path, seed, capsys, batch):
    """The single-batch layout (``batch`` the decode rows' batch, or none in still older records):
    loaded, checked (an edited flag refused) and followed at every batch; another batch is said once
    where the record says its own."""
    rec = _old_layout(_record((0.1, 0.7)), batch)
    D.check_dispatch("blasst.json", json.loads(json.dumps(rec)), 2)
    edited = json.loads(json.dumps(rec))
    edited["configs"][0]["decode"]["modes"]["topk"]["sparse"][1][0] = True
    with pytest.raises(UserError, match="the sparse flags .* edited"):
        D.check_dispatch("blasst.json", edited, 2)
    out = _export(tmp_path / "e", (0.1, 0.7), old=True)
    if not batch:
        doc = json.loads((out / "blasst.json").read_text())
        doc["dispatch"] = rec
        (out / "blasst.json").write_text(json.dumps(doc))
    assert ("batch" in load_blasst(out)["dispatch"]["configs"][0]["decode"]) == batch
    sparsecal.sparsify(tiny_sdpa_model, out, method="bsfa", k=1, decode="topk")
    reach = 301 // 64 + 1
    for b in (1, 2):
        _, st = _prefill_then_step(tiny_sdpa_model, seed, batch=b)
        assert (st["reachable"][0] == reach * b).all() and (st["skipped"][0] == (reach - 2) * b).all()
        assert st["reachable"][1].sum() == 0
    assert capsys.readouterr().err.count("measured at batch 1, this decode runs batch 2") == (1 if batch else 0)
    sparsecal.densify(tiny_sdpa_model)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bed") / "run"
    write_synthetic_run(root, [1024, 2048], 2, layers=2, heads=4)
    assert runner.invoke(app, ["fit", str(root), "--k", "8", "--targets", "0.5"]).exit_code == 0
    return root


def _file(run, tmp_path, decode: bool, old: bool = False, prefill: bool = True, batch: int = 16,
          dense: float = 6.0, name: str = "be.json"):
    """tmp_path / name: prefill rows (break-even 0.5) unless not ``prefill``, decode rows of ``batch``
    (both timings, FLASH ``dense`` ms: 6 gives 0.5, 1.5 never) where ``decode``."""
    geo, lengths, info = B.geometry(run)
    measured = [{"method": m, "head_dim": 64, "group": 1, "length": n, "points": PTS, "dense": {"FLASH_ATTENTION": 6.0}}
                for m in D.METHODS for n in lengths] if prefill else []
    measured += [{"phase": "decode", "timing": t, "decision": "head", "batch": batch, "method": m, "head_dim": 64,
                  "group": 1, "length": n, "points": PTS, "dense": {"FLASH_ATTENTION": dense}}
                 for m in D.METHODS for n in lengths for t in D.TIMINGS] if decode else []
    doc = B.to_file(measured, geo, info)
    if old:  # a file written before phases and timings existed
        doc["rows"] = [{k: v for k, v in r.items() if k not in ("phase", "timing")} for r in doc["rows"]]
    (tmp_path / name).write_text(json.dumps(doc))
    return tmp_path / name


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


def test_export_merges_the_files_of_two_batches_and_refuses_a_row_twice(run, tmp_path):
    """--break-even twice: prefill and batch-16 decode rows from one file, batch-1 decode rows from
    another; the record holds both batches (as from one file holding both), the table a row per
    batch. Two files with a row of the same key: refused in one line, exit 2, nothing written."""
    a = _file(run, tmp_path, decode=True)
    b = _file(run, tmp_path, decode=True, prefill=False, batch=1, dense=1.5, name="b1.json")
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "m"), "--break-even", str(a),
                              "--break-even", str(b)])
    assert res.exit_code == 0, res.output
    rec = load_blasst(tmp_path / "m")["dispatch"]
    src = rec["break_even_file"]
    assert src["name"] == "be.json + b1.json" and [f["name"] for f in src["files"]] == ["be.json", "b1.json"]
    for c in rec["configs"]:
        dec = c["decode"]
        assert dec["batches"] == [1, 16] and dec["by_batch"]["1"]["break_even"] == [None, None]
        assert dec["by_batch"]["16"]["break_even"] == [0.5, 0.5]
        assert not any(x for g in dec["by_batch"]["1"]["sparse"].values() for row in g for x in row)
    said = " ".join(res.output.split())
    assert "decode topk B=1 (break-even never never)" in said and "decode topk B=16 (break-even 0.500 0.500)" in said
    assert "batches 1, 16: a decode step of batch B follows the largest measured batch <= B" in said
    one = json.loads(a.read_text())  # the same rows in one file
    one["rows"] = sorted(one["rows"] + json.loads(b.read_text())["rows"], key=D.row_key)
    (tmp_path / "both.json").write_text(json.dumps(one))
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "o"), "--break-even",
                              str(tmp_path / "both.json")])
    assert res.exit_code == 0, res.output
    got = load_blasst(tmp_path / "o")["dispatch"]["configs"]
    assert [c["decode"] for c in got] == [c["decode"] for c in rec["configs"]]
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "x"), "--break-even", str(a),
                              "--break-even", str(tmp_path / "both.json")])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0].startswith("error: be.json and both.json both hold a row for decode eager head")
    assert "batch 16" in lines[0]
    assert not (tmp_path / "x").exists()


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


@INTERPRETER_WARNINGS
def test_bench_quick_decode_rows_of_two_batches(run, tmp_path):
    """--decode-batch 1,2: one set of decode rows per batch in one file; a bad batch list is refused."""
    out = tmp_path / "be.json"
    B.main(["--run", str(run), "--out", str(out), "--quick", "--decode-lengths", "130", "--methods", "blasst",
            "--decode-sparsities", "0", "--rounds", "1", "--decode-batch", "2,1"])
    doc = D.load_break_even(out)
    assert [(r["batch"], r["length"]) for r in doc["rows"]] == [(1, 130), (2, 130)]
    assert doc["request"]["decode_batch"] == [1, 2]
    for bad in ("0,1", "1,x", ","):
        with pytest.raises(UserError, match="decode-batch") as e:
            B.parse(["--run", str(run), "--out", str(out), "--decode-batch", bad])
        assert "\n" not in str(e.value)
