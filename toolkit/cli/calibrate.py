"""The fit and export commands' console side: progress, warnings and the result tables
(the work itself is sparsecal.analysis.fit / .export)."""
from __future__ import annotations

import math
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console(stderr=True)


def fit_command(run: Path, req) -> dict:
    from sparsecal.analysis.fit import fit_run
    from sparsecal.formats.run import RunStore

    store = RunStore.open(run)
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        job = bar.add_task("reading samples", total=None)

        def progress(done, total, rec):
            bar.update(job, completed=done, total=total, description=f"reading {rec['id']}")

        doc = fit_run(store, req, progress, warn=lambda line: bar.console.print(f"[yellow]warning:[/] {line}"))
    console.print(f"fitted {len(doc['split']['train'])} calibration samples, validated on "
                  f"{len(doc['split']['test']) or len(doc['split']['train'])} ({doc['validation']}) "
                  f"in {time.perf_counter() - t0:.1f} s -> {Path(run) / 'fit'}")
    print_fit(Path(run) / "fit", doc)
    return doc


def print_fit(fit_dir: Path, doc: dict) -> None:
    """BSFA Table 1 (predicted vs measured density), the BLASST laws and Table 5."""
    from sparsecal.analysis.tables import read_table

    out = Console(width=max(110, Console().width))
    dens = read_table(fit_dir, "bsfa_density").sort(["k", "length"])
    t = Table(title=f"BSFA density, predicted vs measured ({doc['validation']}, spread = std over samples)")
    for col in ("k", "tokens", "samples", "predicted", "measured", "std", "head p10-p90", "mass kept (top-k)"):
        t.add_column(col, justify="right")
    for r in dens.iter_rows(named=True):
        t.add_row(str(r["k"]), str(r["length"]), str(r["samples"]), f"{r['predicted']:.3f}", f"{r['measured']:.3f}",
                  "-" if r["measured_std"] != r["measured_std"] else f"{r['measured_std']:.3f}", f"{r['head_p10']:.3f}-{r['head_p90']:.3f}", f"{r['retained_mass_topk']:.4f}")
    out.print(t)
    print_bsfa_fitted(out, fit_dir, doc)
    _print_laws(out, doc)
    _print_held_out(out, fit_dir, doc)
    print_rescales(out, fit_dir)
    print_joint(out, fit_dir)
    print_decode_group(out, fit_dir)


def _fmt(x) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.3g}"


def _print_laws(out, doc: dict) -> None:
    """Per mode and target: a/L (deployed), a L^-b and A exp(B S)/L with R^2 in ln lambda, and the
    lengths the deployed law holds on (sparsify runs dense below ``dense below`` and, unless it is
    told to extrapolate, past the longest of them: ``dense past``)."""
    t = Table(title=f"BLASST lambda laws ({doc['request']['order']} order; R² in ln λ; a/L is deployed)")
    for col in ("mode", "target", "a (a/L)", "R²", "a·L^-b: b", "R²", "A·e^(BS)/L: A, B", "R²",
                "holds on (tokens)", "dense below", "dense past"):
        t.add_column(col, justify="right")
    for c in doc["blasst"]:
        laws, dep = c.get("laws", {}), c.get("deployed") or {}
        p, e = laws.get("power") or {}, laws.get("exp") or {}
        t.add_row(c["mode"], f"{c['target']:g}", f"{c['a']:.4g}", _fmt(c["law"]["r2"]), _fmt(p.get("b")),
                  _fmt(p.get("r2")), f"{_fmt(e.get('A'))}, {_fmt(e.get('B'))}" if e else "-", _fmt(e.get("r2")),
                  ",".join(map(str, dep.get("validated_lengths", []))), str(dep.get("dense_below", "-")),
                  str(dep.get("max_length", "-")))
    out.print(t)
    from sparsecal.analysis.blasst_laws import exp_note

    note = exp_note([c["target"] for c in doc["blasst"]])
    if note:
        out.print(note)


