"""The model side of an evaluation: switch the attention method, prefill a prompt, decode greedily.

Shapes: B prompts of N tokens each, d hidden size, L layers, H query heads. ``prefill_batch``
runs the decoder body (``model.base_model``) once over B prompts of one length (no padding: the
rows never mix) with a KV cache and keeps the final hidden states [B, N, d] (after the last norm),
from which the metrics draw next-token distributions in chunks (metrics.py) and
``generate_batch`` the first new tokens; decode then continues from the cache one token a step
for the whole batch (the cache appending in place, kv_append.py). ``prefill`` / ``generate`` /
``answer_logprob`` are the same functions on a batch of one prompt. Skipped and reachable tiles are counted per batch row
(``model.sparsecal_stats["row_skipped"]``), so a batched row counts what its prompt skipped.
Under a sparse method every forward leaves the skipped and reachable
tiles of that forward in ``model.sparsecal_stats`` ([L, H] each); prefill keeps its own counts
and decode sums them over its steps. ``law`` is where the forward's length sits against the BLASST
law's validated lengths (integrations/sparsify_laws.py: below | interpolated | extrapolated; decode:
the worst over its steps; None without a law).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparsecal.evaluation.kv_append import in_place
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
class Batch:
    """B prompts of one length prefilled together (rows independent: no padding, no mixing)."""

    hidden: torch.Tensor            # [B, N, d] final hidden states of each prompt
    cache: object                   # the KV cache after the prompts (batch B)
    seconds: float                  # the whole batch's forward
    skipped: list                   # [B] candidate tiles skipped per prompt, summed over layers and heads
    reachable: list                 # [B] reachable tiles per prompt (0 for dense)
    law: str | None = None

    def row(self, i: int) -> Prefill:
        """Prompt i's view (its seconds: the batch's share, seconds / B)."""
        return Prefill(self.hidden[i], None, self.seconds / len(self.skipped), self.skipped[i],
                       self.reachable[i], self.law)


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


def _row_counts(model, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(skipped [B], reachable [B]) int64 tiles of the last forward per batch row, on the device
    (no synchronisation); zeros when the model runs dense."""
    stats = getattr(model, "sparsecal_stats", None)
    if stats is None or not hasattr(model, "_sparsecal_state") or "row_skipped" not in stats:
        zero = torch.zeros(batch, dtype=torch.int64, device=device)
        return zero, zero
    return stats["row_skipped"].sum(dim=(0, 2)), stats["row_reachable"].sum(dim=(0, 2))


