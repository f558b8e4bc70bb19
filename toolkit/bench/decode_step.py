"""Where one decode step of a model goes (issue 28, the end-to-end TPOT row): per configuration (the
timing phase's baselines ``sdpa`` and ``sdpa_cudnn``, then each method as `sparsecal eval` switches
it on) the step's device time as CUDA-graph replays in round-robin rounds, its eager time (greedy
steps from the prompt's cache, evaluation.timing.decode_ms: host launches included), and the
kernels one eager step launches (torch.profiler: per kernel name its launches and device
microseconds), with each configuration's kernels set against the faster baseline's, so a gap in
TPOT is split into the attention kernel, the kernels around it, and the host. Beside the ratio of
median graph times, each configuration's speedup over the best baseline from the rounds, with its
exact distribution-free 95% interval (evaluation/speed_stats.py; 4 rounds or more).

    python -m sparsecal.bench.decode_step --model DIR --export DIR --length 32768
        [--methods dense,bsfa:128,blasst:0.5] [--dispatch both] [--rounds 5] [--reps 20]
        [--cache sdpa|own] [--prefills-before N] [--decode-dense reproducible|fastest|both] [--out FILE]
    TRITON_INTERPRET=1 python -m sparsecal.bench.decode_step --model DIR --export DIR --length 300 --quick
        (CPU: wall-clock eager steps and the profiler's CPU ops; a test)

The step is that of `sparsecal eval`'s timing phase (evaluation/timing.py ``decode_graph_ms``): one
token against the cache of a random prompt of ``length`` tokens, every replay the same step. By
default every configuration steps from one cache made by a plain SDPA prefill and only steps are
timed; ``--cache own`` makes each configuration's cache with its own prefill in each round, and
``--prefills-before N`` runs N untimed prefills of the prompt under the configuration right before
its steps, as eval's timing rounds do (its TTFT prefills come first): the two differences between
this anatomy and eval's graph TPOT column (data/bench/NOTES.md, "8B rows, s38"). ``--decode-dense
fastest`` (or ``both``) adds, for each dispatched method, the configuration whose dense decode steps
run the record's fastest backend (sparsify's ``decode_dense="fastest"``, cuDNN where it won), labelled
``<method>+dispatch fastest``.

Shape legend
    N prompt length (cached tokens)
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from sparsecal.bench.harness import log
from sparsecal.evaluation.speed_stats import round_order

TOP = 12   # kernels listed per configuration in the printed summary


def _prompt_cache(model, ids):
    """(the prompt's KV cache, the next token [1, 1]) after one prefill of ``ids`` [1, N]; the cache
    appends in place (evaluation.kv_append, as the eval's timed steps do), room for one step."""
    from sparsecal.evaluation.kv_append import in_place

    with torch.no_grad():
        out = model(ids, logits_to_keep=1, use_cache=True)
    in_place(out.past_key_values, ids.shape[1] + 1)
    return out.past_key_values, out.logits[:, -1:].argmax(-1)


def _step(model, cache, nxt):
    """One decode step against a copy of ``cache`` (the prompt's cache is left as it was)."""
    with torch.no_grad():
        return model(input_ids=nxt, past_key_values=copy.deepcopy(cache), use_cache=True)


def step_ms(model, cache, nxt, reps: int, quick: bool) -> float:
    """Median ms of one step: CUDA-graph replays on a GPU (evaluation.timing._replay_ms), the
    eager wall clock of ``reps`` steps on the CPU (``quick``)."""
    if quick:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            _step(model, cache, nxt)
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    from sparsecal.evaluation.timing import _replay_ms

    step = copy.deepcopy(cache)
    with torch.no_grad():
        return _replay_ms(lambda: _step(model, cache, nxt),
                          lambda: model(input_ids=nxt, past_key_values=step, use_cache=True), nxt.device, reps, 3)


def kernels(model, cache, nxt, quick: bool) -> dict:
    """{kernel name: [launches, device us]} of one eager step (after a warm step); on the CPU
    (``quick``) the aten ops and their CPU us."""
    from torch.profiler import ProfilerActivity, profile

    _step(model, cache, nxt)
    acts = [ProfilerActivity.CPU] + ([] if quick else [ProfilerActivity.CUDA])
    with profile(activities=acts) as prof:
        _step(model, cache, nxt)
        if not quick:
            torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = e.cpu_time_total if quick else getattr(e, "self_device_time_total", 0)
        if (quick and e.key.startswith("aten::")) or (not quick and us > 0 and e.device_type.name == "CUDA"):
            out[e.key] = [int(e.count), round(float(us), 2)]
    return out


def diff(mine: dict, base: dict) -> list:
    """[name, launches here - there, us here - there] for kernels that differ, largest |us| first."""
    rows = []
    for name in set(mine) | set(base):
        a, b = mine.get(name, [0, 0.0]), base.get(name, [0, 0.0])
        if a != b:
            rows.append([name[:120], a[0] - b[0], round(a[1] - b[1], 2)])
    return sorted(rows, key=lambda r: -abs(r[2]))


def _variants(model, args, model_id: str) -> dict:
    """label -> (enter, leave): the timing phase's baselines and each method as eval runs it."""
    from sparsecal.evaluation.command import expand_dispatch
    from sparsecal.evaluation.methods import parse_methods
    from sparsecal.evaluation.model import use_method
    from sparsecal.evaluation.timing import baseline_variants
    from sparsecal.integrations.sparsify import densify

    out = {n: ev for n, ev in baseline_variants(model, not args.quick).items() if n != "rest"}
    for m in expand_dispatch(parse_methods(args.methods), args.dispatch):
        if args.decode_dense != "fastest" or not m.dispatch:
            out[m.label] = (lambda m=m: use_method(model, m, args.export, model_id, args.extrapolate),
                            lambda: densify(model))
        if args.decode_dense != "reproducible" and m.dispatch:
            out[f"{m.label} fastest"] = (lambda m=m: _fastest(model, m, args, model_id), lambda: densify(model))
    return out


def _fastest(model, m, args, model_id: str):
    """``m`` (dispatched) switched on as eval does, its dense decode steps on the record's fastest backend."""
    from sparsecal.integrations.sparsify import densify, sparsify

    densify(model)
    sparsify(model, args.export, model_id=model_id, extrapolate=args.extrapolate, decode_dense="fastest",
             **m.sparsify_kwargs)


def _before_steps(model, ids, shared: tuple, args):
    """Under the configuration just switched on: ``args.prefills_before`` untimed prefills of ``ids``
    (no cache kept), then the (cache, next token) its steps run from: ``shared`` (the plain SDPA
    prefill's) or, with ``--cache own``, its own prefill's."""
    with torch.no_grad():
        for _ in range(args.prefills_before):
            model(ids, logits_to_keep=1, use_cache=False)
    return _prompt_cache(model, ids) if args.cache == "own" else shared


def run(args) -> dict:
    """Every configuration's step times (rounds) and kernels at ``args.length``."""
    from sparsecal.capture.models import load_model, resolve_model
    from sparsecal.evaluation.speed_stats import ratio_interval
    from sparsecal.evaluation.timing import decode_ms, random_ids
    from sparsecal.formats.provenance import provenance

    ms = resolve_model(args.model)
    device = "cpu" if args.quick else "cuda"
    model = load_model(ms, args.dtype, device)
    ids = random_ids(model.get_output_embeddings().weight.shape[0], args.length, torch.device(device))
    cache, nxt = _prompt_cache(model, ids)
    table = _variants(model, args, ms.model_id)
    got = {label: {"rounds_ms": [], "eager_rounds_ms": []} for label in table}
    for r in range(args.rounds):
        for label in round_order(table, r):
            enter, leave = table[label]
            enter()
            try:
                c, x = _before_steps(model, ids, (cache, nxt), args)
                got[label]["rounds_ms"].append(step_ms(model, c, x, args.reps, args.quick))
                got[label]["eager_rounds_ms"].append(decode_ms(model, ids, args.reps, 2)["ms"])
                if r == 0:
                    got[label]["kernels"] = kernels(model, c, x, args.quick)
            finally:
                leave()
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v['rounds_ms'][-1]:.3f}" for k, v in got.items()))
    for v in got.values():
        v["ms"], v["eager_ms"] = statistics.median(v["rounds_ms"]), statistics.median(v["eager_rounds_ms"])
    best = min(("sdpa", "sdpa_cudnn"), key=lambda n: got[n]["ms"] if n in got else float("inf"))
    eager = min(("sdpa", "sdpa_cudnn"), key=lambda n: got[n]["eager_ms"] if n in got else float("inf"))
    for label, v in got.items():
        v["vs_best_sdpa"], v["eager_vs_best_sdpa"] = got[best]["ms"] / v["ms"], got[eager]["eager_ms"] / v["eager_ms"]
        v["vs_best_sdpa_interval"] = ratio_interval(got[best]["rounds_ms"], v["rounds_ms"])
        v["eager_vs_best_sdpa_interval"] = ratio_interval(got[eager]["eager_rounds_ms"], v["eager_rounds_ms"])
        v["kernels_vs_best_sdpa"] = diff(v["kernels"], got[best]["kernels"])
    return {"benchmark": "decode_step", "provenance": provenance(), "args": {k: str(v) for k, v in vars(args).items()},
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "best_sdpa": best,
            "variants": got}


def summary(doc: dict) -> str:
    """Per configuration its step time against the best SDPA and its largest kernel differences."""
    lines = [f"decode step at {doc['args']['length']} tokens on {doc['device']}; best SDPA {doc['best_sdpa']}"]
    for label, v in doc["variants"].items():
        ci = v["vs_best_sdpa_interval"]
        band = f"[{ci['lo']:.3f}, {ci['hi']:.3f}]" if ci["lo"] is not None else "[too few rounds]"
        lines.append(f"  {label:24s} {v['ms']:.4f} ms  {v['vs_best_sdpa']:.3f}x best SDPA (HL {ci['ratio']:.3f}x {band}); "
                     f"eager {v['eager_ms']:.3f} ms "
                     f"{v['eager_vs_best_sdpa']:.3f}x (rounds {min(v['eager_rounds_ms']):.3f}-{max(v['eager_rounds_ms']):.3f})")
        lines += [f"      {n:+3d} x  {us:+9.2f} us  {name}" for name, n, us in v["kernels_vs_best_sdpa"][:TOP]]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparsecal.bench.decode_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--export", required=True)
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--methods", default="dense,bsfa:128,blasst:0.5")
    ap.add_argument("--dispatch", default="both", choices=("off", "on", "both"))
    ap.add_argument("--extrapolate", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cache", default="sdpa", choices=("sdpa", "own"),
                    help="steps from one plain SDPA prefill's cache, or each configuration's own (as eval)")
    ap.add_argument("--prefills-before", type=int, default=0,
                    help="untimed prefills under each configuration before its steps (eval's rounds: 4+)")
    ap.add_argument("--decode-dense", default="reproducible", choices=("reproducible", "fastest", "both"),
                    help="dispatched methods' dense decode steps: the reproducible pick, the record's fastest, or both")
    ap.add_argument("--quick", action="store_true", help="CPU under TRITON_INTERPRET=1: eager wall clock, CPU ops")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.prefills_before < 0:
        ap.error("--prefills-before must be >= 0")
    doc = run(args)
    print(summary(doc))
    if args.out:
        from sparsecal.formats.files import atomic_write_text

        atomic_write_text(args.out, json.dumps(doc, indent=1))
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
