"""``sparsecal verify EXPORT --engine modelopt``: the exported block run by Model-Optimizer's own code,
its skip counts against what sparsecal predicted, per phase, target and length.

For each chosen sample of the run the export came from (its token ids are in the sample):

- predicted: analysis.consumer_predict on the sample's statistics, lambda = a exp(b S) / N;
- measured on dense statistics: the block read by Model-Optimizer's loader, applied through its
  HF path (integrations.consumer_modelopt), the model run with masks NOT applied (Model-Optimizer's
  calibration mode), every target counted in the same forward by ExactCounter;
- measured with masks applied: one run per target, each layer's mask applied before the next
  layer runs (what a deployment does); its drift from the dense-statistics count is the effect
  of skipping upstream layers.

Prefill is the whole N-token prompt; decode continues from the first N - R positions of that
prefill's cache and feeds the last R = the run's decode rows one at a time (the rows sparsecal
captured as decode rows; Model-Optimizer's lambda there uses the step's kv length r + 1,
sparsecal's prediction the sample's N). With masks applied, the cached keys and values are those
of the masked prefill of all N tokens (a 128-row block's decision sees rows past N - R).
Writes EXPORT/verify-modelopt.json (kind sparsecal-verify) and returns its document.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from sparsecal.analysis import consumer_predict as CP
from sparsecal.analysis.engine_law import text_table
from sparsecal.analysis.fit import load_fit
from sparsecal.formats import engine_files as F
from sparsecal.formats.errors import UserError
from sparsecal.formats.files import atomic_write_text
from sparsecal.formats.provenance import provenance
from sparsecal.formats.run import RunStore, captured_layers
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.formats.verify import VERIFY_JSON, VERIFY_KIND
from sparsecal.formats.version import SCHEMA_VERSION
from sparsecal.integrations import consumer_modelopt as M

ENGINES = ("modelopt",)


def open_inputs(export: Path, run: Path | None) -> dict:
    """The export (engine.json, the modelopt block) and its run, checked to belong together."""
    export = Path(export)
    man = F.load_engine_manifest(export)
    if "modelopt" not in man["formats"]:
        raise UserError(f"{export} holds no modelopt export; write it with `sparsecal export RUN --out {export} "
                        "--format modelopt`.")
    block = F.load_modelopt(export, {"model": man["model"]["id"]})
    run = Path(run) if run is not None else export.parent
    if not (run / "manifest.json").is_file():
        raise UserError(f"{run} is not a run directory; give the run the export was made from with --run RUN.")
    store = RunStore.open(run)
    if store.manifest.get("name", run.name) != man["run"]["name"] or store.manifest["model"]["id"] != man["model"]["id"]:
        raise UserError(f"{run} is not the run {export} was exported from (run {man['run']['name']}, model "
                        f"{man['model']['id']}); give it with --run RUN.")
    return {"export": export, "manifest": man, "block": block, "store": store, "fit": load_fit(run)}


def choose_samples(inp: dict, which: str, lengths: list[int] | None, limit: int | None) -> list[dict]:
    """The run's records to replay: ``which`` held-out (the fit's test split) or all finished ones."""
    store, fit = inp["store"], inp["fit"]
    ids = fit["split"]["test"] or fit["split"]["train"] if which == "held-out" else None
    done = store.done_ids()
    recs = [r for r in store.manifest["samples"] if r["id"] in done and (ids is None or r["id"] in ids)]
    if lengths:
        recs = [r for r in recs if r["length"] in lengths]
    if not recs:
        raise UserError(f"no finished {which} sample of {store.root} has a length in {lengths}; pick lengths the run "
                        "captured.")
    by_len: dict[int, list] = {}
    for r in recs:
        by_len.setdefault(r["length"], []).append(r)
    return [r for n in sorted(by_len) for r in by_len[n][:limit]]


def _laws(inp: dict) -> dict:
    tsf = inp["block"]["group"]["threshold_scale_factor"]
    return {m: (tsf[m]["a"], tsf[m]["b"]) for m in M.PHASES if m in tsf}


def predict(inp: dict, rec: dict, targets: list[float], pos: np.ndarray, cfg: StatsConfig, arrays: dict) -> dict:
    """{(phase, S): {skipped, total, diagonal, factor, lambda}} of one sample."""
    n, edges, out = rec["length"], cfg.gap_edges(), {}
    order = list(cfg.orders).index("forward")
    for phase, (a, b) in _laws(inp).items():
        for s in targets:
            factor = a * math.exp(b * s)
            x = math.log(factor / n)
            if phase == "prefill":
                got = CP.modelopt_prefill(arrays, edges, pos, order, cfg.block_m, n, x)
            else:
                got = CP.modelopt_decode(arrays, edges, pos, order, n, cfg, x)
            out[(phase, s)] = dict(got, factor=factor, **{"lambda": factor / n})
    return out


def _measure(model, ids, counter, decode_rows: int, key) -> None:
    """One prefill of the whole prompt (counted), then its cache cut back to the first N - R positions
    and the last R = ``decode_rows`` tokens fed one at a time (counted as decode steps)."""
    import torch

    counter.key = key
    with torch.no_grad():
        past = model(ids, use_cache=True).past_key_values
        r = min(decode_rows, ids.shape[1] - 1)
        if r <= 0:
            return
        past.crop(-r)  # keep the first N - R positions
        for t in range(ids.shape[1] - r, ids.shape[1]):
            past = model(ids[:, t:t + 1], past_key_values=past, use_cache=True).past_key_values


def _positions(inp: dict, enabled: dict) -> np.ndarray:
    """Positions (among the captured layers) of the layers whose module Model-Optimizer enabled."""
    captured = captured_layers(inp["store"].manifest)
    on = {int(name.split(".")[-2]) for name, e in enabled.items() if e and name.split(".")[-2].isdigit()}
    return np.array([i for i, layer in enumerate(captured) if layer in on], np.int64)


def run_verify(inp: dict, recs: list[dict], targets: list[float], masks: bool, model, device: str,
               progress=print) -> dict:
    """Predicted and measured counts of every (phase, target, length) on ``model`` (the run's model,
    eager attention, on ``device``); returns the verify document."""
    import torch

    store = inp["store"]
    cfg = StatsConfig.from_dict(store.manifest["config"])
    enabled = M.apply(model, inp["block"]["block"])
    counter = M.ExactCounter()
    counter.attach(model)
    pos = _positions(inp, enabled)
    pred: dict = {}
    dense, masked = {}, {}
    for i, rec in enumerate(recs, 1):
        t0 = time.monotonic()
        arrays = CP.load_sample_arrays(store, rec)
        for k, v in predict(inp, rec, targets, pos, cfg, arrays).items():
            acc = pred.setdefault((*k, rec["length"]), {"skipped": 0.0, "total": 0.0, "samples": 0})
            acc.update(skipped=acc["skipped"] + v["skipped"], total=acc["total"] + v["total"],
                       samples=acc["samples"] + 1, diagonal=v["diagonal"], factor=v["factor"])
        ids = torch.as_tensor(np.asarray(arrays["input_ids"], np.int64), device=device)[None]
        counter.counts = dense.setdefault("c", counter.counts)
        counter.dense(targets)
        _measure(model, ids, counter, cfg.decode_rows, rec["length"])
        if masks:
            for s in targets:
                counter.counts = masked.setdefault(s, M.defaultdict(lambda: [0, 0]))
                counter.masked(s)
                _measure(model, ids, counter, cfg.decode_rows, rec["length"])
        progress(f"  [{i}/{len(recs)}] {rec['id']} ({rec['length']} tokens): {time.monotonic() - t0:.1f} s")
    return document(inp, recs, targets, pred, dense.get("c", {}), masked, masks, device)


def document(inp, recs, targets, pred, dense, masked, masks: bool, device: str) -> dict:
    rows = []
    for (phase, s, n), p in sorted(pred.items()):
        d = dense.get((phase, s, n))
        m = masked.get(s, {}).get((phase, s, n)) if masks else None
        predicted = p["skipped"] / p["total"]
        measured = d[0] / d[1] if d and d[1] else None
        rows.append({"engine": "modelopt", "path": "hf-pytorch", "phase": phase, "target": s, "length": n,
                     "samples": p["samples"], "factor": p["factor"], "lambda": p["factor"] / n,
                     "saturated": p["factor"] / n >= 1.0, "predicted": predicted, "measured_dense": measured,
                     "measured_skipped": d[0] if d else None, "measured_total": d[1] if d else None,
                     "error": None if measured is None else measured - predicted, "diagonal": p["diagonal"],
                     "measured_masks": m[0] / m[1] if m and m[1] else None,
                     "drift": (m[0] / m[1] - measured) if (m and m[1] and measured is not None) else None})
    man = inp["manifest"]
    return {"kind": VERIFY_KIND, "schema_version": SCHEMA_VERSION, "engine": "modelopt", "export": str(inp["export"]), "run": man["run"],
            "model": man["model"]["id"], "consumer": _consumer_version(), "device": device,
            "samples": [r["id"] for r in recs], "targets": list(targets), "masks": masks,
            "law": {k: {"a": a, "b": b} for k, (a, b) in _laws(inp).items()}, "rows": rows,
            "provenance": provenance()}


def _consumer_version() -> str:
    from importlib.metadata import version

    return f"nvidia-modelopt {version('nvidia-modelopt')}"


def write(export: Path, doc: dict) -> Path:
    path = Path(export) / VERIFY_JSON
    atomic_write_text(path, F.json_text(doc))
    return path


def format_table(rows: list[dict]) -> str:
    """The predicted vs measured table as fixed-width text."""
    head = ("phase", "target", "tokens", "samples", "lambda", "predicted", "measured", "error", "masks applied",
            "drift")

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    body = [(r["phase"], f"{r['target']:g}", str(r["length"]), str(r["samples"]),
             f"{r['lambda']:.3g}" + (" >=1" if r["saturated"] else ""), f(r["predicted"], ".4f"),
             f(r["measured_dense"], ".4f"), f(r["error"], "+.4f"), f(r["measured_masks"], ".4f"),
             f(r["drift"], "+.4f")) for r in rows]
    return text_table(head, body)
