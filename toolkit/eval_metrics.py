"""Fidelity of a method's next-token distributions against dense, computed in position chunks.

Shapes: N prompt positions, d hidden size, V vocabulary. The model's final hidden states
``h`` [N, d] (after the last norm) go through the output head ``head`` ([N, d] -> [N, V]) a
chunk of positions at a time, so memory stays O(chunk * V) at any prompt length; the dense
reference is kept as hidden states, never as [N, V] log-probabilities.

    kl     mean over the N positions of KL(dense || method) of the next-token distributions
           (natural log; 0 when the method reproduces dense)
    top1   share of the N positions whose most likely next token is dense's
    nll    mean negative log-likelihood of the prompt's own next tokens (positions 0..N-2);
           perplexity = exp(nll)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CHUNK = 256


@dataclass(frozen=True)
class Fidelity:
    kl: float
    top1: float
    nll: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


@torch.no_grad()
def fidelity(head, h_ref: torch.Tensor, h: torch.Tensor, input_ids: torch.Tensor,
             chunk: int = CHUNK) -> Fidelity:
    """KL(ref || h), top-1 agreement and the method's NLL, from hidden states [N, d] of the same
    prompt ``input_ids`` [N]. ``head`` maps [n, d] to logits [n, V] (the model's output head)."""
    n = h.shape[0]
    if h_ref.shape != h.shape or input_ids.shape[0] != n:
        raise ValueError(f"shapes differ: ref {tuple(h_ref.shape)}, method {tuple(h.shape)}, ids {tuple(input_ids.shape)}")
    kl = agree = nll = 0.0
    targets = input_ids.to(h.device)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        lp = torch.log_softmax(head(h[start:stop]).float(), dim=-1)
        lp_ref = lp if h_ref is h else torch.log_softmax(head(h_ref[start:stop]).float(), dim=-1)
        kl += float((lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0).sum())
        agree += float((lp_ref.argmax(-1) == lp.argmax(-1)).sum())
        nxt = targets[start + 1:stop + 1]  # the token each position predicts (none after the last)
        nll -= float(lp[:nxt.shape[0]].gather(-1, nxt[:, None]).sum())
    return Fidelity(kl=kl / n, top1=agree / n, nll=nll / max(n - 1, 1))


def sparsity(skipped, reachable) -> float:
    """Skipped candidate tiles over reachable tiles: counts, or [L, H] tensors summed over layers
    and heads. 0 when nothing was reachable (dense attention counts nothing)."""
    total = int(reachable.sum()) if isinstance(reachable, torch.Tensor) else int(reachable)
    skip = int(skipped.sum()) if isinstance(skipped, torch.Tensor) else int(skipped)
    return skip / total if total else 0.0
