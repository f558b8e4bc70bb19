"""Attention logit soft-capping (Gemma 2): the plain-torch side, shared by every reference.

With a cap c > 0 the scaled score s = scale * q.k becomes c * tanh(s / c) BEFORE anything reads
it: the softmax, every statistic (block maxima, gaps, running max, t*, masses, the Q-init
estimate) and every BSFA / BLASST decision. c = 0 (or None) is off: scores are used as they are.
tanh maps -inf to -1, so the cap goes on before the causal / length masks set -inf.

The Triton kernels cap through ``jit.soft_cap`` (same definition, the cap in their log2 units);
``jit.softcap_args`` turns the keyword into their (SOFTCAP, cap) launch arguments.

Shape legend: any score tensor (e.g. [H, M, N] scores of M query rows against N keys).
"""
from __future__ import annotations

import math

import torch


def check_softcap(softcap) -> float:
    """The cap as a float: 0.0 when off (0 or None), else a finite positive value; ValueError otherwise."""
    if softcap is None:
        return 0.0
    cap = float(softcap)
    if cap == 0.0:
        return 0.0
    if not math.isfinite(cap) or cap < 0.0:
        raise ValueError(f"softcap must be a finite number > 0 (or 0 / None for no cap), got {softcap!r}")
    return cap


def soft_cap(s: torch.Tensor, softcap) -> torch.Tensor:
    """cap * tanh(s / cap) of scaled scores s (any shape; s itself when the cap is off). Apply it
    before masking: a masked (-inf) score would become -cap."""
    cap = check_softcap(softcap)
    if not cap:
        return s
    return torch.tanh(s / cap) * cap


def soft_cap_(s: torch.Tensor, softcap) -> torch.Tensor:
    """``soft_cap`` in place (s is returned)."""
    cap = check_softcap(softcap)
    if cap:
        s.div_(cap).tanh_().mul_(cap)
    return s
