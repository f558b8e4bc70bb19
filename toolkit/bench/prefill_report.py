"""The prefill targets table data/bench/NOTES.md records after a prefill GPU run, read from the run's
files (issue 28 part 5), for the kernel a user's call would run: ``prefill_pick.pick`` at the
row's head dim, method and sparsity, not the fastest variant of each cell.

    python -m sparsecal.bench.prefill_report data/bench/prefill-gluon-h100-d64-s42.json.gz ...

Files of ``python -m sparsecal.bench.prefill_gluon --sections targets``. Per shape (head dim D,
tokens N, GQA group G): the best SDPA and the project's fastest dense kernel (ms), then for BSFA and
BLASST the picked kernel's "nothing skipped" form against that dense kernel (``vs_dense``) and its
share of the ideal 1 / (1 - s/2) against the best dense kernel of all (``of_ideal_best``) at 50 %
and 75 %, each with the rounds' exact 95 % interval where the run had enough rounds (4 or more).
Counted: nothing-skipped cells at their goal (NOTHING_SKIPPED: 0.95 at D=64, 0.98 at D=128) and
sparse cells at >= OF_IDEAL of the ideal, by the median and by the interval's upper end.

With ``--ab BASE FORM[,FORM...]`` it prints instead the A/B tables NOTES.md records after a comparison run: per
shape and form, BASE's time over the form's (> 1: the form is faster) in every cell: skipping off, then BSFA and
BLASST at 0 / 50 / 75 % (the ratio of the medians of the run's rounds), each with its exact interval from the two
forms' rounds (``evaluation.speed_stats.ratio_interval`` at alpha AB_ALPHA: level 0.90 with 3 rounds a form, the
range of the 9 round-by-round ratios); a last line counts the cells whose interval lies above 1 (the form faster) and
below 1 (slower). Rounds of one run share its machine and drift, so an interval is as good as the assumption that
both forms' rounds differ by a scale factor only; cells that run identical code in both forms are the run's own
check of that (s49, 64K: in a fixed order the form timed first read 2-5 % faster, ``order_note``).

    python -m sparsecal.bench.prefill_report --ab gluon_ws gluon_ws_nov data/bench/prefill-vbytes-h100-d128-s48.json.gz

With ``--cost KERNEL`` it splits a timed kernel's distance from the ideal into its two parts, per shape and
method: the fixed cost of deciding (KERNEL with nothing skipped over the own dense kernel) and what a skipped tile
saves (per skipped share of the candidate tiles, in own dense calls; the ideal counts half a tile and no fixed
cost), ``cost_rows``.

    python -m sparsecal.bench.prefill_report --cost gluon_ws data/bench/prefill-gluon-h100-d128-s50b.json.gz

Shape legend: one row per (D, N, G) of the files' ``targets`` (a later file's shape replaces an earlier
file's); cells per row: 2 methods x 3 sparsities; the last column names the tree that ran the row (its
file's ``provenance``: commit, and the source digest where the file has one): a kernel name means the
code of that tree, so rows of different trees are different kernels under one name.
"""
from __future__ import annotations

import argparse

from sparsecal.bench.decode_report import number, order_note
from sparsecal.bench.harness import run_cli
from sparsecal.evaluation.speed_stats import ratio_interval
from sparsecal.formats.errors import UserError
from sparsecal.formats.json_values import finite_number, read_file
from sparsecal.kernels.sparse.prefill_pick import pick

NOTHING_SKIPPED = {64: 0.95, 128: 0.98}   # issue 28: nothing skipped / own dense, per head dim
OF_IDEAL = 0.90                           # and 50 % / 75 % at >= 0.90 of the ideal against the best dense
METHODS = {"bsfa": 1, "blasst": 2}        # the bench's row names -> prefill.method_code
SPARSITIES = (0, 50, 75)                  # percent; 0: the "nothing skipped" row


def read(path) -> dict:
    """A prefill benchmark file (.json or .json.gz) with a ``targets`` section."""
    doc = read_file(path, "prefill benchmark")
    if not isinstance(doc, dict) or doc.get("benchmark") != "prefill_gluon" or not isinstance(doc.get("targets"), list):
        kind = doc.get("benchmark") if isinstance(doc, dict) else type(doc).__name__
        raise UserError(f"{path} holds a {kind!r} benchmark without prefill targets; pass a file of "
                        "`python -m sparsecal.bench.prefill_gluon --sections targets`.")
    return doc


def _cell(row: dict, key: str, path) -> tuple:
    """(median, lo, hi) of ``key`` in one variant's row; lo / hi None where the run had too few rounds."""
    lo, hi = row.get(f"{key}_lo"), row.get(f"{key}_hi")
    return number(row, key, path), (float(lo) if finite_number(lo) else None), (float(hi) if finite_number(hi) else None)


