"""Exact dense attention of one decoder layer as the model defines it: the path of every layer that
sparsecal leaves alone (sliding-window and chunked layers, layers outside ``--layers``, layers a
sparse export ignores) and the definition those layers are tested against.

Causal attention of the last Nq positions of a sequence of Nk keys (prefill: Nq = Nk; decode with
a KV cache: Nq = 1), with the features current decoders add:

    window  W   key t is visible to query position p when p - W < t <= p (transformers'
                sliding_window: W keys, the query's own included)
    chunk   C   key t is visible when t // C == p // C and t <= p (Llama 4's chunked attention)
    softcap c   scaled scores s become c * tanh(s / c) before the softmax (Gemma 2)
    sinks   [H] per-head sink logits that join every row's softmax denominator and carry no value
                (gpt-oss)

Without softcap and sinks it runs PyTorch's SDPA (with a boolean mask when W or C is set); with
them, a float32 softmax over query-row chunks, so memory stays at H * ROWS * Nk scores.

Shape legend
    B batch   H query heads   Hkv key/value heads (H % Hkv == 0)   Nq queries   Nk keys   D head dim
"""
from __future__ import annotations

import torch

from sparsecal.kernels.softcap import soft_cap_

ROWS = 1024  # query rows per chunk of the explicit (softcap / sinks) path


def visible(nq: int, nk: int, window: int | None, chunk: int | None, device) -> torch.Tensor:
    """[Nq, Nk] bool: which keys each of the last Nq query positions sees."""
    pos = torch.arange(nk - nq, nk, device=device)[:, None]
    key = torch.arange(nk, device=device)[None, :]
    ok = key <= pos
    if window:
        ok &= key > pos - window
    if chunk:
        ok &= key // chunk == pos // chunk
    return ok


def layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                    window: int | None = None, chunk: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Nq, D], k/v [B, Hkv, Nk, D] (Nq <= Nk) -> out [B, H, Nq, D] in q.dtype."""
    b, h, nq, d = q.shape
    nk, group = k.shape[2], h // k.shape[1]
    if softcap is None and sinks is None:
        plain = not window and not chunk and nq in (1, nk)  # SDPA's own causal flag or no mask at all
        mask = None if plain else visible(nq, nk, window, chunk, q.device)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=plain and nq > 1, scale=scale, enable_gqa=group > 1)
    kr = k.float().repeat_interleave(group, 1)
    vr = v.float().repeat_interleave(group, 1)
    out = torch.empty(b, h, nq, d, dtype=q.dtype, device=q.device)
    for r0 in range(0, nq, ROWS):
        r1 = min(nq, r0 + ROWS)
        s = soft_cap_(scale * q[:, :, r0:r1].float() @ kr.transpose(-1, -2), softcap)
        ok = visible(nq, nk, window, chunk, q.device)[r0:r1]
        s = s.masked_fill(~ok, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.float().view(1, h, 1, 1).expand(b, h, r1 - r0, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)
        if sinks is not None:
            p = p[..., :-1]
        out[:, :, r0:r1] = (p @ vr).to(q.dtype)
    return out
