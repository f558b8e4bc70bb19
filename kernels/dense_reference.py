"""Plain-torch causal attention: the semantics of the dense Triton kernel (kernels/dense.py).

Shape legend
    B batch    H query heads    Hkv key/value heads (H % Hkv == 0)    N sequence length    D head dim
"""
from __future__ import annotations

import torch

from sparsecal.kernels.softcap import soft_cap


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, softcap: float = 0.0):
    """float64 causal softmax attention, query head h reading KV head h // (H // Hkv); with softcap
    c > 0 the scaled scores s are replaced by c * tanh(s / c) first (Gemma 2).

    q [B, H, N, D], k/v [B, Hkv, N, D] -> (out [B, H, N, D] float64, lse [B, H, N] float64, the
    natural-log log-sum-exp of each row's scaled (capped) scores)."""
    group = q.shape[1] // k.shape[1]
    kr = k.double().repeat_interleave(group, 1)
    vr = v.double().repeat_interleave(group, 1)
    s = soft_cap(scale * q.double() @ kr.transpose(-1, -2), softcap)
    n = q.shape[2]
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), 1), float("-inf"))
    return torch.softmax(s, -1) @ vr, torch.logsumexp(s, -1)
