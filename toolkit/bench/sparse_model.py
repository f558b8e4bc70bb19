"""The SmolLM2 sections of the sparse benchmark (``sparsecal bench --smollm2``), on the GPU:

captured   Q/K/V of a few layers of SmolLM2-135M-Instruct (bf16) on an 8K-token task prompt,
           captured at the attention interface (after RoPE), run through the sparse prefill kernel
           with the calibrated export (BSFA k, BLASST targets, window) against the dense Triton
           forward and the best SDPA backend: real sparsity, counted in the kernel;
ttft       end-to-end prefill time (the forward that yields the first new token) at each length,
           SDPA vs the model switched with ``sparsify`` to each configuration, with the sparsity
           counted over all layers; eager (transformers as is: Python launch cost bounds it) and
           replayed from a CUDA graph (the device time of the same forward).

Each writes rows in the dashboard's Accuracy-speedup format (toolkit/formats/results.py; kind
``sparsecal-bench``) to its own file next to the result (``*-captured-rows.json``,
``*-ttft-rows.json``): method, config, length, speedup (SDPA time / sparse time), sparsity, task
("kernel" or "ttft"), so that ``sparsecal eval --bench`` joins them with accuracy rows.
"""
from __future__ import annotations

import json
import statistics

import torch

from sparsecal.bench.harness import bench_ms, log, sdpa_fns
from sparsecal.formats.files import atomic_write_text
from sparsecal.kernels.dense import attention_dense
from sparsecal.kernels.sparse.prefill import candidate_tiles, sparse_attention_triton

CAPTURE_LAYERS = (0, 7, 15, 22, 29)


def configs(export_dir) -> list[tuple[str, str, dict]]:
    """(method, config, sparsify kwargs) for every operating point of the export, plus window:32."""
    from sparsecal.formats.exports import load_blasst
    from sparsecal.integrations.exports import load_bsfa

    ks = load_bsfa(export_dir, {}).k_values
    targets = [t["target_sparsity"] for t in load_blasst(export_dir, {})["targets"]]
    out = [("bsfa", f"k={k}", {"method": "bsfa", "k": k}) for k in ks if k >= 16]
    out += [("blasst", f"target={t:g}", {"method": "blasst", "target": t}) for t in targets]
    return out + [("window", "blocks=32", {"method": "window", "blocks": 32})]


def _model_and_prompts(lengths):
    from sparsecal.capture.models import load_model, load_tokenizer, resolve_model
    from sparsecal.capture.prompts import build_task_prompts

    ms = resolve_model("smollm2")
    model = load_model(ms, dtype="bfloat16", device="cuda", attn="sdpa")
    prompts = build_task_prompts(load_tokenizer(ms), ["niah_single"], lengths, 1, seed=20261122)
    return ms, model, {p.length: torch.tensor([p.input_ids], device="cuda") for p in prompts}