def targets_rows(doc: dict, path="the prefill run") -> list[dict]:
    """Per shape: d, n, group, sdpa_ms, dense_ms, dense (variant), run (the tree: commit [source
    digest]), and per (method, sparsity) key "bsfa_s50" etc.: (picked kernel, (median, lo, hi)):
    vs_dense at 0, of_ideal_best at 50 / 75."""
    prov = doc.get("provenance") if isinstance(doc.get("provenance"), dict) else {}
    run = " ".join(str(prov[k]) for k in ("commit", "source") if prov.get(k)) or "unknown"
    out = []
    for shape in doc["targets"]:
        d, n, g = shape["d"], shape["n"], shape["group"]
        rows = {r["variant"]: r for r in shape["rows"]}
        row = {"d": d, "n": n, "group": g, "sdpa_ms": shape["best_sdpa_ms"], "dense_ms": shape["dense_ms"],
               "dense": shape["dense_variant"], "run": run}
        for method, code in METHODS.items():
            for s in SPARSITIES:
                kernel = pick(d, code, s / 100)
                name = f"{kernel}_{method}_s{s}"
                if name not in rows:
                    raise UserError(f"{path}: D={d} N={n} G={g}: {name}, the kernel prefill_pick runs there, was not "
                                    f"timed; run the benchmark with --variants {kernel}.")
                row[f"{method}_s{s}"] = (kernel, _cell(rows[name], "vs_dense" if s == 0 else "of_ideal_best", path))
        out.append(row)
    return out


def counts(rows: list[dict]) -> dict:
    """The must-show counts over ``targets_rows``: nothing skipped at its head dim's goal, sparse
    cells at >= OF_IDEAL by the median and by the interval's upper end (None: no interval)."""
    zero = [(r["d"], r[f"{m}_s0"][1]) for r in rows for m in METHODS]
    sparse = [r[f"{m}_s{s}"][1] for r in rows for m in METHODS for s in SPARSITIES[1:]]
    return {"shapes": len(rows), "zero_cells": len(zero),
            "zero_at_goal": sum(c[0] >= NOTHING_SKIPPED.get(d, 1.0) for d, c in zero),
            "sparse_cells": len(sparse), "of_ideal_median": sum(c[0] >= OF_IDEAL for c in sparse),
            "of_ideal_hi": sum(c[2] is not None and c[2] >= OF_IDEAL for c in sparse)}


def _fmt(cell: tuple) -> str:
    kernel, (x, lo, hi) = cell
    return f"{kernel} {x:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else "")


def targets_markdown(rows: list[dict]) -> str:
    """The table, one line per shape, and the counts."""
    cols = [f"{m.upper()} {'nothing skipped / dense' if s == 0 else f'{s}%: of ideal'}" for m in METHODS
            for s in SPARSITIES]
    lines = ["| D | N | G | best SDPA ms | own dense ms | " + " | ".join(cols) + " | run |",
             "|---|---|---|---|---|" + "---|" * (len(cols) + 1)]
    for r in rows:
        cells = [_fmt(r[f"{m}_s{s}"]) for m in METHODS for s in SPARSITIES]
        lines.append(f"| {r['d']} | {r['n'] // 1024}K | {r['group']} | {r['sdpa_ms']:.2f} | {r['dense_ms']:.2f} | "
                     + " | ".join(cells) + f" | {r['run']} |")
    c = counts(rows)
    goals = ", ".join(f"{v} at D={d}" for d, v in NOTHING_SKIPPED.items())
    lines += ["", (f"Nothing skipped at its goal ({goals}): {c['zero_at_goal']}/{c['zero_cells']}; 50 % / 75 % at "
                   f">= {OF_IDEAL} of the ideal: {c['of_ideal_median']}/{c['sparse_cells']} by the median, "
                   f"{c['of_ideal_hi']}/{c['sparse_cells']} by the interval's upper end.")]
    return "\n".join(lines)


AB_CELLS = ("off", *(f"{m}_s{s}" for m in METHODS for s in SPARSITIES))  # the A/B table's cells, in order
# The A/B cells' intervals: alpha 0.11 gives the exact level 0.90 that 3 rounds a form allow (1 - 2/20; 95 % needs
# 4 rounds), 0.905 at 5; the level each interval has is kept and the table prints the lowest.
AB_ALPHA = 0.11


def _timed(rows: dict) -> str:
    """The variants a shape's rows timed (those with a skipping-off row), comma-separated."""
    return ", ".join(sorted(k.removesuffix("_off") for k in rows if k.endswith("_off")))


