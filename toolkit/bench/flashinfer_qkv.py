"""Captured Q/K/V for the FlashInfer skip-softmax comparison (``bench/flashinfer_skip.py``): the
post-RoPE query, key and value of a few layers exactly as the attention function receives them
(key/value before any GQA repeat), from one of sparsecal's prompts, saved as bf16 safetensors.

    python -m sparsecal.bench.flashinfer_qkv --out DIR [--model smollm2] [--task niah_single]
        [--lengths 4096,8192] [--layers 3,15,27] [--seed 1]

Writes DIR/qkv-N.safetensors per length N with tensors ``L{layer}.q`` [H, N, D], ``L{layer}.k``,
``L{layer}.v`` [Hkv, N, D] (bf16) and metadata (model, task, seed, length, layers, scale).
Runs on the CPU in float32 (the model's own dtype on a GPU is not needed for a few layers).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparsecal.bench.harness import log

CAPTURE_NAME = "sparsecal_fi_capture"


def _capture_fn(store: dict, layers: set[int]):
    """An AttentionInterface function that keeps q/k/v of ``layers`` and runs plain SDPA."""
    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        if layer in layers:
            store[layer] = (query[0].to(torch.bfloat16).clone(), key[0].to(torch.bfloat16).clone(),
                            value[0].to(torch.bfloat16).clone(), scaling)
        rep = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(rep, dim=1)
        v = value.repeat_interleave(rep, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    return fn


def capture(model_spec: str, task: str, lengths: list[int], layers: list[int], seed: int, out: Path) -> list[Path]:
    """Capture and save; returns the files written."""
    from safetensors.torch import save_file
    from transformers import AttentionInterface

    from sparsecal.capture.models import load_model, load_tokenizer, resolve_model
    from sparsecal.capture.prompts.tasks import build_sample, sample_seed
    from sparsecal.formats.files import atomic_write

    ms = resolve_model(model_spec)
    store: dict = {}
    AttentionInterface.register(CAPTURE_NAME, _capture_fn(store, set(layers)))
    tok = load_tokenizer(ms)
    model = load_model(ms, "float32", "cpu", attn=CAPTURE_NAME)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for n in lengths:
        sample = build_sample(tok, task, n, sample_seed(seed, task, n, 0), 0)
        store.clear()
        with torch.inference_mode():
            model(torch.tensor([sample.input_ids]), use_cache=False, logits_to_keep=1)
        tensors, scale = {}, None
        for layer in layers:
            q, k, v, scale = store[layer]
            tensors.update({f"L{layer}.q": q.contiguous(), f"L{layer}.k": k.contiguous(),
                            f"L{layer}.v": v.contiguous()})
        meta = {"model": ms.model_id, "task": task, "seed": str(seed), "length": str(n),
                "layers": json.dumps(layers), "scale": repr(scale)}
        path = out / f"qkv-{n}.safetensors"
        atomic_write(path, lambda p, t=tensors, m=meta: save_file(t, str(p), metadata=m))
        written.append(path)
        log(f"captured {path} ({len(layers)} layers, N={n})")
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--lengths", default="4096,8192")
    ap.add_argument("--layers", default="3,15,27")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    capture(a.model, a.task, [int(x) for x in a.lengths.split(",")], [int(x) for x in a.layers.split(",")],
            a.seed, a.out)


if __name__ == "__main__":
    main()
