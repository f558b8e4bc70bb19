"""GPU benchmark of the Triton capture kernels, in one run on one GPU.

1. correctness on the GPU: instrumented Triton vs the plain-torch reference (every TileStats field
   and the reductions), dense Triton vs the reference output;
2. a small launch-config sweep (dense tiles/warps/stages, pass-1 warps/stages, statistics-pass
   warps and chunk) at the first length;
3. at each head dim and length (bf16, causal, B=1, H=32, 8 KV heads): the best PyTorch SDPA backend
   (cuDNN, FLASH) vs dense Triton vs instrumented pass 1 vs passes 1+2 vs the full capture path
   (passes, decode rows, reductions on the device), with TFLOP/s = 4*B*H*N^2*D/2 / time;
4. a long capture of an 8B-shaped random-weight Llama (a few layers) against its plain forward.

    python -m sparsecal.bench.capture_instrumented [--lengths 16384,32768] [--dims 128,64]
        [--model-length 32768] [--model-layers 4] [--out data/bench/triton-capture-h100.json]

Times are medians of triton.testing.do_bench (L2 flushed before each run, warm-up first).
``--smollm2 DIR`` instead captures SmolLM2 on the default prompt set twice (GPU triton, CPU
reference) into DIR and compares the runs. The one-order capture path has its own benchmark,
``python -m sparsecal.bench.capture_single_order``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sparsecal.bench.harness import (
    CHECK_CASES,
    DEVICE,
    HEADS,
    KV_HEADS,
    bench_ms,
    compiled_info,
    log,
    random_qkv,
    run_section,
    sdpa_fns,
    sweep,
    sync,
)
from sparsecal.formats.provenance import provenance
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture import instrumented as ti
from sparsecal.kernels.capture.reduce_reference import reduce_tiles
from sparsecal.kernels.capture.reference import instrumented_attention
from sparsecal.kernels.dense import attention_dense, flops_causal

DENSE_SWEEP = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 8, 4),
               (64, 64, 4, 3), (64, 128, 4, 3)]
PASS1_SWEEP = [(8, 2, False), (8, 3, False), (8, 4, False), (4, 3, False), (8, 3, True)]
STATS_SWEEP = [(4, 1, 16), (4, 1, 32), (8, 1, 32), (4, 2, 32)]


def field_errors(t, r) -> dict:
    """Max abs error per TileStats float field (finite entries), -inf pattern agreement, the
    share of rows whose t* or rescale count differs, and the shortfall's error, +inf pattern and
    share of rows whose "already final" (shortfall 0) differs."""
    out = {}
    for name in ("bmax", "gap", "mass", "qinit_err", "joint_err", "dec_gap", "dec_mass", "tstar_norm"):
        a, b = getattr(t, name).double(), getattr(r, name).double()
        fin = torch.isfinite(b)
        out[name] = {"max_abs_err": float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0,
                     "inf_pattern_equal": bool(torch.equal(torch.isneginf(a), torch.isneginf(b)))}
    for name in ("tstar_step", "tstar_where", "rescales"):
        out[name] = {"mismatch_share": float((getattr(t, name) != getattr(r, name)).float().mean())}
    a, b = t.shortfall.double(), r.shortfall.double()
    fin = torch.isfinite(b)
    out["shortfall"] = {"max_abs_err": float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0,
                        "inf_pattern_equal": bool(torch.equal(torch.isposinf(a), torch.isposinf(b))),
                        "zero_mismatch_share": float(((a == 0) != (b == 0)).float().mean())}
    return out


def check_case(case) -> dict:
    n, hkv, group, d, bm, bn, dtype = case
    cfg = StatsConfig(block_m=bm, block_n=bn)
    q, k, v = random_qkv(n, d, dtype, hkv * group, hkv, seed=n, sink=True)
    scale = d ** -0.5
    out, t = ti.instrumented_attention_triton(q, k, v, scale, cfg)
    ref_out, r = instrumented_attention(q, k, v, scale, cfg)
    dense, _ = attention_dense(q, k, v, scale, out=torch.full_like(q, float("nan")))
    res = {"case": dict(n=n, kv_heads=hkv, group=group, d=d, bm=bm, bn=bn, dtype=str(dtype)),
           "out_max_abs_err": float((out.double() - ref_out.double()).abs().max()),
           "dense_max_abs_err": float((dense.double() - ref_out.double()).abs().max()),
           "fields": field_errors(t, r)}
    a, b = reduce_tiles(t, n, cfg), reduce_tiles(r, n, cfg)
    res["bsfa_kept_equal"] = bool(torch.equal(a["bsfa_kept"], b["bsfa_kept"]))
    res["gap_count_moved_share"] = float((a["gap_count"] - b["gap_count"]).abs().sum() / (2 * b["gap_count"].sum()))
    f = res["fields"]
    tol_out = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    res["ok"] = bool(res["out_max_abs_err"] < tol_out and res["dense_max_abs_err"] < tol_out
                     and all(v.get("inf_pattern_equal", True) for v in f.values())
                     and all(f[x]["max_abs_err"] < 1e-3 for x in ("bmax", "gap", "qinit_err", "joint_err", "dec_gap"))
                     and all(f[x]["max_abs_err"] < 1e-4 for x in ("mass", "dec_mass"))
                     and f["tstar_step"]["mismatch_share"] < 0.01 and res["bsfa_kept_equal"]
                     and rescales_ok(f))
    return res


def rescales_ok(f: dict) -> bool:
    """field_errors' rescale and shortfall rows within tolerance (near ties may move a count)."""
    return bool(f["rescales"]["mismatch_share"] < 0.01 and f["shortfall"]["max_abs_err"] < 1e-3
                and f["shortfall"]["zero_mismatch_share"] < 0.01)


