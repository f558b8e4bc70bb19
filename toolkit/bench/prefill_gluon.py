"""GPU benchmark of the Gluon prefill kernel (kernels/sparse/prefill_gluon.py) and issue 17's
kernel targets, in one run on one Hopper GPU.

1. check: the Gluon kernel against the plain-torch reference (outputs within dtype tolerance, skip
   counts equal) on ragged lengths, GQA 1/4/8, D 64/128, fp16/bf16, batch 2, both TMA views
   ([B, H, N, D] storage and the [B, N, H, D] storage transformers hands over), every method it
   takes (dense, BSFA, BLASST forward, window). Runs first, every time.
2. targets: per head dim, length and GQA group (bf16, causal, B=1, H=32, run geometry 128 x 64),
   round-robin timings of cuDNN and FLASH SDPA, the dense Triton kernel at its tuned tile, the
   Triton sparse kernel (skipping off, BSFA / BLASST at ~0 / 50 / 75% sparsity) and the Gluon
   kernel (skipping off, the same BSFA / BLASST points). Each sparse row carries
   the sparsity its kernel counted, the ideal 1 / (1 - s/2) and its ratio to the dense baseline:
   the fastest of the project's dense kernels in the run (dense Triton, every Gluon kernel with
   skipping off; ``dense_variant`` names it), and ``of_ideal_best`` against the faster of that and
   the best SDPA; every ratio with ``_lo``/``_hi``, the exact 95% interval of the two variants'
   rounds (``rounds_ms``; evaluation/speed_stats.py, from 4 rounds). The variants are timed in
   ``speed_stats.round_order``: reversed every other round, so an even ``--rounds`` (4 or 6) times every pair once
   each way round (since s49; a fixed order read the second of two identical kernels 2-5 % slower at 64K).

3. --variants: extra Gluon kernels, checked and timed beside ``gluon`` under their own names
   (EXTRA_VARIANTS: ``gluon_ws``, the warp-specialized kernel of prefill_gluon_ws.py at its default
   form per head dim; ``gluon_ws_prod`` / ``gluon_ws_inline`` force the producer warp on / off;
   ``gluon_pair``, two query blocks a program of prefill_gluon_pair.py, D = 64 only, ``gluon_pair_b6``
   the same with 6 ring slots, ``gluon_pair_two`` the same deciding two tiles in one exchange (what
   ``prefill_pick`` ran for D = 64 BSFA calls expected to skip until s47); ``gluon_ws_c1`` / ``gluon_pair_two_c1``
   / ``gluon_ws_c4``: the grid one head after the other, or 4 heads side by side, at every
   length (the default puts heads side by side at short ones, ``prefill_gluon_ws.grid_chunk``);
   ``gluon_ws_vote`` / ``gluon_ws_redbar``: the ws kernel's warpgroups agreeing by votes and an
   mbarrier, or at one barrier with an OR (``meet`` 0 / 2; the default per head dim is
   ``prefill_gluon_ws.MEET``); ``gluon_ws_late`` / ``gluon_ws_early`` (D = 128): the copies under the wgmma in
   every call, or in none (the default: dense calls only, ``prefill_gluon_ws.late_for``); ``gluon_ws_redbar_late``
   (D = 128): both, the barrier with an OR and the copies under the wgmma in every call. Every
   Gluon row records ``build_regs`` / ``build_spills`` as compiled on the GPU machine. A variant whose
   check fails is still timed (its rows say ``check_ok``: false); one whose check
   raised is left out of the timings (``check.variants[name].error``); neither stops the others.

    python -m sparsecal.bench.prefill_gluon [--sections check,targets] [--dims 128,64]
        [--lengths 16384,32768,65536] [--groups 1,4,8] [--rounds 2] [--variants gluon_ws,...] --out FILE
"""
from __future__ import annotations

import argparse
import functools
import math
import statistics

import torch

