"""Benchmark: a 4K-token capture of SmolLM2 on the CPU against the plain forward of the same prompt.

Both run the same call (batch 1, no KV cache, logits of the last position only); the plain forward
uses PyTorch SDPA, the capture the instrumented reference attention plus reductions. Runs are
interleaved (plain, capture, plain, ...) and the medians compared, so drift hits both alike.

    python -m sparsecal.bench.capture_model [--length 4096] [--repeats 3] [--out data/bench/capture-cpu.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sparsecal.capture.models import load_model, load_tokenizer, resolve_model
from sparsecal.capture.prompts import build_sample
from sparsecal.capture.runner import capture_sample
from sparsecal.formats.provenance import provenance
from sparsecal.formats.stats_config import StatsConfig


@torch.no_grad()
def plain_forward(model, ids):
    return model(torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits


def run(length: int, repeats: int) -> dict:
    ms = resolve_model("smollm2")
    model, tok = load_model(ms), load_tokenizer(ms)
    ids = build_sample(tok, "niah_single", length, seed=1234).input_ids
    cfg = StatsConfig()
    plain_forward(model, ids[:512])  # warm-up both paths
    capture_sample(model, ids[:512], cfg)
    plain, cap = [], []
    for r in range(repeats):
        t = time.perf_counter()
        plain_forward(model, ids)
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        capture_sample(model, ids, cfg)
        cap.append(time.perf_counter() - t)
        print(f"repeat {r + 1}/{repeats}: plain {plain[-1]:.2f} s, capture {cap[-1]:.2f} s", flush=True)
    p, c = statistics.median(plain), statistics.median(cap)
    return {"benchmark": "capture-cpu", "model": ms.model_id, "length": length, "dtype": "float32",
            "config": cfg.to_dict(), "repeats": repeats, "plain_s": plain, "capture_s": cap,
            "plain_median_s": p, "capture_median_s": c, "ratio": c / p, "target_ratio": 3.0,
            "provenance": provenance()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("data/bench/capture-cpu.json"))
    args = ap.parse_args(argv)
    result = run(args.length, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"capture / plain forward at {args.length} tokens: {result['capture_median_s']:.2f} s / "
          f"{result['plain_median_s']:.2f} s = {result['ratio']:.2f}x (target <= 3x) -> {args.out}")


if __name__ == "__main__":
    main()
