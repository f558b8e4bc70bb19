"""Decode dispatch of the group decision (issue 28, parts 2 and 3), on the CPU: a break-even file with
head and group decode rows gives each config a ``decode`` (head) and a ``decode_group`` entry, each
under its own decision's break-even (the head entry as from a head-only file, which adds nothing);
a damaged group entry is refused in one line; sparsify's group decision on BLASST follows the group
entry (sparse above the group break-even, dense below it, where the head entry would say otherwise);
the export computes the group entry's sparsity at the group law from the held-out group histograms
(without them: the target at the group law's validated lengths) and names both decisions' break-evens."""
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

from helpers import DISPATCH_LENGTHS, NOOP_BLASST_FACTOR, tiny_dispatch_export

runner = CliRunner()
PTS = [{"sparsity": 0.0, "ms": 10.0}, {"sparsity": 1.0, "ms": 2.0}]  # against d ms: break-even (10 - d) / 8
DENSE_MS = {"head": 6.0, "group": 4.0}  # decode break-even 0.5 (head), 0.75 (group)
GEO = {"block_m": 128, "block_n": 64, "heads": 4, "kv_heads": 2, "head_dim": 64}


def _be_doc(decisions=("head", "group")):
    """Prefill rows (break-even 0.5) and graph decode rows of batch 1 per decision in ``decisions``
    (DENSE_MS) at head_dim 64, group 2, for both methods."""
    measured = [{"method": m, "head_dim": 64, "group": 2, "length": n, "points": PTS, "dense": {"FLASH_ATTENTION": 6.0}}
                for m in D.METHODS for n in DISPATCH_LENGTHS]
    measured += [{"phase": "decode", "timing": "graph", "decision": d, "batch": 1, "method": m, "head_dim": 64,
                  "group": 2, "length": n, "points": PTS, "dense": {"FLASH_ATTENTION": DENSE_MS[d],
                                                                    "EFFICIENT_ATTENTION": DENSE_MS[d] + 1}}
                 for d in decisions for m in D.METHODS for n in DISPATCH_LENGTHS]
    return D.break_even_file(measured, GEO, {"gpu": "test", "commit": "c0ffee1"})


def _record(head=((0.0, 0.0), (0.0, 0.0)), group=((0.9, 0.9), (0.6, 0.6)), decisions=("head", "group")):
    """BLASST target=0.5, prefill never sparse: decode sparsity per layer and bucket ``head`` under
    the head decision, ``group`` under the group decision (default: layer 0 above the group
    break-even 0.75, layer 1 between the head's 0.5 and it); BSFA k=1 with a head topk entry only."""
    zero = np.zeros((2, 2))
    cfgs = [{"method": "bsfa", "config": "k=1", "value": 1, "source": "test", "sparsity": zero,
             "decode": {"topk": {"source": "test", "sparsity": np.full((2, 2), 0.9)}}},
            {"method": "blasst", "config": "target=0.5", "value": 0.5, "source": "test", "sparsity": zero,
             "decode": {"sparse": {"source": "test", "sparsity": np.array(head)}},
             "decode_group": {"sparse": {"source": "test", "sparsity": np.array(group)}}}]
    return json.loads(json.dumps(D.dispatch_record(cfgs, DISPATCH_LENGTHS, _be_doc(decisions), "be.json", 64, 2)[0]))


def test_the_record_holds_each_decisions_entry_under_its_own_break_even():
    rec = _record()
    D.check_dispatch("blasst.json", rec, 2)
    bsfa, blasst = rec["configs"]
    assert rec["timing"] == {"prefill": "eager", "decode": "graph", "decode_group": "graph"}
    assert rec["decode_decision"] == "head" and "decode_group" not in bsfa  # BSFA: no group sparsity given
    head, group = blasst["decode"], blasst["decode_group"]
    assert (head["decision"], group["decision"]) == ("head", "group") and group["batches"] == [1]
    assert head["by_batch"]["1"]["break_even"] == [0.5, 0.5] and group["by_batch"]["1"]["break_even"] == [0.75, 0.75]
    assert group["by_batch"]["1"]["sparse"]["sparse"] == [[True, True], [False, False]]
    assert head["by_batch"]["1"]["sparse"]["sparse"] == [[False, False], [False, False]]
    assert group["modes"]["sparse"]["sparsity"] == [[0.9, 0.9], [0.6, 0.6]]
    src = rec["break_even_file"]
    assert src["decode_group_measured_lengths"] == {m: {"1": DISPATCH_LENGTHS} for m in D.METHODS}
    # a head-only file: the record as before the group entry existed, its head entries the same
    old = _record(decisions=("head",))
    D.check_dispatch("blasst.json", old, 2)
    assert "decode_group" not in old["timing"] and "decode_group_measured_lengths" not in old["break_even_file"]
    assert all("decode_group" not in c for c in old["configs"])
    assert [c["decode"] for c in old["configs"]] == [c["decode"] for c in rec["configs"]]
    # a group-only file: group entries, no head entry, nothing about the head decision's timing
    only = _record(decisions=("group",))
    D.check_dispatch("blasst.json", only, 2)
    assert only["timing"] == {"prefill": "eager", "decode": None, "decode_group": "graph"}
    assert "decode" not in only["configs"][1] and only["configs"][1]["decode_group"] == group


