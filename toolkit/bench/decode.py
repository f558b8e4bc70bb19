"""Decode benchmark, in one run on one GPU: the split-K decode of kernels/sparse/decode.py ("old")
against the group kernel of kernels/sparse/decode_group.py and the best SDPA.

1. check: every kernel against the plain-torch reference on small inputs (contiguous one length,
   ragged lengths, a paged cache; per-head and group decision; BSFA, BLASST, top-k, dense);
2. per shape (B=16, H=32 query heads, G 1/4/8, D 64/128, 16K/32K/64K cached tokens; inputs with
   sinks, local windows and heavy hitters, as bench/sparse_inputs.structured_qkv, made for the
   decode row only), round-robin medians of
     sdpa_{flash,efficient,cudnn}_{native,expanded}  GQA by enable_gqa or repeat_interleave
     old_dense, old_blasst_s50/s75                   decode.py (gather schedule)
     group_dense                                     decode_group.py, skipping off
     group_{bsfa,blasst}_{head,group}_s50/s75        per-head / group decision
   at operating points found by bisection on the kernel's own skip counts (share of reachable
   tiles per head skipped: BLASST's ln(lambda); BSFA's per-head quantile of the candidate tile
   maxima), each also as CUDA-graph replays. Sparse rows carry the counted sparsity, the group V-skip
   share from the kernel's counters (tiles every head of a group skips / tiles), the ideal
   1 / (1 - v/2) from it (a skipped tile saves its V load: half of its K + V bytes), speedups over
   the best SDPA (eager and graph: each against the SDPA backend fastest that way) and the share of
   the ideal reached (``of_ideal`` eager, ``graph_of_ideal`` device time); one row of each sparse
   output is checked against the reference. Graph replays are timed in the same rounds as the
   eager calls (captured anew each round); every speedup carries the exact distribution-free 95%
   interval of its rounds against the best SDPA's (``_lo``/``_hi``, evaluation/speed_stats.py; from
   4 rounds: --rounds 5 for the targets). Group-kernel rows record their main kernel's registers,
   spills and shared memory as the device's Triton built it (``compiled``).

    python -m sparsecal.bench.decode [--dims 128,64] [--groups 1,4,8] [--lengths 16384,32768,65536]
        [--batch 16] [--rounds 3] [--out data/bench/decode-h100.json]
    TRITON_INTERPRET=1 python -m sparsecal.bench.decode --quick   # CPU, tiny shapes (a test runs it)
    python -m sparsecal.bench.decode --sweep [...]   # launch sweep of the group kernel (bench/decode_sweep.py)
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from sparsecal.bench.decode_inputs import (
    BM,
    BN,
    HEADS,
    SPARSITIES,
    TOL,
    bisect,
    bsfa_at,
    counted,
    decode_qkv,
    sdpa_variants,
)
from sparsecal.bench.decode_sweep import run as run_sweep
from sparsecal.bench.harness import compiled_info, graph_replay, log, run_cli
from sparsecal.evaluation.speed_stats import ROUND_ORDER, round_order
from sparsecal.formats.errors import UserError
from sparsecal.formats.files import atomic_write_text
from sparsecal.formats.provenance import provenance
from sparsecal.kernels.jit import interpreting
from sparsecal.kernels.sparse.decode import sparse_decode_triton
from sparsecal.kernels.sparse.decode_group import decode_tile_maxima, group_decode_triton
from sparsecal.kernels.sparse.reference import sparse_decode, sparse_decode_ragged


def operating_points(q, k, v, scale: float, decision: str, old: bool = False) -> dict:
    """{(method, s): method kwargs} bisected on the kernel's own counts (old: decode.py, BLASST only)."""
    length = k.shape[2]
    pts = {}
    for s in SPARSITIES:
        if old:
            ll = bisect(lambda x: counted(sparse_decode_triton(q, k, v, scale, BM, BN, log_lambda=x)[1],
                                          torch.zeros(1), length)[0], -40.0, 0.0, s)
            pts[("blasst", s)] = {"log_lambda": ll}
            continue
        ll = bisect(lambda x: counted(*group_decode_triton(q, k, v, scale, BM, BN, log_lambda=x, decision=decision)[1:],
                                      length)[0], -40.0, 0.0, s)
        tmax = decode_tile_maxima(q, k, scale, BN)
        p = bisect(lambda x, tmax=tmax: counted(*group_decode_triton(q, k, v, scale, BM, BN, thresholds=bsfa_at(tmax, length, x),
                                                          decision=decision)[1:], length)[0], 0.0, 1.0, s)
        pts[("blasst", s)] = {"log_lambda": ll}
        pts[("bsfa", s)] = {"thresholds": bsfa_at(tmax, length, p)}
    return pts


