"""Synthetic long-context tasks with known answers, built to an exact token length.

Every sample is assembled in token space: the fixed parts (instruction header, needles,
question) and the filler sentences are tokenized separately with
``tokenizer(piece, add_special_tokens=False)``, the filler is trimmed so that the total is
exactly the requested length, and the tokenizer's leading special tokens (a BOS, if the
tokenizer adds one by default) are prepended. All randomness comes from one
``random.Random(seed)``, so ``(task, length, seed)`` regenerates a sample exactly.

The natural text (haystack filler, the ``text`` task, the word vocabulary) is the Python
language reference shipped with every Python install as ``pydoc_data.topics``, normalized to
ASCII so that token-level trimming never splits a multi-byte character. The ``text_stdlib`` task
is built like ``text`` from a second corpus, the standard library's docstrings (corpora.py), so
an evaluation can hold out text its calibration never saw.
"""

from __future__ import annotations

import bisect
import functools
import math
import random
import re
import zlib
from dataclasses import dataclass, field
from typing import Sequence

from sparsecal.capture.prompts.corpora import STDLIB_SOURCE, ascii_text, stdlib_text
from sparsecal.formats.errors import UserError, unknown

TASKS: tuple[str, ...] = ("niah_single", "niah_multikey", "vt", "cwe", "text", "text_stdlib")
TEXT_TASKS: tuple[str, ...] = ("text", "text_stdlib")  # continuation of natural text, scored by perplexity
MIN_LENGTH = {"niah_single": 128, "niah_multikey": 256, "vt": 256, "cwe": 384, "text": 16, "text_stdlib": 16}
TEXT_SOURCE = "pydoc_data.topics"
MIN_FILLER = 16  # fewest filler tokens a needle task accepts
MULTIKEY_NEEDLES = 4
VT_HOPS = 4  # the asked chain has VT_HOPS + 1 variables
VT_DECOY_VARS = 3
CWE_COMMON = 10
CWE_MIN_REPEATS = 3
CONTINUATION_WORDS = 20

_NIAH_HEADER = (
    "A long passage follows. Hidden inside it are one or more special magic numbers, each "
    "tied to a key. Keep every one of them in mind: a question about them comes at the end."
    "\n\nPassage:"
)
_NIAH_NEEDLE = " The special magic number for {key} is: {number}."
_NIAH_QUESTION = (
    "\n\nQuestion: What is the special magic number for {key} in the passage above?"
    "\nAnswer: The special magic number for {key} is:"
)
_VT_HEADER = (
    "A long passage follows. Scattered through it are variable assignments of the form "
    "VAR NAME = value. Track them carefully: a question about them comes at the end."
    "\n\nPassage:"
)
_VT_QUESTION = (
    "\n\nQuestion: Which variables end up holding the value {value}, whether assigned it "
    "directly or copied from another variable? Name all of them."
    "\nAnswer: The variables holding the value {value} are:"
)
_CWE_HEADER = "Here is a numbered list of words. Some of the words occur many times.\n\n"
_CWE_QUESTION = (
    "\nQuestion: Which {n} words occur most often in the list above?"
    "\nAnswer: The {n} most frequent words in the list are:"
)


@dataclass
class PromptSample:
    """One prompt as token ids, with its known answer and what regenerates it."""

    task: str
    length: int
    seed: int
    input_ids: list[int]
    answer: list[str]
    index: int
    meta: dict = field(default_factory=dict)


class _NeedMore(Exception):
    """Raised by a task builder when the body budget cannot hold the fixed parts."""

    def __init__(self, needed: int):
        super().__init__(needed)
        self.needed = needed


def sample_seed(base_seed: int, task: str, length: int, index: int) -> int:
    """Per-sample seed: a stable CRC32 of the sample's coordinates, in ``[0, 2**31)``."""
    return zlib.crc32(f"{base_seed}:{task}:{length}:{index}".encode()) & 0x7FFFFFFF


# ----------------------------------------------------------------------------- text source
@functools.lru_cache(maxsize=1)
def source_text() -> str:
    """The Python language reference (``pydoc_data.topics``), sorted by topic, as ASCII."""
    from pydoc_data.topics import topics

    return ascii_text("".join(topics[key] for key in sorted(topics)))