@pytest.mark.parametrize("damage", [
    lambda r: r["configs"][1]["decode_group"].update(decision="head"),
    lambda r: r["configs"][1]["decode_group"]["by_batch"]["1"]["sparse"]["sparse"][1].__setitem__(0, True),
    lambda r: r["configs"][1]["decode_group"]["by_batch"]["1"]["break_even"].append(0.5),
    lambda r: r["configs"][1]["decode_group"]["modes"]["sparse"]["sparsity"][0].__setitem__(0, 1.5),
    lambda r: r["configs"][1]["decode_group"].update(batches=[1, 16]),
    lambda r: r["timing"].pop("decode_group"),
    lambda r: r["timing"].update(decode_group="cuda"),
    lambda r: r["configs"][1].update(decode_group=[]),
], ids=["decision", "edited-flag", "break-even-length", "sparsity-range", "batches", "no-timing", "bad-timing",
        "not-an-entry"])
def test_a_damaged_group_entry_is_refused_in_one_line(damage):
    rec = _record()
    damage(rec)
    with pytest.raises(UserError, match="blasst.json: dispatch .*export it again") as e:
        D.check_dispatch("blasst.json", rec, 2)
    assert "\n" not in str(e.value)


def _export(out, rec):
    """A 2-layer export whose BLASST target 0.5 has a decode law (head: a = 30) and the group law
    (a_group = 301: lambda = 1 at the decode step against 301 keys), validated on 256-512 tokens."""
    valid = {"law": "a/L", "validated_lengths": DISPATCH_LENGTHS, "min_length": 256, "max_length": 512}
    return tiny_dispatch_export(out, rec, threshold_scale_factor={"prefill": NOOP_BLASST_FACTOR, "decode": 30.0},
                                validity={"decode": valid},
                                decode_group={"threshold_scale_factor": 301.0, "validity": valid})


def _decode_step(model, seed, n=300):
    """A prefill of n tokens (bucket 256, prefill dense by the plan), one decode step against n + 1
    keys: (its logits, its counts)."""
    from transformers import DynamicCache

    ids = torch.randint(0, 300, (1, n + 1), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :n], past_key_values=cache, use_cache=True)
        logits = model(ids[:, n:], past_key_values=cache, use_cache=True).logits
    return logits, {k: v.clone() for k, v in model.sparsecal_stats.items()}


def test_the_group_decision_follows_its_own_entry(tiny_sdpa_model, tmp_path, seed):
    """Group decision: layer 0 (0.9 >= 0.75) decodes sparse through the group kernel (every head of a
    KV group skips alike), layer 1 (0.6 < 0.75, though >= the head's 0.5) dense, counting nothing.
    Head decision (head sparsity 0 on both): every layer dense, what ``dense`` runs bit for bit. Group
    sparsity below its break-even on both layers: the group decision runs that same dense path."""
    exp = _export(tmp_path / "e", _record())
    sparsecal.sparsify(tiny_sdpa_model, exp, method="blasst", decode_decision="group")
    _, st = _decode_step(tiny_sdpa_model, seed)
    reach = 301 // 64 + 1
    assert (st["reachable"][0] == reach).all() and st["skipped"][0].sum() > 0
    assert torch.equal(st["skipped"][0, 0::2], st["skipped"][0, 1::2])  # 2 query heads per KV head
    assert st["reachable"][1].sum() == 0 and st["skipped"][1].sum() == 0
    sparsecal.sparsify(tiny_sdpa_model, exp, method="dense")
    want, _ = _decode_step(tiny_sdpa_model, seed)
    sparsecal.sparsify(tiny_sdpa_model, exp, method="blasst", decode_decision="head")
    got, st = _decode_step(tiny_sdpa_model, seed)
    assert torch.equal(got, want) and st["reachable"].sum() == 0
    low = _export(tmp_path / "low", _record(group=((0.7, 0.7), (0.6, 0.6))))
    sparsecal.sparsify(tiny_sdpa_model, low, method="blasst", decode_decision="group")
    got, st = _decode_step(tiny_sdpa_model, seed)
    assert torch.equal(got, want) and st["reachable"].sum() == 0
    # without dispatch the group law runs both layers sparse: the entry, not the law, kept layer 1 dense
    sparsecal.sparsify(tiny_sdpa_model, exp, method="blasst", decode_decision="group", dispatch=False)
    _, st = _decode_step(tiny_sdpa_model, seed)
    assert (st["reachable"] == reach).all() and (st["skipped"].sum((1,)) > 0).all()
    sparsecal.densify(tiny_sdpa_model)


