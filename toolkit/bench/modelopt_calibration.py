"""Head-to-head: sparsecal's calibration against Model-Optimizer's own (its DynamicThresholdCalibrator,
default 20 threshold trials) on the same model, prompts, lengths and targets.

    python -m sparsecal.bench.modelopt_calibration --run RUN --export EXPORT --out DIR [--device cpu]

RUN: a run captured at Model-Optimizer's tiles (``capture --engine modelopt``), fitted and exported
with ``--format modelopt`` into EXPORT. Both calibrations see the run's calibration (train) prompts:

- sparsecal: ``capture`` + ``fit`` + ``export`` of those prompts, timed as subprocesses of the CLI
  into DIR/sparsecal-run (its statistics include BSFA, stabilization and the gap histograms of every
  target at once; the capture's seconds include its process start and model load, which
  Model-Optimizer's row adds as ``total_with_load``); the 1-minute load average before and after
  each side is recorded (the CPU machine is shared);
- Model-Optimizer: its HF path on the same model (eager attention), ``DynamicThresholdCalibrator``
  for prefill (the whole prompt) and for decode (its decode loop's scheme: an SDPA prefill, then
  the last R = the run's decode rows fed one at a time through the sparse path), timed in-process.

Both sides skip on the same layers: the export's block (its ``ignore``) is applied through
Model-Optimizer's HF path before its calibrator runs, and sparsecal's own export of the train
prompts leaves the same layers dense (the default --min-layer-sparsity, the same samples).
Then both laws are measured on the run's held-out prompts by the same exact counter
(integrations.consumer_modelopt.ExactCounter, dense statistics: no mask applied), per phase,
target and length: achieved sparsity and retained softmax mass (the mass Model-Optimizer's own
mask keeps). Writes DIR/result.json (kind sparsecal-bench, benchmark modelopt-calibration).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from sparsecal.capture.models import load_run_model
from sparsecal.formats import engine_files as F
from sparsecal.formats.files import atomic_write_text
from sparsecal.formats.provenance import provenance
from sparsecal.formats.run import RunStore
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.integrations import consumer_modelopt as M
from sparsecal.integrations import consumer_verify as V


def _ids(store, rec, device):
    import torch

    _, t = store.load_sample(rec["id"], keys=("input_ids",))
    return torch.as_tensor(np.asarray(t["input_ids"], np.int64), device=device)[None]


def time_sparsecal(store, train: list[dict], targets: list[float], out: Path) -> dict:
    """Wall time of the CLI's capture, fit and export of the train prompts (fresh run in ``out``)."""
    prompts = out / "train-prompts.jsonl"
    lines = [json.dumps({"input_ids": np.asarray(store.load_sample(r["id"], keys=("input_ids",))[1]["input_ids"]).tolist()})
             for r in train]
    atomic_write_text(prompts, "\n".join(lines) + "\n")
    cfg, run = store.manifest["config"], out / "sparsecal-run"
    cli = [sys.executable, "-m", "sparsecal.cli"]
    steps = {"capture": cli + ["capture", "--model", store.manifest["model"]["spec"], "--prompts-file", str(prompts),
                               "--out", str(run), "--engine", "modelopt", "--orders", "forward", "--decode-rows",
                               str(cfg["decode_rows"])],
             "fit": cli + ["fit", str(run), "--engine", "modelopt", "--holdout", "0", "--targets",
                           ",".join(f"{t:g}" for t in targets)],
             "export": cli + ["export", str(run), "--out", str(run / "export"), "--format", "modelopt"]}
    secs = {}
    for name, argv in steps.items():
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        secs[name] = time.perf_counter() - t0
    secs["total"] = sum(secs.values())
    return {"seconds": secs, "law": _block_law(run / "export")}


def _block_law(export: Path) -> dict:
    tsf = F.load_modelopt(export)["group"]["threshold_scale_factor"]
    return {m: {"a": tsf[m]["a"], "b": tsf[m]["b"]} for m in M.PHASES if m in tsf}


