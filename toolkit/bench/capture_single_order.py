"""The single-order capture path against the three-order one on the GPU (issue 3), in one run:
``python3 -m sparsecal.bench.capture_single_order --commit <sha>`` (writes
data/bench/triton-capture-single-order-h100.json).

1. checks on the GPU: for each scan order, the single-order capture (kernels/capture/single_order.py:
   single-pass forward + mass pass + decode rows + device reductions) against reduce_tiles of the
   plain-torch reference cut to that order (every key: shape, dtype, values), and the mass pass
   against the reference mass (harness.CHECK_CASES: 5 shapes, bf16/fp16/fp32, 128x64,
   64x32, 80x48);
2. whether both capture paths run one call without a host sync (torch.cuda.set_sync_debug_mode);
3. a launch sweep of the mass pass at the first length, per head dim;
4. per (D, N), bf16, causal, B=1, H=32, 8 KV heads, default geometry 128x64, timed round-robin
   ``--repeats`` rounds (median of the rounds of do_bench medians, L2 flushed): SDPA cuDNN and
   FLASH, dense Triton (tuned tile), the three-order capture (two passes), the one-order capture
   for each order, and its parts: the single-pass forward alone per order, the mass pass, decode
   + reductions (forward order);
5. with --profile, a torch.profiler table of one one-order capture call.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from sparsecal.bench.capture_instrumented import profile_capture
from sparsecal.bench.harness import (
    CHECK_CASES,
    HEADS,
    KV_HEADS,
    bench_ms,
    compiled_info,
    log,
    random_qkv,
    result_file,
    run_section,
    sdpa_fns,
    sweep,
    sync,
)
from sparsecal.formats.geometry import ORDERS
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.forward_stats import instrumented_forward_triton
from sparsecal.kernels.capture.mass import block_mass_triton
from sparsecal.kernels.capture.pipeline import capture_triton
from sparsecal.kernels.capture.reduce_reference import reduce_tiles
from sparsecal.kernels.capture.reference import TileStats, instrumented_attention
from sparsecal.kernels.capture.single_order import single_order_reductions
from sparsecal.kernels.dense import attention_dense, flops_causal

MASS_SWEEP = [(4, 2), (4, 3), (8, 2), (8, 3)]


def one_order(r: TileStats, o: int) -> TileStats:
    """The reference TileStats of all three orders cut down to order o (as a one-order run has it)."""
    cut = lambda t: t[:, o:o + 1]
    return TileStats(r.bmax, cut(r.gap), r.mass, cut(r.tstar_step), cut(r.tstar_where), cut(r.tstar_norm),
                     r.qinit_err, cut(r.dec_gap), r.dec_mass, r.dec_rows, cut(r.rescales), cut(r.shortfall),
                     dec_bmax=r.dec_bmax, joint_err=r.joint_err, group=r.group)


FLOAT_TOL = 1e-3


def reduced_errors(got: dict, want: dict) -> dict:
    """Per key: max abs error of floats (finite entries) and -inf pattern equality, or the share of
    counts that moved bin; plus dtype/shape agreement and ``within`` (the key's tolerance met).

    Tolerances: FLOAT_TOL, except raw_* (stored in fp16: one storage step at the largest value) and
    the *gap_mass histograms, whose bins move with their counts: a row whose gap sits on a bin edge
    (a near tie, allowed by moved_share < 1%) carries its whole mass to the next bin, so there the
    mass summed over the bins must agree instead."""
    out = {}
    for key, w in want.items():
        g = got[key]
        e = {"same_shape": tuple(g.shape) == tuple(w.shape),
             "same_dtype": g.dtype == w.dtype or (key.endswith("gap_mass") and not w.any())}
        if g.is_floating_point():
            fin = torch.isfinite(w)
            e["max_abs_err"] = float((g[fin].double() - w[fin].double()).abs().max()) if fin.any() else 0.0
            e["inf_equal"] = bool(torch.equal(torch.isinf(g), torch.isinf(w)))
            tol = FLOAT_TOL
            if key.startswith("raw_") and fin.any():
                tol = max(tol, float(w[fin].abs().max()) * 2.0 ** -10)
            e["within"] = e["max_abs_err"] < tol
            if key.endswith("gap_mass") and e["same_shape"]:
                e["bin_total_abs_err"] = float((g.double().sum(-1) - w.double().sum(-1)).abs().max())
                e["within"] = e["within"] or e["bin_total_abs_err"] < FLOAT_TOL
        else:
            e["moved_share"] = float((g - w).abs().sum() / max(1, 2 * int(w.abs().sum())))
            e["within"] = e["moved_share"] < 0.01
        out[key] = e
    return out


def check_single(case) -> dict:
    """The single-order capture per order vs reduce_tiles of the reference (on the GPU), the mass
    pass vs the reference mass."""
    n, hkv, group, d, bm, bn, dtype = case
    q, k, v = random_qkv(n, d, dtype, hkv * group, hkv, seed=n, sink=True)
    scale = d ** -0.5
    ref_out, r = instrumented_attention(q, k, v, scale, StatsConfig(block_m=bm, block_n=bn))
    res = {"case": dict(n=n, kv_heads=hkv, group=group, d=d, bm=bm, bn=bn, dtype=str(dtype)), "orders": {}}
    lse = instrumented_forward_triton(q, k, v, scale, StatsConfig(block_m=bm, block_n=bn), "forward")[1]
    res["mass_max_abs_err"] = float((block_mass_triton(q, k, lse, scale, StatsConfig(block_m=bm, block_n=bn))
                                     - r.mass).abs().max())
    tol_out = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    ok = res["mass_max_abs_err"] < 1e-4
    for o, order in enumerate(ORDERS):
        cfg = StatsConfig(block_m=bm, block_n=bn, orders=(order,), raw=True)
        out, got = capture_triton(q, k, v, scale, cfg)
        e = {"out_max_abs_err": float((out.double() - ref_out.double()).abs().max()),
             "keys": reduced_errors(got, reduce_tiles(one_order(r, o), n, cfg))}
        ks = e["keys"]
        e["ok"] = bool(list(got) == list(ks) and e["out_max_abs_err"] < tol_out
                       and all(x["same_shape"] and x["same_dtype"] and x.get("inf_equal", True) for x in ks.values())
                       and all(x["within"] for x in ks.values())
                       and ks["bsfa_kept"]["moved_share"] == 0
                       and all(x.get("moved_share", 0) < 0.01 for x in ks.values()))
        ok &= e["ok"]
        res["orders"][order] = e
    res["ok"] = bool(ok)
    return res


def sync_free(fn) -> bool | str:
    """True when fn() (after a warm-up call) runs without a host sync (torch's sync debug mode)."""
    from sparsecal.bench import harness

    if harness.DEVICE != "cuda":
        return "not checked (no CUDA device)"
    fn()
    sync()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError as e:
        return f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
        sync()


def single_order_measure(d: int, n: int, mass_launch, repeats: int) -> dict:
    """Round-robin timings at one (D, N): SDPA, dense, the three-order capture, and per order the
    one-order capture with its parts (single-pass forward alone; mass; decode + reductions)."""
    q, k, v = random_qkv(n, d, seed=n + d)
    scale = d ** -0.5
    cfg3 = StatsConfig()
    launch = {"mass": mass_launch} if mass_launch else None
    fns = {name: fn for name, (fn, _) in sdpa_fns(q, k, v)[0].items()}
    fns["dense"] = lambda: attention_dense(q, k, v, scale)
    fns["capture_3orders"] = lambda: capture_triton(q, k, v, scale, cfg3)
    for order in ORDERS:
        cfg = StatsConfig(orders=(order,))
        fns[f"capture_{order}"] = lambda c=cfg: capture_triton(q, k, v, scale, c, launch=launch)
        fns[f"forward_stats_{order}"] = lambda o=order: instrumented_forward_triton(q, k, v, scale, cfg3, o)
    fwd = instrumented_forward_triton(q, k, v, scale, cfg3, "forward")
    mass = block_mass_triton(q, k, fwd[1], scale, cfg3, mass_launch)
    cfg_f = StatsConfig(orders=("forward",))
    fns["mass"] = lambda: block_mass_triton(q, k, fwd[1], scale, cfg3, mass_launch)
    fns["decode_reduce_forward"] = lambda: single_order_reductions(q, k, fwd[1:], mass, scale, cfg_f)
    res = {"d": d, "n": n, "mass_launch": mass_launch, "samples_ms": {name: [] for name in fns}}
    for _ in range(repeats):
        for name, fn in fns.items():
            res["samples_ms"][name].append(bench_ms(fn))
    res["ms"] = {name: float(torch.tensor(x).median()) for name, x in res["samples_ms"].items()}
    res["compiled"] = {name: compiled_info(name) for name in ("mass", "forward_stats")}  # last launches
    flops = flops_causal(1, HEADS, n, d)
    res["tflops"] = {x: flops / (ms * 1e-3) / 1e12 for x, ms in res["ms"].items()}
    dense = res["ms"]["dense"]
    res["ratios_vs_dense"] = {x: ms / dense for x, ms in res["ms"].items()}
    log(f"D={d} N={n}: " + ", ".join(f"{x} {ms:.2f} ms ({res['ratios_vs_dense'][x]:.2f}x)" for x, ms in res["ms"].items()))
    return res


def single_order_table(result: dict) -> str:
    short = {"sdpa_cudnn": "cuDNN", "sdpa_flash": "FLASH", "capture_3orders": "cap 3 ord"}
    for o, tag in zip(ORDERS, ("fwd", "rev", "sink")):
        short.update({f"capture_{o}": f"cap {tag}", f"forward_stats_{o}": f"1pass {tag}"})
    short.update(mass="mass", decode_reduce_forward="dec+red")
    lines = ["   D      N  dense ms " + " ".join(f"{c:>10}" for c in short.values()) + "   (time / dense Triton)"]
    for m in result.get("measure", []):
        r = m["ratios_vs_dense"]
        lines.append(f"{m['d']:>4} {m['n']:>6} {m['ms']['dense']:9.2f} "
                     + " ".join(f"{r.get(c, float('nan')):10.3f}" for c in short))
    return "\n".join(lines) + "\n(target: full capture (cap ...) <= 2.2x dense Triton)"


def single_order_benchmark(args, save, result: dict) -> None:
    result["shape"] = dict(heads=HEADS, kv_heads=KV_HEADS, dtype="bfloat16", causal=True, batch=1,
                           geometry="128x64", stats=StatsConfig().to_dict())
    run_section(result, "checks", lambda: [check_single(c) for c in CHECK_CASES], save)
    log("single-order checks ok: " + str([c["ok"] for c in result.get("checks", [])]))
    q, k, v = random_qkv(2000, 128, seed=5)

    def syncs():
        return {"single_order_forward": sync_free(lambda: capture_triton(
                    q, k, v, 128 ** -0.5, StatsConfig(orders=("forward",)))),
                "three_orders": sync_free(lambda: capture_triton(q, k, v, 128 ** -0.5, StatsConfig()))}
    run_section(result, "sync_free", syncs, save)
    log(f"sync-free: {result.get('sync_free')}")
    result["mass_sweep"], result["measure"] = {}, []
    for d in args.dims:
        q, k, v = random_qkv(args.lengths[0], d, seed=11)
        lse = instrumented_forward_triton(q, k, v, d ** -0.5, StatsConfig(), "forward")[1]
        holder: dict = {}
        run_section(holder, "s", lambda: sweep(f"mass D={d}", MASS_SWEEP, lambda c: lambda: block_mass_triton(
            q, k, lse, d ** -0.5, StatsConfig(), c)), save)
        best, rows = holder.get("s", (None, []))
        result["mass_sweep"][str(d)] = {"best": best, "rows": rows}
        for n in args.lengths:
            holder = {}
            run_section(holder, "m", lambda: single_order_measure(d, n, best, args.repeats), save)
            if "m" in holder:
                result["measure"].append(holder["m"])
            save()
    if args.profile:
        d, n = args.dims[-1], args.lengths[0]
        best = result["mass_sweep"].get(str(d), {}).get("best")
        run_section(result, "profile", lambda: profile_capture(d, n, StatsConfig(orders=("forward",)),
                                                               {"mass": best} if best else None), save)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,32768")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--out", type=Path, default=Path("data/bench/triton-capture-single-order-h100.json"))
    ap.add_argument("--repeats", type=int, default=3, help="round-robin timing rounds (median)")
    ap.add_argument("--commit", default=None, help="commit to record (the device copy's .git may be stale or absent)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of one capture call")
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.dims = [int(x) for x in args.dims.split(",")]
    result, save = result_file("triton-capture-single-order", args.out, args.commit)
    single_order_benchmark(args, save, result)
    print(single_order_table(result), flush=True)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
