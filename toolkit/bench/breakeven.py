"""``sparsecal bench break-even``: where the sparse prefill and decode kernels pay on this GPU, for a run's model.

Per length (the run's calibrated lengths, or ``--lengths``) and method (bsfa, blasst): structured
inputs at the run's geometry (B = 1, the model's H, Hkv, D, bf16; bench/sparse_inputs.structured_qkv),
the time of one layer's causal prefill attention by each SDPA backend (cuDNN, FLASH;
bench/harness.sdpa_fns) and by the project's sparse prefill kernel
(kernels.sparse.prefill_pick.sparse_prefill, the kernel sparsify runs, at the run's BM x BN, with the
operating point as its expected sparsity) at each ``--sparsities`` operating point, read from the
input's own tile statistics as bench/sparse.py's prefill_variants does; each point records the
sparsity the kernel counted. Times (``--timings``): ``eager``, medians over ``--rounds`` round-robin
rounds of bench_ms (one launch per call, host cost included); ``graph``, the median of replaying
each call captured as a CUDA graph (device time: what a deployment replaying graphs pays; a call
that cannot be captured is left out, said on stderr). Decode (``--phases ...,decode``):
bench/breakeven_decode.py, one decode step of ``--decode-batch`` rows (one set of rows per batch:
``--decode-batch 1,16``) per ``--decode-lengths`` cached length and ``--decode-decisions`` (head:
decode.py, group: decode_group.py, the kernel sparsify runs for that decision). The file
(formats/dispatch.py: rows per phase, timing and decode batch with dense_ms, dense_backend, points
and break_even) is what ``sparsecal export RUN --out DIR --break-even FILE`` reads
(``--dispatch-timing graph|eager``; ``--break-even`` repeatable: files merged row-wise).

    sparsecal bench break-even --run RUN --out FILE [--lengths 1024,2048] [--methods bsfa,blasst]
        [--sparsities 0,0.25,0.5,0.75,0.9] [--rounds 3] [--phases prefill,decode] [--timings graph,eager]
        [--decode-lengths ...] [--decode-batch 1,16] [--decode-decisions head,group] [--decode-sparsities ...]
    TRITON_INTERPRET=1 sparsecal bench break-even --run RUN --out FILE --quick   # CPU: decode rows, tiny

Shape legend: H query heads, Hkv KV heads, N tokens, D head dim.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from sparsecal.formats import dispatch as D
from sparsecal.formats.errors import UserError

SPARSITIES = "0,0.25,0.5,0.75,0.9"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one error line, exit code 2 (the CLI's UserError)
        raise UserError(f"sparsecal bench break-even: {message} (see `sparsecal bench --help`).")


def parse(argv) -> argparse.Namespace:
    ap = _Parser(prog="sparsecal bench break-even", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="the calibrated run (model geometry, lengths)")
    ap.add_argument("--out", type=Path, required=True, help="the break-even file (JSON)")
    ap.add_argument("--lengths", default=None, help="prompt lengths [default: the run's calibrated lengths]")
    ap.add_argument("--methods", default="bsfa,blasst")
    ap.add_argument("--sparsities", default=SPARSITIES, help="operating points (shares of reachable tiles skipped)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phases", default="prefill,decode", help="prefill and/or decode rows")
    ap.add_argument("--timings", default="graph,eager", help="graph (CUDA-graph replays) and/or eager")
    ap.add_argument("--decode-lengths", default=None, help="cached lengths of the decode rows [default: --lengths]")
    ap.add_argument("--decode-batch", default=None, help="decode rows per step, one set of decode rows per batch "
                    "(e.g. 1,16) [default: 16; --quick: 1]")
    ap.add_argument("--decode-decisions", default="head", help="head and/or group (sparsify's decode_decision)")
    ap.add_argument("--decode-sparsities", default=SPARSITIES, help="decode operating points")
    ap.add_argument("--quick", action="store_true", help="the CPU under TRITON_INTERPRET=1: decode rows, tiny")
    args = ap.parse_args(argv)
    try:
        args.lengths, args.decode_lengths = (None if x is None else [int(y) for y in x.split(",") if y.strip()]
                                             for x in (args.lengths, args.decode_lengths))
        args.sparsities, args.decode_sparsities = (sorted({float(y) for y in x.split(",") if y.strip()})
                                                   for x in (args.sparsities, args.decode_sparsities))
        args.decode_batch = (sorted({int(y) for y in args.decode_batch.split(",") if y.strip()})
                             if args.decode_batch is not None else [1 if args.quick else 16])
    except ValueError:
        raise UserError("--lengths, --decode-batch and --sparsities take comma-separated numbers (e.g. 1024,2048, "
                        "1,16 and 0,0.5).") from None
    for name in ("methods", "phases", "timings", "decode_decisions"):
        setattr(args, name, [m.strip() for m in getattr(args, name).split(",") if m.strip()])
    bad = ([m for m in args.methods if m not in D.METHODS] + [p for p in args.phases if p not in D.PHASES]
           + [t for t in args.timings if t not in D.TIMINGS] + [x for x in args.decode_decisions if x not in D.DECISIONS]
           + [s for s in args.sparsities + args.decode_sparsities if not 0 <= s < 1])
    lens = [x for x in (args.lengths, args.decode_lengths) if x is not None]
    if (bad or not args.methods or not args.phases or not args.timings or not args.decode_decisions
            or not args.sparsities or not args.decode_sparsities or args.rounds < 1 or not args.decode_batch
            or min(args.decode_batch) < 1
            or any(not x or min(x) < 1 for x in lens)):
        raise UserError(f"--methods takes {','.join(D.METHODS)}, --phases {','.join(D.PHASES)}, --timings "
                        f"{','.join(D.TIMINGS)}, --decode-decisions {','.join(D.DECISIONS)}, --sparsities values in "
                        f"[0, 1), --lengths positive integers, --rounds and each --decode-batch >= 1 "
                        f"(got {bad or 'an empty list'}).")
    return args


def geometry(run: Path, lengths=None) -> tuple[dict, list[int], dict]:
    """(geometry {block_m, block_n, heads, kv_heads, head_dim, dtype}, lengths, {"name", "model"})
    of a run: its fit's calibrated lengths, else its planned prompt lengths, unless given."""
    from sparsecal.formats.geometry import TRITON_HEAD_DIMS
    from sparsecal.formats.run import RunStore

    man = RunStore.open(run).manifest
    model, cfg = man["model"], man["config"]
    if not model.get("head_dim") or not model.get("num_kv_heads"):
        raise UserError(f"{run}/manifest.json does not record head_dim and num_kv_heads (an older capture); "
                        "capture the run again.")
    if model["head_dim"] not in TRITON_HEAD_DIMS:
        raise UserError(f"head dim {model['head_dim']} has no Triton sparse prefill kernel "
                        f"({', '.join(map(str, TRITON_HEAD_DIMS))}): its prefill always runs the reference.")
    fit = Path(run) / "fit" / "fit.json"
    if lengths is None:
        from sparsecal.analysis.fit import load_fit  # fit.json checked: lengths positive integers

        lengths = load_fit(run)["lengths"] if fit.is_file() else None
        lengths = sorted({int(n) for n in lengths or [r["length"] for r in man["samples"]]})
    geo = {"block_m": int(cfg["block_m"]), "block_n": int(cfg["block_n"]), "heads": int(model["num_heads"]),
           "kv_heads": int(model["num_kv_heads"]), "head_dim": int(model["head_dim"]), "dtype": "bfloat16",
           "batch": 1}
    return geo, sorted(lengths), {"name": Path(run).name, "model": model["id"]}