@pytest.fixture(scope="module")
def run(tmp_path_factory, module_seed):
    """A synthetic run (2 layers, 4 heads, its known group law: the group gap is head 0's + ln 1.5),
    fitted at target 0.5 (a held-out split)."""
    root = tmp_path_factory.mktemp("grp") / "run"
    write_synthetic_run(root, [1024, 2048], 2, layers=2, heads=4, seed=module_seed)
    assert runner.invoke(app, ["fit", str(root), "--k", "8", "--targets", "0.5"]).exit_code == 0
    return root


def _file(run, tmp_path, decisions=("head", "group")):
    geo, lengths, info = B.geometry(run)
    measured = [{"method": m, "head_dim": 64, "group": 1, "length": n, "points": PTS, "dense": {"FLASH_ATTENTION": 6.0}}
                for m in D.METHODS for n in lengths]
    measured += [{"phase": "decode", "timing": "graph", "decision": d, "batch": 1, "method": m, "head_dim": 64,
                  "group": 1, "length": n, "points": PTS, "dense": {"FLASH_ATTENTION": DENSE_MS[d]}}
                 for d in decisions for m in D.METHODS for n in lengths]
    (tmp_path / "be.json").write_text(json.dumps(B.to_file(measured, geo, info)))
    return tmp_path / "be.json"


def test_export_writes_both_decisions(run, tmp_path):
    from sparsecal.integrations import export_dispatch as XD

    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "x"), "--break-even", str(_file(run, tmp_path))])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "decode sparse B=1 (break-even 0.500 0.500)" in said
    assert "decode group sparse B=1 (break-even 0.750 0.750)" in said and "group decision decode graph" in said
    assert "no calibrated group-decision decode sparsity for k=8" in said
    doc = load_blasst(tmp_path / "x")  # the record checked on read
    rec, law = doc["dispatch"], doc["decode_group"]
    bsfa, blasst = rec["configs"]
    assert "decode_group" not in bsfa and rec["timing"]["decode_group"] == "graph"
    grp = blasst["decode_group"]
    s = np.array(grp["modes"]["sparse"]["sparsity"], float)
    head = np.array(blasst["decode"]["modes"]["sparse"]["sparsity"], float)
    # the group law reaches the target on the held-out samples; the head entry is the head law's own
    assert "group gap histograms" in grp["modes"]["sparse"]["source"] and np.abs(s - 0.5).max() < 0.05
    assert not np.array_equal(s, head) and grp["by_batch"]["1"]["sparse"]["sparse"] == (s >= 0.75).tolist()
    # without the held-out group histograms: the target at the group law's validated lengths
    fit = json.loads((run / "fit" / "fit.json").read_text())
    got = XD.blasst_decode_group(fit, doc, {"edges": None}, [0, 1], 0.5, None)["sparse"]["sparsity"]
    want = [0.5 if n in law["validity"]["validated_lengths"] else np.nan for n in fit["lengths"]]
    np.testing.assert_array_equal(got, [want, want])
    # a head-only file: no group entry, the same head entries as beside the group's
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "h"), "--break-even",
                              str(_file(run, tmp_path, ("head",)))])
    assert res.exit_code == 0, res.output
    only = load_blasst(tmp_path / "h")["dispatch"]
    assert "decode_group" not in only["timing"] and all("decode_group" not in c for c in only["configs"])
    assert [c["decode"] for c in only["configs"]] == [c["decode"] for c in rec["configs"]]