def time_ms(fn, quick: bool) -> float:
    """Median ms of fn: triton's do_bench (L2 flushed) on a GPU; wall clock of one call in --quick."""
    if quick:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton

    return float(triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median"))


def graph_ms(fn) -> float | str:
    """Median ms of replaying fn captured as a CUDA graph (device time without launch overheads),
    or why it could not be captured."""
    import triton

    try:
        fn()
        return float(triton.testing.do_bench(graph_replay(fn), warmup=10, rep=60, return_mode="median"))
    except Exception as e:  # noqa: BLE001  (a variant with a host sync, torch-made masks, cannot be captured)
        return f"not captured: {type(e).__name__}: {str(e)[:160]}"


def shape_variants(q, k, v, quick: bool) -> dict:
    """name -> (fn, info). Operating points bisected here on each kernel's own counts."""
    scale = q.shape[-1] ** -0.5
    variants = {} if quick else {n: (fn, {}) for n, fn in sdpa_variants(q, k, v).items()}
    variants["old_dense"] = (lambda: sparse_decode_triton(q, k, v, scale, BM, BN, dense=True), {})
    variants["group_dense"] = (lambda: group_decode_triton(q, k, v, scale, BM, BN, dense=True), {})
    for (method, s), kw in operating_points(q, k, v, scale, "head", old=True).items():
        variants[f"old_{method}_s{int(s * 100)}"] = (
            lambda kw=kw: sparse_decode_triton(q, k, v, scale, BM, BN, **kw), {"kw": kw, "target": s})
    for decision in ("head", "group"):
        for (method, s), kw in operating_points(q, k, v, scale, decision).items():
            variants[f"group_{method}_{decision}_s{int(s * 100)}"] = (
                lambda kw=kw, decision=decision: group_decode_triton(q, k, v, scale, BM, BN, decision=decision, **kw),
                {"kw": kw, "target": s, "decision": decision})
    return variants


def describe(name: str, fn, info: dict, q, k, v) -> dict:
    """A sparse variant's counted sparsity and group V-skip share (its own counters) and the
    largest error of its first batch row against the reference."""
    length = k.shape[2]
    scale = q.shape[-1] ** -0.5
    kw = info.get("kw")
    out = {"variant": name}
    if kw is None:
        return out
    res = fn()
    if name.startswith("old_"):
        sk = res[1]
        tmax = decode_tile_maxima(q, k, scale, BN)  # the old kernel has no group counter: from its decision
        from sparsecal.kernels.sparse.decode import decode_skip_mask

        mask = decode_skip_mask(tmax * 1.4426950408889634, length, BM, BN, **kw)
        vsk = mask.view(q.shape[0], k.shape[1], -1, mask.shape[-1]).all(2).sum(-1)
        out["v_skip_from"] = "decision mask (decode.py keeps no group counter)"
    else:
        sk, vsk = res[1], res[2]
    out["sparsity"], out["v_skip"] = counted(sk, vsk, length)
    out["ideal"] = 1.0 / (1.0 - out["v_skip"] / 2.0)
    want, _ = sparse_decode(q[:1], k[:1], v[:1], scale, BM, BN, decision=info.get("decision", "head"), **kw)
    out["err_row0"] = float((res[0][:1].double() - want.double()).abs().max())
    out.update({x: (y if not torch.is_tensor(y) else y.flatten()[:4].tolist()) for x, y in kw.items()})
    out.update(target=info["target"], decision=info.get("decision", "head"))
    return out


def timed_rounds(variants: dict, rounds: int, quick: bool) -> tuple[dict, dict]:
    """(eager, graph): name -> ms per round, round-robin over the variants (``speed_stats.round_order``), each
    round timing every variant's call and (on a GPU) its call captured in a CUDA graph and replayed
    (graph_ms: captured anew each round and freed after, so no two variants' graph memory is held at
    once; where the capture fails, its reason in place of the list)."""
    eager = {name: [] for name in variants}
    graph = {} if quick else {name: [] for name in variants}
    for r in range(rounds):
        for name in round_order(variants, r):
            fn = variants[name][0]
            eager[name].append(time_ms(fn, quick))
            if isinstance(graph.get(name), list):
                got = graph_ms(fn)
                graph[name] = graph[name] + [got] if isinstance(got, float) else got
    return eager, graph


def speedups(row: dict, eager: list, graph, best_eager: list, best_graph) -> dict:
    """``row`` with its speedups over the best SDPA (ratios of medians), each with the exact 95%
    interval of its rounds (evaluation.speed_stats.ratio_interval; lo and hi None below 4 rounds)."""
    from sparsecal.evaluation.speed_stats import ratio_interval

    pairs = [("speedup_vs_sdpa", best_eager, eager)]
    if isinstance(graph, list) and graph and isinstance(best_graph, list) and best_graph:
        pairs.append(("graph_speedup_vs_sdpa", best_graph, graph))
    for key, base, mine in pairs:
        ci = ratio_interval(base, mine)
        row[key], row[f"{key}_lo"], row[f"{key}_hi"] = ci["median_ratio"], ci["lo"], ci["hi"]
    return row


def _compiled(name: str, fn, quick: bool) -> dict:
    """{"compiled": registers, spills, shared memory} of a group-kernel variant's main kernel as the
    device's Triton built it (its last launch: ``fn`` is run once more), {} for the others and on
    the CPU."""
    kernel = "group_dense" if name == "group_dense" else "group_attend" if name.startswith("group_") else None
    if quick or kernel is None:
        return {}
    fn()
    return {"compiled": compiled_info(kernel)}


def fastest_sdpa(rounds: dict) -> str | None:
    """The SDPA variant with the lowest median of its rounds (name -> ms per round; a capture error
    in place of the list is left out), None without one."""
    med = {n: statistics.median(t) for n, t in rounds.items() if n.startswith("sdpa") and isinstance(t, list) and t}
    return min(med, key=med.get) if med else None


def decode_shape(d: int, group: int, batch: int, length: int, rounds: int, quick: bool, device) -> dict:
    """Every variant of one shape, round-robin, eager calls and (on a GPU) graph replays."""
    q, k, v = decode_qkv(batch, length, d, group, seed=length + 7 * group + d, dtype=torch.bfloat16, device=device,
                         heads=HEADS if not quick else 4)
    variants = shape_variants(q, k, v, quick)
    times, graphs = timed_rounds(variants, rounds, quick)
    ms = {name: statistics.median(t) for name, t in times.items()}
    has_sdpa = any(n.startswith("sdpa") for n in ms)
    best = fastest_sdpa(times) or "old_dense"
    best_graph = fastest_sdpa(graphs) or best   # graph speedups against the SDPA fastest as a graph
    rows = []
    for name, (fn, info) in variants.items():
        g = graphs.get(name)
        row = describe(name, fn, info, q, k, v) | _compiled(name, fn, quick) | {
            "ms": ms[name], "rounds_ms": times[name], "graph_rounds_ms": g if isinstance(g, list) else None,
            "graph_ms": statistics.median(g) if isinstance(g, list) and g else g}
        row = speedups(row, times[name], g, times[best], graphs.get(best_graph))
        if "ideal" in row:
            row["of_ideal"] = row["speedup_vs_sdpa"] / row["ideal"]
            row["of_ideal_vs_group_dense"] = ms["group_dense"] / ms[name] / row["ideal"]
            for key in ("", "_lo", "_hi"):   # the share of the ideal in device time, with its interval
                x = row.get(f"graph_speedup_vs_sdpa{key}")
                if x is not None:
                    row[f"graph_of_ideal{key}"] = x / row["ideal"]
        rows.append(row)
    dense_err = None
    if has_sdpa:
        dense_err = float((variants["group_dense"][0]()[0].double() - variants[best][0]().double()).abs().max())
    del q, k, v, variants
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"d": d, "group": group, "batch": batch, "length": length, "heads": HEADS, "best_sdpa": best,
            "best_sdpa_graph": best_graph, "group_dense_vs_best_sdpa_max_err": dense_err, "rows": rows}


