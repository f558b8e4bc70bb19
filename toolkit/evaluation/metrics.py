"""Fidelity of a method's next-token distributions against dense, computed in position chunks.

Shapes: N prompt positions, d hidden size, V vocabulary. The model's final hidden states
``h`` [N, d] (after the last norm) go through the output head ``head`` ([N, d] -> [N, V]) a
chunk of positions at a time. The dense reference (``Reference``) computes its log-probabilities
once per chunk and keeps them while they fit a byte budget (512 MiB by default: every chunk of a
SmolLM2 prompt up to 2.7K tokens); past it, the chunks beyond the budget are recomputed from
the kept hidden states on each use, so memory stays bounded at any prompt length.

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
BUDGET = 512 << 20  # bytes of dense log-probabilities kept per prompt


@dataclass(frozen=True)
class Fidelity:
    kl: float
    top1: float
    nll: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


class Reference:
    """Dense next-token log-probabilities [N, V] of a prompt, a chunk of positions at a time, from
    its final hidden states ``hidden`` [N, d]. Chunks are cached up to ``budget_bytes``."""

    def __init__(self, head, hidden: torch.Tensor, chunk: int = CHUNK, budget_bytes: int = BUDGET):
        self.head, self.hidden, self.chunk = head, hidden, chunk
        self.budget, self._cache, self._used = budget_bytes, {}, 0

    @torch.no_grad()
    def logprobs(self, start: int) -> torch.Tensor:
        """[n, V] float32 log-probabilities of positions start .. start + chunk - 1."""
        if start in self._cache:
            return self._cache[start]
        lp = torch.log_softmax(self.head(self.hidden[start:start + self.chunk]).float(), dim=-1)
        size = lp.numel() * lp.element_size()
        if self._used + size <= self.budget:
            self._cache[start], self._used = lp, self._used + size
        return lp


@torch.no_grad()
def fidelity(head, ref, h: torch.Tensor, input_ids: torch.Tensor, chunk: int = CHUNK) -> Fidelity:
    """KL(ref || h), top-1 agreement and the method's NLL, from hidden states [N, d] of the same
    prompt ``input_ids`` [N]. ``ref``: a ``Reference`` (or dense hidden states [N, d]); ``head``
    maps [n, d] to logits [n, V] (the model's output head)."""
    if not isinstance(ref, Reference):
        ref = Reference(head, ref, chunk, budget_bytes=0)
    n, chunk = h.shape[0], ref.chunk
    if ref.hidden.shape != h.shape or input_ids.shape[0] != n:
        raise ValueError(f"shapes differ: ref {tuple(ref.hidden.shape)}, method {tuple(h.shape)}, "
                         f"ids {tuple(input_ids.shape)}")
    zero = torch.zeros((), dtype=torch.float64, device=h.device)
    kl, agree, nll = zero, zero, zero  # summed on the device: one synchronisation per prompt
    targets = input_ids.to(h.device)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        lp_ref = ref.logprobs(start)
        lp = lp_ref if h is ref.hidden else torch.log_softmax(head(h[start:stop]).float(), dim=-1)
        kl = kl + (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0).sum().double()
        agree = agree + (lp_ref.argmax(-1) == lp.argmax(-1)).sum()
        nxt = targets[start + 1:stop + 1]  # the token each position predicts (none after the last)
        nll = nll - lp[:nxt.shape[0]].gather(-1, nxt[:, None]).sum().double()
    kl, agree, nll = torch.stack([kl, agree.double(), nll]).tolist()
    return Fidelity(kl=kl / n, top1=agree / n, nll=nll / max(n - 1, 1))


def sparsity(skipped, reachable) -> float:
    """Skipped candidate tiles over reachable tiles: counts, or [L, H] tensors summed over layers
    and heads. 0 when nothing was reachable (dense attention counts nothing)."""
    total = int(reachable.sum()) if isinstance(reachable, torch.Tensor) else int(reachable)
    skip = int(skipped.sum()) if isinstance(skipped, torch.Tensor) else int(skipped)
    return skip / total if total else 0.0
