"""Prompt builders: synthetic long-context tasks with known answers, and user prompt files.

``build_task_prompts`` makes RULER-style tasks (needle in a haystack, variable tracking,
common-word extraction, plain text from two corpora) at exact token lengths, deterministically from a seed;
``load_prompts_file`` reads the user's own prompts from JSONL. Both return ``PromptSample``.
"""

from sparsecal.capture.prompts.jsonl import load_prompts_file
from sparsecal.capture.prompts.tasks import (
    MIN_LENGTH,
    TASKS,
    TEXT_TASKS,
    PromptSample,
    build_sample,
    build_task_prompts,
    sample_seed,
)

__all__ = [
    "MIN_LENGTH",
    "TASKS",
    "TEXT_TASKS",
    "PromptSample",
    "build_sample",
    "build_task_prompts",
    "load_prompts_file",
    "sample_seed",
]