def check_cases(device, quick: bool) -> dict:
    """Old and group kernels against the reference: contiguous (one length), ragged and paged."""
    rows, ok = [], True
    cases = [(2, 300, 4, 1, 64, torch.float16), (3, 333, 8, 2, 128, torch.bfloat16)]
    for b, length, h, hkv, d, dtype in cases[:1] if quick else cases:
        q, k, v = decode_qkv(b, length, d, h // hkv, seed=length, dtype=dtype, device=device, heads=h)
        scale, bm, bn = d ** -0.5, 64, 32
        tmax = decode_tile_maxima(q, k, scale, bn)
        # midway between the two middle tile maxima, not at one of them: a threshold equal to a tile's
        # maximum is a tie that the kernels' and the reference's rounding break differently
        srt = tmax[:, :, : (length - 1) // bn].amax(0).sort(dim=-1).values
        thr = (srt[:, srt.shape[-1] // 2 - 1: srt.shape[-1] // 2 + 1].mean(dim=-1, keepdim=True))
        lens = torch.tensor([length - 17 * i for i in range(b)], dtype=torch.int32, device=device)
        pages = -(-length // 64)
        table = torch.randperm(b * pages, device=device).view(b, pages).int()
        kp = k.view(b, hkv, pages, 64, d).transpose(1, 2).reshape(b * pages, hkv, 64, d) if length % 64 == 0 else None
        for kw in ({"log_lambda": -3.0}, {"thresholds": thr}, {"topk": 3}, {"dense": True}):
            ref_kw = {"log_lambda": -math.inf} if "dense" in kw else kw
            for decision in ("head", "group"):
                want, c = sparse_decode(q, k, v, scale, bm, bn, decision=decision, **ref_kw)
                got, sk, vsk = group_decode_triton(q, k, v, scale, bm, bn, decision=decision, **kw)
                rows.append(_check_row("group", kw, decision, got, want, torch.equal(sk.sum(0), c.skipped)
                                       and torch.equal(vsk.sum(0), c.v_skipped), dtype))
                want, rs, rv, _ = sparse_decode_ragged(q, k, v, lens, scale, bm, bn, decision=decision, **ref_kw)
                got, sk, vsk = group_decode_triton(q, k, v, scale, bm, bn, lengths=lens, decision=decision, **kw)
                rows.append(_check_row("ragged", kw, decision, got, want, torch.equal(sk, rs) and torch.equal(vsk, rv),
                                       dtype))
            if "dense" not in kw and "topk" not in kw:
                want, c = sparse_decode(q, k, v, scale, bm, bn, **kw)
                got, sk = sparse_decode_triton(q, k, v, scale, bm, bn, **kw)
                rows.append(_check_row("old", kw, "head", got, want, torch.equal(sk.sum(0), c.skipped), dtype))
        del kp, table
        ok &= all(r["ok"] for r in rows)
        log(f"check B={b} L={length} H={h} Hkv={hkv} D={d} {dtype}: "
            + ("ok" if ok else "FAILED " + str([r for r in rows if not r["ok"]][:3])))
    rows += check_paged(device)
    return {"ok": bool(ok and all(r["ok"] for r in rows)), "rows": rows}


def check_paged(device) -> list:
    """A paged ragged batch (lengths 1, awkward, a multiple of the page, longer) against the reference."""
    h, hkv, d, page, dtype = 8, 2, 64, 64, torch.float16
    lens = [1, 77, 128, 333]
    q, k, v = decode_qkv(len(lens), max(lens), d, h // hkv, seed=5, dtype=dtype, device=device, heads=h)
    n_pages = [-(-n // page) for n in lens]
    pool_k = torch.zeros(sum(n_pages) + 2, hkv, page, d, dtype=dtype, device=device)
    pool_v = torch.zeros_like(pool_k)
    table = torch.full((len(lens), max(n_pages)), -1, dtype=torch.int32, device=device)
    order = torch.randperm(pool_k.shape[0], device=device)
    at = 0
    for i, n in enumerate(n_pages):
        for j in range(n):
            p = int(order[at])
            table[i, j] = p
            seg = slice(j * page, min((j + 1) * page, lens[i]))
            pool_k[p, :, : seg.stop - seg.start] = k[i, :, seg]
            pool_v[p, :, : seg.stop - seg.start] = v[i, :, seg]
            at += 1
    lt = torch.tensor(lens, dtype=torch.int32, device=device)
    rows = []
    for kw, decision in (({"log_lambda": -3.0}, "group"), ({"topk": 2}, "head"), ({"window": 2}, "head")):
        want, rs, rv, _ = sparse_decode_ragged(q, pool_k, pool_v, lt, d ** -0.5, 64, 32, block_table=table,
                                               decision=decision, **kw)
        got, sk, vsk = group_decode_triton(q, pool_k, pool_v, d ** -0.5, 64, 32, lengths=lt, block_table=table,
                                           decision=decision, **kw)
        rows.append(_check_row("paged", kw, decision, got, want, torch.equal(sk, rs) and torch.equal(vsk, rv), dtype))
    return rows


def _check_row(kernel: str, kw: dict, decision: str, got, want, counts_equal: bool, dtype) -> dict:
    err = float((got.double() - want.double()).abs().max())
    return {"kernel": kernel, "method": min(kw), "decision": decision, "dtype": str(dtype), "max_abs_err": err,
            "counts_equal": bool(counts_equal), "ok": bool(counts_equal and err < TOL[dtype])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparsecal.bench.decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--groups", default="1,4,8")
    ap.add_argument("--lengths", default="16384,32768,65536")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument("--sweep", action="store_true", help="time every candidate launch of the group kernel per shape "
                    "(bench/decode_sweep.py) and write the winning table")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    quick = args.quick
    if quick and not interpreting():
        raise UserError("--quick runs the kernels on the CPU: set TRITON_INTERPRET=1 before starting Python.")
    if not quick and not torch.cuda.is_available():
        raise UserError("the decode benchmark needs a CUDA GPU; --quick (with TRITON_INTERPRET=1) runs tiny shapes on the CPU.")
    device = "cpu" if quick else "cuda"
    if args.sweep:
        out = args.out or Path("data/bench/decode-sweep-cpu-quick.json" if quick else "data/bench/decode-sweep-h100.json")
        run_sweep(args, device, quick, out)
        log(f"wrote {out}")
        return
    if quick:
        dims, groups, lengths, batch, rounds = [64], [4], [200], 1, 1
    else:
        dims, groups, lengths = ([int(x) for x in a.split(",")] for a in (args.dims, args.groups, args.lengths))
        batch, rounds = args.batch, args.rounds
    out = args.out or Path("data/bench/decode-cpu-quick.json" if quick else "data/bench/decode-h100.json")
    result = {"benchmark": "decode", "provenance": provenance(), "args": vars(args) | {"out": str(out)},
              "geometry": {"block_m": BM, "block_n": BN, "heads": HEADS}, "round_order": ROUND_ORDER}

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=1, default=str))

    result["check"] = check_cases(device, quick)
    log(f"check: {'ok' if result['check']['ok'] else 'FAILED'}")
    save()
    result["shapes"] = []
    for d in dims:
        for g in groups:
            for n in lengths:
                log(f"decode D={d} G={g} L={n} B={batch}")
                try:
                    result["shapes"].append(decode_shape(d, g, batch, n, rounds, quick, device))
                    log(summary(result["shapes"][-1]))
                except Exception as e:  # noqa: BLE001  (a shape that fails is recorded and the run goes on)
                    result["shapes"].append({"d": d, "group": g, "length": n, "error": f"{type(e).__name__}: {e}"[:500]})
                    log(f"  FAILED {result['shapes'][-1]['error']}")
                save()
    save()
    log(f"wrote {out}")


def summary(shape: dict) -> str:
    """One line per variant: ms, graph ms, speedup over the best SDPA, sparsity, V-skip, of ideal."""
    lines = [f"  best sdpa {shape['best_sdpa']}"]
    for r in shape["rows"]:
        extra = (f" s={r['sparsity']:.2f} v_skip={r['v_skip']:.2f} ideal={r['ideal']:.2f} of_ideal={r['of_ideal']:.2f}"
                 if "sparsity" in r else "")
        g = f"{r['graph_ms']:.3f}" if isinstance(r.get("graph_ms"), float) else "-"
        if r.get("graph_speedup_vs_sdpa_lo") is not None:
            g += f" x{r['graph_speedup_vs_sdpa']:.3f} [{r['graph_speedup_vs_sdpa_lo']:.3f}, {r['graph_speedup_vs_sdpa_hi']:.3f}]"
        lines.append(f"  {r['variant']:<28} {r['ms']:.3f} ms (graph {g}) x{r['speedup_vs_sdpa']:.2f} vs sdpa{extra}")
    return "\n".join(lines)


if __name__ == "__main__":
    run_cli(main)
