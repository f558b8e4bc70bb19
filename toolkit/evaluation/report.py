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


def markdown_table(summary, speed=None) -> str:
    """One Markdown row per (method label, length) of an evaluation's summary (summary.parquet):
    per answer task its accuracy (n), answers gained / lost against dense, the exact paired p and
    the answer log-likelihood difference [95%]; per text task the KL [95%] and the samples whose
    perplexity rose / fell against dense with the exact sign test's p; the tasks where the
    cell differs from the rounding floor (``distinguishable``); the counted prefill / decode
    sparsity (mean over tasks); and, with ``speed`` (summary.own_speed of timing.parquet), the
    configuration's own TTFT and TPOT speedups against the best SDPA, eager / CUDA-graph replay,
    each with its 95% interval [lo, hi] where the timing phase had enough rounds for one."""
    import polars as pl

    tasks = [(t, m == "accuracy") for t, m in summary.select("task", "metric").unique().sort("task").rows()]
    heads = [f"{t}: {'acc (n) +/- p; answer LL - dense [95%]' if b else 'KL [95%]; ppl fell +/rose -, p'}" for t, b in tasks]
    cols = ["method", "tokens", *heads, "differs from floor", "sparsity pre / dec", "TTFT eager / graph",
            "TPOT eager / graph"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    speed_of = {} if speed is None else {(r["label"], r["length"]): r for r in speed.iter_rows(named=True)}
    keys = summary.select("label", "length").unique(maintain_order=True).sort("length").rows()
    order = {label: i for i, label in enumerate(summary["label"].unique(maintain_order=True))}
    for label, n in sorted(keys, key=lambda k: (order[k[0]], k[1])):
        cell = summary.filter((pl.col("label") == label) & (pl.col("length") == n))
        by = {r["task"]: r for r in cell.iter_rows(named=True)}
        parts = [_task_cell(by.get(t), b) for t, b in tasks]
        apart = sorted(t for t, r in by.items() if r.get("distinguishable"))
        s = speed_of.get((label, n), {})
        lines.append("| " + " | ".join([
            label, str(n), *parts, ", ".join(apart) or "no",
            f"{_fmt(cell['sparsity'].mean(), '.2f')} / {_fmt(cell['decode_sparsity'].mean(), '.2f')}",
            f"{_speed(s, 'speedup_ttft')} / {_speed(s, 'speedup_ttft_graph')}",
            f"{_speed(s, 'speedup_tpot')} / {_speed(s, 'speedup_tpot_graph')}"]) + " |")
    return "\n".join(lines)


def _speed(s: dict, name: str) -> str:
    """A speedup with its rounds' 95% interval where the timing has one: 1.052 [1.041, 1.074]."""
    lo, hi = s.get(f"{name}_lo"), s.get(f"{name}_hi")
    return _fmt(s.get(name), ".3f") + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else "")


def _task_cell(r: dict | None, answers: bool) -> str:
    """An answer task's accuracy, flips and exact p with the answer LL difference; a text task's KL
    with its perplexity flips and exact p."""
    if r is None:
        return "-"
    if not answers:
        return f"{_ci(r, 'kl', '.1e')}; +{_fmt(r.get('gained'), 'd')}/-{_fmt(r.get('lost'), 'd')} p={_fmt(r.get('p_dense'), '.2g')}"
    return (f"{_fmt(r['accuracy'], '.2f')} (n={r['samples']}) +{_fmt(r.get('gained'), 'd')}/-{_fmt(r.get('lost'), 'd')} "
            f"p={_fmt(r.get('p_dense'), '.2g')}; {_ci(r, 'answer_ll_delta', '+.3f')}")