def time_modelopt(model, store, train: list[dict], decode_rows: int, device: str) -> dict:
    """Model-Optimizer's calibrator on ``model`` (already sparsified through its HF path): prefill,
    then decode; wall time and (a, b) per phase."""
    import torch
    from modelopt.torch.sparsity.attention_sparsity.calibration.calibrator import DynamicThresholdCalibrator
    from modelopt.torch.sparsity.attention_sparsity.utils import get_named_sparse_attention_modules

    for _, module in get_named_sparse_attention_modules(model):   # its calibrator measures threshold trials
        module._sparse_method_instance.calibration_params = None
    ids = [_ids(store, r, device) for r in train]

    def prefill_loop(m):
        for x in ids:
            m(x, use_cache=False)

    def decode_loop(m):
        for x in ids:
            impl = m.config._attn_implementation
            m.config._attn_implementation = "sdpa"
            past = m(x[:, :-decode_rows], use_cache=True).past_key_values
            m.config._attn_implementation = impl
            for t in range(x.shape[1] - decode_rows, x.shape[1]):
                past = m(x[:, t:t + 1], past_key_values=past, use_cache=True).past_key_values

    out = {"seconds": {}, "law": {}, "fit": {}}
    for phase, loop in (("prefill", prefill_loop), ("decode", decode_loop)):
        cal = DynamicThresholdCalibrator()
        t0 = time.perf_counter()
        with torch.no_grad():
            got = cal.calibrate(model, loop, phase=phase)
        out["seconds"][phase] = time.perf_counter() - t0
        out["trials"] = len(cal.threshold_trials)
        if "a" in got:
            out["law"][phase] = {"a": got["a"], "b": got["b"]}
            out["fit"][phase] = {k: got[k] for k in ("r_squared", "num_data_points", "total_samples")}
    out["seconds"]["total"] = sum(out["seconds"].values())
    return out


def held_out(model, store, held: list[dict], laws: dict, targets: list[float], decode_rows: int, device: str) -> list:
    """Achieved sparsity and retained mass of each law at each target, per phase and length."""
    from modelopt.torch.sparsity.attention_sparsity.utils import get_named_sparse_attention_modules

    rows = []
    for name, law in laws.items():
        for _, module in get_named_sparse_attention_modules(model):
            module._sparse_method_instance.calibration_params = law
            module._sparse_method_instance.target_sparse_ratio = {p: targets[0] for p in M.PHASES}
        counter = M.ExactCounter(mass=True)
        counter.attach(model)
        counter.dense(targets)
        for rec in held:
            V._measure(model, _ids(store, rec, device), counter, decode_rows, rec["length"])
        for (phase, s, n), (skipped, total) in sorted(counter.counts.items()):
            kept, nrows = counter.mass[(phase, s, n)]
            rows.append({"law": name, "phase": phase, "target": s, "length": n, "achieved": skipped / total,
                         "error": skipped / total - s, "retained_mass": kept / nrows, "tiles": total})
        _unwrap(counter)
    return rows


def _unwrap(counter) -> None:
    for method in counter.methods:
        del method.calc_correction_factor_and_p   # back to the class's method
        method.set_calibration_mode(False)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    inp = V.open_inputs(args.export, args.run)
    store: RunStore = inp["store"]
    cfg = StatsConfig.from_dict(store.manifest["config"])
    split = inp["fit"]["split"]
    recs = {r["id"]: r for r in store.manifest["samples"]}
    train, held = [recs[i] for i in split["train"]], [recs[i] for i in (split["test"] or split["train"])]
    targets = sorted({p[0] for m in (inp["manifest"].get("law") or {}).values() for p in m["points"]})
    print(f"sparsecal: capture + fit + export of {len(train)} prompts", flush=True)
    load0 = os.getloadavg()[0]
    ours = time_sparsecal(store, train, targets, args.out)
    ours["load_average"] = [load0, os.getloadavg()[0]]
    t0 = time.perf_counter()
    model = load_run_model(store.manifest, args.device, attn="eager")
    M.apply(model, inp["block"]["block"])
    load_s = time.perf_counter() - t0
    print(f"Model-Optimizer: DynamicThresholdCalibrator on the same {len(train)} prompts", flush=True)
    load0 = os.getloadavg()[0]
    theirs = time_modelopt(model, store, train, cfg.decode_rows, args.device)
    theirs["seconds"]["model_load"] = load_s        # sparsecal's capture seconds include its own model load
    theirs["seconds"]["total_with_load"] = theirs["seconds"]["total"] + load_s
    theirs["load_average"] = [load0, os.getloadavg()[0]]
    laws = {"sparsecal": ours["law"], "modelopt": theirs["law"]}
    rows = held_out(model, store, held, laws, targets, cfg.decode_rows, args.device)
    doc = {"kind": "sparsecal-bench", "benchmark": "modelopt-calibration", "run": str(args.run),
           "export": str(args.export), "consumer": V._consumer_version(), "device": args.device,
           "train": [r["id"] for r in train], "held_out": [r["id"] for r in held], "targets": targets,
           "sparsecal": ours, "modelopt": theirs, "rows": rows, "provenance": provenance()}
    atomic_write_text(args.out / "result.json", F.json_text(doc))
    print(json.dumps({k: doc[k]["seconds"] for k in ("sparsecal", "modelopt")}, indent=1))
    return doc


if __name__ == "__main__":
    main()