def _rounds(row: dict, path) -> list[float]:
    """A row's ``rounds_ms``: positive finite times, or one UserError line."""
    x = row.get("rounds_ms")
    if not (isinstance(x, list) and x and all(finite_number(v) and v > 0 for v in x)):
        raise UserError(f"{path}: row {row.get('variant')!r} has rounds_ms = {x!r}, not a list of positive times; "
                        "the file is damaged or older than its rounds: run the benchmark again.")
    return [float(v) for v in x]


def _interval(base_row: dict, form_row: dict, path) -> tuple:
    """(lo, hi, level) of BASE's time over the form's at AB_ALPHA, (None, None, None) where the rounds are too few."""
    got = ratio_interval(_rounds(base_row, path), _rounds(form_row, path), AB_ALPHA)
    return got["lo"], got["hi"], got["level"]


def _shape_rows(shape: dict, names, path) -> dict:
    """A shape's rows by variant name, or one UserError line naming the first of ``names`` the run did not time."""
    rows = {r["variant"]: r for r in shape["rows"]}
    missing = [x for x in names if x not in rows]
    if missing:
        raise UserError(f"{path}: D={shape['d']} N={shape['n']} G={shape['group']}: {missing[0]} was not timed; "
                        f"pass variants the run timed (it has {_timed(rows)}).")
    return rows


def ab_rows(doc: dict, base: str, forms: list[str], path="the prefill run") -> list[dict]:
    """Per shape and form: d, n, group, form, ratios (BASE ms / form ms per AB_CELLS cell) and intervals ((lo, hi,
    level) per cell, ``_interval``). A form that the run timed at some shapes and at none of another's cells (one
    that takes only some head dims, bench.prefill_gluon.VARIANT_DIMS) has no row at that shape; a form it timed
    nowhere, or at only some of a shape's cells, is one UserError line."""
    out = []
    anywhere = {r["variant"] for shape in doc["targets"] for r in shape["rows"]}
    somewhere = {f for f in forms if any(f"{f}_{c}" in anywhere for c in AB_CELLS)}
    for shape in doc["targets"]:
        timed = {r["variant"] for r in shape["rows"]}
        for form in forms:
            if form in somewhere and not any(f"{form}_{c}" in timed for c in AB_CELLS):
                continue  # a form of other head dims than this shape's
            rows = _shape_rows(shape, [f"{v}_{c}" for v in (base, form) for c in AB_CELLS], path)
            ratios = [number(rows[f"{base}_{c}"], "ms", path) / number(rows[f"{form}_{c}"], "ms", path)
                      for c in AB_CELLS]
            intervals = [_interval(rows[f"{base}_{c}"], rows[f"{form}_{c}"], path) for c in AB_CELLS]
            out.append({"d": shape["d"], "n": shape["n"], "group": shape["group"], "form": form, "ratios": ratios,
                        "intervals": intervals})
    return out


def _groups(cells) -> str:
    """AB_CELLS-ordered cells as the table writes them: skipping off; then one group a method."""
    k = len(SPARSITIES)
    return "; ".join([cells[0]] + [" ".join(cells[i:i + k]) for i in range(1, len(cells), k)])


def _ab_cell(ratio: float, interval: tuple) -> str:
    lo, hi, _ = interval
    return f"{ratio:.3f}" if lo is None else f"{ratio:.3f} ({lo:.2f}-{hi:.2f})"


def ab_counts(rows: list[dict]) -> dict:
    """Cells of the A/B rows whose interval lies above 1 (``faster``), below 1 (``slower``), of ``with_interval``
    (``cells`` in all), and the lowest ``level`` of those intervals (None without one)."""
    ivs = [iv for r in rows for iv in r["intervals"] if iv[0] is not None]
    return {"faster": sum(iv[0] > 1 for iv in ivs), "slower": sum(iv[1] < 1 for iv in ivs),
            "cells": sum(len(r["intervals"]) for r in rows), "with_interval": len(ivs),
            "level": min((iv[2] for iv in ivs), default=None)}


def ab_markdown(rows: list[dict], base: str) -> str:
    """The A/B table: one line per shape and form, BASE's time over the form's per cell with its exact interval,
    and the count of cells the intervals place above and below 1 (``ab_counts``)."""
    c = ab_counts(rows)
    level = "no interval: too few rounds" if c["level"] is None else f"interval at level >= {c['level']:.2f}"
    lines = [f"| form | D | N | G | {base} ms / form ms ({level}): {_groups(AB_CELLS)} |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['form']} | {r['d']} | {r['n'] // 1024}K | {r['group']} | "
                     f"{_groups([_ab_cell(v, iv) for v, iv in zip(r['ratios'], r['intervals'])])} |")
    lines.append(f"\nIntervals above 1 (the form faster): {c['faster']}, below 1 (slower): {c['slower']}, "
                 f"of {c['with_interval']} cells with an interval ({c['cells']} in all).")
    return "\n".join(lines)