def tune(d: int, n: int, cfg: StatsConfig) -> dict:
    """Launch-config sweeps of the instrumented passes at one (D, N) (the capture path: fused
    histograms); returns the chosen configs and the sweep tables."""
    q, k, v = random_qkv(n, d)
    scale = d ** -0.5
    p1_best, p1_rows = sweep(f"pass1 D={d}", PASS1_SWEEP, lambda c: lambda: ti.instrumented_forward(
        q, k, v, scale, cfg, stats=False, launch={"pass1": c[:2], "evict_first": c[2]}))
    p1 = p1_best or (*ti.PASS1_LAUNCH.get(d, (4, 2)), ti.EVICT_FIRST)
    base = {"pass1": tuple(p1[:2]), "evict_first": p1[2]}
    st_best, st_rows = sweep(f"pass1+2 D={d}", STATS_SWEEP, lambda c: lambda: ti.instrumented_forward(
        q, k, v, scale, cfg, fused=True, launch={**base, "stats": c[:2], "tile_chunk": c[2]}))
    st = st_best or (*ti.STATS_LAUNCH, ti.TILE_CHUNK)
    launch = {**base, "stats": tuple(st[:2]), "tile_chunk": st[2]}
    return {"launch": launch, "sweeps": {"pass1": p1_rows, "pass12": st_rows}}


def diagnose(d: int, n: int, cfg: StatsConfig, launch: dict) -> dict:
    """What pass 1's parts cost: the same kernel without the q-init prologue and/or the scratch
    stores; plus registers/spills of the compiled kernels."""
    q, k, v = random_qkv(n, d, seed=7)
    scale = d ** -0.5
    res = {}
    for parts in ((), ("qinit",), ("scratch",), ("qinit", "scratch")):
        res["+".join(parts) or "none"] = bench_ms(lambda: ti.instrumented_forward(
            q, k, v, scale, cfg, stats=False, launch=launch, parts=parts))
    res["compiled_pass1"] = compiled_info("pass1")
    ti.instrumented_forward(q, k, v, scale, cfg, fused=True, launch=launch)
    res["compiled_stats"] = compiled_info("stats")
    log(f"diagnose D={d} N={n}: " + ", ".join(f"{k} {v}" for k, v in res.items()))
    return res


