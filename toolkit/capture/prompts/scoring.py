"""Scoring a generated answer against a task sample's known answer.

``score(sample, text)`` is the share of the answer recovered, in [0, 1] (RULER's "string match
all" where the answer has several parts); ``is_correct(sample, text)`` is the strict verdict:

    niah_single, niah_multikey   the first number in the generation is the asked one
    vt                           every variable of the chain is named, and no decoy variable
    cwe                          all ten common words are named (score: the share named)
    text, text_stdlib            the first generated word is the continuation's first word

``answer_budget(tokenizer, sample)`` is the number of new tokens a greedy generation gets: the
answer written out, plus a margin for the model's own wording (and list formatting).
"""
from __future__ import annotations

import re

from sparsecal.capture.prompts.tasks import TEXT_TASKS, PromptSample

_NUMBER = re.compile(r"\d+")
_NAME = re.compile(r"\b[A-Z]{5}\b")
_WORD = re.compile(r"[a-z]+")
MARGIN_TOKENS = 4
ITEM_TOKENS = 2  # extra per further answer part: room for '1. word' lists instead of 'word, word'
TEXT_WORDS = 1  # continuation words the text task scores


def answer_items(sample: PromptSample) -> list[str]:
    """The parts of the answer that scoring looks for (text: its first ``TEXT_WORDS`` words)."""
    if sample.task in TEXT_TASKS:
        return sample.answer[0].split()[:TEXT_WORDS]
    return list(sample.answer)


def score(sample: PromptSample, text: str) -> float:
    """Share of the answer found in the generated ``text``, in [0, 1]."""
    items = answer_items(sample)
    if not items:
        return 0.0
    if sample.task in ("niah_single", "niah_multikey"):
        first = _NUMBER.search(text)
        return float(first is not None and first.group() == items[0])
    if sample.task == "vt":
        found = set(_NAME.findall(text))
    elif sample.task == "cwe":
        found = set(_WORD.findall(text.lower()))
    elif sample.task in TEXT_TASKS:
        words = text.split()[:len(items)]
        return sum(a == b for a, b in zip(words, items)) / len(items)
    else:  # a prompts-file task: the answer strings as substrings
        return sum(item in text for item in items) / len(items)
    return sum(item in found for item in items) / len(items)


def is_correct(sample: PromptSample, text: str) -> bool:
    """The strict verdict: everything found (and, for vt, no decoy variable named)."""
    if score(sample, text) < 1.0:
        return False
    if sample.task == "vt":
        decoys = set(sample.meta.get("decoy_names", ()))
        return not decoys & set(_NAME.findall(text))
    return True


def answer_ids(tokenizer, sample: PromptSample) -> list[int]:
    """The answer as the model would write it after the prompt: its parts joined by ', ' after a
    space, as tokens (the teacher-forced answer of an evaluation)."""
    return tokenizer(" " + ", ".join(answer_items(sample)), add_special_tokens=False)["input_ids"]


def answer_budget(tokenizer, sample: PromptSample) -> int:
    """New tokens a greedy generation of ``sample``'s answer gets: the answer's own tokens (its
    parts joined by ', '), ``MARGIN_TOKENS``, and ``ITEM_TOKENS`` per part after the first."""
    items = answer_items(sample)
    own = len(answer_ids(tokenizer, sample))
    return own + MARGIN_TOKENS + ITEM_TOKENS * max(len(items) - 1, 0)