def _print_held_out(out, fit_dir: Path, doc: dict) -> None:
    """Held-out sparsity (reachable and candidate tiles) and its error per law, and the deployed
    a/L under the runtime policy with its retained mass."""
    import polars as pl

    from sparsecal.analysis.tables import read_table

    ev = read_table(fit_dir, "blasst_eval")
    if not ev.height:
        return
    ev = ev.filter(pl.col("order") == doc["request"]["order"])
    agg = (ev.group_by(["mode", "target", "length", "method"])
           .agg(pl.col("achieved").mean(), pl.col("achieved_candidates").mean(), pl.col("error").mean(),
                pl.col("retained_mass").mean(), pl.col("dense").all(), pl.col("saturated").all())
           .sort(["mode", "target", "length"], descending=[True, False, False]))
    t = Table(title=f"BLASST on {doc['validation']} samples: error = achieved - target per law; deployed = a/L as "
                    "sparsify runs it (dense below the validated lengths and where a/L > 1)")
    for col in ("mode", "target", "tokens", "a/L err", "a·L^-b err", "A·e^(BS)/L err", "fixed err",
                "deployed: sparsity", "of candidates", "mass kept"):
        t.add_column(col, justify="right")
    rows: dict = {}
    for r in agg.iter_rows(named=True):
        rows.setdefault((r["mode"], r["target"], r["length"]), {})[r["method"]] = r
    for (mode, target, n), m in rows.items():
        err = [(f"{m[k]['error']:+.3f}" + (" (all)" if m[k]["saturated"] else "")) if k in m else "-"
               for k in ("a/L", "power", "exp", "fixed")]
        d = m.get("deployed")
        dep = ["dense", "-", "1.0000"] if d and d["dense"] else [f"{d['achieved']:.3f}", f"{d['achieved_candidates']:.3f}",
                                                                  f"{d['retained_mass']:.4f}"] if d else ["-"] * 3
        t.add_row(mode, f"{target:g}", str(n), *err, *dep)
    out.print(t)


def print_bsfa_fitted(out, fit_dir: Path, doc: dict) -> None:
    """BSFA under the fitted (exported) thresholds: retained mass prefill and decode, and decode
    density with thresholds calibrated on decode rows (fits made before these tables: nothing)."""
    from sparsecal.analysis.tables import read_table

    if not (fit_dir / "bsfa_retained.parquet").is_file():
        return
    ret = read_table(fit_dir, "bsfa_retained")
    dec = read_table(fit_dir, "bsfa_decode") if (fit_dir / "bsfa_decode.parquet").is_file() else None
    if not ret.height:
        return
    by = {(r["phase"], r["k"], r["length"]): r for r in ret.iter_rows(named=True)}
    dd = {(r["k"], r["length"]): r for r in dec.iter_rows(named=True)} if dec is not None and dec.height else {}
    t = Table(title=f"BSFA under the fitted thresholds ({doc['validation']}): mass kept, decode density "
                    "(decode thresholds calibrated on decode rows; * = lower bound)")
    for col in ("k", "tokens", "prefill mass kept", "decode predicted", "decode measured", "decode mass kept",
                "decode mass kept (top-k)"):
        t.add_column(col, justify="right")
    def mark(r):
        return "-" if r is None else f"{r['retained_mass']:.4f}" + ("*" if r["bound_positions"] else "")
    for k, n in sorted({(k, n) for _, k, n in by}):
        d = dd.get((k, n))
        t.add_row(str(k), str(n), mark(by.get(("prefill", k, n))), "-" if d is None else f"{d['predicted']:.3f}",
                  "-" if d is None else f"{d['measured']:.3f}", mark(by.get(("decode", k, n))),
                  "-" if d is None else f"{d['retained_mass_topk']:.4f}")
    out.print(t)


