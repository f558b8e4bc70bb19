"""Served lengths where an engine file's law gives lambda = factor / kv_len >= 1 (kv_len <= factor).

sparsecal's runtime runs dense there; no consumer does (formats.engines.CONSUMERS says what each
does instead). For every exported format and phase the export records the shortest length that is
safe (floor(factor) + 1), whether the served lengths (``--serve-lengths MIN[-MAX]``; every length
from 1 token when not given) reach below it, what each consumer of the format does there, and the
remedies a consumer can apply: serve sparse only from that length, keep the layers sparsecal
leaves dense ignored, or a target that keeps lambda < 1 from the shortest served length
(S < ln(MIN / a) / b on the format's a * exp(b * S) law). Written into engine.json (``safety``),
report.txt and one printed line. Docs: docs/formats.md, "Served lengths".
"""
from __future__ import annotations

import math

from sparsecal.formats.engines import BLOCK_FORMATS, CONSUMERS
from sparsecal.formats.errors import UserError

PHASES = ("prefill", "decode")


def serve_range(serve: tuple | None, context: int | None) -> dict:
    """{"min", "max", "source"} of the served lengths, checked against the model's context."""
    if serve is None:
        return {"min": 1, "max": context, "source": "default: every length from 1 token (--serve-lengths not given)"}
    lo, hi = serve
    for n in (lo, hi):
        if n is not None and context and n > context:
            raise UserError(f"--serve-lengths: {n} tokens is past the model's context of {context} tokens; give at "
                            f"most {context}.")
    return {"min": lo, "max": hi if hi is not None else context, "source": "--serve-lengths"}


def max_safe_target(law: dict | None, shortest: int) -> float | None:
    """The largest target (3 decimals) whose factor a * exp(b * S) stays below ``shortest``, or None
    (no law, b <= 0, or no target above 0 does)."""
    if not law or law.get("b") is None or law["b"] <= 0 or law["a"] <= 0:
        return None
    s = math.floor(1000.0 * math.log(shortest / law["a"]) / law["b"] - 1e-9) / 1000.0
    while s > 0 and law["a"] * math.exp(law["b"] * s) >= shortest:
        s -= 0.001
    return round(s, 3) if s > 0 else None


def _phase(factor: float, law: dict | None, serve: dict) -> dict:
    safe_from = math.floor(factor) + 1
    return {"factor": factor, "lambda_at_shortest": factor / serve["min"], "safe_from": safe_from,
            "unsafe": serve["min"] < safe_from, "max_target": max_safe_target(law, serve["min"])}


def check(built: dict, serve: dict, scalar_laws: dict, ignore_names: list[str]) -> dict:
    """engine.json ``safety``: per format its phases (factor, lambda at the shortest served length,
    safe_from, unsafe, max_target), the consumers' behaviour where unsafe, and the remedies."""
    out = {"serve_lengths": serve, "rule": "lambda = factor / kv_len >= 1 where kv_len <= factor; safe from "
           "floor(factor) + 1 tokens", "formats": {}}
    for fmt, entry in built["formats"].items():
        block = fmt in BLOCK_FORMATS or entry.get("form") == "target_sparsity"
        laws = built["laws"] if block else scalar_laws
        phases = {m: _phase(f, laws.get(m), serve) for m, f in entry["factors"].items() if f is not None}
        unsafe = any(p["unsafe"] for p in phases.values())
        rec = {"phases": phases, "unsafe": unsafe,
               "consumers": [{"consumer": c, "short": k, "does": d, "source": s, "exact": "dense" in d}
                             for k, c, d, s in CONSUMERS[fmt]] if unsafe else [],
               "remedies": {"min_length": max(p["safe_from"] for p in phases.values()),
                            "max_target": {m: p["max_target"] for m, p in phases.items()},
                            "ignore": list(ignore_names),
                            "ignore_applied": block or (fmt == "trtllm" and built.get("patched", False))}}
        out["formats"][fmt] = rec
    return out


def _target_text(rec: dict, fmt: str) -> str:
    got = {m: s for m, s in rec["remedies"]["max_target"].items() if s is not None}
    if not got:
        return "no target keeps lambda < 1 there"
    how = "set target_sparsity" if fmt in BLOCK_FORMATS or fmt == "trtllm" else "fit and export"
    return f"{how} <= " + ", ".join(f"{s:g} ({m})" for m, s in got.items())


def report_lines(safety: dict) -> list[str]:
    """report.txt's "Served lengths" section."""
    serve = safety["serve_lengths"]
    lines = [f"Served lengths {serve['min']}-{serve['max'] or '?'} tokens ({serve['source']}); {safety['rule']}:"]
    for fmt, rec in safety["formats"].items():
        for m, p in rec["phases"].items():
            lines.append(f"  {fmt} {m}: factor {p['factor']:.4g}, lambda {p['lambda_at_shortest']:.3g} at "
                         f"{serve['min']} tokens; " + (f"lambda >= 1 below {p['safe_from']} tokens" if p["unsafe"]
                                                       else "lambda < 1 on every served length"))
        if not rec["unsafe"]:
            continue
        for c in rec["consumers"]:
            lines.append(f"    there {c['consumer']} {c['does']} ({c['source']})")
        r = rec["remedies"]
        ign = (f"keep the {len(r['ignore'])} ignored layer(s) dense" + ("" if r["ignore_applied"] else
               " (this file cannot: patch the checkpoint, --patch-config, where the engine reads its block)")
               if r["ignore"] else "no layer is ignored")
        lines.append(f"    remedies: serve sparse from {r['min_length']} tokens (shorter requests dense); {ign}; "
                     f"{_target_text(rec, fmt)}")
    return lines


def warning_line(safety: dict) -> str | None:
    """The one printed line when some format is unsafe on the served lengths, else None."""
    bad = {f: r for f, r in safety["formats"].items() if r["unsafe"]}
    if not bad:
        return None
    where = ", ".join(f"{f} below {r['remedies']['min_length']}" for f, r in bad.items())
    cons = [c for r in bad.values() for c in r["consumers"]]
    changes = ", ".join(dict.fromkeys(c["short"] for c in cons if not c["exact"]))
    dense = ", ".join(dict.fromkeys(c["short"] for c in cons if c["exact"]))
    there = " or ".join(x for x in (changes and f"the output changes ({changes})",
                                    dense and f"skipping is off ({dense})") if x)
    return (f"lambda = factor / L >= 1 on served lengths (from {safety['serve_lengths']['min']} tokens): {where} "
            f"tokens; there {there}. Remedies in report.txt and engine.json (safety).")