@functools.lru_cache(maxsize=1)
def _sentences() -> tuple[str, ...]:
    """Prose sentences of the source, in order (code blocks, grammar and headings dropped)."""
    out = []
    for para in re.split(r"\n\s*\n", source_text()):
        if para.startswith(" ") or any(mark in para for mark in ("::=", "***", ">>>")):
            continue
        for sent in re.split(r"(?<=[.!?])\s+(?=[A-Z])", " ".join(para.split())):
            if 30 <= len(sent) <= 300 and sent[0].isupper() and sent[-1] in ".!?":
                out.append(sent)
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _word_pool() -> tuple[str, ...]:
    """Distinct lowercase words (4-10 letters) of the prose sentences, sorted."""
    return tuple(sorted({w for s in _sentences() for w in re.findall(r"\b[a-z]{4,10}\b", s)}))


def corpus(task: str) -> tuple[str, str]:
    """(source name, text) of a text task's corpus."""
    return (STDLIB_SOURCE, stdlib_text()) if task == "text_stdlib" else (TEXT_SOURCE, source_text())


@functools.lru_cache(maxsize=2)
def _line_starts(task: str = "text") -> tuple[int, ...]:
    """Offsets in a text task's corpus where a line begins with a letter: its start points."""
    return tuple(m.start() for m in re.finditer(r"(?m)^[A-Za-z]", corpus(task)[1]))