def export_command(run: Path, out: Path, target, max_length, force: bool = False, formats=(), patch_config=None,
                   per_layer: bool = False, min_layer_sparsity: float = 0.05, break_even=None,
                   margin: float = 0.0, serve_lengths: str | None = None, length_weights: str | None = None,
                   timing: str = "graph") -> dict:
    """``sparsecal export``: the files, a summary line on stderr, the simulated-sparsity report on
    stdout, and with ``break_even`` the dispatch table (which layers run sparse at which lengths).
    ``serve_lengths`` (MIN[-MAX]) and ``length_weights`` (LENGTH:WEIGHT,... or a prompts file) as typed."""
    from sparsecal.formats.engines import parse_serve_lengths
    from sparsecal.formats.run import RunStore
    from sparsecal.integrations.export import export_run

    serve = parse_serve_lengths(serve_lengths)
    store = RunStore.open(run)
    weights, source = _length_weights(length_weights, store.manifest["model"])
    res = export_run(store, out, target, max_length, force, formats=formats, patch_config=patch_config,
                     per_layer=per_layer, min_layer_sparsity=min_layer_sparsity,
                     hf_config=_model_config(store.manifest["model"]) if formats else None,
                     warn=lambda line: console.print(f"[yellow]warning:[/] {line}"), break_even=break_even,
                     margin=margin, serve_lengths=serve, length_weights=weights, weights_source=source,
                     timing=timing)
    console.print(f"exported to {out}: thresholds.bsfa.pt and thresholds.safetensors {res['bsfa_shape']} "
                  f"(k {','.join(map(str, res['k_values']))}), blasst.json "
                  + "; ".join(f"target {t:g}: a = {f['prefill']:.4g} prefill, "
                              + (f"{f['decode']:.4g} decode" if f.get("decode") is not None else "no decode")
                              for t, f in res["blasst"].items())
                  + (f"; {', '.join(res['engine_files'])}" if res["engine_files"] else ""))
    if res["patched"]:
        console.print(f"patched {res['patched'][0]} (the original is kept as {res['patched'][1].name})")
    print(res["report"], end="")
    if res["dispatch"] is not None:
        print_dispatch(res["dispatch"])
    return res


def print_dispatch(rec: dict) -> None:
    """Per method its break-even per calibrated length (* taken from the nearest measured length),
    then per config how many layers run sparse there and which (decode: per mode and measured batch)."""
    from sparsecal.formats.dispatch import decode_views, layer_ranges

    src = rec["break_even_file"]
    out = Console(width=max(110, Console().width))
    t = Table(title=f"Dispatch: a layer runs sparse where its calibrated prefill sparsity >= break-even + "
                    f"{rec['margin']:g} ({src['name']}: {src['gpu']}, commit {src['commit']}; * = nearest measured "
                    "length); elsewhere SDPA")
    t.add_column("config")
    for n in rec["lengths"]:
        t.add_column(f"{n} tokens", justify="left")
    said = set()
    for e in rec["configs"]:
        if e["method"] not in said:
            said.add(e["method"])
            t.add_row(f"{e['method']} break-even", *[("never" if be is None else f"{be:.3f}") + ("*" if x else "")
                                                     for be, x in zip(e["break_even"], e["extrapolated"])])
        cells = []
        for j in range(len(rec["lengths"])):
            layers = [i for i, row in enumerate(e["sparse"]) if row[j]]
            cells.append(f"{len(layers)}/{len(e['sparse'])}: {layer_ranges(layers)}")
        t.add_row(f"{e['method']} {e['config']}", *cells)
        for key, word in (("decode", ""), ("decode_group", " group")):  # the head decision's, then the group's
            views = decode_views(e[key]) if e.get(key) else []
            for mode in (views[0][1]["modes"] if views else {}):
                for b, v in views:  # one row per measured decode batch
                    g = v["modes"][mode]["sparse"]
                    be = " ".join(("never" if x is None else f"{x:.3f}") + ("*" if ext else "")
                                  for x, ext in zip(v["break_even"], v["extrapolated"]))
                    t.add_row(f"  decode{word} {mode}{f' B={b}' if b else ''} (break-even {be})",
                              *[f"{sum(r[j] for r in g)}/{len(g)}: {layer_ranges([i for i, r in enumerate(g) if r[j]])}"
                                for j in range(len(rec["lengths"]))])
    out.print(t)
    timing = rec.get("timing") or {"prefill": "eager", "decode": None}
    batches = sorted({b for c in rec["configs"] if c.get("decode") for b, _ in decode_views(c["decode"]) if b})
    out.print(f"timings: prefill {timing['prefill']}, decode "
              + (f"{timing['decode']} ({rec.get('decode_decision')} decision"
                 + (f", batch{'es' if len(batches) > 1 else ''} {', '.join(map(str, batches))}: a decode step of "
                    "batch B follows the largest measured batch <= B, the smallest below them)" if batches else ")")
                 if timing["decode"] else "not dispatched (no head-decision decode rows in the break-even file)")
              + (f"; group decision decode {timing['decode_group']} (the 'decode group' rows)"
                 if timing.get("decode_group") else ""))
    if not rec["configs"]:
        out.print("no config has break-even rows: every exported layer runs sparse (no dispatch).")


