"""Capture: run a real model on prompts with the instrumented attention and store the run.

    runner.py      the ``sparsecal_capture`` AttentionInterface function and the per-sample loop
    command.py     ``sparsecal capture``: checks, model load, progress, the run summary
    models.py      resolve, validate and load models (SmolLM2 GGUF offline, local checkpoints)
    prompts/       RULER-style synthetic tasks, JSONL prompt files, answer scoring
    summary.py     the one-screen summary printed after a capture
"""
