"""Plain-torch causal attention: the semantics of the dense Triton kernel (kernels/dense.py).

Shape legend
    B batch    H query heads    Hkv key/value heads (H % Hkv == 0)    N sequence length    D head dim
"""
from __future__ import annotations

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """float64 causal softmax attention, query head h reading KV head h // (H // Hkv).

    q [B, H, N, D], k/v [B, Hkv, N, D] -> (out [B, H, N, D] float64, lse [B, H, N] float64, the
    natural-log log-sum-exp of each row's scaled scores)."""
    group = q.shape[1] // k.shape[1]
    kr = k.double().repeat_interleave(group, 1)
    vr = v.double().repeat_interleave(group, 1)
    s = scale * q.double() @ kr.transpose(-1, -2)
    n = q.shape[2]
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), 1), float("-inf"))
    return torch.softmax(s, -1) @ vr, torch.logsumexp(s, -1)
