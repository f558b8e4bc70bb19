"""VFA's joint stabilization statistic on a real model, per layer: how far the max VFA freezes,
max(Q-init estimate, exact max over the sink and local blocks), sits from the row's true max.

Runs the model's prompts through the capture reference (kernels/capture/reference.py,
``instrumented_attention``: fp32, every row) with an AttentionInterface function that keeps each
layer's ``joint_err`` [H, N] (frozen max - true max, nats of scaled scores). Per layer: rows, the
share of rows where the frozen max is below the true max by more than 1 and 5 nats (the rows whose
later blocks exceed the frozen max: VFA's p > 1 region, exact in real arithmetic, bounded by the P
dtype's range in floating point), the share above it by more than 5 nats (a frozen max far above
the true max scales every p down: underflow, not overflow), the median, 1st percentile and max.

    python -m sparsecal.bench.vfa [--model smollm2] [--tasks text,niah_single] [--length 2048]
        [--out data/bench/vfa-joint-smollm2-cpu.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparsecal.formats.files import atomic_write_text
from sparsecal.formats.provenance import provenance

NAME = "sparsecal_vfa_joint"


def _attention(store: dict, cfg):
    from sparsecal.kernels.capture.reference import instrumented_attention

    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """query [1, H, N, D], key/value [1, Hkv, N, D] -> ([1, N, H, D], None); keeps joint_err."""
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out, tiles = instrumented_attention(query, key, value, scale, cfg)
        store.setdefault(module.layer_idx, []).append(tiles.joint_err.flatten())
        return out.transpose(1, 2).contiguous(), None

    return fn


def layer_rows(errs: dict) -> list[dict]:
    """Per layer: the statistics of its joint_err values (every head, row and prompt)."""
    rows = []
    for layer in sorted(errs):
        e = torch.cat(errs[layer]).double()
        rows.append({"layer": layer, "rows": int(e.numel()), "below_1": float((e < -1).double().mean()),
                     "below_5": float((e < -5).double().mean()), "above_5": float((e > 5).double().mean()),
                     "median": float(e.median()),
                     "p01": float(torch.quantile(e, 0.01)), "max": float(e.max())})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tasks", default="text,niah_single")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from transformers import AttentionInterface

    from sparsecal.capture.models import load_model, load_tokenizer, resolve_model
    from sparsecal.capture.prompts import build_task_prompts
    from sparsecal.formats.stats_config import StatsConfig

    ms = resolve_model(args.model)
    model = load_model(ms, "float32", "cpu", attn="sdpa")
    errs: dict = {}
    AttentionInterface.register(NAME, _attention(errs, StatsConfig()))
    model.set_attn_implementation(NAME)
    prompts = build_task_prompts(load_tokenizer(ms), args.tasks.split(","), [args.length], 1, seed=20261126)
    with torch.no_grad():
        for p in prompts:
            model(torch.as_tensor([p.input_ids]))
    doc = {"benchmark": "vfa-joint", "provenance": provenance(), "model": ms.model_id, "tasks": args.tasks,
           "length": args.length, "prompts": len(prompts), "layers": layer_rows(errs)}
    for r in doc["layers"]:
        print(f"layer {r['layer']:2d}: rows {r['rows']}, below -1 nat {r['below_1']:.3f}, below -5 {r['below_5']:.3f}, "
              f"above +5 {r['above_5']:.3f}, median {r['median']:+.2f}, 1st percentile {r['p01']:+.2f}, max {r['max']:+.2f}")
    if args.out:
        atomic_write_text(args.out, json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