def capture_qkv(model, ids, layers) -> dict:
    """layer -> (q [1, H, N, D], k, v [1, Hkv, N, D]) as the attention interface receives them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grabbed = {}

    def grab(module, query, key, value, *args, **kwargs):
        if module.layer_idx in layers:
            grabbed[module.layer_idx] = (query.contiguous(), key.contiguous(), value.contiguous())
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("sparsecal_grab", grab)
    model.set_attn_implementation("sparsecal_grab")
    with torch.no_grad():
        model(ids, logits_to_keep=1)
    model.set_attn_implementation("sdpa")
    return grabbed


def captured_section(model, ids, export_dir) -> dict:
    from sparsecal.integrations.sparsify import load_state, method_args

    n = ids.shape[1]
    qkv = capture_qkv(model, ids, CAPTURE_LAYERS)
    points = [(method, config, load_state(export_dir, **kw)) for method, config, kw in configs(export_dir)]
    rows, bench_rows = [], []
    for layer, (q, k, v) in sorted(qkv.items()):
        d = q.shape[-1]
        scale = d ** -0.5
        reach = candidate_tiles(n, 128, 64)[1] * q.shape[1]
        ms = {"dense_triton": bench_ms(lambda: attention_dense(q, k, v, scale))}
        ms.update({name: bench_ms(fn) for name, (fn, _) in sdpa_fns(q, k, v)[0].items()})
        sdpa = min(t for name, t in ms.items() if name.startswith("sdpa"))
        for method, config, state in points:
            args = method_args(state, layer, "prefill", n, q.device)
            _, sk = sparse_attention_triton(q, k, v, scale, state.block_m, state.block_n, order=state.order, **args)
            t = bench_ms(lambda: sparse_attention_triton(q, k, v, scale, state.block_m, state.block_n,
                                                         order=state.order, **args))
            sp = float(sk.sum()) / reach
            rows.append({"layer": layer, "method": method, "config": config, "ms": t, "sparsity": sp,
                         "speedup_vs_dense": ms["dense_triton"] / t, "speedup_vs_sdpa": sdpa / t})
            bench_rows.append({"method": method, "config": config, "length": n, "speedup": sdpa / t,
                               "sparsity": sp, "task": "kernel", "layer": layer})
        rows.append({"layer": layer, "baselines_ms": ms})
        log(f"  captured layer {layer}: " + ", ".join(f"{r['config']} s={r['sparsity']:.2f} x{r['speedup_vs_sdpa']:.2f}"
                                                     for r in rows[-len(points) - 1:-1]))
    return {"length": n, "layers": list(CAPTURE_LAYERS), "rows": rows, "bench_rows": bench_rows}


def _time_forward(model, ids, reps: int = 10) -> float:
    with torch.no_grad():
        for _ in range(3):
            model(ids, logits_to_keep=1)
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            model(ids, logits_to_keep=1)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def _time_graph(model, ids, reps: int = 10) -> float:
    """Median ms of the same forward (no KV cache) captured once in a CUDA graph and replayed: the
    device time of prefill without Python's per-op launch cost (which bounds a 135M model's eager
    forward at every length)."""
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(ids, logits_to_keep=1, use_cache=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(ids, logits_to_keep=1, use_cache=False)
        for _ in range(3):
            graph.replay()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def _timings(model, ids) -> dict:
    """{"eager": ms, "graph": ms or None} of one prefill forward (graph None when capture fails)."""
    out = {"eager": _time_forward(model, ids), "graph": None}
    try:
        out["graph"] = _time_graph(model, ids)
    except Exception as e:  # recorded: the eager time still stands
        out["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def _causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """The dense baseline as an attention function: SDPA causal, no mask tensor (like the sparse
    functions, which transformers gives no mask; unpadded prompts). Under CUDA-graph capture the
    built-in "sdpa" path was measured to get a materialized mask and a slower kernel (38 ms at 8K
    replayed vs 22 ms eager), so both timings use this."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def ttft_section(model, prompts: dict, export_dir) -> dict:
    """TTFT eager (HF forward as is) and in a CUDA graph; the joinable rows use the graph times
    when both SDPA and the configuration captured, else the eager ones (``timing`` says which)."""
    from transformers import AttentionInterface

    from sparsecal.integrations.sparsify import densify, sparsify

    AttentionInterface.register("sparsecal_causal_sdpa", _causal_sdpa)
    rows, bench_rows = [], []
    for n, ids in sorted(prompts.items()):
        model.set_attn_implementation("sparsecal_causal_sdpa")
        base = _timings(model, ids)
        model.set_attn_implementation("sdpa")
        rows.append({"length": n, "method": "dense", "config": "sdpa", "ms": base["eager"], "graph_ms": base["graph"],
                     **({"graph_error": base["graph_error"]} if "graph_error" in base else {})})
        for method, config, kw in configs(export_dir):
            sparsify(model, export_dir, **kw)
            t = _timings(model, ids)
            st = model.sparsecal_stats
            sp = float(st["skipped"].sum()) / float(st["reachable"].sum())
            densify(model)
            timing = "graph" if base["graph"] and t["graph"] else "eager"
            rows.append({"length": n, "method": method, "config": config, "ms": t["eager"], "graph_ms": t["graph"],
                         "sparsity": sp, "speedup_vs_sdpa": base["eager"] / t["eager"],
                         "graph_speedup_vs_sdpa": base["graph"] / t["graph"] if timing == "graph" else None,
                         **({"graph_error": t["graph_error"]} if "graph_error" in t else {})})
            bench_rows.append({"method": method, "config": config, "length": n, "speedup": base[timing] / t[timing],
                               "sparsity": sp, "task": "ttft", "timing": timing})
        log(f"  ttft {n}: sdpa {base['eager']:.2f} ms (graph {base['graph']}); " + ", ".join(
            f"{r['config']} {r['ms']:.2f} ms (graph {r['graph_ms']}) s={r['sparsity']:.2f}"
            for r in rows if r["length"] == n and "sparsity" in r))
    return {"rows": rows, "bench_rows": bench_rows}


def model_sections(result: dict, args, save) -> None:
    """Run both sections and write the joinable rows next to ``args.out`` (``*-rows.json``)."""
    lengths = [int(x) for x in args.model_lengths.split(",")]
    _, model, prompts = _model_and_prompts(lengths)
    sec = result.setdefault("smollm2", {"export": str(args.export)})
    for key, fn in (("captured", lambda: captured_section(model, prompts[max(lengths)], args.export)),
                    ("ttft", lambda: ttft_section(model, prompts, args.export))):
        log(f"smollm2 {key}")
        try:
            sec[key] = fn()
        except Exception as e:  # recorded, the run goes on
            import traceback

            traceback.print_exc()
            sec[key] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        save()
    for key in ("captured", "ttft"):  # one file each: the dashboard averages rows of one point
        rows = sec.get(key, {}).get("bench_rows", [])
        doc = {"kind": "sparsecal-bench", "rows": rows, "provenance": result["provenance"]}
        path = args.out.with_name(f"{args.out.stem}-{key}-rows.json")
        atomic_write_text(path, json.dumps(doc, indent=1, default=str))
        log(f"wrote {len(rows)} rows to {path}")