def _length_weights(text: str | None, model: dict) -> tuple[dict | None, str | None]:
    """``--length-weights``: ({length: weight}, where from) of LENGTH:WEIGHT pairs, or of a prompts
    file's prompts (each prompt weighs 1; "text" lines are tokenized with the run's model's tokenizer)."""
    from sparsecal.formats.engines import parse_length_weights
    from sparsecal.formats.errors import UserError

    if text is None:
        return None, None
    path = Path(text)
    if not path.is_file():
        if ":" not in text:
            raise UserError(f"--length-weights {text}: no such prompts file, and not LENGTH:WEIGHT pairs; give e.g. "
                            "1024:0.5,4096:0.5 or a JSONL prompts file.")
        return parse_length_weights(text), f"--length-weights {text}"
    from sparsecal.capture.models import load_tokenizer, resolve_model
    from sparsecal.capture.prompts.jsonl import load_prompts_file

    class _Lazy:  # the tokenizer is loaded only when a line gives "text"
        tok = None

        def __call__(self, s):
            self.tok = self.tok or load_tokenizer(resolve_model(model.get("spec") or model["id"]))
            return self.tok(s)

    weights: dict = {}
    samples = load_prompts_file(path, _Lazy(), model.get("vocab_size"))
    for s in samples:
        weights[s.length] = weights.get(s.length, 0.0) + 1.0
    return weights, f"the {len(samples)} prompts of {path}"


def _model_config(model: dict):
    """The run's model config (attention module names for the engine files), when it loads here."""
    from sparsecal.capture.models import load_config, resolve_model
    from sparsecal.formats.errors import UserError

    try:
        return load_config(resolve_model(model.get("spec") or ""))
    except (UserError, OSError, ValueError):
        return None


def engine_blocks(ctx, engine: str, model: str, block_m: int, block_n: int) -> tuple[int, int]:
    """``capture --engine``: the engine's BM x BN (trtllm-hopper's depends on the model's head_dim);
    --block-m/--block-n typed on the command line must agree. The preset is written back into the
    command's parameters, so ranks started by --gpus capture the same tiles."""
    from sparsecal.formats.engines import ENGINES, preset_blocks
    from sparsecal.formats.errors import unknown

    if engine not in ENGINES:
        raise unknown("engine", engine, ENGINES)
    head_dim = None
    if engine == "trtllm-hopper":
        from sparsecal.capture.models import load_config, model_info, resolve_model

        ms = resolve_model(model)
        head_dim = model_info(ms, load_config(ms))["head_dim"]
    given = {name: value for name, value in (("block-m", block_m), ("block-n", block_n))
             if getattr(ctx.get_parameter_source(name.replace("-", "_")), "name", None) == "COMMANDLINE"}
    bm, bn = preset_blocks(engine, head_dim, given)
    ctx.params.update(block_m=bm, block_n=bn)
    return bm, bn


def check_fit_engine(run: Path, engine: str, order: str) -> None:
    """``fit --engine``: the run must be captured at the engine's tiles, and engines scan forward."""
    from sparsecal.formats.engines import check_run_geometry
    from sparsecal.formats.errors import UserError
    from sparsecal.formats.run import RunStore

    man = RunStore.open(run).manifest
    check_run_geometry(engine, str(run), man["config"]["block_m"], man["config"]["block_n"],
                       man["model"].get("head_dim"))
    if order != "forward" and engine != "sparsecal":
        raise UserError(f"--engine {engine} scans key tiles forward; leave out --order {order}.")


