"""End-to-end prefill time (TTFT) of a model switched with ``sparsify``, against SDPA, with the
attention share of the forward and the ideal speedup it implies (``python -m sparsecal.bench.ttft``).

Per prompt length, one prefill forward (batch 1, last-position logits, no KV cache in graph mode),
every variant of a length in one process, timed in ``--rounds`` round-robin rounds (each the
median of ``--reps`` after ``--warmup``; the median over rounds is kept, so drift hits all alike):

    sdpa         the model's attention as causal SDPA in PyTorch's backend order (FLASH first)
    sdpa_cudnn   the same with cuDNN first; the faster of the two is the baseline ("best SDPA")
    rest         the forward with the attention kernel replaced by a copy of Q (what SDPA's own
                 output copy costs): attention share a = 1 - rest / best SDPA
    per operating point of the export (``configs``), ``sparsify`` with dispatch
    (the export's dispatch record: sparse only where the calibrated sparsity reaches the measured
    break-even; ``dispatch`` rows) and without it (``every_layer`` rows; window has only these)

Sparsity: skipped / reachable candidate tiles counted in the kernels over ALL layers (a layer run
dense by dispatch counts its reachable tiles and no skips). The ideal TTFT speedup of a sparsity s
is 1 / (1 - a * s / 2): the attention share a shrinks as the kernel ideal 1 / (1 - s/2) says
(skipping a tile saves its V load and P.V, about half its work); it is taken at the every-layer
run's sparsity, so dispatch that runs a layer dense is charged for what the layer could have saved.

    python -m sparsecal.bench.ttft --model DIR|smollm2 --export DIR --lengths 32768,65536
        [--graph] [--rounds 3] [--reps 5] [--warmup 2] [--min-k 16] [--commit SHA] --out FILE

Prompts: the model's tokenizer on the niah_single task when it has one, else random token ids
(seed 20261123). Writes FILE (rows per length and variant, provenance) and FILE's ``*-rows.json``
in the Accuracy-speedup format (task "ttft": the speedup of what sparsify runs by default, i.e.
with dispatch) for ``sparsecal eval --bench``.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from sparsecal.bench.harness import log, result_file
from sparsecal.evaluation.speed_stats import round_order
from sparsecal.evaluation.timing import BASELINES, forward_ms, graph_ms, ideal_speedup

PROMPT_SEED = 20261123


def configs(export_dir, min_k: int = 16) -> list[tuple[str, str, dict]]:
    """(method, config, sparsify kwargs) for every operating point of the export (BSFA k >= ``min_k``),
    plus window:32."""
    from sparsecal.formats.exports import load_blasst
    from sparsecal.integrations.exports import load_bsfa

    ks = load_bsfa(export_dir, {}).k_values
    targets = [t["target_sparsity"] for t in load_blasst(export_dir, {})["targets"]]
    out = [("bsfa", f"k={k}", {"method": "bsfa", "k": k}) for k in ks if k >= min_k]
    out += [("blasst", f"target={t:g}", {"method": "blasst", "target": t}) for t in targets]
    return out + [("window", "blocks=32", {"method": "window", "blocks": 32})]


def _time(model, ids, args) -> dict:
    """{"ms": eager median, "graph_ms": replayed median (with --graph; None and "graph_error"
    when capture fails: the eager time still stands)}."""
    out = {"ms": forward_ms(model, ids, args.reps, args.warmup)}
    if args.graph:
        try:
            out["graph_ms"] = graph_ms(model, ids, args.reps, args.warmup)
        except RuntimeError as e:  # recorded: graph capture can fail where eager runs
            out["graph_ms"], out["graph_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    return out


def variants(model, export, args, cuda: bool) -> dict:
    """(variant, method, config) -> (enter, leave): switch the model to the variant and back. The
    BASELINES (cuDNN first only on a GPU), then per operating point ``every_layer`` (dispatch off)
    and, for BSFA and BLASST, ``dispatch`` (window has no dispatch record: the every-layer row)."""
    from transformers import AttentionInterface

    from sparsecal.integrations.sparsify import densify, sparsify

    out = {}
    for name, fn in BASELINES.items():
        if name != "sdpa_cudnn" or cuda:
            AttentionInterface.register(f"sparsecal_{name}", fn)
            out[(name, None, None)] = (lambda n=name: model.set_attn_implementation(f"sparsecal_{n}"),
                                       lambda: model.set_attn_implementation("sdpa"))
    for method, config, kw in configs(export, args.min_k):
        for disp in (False, True) if method in ("bsfa", "blasst") else (False,):
            out[("dispatch" if disp else "every_layer", method, config)] = (
                lambda kw=kw, d=disp: sparsify(model, export, dispatch=d, **kw), lambda: densify(model))
    return out


def _counts(model, ids) -> dict:
    """One more eager forward's kernel counts per layer: skipped, reachable (a layer run dense by
    dispatch counts none) and how many layers ran sparse."""
    with torch.no_grad():
        model(ids, logits_to_keep=1)
    st = model.sparsecal_stats
    reach = st["reachable"].sum(1).tolist()
    return {"skipped": st["skipped"].sum(1).tolist(), "reachable": reach, "sparse_layers": sum(r > 0 for r in reach)}


def timed(model, ids, export, args) -> dict:
    """key -> {"ms", "graph_ms" (medians over ``--rounds`` round-robin rounds in ``speed_stats.round_order``,
    each the median of ``--reps``), "rounds_ms", and the kernel counts of sparse variants}."""
    table = variants(model, export, args, ids.device.type == "cuda")
    got = {key: {"rounds": []} for key in table}
    for r in range(args.rounds):
        for key in round_order(table, r):
            enter, leave = table[key]
            enter()
            try:
                got[key]["rounds"].append(_time(model, ids, args))
                if key[1] and "skipped" not in got[key]:
                    got[key].update(_counts(model, ids))
            finally:
                leave()
    for rec in got.values():
        rs = rec.pop("rounds")
        rec["rounds_ms"] = [r["ms"] for r in rs]
        rec["ms"] = statistics.median(rec["rounds_ms"])
        if args.graph:
            g = [r["graph_ms"] for r in rs if r.get("graph_ms")]
            rec["graph_ms"] = statistics.median(g) if len(g) == len(rs) else None
            errors = [r["graph_error"] for r in rs if "graph_error" in r]
            if errors:
                rec["graph_error"] = errors[0]
    return got


def _speed(t: dict, base: float, graph: bool) -> float | None:
    ms = t.get("graph_ms") if graph else t["ms"]
    return base / ms if ms else None


def length_rows(model, ids, export, args) -> list[dict]:
    """Every variant at one length; rows with speedups against the best SDPA, the attention share,
    the sparsity over all layers and the ideal speedup (module docstring)."""
    n = ids.shape[1]
    got = timed(model, ids, export, args)
    base = {key[0]: t for key, t in got.items() if key[1] is None}
    graph = bool(args.graph) and all(t.get("graph_ms") for t in got.values())
    pick = "graph_ms" if graph else "ms"
    best = min((b for b in base if b != "rest"), key=lambda b: base[b][pick])
    ref = base[best][pick]
    share = 1.0 - base["rest"][pick] / ref
    rows = [{"length": n, "variant": b, **t, "speedup": _speed(t, ref, graph)} for b, t in base.items()]
    for (variant, method, config), t in got.items():
        if method is None:
            continue
        every = got[("every_layer", method, config)]
        total = max(sum(every["reachable"]), 1)
        s_all = sum(every["skipped"]) / total
        sp, ideal = _speed(t, ref, graph), ideal_speedup(share, s_all)
        rows.append({"length": n, "variant": variant, "method": method, "config": config, **t,
                     "sparsity": sum(t["skipped"]) / total, "sparsity_every_layer": s_all, "speedup": sp,
                     "ideal": ideal, "of_ideal": sp / ideal if sp else None})
        if method == "window" or variant == "dispatch":
            log(f"  N={n} {method}:{config}: s={s_all:.2f} ideal {ideal:.3f}x, every layer "
                f"{_speed(every, ref, graph):.3f}x, this {sp:.3f}x ({t['sparse_layers']} sparse layers)")
    for r in rows:
        r.update(baseline=best, timing="graph" if graph else "eager", attention_share=share)
    log(f"N={n}: best SDPA {best} {ref:.2f} ms ({'graph' if graph else 'eager'}), attention share {share:.3f}")
    return rows


def prompts(ms, vocab_size: int, lengths, device) -> dict:
    """{length: ids [1, N]}: the niah_single task with the model's tokenizer, else random ids."""
    from sparsecal.capture.models import load_tokenizer
    from sparsecal.capture.prompts import build_task_prompts
    from sparsecal.formats.errors import UserError

    try:
        tok = load_tokenizer(ms)
    except UserError:
        g = torch.Generator().manual_seed(PROMPT_SEED)
        return {n: torch.randint(0, vocab_size, (1, n), generator=g).to(device) for n in lengths}
    found = build_task_prompts(tok, ["niah_single"], lengths, 1, seed=PROMPT_SEED)
    return {p.length: torch.tensor([p.input_ids], device=device) for p in found}


