"""The markdown tables data/bench/NOTES.md records after a decode GPU run, read from the run's files
(issue 28's decode rows): what a sweep says against the committed tables, and where a targets run
stands on each must-show line, counted one way every time.

    python -m sparsecal.bench.decode_report --sweep data/bench/decode-sweep10-b16-h100-d64.json ...
    python -m sparsecal.bench.decode_report --targets data/bench/decode-targets-s42-b16-h100-d128.json.gz ...
    python -m sparsecal.bench.decode_report --bandwidth data/bench/decode-targets-s53-b16-h200-d128.json.gz ...

--sweep (files of ``python -m sparsecal.bench.decode --sweep``): per shape and sparsity, the
table's sparse launch (``decode_group.sparse_launch_for``), the fastest checked sparse launch the
sweep timed and the ratio of their medians (< 1: the sweep found a faster one), and the same for
the dense launch (``decode_group_dense.launch_for``).

--targets (files of ``python -m sparsecal.bench.decode``): dense decode against the best SDPA
(graph replays, with the rounds' interval), Flash SDPA, the faster of the two reproducible dense
steps (the dispatched floor), and the BSFA group decision's share of the ideal at 50 % / 75 %.
Counted: dense shapes whose interval reaches 1.0, sparse cells at >= 0.90 of the ideal by the
median and by the interval's upper end, dispatched floors below 0.99.

--bandwidth (files of ``python -m sparsecal.bench.decode``): the rate each kernel streams the cache at
(graph replays): the K and V bytes of a dense step over the own dense kernel's and the best SDPA's
time, and for the BSFA group decision at 50 % / 75 % the bytes it reads (all of K, the V tiles some
head keeps: 1 - v_skip of V) over its time, and that rate over the own dense kernel's. A sparse
kernel that streams as fast as the dense one reaches its ideal; the ratio says how far it does.
"""
from __future__ import annotations

import argparse

from sparsecal.bench.harness import run_cli
from sparsecal.evaluation.speed_stats import ROUND_ORDER
from sparsecal.formats.errors import UserError
from sparsecal.formats.json_values import finite_number, read_file
from sparsecal.kernels.sparse.decode_group import sparse_launch_for
from sparsecal.kernels.sparse.decode_group_dense import ATTEND, launch_for

OF_IDEAL = 0.90     # issue 28: sparse decode at >= 0.90 of the ideal from the group V-skip share
FLOOR = 0.99        # and no dispatched decode below 0.99x the best SDPA
TARGETS = (50, 75)  # the sparsities the benchmarks time (percent)


def read(path, benchmark: str) -> dict:
    """A decode benchmark file (.json or .json.gz) of ``benchmark`` ("decode-sweep" or "decode")."""
    doc = read_file(path, "decode benchmark")
    if not isinstance(doc, dict) or doc.get("benchmark") != benchmark or not isinstance(doc.get("shapes"), list):
        kind = doc.get("benchmark") if isinstance(doc, dict) else type(doc).__name__
        raise UserError(f"{path} holds a {kind!r} benchmark, not {benchmark!r}; pass --sweep for "
                        "`bench.decode --sweep` files and --targets for `bench.decode` files.")
    return doc


def number(row: dict, key: str, path) -> float:
    """``row[key]`` as a float, or one UserError line: a benchmark row's value that is not finite."""
    x = row.get(key)
    if not finite_number(x):
        raise UserError(f"{path}: row {row.get('variant')!r} has {key} = {x!r}, not a finite number; the file is "
                        "damaged: run the benchmark again.")
    return float(x)


FIXED_ORDER = ("Timed in one fixed order every round: in a prefill run so timed, a form timed right after another "
               "read 2-5 % slower than the same kernel timed first (data/bench/NOTES.md, s49), so ratios within that "
               "of 1 do not tell the forms apart.")


def order_note(doc: dict) -> str:
    """A line (FIXED_ORDER) for a run whose rounds all timed the variants in one order (no ``round_order``: files
    before s49), else nothing."""
    return "" if doc.get("round_order") == ROUND_ORDER else f"\n{FIXED_ORDER}"


