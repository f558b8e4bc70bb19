"""One evaluation row per (prompt, method): ``run_batch`` runs B prompts of one token length as
one batch through every pending method (dense first, the reference) and builds each prompt's row
(evaluation/model.py for the model side, metrics.py for the fidelity against dense); ``batches``
groups the pending prompts. Shapes: B prompts of N tokens, d hidden size."""
from __future__ import annotations

import time

# The row columns that are wall times (they differ run to run; everything else is deterministic)
TIMING_COLUMNS = ("prefill_s", "decode_s", "seconds", "setup_s", "answer_s", "fidelity_s")


def _sid(p) -> str:
    from sparsecal.formats.run import sample_id

    return sample_id(p.task, p.length, p.input_ids)


def run_batch(model, tok, prompts, methods, pending, export_dir, manifest: dict, eos: set):
    """Rows of B prompts of one length for their ``pending`` methods (pending[i]: prompt i's),
    run as one batch: dense first (the reference), then each method pending for any of them on
    the same prompts: prefill, answer likelihood and generation of the whole batch, fidelity per
    prompt. Yields one method's rows (a list) at a time."""
    import torch

    from sparsecal.capture.prompts.scoring import answer_budget, answer_ids
    from sparsecal.evaluation.metrics import Reference, fidelity
    from sparsecal.evaluation.model import answer_logprob_batch, generate_batch, prefill_batch, use_method
    from sparsecal.integrations.sparsify import densify

    budgets = [answer_budget(tok, p) for p in prompts]
    answers = [answer_ids(tok, p) for p in prompts]
    model_id, held = manifest["model"]["id"], [_held_out(manifest, p) for p in prompts]
    extrapolate = (manifest.get("request") or {}).get("extrapolate", False)
    head, refs = model.get_output_embeddings(), None
    ids = torch.tensor([p.input_ids for p in prompts], device=model.device)  # [B, N]: each row's targets
    for method in methods:  # dense first (with_dense put it there): the reference of the others
        wanted = [i for i, todo in enumerate(pending) if method in todo]
        if refs is not None and not wanted:
            continue
        t0 = time.perf_counter()
        use_method(model, method, export_dir, model_id, extrapolate)
        setup_s = time.perf_counter() - t0
        pre = prefill_batch(model, [p.input_ids for p in prompts])
        refs = refs or [Reference(head, pre.hidden[i]) for i in range(len(prompts))]
        if wanted:
            t0 = time.perf_counter()
            forced = answer_logprob_batch(model, pre, answers)  # a host list: the device has finished
            answer_s = time.perf_counter() - t0
            gens = generate_batch(model, pre, budgets, eos)
            rows = []
            for i in wanted:
                t0 = time.perf_counter()
                fid = fidelity(head, refs[i], pre.hidden[i], ids[i])
                rows.append(dict(_row(prompts[i], method, tok, pre.row(i), gens[i], fid, held[i]),
                                 answer_logprob=forced[i], answer_tokens=len(answers[i]), batch=len(prompts),
                                 setup_s=setup_s / len(prompts), answer_s=answer_s / len(prompts),
                                 fidelity_s=time.perf_counter() - t0))
            yield rows
        del pre
    densify(model)  # the model's own attention again


def batches(todo: list, size: int) -> list:
    """``todo``'s (prompt, pending methods) items in batches of at most ``size`` prompts of one
    token length, in the order the lengths first appear."""
    groups: dict[int, list] = {}
    for item in todo:
        groups.setdefault(len(item[0].input_ids), []).append(item)
    return [g[i:i + size] for g in groups.values() for i in range(0, len(g), size)]


def _held_out(manifest: dict, prompt):
    """Whether the prompt's task was left out of calibration (None: calibration unknown)."""
    return next((p["held_out_task"] for p in manifest["prompts"] if p["id"] == _sid(prompt)), None)


def _split(held) -> str | None:
    """The row's split from its prompt's held-out flag (the manifest's ``split`` says the same)."""
    from sparsecal.evaluation.inputs import HELD_OUT, SEEN

    return None if held is None else HELD_OUT if held else SEEN


def _row(prompt, method, tok, pre, gen, fid, held) -> dict:
    from sparsecal.capture.prompts.scoring import is_correct, score
    from sparsecal.evaluation.metrics import sparsity as sparsity_of

    text = tok.decode(gen.tokens, skip_special_tokens=True)
    return {"sample_id": _sid(prompt), "task": prompt.task, "length": prompt.length, "index": prompt.index,
            "seed": prompt.seed, "held_out_task": held, "split": _split(held), "label": method.label,
            "method": method.name, "config": method.config, "answer": " | ".join(prompt.answer), "generated": text,
            "score": score(prompt, text), "correct": is_correct(prompt, text), "kl": fid.kl, "top1": fid.top1,
            "nll": fid.nll, "ppl": fid.ppl,
            "sparsity": sparsity_of(pre.skipped, pre.reachable), "prefill_skipped": pre.skipped,
            "prefill_reachable": pre.reachable, "decode_sparsity": sparsity_of(gen.skipped, gen.reachable),
            "decode_skipped": gen.skipped, "decode_reachable": gen.reachable, "new_tokens": len(gen.tokens),
            "prefill_law": pre.law, "decode_law": gen.law,
            "prefill_s": pre.seconds, "decode_s": gen.seconds, "seconds": pre.seconds + gen.seconds}