def _law(model) -> str | None:
    """The law regime of the last forward (``model.sparsecal_law``), None when it has none."""
    law = getattr(model, "sparsecal_law", None)
    return law.get("law") if law is not None and hasattr(model, "_sparsecal_state") else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def prefill_batch(model, prompts: list[list[int]]) -> Batch:
    """One forward of the decoder body over B prompts of one length: hidden states [B, N, d], the
    cache and each prompt's counted tiles."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("a batch holds prompts of one length (no padding)")
    device = model.device
    ids = torch.tensor(prompts, device=device)
    _sync(device)
    t0 = time.perf_counter()
    out = model.base_model(input_ids=ids, use_cache=True)
    skipped, reachable = _row_counts(model, len(prompts), device)
    law = _law(model)
    _sync(device)
    seconds = time.perf_counter() - t0
    return Batch(out.last_hidden_state, out.past_key_values, seconds, skipped.tolist(), reachable.tolist(), law)


@torch.no_grad()
def prefill(model, input_ids: list[int]) -> Prefill:
    """One forward of the decoder body over the prompt; hidden states [N, d] and the cache
    (``prefill_batch`` of one prompt)."""
    batch = prefill_batch(model, [input_ids])
    return Prefill(batch.hidden[0], batch.cache, batch.seconds, batch.skipped[0], batch.reachable[0], batch.law)


def _as_batch(pre: Prefill) -> Batch:
    return Batch(pre.hidden[None], pre.cache, pre.seconds, [pre.skipped], [pre.reachable], pre.law)


@torch.no_grad()
def generate_batch(model, pre: Batch, budgets: list[int], eos_ids: set) -> list[Generation]:
    """Greedy decoding of each prompt of the batch from its cache: row i at most ``budgets[i]`` new
    tokens, stopping at EOS. The batch steps until every row has stopped; a stopped row's later
    steps are neither kept nor counted. Each Generation's seconds: the batch's decode / B."""
    from sparsecal.integrations.sparsify_laws import worst_regime

    device, b = model.device, len(budgets)
    head = model.get_output_embeddings()
    nxt = head(pre.hidden[:, -1]).argmax(-1)                          # [B]
    tokens = [[t] for t in nxt.tolist()]
    active = [budgets[i] > 1 and tokens[i][0] not in eos_ids for i in range(b)]
    # the same rule on the device (no host-to-device copy per step): row i goes on while it has
    # fewer than budgets[i] tokens and its last one is no EOS
    budget = torch.tensor(budgets, device=device)
    eos = torch.tensor(sorted(eos_ids) or [-1], device=device)
    keep, count = torch.tensor(active, device=device), torch.ones(b, dtype=torch.int64, device=device)
    skipped = torch.zeros(b, dtype=torch.int64, device=device)
    reachable = torch.zeros_like(skipped)
    laws: list[list] = [[] for _ in range(b)]
    cache = pre.cache
    in_place(cache, cache.get_seq_length() + max(budgets))   # appends in place: no copy of the cache a step
    _sync(device)
    t0 = time.perf_counter()
    while any(active):
        out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        s, r = _row_counts(model, b, device)
        skipped, reachable = skipped + s * keep, reachable + r * keep
        law = _law(model)
        nxt = out.logits[:, -1].argmax(-1)
        count = count + keep
        keep = keep & (count < budget) & ~torch.isin(nxt, eos)
        for i, t in enumerate(nxt.tolist()):  # the step's one synchronisation
            if active[i]:
                laws[i].append(law)
                tokens[i].append(t)
                active[i] = len(tokens[i]) < budgets[i] and t not in eos_ids
    sk, re = skipped.tolist(), reachable.tolist()
    _sync(device)
    seconds = (time.perf_counter() - t0) / b
    return [Generation(tokens[i], seconds, sk[i], re[i], worst_regime(laws[i])) for i in range(b)]


@torch.no_grad()
def generate(model, pre: Prefill, max_new_tokens: int, eos_ids: set) -> Generation:
    """Greedy decoding from the prompt's cache: at most ``max_new_tokens``, stopping at EOS
    (``generate_batch`` of one prompt)."""
    return generate_batch(model, _as_batch(pre), [max_new_tokens], eos_ids)[0]


@torch.no_grad()
def answer_logprob_batch(model, pre: Batch, answers: list[list[int]]) -> list[float]:
    """Teacher-forced log-likelihood of each row's answer after its prompt: the sum over the
    answer's tokens of ln p(token | prompt, the answer's earlier tokens). The first token's
    distribution is the prefill's last position; each further one comes from a decode step (the
    method's decode path) on a copy of the prompts' cache, so ``generate_batch`` still starts from
    the prompts alone. Rows with shorter answers repeat their last token in the batch's later
    steps, which are not counted."""
    import copy

    head = model.get_output_embeddings()
    device, b = model.device, len(answers)
    rows = torch.arange(b, device=device)
    steps = max(len(a) for a in answers) - 1
    # [steps + 1, B] each row's answer, its last token repeated past its end (one copy to the device)
    padded = torch.tensor([[a[min(j, len(a) - 1)] for a in answers] for j in range(steps + 1)], device=device)
    counted = torch.tensor([[j + 1 < len(a) for a in answers] for j in range(steps)] or [[False] * b], device=device)
    total = torch.log_softmax(head(pre.hidden[:, -1]).float(), dim=-1)[rows, padded[0]].double()
    cache = copy.deepcopy(pre.cache)
    in_place(cache, cache.get_seq_length() + steps)
    for step in range(steps):
        out = model(input_ids=padded[step][:, None], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        lp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)[rows, padded[step + 1]]
        total = total + torch.where(counted[step], lp, torch.zeros_like(lp)).double()
    return total.tolist()


@torch.no_grad()
def answer_logprob(model, pre: Prefill, answer_ids: list[int]) -> float:
    """The teacher-forced log-likelihood of ``answer_ids`` after one prompt (``answer_logprob_batch``)."""
    return answer_logprob_batch(model, _as_batch(pre), [answer_ids])[0]


def eos_ids(model, tokenizer) -> set:
    """Token ids that end a generation (the generation config's and the tokenizer's EOS)."""
    ids = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is not None:
            ids.update([source] if isinstance(source, int) else source)
    return ids
