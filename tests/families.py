"""Tiny random-weight checkpoints of the decoder families transformers ships, built from their configs:
each family's attention features (sliding windows, chunked layers, soft-capping, sinks, MQA, head
dim 256) at a size the CPU runs in a second. Layer kinds alternate so every model mixes them.

Shape: 4 layers, 4 query heads, vocab 300; ``WINDOW`` tokens of sliding window / chunk.
"""
from __future__ import annotations

import torch

WINDOW = 16
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
CHUNKED = ["chunked_attention", "full_attention", "chunked_attention", "full_attention"]
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512)

# family -> (config class name, config overrides); the features column of docs/design.md "Models"
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=MIXED)),
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=MIXED)),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, layer_types=MIXED, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=16)),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=WINDOW, layer_types=MIXED, num_key_value_heads=1,
                                             head_dim=256, query_pre_attn_scalar=256)),
    "gpt_oss": ("GptOssConfig", dict(sliding_window=WINDOW, layer_types=MIXED, num_local_experts=2,
                                     num_experts_per_tok=1)),
    "llama4_text": ("Llama4TextConfig", dict(attention_chunk_size=WINDOW, layer_types=CHUNKED, num_local_experts=1,
                                             intermediate_size_mlp=64, no_rope_layers=[1, 1, 1, 1])),
}


def family_config(family: str, **overrides):
    import transformers

    name, extra = FAMILIES[family]
    return getattr(transformers, name)(**{**COMMON, **extra, **overrides})


def make_family_checkpoint(path, seed: int, family: str, **overrides):
    """Save a random-weight checkpoint of ``family`` under path (a deterministic function of seed)."""
    from transformers import AutoModelForCausalLM

    cfg = family_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    return path
