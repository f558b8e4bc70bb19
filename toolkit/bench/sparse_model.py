"""The SmolLM2 sections of the sparse benchmark (``sparsecal bench --smollm2``), on the GPU:

captured   Q/K/V of a few layers of SmolLM2-135M-Instruct (bf16) on an 8K-token task prompt,
           captured at the attention interface (after RoPE), run through the sparse prefill kernel
           sparsify runs (kernels.sparse.prefill_pick.sparse_prefill)
           with the calibrated export (BSFA k, BLASST targets, window) against the dense Triton
           forward and the best SDPA backend: real sparsity, counted in the kernel;
ttft       end-to-end prefill time (the forward that yields the first new token) at each length
           through bench/ttft.py: the best SDPA vs the model switched with ``sparsify`` to each
           configuration, with and without dispatch, replayed from a CUDA graph (the device time
           of the forward; eager, Python's launch cost bounds a 135M model).

Each writes rows in the dashboard's Accuracy-speedup format (toolkit/formats/results.py; kind
``sparsecal-bench``) to its own file next to the result (``*-captured-rows.json``,
``*-ttft-rows.json``): method, config, length, speedup (SDPA time / sparse time), sparsity, task
("kernel" or "ttft"), so that ``sparsecal eval --bench`` joins them with accuracy rows.
"""
from __future__ import annotations

import json

import torch

from sparsecal.bench.harness import bench_ms, log, sdpa_fns
from sparsecal.bench.ttft import configs
from sparsecal.formats.files import atomic_write_text
from sparsecal.kernels.dense import attention_dense
from sparsecal.kernels.sparse.prefill import candidate_tiles
from sparsecal.kernels.sparse.prefill_pick import sparse_prefill

CAPTURE_LAYERS = (0, 7, 15, 22, 29)


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
    from sparsecal.integrations.sparsify import expected_sparsity, load_state, method_args

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
            args["expected_sparsity"] = expected_sparsity(state, layer, "prefill", n)  # sparsify's kernel pick
            _, sk = sparse_prefill(q, k, v, scale, state.block_m, state.block_n, order=state.order, **args)
            t = bench_ms(lambda: sparse_prefill(q, k, v, scale, state.block_m, state.block_n, order=state.order,
                                                **args))
            sp = float(sk.sum()) / reach
            rows.append({"layer": layer, "method": method, "config": config, "ms": t, "sparsity": sp,
                         "speedup_vs_dense": ms["dense_triton"] / t, "speedup_vs_sdpa": sdpa / t})
            bench_rows.append({"method": method, "config": config, "length": n, "speedup": sdpa / t,
                               "sparsity": sp, "task": "kernel", "layer": layer})
        rows.append({"layer": layer, "baselines_ms": ms})
        log(f"  captured layer {layer}: " + ", ".join(f"{r['config']} s={r['sparsity']:.2f} x{r['speedup_vs_sdpa']:.2f}"
                                                     for r in rows[-len(points) - 1:-1]))
    return {"length": n, "layers": list(CAPTURE_LAYERS), "rows": rows, "bench_rows": bench_rows}


def ttft_section(model, prompts: dict, export_dir) -> dict:
    """TTFT per length through bench/ttft.py (best SDPA vs each operating point with and without
    dispatch, replayed from CUDA graphs); ``bench_rows`` are its joinable rows."""
    import argparse

    from sparsecal.bench.ttft import joinable, length_rows

    opts = argparse.Namespace(graph=True, rounds=3, reps=5, warmup=3, min_k=16)
    rows = []
    for n, ids in sorted(prompts.items()):
        rows += length_rows(model, ids, export_dir, opts)
    return {"rows": rows, "bench_rows": joinable(rows)}


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