def to_file(measured: list[dict], geo: dict, run: dict, argv_info: dict | None = None) -> dict:
    """The break-even document of ``measured`` (formats.dispatch.break_even_rows' input) with this
    machine's provenance (GPU, commit, versions, date) and the options used."""
    from sparsecal.formats.provenance import provenance

    doc = D.break_even_file(measured, geo, provenance(), run)
    doc["request"] = argv_info or {}
    return doc


def measure_length(n: int, geo: dict, methods, sparsities, rounds: int, timings=("eager",)) -> list[dict]:
    """One length on the GPU: per timing and method {"phase": "prefill", "timing", "method",
    "head_dim", "group", "length", "dense" {backend: ms}, "dense_gqa" {backend: native | expanded},
    "points" [{"sparsity", "ms", "target"}]}."""
    import torch

    from sparsecal.bench.decode import graph_ms
    from sparsecal.bench.harness import PREFILL_SDPA, bench_ms, log, sdpa_fns
    from sparsecal.bench.sparse_inputs import blasst_log_lambda_for, bsfa_thresholds_for, structured_qkv, tile_stats
    from sparsecal.evaluation.speed_stats import round_order
    from sparsecal.kernels.sparse.prefill import candidate_tiles
    from sparsecal.kernels.sparse.prefill_pick import sparse_prefill

    h, hkv, d, bm, bn = geo["heads"], geo["kv_heads"], geo["head_dim"], geo["block_m"], geo["block_n"]
    q, k, v = structured_qkv(n, d, h, hkv, seed=n + d + h)
    scale = d ** -0.5
    bmax, gap = tile_stats(q, k, v, scale, bm, bn)
    reach = candidate_tiles(n, bm, bn)[1] * h
    out = torch.empty_like(q)
    names = {f"sdpa_{b.split('_')[0].lower()}": b for b in PREFILL_SDPA}
    found, _ = sdpa_fns(q, k, v)
    fns = {("dense", names[name]): fn for name, (fn, _) in found.items()}
    gqa = {names[name]: mode for name, (_, mode) in found.items()}
    counted = {}
    for method in methods:
        for s in sparsities:
            kw = ({"thresholds": bsfa_thresholds_for(bmax, n, bm, bn, s)} if method == "bsfa"
                  else {"log_lambda": blasst_log_lambda_for(gap, n, bm, bn, s)})
            kw["expected_sparsity"] = s  # the kernel sparsify picks for a layer calibrated at s
            _, sk = sparse_prefill(q, k, v, scale, bm, bn, out=out, **kw)
            counted[(method, s)] = float(sk.sum()) / reach
            fns[(method, s)] = lambda kw=kw: sparse_prefill(q, k, v, scale, bm, bn, out=out, **kw)
    by_timing = {}
    if "eager" in timings:
        times = {key: [] for key in fns}
        for r in range(rounds):
            for key in round_order(fns, r):
                times[key].append(bench_ms(fns[key]))
        by_timing["eager"] = {key: statistics.median(t) for key, t in times.items()}
    if "graph" in timings:
        got = {key: graph_ms(fn) for key, fn in fns.items()}
        for key, t in got.items():
            if not isinstance(t, float):
                log(f"  prefill N={n} {key}: {t}")
        by_timing["graph"] = {key: t for key, t in got.items() if isinstance(t, float)}
    rows = []
    for timing, ms in by_timing.items():
        dense = {b: t for (kind, b), t in ms.items() if kind == "dense"}
        log(f"N={n} {timing}: dense " + ", ".join(f"{b} {t:.4f} ms" for b, t in dense.items()))
        rows += [{"phase": "prefill", "timing": timing, "method": m, "head_dim": d, "group": h // hkv, "length": n,
                  "dense": dense, "dense_gqa": gqa,
                  "points": [{"sparsity": counted[(m, s)], "ms": ms[(m, s)], "target": s}
                             for s in sparsities if (m, s) in ms]}
                 for m in methods if dense and any((m, s) in ms for s in sparsities)]
    return rows


