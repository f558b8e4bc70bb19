"""GPU benchmark of the single-pass instrumented forward (kernels/capture/forward_stats.py).

One run: correctness of every output vs the torch reference on the GPU (each order, a few
shapes and dtypes), then per (D, N): SDPA cuDNN and FLASH (GQA native), the dense Triton
forward (its tuned tile, and the run's 128x64 tile), a launch sweep of the single-pass kernel,
and per scan order the single-pass kernel with statistics and without (the same scan, to
separate the statistics' cost). bf16, causal, B=1, H=32, 8 KV heads; default geometry 128x64.
Times are medians of triton.testing.do_bench (L2 flushed, warm-up first), each variant timed in
``--repeats`` round-robin rounds (median of the rounds) so drift hits all variants alike.

    python3 -m sparsecal.bench.capture_forward_stats --commit <sha>
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparsecal.bench.harness import HEADS, KV_HEADS, bench_ms, log, random_qkv, sdpa_fns, sweep
from sparsecal.formats.geometry import ORDERS
from sparsecal.formats.provenance import provenance
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture import instrumented as ti
from sparsecal.kernels.capture.forward_stats import instrumented_forward_triton
from sparsecal.kernels.capture.reference import instrumented_attention
from sparsecal.kernels.dense import attention_dense, flops_causal

LAUNCH_SWEEP = [(8, 3), (4, 3), (8, 2)]
CHECK_CASES = [  # (N, KV heads, group, D, BM, BN, dtype)
    (1000, 2, 4, 128, 128, 64, torch.bfloat16),
    (777, 1, 3, 64, 128, 64, torch.float16),
    (300, 1, 2, 128, 80, 48, torch.bfloat16),
    (640, 1, 2, 64, 128, 64, torch.float32),
]


def order_errors(got, ref_out, r, o: int, dtype) -> dict:
    """Max errors of instrumented_forward_triton's outputs vs the reference TileStats (order o)."""
    out, lse, bmax, gap, tstep, twhere, qerr, resc, short, jerr = got
    e = {"out": float((out.double() - ref_out.double()).abs().max())}
    for name, a, b in (("bmax", bmax, r.bmax), ("gap", gap, r.gap[:, o]), ("qinit_err", qerr, r.qinit_err),
                       ("joint_err", jerr, r.joint_err)):
        fin = torch.isfinite(b)
        e[name] = float((a[fin].double() - b[fin].double()).abs().max())
        e[name + "_inf_equal"] = bool(torch.equal(torch.isneginf(a), torch.isneginf(b)))
    e["tstar_step_mismatch"] = float((tstep.long() != r.tstar_step[:, o]).float().mean())
    e["tstar_where_mismatch"] = float((twhere != r.tstar_where[:, o]).float().mean())
    e["rescales_mismatch"] = float((resc.long() != r.rescales[:, o]).float().mean())
    fin = torch.isfinite(r.shortfall[:, o])
    e["shortfall"] = float((short[fin].double() - r.shortfall[:, o][fin].double()).abs().max())
    e["shortfall_inf_equal"] = bool(torch.equal(torch.isposinf(short), torch.isposinf(r.shortfall[:, o])))
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    e["ok"] = bool(e["out"] < tol and all(e[x] < 1e-3 for x in ("bmax", "gap", "qinit_err", "joint_err"))
                   and all(e[x + "_inf_equal"] for x in ("bmax", "gap", "shortfall")) and e["tstar_step_mismatch"] < 0.01
                   and e["rescales_mismatch"] < 0.01 and e["shortfall"] < 1e-3)
    return e


def check_case(case) -> dict:
    """Max errors of every output vs the reference per order; t* mismatch shares (near-ties)."""
    n, hkv, group, d, bm, bn, dtype = case
    cfg = StatsConfig(block_m=bm, block_n=bn, decode_rows=1)
    q, k, v = random_qkv(n, d, dtype, hkv * group, hkv, seed=n, sink=True)
    scale = d ** -0.5
    ref_out, r = instrumented_attention(q, k, v, scale, cfg)
    res = {"case": dict(n=n, kv_heads=hkv, group=group, d=d, bm=bm, bn=bn, dtype=str(dtype)), "orders": {}}
    ok = True
    for o, order in enumerate(ORDERS):
        e = order_errors(instrumented_forward_triton(q, k, v, scale, cfg, order), ref_out, r, o, dtype)
        ok &= e["ok"]
        res["orders"][order] = e
    res["ok"] = ok
    return res