def cost_rows(doc: dict, kernel: str, path="the prefill run") -> list[dict]:
    """Per shape and method: d, n, group, method, ``fixed`` (KERNEL's time with nothing skipped over the own dense
    kernel's, less 1: what deciding costs before any tile is skipped) and ``saved`` {50: x, 75: y}: the time KERNEL
    saves from nothing skipped to s, per skipped share of the candidate tiles, in own-dense-call times
    ((T0 - Ts) / (s T_dense), s the kernel's own counted sparsity). The ideal 1 / (1 - s/2) counts 0.5 (half a
    tile) and no fixed cost."""
    out = []
    for shape in doc["targets"]:
        dense = number(shape, "dense_ms", path)
        if dense <= 0:
            raise UserError(f"{path}: D={shape['d']} N={shape['n']} G={shape['group']}: dense_ms {dense}, not a "
                            "positive time; the file is damaged.")
        for method in METHODS:
            names = [f"{kernel}_{method}_s{s}" for s in SPARSITIES]
            rows = _shape_rows(shape, names, path)
            t0 = number(rows[names[0]], "ms", path)
            saved = {}
            for s, name in zip(SPARSITIES[1:], names[1:]):
                counted = number(rows[name], "sparsity", path)
                if not 0 < counted <= 1:
                    raise UserError(f"{path}: {name} counted sparsity {counted}, outside (0, 1]; the file is damaged.")
                saved[s] = (t0 - number(rows[name], "ms", path)) / (counted * dense)
            out.append({"d": shape["d"], "n": shape["n"], "group": shape["group"], "method": method,
                        "fixed": t0 / dense - 1, "saved": saved})
    return out


def cost_markdown(rows: list[dict], kernel: str) -> str:
    """The decision's cost table: one line per shape and method (``cost_rows``), and the ranges."""
    head = (f"| D | N | G | method | {kernel} nothing skipped / own dense - 1 | saved per skipped share, "
            "in own dense calls, at 50 / 75 % (ideal 0.50) |")
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['d']} | {r['n'] // 1024}K | {r['group']} | {r['method']} | {100 * r['fixed']:+.1f} % | "
                     + " / ".join(f"{r['saved'][s]:.3f}" for s in SPARSITIES[1:]) + " |")
    fixed = [r["fixed"] for r in rows]
    saved = [x for r in rows for x in r["saved"].values()]
    lines.append(f"\nFixed cost {100 * min(fixed):+.1f} to {100 * max(fixed):+.1f} %; saved per skipped share "
                 f"{min(saved):.3f}-{max(saved):.3f} ({len(rows)} rows).")
    return "\n".join(lines)


def latest_rows(paths) -> tuple[list[dict], list[str]]:
    """``targets_rows`` of the files in order, a shape (D, N, G) of a later file replacing an earlier
    file's; and one line per replaced shape (its file, the file that replaced it)."""
    rows, where, notes = {}, {}, []
    for p in paths:
        for r in targets_rows(read(p), p):
            key = (r["d"], r["n"], r["group"])
            if key in rows:
                notes.append(f"D={key[0]} N={key[1]} G={key[2]}: {p} replaces {where[key]}")
            rows[key], where[key] = r, p
    return sorted(rows.values(), key=lambda r: (r["d"], r["n"], r["group"])), notes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparsecal.bench.prefill_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="files of `python -m sparsecal.bench.prefill_gluon --sections targets`; "
                                             "a shape in a later file replaces an earlier file's")
    ap.add_argument("--ab", nargs=2, metavar=("BASE", "FORMS"),
                    help="instead of the targets table: BASE's time over each of FORMS' (comma-separated variants)")
    ap.add_argument("--cost", metavar="KERNEL",
                    help="instead of the targets table: what deciding costs KERNEL (e.g. gluon_ws) with nothing "
                         "skipped, and what each skipped tile saves")
    args = ap.parse_args(argv)
    if args.ab and args.cost:
        ap.error("--ab and --cost are two different tables: pass one")
    if args.ab:
        base, forms = args.ab[0], [f for f in args.ab[1].split(",") if f]
        if not forms:
            ap.error("--ab takes BASE and FORMS, the variants to compare with it, comma-separated (e.g. gluon_ws_nov)")
    if args.cost or args.ab:  # one table a file, each with its order note
        for p in args.files:
            doc = read(p)
            text = (cost_markdown(cost_rows(doc, args.cost, p), args.cost) if args.cost
                    else ab_markdown(ab_rows(doc, base, forms, p), base))
            print(f"{p}:\n" + text + order_note(doc))
        return
    rows, notes = latest_rows(args.files)
    print(targets_markdown(rows) + "".join(f"\n{x}" for x in notes))


if __name__ == "__main__":
    run_cli(main)