def sweep_rows(doc: dict, path="the sweep") -> list[dict]:
    """Per swept shape: d, group, length, then for "dense", "s50", "s75": (table's launch, its ms,
    fastest launch, its ms, fastest / table)."""
    out = []
    for shape in doc["shapes"]:
        if "rows" not in shape:   # a shape that failed on the GPU is recorded with its error only
            continue
        d, g, n = shape["d"], shape["group"], shape["length"]
        dense = launch_for(d, g, n, shape.get("batch", 16))
        names = {"dense": "dense_" + (dense if dense == ATTEND else dense.name())}
        names |= {f"s{t}": f"bsfa_group_s{t}_{sparse_launch_for(d, g, n).name()}" for t in TARGETS}
        row = {"d": d, "group": g, "length": n}
        for key, mine in names.items():
            prefix = "dense_" if key == "dense" else f"bsfa_group_{key}_"
            timed = {r["variant"]: number(r, "ms", path) for r in shape["rows"]
                     if r["variant"].startswith(prefix) and r.get("ok") and r.get("ms") is not None}
            if mine not in timed:
                raise UserError(f"{path}: D={d} G={g} {n}: the table's launch {mine} was not timed (or not checked) "
                                "by this sweep; sweep again with this tree's candidates.")
            best = min(timed, key=timed.get)
            row[key] = (mine[len(prefix):], timed[mine], best[len(prefix):], timed[best], timed[best] / timed[mine])
        out.append(row)
    return out


def targets_rows(doc: dict, path="the targets run") -> list[dict]:
    """Per shape: d, group, length, best SDPA (graph), own dense (median, lo, hi), Flash, the floor
    (the faster reproducible dense step), and per sparsity the group BSFA decision's (speedup, share
    of the ideal, its interval's upper end)."""
    out = []
    for shape in doc["shapes"]:
        rows = {r["variant"]: r for r in shape["rows"]}
        own, flash = rows["group_dense"], rows["sdpa_flash_native"]
        row = {"d": shape["d"], "group": shape["group"], "length": shape["length"],
               "sdpa": shape["best_sdpa_graph"], "sdpa_ms": number(rows[shape["best_sdpa_graph"]], "graph_ms", path),
               "own": tuple(number(own, f"graph_speedup_vs_sdpa{s}", path) for s in ("", "_lo", "_hi")),
               "flash": number(flash, "graph_speedup_vs_sdpa", path)}
        row["floor"] = max(row["own"][0], row["flash"])
        for t in TARGETS:
            r = rows[f"group_bsfa_group_s{t}"]
            row[f"s{t}"] = tuple(number(r, k, path) for k in ("graph_speedup_vs_sdpa", "graph_of_ideal",
                                                                "graph_of_ideal_hi"))
        out.append(row)
    return out


def counts(rows: list[dict]) -> dict:
    """The targets' must-show counts over ``targets_rows``."""
    cells = [r[f"s{t}"] for r in rows for t in TARGETS]
    return {"shapes": len(rows), "dense_reaching_1": sum(r["own"][2] >= 1.0 for r in rows),
            "cells": len(cells), "of_ideal_median": sum(c[1] >= OF_IDEAL for c in cells),
            "of_ideal_hi": sum(c[2] >= OF_IDEAL for c in cells),
            "floor_below": [(r["d"], r["group"], r["length"], round(r["floor"], 3)) for r in rows
                            if r["floor"] < FLOOR]}


KV_BYTES = 2  # bytes an element of K / V: the targets runs' cache is bfloat16 (bench.decode.decode_shape)


