"""sparsecal export and the CLI around fit/export: round trips, refusals, one-line errors."""
import json
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.cli import app
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import BSFA_DECODE_KEYS, BSFA_IDENTITY_KEYS, BSFA_KEYS, blasst_lambda, load_blasst
from sparsecal.integrations.exports import load_bsfa

runner = CliRunner()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("exp")
    run, out = base / "run", base / "export"
    write_synthetic_run(run, [1024, 2048, 4096], 3, layers=2, heads=4, a=300.0, a_decode=30.0, target=0.5)
    res = runner.invoke(app, ["fit", str(run), "--k", "8,16,32", "--targets", "0.4,0.5"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["export", str(run), "--out", str(out), "--target", "0.5", "--max-length", "6000"])
    assert res.exit_code == 0, res.output
    return run, out


def test_bsfa_pt_has_exactly_the_reference_keys(exported):
    run, out = exported
    d = torch.load(out / "thresholds.bsfa.pt", weights_only=True)
    # the reference's, the decode thresholds and the model identity
    assert set(d) == set(BSFA_KEYS) | set(BSFA_DECODE_KEYS) | set(BSFA_IDENTITY_KEYS)
    assert d["model"] == "synthetic-2x4" and d["head_dim"] == 64
    assert d["k_values"] == [8, 16, 32] and d["num_layers"] == 2 and d["num_heads"] == 4
    assert d["q_block_size"] == 128 and d["k_block_size"] == 64 and d["aggregation_method"] == "mean"
    assert d["max_num_blocks"] == 47 and d["thresholds"].shape == (3, 2, 4, 47)  # ceil(6000 / 128)
    assert d["thresholds"].dtype == torch.float32
    with safe_open(str(run / "fit" / "bsfa_thresholds.safetensors"), "pt") as f:
        fitted = f.get_tensor("thresholds")
    p = fitted.shape[-1]  # 4096 / 128 = 32 calibrated positions, the rest carried forward
    assert p == 32
    assert torch.equal(d["thresholds"][..., :p], fitted)
    assert torch.equal(d["thresholds"][..., p:], fitted[..., -1:].expand(-1, -1, -1, 47 - p))
    # -inf exactly where A_i <= k: A_i = 2 i at 128 x 64
    a_i = 2 * torch.arange(47)
    for ki, k in enumerate(d["k_values"]):
        assert torch.equal(torch.isinf(d["thresholds"][ki]), (a_i <= k).expand(2, 4, 47))


def test_safetensors_and_pt_agree(exported):
    _, out = exported
    pt = load_bsfa(out / "thresholds.bsfa.pt")
    st = load_bsfa(out / "thresholds.safetensors")
    assert torch.equal(pt.thresholds, st.thresholds) and pt.k_values == st.k_values
    assert st.model == "synthetic-2x4" and json.loads(st.meta["lengths"]) == [1024, 2048, 4096]
    assert pt.model == "synthetic-2x4"  # from the safetensors beside it
    assert torch.equal(st.for_k(16), st.thresholds[1])


def test_blasst_json_round_trip(exported):
    _, out = exported
    doc = load_blasst(out)
    assert doc["algorithm"] == "skip_softmax" and doc["target_sparsity"] == 0.5
    a, a_dec = doc["threshold_scale_factor"]["prefill"], doc["threshold_scale_factor"]["decode"]
    assert a == pytest.approx(300, rel=0.15) and a_dec == pytest.approx(30, rel=0.15)
    assert blasst_lambda(doc, 2048) == pytest.approx(a / 2048)
    assert blasst_lambda(doc, 2048, mode="decode") == pytest.approx(a_dec / 2048)
    lower = next(t for t in doc["targets"] if t["target_sparsity"] == 0.4)
    assert blasst_lambda(doc, 1000, target=0.4) == pytest.approx(lower["threshold_scale_factor"]["prefill"] / 1000)
    assert lower["threshold_scale_factor"]["prefill"] < a  # less sparsity needs a smaller lambda
    rows = doc["per_length"]
    assert {(r["mode"], r["length"]) for r in rows} == {(m, n) for m in ("prefill", "decode") for n in (1024, 2048, 4096)}
    for r in rows:
        assert set(r) >= {"length", "target", "lambda", "achieved"}
        assert r["achieved"] == pytest.approx(0.5, abs=0.06)
    assert doc["fit"]["prefill"]["law"]["r2"] > 0.95 and "b" in doc["fit"]["prefill"]["power_law"]
    assert doc["sparse_layers"] == [0, 1] and doc["ignored_layers"] == {}  # every layer captured, every one skips


def test_report_simulates_the_exported_rule_on_held_out_samples(exported):
    _, out = exported
    report = (out / "report.txt").read_text()
    assert "sparsecal: blasst.json" in report and "Layers left dense:\n  none" in report
    rows = load_blasst(out)["simulation"]
    assert {(r["mode"], r["length"]) for r in rows} == {(m, n) for m in ("prefill", "decode") for n in (1024, 2048, 4096)}
    for r in rows:  # the synthetic law holds at every length: the engines' rule reaches the target
        assert r["achieved"] == pytest.approx(0.5, abs=0.06) and r["lambda"] == pytest.approx(r["factor"] / r["length"])


def test_loading_refuses_mismatches(exported, tmp_path):
    _, out = exported
    with pytest.raises(UserError, match="num_heads 4, but it is applied to num_heads 9"):
        load_bsfa(out, expect={"num_heads": 9})
    with pytest.raises(UserError, match="model 'synthetic-2x4'"):
        load_blasst(out, expect={"model": "smollm2"})
    with pytest.raises(UserError, match="block_n 64, but it is applied to block_n 32"):
        load_blasst(out, expect={"block_n": 32})
    with pytest.raises(UserError, match="k=12 is not in the export"):
        load_bsfa(out).for_k(12)
    with pytest.raises(UserError, match="target sparsity 0.9 is not in the BLASST export"):
        blasst_lambda(load_blasst(out), 1024, target=0.9)
    d = torch.load(out / "thresholds.bsfa.pt", weights_only=True)
    d.pop("aggregation_method")
    torch.save(d, tmp_path / "bad.bsfa.pt")
    with pytest.raises(UserError, match="does not hold the BSFA export keys"):
        load_bsfa(tmp_path / "bad.bsfa.pt")
    doc = json.loads((out / "blasst.json").read_text())
    (tmp_path / "old.json").write_text(json.dumps(dict(doc, schema_version=0)))
    with pytest.raises(UserError, match="schema version 0"):
        load_blasst(tmp_path / "old.json")


@pytest.mark.parametrize("edit, says", [
    (lambda d: d.update(q_block_size=0), "q_block_size is 0, not a positive integer"),
    (lambda d: d.update(num_layers=-3), "num_layers is -3, not a positive integer"),
    (lambda d: d["per_length"][1].update(achieved=7.0), "per_length[1] is "),
    (lambda d: d["per_length"][0].update(length=-4), "per_length[0] is "),
    (lambda d: d["per_length"][2].update(**{"lambda": float("nan")}), "per_length[2].lambda is nan"),
    (lambda d: d["fit"]["prefill"]["law"].update(a=float("inf")), "fit.prefill.law.a is inf"),
])
def test_blasst_json_values_are_checked(exported, tmp_path, edit, says):
    """The values of blasst.json, not only their types: positive tile sizes and counts (they reach the
    kernels), every number finite (json reads NaN and Infinity), the per-length rows in range."""
    _, out = exported
    doc = json.loads((out / "blasst.json").read_text())
    assert len(doc["per_length"]) >= 3 and load_blasst(out)["per_length"] == doc["per_length"]
    edit(doc)
    (tmp_path / "blasst.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match=re.escape(says)):
        load_blasst(tmp_path / "blasst.json")


def _one_line_error(res, pattern):
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and pattern in lines[0], res.output


def test_cli_refusals(tmp_path):
    run = tmp_path / "run"
    write_synthetic_run(run, [1024, 2048], 1, layers=1, heads=2)
    _one_line_error(runner.invoke(app, ["fit", str(run)]), "too few samples for a hold-out split")
    _one_line_error(runner.invoke(app, ["fit", str(run), "--holdout", "0", "--targets", "0.97"]), "out of reach")
    _one_line_error(runner.invoke(app, ["fit", str(run), "--k", "5"]), "k 5 was not captured")
    _one_line_error(runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "e")]), "has no fit")
    man = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps(dict(man, schema_version=0)))
    _one_line_error(runner.invoke(app, ["fit", str(run), "--holdout", "0"]), "schema version 0")


def test_cli_fit_warns_but_accepts_k_beyond_candidates(tmp_path):
    run = tmp_path / "run"
    write_synthetic_run(run, [1024, 2048], 2, layers=1, heads=2)
    res = runner.invoke(app, ["fit", str(run), "--k", "32,64", "--targets", "0.3"])
    assert res.exit_code == 0, res.output
    assert "k=32 keeps every candidate" in res.output and "k=64 keeps every candidate" in res.output
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "e"), "--target", "0.8"])
    _one_line_error(res, "--target 0.8 was not fitted")
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "e")])
    assert res.exit_code == 0, res.output
    assert np.isinf(load_bsfa(tmp_path / "e").thresholds.numpy()).all()