# ----------------------------------------------------------------------------- token helpers
def _ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _batch_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text (one batched call), without special tokens."""
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text by default (e.g. BOS), or []."""
    plain = _ids(tokenizer, "Hello")
    full = list(tokenizer("Hello")["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def _needle_prompt(tokenizer, rng: random.Random, length: int, header: str,
                   needles: list[str], question: str) -> tuple[list[int], list[float]]:
    """``header``, filler with the ``needles`` inserted in order, then ``question``.

    Returns ``(ids, depths)``: exactly ``length`` ids, and where each needle starts as a
    fraction of the haystack (0 = its start, 1 = its end). Raises ``_NeedMore`` when fewer
    than ``MIN_FILLER`` filler tokens would remain.
    """
    head, tail = _ids(tokenizer, header), _ids(tokenizer, question)
    needle_ids = _batch_ids(tokenizer, needles)
    budget = length - len(head) - len(tail)
    fill = budget - sum(len(n) for n in needle_ids)
    if fill < MIN_FILLER:
        raise _NeedMore(length - fill + MIN_FILLER)
    body, starts = _haystack(tokenizer, rng, fill, needle_ids)
    return head + body + tail, [round(start / budget, 3) for start in starts]


def _haystack(tokenizer, rng: random.Random, fill: int, needles: list[list[int]]):
    """``fill`` tokens of filler sentences with ``needles`` inserted at seeded boundaries.

    The needles keep their order and sit between sentences; only the last filler sentence is
    trimmed. Returns ``(ids, needle_starts)``.
    """
    sents = _sentences()
    pos, pieces, total = rng.randrange(len(sents)), [], 0
    while total < fill:
        batch = [" " + sents[(pos + k) % len(sents)] for k in range(64)]
        pos += 64
        for ids in _batch_ids(tokenizer, batch):
            if total >= fill:
                break
            pieces.append(ids[:fill - total])
            total += len(pieces[-1])
    starts = [0]
    for piece in pieces[:-1]:
        starts.append(starts[-1] + len(piece))
    slots = []
    for depth in sorted(rng.random() * fill for _ in needles):
        k = min(bisect.bisect_left(starts, depth), len(starts) - 1)
        if k > 0 and depth - starts[k - 1] < starts[k] - depth:
            k -= 1
        slots.append(k)
    out, needle_starts, q = [], [], 0
    for k, piece in enumerate(pieces):
        while q < len(needles) and slots[q] == k:
            needle_starts.append(len(out))
            out.extend(needles[q])
            q += 1
        out.extend(piece)
    return out, needle_starts


# ----------------------------------------------------------------------------- task builders
def _niah(tokenizer, rng: random.Random, length: int, n_needles: int):
    """Needle(s) in a haystack: ``n_needles`` keyed magic numbers, one of them asked."""
    pool = _word_pool()
    keys: list[str] = []
    while len(keys) < n_needles:
        key = f"{rng.choice(pool)}-{rng.choice(pool)}"
        if key not in keys:
            keys.append(key)
    numbers = [str(n) for n in rng.sample(range(1_000_000, 10_000_000), n_needles)]
    target = rng.randrange(n_needles)
    needles = [_NIAH_NEEDLE.format(key=k, number=n) for k, n in zip(keys, numbers)]
    question = _NIAH_QUESTION.format(key=keys[target])
    ids, depths = _needle_prompt(tokenizer, rng, length, _NIAH_HEADER, needles, question)
    meta = {"key": keys[target], "keys": keys, "numbers": numbers, "needles": n_needles,
            "depths": depths, "source": TEXT_SOURCE}
    return ids, [numbers[target]], meta


def _var_names(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct five-letter uppercase names that never occur in the source text."""
    text = source_text()
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names and name not in text:
            names.append(name)
    return names


def _vt(tokenizer, rng: random.Random, length: int):
    """Variable tracking: a chain of copies of one value, plus a decoy chain of another."""
    names = _var_names(rng, VT_HOPS + 1 + VT_DECOY_VARS)
    chain, decoy = names[:VT_HOPS + 1], names[VT_HOPS + 1:]
    value, decoy_value = (str(v) for v in rng.sample(range(10_000, 100_000), 2))

    def lines(vars_: list[str], val: str) -> list[str]:
        return [f" VAR {vars_[0]} = {val}."] + [
            f" VAR {vars_[i]} = VAR {vars_[i - 1]}." for i in range(1, len(vars_))]

    queues = [lines(chain, value), lines(decoy, decoy_value)]
    order = [0] * len(queues[0]) + [1] * len(queues[1])
    rng.shuffle(order)
    texts = [queues[which].pop(0) for which in order]  # each chain keeps its own order
    question = _VT_QUESTION.format(value=value)
    ids, depths = _needle_prompt(tokenizer, rng, length, _VT_HEADER, texts, question)
    meta = {"value": value, "hops": VT_HOPS, "decoy_names": decoy, "decoy_value": decoy_value,
            "depths": depths, "source": TEXT_SOURCE}
    return ids, chain, meta


def _cwe(tokenizer, rng: random.Random, length: int):
    """Common-word extraction: a numbered word list in which ``CWE_COMMON`` words repeat."""
    header = _ids(tokenizer, _CWE_HEADER)
    question = _ids(tokenizer, _CWE_QUESTION.format(n=CWE_COMMON))
    budget = length - len(header) - len(question)
    words = list(_word_pool())
    rng.shuffle(words)
    word_ids = dict(zip(words, _batch_ids(tokenizer, [f" {w}\n" for w in words])))
    # an entry costs at least 2 tokens, so a list has at most budget // 2 entries; the common
    # block alone may overshoot that by one round before the length check rejects it
    most = max(budget, 0) // 2 + CWE_COMMON * (CWE_MIN_REPEATS + 1) + 2
    num_ids = [[]] + _batch_ids(tokenizer, [f"{i}." for i in range(1, most + 1)])
    try:
        chosen, repeats = _cwe_words(words, word_ids, num_ids, budget)
    except _NeedMore as exc:
        raise _NeedMore(exc.needed + len(header) + len(question)) from None
    rng.shuffle(chosen)
    body = []
    for i, word in enumerate(chosen, 1):
        body += num_ids[i] + word_ids[word]
    if len(body) < budget:  # slack no word swap could absorb: a trimmed extra entry
        taken = set(chosen)
        extra = next((w for w in words if w not in taken), words[-1])
        tail = num_ids[len(chosen) + 1] + word_ids[extra]
        body += (tail * (budget // len(tail) + 1))[:budget - len(body)]
    meta = {"repeats": repeats, "entries": len(chosen), "source": TEXT_SOURCE}
    return header + body + question, words[:CWE_COMMON], meta


def _cwe_words(words: list[str], word_ids: dict, num_ids: list[list[int]], budget: int):
    """Pick the list's words (unordered) so that the entries fill ``budget`` tokens or nearly.

    The first ``CWE_COMMON`` of ``words`` repeat ``repeats`` times; the others fill the rest,
    each once (more often only if the pool runs out after all). Entry costs do
    not depend on the order, so the caller may shuffle the result freely.
    """
    common, spare = words[:CWE_COMMON], words[CWE_COMMON:]
    wcost = {w: len(ids) for w, ids in word_ids.items()}
    per_entry = len(num_ids[max(1, budget // 8)]) + sum(wcost[w] for w in common) / CWE_COMMON
    entries = budget / per_entry
    # about half of the list is common words; more when the pool of uncommon ones runs short
    repeats = max(CWE_MIN_REPEATS, round(entries / 2 / CWE_COMMON),
                  math.ceil((entries - 0.8 * len(spare)) / CWE_COMMON))
    chosen = common * repeats
    used = sum(len(num_ids[i + 1]) + wcost[w] for i, w in enumerate(chosen))
    if used > budget - MIN_FILLER:
        raise _NeedMore(used + MIN_FILLER)
    k = 0
    while True:
        word = spare[k % len(spare)]
        cost = len(num_ids[len(chosen) + 1]) + wcost[word]
        if used + cost > budget:
            break
        chosen.append(word)
        used += cost
        k += 1
    _absorb_slack(chosen, common, spare[k:], wcost, budget - used)
    return chosen, repeats


def _absorb_slack(chosen: list[str], common: list[str], unused: list[str], wcost: dict,
                  slack: int) -> None:
    """Swap uncommon words in ``chosen`` for unused longer ones until ``slack`` tokens are used."""
    by_cost: dict[int, list[str]] = {}
    for word in unused:
        by_cost.setdefault(wcost[word], []).append(word)
    protected = set(common)
    for i, word in enumerate(chosen):
        if slack <= 0:
            return
        if word in protected:
            continue
        for extra in range(slack, 0, -1):
            bucket = by_cost.get(wcost[word] + extra)
            if bucket:
                chosen[i] = bucket.pop()
                by_cost.setdefault(wcost[word], []).append(word)
                slack -= extra
                break


def _decoded_end(tokenizer, chunk: str, prompt: list[int]) -> int:
    """Character offset in ``chunk`` where the text covered by ``prompt`` (a token prefix) ends."""
    decoded = tokenizer.decode(prompt)
    if chunk.startswith(decoded):
        return len(decoded)
    # tokenizers whose decode does not round-trip exactly: use the character offsets
    spans = tokenizer(chunk, add_special_tokens=False, return_offsets_mapping=True)
    return max(stop for _, stop in spans["offset_mapping"][:len(prompt)])


def _text(tokenizer, rng: random.Random, length: int, task: str = "text"):
    """Plain natural text of ``task``'s corpus from a seeded line start; the answer is its
    continuation.

    The answer is the next ``CONTINUATION_WORDS`` whitespace-separated words of the source
    after the prompt, joined by single spaces (if the prompt ends inside a word, the first
    one is that word's remainder).
    """
    source, text = corpus(task)
    offset = rng.choice(_line_starts(task))
    size = length * 6 + 400
    while True:
        chunk = (text * (size // len(text) + 2))[offset:offset + size]  # wraps around
        ids = _ids(tokenizer, chunk)
        if len(ids) >= length:
            end = _decoded_end(tokenizer, chunk, ids[:length])
            words = chunk[end:].split()[:CONTINUATION_WORDS]
            if len(words) == CONTINUATION_WORDS or size >= 8 * len(text):
                break
        size *= 2
    prompt = ids[:length]
    meta = {"source": source, "offset": offset, "continuation_words": len(words)}
    return prompt, [" ".join(words)], meta


_BUILDERS = {
    "niah_single": lambda tok, rng, n: _niah(tok, rng, n, 1),
    "niah_multikey": lambda tok, rng, n: _niah(tok, rng, n, MULTIKEY_NEEDLES),
    "vt": _vt,
    "cwe": _cwe,
    "text": _text,
    "text_stdlib": lambda tok, rng, n: _text(tok, rng, n, "text_stdlib"),
}


def _too_short(task: str, length: int, needed: int) -> UserError:
    """The one-line error for a length below what ``task`` needs."""
    return UserError(
        f"Length {length} is too short for task '{task}': it needs at least {needed} tokens. "
        f"Use a length of {needed} or more."
    )


def build_sample(tokenizer, task: str, length: int, seed: int, index: int = 0) -> PromptSample:
    """Build one sample of ``task`` with exactly ``length`` tokens, regenerable from the seed."""
    if task not in _BUILDERS:
        raise unknown("task", task, TASKS)
    if not isinstance(length, int) or isinstance(length, bool):
        raise UserError(f"Length must be a whole number of tokens, got {length!r}.")
    if length < MIN_LENGTH[task]:
        raise _too_short(task, length, MIN_LENGTH[task])
    prefix = _special_prefix(tokenizer)
    try:
        body, answer, meta = _BUILDERS[task](tokenizer, random.Random(seed), length - len(prefix))
    except _NeedMore as exc:
        raise _too_short(task, length, max(MIN_LENGTH[task], exc.needed + len(prefix))) from None
    ids = prefix + body
    if len(ids) != length:  # a bug, not bad input
        raise AssertionError(f"{task}: built {len(ids)} tokens instead of {length}")
    return PromptSample(task, length, seed, ids, answer, index, meta)


def build_task_prompts(tokenizer, tasks: Sequence[str], lengths: Sequence[int], samples: int,
                       seed: int) -> list[PromptSample]:
    """Every task at every length, ``samples`` samples each, with per-sample derived seeds."""
    for task in tasks:  # fail on a bad name before building anything
        if task not in _BUILDERS:
            raise unknown("task", task, TASKS)
    return [
        build_sample(tokenizer, task, length, sample_seed(seed, task, length, index), index)
        for task in tasks
        for length in lengths
        for index in range(samples)
    ]