def bandwidth_rows(doc: dict, path="the targets run") -> list[dict]:
    """Per shape: d, group, length, the K + V bytes of a dense step over the own dense kernel's and the
    best SDPA's graph time (TB/s), and per sparsity the group BSFA decision's bytes read (K, and the
    share 1 - v_skip of V) over its graph time (TB/s) with that rate over the own dense kernel's."""
    out = []
    for shape in doc["shapes"]:
        rows = {r["variant"]: r for r in shape["rows"]}
        half = shape["batch"] * (shape["heads"] // shape["group"]) * shape["length"] * shape["d"] * KV_BYTES
        own = 2 * half / number(rows["group_dense"], "graph_ms", path) / 1e9
        row = {"d": shape["d"], "group": shape["group"], "length": shape["length"], "own": own,
               "sdpa": 2 * half / number(rows[shape["best_sdpa_graph"]], "graph_ms", path) / 1e9}
        for t in TARGETS:
            r = rows[f"group_bsfa_group_s{t}"]
            rate = (2 - number(r, "v_skip", path)) * half / number(r, "graph_ms", path) / 1e9
            row[f"s{t}"] = (rate, rate / own)
        out.append(row)
    return out


def bandwidth_markdown(rows: list[dict]) -> str:
    """The ``bandwidth_rows`` table: TB/s of the own dense kernel, the best SDPA and the group decision per sparsity
    (its rate over the own dense kernel's in brackets)."""
    lines = ["| D | G | cached | own dense TB/s | best SDPA TB/s | "
             + " | ".join(f"{t}%: TB/s (of own dense)" for t in TARGETS) + " |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        sparse = " | ".join("{:.2f} ({:.2f})".format(*r[f"s{t}"]) for t in TARGETS)
        lines.append(f"| {r['d']} | {r['group']} | {r['length'] // 1024}K | {r['own']:.2f} | {r['sdpa']:.2f} | "
                     f"{sparse} |")
    return "\n".join(lines)


def sweep_markdown(rows: list[dict]) -> str:
    lines = ["| D | G | cached | dense: table -> fastest (ratio) | 50%: table -> fastest | 75%: table -> fastest |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k][0]} -> {r[k][2]} ({r[k][4]:.3f})" for k in ("dense", "s50", "s75")]
        lines.append(f"| {r['d']} | {r['group']} | {r['length'] // 1024}K | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_markdown(rows: list[dict]) -> str:
    lines = ["| D | G | cached | best SDPA ms | own dense [95%] | Flash | floor | "
             + " | ".join(f"{t}%: speedup, of ideal (hi)" for t in TARGETS) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(TARGETS)]
    for r in rows:
        own = "{:.3f} [{:.3f}, {:.3f}]".format(*r["own"])
        sparse = " | ".join("x{:.2f}, {:.2f} ({:.2f})".format(*r[f"s{t}"]) for t in TARGETS)
        lines.append(f"| {r['d']} | {r['group']} | {r['length'] // 1024}K | {r['sdpa'].split('_')[1]} "
                     f"{r['sdpa_ms']:.3f} | {own} | {r['flash']:.3f} | {r['floor']:.3f} | {sparse} |")
    c = counts(rows)
    lines.append("")
    lines.append(f"Dense interval reaching 1.0: {c['dense_reaching_1']}/{c['shapes']}; sparse >= {OF_IDEAL} of the "
                 f"ideal: {c['of_ideal_median']}/{c['cells']} by the median, {c['of_ideal_hi']}/{c['cells']} by the "
                 f"interval's upper end; dispatched floor below {FLOOR}: {c['floor_below'] or 'none'}.")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparsecal.bench.decode_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", nargs="+", default=[], help="files of `python -m sparsecal.bench.decode --sweep`")
    ap.add_argument("--targets", nargs="+", default=[], help="files of `python -m sparsecal.bench.decode`")
    ap.add_argument("--bandwidth", nargs="+", default=[], help="files of `python -m sparsecal.bench.decode`: "
                    "the rate each kernel streams the cache at")
    args = ap.parse_args(argv)
    if not (args.sweep or args.targets or args.bandwidth):
        raise UserError("nothing to report: pass --sweep FILE ..., --targets FILE ... and / or --bandwidth FILE ...")
    if args.sweep:
        docs = {p: read(p, "decode-sweep") for p in args.sweep}
        print(sweep_markdown([r for p, d in docs.items() for r in sweep_rows(d, p)]) + _order_notes(docs))
    if args.targets:
        docs = {p: read(p, "decode") for p in args.targets}
        print(targets_markdown([r for p, d in docs.items() for r in targets_rows(d, p)]) + _order_notes(docs))
    if args.bandwidth:
        docs = {p: read(p, "decode") for p in args.bandwidth}
        print(bandwidth_markdown([r for p, d in docs.items() for r in bandwidth_rows(d, p)]))


def _order_notes(docs: dict) -> str:
    """``order_note`` once for the files (named) whose rounds kept one order."""
    fixed = [p for p, d in docs.items() if order_note(d)]
    return f"\n{', '.join(map(str, fixed))}: {FIXED_ORDER}" if fixed else ""


if __name__ == "__main__":
    run_cli(main)