def joinable(rows: list[dict]) -> list[dict]:
    """The rows sparsify runs by default (dispatch where the export has a record, window every
    layer) in the Accuracy-speedup format (toolkit/formats/results.py), with the sparsity counted as
    `sparsecal eval` counts it (skipped over reachable tiles of the layers that ran sparse), so that
    `sparsecal eval --bench` can check it against the evaluated configuration's (``dispatch``: a
    ``+dispatch`` method's row)."""
    return [{"method": r["method"], "config": r["config"], "length": r["length"], "speedup": r["speedup"],
             "sparsity": sum(r["skipped"]) / max(sum(r["reachable"]), 1), "task": "ttft", "timing": r["timing"],
             "dispatch": r["variant"] == "dispatch"}
            for r in rows if r["speedup"] and (r["variant"] == "dispatch" or r.get("method") == "window")]


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="'smollm2' or a checkpoint directory")
    ap.add_argument("--export", type=Path, required=True, help="a `sparsecal export` directory of that model")
    ap.add_argument("--lengths", default="32768,65536,131072")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (the speedups use them)")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin rounds over the variants (median kept)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--min-k", type=int, default=16, help="the smallest BSFA k of the export to time")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    from sparsecal.capture.models import load_config, load_model, resolve_model
    from sparsecal.formats.files import atomic_write_text

    args = parse(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    ms = resolve_model(args.model)  # bad input is refused before anything is written
    result, save = result_file("ttft", args.out, args.commit)
    model = load_model(ms, dtype=args.dtype, device=args.device, attn="sdpa")
    vocab = load_config(ms).get_text_config().vocab_size
    result.update(model=ms.model_id, export=str(args.export), request=vars(args) | {"out": str(args.out),
                  "export": str(args.export)}, rows=[])
    for n, ids in sorted(prompts(ms, vocab, lengths, args.device).items()):
        result["rows"] += length_rows(model, ids, args.export, args)
        save()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    doc = {"kind": "sparsecal-bench", "rows": joinable(result["rows"]), "provenance": result["provenance"]}
    path = args.out.with_name(f"{args.out.stem}-rows.json")
    atomic_write_text(path, json.dumps(doc, indent=1, default=str))
    log(f"wrote {args.out} and {len(doc['rows'])} joinable rows to {path}")


if __name__ == "__main__":
    import sys

    from sparsecal.formats.errors import UserError

    try:
        main()
    except UserError as e:  # a model or export the user named: one line, exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
