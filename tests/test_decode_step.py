"""bench/decode_step.py --quick: a decode step's anatomy end to end on the CPU (TRITON_INTERPRET=1)
on the tiny 4-head model under a dispatch record that runs every decode step on the project's
dense kernel: every configuration is timed in each round, its ops are listed, and the ops it runs
beside the best baseline's are those of its attention path (SDPA's op gone where the Triton
kernel runs instead; nothing differs for the other baseline)."""
import json

import pytest
from test_dispatch_owndense import _record

from sparsecal.bench import decode_step
from sparsecal.capture.models import resolve_model

from helpers import INTERPRETER_WARNINGS, make_checkpoint, tiny_dispatch_export


@INTERPRETER_WARNINGS
def test_quick_step_anatomy(tmp_path, seed):
    model = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=2, layers=2)
    exp = tiny_dispatch_export(tmp_path / "e", _record(), model=resolve_model(str(model)).model_id)
    out = tmp_path / "step.json"
    decode_step.main(["--model", str(model), "--export", str(exp), "--length", "300", "--quick", "--rounds", "2",
                      "--reps", "1", "--methods", "bsfa:1:topk", "--dtype", "float32", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "decode_step" and doc["provenance"]["commit"] is not None
    got = doc["variants"]
    assert list(got) == ["sdpa", "bsfa:1:topk", "bsfa:1:topk+dispatch", "dense+dispatch"]  # no cuDNN on the CPU
    assert doc["best_sdpa"] == "sdpa" and got["sdpa"]["kernels_vs_best_sdpa"] == []
    for label, v in got.items():
        assert len(v["rounds_ms"]) == len(v["eager_rounds_ms"]) == 2 and v["ms"] > 0 and v["vs_best_sdpa"] > 0
        assert v["eager_ms"] > 0 and v["eager_vs_best_sdpa"] > 0
        assert v["kernels"]["aten::linear"][0] > 0, label
        assert v["vs_best_sdpa_interval"]["lo"] is None   # 2 rounds: too few for an interval
    for label in ("bsfa:1:topk", "bsfa:1:topk+dispatch", "dense+dispatch"):  # sparsecal's decode paths: no SDPA op
        delta = {name: n for name, n, _ in got[label]["kernels_vs_best_sdpa"]}
        assert delta["aten::scaled_dot_product_attention"] == -2, label  # one per layer
    assert "best SDPA" in decode_step.summary(doc)


@INTERPRETER_WARNINGS
def test_quick_step_anatomy_as_eval_times_it(tmp_path, seed, capsys, monkeypatch):
    """--cache own --prefills-before 1: each configuration's steps run from its own prefill's cache
    after an untimed prefill, as in eval's timing rounds (the prompt's cache made once for the shared
    one, then once per configuration and round; one prefill without a cache before each); a negative
    count is refused in one line."""
    calls = {"cache": 0}
    real = decode_step._prompt_cache

    def counted(model, ids):
        calls["cache"] += 1
        return real(model, ids)

    monkeypatch.setattr(decode_step, "_prompt_cache", counted)
    model = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=2, layers=2)
    exp = tiny_dispatch_export(tmp_path / "e", _record(), model=resolve_model(str(model)).model_id)
    out = tmp_path / "step.json"
    argv = ["--model", str(model), "--export", str(exp), "--length", "300", "--quick", "--rounds", "1", "--reps", "1",
            "--methods", "bsfa:1:topk", "--dispatch", "on", "--dtype", "float32"]
    decode_step.main([*argv, "--cache", "own", "--prefills-before", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["args"]["cache"] == "own" and doc["args"]["prefills_before"] == "1"
    assert list(doc["variants"]) == ["sdpa", "bsfa:1:topk+dispatch", "dense+dispatch"]  # dispatch on: its dense too
    assert all(len(v["rounds_ms"]) == 1 and v["ms"] > 0 for v in doc["variants"].values())
    assert calls["cache"] == 1 + 3  # the shared cache, then each of the 3 configurations' own (1 round)
    with pytest.raises(SystemExit) as e:
        decode_step.main([*argv, "--prefills-before", "-1"])
    assert e.value.code == 2 and "--prefills-before must be >= 0" in capsys.readouterr().err


@INTERPRETER_WARNINGS
def test_quick_step_anatomy_with_the_fastest_dense_decode(tmp_path, seed):
    """--decode-dense both: each dispatched method also runs as sparsify(..., decode_dense="fastest"),
    labelled "+dispatch fastest"; the undispatched method is timed once; --decode-dense fastest
    leaves out the reproducible dispatched configurations."""
    model = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=2, layers=2)
    exp = tiny_dispatch_export(tmp_path / "e", _record(), model=resolve_model(str(model)).model_id)
    out = tmp_path / "step.json"
    decode_step.main(["--model", str(model), "--export", str(exp), "--length", "300", "--quick", "--rounds", "4",
                      "--reps", "1", "--methods", "bsfa:1:topk", "--dtype", "float32", "--decode-dense", "both",
                      "--out", str(out)])
    got = json.loads(out.read_text())["variants"]
    assert list(got) == ["sdpa", "bsfa:1:topk", "bsfa:1:topk+dispatch", "bsfa:1:topk+dispatch fastest",
                         "dense+dispatch", "dense+dispatch fastest"]
    for v in got.values():   # 4 rounds: each speedup has its interval (speed_stats.ratio_interval)
        for ci in (v["vs_best_sdpa_interval"], v["eager_vs_best_sdpa_interval"]):
            assert v["ms"] > 0 and ci["lo"] <= ci["ratio"] <= ci["hi"] and ci["level"] > 0.95
    assert got["sdpa"]["vs_best_sdpa_interval"]["ratio"] == 1.0
    decode_step.main(["--model", str(model), "--export", str(exp), "--length", "300", "--quick", "--rounds", "1",
                      "--reps", "1", "--methods", "bsfa:1:topk", "--dtype", "float32", "--decode-dense", "fastest",
                      "--dispatch", "on", "--out", str(out)])
    assert list(json.loads(out.read_text())["variants"]) == ["sdpa", "bsfa:1:topk+dispatch fastest",
                                                             "dense+dispatch fastest"]