from sparsecal.bench.harness import log, result_file, run_section
from sparsecal.bench.sparse import BM, BN, HEADS, SPARSITIES, ideal, round_robin_times
from sparsecal.bench.sparse_inputs import blasst_log_lambda_for, bsfa_thresholds_for, structured_qkv, tile_stats
from sparsecal.evaluation.speed_stats import ROUND_ORDER
from sparsecal.kernels.dense import attention_dense, flops_causal
from sparsecal.kernels.jit import LAST_COMPILED
from sparsecal.kernels.sparse.prefill import candidate_tiles, sparse_attention_triton
from sparsecal.kernels.sparse.prefill_gluon import sparse_attention_gluon
from sparsecal.kernels.sparse.prefill_gluon_pair import sparse_attention_gluon_pair
from sparsecal.kernels.sparse.prefill_gluon_ws import sparse_attention_gluon_ws
from sparsecal.kernels.sparse.reference import sparse_attention

TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (N, Hkv, G, D, dtype, batch, transposed storage)
CHECK_CASES = ((1000, 2, 4, 128, torch.bfloat16, 1, False), (777, 1, 8, 64, torch.float16, 1, True),
               (1300, 3, 1, 64, torch.bfloat16, 2, False), (640, 2, 4, 128, torch.float16, 1, True),
               (2049, 1, 4, 128, torch.bfloat16, 1, True), (1500, 2, 4, 64, torch.bfloat16, 1, False))
# Extra Gluon kernels (--variants): name -> callable with sparse_attention_gluon's arguments and results.
EXTRA_VARIANTS = {"gluon_ws": sparse_attention_gluon_ws,
                  "gluon_ws_prod": functools.partial(sparse_attention_gluon_ws, producer=True),
                  "gluon_ws_inline": functools.partial(sparse_attention_gluon_ws, producer=False),
                  "gluon_pair": sparse_attention_gluon_pair,
                  "gluon_pair_b6": functools.partial(sparse_attention_gluon_pair, nbuf=6),
                  "gluon_pair_two": functools.partial(sparse_attention_gluon_pair, two=True),
                  "gluon_ws_c1": functools.partial(sparse_attention_gluon_ws, chunk=1),
                  "gluon_pair_two_c1": functools.partial(sparse_attention_gluon_pair, two=True, chunk=1),
                  "gluon_ws_c4": functools.partial(sparse_attention_gluon_ws, chunk=4),
                  "gluon_ws_vote": functools.partial(sparse_attention_gluon_ws, meet=0),
                  "gluon_ws_redbar": functools.partial(sparse_attention_gluon_ws, meet=2),
                  "gluon_ws_late": functools.partial(sparse_attention_gluon_ws, late=True),
                  "gluon_ws_early": functools.partial(sparse_attention_gluon_ws, late=False),
                  "gluon_ws_redbar_late": functools.partial(sparse_attention_gluon_ws, meet=2, late=True)}
VARIANT_DIMS = {"gluon_pair": (64,), "gluon_pair_b6": (64,), "gluon_pair_two": (64,),
                "gluon_pair_two_c1": (64,), "gluon_ws_late": (128,),
                "gluon_ws_early": (128,), "gluon_ws_redbar_late": (128,)}  # head dims a variant takes (others: every dim the Gluon kernels take)


def takes(name: str, d: int) -> bool:
    """Whether kernel ``name`` takes head dim d (its check cases and timed shapes are those)."""
    return d in VARIANT_DIMS.get(name, (d,))