def print_rescales(out: Console, fit_dir: Path) -> None:
    """Per scan order: mean running-max rescales per row, and the rows already at their final max
    (and the median shortfall) after the first block and after the first local blocks; one line
    for a run captured before these statistics."""
    from sparsecal.analysis.stabilization import order_summary
    from sparsecal.formats.run import RESCALE_MISSING

    title = "Running-max stabilization per scan order (all lengths, layers, heads)"
    rescale, hist = _fit_tables(fit_dir, "stab_rescale", "stab_shortfall_hist")
    if rescale is None or not rescale.height:
        out.print(f"{title}: {RESCALE_MISSING}", soft_wrap=True, markup=False)
        return
    t = Table(title=title + "; shortfall = final row max - running max, nats")
    for col in ("order", "rows", "rescales / row", "final after 1st block", "median shortfall",
                "final after 1st+local", "median shortfall"):
        t.add_column(col, justify="right")
    for r in order_summary(rescale, hist):
        t.add_row(r["order"], f"{r['rows']:,}", f"{r['mean_rescales']:.3f}", f"{r['first_share_zero']:.3f}",
                  f"{r['first_median']:.3g}", f"{r['local_share_zero']:.3f}", f"{r['local_median']:.3g}")
    out.print(t)


def _fit_tables(fit_dir: Path, *names: str) -> list:
    """The fit's tables ``names``, or Nones where any is missing or unreadable (a run fitted before
    they existed: the caller says which command makes them)."""
    from sparsecal.analysis.tables import read_table
    from sparsecal.formats.errors import UserError

    try:
        return [read_table(fit_dir, n) for n in names]
    except UserError:
        return [None] * len(names)


def print_joint(out: Console, fit_dir: Path) -> None:
    """VFA's frozen max (max(Q-init, sink + diagonal max)) minus the true row max per layer band:
    the median and the shares of rows more than 1 / 5 nats below it (p > 1 in the frozen phase)
    and more than 5 above; one line for a run captured before the statistic."""
    from sparsecal.analysis.stabilization import joint_bands
    from sparsecal.formats.run import JOINT_MISSING

    joint, hist = _fit_tables(fit_dir, "joint", "joint_hist")
    if joint is None or not joint.height:
        out.print(f"VFA frozen max: {JOINT_MISSING}", soft_wrap=True, markup=False)
        return
    t = Table(title="VFA frozen max - true row max per layer band (nats)",
              caption="frozen = max(Q-init, sink + diagonal max); all lengths and heads; < -1: p > 1 rows")
    for col in ("layers", "rows", "median", "< -1", "< -5", "> +5"):
        t.add_column(col, justify="right")
    for r in joint_bands(joint, hist):
        t.add_row(r["layers"], f"{r['rows']:,}", f"{r['median']:.3g}", f"{r['share_below_1']:.4f}",
                  f"{r['share_below_5']:.4f}", f"{r['share_above_5']:.4f}")
    out.print(t)


def print_decode_group(out: Console, fit_dir: Path) -> None:
    """BLASST decode under the group decision (a KV group skips a tile only when all its heads do:
    the V loads saved): its skip share at the head law's lambda and the a/L it needs for the target;
    one line for a run captured before the statistic."""
    (grp,) = _fit_tables(fit_dir, "blasst_decode_group")
    title = "BLASST decode, group decision"
    if grp is None or not grp.height:
        out.print(f"{title}: not in this run (captured before decode_group_gap_count existed; re-capture)",
                  soft_wrap=True, markup=False)
        return
    t = Table(title=f"{title} (the KV group skips a tile only when every head would: the V loads saved)",
              caption="group share: of the reachable decode tiles, at the head law's lambda = a_head / L")
    for col in ("target", "tokens", "head lambda", "group share", "group lambda_best", "a_head", "a_group"):
        t.add_column(col, justify="right")
    for r in grp.sort(["target", "length"]).iter_rows(named=True):
        t.add_row(f"{r['target']:g}", str(r["length"]), _fmt(r["lambda_head"]), f"{r['group_sparsity_at_head_lambda']:.3f}",
                  _fmt(r["lambda_group_best"]), _fmt(r["a_head"]), _fmt(r["a_group"]))
    out.print(t)
