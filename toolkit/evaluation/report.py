"""What ``sparsecal eval`` prints after its rows: the summary table with every interval and exact
test, the noise floor per length, and the seen / held-out lines. Split from command.py."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_summary(summary, root) -> None:
    """The summary table (every cell with its 95% interval, the exact paired test against dense,
    gained/lost answers, whether it is distinguishable from the rounding floor and the smallest
    difference the cell resolves), then the noise floor per length."""
    from sparsecal.evaluation.summary import noise_floor

    table = Table(title=f"{root}: accuracy relative to dense (answer tasks: score; text: perplexity), [95% "
                        "interval: 0/1 score Tango, else BCa]; p exact vs dense; floor: differs from dense:fp32")
    for col in ("method", "tokens", "task", "n", "score", "+/-", "p", "rel. dense", "ppl ratio",
                "answer LL - dense", "top-1", "KL", "floor", "mdd", "sparsity pre/dec"):
        table.add_column(col, justify="left" if col in ("method", "task") else "right", no_wrap=True)
    for r in summary.iter_rows(named=True):
        table.add_row(r["label"] + (f" ({r['split']})" if r.get("split") else ""), str(r["length"]), r["task"],
                      str(r["samples"]), _fmt(r["accuracy"], ".2f"), f"+{_fmt(r.get('gained'), 'd')}/-"
                      f"{_fmt(r.get('lost'), 'd')}", _fmt(r.get("p_dense"), ".2g"), _ci(r, "accuracy_rel_dense", ".3f"),
                      _ci(r, "ppl_ratio", ".4f"), _ci(r, "answer_ll_delta", ".2f"), _ci(r, "top1", ".3f"),
                      _ci(r, "kl", ".1e"), {True: "yes", False: "no"}.get(r.get("distinguishable"), "-"),
                      _fmt(r.get("mdd"), ".3g"), f"{_fmt(r['sparsity'], '.2f')}/{_fmt(r['decode_sparsity'], '.2f')}")
    out = Console(width=max(230, Console().width))
    out.print(table)
    for line in noise_floor_lines(noise_floor(summary)) + split_lines(summary):
        out.print(line, soft_wrap=True)


def _fmt(x, f: str) -> str:
    return "-" if x is None else format(x, f)


def _ci(r: dict, name: str, f: str) -> str:
    """'value [lo, hi]' of a summary cell (no interval: the value alone)."""
    lo, hi = r.get(f"{name}_lo"), r.get(f"{name}_hi")
    tail = "" if lo is None or hi is None else f" [{format(lo, f)}, {format(hi, f)}]"
    return _fmt(r.get(name), f) + tail


def noise_floor_lines(floor: list[dict]) -> list[str]:
    """One line per noise-floor method and length: how far exact dense attention computed another
    way sits from the reference, in the same metrics as the methods."""
    lines = []
    for r in floor:
        where = f" ({r['split']})" if r.get("split") else ""
        lines.append(f"noise floor {r['label']} vs dense at {r['length']} tokens{where} ({r['samples']} samples): "
                     f"answers +{r.get('gained', 0)}/-{r.get('lost', 0)}, top-1 {_ci(r, 'top1', '.4f')}, "
                     f"KL {_ci(r, 'kl', '.2e')}, ppl ratio {_ci(r, 'ppl_ratio', '.4f')}, "
                     f"answer LL {_ci(r, 'answer_ll_delta', '.3f')}, rel. dense {_ci(r, 'accuracy_rel_dense', '.3f')}")
    return lines


def _split_rows(summary) -> list[dict]:
    """results.json's ``splits``: the seen and held-out task families per method and length."""
    from sparsecal.evaluation.summary import split_rows

    return split_rows(summary)


def split_lines(summary) -> list[str]:
    """One line per method (dense aside) and length whose rows know their split: each split's (seen,
    held-out) relative accuracy (averaged over its tasks where defined), top-1 and KL, and its tasks."""
    by: dict = {}
    for r in _split_rows(summary):
        by.setdefault((r["label"], r["length"]), []).append(r)
    return [f"{label} at {length} tokens: " + "; ".join(
        f"{r['split']} rel. dense {_fmt(r['accuracy_rel_dense'], '.3f')}, top-1 {_fmt(r['top1'], '.4f')}, "
        f"KL {_fmt(r['kl'], '.2e')} ({r['tasks']}, {r['samples']} samples)" for r in rows)
        for (label, length), rows in by.items() if label != "dense"]
