"""bench/decode_step.py --quick: a decode step's anatomy end to end on the CPU (TRITON_INTERPRET=1)
on the tiny 4-head model under a dispatch record that runs every decode step on the project's
dense kernel: every configuration is timed in each round, its ops are listed, and the ops it runs
beside the best baseline's are those of its attention path (SDPA's op gone where the Triton
kernel runs instead; nothing differs for the other baseline)."""
import json

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
    for label in ("bsfa:1:topk", "bsfa:1:topk+dispatch", "dense+dispatch"):  # sparsecal's decode paths: no SDPA op
        delta = {name: n for name, n, _ in got[label]["kernels_vs_best_sdpa"]}
        assert delta["aten::scaled_dot_product_attention"] == -2, label  # one per layer
    assert "best SDPA" in decode_step.summary(doc)
