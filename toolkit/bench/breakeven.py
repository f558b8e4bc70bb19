"""``sparsecal bench break-even``: where the sparse prefill kernel pays on this GPU, for a run's model.

Per length (the run's calibrated lengths, or ``--lengths``) and method (bsfa, blasst): structured
inputs at the run's geometry (B = 1, the model's H, Hkv, D, bf16; bench/sparse_inputs.structured_qkv),
the time of one layer's causal prefill attention by each SDPA backend (cuDNN, FLASH;
bench/harness.sdpa_fns) and by the project's sparse prefill kernel
(kernels.sparse.prefill_pick.sparse_prefill, the kernel sparsify runs, at the run's BM x BN, with the
operating point as its expected sparsity) at each ``--sparsities`` operating point, read from the
input's own tile statistics as bench/sparse.py's prefill_variants does; each point records the
sparsity the kernel counted. Times are medians over ``--rounds`` round-robin rounds of bench_ms.
The file (formats/dispatch.py: rows with dense_ms, dense_backend, points and break_even) is what
``sparsecal export RUN --out DIR --break-even FILE`` reads.

    sparsecal bench break-even --run RUN --out FILE [--lengths 1024,2048] [--methods bsfa,blasst]
        [--sparsities 0,0.25,0.5,0.75,0.9] [--rounds 3]

Shape legend: H query heads, Hkv KV heads, N tokens, D head dim.
"""
from __future__ import annotations

import argparse
import json
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
    args = ap.parse_args(argv)
    try:
        args.lengths = None if args.lengths is None else [int(x) for x in args.lengths.split(",") if x.strip()]
        args.sparsities = sorted({float(x) for x in args.sparsities.split(",") if x.strip()})
    except ValueError:
        raise UserError("--lengths and --sparsities take comma-separated numbers (e.g. 1024,2048 and 0,0.5).") from None
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in D.METHODS] + [s for s in args.sparsities if not 0 <= s < 1]
    if bad or not args.methods or not args.sparsities or args.rounds < 1 or (args.lengths is not None and (
            not args.lengths or min(args.lengths) < 1)):
        raise UserError(f"--methods takes {','.join(D.METHODS)}, --sparsities values in [0, 1), --lengths positive "
                        f"integers, --rounds >= 1 (got {bad or 'an empty list'}).")
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
        lengths = json.loads(fit.read_text()).get("lengths") if fit.is_file() else None
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


def measure_length(n: int, geo: dict, methods, sparsities, rounds: int) -> list[dict]:
    """One length on the GPU: per method {"method", "head_dim", "group", "length", "dense"
    {backend: ms}, "dense_gqa" {backend: native | expanded}, "points" [{"sparsity", "ms", "target"}]}."""
    import torch

    from sparsecal.bench.harness import PREFILL_SDPA, bench_ms, log, sdpa_fns
    from sparsecal.bench.sparse_inputs import blasst_log_lambda_for, bsfa_thresholds_for, structured_qkv, tile_stats
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
    times = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            times[key].append(bench_ms(fn))
    ms = {key: statistics.median(t) for key, t in times.items()}
    dense = {b: t for (kind, b), t in ms.items() if kind == "dense"}
    log(f"N={n}: dense " + ", ".join(f"{b} {t:.4f} ms" for b, t in dense.items()))
    return [{"method": m, "head_dim": d, "group": h // hkv, "length": n, "dense": dense, "dense_gqa": gqa,
             "points": [{"sparsity": counted[(m, s)], "ms": ms[(m, s)], "target": s} for s in sparsities]}
            for m in methods]


def summary(doc: dict) -> str:
    """One line per row: dense backend and time, the points, the break-even."""
    lines = [f"break-even on {doc['gpu']} (commit {doc['provenance'].get('commit')}):"]
    for r in doc["rows"]:
        pts = " ".join(f"{p['sparsity']:.2f}:{p['ms']:.4f}" for p in r["points"])
        be = "never" if r["break_even"] is None else f"{r['break_even']:.3f}"
        lines.append(f"  {r['method']:6} D={r['head_dim']} G={r['group']} N={r['length']:>6}: "
                     f"{r['dense_backend']} {r['dense_ms']:.4f} ms; sparse {pts}; break-even {be}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    import torch

    if not torch.cuda.is_available():
        raise UserError("sparsecal bench break-even times the kernels on a CUDA GPU; run it on the GPU that will "
                        "serve the model (this machine has none).")
    geo, lengths, run = geometry(args.run, args.lengths)
    measured = []
    for n in lengths:
        measured += measure_length(n, geo, args.methods, args.sparsities, args.rounds)
        torch.cuda.empty_cache()
    doc = to_file(measured, geo, run, {"lengths": lengths, "methods": args.methods, "sparsities": args.sparsities,
                                       "rounds": args.rounds})
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
