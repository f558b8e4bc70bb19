"""The fit and export commands' console side: progress, warnings and the result tables
(the work itself is sparsecal.analysis.fit / .export)."""
from __future__ import annotations

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
                  TimeElapsedColumn(), console=console, transient=True) as bar:
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
    t = Table(title=f"BLASST lambda laws ({doc['request']['order']} order)")
    for col in ("mode", "target", "a (a/L)", "R² (a/L)", "b (a·L^-b)", "R² (power)", "lengths in fit"):
        t.add_column(col, justify="right")
    for c in doc["blasst"]:
        p = c["power_law"] or {}
        fmt = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
        t.add_row(c["mode"], f"{c['target']:g}", f"{c['a']:.4g}", fmt(c["law"]["r2"]), fmt(p.get("b")),
                  fmt(p.get("r2")), ",".join(str(x["length"]) for x in c["per_length"] if x["in_fit"]))
    out.print(t)
    ev = read_table(fit_dir, "blasst_eval")
    if ev.height:
        import polars as pl

        ev = ev.filter(pl.col("order") == doc["request"]["order"])
        agg = (ev.group_by(["mode", "target", "length", "method"])
               .agg(pl.col("achieved").mean(), pl.col("achieved").std().alias("std"), pl.col("retained_mass").mean())
               .sort(["mode", "target", "length", "method"], descending=[True, False, False, False]))
        t = Table(title=f"BLASST achieved sparsity on {doc['validation']} samples: calibrated a/L vs fixed lambda")
        for col in ("mode", "target", "tokens", "a/L: sparsity", "mass kept", "fixed: sparsity", "mass kept"):
            t.add_column(col, justify="right")
        rows = {}
        for r in agg.iter_rows(named=True):
            rows.setdefault((r["mode"], r["target"], r["length"]), {})[r["method"]] = r
        for (mode, target, n), m in rows.items():
            cal, fix = m.get("a/L"), m.get("fixed")
            t.add_row(mode, f"{target:g}", str(n), f"{cal['achieved']:.3f}", f"{cal['retained_mass']:.4f}",
                      f"{fix['achieved']:.3f}", f"{fix['retained_mass']:.4f}")
        out.print(t)


def export_command(run: Path, out: Path, target, max_length, force: bool = False, formats=(), patch_config=None,
                   per_layer: bool = False, min_layer_sparsity: float = 0.05) -> dict:
    """``sparsecal export``: the files, a summary line on stderr, the simulated-sparsity report on stdout."""
    from sparsecal.formats.run import RunStore
    from sparsecal.integrations.export import export_run

    store = RunStore.open(run)
    res = export_run(store, out, target, max_length, force, formats=formats, patch_config=patch_config,
                     per_layer=per_layer, min_layer_sparsity=min_layer_sparsity,
                     hf_config=_model_config(store.manifest["model"]) if formats else None,
                     warn=lambda line: console.print(f"[yellow]warning:[/] {line}"))
    console.print(f"exported to {out}: thresholds.bsfa.pt and thresholds.safetensors {res['bsfa_shape']} "
                  f"(k {','.join(map(str, res['k_values']))}), blasst.json "
                  + "; ".join(f"target {t:g}: a = {f['prefill']:.4g} prefill, "
                              + (f"{f['decode']:.4g} decode" if f.get("decode") is not None else "no decode")
                              for t, f in res["blasst"].items())
                  + (f"; {', '.join(res['engine_files'])}" if res["engine_files"] else ""))
    if res["patched"]:
        console.print(f"patched {res['patched'][0]} (the original is kept as {res['patched'][1].name})")
    print(res["report"], end="")
    return res


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
