"""The BLASST law's regime in an evaluation (issue 27, "laws said right"): ``--extrapolate`` checked
with the other options, the (method, length) cells past the law's validated lengths named before
the model loads, and per cell the regimes the rows recorded (rows' ``prefill_law`` and
``decode_law``: below | interpolated | extrapolated, integrations/sparsify_laws.py; None for a
method without a law) in the printed summary and results.json's ``laws``.

Without ``--extrapolate`` a BLASST call past the longest validated length runs what ``dense`` runs
(nothing skipped); with it, a/L is applied there. Either way the rows say ``extrapolated``.
"""
from __future__ import annotations

from pathlib import Path

from sparsecal.formats.errors import UserError

ACTIONS = {False: "ran dense there (pass --extrapolate to apply a/L anyway)",
           True: "a/L applied past the validated lengths (--extrapolate)"}


def check_extrapolate(extrapolate: bool | None, methods: str | None) -> None:
    """``--extrapolate`` changes BLASST only: refuse it with a --methods that has no BLASST method
    (methods None: not known yet, judged again after the request is resolved)."""
    if not extrapolate or methods is None:
        return
    from sparsecal.evaluation.methods import parse_methods

    if not any(m.name == "blasst" for m in parse_methods(methods)):
        raise UserError(f"--extrapolate applies the BLASST law past its validated lengths, but --methods '{methods}' "
                        "has no blasst method; add one (e.g. blasst:0.5) or leave out --extrapolate.")


def plan_lines(methods, export_dir, lengths, extrapolate: bool) -> list[str]:
    """One line per BLASST method, phase and requested length outside its law's validated lengths
    (read from the export's blasst.json before the model loads). Decode steps run at the prompt
    length and beyond, so a prompt at the longest validated length decodes past it."""
    from sparsecal.formats.exports import BLASST_JSON, blasst_group_law, blasst_law_regime, blasst_validity, load_blasst

    if not (Path(export_dir) / BLASST_JSON).is_file():
        return []
    doc, out = load_blasst(Path(export_dir)), []
    for m in (m for m in methods if m.name == "blasst"):
        for mode in ("prefill", "decode") if m.decode_mode in ("sparse", "group") else ("prefill",):
            v = blasst_validity(doc, mode, m.value)
            if mode == "decode" and m.decode_mode == "group":  # the group decision's own law
                v = (blasst_group_law(doc, m.value) or {}).get("validity", v)
            past = [n for n in lengths if blasst_law_regime(n + (mode == "decode"), v) == "extrapolated"]
            if v and past:
                out.append(f"{m.label} {mode} at {', '.join(map(str, past))} tokens: past the law's validated lengths "
                           f"({v['min_length']}-{v['max_length']}); {ACTIONS[bool(extrapolate)]}")
    return out


def law_cells(rows: list[dict]) -> list[dict]:
    """results.json's ``laws``: per method label and length whose rows carry a law, the rows counted
    per regime in each phase ({"label", "length", "samples", "prefill": {regime: n}, "decode": ...})."""
    cells: dict = {}
    for r in rows:
        if r.get("prefill_law") is None and r.get("decode_law") is None:
            continue
        c = cells.setdefault((r["label"], r["length"]), {"label": r["label"], "length": r["length"], "samples": 0,
                                                         "prefill": {}, "decode": {}})
        c["samples"] += 1
        for mode in ("prefill", "decode"):
            law = r.get(f"{mode}_law")
            if law is not None:
                c[mode][law] = c[mode].get(law, 0) + 1
    return [cells[k] for k in sorted(cells, key=lambda k: (k[0], k[1]))]


def law_lines(rows: list[dict], extrapolate: bool) -> list[str]:
    """The summary's lines: each method and length whose rows ran a phase outside the validated
    lengths, with what the runtime did there."""
    out = []
    for c in law_cells(rows):
        for mode in ("prefill", "decode"):
            off = {k: n for k, n in c[mode].items() if k != "interpolated"}
            for law, n in sorted(off.items()):
                what = ACTIONS[bool(extrapolate)] if law == "extrapolated" else "ran dense there (never validated)"
                out.append(f"law {law}: {c['label']} {mode} at {c['length']} tokens in {n} of {c['samples']} samples; "
                           f"{what}")
    return out