def measure(args, geo: dict, lengths, decode_lengths) -> list[dict]:
    """Every row's timings (break_even_rows' input): prefill per length, decode per batch and cached
    length (``--quick``: decode only, tiny lengths, on the CPU; batch 1 unless given)."""
    import torch

    from sparsecal.bench.breakeven_decode import measure_decode_length

    measured = []
    if "prefill" in args.phases and not args.quick:
        for n in lengths:
            measured += measure_length(n, geo, args.methods, args.sparsities, args.rounds, args.timings)
            torch.cuda.empty_cache()
    if "decode" in args.phases:
        for batch in args.decode_batch:
            for n in decode_lengths:
                measured += measure_decode_length(n, geo, args.methods, args.decode_decisions, args.decode_sparsities,
                                                  args.rounds, batch, args.timings, args.quick)
                if not args.quick:
                    torch.cuda.empty_cache()
    return measured


def summary(doc: dict) -> str:
    """One line per row: dense backend and time, the points, the break-even."""
    lines = [f"break-even on {doc['gpu']} (commit {doc['provenance'].get('commit')}):"]
    for r in doc["rows"]:
        pts = " ".join(f"{p['sparsity']:.2f}:{p['ms']:.4f}" for p in r["points"])
        be = "never" if r["break_even"] is None else f"{r['break_even']:.3f}"
        what = f"{r['phase']:7} {r['timing']:5} " + (f"{r['decision']:5} B={r['batch']} " if r.get("decision") else "")
        lines.append(f"  {what}{r['method']:6} D={r['head_dim']} G={r['group']} N={r['length']:>6}: "
                     f"{r['dense_backend']} {r['dense_ms']:.4f} ms; sparse {pts}; break-even {be}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    import torch

    from sparsecal.kernels.jit import interpreting

    if args.quick and not interpreting():
        raise UserError("--quick runs the decode kernels on the CPU: set TRITON_INTERPRET=1 before starting Python.")
    if not args.quick and not torch.cuda.is_available():
        raise UserError("sparsecal bench break-even times the kernels on a CUDA GPU; run it on the GPU that will "
                        "serve the model (this machine has none).")
    geo, lengths, run = geometry(args.run, args.lengths)
    decode_lengths = args.decode_lengths or lengths
    measured = measure(args, geo, lengths, decode_lengths)
    doc = to_file(measured, geo, run, {"lengths": lengths, "methods": args.methods, "sparsities": args.sparsities,
                                       "rounds": args.rounds, "phases": args.phases, "timings": args.timings,
                                       "decode_lengths": decode_lengths, "decode_batch": args.decode_batch,
                                       "decode_decisions": args.decode_decisions,
                                       "decode_sparsities": args.decode_sparsities, "quick": args.quick})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    D.write_break_even(args.out, doc)
    print(summary(doc))
    print(f"wrote {args.out}; use it with `sparsecal export {args.run} --out DIR --break-even {args.out}`")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