def profile_capture(d: int, n: int, cfg: StatsConfig, launch: dict) -> dict:
    """torch.profiler table of one full capture call (the GPU kernels and torch ops it runs)."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = random_qkv(n, d, seed=3)
    ti.instrumented_capture_triton(q, k, v, d ** -0.5, cfg, launch=launch)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ti.instrumented_capture_triton(q, k, v, d ** -0.5, cfg, launch=launch)
        sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=50)
    print(table, flush=True)
    return {"d": d, "n": n, "table": table}


def unfused_capture(q, k, v, scale, cfg, launch):
    """TileStats, then kernels/capture/reduce_reference.py on the device (the path that materializes t*)."""
    out, tiles = ti.instrumented_attention_triton(q, k, v, scale, cfg, launch=launch)
    return out, reduce_tiles(tiles, q.shape[2], cfg)


def measure(d: int, n: int, cfg: StatsConfig, tuned: dict) -> dict:
    """Every variant at one (D, N) on the same inputs."""
    q, k, v = random_qkv(n, d, seed=n + d)
    scale = d ** -0.5
    flops = flops_causal(1, HEADS, n, d)
    res = {"d": d, "n": n, "ms": {}, "tflops": {}, "gqa_sdpa": {}}
    fns, res["gqa_sdpa"] = sdpa_fns(q, k, v)
    for name, (fn, mode) in fns.items():
        res["ms"][name], res["gqa_sdpa"][name] = bench_ms(fn), mode
    launch = tuned["launch"]
    best, res["dense_sweep"] = sweep(f"dense D={d} N={n}", DENSE_SWEEP,
                                     lambda c: lambda: attention_dense(q, k, v, scale, config=c))
    res["dense_config"] = list(best)
    res["compiled_dense"] = (attention_dense(q, k, v, scale, config=best), compiled_info("dense"))[1]
    variants = {
        "dense": lambda: attention_dense(q, k, v, scale, config=best),
        "pass1": lambda: ti.instrumented_forward(q, k, v, scale, cfg, stats=False, launch=launch),
        "pass12": lambda: ti.instrumented_forward(q, k, v, scale, cfg, fused=True, launch=launch),
        "full_capture": lambda: ti.instrumented_capture_triton(q, k, v, scale, cfg, launch=launch),
        "full_unfused": lambda: unfused_capture(q, k, v, scale, cfg, launch),
    }
    for name, fn in variants.items():
        res["ms"][name] = bench_ms(fn)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ti.instrumented_capture_triton(q, k, v, scale, cfg, launch=launch)
        res["full_capture_peak_extra_bytes"] = int(torch.cuda.max_memory_allocated() - base)
    for name, ms in res["ms"].items():
        res["tflops"][name] = flops / (ms * 1e-3) / 1e12
    sdpa = [res["ms"][x] for x in ("sdpa_cudnn", "sdpa_flash") if x in res["ms"]]
    dense = res["ms"]["dense"]
    res["ratios"] = {"dense_vs_best_sdpa_tflops": (min(sdpa) / dense) if sdpa else None,
                     "pass1_vs_dense": res["ms"]["pass1"] / dense, "pass12_vs_dense": res["ms"]["pass12"] / dense,
                     "full_capture_vs_dense": res["ms"]["full_capture"] / dense}
    log(f"D={d} N={n}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in res["ms"].items()))
    return res


def model_capture(n: int, layers: int) -> dict:
    """Plain forward vs Triton capture of an 8B-shaped random-weight Llama (bf16) at n tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparsecal.capture.runner import capture_sample

    mcfg = LlamaConfig(vocab_size=128256, hidden_size=HEADS * 128, intermediate_size=14336 * HEADS // 32,
                       num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       head_dim=128, max_position_embeddings=131072, rope_theta=500000.0)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            model = LlamaForCausalLM(mcfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, mcfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    cfg = StatsConfig()

    def plain():
        with torch.no_grad():
            return model(torch.tensor([ids], device=DEVICE), use_cache=False, logits_to_keep=1).logits

    def capture():
        return capture_sample(model, ids, cfg, backend="triton")

    res = {"n": n, "layers": layers, "shape": "Llama-3.1-8B attention/MLP shape, random weights, bf16"}
    for name, fn in (("plain", plain), ("capture", capture)):
        fn()  # warm-up (compiles the kernels)
        sync()
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            result = fn()
            sync()
            times.append(time.perf_counter() - t0)
        res[f"{name}_s"] = times
        res[f"{name}_peak_bytes"] = int(torch.cuda.max_memory_allocated()) if DEVICE == "cuda" else None
    stats, _, logits = result
    res["ratio"] = min(res["capture_s"]) / min(res["plain_s"])
    res["logits_max_abs_diff_vs_plain"] = float((logits.float() - plain().float()).abs().max())
    res["stat_shapes"] = {k: list(v.shape) for k, v in stats.items()}
    res["gap_count_total_per_layer_head"] = int(stats["gap_count"][0, 0, 0].sum())
    log(f"model capture N={n} L={layers}: plain {min(res['plain_s']):.3f} s, capture {min(res['capture_s']):.3f} s")
    return res


def compare_runs(a, b) -> dict:
    """Statistics of run ``a`` against run ``b``, sample by sample: float keys as the max abs error
    over finite entries (and -inf pattern mismatches), count keys as the share of counts that moved
    bin; plus the summary table of both (sparsity, retained mass, sink rows)."""
    from sparsecal.capture.summary import run_summary

    keys: dict = {}
    for rec in b.manifest["samples"]:
        x, y = a.load_sample(rec["id"])[1], b.load_sample(rec["id"])[1]
        for key, want in y.items():
            got, row = x[key], keys.setdefault(key, {})
            if want.is_floating_point():
                fin = torch.isfinite(want)
                err = float((got[fin].double() - want[fin].double()).abs().max()) if fin.any() else 0.0
                row["max_abs_err"] = max(row.get("max_abs_err", 0.0), err)
                bad = int((torch.isneginf(got) != torch.isneginf(want)).sum())
                row["inf_mismatch"] = row.get("inf_mismatch", 0) + bad
            else:
                moved = float((got.long() - want.long()).abs().sum() / max(1, 2 * int(want.long().abs().sum())))
                row["moved_share"] = max(row.get("moved_share", 0.0), moved)
    sa, sb = run_summary(a), run_summary(b)
    diffs = {c: max(abs(r1[c] - r2[c]) for r1, r2 in zip(sa, sb)) for c in ("sparsity", "retained_mass", "sink_rows")}
    return {"per_key": keys, "summary_a": sa, "summary_b": sb, "summary_max_abs_diff": diffs}


def smollm2_compare(root: Path, lengths: list[int]) -> dict:
    """The default prompt set captured on the GPU (triton) and on the CPU (reference), float32."""
    from sparsecal.capture.command import CaptureRequest, capture_command
    from sparsecal.formats.run import RunStore

    tasks = ["niah_single", "niah_multikey", "vt", "cwe", "text"]
    res = {"tasks": tasks, "lengths": lengths, "seconds": {}}
    for name, device, backend in (("gpu-triton", "cuda", "triton"), ("cpu-reference", "cpu", "reference")):
        t0 = time.perf_counter()
        capture_command(CaptureRequest(out=root / name, tasks=tasks, lengths=lengths, dtype="float32",
                                       device=device, backend=backend))
        res["seconds"][name] = time.perf_counter() - t0
        log(f"smollm2 {name}: {res['seconds'][name]:.1f} s")
    a, b = RunStore.open(root / "gpu-triton"), RunStore.open(root / "cpu-reference")
    res["capture_seconds"] = {n: sum(s.get("seconds", 0) for s in (json.loads(p.read_text()) for p in
                                     (root / n / "samples").glob("*/sample.json"))) for n in ("gpu-triton", "cpu-reference")}
    res["comparison"] = compare_runs(a, b)
    return res


def table(result: dict) -> str:
    lines = [f"{'D':>4} {'N':>6} {'cuDNN':>7} {'FLASH':>7} {'dense':>7} {'d/SDPA':>7} {'p1/d':>6} {'p12/d':>6} {'full/d':>7}"]
    for m in result.get("measurements", []):
        t, r = m["tflops"], m["ratios"]
        lines.append(f"{m['d']:>4} {m['n']:>6} {t.get('sdpa_cudnn', float('nan')):7.0f} "
                     f"{t.get('sdpa_flash', float('nan')):7.0f} {t['dense']:7.0f} "
                     f"{r['dense_vs_best_sdpa_tflops'] or float('nan'):7.3f} {r['pass1_vs_dense']:6.3f} "
                     f"{r['pass12_vs_dense']:6.3f} {r['full_capture_vs_dense']:7.3f}")
    return "\n".join(lines) + "\n(TFLOP/s; targets: d/SDPA >= 0.85, p1/d <= 1.25, full/d <= 2.2)"


def kernel_benchmark(args, save, result: dict) -> None:
    cfg = StatsConfig()
    result["config"] = {"heads": HEADS, "kv_heads": KV_HEADS, "dtype": "bfloat16", "lengths": args.lengths,
                        "dims": args.dims, "stats": cfg.to_dict(),
                        "flops": "4 * B * H * N^2 * D / 2 (causal), B = 1"}
    run_section(result, "correctness", lambda: [check_case(c) for c in CHECK_CASES], save)
    log("correctness: " + ", ".join(str(c["ok"]) for c in result.get("correctness", [])))
    result["tuning"], result["diagnostics"] = {}, {}
    for d in args.dims:
        run_section(result["tuning"], str(d), lambda: tune(d, args.lengths[0], cfg), save)
        launch = (result["tuning"].get(str(d)) or {}).get("launch")
        run_section(result["diagnostics"], str(d), lambda: diagnose(d, args.lengths[0], cfg, launch), save)
    result["measurements"] = []
    for d in args.dims:
        tuned = result["tuning"].get(str(d)) or {"launch": None}
        for n in args.lengths:
            holder: dict = {}
            run_section(holder, "m", lambda: measure(d, n, cfg, tuned), save)
            if "m" in holder:
                result["measurements"].append(holder["m"])
            save()
    if args.profile:
        d, n = args.dims[0], args.lengths[-1]
        run_section(result, "profile", lambda: profile_capture(d, n, cfg, (result["tuning"].get(str(d)) or {}).get("launch")), save)
    if args.model_layers and args.model_length:
        run_section(result, "model_capture", lambda: model_capture(args.model_length, args.model_layers), save)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,32768")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--model-length", type=int, default=32768)
    ap.add_argument("--model-layers", type=int, default=4, help="0 skips the model capture")
    ap.add_argument("--smollm2", type=Path, default=None, help="capture SmolLM2 GPU vs CPU into this directory")
    ap.add_argument("--smollm2-lengths", default="1024,2048,4096")
    ap.add_argument("--out", type=Path, default=None, help="[default: data/bench/triton-capture-h100.json]")
    ap.add_argument("--commit", default=None, help="commit to record (the device copy's .git may be stale or absent)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of one capture call")
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.dims = [int(x) for x in args.dims.split(",")]
    name = "triton-capture"
    args.out = args.out or Path(f"data/bench/{name}-h100.json")
    result = {"benchmark": "smollm2-gpu-vs-cpu" if args.smollm2 else name, "provenance": provenance()}
    result["provenance"]["commit"] = args.commit or result["provenance"]["commit"]
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(result, indent=1, default=str))

    log(f"GPU: {result['provenance']['gpu']}, torch {torch.__version__}")
    if args.smollm2:
        lengths = [int(x) for x in args.smollm2_lengths.split(",")]
        run_section(result, "smollm2", lambda: smollm2_compare(args.smollm2, lengths), save)
        print(json.dumps(result.get("smollm2", {}).get("comparison", {}).get("summary_max_abs_diff"), indent=1))
        return
    kernel_benchmark(args, save, result)
    print(table(result), flush=True)
    if "model_capture" in result:
        mc = result["model_capture"]
        peak = (mc["capture_peak_bytes"] or 0) / 2**30
        print(f"model capture N={mc['n']} L={mc['layers']}: {mc['ratio']:.2f}x plain forward, peak {peak:.1f} GiB",
              flush=True)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
