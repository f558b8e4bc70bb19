"""The model side of an evaluation: switch the attention method, prefill a prompt, decode greedily.

Shapes: N prompt tokens, d hidden size, L layers, H query heads. ``prefill`` runs the decoder
body (``model.base_model``) once over the prompt with a KV cache and keeps the final hidden
states [N, d] (after the last norm), from which the metrics draw next-token distributions in
chunks (metrics.py) and ``generate`` the first new token; decode then continues from the
cache one token at a time. Under a sparse method every forward leaves the skipped and reachable
tiles of that forward in ``model.sparsecal_stats`` ([L, H] each); prefill keeps its own counts
and decode sums them over its steps. ``law`` is where the forward's length sits against the BLASST
law's validated lengths (integrations/sparsify_laws.py: below | interpolated | extrapolated; decode:
the worst over its steps; None without a law).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparsecal.evaluation.methods import Method


@dataclass
class Prefill:
    hidden: torch.Tensor            # [N, d] final hidden states of the prompt
    cache: object                   # the KV cache after the prompt
    seconds: float
    skipped: int = 0                # candidate tiles skipped, summed over layers and heads
    reachable: int = 0              # reachable tiles, summed likewise (0 for dense)
    law: str | None = None          # the BLASST law's regime at this length (sparsify_laws)


@dataclass
class Generation:
    tokens: list                    # the new token ids
    seconds: float
    skipped: int = 0
    reachable: int = 0
    law: str | None = None          # the worst regime over the decode steps (sparsify_laws.worst_regime)


def use_method(model, method: Method, export_dir, model_id: str, extrapolate: bool = False):
    """Switch ``model`` to ``method`` (sdpa: the model's own attention); ``extrapolate``: BLASST past
    its law's validated lengths applies a/L instead of running dense (sparsify's keyword)."""
    from sparsecal.integrations.sparsify import densify, sparsify

    densify(model)
    if method.name != "sdpa":
        sparsify(model, export_dir, model_id=model_id, extrapolate=extrapolate, **method.sparsify_kwargs)
    return model


def _counts(model) -> tuple[int, int]:
    """(skipped, reachable) tiles of the last forward, 0 and 0 when the model runs dense."""
    stats = getattr(model, "sparsecal_stats", None)
    if stats is None or not hasattr(model, "_sparsecal_state"):
        return 0, 0
    return int(stats["skipped"].sum()), int(stats["reachable"].sum())


def _law(model) -> str | None:
    """The law regime of the last forward (``model.sparsecal_law``), None when it has none."""
    law = getattr(model, "sparsecal_law", None)
    return law.get("law") if law is not None and hasattr(model, "_sparsecal_state") else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def prefill(model, input_ids: list[int]) -> Prefill:
    """One forward of the decoder body over the prompt; hidden states [N, d] and the cache."""
    device = model.device
    ids = torch.tensor([input_ids], device=device)
    _sync(device)
    t0 = time.perf_counter()
    out = model.base_model(input_ids=ids, use_cache=True)
    _sync(device)
    seconds = time.perf_counter() - t0
    skipped, reachable = _counts(model)
    return Prefill(out.last_hidden_state[0], out.past_key_values, seconds, skipped, reachable, _law(model))


@torch.no_grad()
def generate(model, pre: Prefill, max_new_tokens: int, eos_ids: set) -> Generation:
    """Greedy decoding from the prompt's cache: at most ``max_new_tokens``, stopping at EOS."""
    from sparsecal.integrations.sparsify_laws import worst_regime

    device = model.device
    head = model.get_output_embeddings()
    nxt = int(head(pre.hidden[-1:]).argmax(-1))
    tokens, cache, skipped, reachable, laws = [nxt], pre.cache, 0, 0, []
    _sync(device)
    t0 = time.perf_counter()
    while len(tokens) < max_new_tokens and nxt not in eos_ids:
        out = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        s, r = _counts(model)
        skipped, reachable = skipped + s, reachable + r
        laws.append(_law(model))
        nxt = int(out.logits[0, -1].argmax(-1))
        tokens.append(nxt)
    _sync(device)
    return Generation(tokens, time.perf_counter() - t0, skipped, reachable, worst_regime(laws))


@torch.no_grad()
def answer_logprob(model, pre: Prefill, answer_ids: list[int]) -> float:
    """Teacher-forced log-likelihood of ``answer_ids`` after the prompt: the sum over the answer's
    tokens of ln p(token | prompt, the answer's earlier tokens). The first token's distribution is
    the prefill's last position; each further one comes from a decode step (the method's decode
    path) on a copy of the prompt's cache, so ``generate`` still starts from the prompt alone."""
    import copy

    head = model.get_output_embeddings()
    device = model.device
    total = float(torch.log_softmax(head(pre.hidden[-1:]).float(), dim=-1)[0, answer_ids[0]])
    cache = copy.deepcopy(pre.cache)
    for prev, nxt in zip(answer_ids[:-1], answer_ids[1:]):
        out = model(input_ids=torch.tensor([[prev]], device=device), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        total += float(torch.log_softmax(out.logits[0, -1].float(), dim=-1)[nxt])
    return total


def eos_ids(model, tokenizer) -> set:
    """Token ids that end a generation (the generation config's and the tokenizer's EOS)."""
    ids = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is not None:
            ids.update([source] if isinstance(source, int) else source)
    return ids