def _storage(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """t [B, H, N, D] as a view of [B, N, H, D] storage when ``transposed`` (what sparsify passes)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2) if transposed else t.contiguous()


def _check_shape(kern, n, kv, group, d, dtype, batch, transposed) -> list[dict]:
    """Rows of one check shape for kernel ``kern``: dense, BSFA, BLASST and window against the reference."""
    q, k, v = structured_qkv(n, d, kv * group, kv, seed=n + d, dtype=dtype, batch=batch)
    q, k, v = (_storage(t, transposed) for t in (q, k, v))
    scale = d ** -0.5
    bmax, gap = tile_stats(q[:1], k[:1], v[:1], scale, BM, BN)
    cases = [{"dense": True}, {"thresholds": bsfa_thresholds_for(bmax, n, BM, BN, 0.5)},
             {"log_lambda": blasst_log_lambda_for(gap, n, BM, BN, 0.5)}, {"window": 2}]
    rows = []
    for kw in cases:
        got, sk = kern(q, k, v, scale, BM, BN, **kw)
        ref_kw = dict(kw, log_lambda=-math.inf) if "dense" in kw else kw
        ref_kw.pop("dense", None)
        errs, same = [], True
        for i in range(batch):
            want, c = sparse_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], scale, BM, BN, **ref_kw)
            errs.append(float((got[i:i + 1].double() - want.double()).abs().max()))
            same &= "dense" in kw or bool(torch.equal(sk[i].cpu(), c.skipped.cpu()))
        err = max(errs)
        rows.append({"n": n, "d": d, "group": group, "dtype": str(dtype), "batch": batch, "transposed": transposed,
                     "method": min(kw), "max_abs_err": err, "skip_counts_equal": same,
                     "skipped": int(sk.sum()), "ok": bool(err < TOL[dtype] and same)})
    return rows


def check_gluon(extra: tuple = ()) -> dict:
    """The Gluon kernel (``ok``, ``rows``) and each extra variant (``variants[name]``: ok, error, rows)
    against the reference; an extra variant that raises is recorded, not propagated."""
    out = {"ok": True, "rows": [], "variants": {}}
    for name in ("gluon", *extra):
        kern = sparse_attention_gluon if name == "gluon" else EXTRA_VARIANTS[name]
        rows, error = [], None
        for case in (c for c in CHECK_CASES if takes(name, c[3])):
            try:
                got = _check_shape(kern, *case)
            except Exception as e:  # an extra variant's failure must not stop the run
                if name == "gluon":
                    raise
                error = f"{type(e).__name__}: {e}"[:2000]
                log(f"{name} check n={case[0]} d={case[3]} FAILED: {error}")
                break
            rows += [dict(r, kernel=name) for r in got]
            log(f"{name} check n={case[0]} d={case[3]} G={case[2]} {case[4]} B={case[5]} transposed={case[6]}: "
                + ", ".join(f"{r['method']} {r['max_abs_err']:.1e}{'' if r['skip_counts_equal'] else ' COUNTS DIFFER'}"
                            for r in got))
        ok = error is None and all(r["ok"] for r in rows)
        if name == "gluon":
            out.update(ok=ok, rows=rows)
        else:
            out["variants"][name] = {"ok": ok, "error": error, "rows": rows}
    return out


def _variants(q, k, v, d: int, n: int, extra: dict) -> dict:
    """name -> (callable, kernel-counted sparsity or None, info); extra: name -> (kernel, info) of the
    --variants timed beside ``gluon``."""
    from sparsecal.bench.harness import sdpa_fns

    scale = d ** -0.5
    bmax, gap = tile_stats(q, k, v, scale, BM, BN)
    reach = candidate_tiles(n, BM, BN)[1] * q.shape[1]
    out = torch.empty_like(q)
    variants = {"dense_triton": (lambda: attention_dense(q, k, v, scale, out=out), None, {}),
                "triton_off": (lambda: sparse_attention_triton(q, k, v, scale, BM, BN, dense=True, out=out), 0.0, {})}
    gluons = {"gluon": (sparse_attention_gluon, {}), **extra}
    for gname, (kern, info) in gluons.items():
        kern(q, k, v, scale, BM, BN, dense=True, out=out)
        variants[f"{gname}_off"] = (lambda kern=kern: kern(q, k, v, scale, BM, BN, dense=True, out=out), 0.0,
                                    {**info, **_build()})
    for name, (fn, mode) in sdpa_fns(q, k, v)[0].items():
        variants[name] = (fn, None, {"gqa": mode})
    kernels = {"triton": (sparse_attention_triton, {}), **gluons}
    for s in SPARSITIES:
        points = {"bsfa": {"thresholds": bsfa_thresholds_for(bmax, n, BM, BN, s)},
                  "blasst": {"log_lambda": blasst_log_lambda_for(gap, n, BM, BN, s)}}
        for method, kw in points.items():
            for kname, (kern, info) in kernels.items():
                _, sk = kern(q, k, v, scale, BM, BN, out=out, **kw)
                build = _build() if kname != "triton" else {}

                def fn(kern=kern, kw=kw):
                    return kern(q, k, v, scale, BM, BN, out=out, **kw)

                variants[f"{kname}_{method}_s{int(s * 100)}"] = (fn, float(sk.sum()) / reach,
                                                                {"target": s, **info, **build})
    return variants


def _build() -> dict:
    """The last Gluon launch's build on this machine's compiler: registers a thread and its local
    memory (spills) in 4-byte words, as the driver reports it (``build_regs``, ``build_spills``; what a
    CPU build with another Triton cannot tell; ptxas -v's spill counts are bytes of stores and loads)."""
    c = LAST_COMPILED.get("gluon")
    return {} if c is None else {"build_regs": int(c.n_regs), "build_spills": int(c.n_spills)}


def _ratio(times: dict, base: str, name: str, over: float = 1.0) -> tuple:
    """(median ratio base / name, lo, hi) / ``over``: lo and hi the exact 95% interval of the two
    variants' rounds (evaluation.speed_stats.ratio_interval; None below 4 rounds)."""
    from sparsecal.evaluation.speed_stats import ratio_interval

    ci = ratio_interval(times[base], times[name])
    return tuple(None if x is None else x / over for x in (ci["median_ratio"], ci["lo"], ci["hi"]))


def baselines(ms: dict) -> tuple[str, str, str]:
    """(best SDPA, the project's fastest dense kernel in this run: dense Triton or any Gluon kernel
    with skipping off, the faster of the two) from the variants' median ms."""
    sdpa = min((x for x in ms if x.startswith("sdpa")), key=ms.get)
    dense = min(["dense_triton"] + [x for x in ms if x.startswith("gluon") and x.endswith("_off")], key=ms.get)
    return sdpa, dense, min((sdpa, dense), key=ms.get)


def target_row(name: str, times: dict, sp: float | None, info: dict, n: int, d: int, base: tuple | None = None,
               ms: dict | None = None) -> dict:
    """One variant's row of a targets shape from every variant's round times (name -> ms per round):
    against the best SDPA (``vs_sdpa``), the project's fastest dense kernel (``vs_dense``,
    ``of_ideal``) and the faster of the two (``of_ideal_best``: the issue's "against the best dense
    kernel"), each with ``_lo``/``_hi``, its rounds' exact 95% interval; ``base`` (``baselines``)
    and ``ms`` (the variants' medians) of the shape when the caller has them."""
    ms = ms or {x: statistics.median(t) for x, t in times.items()}
    sdpa, dense, best = base or baselines(ms)
    row = {"variant": name, "ms": ms[name], "rounds_ms": times[name], "tflops": flops_causal(1, HEADS, n, d) / ms[name] / 1e9,
           "vs_dense_triton": ms["dense_triton"] / ms[name], **info}
    row["vs_sdpa"], row["vs_sdpa_lo"], row["vs_sdpa_hi"] = _ratio(times, sdpa, name)
    if sp is not None:
        row.update(sparsity=sp, ideal=ideal(sp))
        row["vs_dense"], row["vs_dense_lo"], row["vs_dense_hi"] = _ratio(times, dense, name)
        row["of_ideal"], row["of_ideal_lo"], row["of_ideal_hi"] = _ratio(times, dense, name, ideal(sp))
        row["of_ideal_best"], row["of_ideal_best_lo"], row["of_ideal_best_hi"] = _ratio(times, best, name, ideal(sp))
    return row


def targets_shape(d: int, n: int, group: int, rounds: int, extra: dict | None = None) -> dict:
    q, k, v = structured_qkv(n, d, HEADS, HEADS // group, seed=n + d + group)
    variants = _variants(q, k, v, d, n, {x: e for x, e in (extra or {}).items() if takes(x, d)})
    times = round_robin_times(variants, rounds)
    ms = {name: statistics.median(t) for name, t in times.items()}
    base = baselines(ms)
    sdpa, dense_name = ms[base[0]], base[1]
    dense = ms[dense_name]
    rows = [target_row(name, times, sp, info, n, d, base, ms) for name, (_, sp, info) in variants.items()]
    del q, k, v
    torch.cuda.empty_cache()
    log(f"D={d} N={n} G={group}: sdpa {sdpa:.3f} ms, dense {dense_name} {dense:.3f}, "
        + ", ".join(f"{r['variant']} {r['ms']:.3f}" for r in rows if r["variant"].startswith(("gluon", "triton"))))
    return {"d": d, "n": n, "group": group, "heads": HEADS, "best_sdpa_ms": sdpa, "dense_ms": dense,
            "dense_variant": dense_name, "rows": rows}


def _extra_for_timing(result: dict, names: list[str]) -> dict:
    """name -> (kernel, info) of the --variants to time: all of them, less those whose check raised."""
    checked = result.get("check", {}).get("variants", {})
    extra = {}
    for name in names:
        rec = checked.get(name)
        if rec is not None and rec["error"] is not None:
            log(f"{name}: left out of the timings, its check raised ({rec['error'][:200]})")
            continue
        extra[name] = (EXTRA_VARIANTS[name], {} if rec is None else {"check_ok": rec["ok"]})
    return extra


def _run_shape(result: dict, save, d: int, n: int, g: int, rounds: int, extra: dict) -> None:
    """One targets shape; when it fails with extra variants, again without them (the error is recorded)."""
    run_section(result, "_shape", lambda: targets_shape(d, n, g, rounds, extra), save)
    if "_shape" not in result and extra:
        log(f"D={d} N={n} G={g}: again without {', '.join(extra)}")
        result.setdefault("errors", {})[f"_shape_extra_d{d}_n{n}_g{g}"] = result["errors"].pop("_shape", None)
        run_section(result, "_shape", lambda: targets_shape(d, n, g, rounds, {}), save)
    if "_shape" in result:
        result["targets"].append(result.pop("_shape"))
    save()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparsecal.bench.prefill_gluon")
    ap.add_argument("--sections", default="check,targets")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--lengths", default="16384,32768,65536")
    ap.add_argument("--groups", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="", help=f"extra kernels, comma-separated: {', '.join(EXTRA_VARIANTS)}")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    names = [x for x in args.variants.split(",") if x]
    unknown = [x for x in names if x not in EXTRA_VARIANTS]
    if unknown:
        ap.error(f"unknown --variants {', '.join(unknown)} (known: {', '.join(EXTRA_VARIANTS)})")
    result, save = result_file("prefill_gluon", args.out, args.commit)
    result["variants"] = names
    result["round_order"] = ROUND_ORDER  # files without it (before s49) timed every round in one fixed order
    if "check" in sections:
        run_section(result, "check", lambda: check_gluon(tuple(names)), save)
        log(f"gluon check ok: {result.get('check', {}).get('ok')}; "
            + ", ".join(f"{k} ok: {v['ok']}" for k, v in result.get("check", {}).get("variants", {}).items()))
    if "targets" in sections:
        result["targets"] = []
        extra = _extra_for_timing(result, names)
        for d in (int(x) for x in args.dims.split(",")):
            for n in (int(x) for x in args.lengths.split(",")):
                for g in (int(x) for x in args.groups.split(",")):
                    _run_shape(result, save, d, n, g, args.rounds, extra)


if __name__ == "__main__":
    main()
