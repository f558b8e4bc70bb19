"""Random-weight checkpoints and prompts for the model benchmarks (speed does not depend on the
weights; statistics do, and are then the random model's own).

``llama_config(layers)`` is Llama-3.1-8B's shape (32 query heads, 8 KV heads, D = 128, hidden
4096, MLP 14336, vocabulary 128256, RoPE theta 5e5, 128K positions) with ``layers`` of its 32
layers; ``tiny=True`` a 2-head Llama small enough for the CPU.

    python -m sparsecal.bench.random_model --out DIR [--layers 4] [--tiny]
        [--prompts FILE --lengths 32768,65536 --samples 2 --seed 1]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sparsecal.bench.harness import log


def llama_config(layers: int, tiny: bool = False):
    """Llama-3.1-8B's shape with ``layers`` layers (or a tiny CPU Llama)."""
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096)
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                       rope_theta=500000.0)


def save_checkpoint(cfg, path: Path, dtype: torch.dtype, device: str, seed: int = 0) -> int:
    """Initialize ``cfg``'s Llama with ``seed`` on ``device`` in ``dtype`` and save it at ``path``
    (safetensors); returns the bytes of its weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(path)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return weights


def write_prompts(path: Path, vocab_size: int, lengths, samples: int, seed: int) -> None:
    """A prompts file (``sparsecal capture --prompts-file``): ``samples`` random token-id prompts
    per length, drawn with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for n in lengths:
            f.writelines(json.dumps({"input_ids": torch.randint(0, vocab_size, (n,), generator=g).tolist()}) + "\n"
                         for _ in range(samples))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="checkpoint directory")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 Llama on the CPU")
    ap.add_argument("--prompts", type=Path, default=None, help="also write a prompts file here")
    ap.add_argument("--lengths", default="32768,65536,131072")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    cfg = llama_config(args.layers, args.tiny)
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.tiny
    weights = save_checkpoint(cfg, args.out, torch.bfloat16 if cuda else torch.float32, "cuda" if cuda else "cpu")
    log(f"checkpoint {args.out}: {args.layers} layers, {weights / 2**30:.2f} GiB of weights, "
        f"in {time.perf_counter() - t0:.1f} s")
    if args.prompts:
        lengths = [int(x) for x in args.lengths.split(",")]
        write_prompts(args.prompts, cfg.vocab_size, lengths, args.samples, args.seed)
        log(f"prompts {args.prompts}: {args.samples} x {lengths} tokens (seed {args.seed})")


if __name__ == "__main__":
    main()