def variants(q, k, v, scale, cfg: StatsConfig, best) -> dict:
    """name -> callable of every timed variant (SDPA backends that fail are left out)."""
    fns = {name: fn for name, (fn, _) in sdpa_fns(q, k, v)[0].items()}
    fns["dense"] = lambda: attention_dense(q, k, v, scale)
    fns["dense_same_tile"] = lambda: attention_dense(q, k, v, scale, config=(cfg.block_m, cfg.block_n, 8, 3))
    fns["two_pass_pass12"] = lambda: ti.instrumented_forward(q, k, v, scale, cfg, fused=True)
    run = instrumented_forward_triton
    for order in ORDERS:
        fns[f"stats_{order}"] = lambda o=order: run(q, k, v, scale, cfg, o, best)
        fns[f"nostats_{order}"] = lambda o=order: run(q, k, v, scale, cfg, o, best, stats=False)
    return fns


def measure(d: int, n: int, cfg: StatsConfig, repeats: int) -> dict:
    """All variants at one (D, N) on the same inputs, timed round-robin ``repeats`` times; ms is
    the median of the rounds; ratios are times vs the tuned dense."""
    q, k, v = random_qkv(n, d, seed=n + d)
    scale = d ** -0.5
    res = {"d": d, "n": n}
    run = instrumented_forward_triton
    best, res["launch_sweep"] = sweep(f"forward D={d} N={n}", LAUNCH_SWEEP,
                                      lambda c: lambda: run(q, k, v, scale, cfg, "forward", c))
    res["launch"] = list(best)
    fns = variants(q, k, v, scale, cfg, best)
    res["samples_ms"] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            res["samples_ms"][name].append(bench_ms(fn))
    res["ms"] = {name: float(torch.tensor(x).median()) for name, x in res["samples_ms"].items()}
    flops = flops_causal(1, HEADS, n, d)
    res["tflops"] = {k_: flops / (ms * 1e-3) / 1e12 for k_, ms in res["ms"].items()}
    dense = res["ms"]["dense"]
    res["ratios_vs_dense"] = {k_: ms / dense for k_, ms in res["ms"].items()}
    log(f"D={d} N={n}: " + ", ".join(f"{k_} {v_:.2f} ms ({res['ratios_vs_dense'][k_]:.3f}x)"
                                     for k_, v_ in res["ms"].items()))
    return res


def table(result: dict) -> str:
    cols = ["sdpa_cudnn", "dense", "dense_same_tile", "two_pass_pass12"] + [f"stats_{o}" for o in ORDERS]
    lines = ["   D      N " + " ".join(f"{c[:15]:>15}" for c in cols) + "   (time / dense)"]
    for m in result.get("measure", []):
        r = m["ratios_vs_dense"]
        lines.append(f"{m['d']:>4} {m['n']:>6} " + " ".join(f"{r.get(c, float('nan')):15.3f}" for c in cols))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,32768")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--out", type=Path, default=Path("data/bench/triton-forward-stats-h100.json"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="round-robin timing rounds (median)")
    ap.add_argument("--no-checks", action="store_true")
    args = ap.parse_args(argv)
    result = {"benchmark": "triton-forward-stats", "provenance": provenance(),
              "shape": dict(heads=HEADS, kv_heads=KV_HEADS, dtype="bfloat16", causal=True, batch=1)}
    result["provenance"]["commit"] = args.commit or result["provenance"]["commit"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: args.out.write_text(json.dumps(result, indent=1, default=str))
    log(f"GPU: {result['provenance']['gpu']}, torch {torch.__version__}")
    if not args.no_checks:
        result["checks"] = [check_case(c) for c in CHECK_CASES]
        log("checks ok: " + str([c["ok"] for c in result["checks"]]))
        save()
    cfg = StatsConfig()
    result["measure"] = []
    for d in [int(x) for x in args.dims.split(",")]:
        for n in [int(x) for x in args.lengths.split(",")]:
            try:
                result["measure"].append(measure(d, n, cfg, args.repeats))
            except Exception as e:  # record and go on: one failure must not lose the other shapes
                result.setdefault("errors", []).append(f"D={d} N={n}: {type(e).__name__}: {str(e)[:500]}")
                log(result["errors"][-1])
            save()
    print(table(result), flush=True)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
