"""GPU benchmark of the sparse kernels, in one run on one GPU (``sparsecal bench``).

1. correctness on the GPU: the Triton sparse prefill and decode kernels against the plain-torch
   sparse reference (outputs and skip counts) on small structured inputs;
2. a launch sweep of the sparse prefill kernel (skipping off and BSFA at 50%) at the first shape;
3. prefill matrix (bf16, causal, B=1, H=32): per head dim, length and GQA group, round-robin
   timings of the best SDPA backend (cuDNN, FLASH), the dense Triton forward at its tuned tile,
   the sparse kernel with skipping off (run geometry), and BSFA and BLASST at about 0%, 50% and 75%
   sparsity (operating points read from the input's own tile statistics). Every sparse row carries the sparsity the kernel counted, the speedup
   over dense Triton and over the best SDPA, and the ideal 1 / (1 - s/2);
4. decode (B >= 16, 32K cached tokens): the split-K kernel with skipping off vs BLASST and BSFA at
   about 50% and 75%, with the share of V tiles actually skipped (a V tile is shared by the G
   query heads of a KV group and is skipped only when all of them skip it) and SDPA for context.

    python -m sparsecal.bench.sparse [--dims 128,64] [--lengths 16384,32768,65536] [--groups 1,4,8]
        [--decode-batch 16] [--decode-length 32768] [--out data/bench/sparse-h100.json]

Times are medians of triton.testing.do_bench (L2 flushed before each call, warm-up first), taken in
``--rounds`` round-robin rounds over the variants of one shape; the median over rounds is kept.
``--smollm2`` adds the model sections (bench/sparse_model.py): kernels on Q/K/V captured from
SmolLM2 with its calibrated export, and end-to-end prefill time (TTFT) against SDPA.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

from sparsecal.bench.harness import bench_ms, log, sdpa_fns
from sparsecal.bench.kernel_profile import bandwidth, device_us, pick
from sparsecal.bench.sparse_inputs import (
    blasst_log_lambda_for,
    bsfa_thresholds_for,
    decode_log_lambda_for,
    decode_tile_max,
    structured_qkv,
    tile_stats,
)
from sparsecal.evaluation.speed_stats import round_order
from sparsecal.formats.files import atomic_write_text
from sparsecal.formats.provenance import provenance
from sparsecal.kernels.dense import attention_dense, flops_causal
from sparsecal.kernels.jit import LOG2E
from sparsecal.kernels.sparse.decode import SCHEDULES, decode_skip_mask, sparse_decode_triton
from sparsecal.kernels.sparse.prefill import candidate_tiles, sparse_attention_triton
from sparsecal.kernels.sparse.reference import sparse_attention, sparse_decode

HEADS, BM, BN = 32, 128, 64
SPARSITIES = (0.0, 0.5, 0.75)
LAUNCH_SWEEP = [(4, 2), (4, 3), (8, 2), (8, 3), (8, 4)]
# decision structures timed side by side (NOTES: V prefetched with K and a decide-then-attend
# form were measured slower at 16K and removed)
STYLES = {"gated": {"gate_v": True}}
DECODE_SWEEP = [(4, 2), (4, 3), (8, 2), (8, 3)]  # (num_warps, num_stages) of the decode kernels
SUFFIX = {"gather": "", "inline": "_inline"}  # decode variant names per schedule
DECODE_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def ideal(s: float) -> float:
    """Speedup when skipped tiles save their V load, exponentials and P.V: about half a tile."""
    return 1.0 / (1.0 - s / 2.0)


def check_kernels() -> dict:
    """Triton vs reference on the GPU: prefill (BSFA, BLASST per order, window) and decode."""
    rows, ok = [], True
    for n, kv, group, d, dtype in ((1000, 2, 4, 128, torch.bfloat16), (777, 1, 3, 64, torch.float16),
                                   (640, 2, 1, 64, torch.float32)):
        q, k, v = structured_qkv(n, d, kv * group, kv, seed=n, dtype=dtype)
        scale = d ** -0.5
        bmax, gap = tile_stats(q, k, v, scale, BM, BN)
        cases = [{"thresholds": bsfa_thresholds_for(bmax, n, BM, BN, 0.5)},
                 {"window": 2}] + [{"log_lambda": blasst_log_lambda_for(gap, n, BM, BN, 0.5), "order": o}
                                   for o in ("forward", "reverse", "sink_local")]
        for kw in cases:
            got, sk = sparse_attention_triton(q, k, v, scale, BM, BN, **kw)
            want, c = sparse_attention(q, k, v, scale, BM, BN, **kw)
            err = float((got.double() - want.double()).abs().max())
            same = bool(torch.equal(sk[0].cpu(), c.skipped.cpu()))
            tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
            ok &= err < tol and same
            rows.append({"n": n, "d": d, "group": group, "dtype": str(dtype), "method": sorted(kw)[0],
                         "order": kw.get("order"), "max_abs_err": err, "skip_counts_equal": same,
                         "sparsity": float(sk.sum()) / (candidate_tiles(n, BM, BN)[1] * q.shape[1])})
        qd, kd, vd = q[:, :, -1:].expand(3, -1, -1, -1).contiguous(), k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)
        kd, vd = kd.contiguous(), vd.contiguous()
        ll = decode_log_lambda_for(qd, kd, scale, BN, 0.5)
        got, sk = sparse_decode_triton(qd, kd, vd, scale, BM, BN, log_lambda=ll)
        want, c = sparse_decode(qd, kd, vd, scale, BM, BN, log_lambda=ll)
        err = float((got.double() - want.double()).abs().max())
        same = bool(torch.equal(sk.sum(0).cpu(), c.skipped.cpu()))
        ok &= err < 3e-2 and same
        rows.append({"n": n, "d": d, "group": group, "dtype": str(dtype), "method": "decode_blasst",
                     "max_abs_err": err, "skip_counts_equal": same})
        log(f"check n={n} d={d} group={group}: " + ", ".join(f"{r['method']} {r['max_abs_err']:.2e}"
                                                              f"{'' if r['skip_counts_equal'] else ' COUNTS DIFFER'}"
                                                              for r in rows[-6:]))
    return {"ok": bool(ok), "rows": rows}


def prefill_variants(q, k, v, d: int, n: int, launch) -> dict:
    """name -> (callable, kernel-counted sparsity or None, extra info)."""
    scale = d ** -0.5
    bmax, gap = tile_stats(q, k, v, scale, BM, BN)
    reach = candidate_tiles(n, BM, BN)[1] * q.shape[1]
    out = torch.empty_like(q)
    variants = {"dense_triton": (lambda: attention_dense(q, k, v, scale, out=out), None, {}),
                "sparse_off": (lambda: sparse_attention_triton(q, k, v, scale, BM, BN, dense=True, out=out,
                                                               launch=launch), 0.0, {})}
    for name, (fn, mode) in sdpa_fns(q, k, v)[0].items():
        variants[name] = (fn, None, {"gqa": mode})
    for s in SPARSITIES:
        points = {"bsfa": {"thresholds": bsfa_thresholds_for(bmax, n, BM, BN, s)},
                  "blasst": {"log_lambda": blasst_log_lambda_for(gap, n, BM, BN, s)}}
        for method, kw in points.items():
            for style, opts in STYLES.items():
                _, sk = sparse_attention_triton(q, k, v, scale, BM, BN, out=out, launch=launch, **opts, **kw)
                got = float(sk.sum()) / reach

                def fn(kw=kw, opts=opts):
                    return sparse_attention_triton(q, k, v, scale, BM, BN, out=out, launch=launch, **opts, **kw)

                info = {"target": s, **({"log_lambda": kw["log_lambda"]} if "log_lambda" in kw else {})}
                variants[f"{method}_s{int(s * 100)}_{style}"] = (fn, got, info)
            if s == 0.5:  # the decision made and counted, every tile computed: what deciding costs
                variants[f"{method}_count_only"] = (
                    lambda kw=kw: sparse_attention_triton(q, k, v, scale, BM, BN, out=out, launch=launch,
                                                          count_only=True, **kw), None, {"decides_like": s})
    return variants


def round_robin_times(variants: dict, rounds: int) -> dict:
    """name -> its bench_ms of each round (in round order), the variants timed in turn in
    ``speed_stats.round_order``, ``rounds`` times."""
    times = {name: [] for name in variants}
    for r in range(rounds):
        for name in round_order(variants, r):
            times[name].append(bench_ms(variants[name][0]))
    return times


def time_round_robin(variants: dict, rounds: int) -> dict:
    """name -> the median of its round_robin_times."""
    return {name: statistics.median(t) for name, t in round_robin_times(variants, rounds).items()}


def prefill_shape(d: int, n: int, group: int, rounds: int, launch) -> dict:
    q, k, v = structured_qkv(n, d, HEADS, HEADS // group, seed=n + d + group)
    variants = prefill_variants(q, k, v, d, n, launch)
    ms = time_round_robin(variants, rounds)
    sdpa = min((t for name, t in ms.items() if name.startswith("sdpa")), default=None)
    dense, off = ms["dense_triton"], ms["sparse_off"]
    rows = []
    for name, (_, sp, info) in variants.items():
        row = {"variant": name, "ms": ms[name], "tflops": flops_causal(1, HEADS, n, d) / ms[name] / 1e9, **info}
        if sp is not None:
            row.update(sparsity=sp, speedup_vs_dense=dense / ms[name], speedup_vs_off=off / ms[name],
                       ideal=ideal(sp), of_ideal=dense / ms[name] / ideal(sp))
            if sdpa:
                row["speedup_vs_sdpa"] = sdpa / ms[name]
        rows.append(row)
    q = k = v = None  # free the inputs before the next shape
    torch.cuda.empty_cache()
    return {"d": d, "n": n, "group": group, "heads": HEADS, "kv_heads": HEADS // group, "best_sdpa_ms": sdpa,
            "rows": rows}


def launch_sweep(d: int, n: int) -> tuple:
    q, k, v = structured_qkv(n, d, HEADS, HEADS // 4, seed=1)
    scale = d ** -0.5
    bmax, _ = tile_stats(q, k, v, scale, BM, BN)
    thr = bsfa_thresholds_for(bmax, n, BM, BN, 0.5)
    rows, best = [], None
    for launch in LAUNCH_SWEEP:
        try:
            t_off = bench_ms(lambda: sparse_attention_triton(q, k, v, scale, BM, BN, dense=True, launch=launch))
            t_half = bench_ms(lambda: sparse_attention_triton(q, k, v, scale, BM, BN, thresholds=thr, launch=launch))
        except Exception as e:  # a config that does not compile or fit is recorded, not fatal
            rows.append({"launch": list(launch), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        rows.append({"launch": list(launch), "off_ms": t_off, "bsfa50_ms": t_half})
        log(f"  launch {launch}: off {t_off:.3f} ms, bsfa 50% {t_half:.3f} ms")
        if best is None or t_off + t_half < best[1]:
            best = (launch, t_off + t_half)
    return best[0], rows


def decode_shape(d: int, group: int, batch: int, length: int, rounds: int) -> dict:
    q, k, v = structured_qkv(length, d, HEADS, HEADS // group, seed=length + group, batch=batch)
    q = q[:, :, -1:].contiguous()
    scale = d ** -0.5
    sweep = {}
    for launch in DECODE_SWEEP:  # the same launch for skipping off and on: the best with skipping off
        try:
            sweep[launch] = bench_ms(lambda: sparse_decode_triton(q, k, v, scale, BM, BN, dense=True, launch=launch))
            sparse_decode_triton(q, k, v, scale, BM, BN, log_lambda=-1.0, launch=launch)  # must build with skipping
        except Exception as e:  # a launch that does not build or fit is left out
            sweep.pop(launch, None)
            log(f"  decode launch {launch}: {type(e).__name__}: {str(e)[:120]}")
    best = min(sweep, key=sweep.get)
    log("  decode launch sweep (skipping off): " + ", ".join(f"{x}: {t:.3f} ms" for x, t in sweep.items()))

    def dec(**kw):
        return sparse_decode_triton(q, k, v, scale, BM, BN, launch=best, **kw)

    variants = {f"decode_off{SUFFIX[sch]}": (lambda sch=sch: dec(dense=True, schedule=sch), None,
                                             {"launch": list(best), "schedule": sch}) for sch in SCHEDULES}
    for name, (fn, mode) in sdpa_fns(q, k, v, DECODE_SDPA, causal=False)[0].items():  # one row sees the cache
        variants[name] = (fn, None, {"gqa": mode})
    reach = (length - 1) // BN + 1
    tmax = decode_tile_max(q, k, scale, BN) * LOG2E  # the kernel's units
    for s in (0.5, 0.75):
        ll = decode_log_lambda_for(q, k, scale, BN, s)
        _, sk = dec(log_lambda=ll)
        mask = decode_skip_mask(tmax, length, BM, BN, log_lambda=ll)  # [B, H, Kb], the last tile never skipped
        v_skip = float(mask.view(batch, HEADS // group, group, -1).all(dim=2).float().mean())
        for sch in SCHEDULES:
            variants[f"blasst_s{int(s * 100)}{SUFFIX[sch]}"] = (
                lambda ll=ll, sch=sch: dec(log_lambda=ll, schedule=sch), float(sk.sum()) / (reach * batch * HEADS),
                {"log_lambda": ll, "v_tiles_skipped": v_skip, "schedule": sch})
    ms = time_round_robin(variants, rounds)
    rows = []
    for name, (_, sp, info) in variants.items():
        row = {"variant": name, "ms": ms[name], **info}
        if sp is not None:  # against skipping off in the same schedule, and against the faster off
            off = ms[f"decode_off{SUFFIX[info['schedule']]}"]
            best_off = min(ms[f"decode_off{SUFFIX[x]}"] for x in SCHEDULES)
            row.update(sparsity=sp, speedup_vs_off=off / ms[name], ideal=ideal(sp), of_ideal=off / ms[name] / ideal(sp),
                       of_ideal_vs_best_off=best_off / ms[name] / ideal(sp))
        if name.startswith(("decode", "blasst")):
            row["profile"] = decode_profile(variants[name][0], q, k, group, info.get("v_tiles_skipped", 0.0))
        rows.append(row)
    q = k = v = None  # free the inputs before the next shape
    torch.cuda.empty_cache()
    return {"d": d, "group": group, "batch": batch, "length": length, "rows": rows}


def decode_profile(fn, q, k, group: int, v_skip: float) -> dict:
    """Device time per decode pass (scores, attend, merge, other) and the bandwidth the scores and
    attend passes reach: scores read K and write the f32 scores; attend reads the scores of kept
    tiles and V of the tiles some head of the group keeps (``v_skip`` = share of V tiles skipped)."""
    us = device_us(fn)
    b, h, _, d = q.shape
    length = k.shape[2]
    k_bytes = k.numel() * k.element_size()
    s_bytes = b * h * length * 4
    parts = {p: pick(us, f"_decode_{p}_kernel") for p in ("scores", "attend", "gather", "merge")}
    parts["other"] = sum(us.values()) - sum(parts.values())
    return {"us": parts, "kernels": us,
            "scores_gbs": bandwidth(k_bytes + s_bytes, parts["scores"]),
            "attend_gbs_if_dense": bandwidth(s_bytes + k_bytes, parts["attend"] + parts["gather"]),
            "attend_gbs_moved": bandwidth(s_bytes + k_bytes * (1.0 - v_skip), parts["attend"] + parts["gather"])}


def summarize(result: dict) -> str:
    lines = []
    for shp in result.get("prefill", []):
        if "rows" not in shp:
            continue
        r = {x["variant"]: x for x in shp["rows"]}
        def f(name, key="of_ideal"):
            return f"{r[name][key]:.2f}" if name in r and key in r[name] else "-"
        lines.append(f"D={shp['d']} N={shp['n']} G={shp['group']}: dense {r['dense_triton']['tflops']:.0f} TF/s, "
                     f"sdpa {shp['best_sdpa_ms']:.2f} ms; off/dense {r['dense_triton']['ms'] / r['sparse_off']['ms']:.3f}; "
                     f"bsfa0 {f('bsfa_s0_gated', 'speedup_vs_dense')} bsfa50 {f('bsfa_s50_gated')} "
                     f"bsfa75 {f('bsfa_s75_gated')} blasst50 {f('blasst_s50_gated')} blasst75 {f('blasst_s75_gated')} "
                     f"(of ideal); blasst75 vs sdpa {f('blasst_s75_gated', 'speedup_vs_sdpa')}; count-only/off "
                     f"bsfa {r['sparse_off']['ms'] / r['bsfa_count_only']['ms']:.3f} "
                     f"blasst {r['sparse_off']['ms'] / r['blasst_count_only']['ms']:.3f}")
    for shp in result.get("decode", []):
        if "rows" in shp:
            lines.append(f"decode D={shp['d']} G={shp['group']} B={shp['batch']} L={shp['length']}: " + ", ".join(
                f"{x['variant']} {x['ms']:.3f} ms" + (f" s={x['sparsity']:.2f} of_ideal={x['of_ideal']:.2f}"
                                                       if "sparsity" in x else "") for x in shp["rows"]))
            lines += [f"  {x['variant']} us " + " ".join(f"{p} {t:.0f}" for p, t in x["profile"]["us"].items())
                      + f"; scores {x['profile']['scores_gbs']:.0f} GB/s, attend {x['profile']['attend_gbs_moved']:.0f} GB/s"
                      for x in shp["rows"] if "profile" in x]
    return "\n".join(lines)


def _section(result: dict, key: str, fn, save) -> None:
    try:
        result.setdefault(key, []).append(fn())
    except Exception as e:  # one failed shape is recorded and the run goes on
        traceback.print_exc()
        result.setdefault(key, []).append({"error": f"{type(e).__name__}: {str(e)[:500]}"})
    save()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="sparsecal bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--lengths", default="16384,32768,65536")
    ap.add_argument("--groups", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--decode-length", type=int, default=32768)
    ap.add_argument("--sections", default="check,sweep,prefill,decode")
    ap.add_argument("--smollm2", action="store_true", help="also the SmolLM2 sections (captured Q/K/V, TTFT)")
    ap.add_argument("--export", type=Path, default=Path("data/calibration/smollm2-1k-8k/export"))
    ap.add_argument("--model-lengths", default="1024,2048,4096,8192")
    ap.add_argument("--out", type=Path, default=Path("data/bench/sparse-h100.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the sparse benchmark needs a CUDA GPU (the kernels' CPU checks run in make test).", file=sys.stderr)
        raise SystemExit(2)
    dims, lengths, groups = ([int(x) for x in a.split(",")] for a in (args.dims, args.lengths, args.groups))
    sections = args.sections.split(",")
    result = {"benchmark": "sparse-kernels", "provenance": provenance(), "args": vars(args) | {"out": str(args.out),
              "export": str(args.export)}, "geometry": {"block_m": BM, "block_n": BN, "heads": HEADS}}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(result, indent=1, default=str))

    launch = {}
    if "check" in sections:
        _section(result, "check", check_kernels, save)
    for d in dims:
        launch[d] = None
        if "sweep" in sections:
            best, rows = launch_sweep(d, lengths[0])
            result.setdefault("sweep", []).append({"d": d, "n": lengths[0], "best": best, "rows": rows})
            launch[d] = tuple(best) if best else None
            save()
    if "prefill" in sections:
        for d in dims:
            for n in lengths:
                for g in groups:
                    log(f"prefill D={d} N={n} G={g}")
                    _section(result, "prefill", lambda: prefill_shape(d, n, g, args.rounds, launch.get(d)), save)
                    log(summarize({"prefill": result["prefill"][-1:]}))
    if "decode" in sections:
        for d in dims:
            for g in groups:
                log(f"decode D={d} G={g}")
                _section(result, "decode", lambda: decode_shape(d, g, args.decode_batch, args.decode_length,
                                                               args.rounds), save)
                log(summarize({"decode": result["decode"][-1:]}))
    if args.smollm2:
        from sparsecal.bench.sparse_model import model_sections

        model_sections(result, args, save)
    log("summary\n" + summarize(result))
    save()


if __name__ == "__main__":
    main()
