"""The eval command: held-out task prompts run with every method through ``sparsecal.sparsify``,
scored and compared with dense, one resumable row per (sample, method).

Order of work: every check that can refuse the request runs before the model loads (methods
parse and fit the export, the export fits the model, lengths fit the model and the export's
Nmax, the prompts are disjoint from the calibration prompts, EVAL holds nothing else). Then, per
sample: dense first (its final hidden states are the reference), then each method on the same
prompt: prefill, fidelity against dense in position chunks, greedy generation of the answer
(sparse prefill and decode), score, achieved sparsity, wall time. Each row is written before the
next starts, so Ctrl-C loses at most the row in progress and the same command resumes; a finished
evaluation run again only rewrites the summary (and joins new ``--bench`` files).

``--dispatch off|on|both``: BSFA and BLASST run without the export's dispatch record (off, the
default), with it (on: labels end in ``+dispatch``), or both, each its own method and rows.

The timing phase (evaluation/timing.py) comes after the rows, in a phase of its own: ``--time``
runs it when the rows are done (one process), ``--time-only`` runs only it on the rows EVAL holds
(after rows written by torchrun ranks or by several processes sharing a GPU, which hold that GPU's
lock shared; the timing phase takes it exclusively and so waits for them). ``--speed-only`` (a
random-weight checkpoint) writes no accuracy rows, times random prompt ids and labels the accuracy
meaningless (results.json and curves.parquet ``accuracy_meaningful`` false).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sparsecal.evaluation.report import _split_rows, print_summary
from sparsecal.evaluation.rows import _sid, batches, run_batch
from sparsecal.formats.errors import UserError

console = Console(stderr=True)
DEFAULT_SEED = 1009  # base seed of evaluation prompts; calibration runs default to 0


@dataclass
class EvalRequest:
    """What `sparsecal eval` is asked. Options left None take the value recorded in an existing
    EVAL directory, else the default (``DEFAULTS``)."""

    export: Path
    out: Path
    model: str | None = None
    tasks: list | None = None
    lengths: list | None = None
    samples: int | None = None
    seed: int | None = None
    methods: str | None = None
    dtype: str | None = None
    device: str | None = None
    reuse_last_threshold: bool | None = None
    calibration: Path | None = None
    held_out_tasks_only: bool = False
    holdout_tasks: list | None = None  # task families that must be held out (added to tasks); see inputs.split_of
    extrapolate: bool | None = None    # BLASST past its law's validated lengths: a/L (True) or dense (evaluation/laws.py)
    bench: list = field(default_factory=list)
    device_map: str | None = None   # placement only, not recorded: "auto" spreads the model over the GPUs
    max_memory: str | None = None   # budgets of --device-map auto ("0=20GiB,cpu=64GiB")
    dispatch: str | None = None     # off | on | both: BSFA and BLASST with the export's dispatch record
    speed_only: bool | None = None  # no accuracy rows (a random-weight checkpoint): timing only
    time: bool = False              # the timing phase after the rows (timing.py)
    time_only: bool = False         # the timing phase alone, on the rows EVAL holds
    timing: object = None           # timing.TimingOptions (None: its defaults)
    time_lengths: list | None = None  # the timing phase at these lengths only (others' records kept)
    batch: int = 1                  # prompts of one length run together (rows independent; not recorded)


DEFAULTS = {"model": "smollm2", "tasks": ["niah_single", "niah_multikey", "vt", "cwe", "text"],
            "lengths": [1024, 2048, 4096], "samples": 1, "seed": DEFAULT_SEED, "methods": "dense",
            "dtype": "float32", "device": "cpu", "reuse_last_threshold": False, "holdout_tasks": None,
            "dispatch": "off", "speed_only": False, "extrapolate": False}
RECORDED = tuple(DEFAULTS)
DISPATCH_MODES = ("off", "on", "both")


def resolve(req: EvalRequest) -> EvalRequest:
    """Fill the options left None from EVAL's manifest (a resumed evaluation), else the defaults."""
    from sparsecal.evaluation.store import EvalStore

    have = (EvalStore.read_manifest(req.out) or {}).get("request", {})
    for name in RECORDED:
        if getattr(req, name) is None:
            setattr(req, name, have.get(name, DEFAULTS[name]))
    req.tasks = list(req.tasks) + [t for t in req.holdout_tasks or [] if t not in req.tasks]
    return req


def check_options(req: EvalRequest) -> None:
    """Every option that can be judged without the model, the export or EVAL's manifest: before
    ranks start and before anything is read or loaded (options left None are judged after
    ``resolve``, which runs this again)."""
    from sparsecal.capture import prompts as P
    from sparsecal.capture.distributed import check_placement
    from sparsecal.capture.models import check_dtype_device
    from sparsecal.evaluation.laws import check_extrapolate
    from sparsecal.evaluation.methods import parse_methods
    from sparsecal.evaluation.summary import read_bench
    from sparsecal.formats.errors import unknown

    if req.methods is not None:
        parse_methods(req.methods)
    if req.dispatch is not None and req.dispatch not in DISPATCH_MODES:
        raise UserError(f"--dispatch {req.dispatch!r} is not one of {', '.join(DISPATCH_MODES)}.")
    if (req.time or req.time_only) and req.device_map:
        raise UserError("--time and --time-only time a model on one device; leave out --device-map.")
    check_extrapolate(req.extrapolate, req.methods)
    for t in (req.tasks or []) + (req.holdout_tasks or []):
        if t not in P.TASKS:
            raise unknown("task", t, P.TASKS)
    bad = [n for n in req.lengths or [] if n < 1]
    if bad:
        raise UserError(f"--lengths {bad[0]} is not a positive token count; give values of at least 1.")
    if req.dtype is not None or req.device is not None:
        check_dtype_device(req.dtype or DEFAULTS["dtype"], req.device or DEFAULTS["device"])
    check_placement(req.device_map, req.max_memory, req.device or DEFAULTS["device"])
    if req.calibration is not None and not Path(req.calibration).is_dir():
        raise UserError(f"--calibration {req.calibration} is not a directory; give the run the export was fitted "
                        "from, or leave it out.")
    if not Path(req.export).is_dir():
        raise UserError(f"export {req.export} is not a directory; make one with `sparsecal export RUN --out DIR`.")
    for path in req.bench:
        if not Path(path).is_file():
            raise UserError(f"--bench {path} {'is a directory' if Path(path).is_dir() else 'does not exist'}; give "
                            "a result file written by `sparsecal bench` (JSON) or its Parquet table.")
    read_bench(req.bench)  # each --bench file exists and is a bench result: refused now, not after every row


def request_record(req: EvalRequest, methods) -> dict:
    """The manifest's request: what a resumed evaluation must match."""
    from dataclasses import replace

    rec = {f.name: getattr(req, f.name) for f in fields(req) if f.name in RECORDED}
    rec["methods"] = ",".join(dict.fromkeys(replace(m, dispatch=False).label for m in methods))
    for name in ("dispatch", "speed_only", "extrapolate"):  # at their defaults, absent: older evaluations still resume
        if rec.get(name) == DEFAULTS[name]:
            del rec[name]
    return rec


def expand_dispatch(methods: list, mode: str) -> list:
    """Each BSFA and BLASST method without (``off``), with (``on``) or without and with (``both``)
    the export's dispatch record; the others as they are. ``dense`` (the reference) always runs
    without it; with ``on`` or ``both``, ``dense+dispatch`` (every prefill layer on the record's
    SDPA, sparsify's one dense path under dispatch) is added as a noise floor: what the dispatched
    methods' dense layers alone move."""
    from dataclasses import replace

    from sparsecal.evaluation.methods import DISPATCHED

    out = []
    for m in methods:
        if m.name not in DISPATCHED:
            out.append(m)
            continue
        out += [m] if mode == "off" else [replace(m, dispatch=True)] if mode == "on" else [m, replace(m, dispatch=True)]
    if mode in ("on", "both") and any(m.dispatch for m in out):
        from sparsecal.evaluation.methods import Method

        out.append(Method("dense", dispatch=True))
    return out


@dataclass
class Plan:
    """What the checks found: the methods (dense first), the model, the export, the calibration."""

    methods: list
    ms: object        # models.ModelSpec
    info: dict        # models.model_info
    export: object    # inputs.ExportInfo
    cal: object       # inputs.Calibration


def _check(req: EvalRequest) -> Plan:
    """Every check that needs neither the tokenizer nor the model."""
    from sparsecal.capture import prompts as P
    from sparsecal.capture.models import DTYPES, resolve_model
    from sparsecal.capture.runner import check_lengths as check_context
    from sparsecal.evaluation.inputs import check_holdout, check_lengths, check_methods, find_calibration, load_export
    from sparsecal.evaluation.methods import parse_methods, with_dense

    methods = with_dense(expand_dispatch(parse_methods(req.methods), req.dispatch))
    if req.dtype not in DTYPES:
        raise UserError(f"Unknown dtype '{req.dtype}'. Available: {', '.join(DTYPES)}.")
    for t in req.tasks:
        if t not in P.TASKS:
            from sparsecal.formats.errors import unknown
            raise unknown("task", t, P.TASKS)
    ms = resolve_model(req.model)
    info = dict(_model_info(ms))
    export = load_export(req.export, info)
    check_methods(methods, export)
    if req.dispatch != "off" and not export.dispatch and any(m.dispatch for m in methods):
        raise UserError(f"--dispatch {req.dispatch}: export {export.path} holds no dispatch record; make one with "
                        "`sparsecal export RUN --out DIR --break-even FILE`, or evaluate with --dispatch off.")
    check_context(req.lengths, info["max_context"])
    check_lengths(req.lengths, methods, export, req.reuse_last_threshold)
    cal = find_calibration(export, req.calibration, info["id"])
    check_holdout(req.holdout_tasks, cal)
    if req.held_out_tasks_only and cal.manifest is None:
        raise UserError("--held-out-tasks-only needs the calibration run: pass --calibration RUN.")
    seen = [t for t in req.tasks if t in cal.tasks]
    if req.held_out_tasks_only and seen:
        raise UserError(f"task {seen[0]} was a calibration task of {cal.manifest}; drop it from --tasks "
                        "or leave out --held-out-tasks-only.")
    return Plan(methods, ms, info, export, cal)


@functools.lru_cache(maxsize=4)
def _model_info(ms) -> dict:
    """The model's identity and geometry (a GGUF's config takes seconds to parse: read once)."""
    from sparsecal.capture.models import load_config, model_info

    return model_info(ms, load_config(ms))


@functools.lru_cache(maxsize=2)
def _tokenizer(ms):
    from sparsecal.capture.models import load_tokenizer

    return load_tokenizer(ms)


def _prompts(req: EvalRequest, plan: Plan):
    """(tokenizer, prompts): the task prompts, checked disjoint from the calibration prompts."""
    from sparsecal.capture import prompts as P
    from sparsecal.evaluation.inputs import check_disjoint

    tok = _tokenizer(plan.ms)
    prompts = P.build_task_prompts(tok, req.tasks, req.lengths, req.samples, req.seed)
    check_disjoint(prompts, plan.cal, req.seed)
    return tok, prompts


def _manifest(req: EvalRequest, plan: Plan, prompts=None) -> dict:
    """The manifest (with the planned prompts when given), in the types a re-read one has."""
    import json

    from sparsecal.evaluation.inputs import HELD_OUT, split_of
    from sparsecal.formats.run import versions

    man = {"request": request_record(req, plan.methods), "model": plan.info, "export": plan.export.identity(),
           "export_path": str(plan.export.path), "calibration": plan.cal.record(), "versions": versions(),
           "dispatch": plan.export.dispatch}
    if prompts is not None:
        split = {t: split_of(t, plan.cal, req.holdout_tasks) for t in req.tasks}
        held = {t: None if s is None else s == HELD_OUT for t, s in split.items()}
        man["prompts"] = [{"id": _sid(p), "task": p.task, "length": p.length, "index": p.index, "seed": p.seed,
                           "answer": p.answer, "held_out_task": held[p.task], "split": split[p.task],
                           "corpus": p.meta.get("source")} for p in prompts]
    return json.loads(json.dumps(man))


@dataclass
class EvalJob:
    """What rank 0 hands every rank after the checks (all of it for one process)."""

    req: EvalRequest  # with the options a resumed evaluation recorded
    plan: Plan
    todo: list        # (prompt, [methods it lacks]) in prompt order


def eval_command(req: EvalRequest) -> dict:
    """Run (or resume) the evaluation; write the summary, results and, with bench files, curves.
    One process, or one rank of ``torchrun ... -m sparsecal.cli eval`` (capture/distributed.py):
    rank 0 checks and plans while the others wait, every rank evaluates its share of the prompts
    into its own row file, and rank 0 merges the rows and writes the summary."""
    from sparsecal.capture import distributed
    from sparsecal.evaluation.store import EvalStore

    ranks = distributed.start()
    if ranks.several and (req.time or req.time_only):
        raise UserError("--time runs in one process: evaluate with torchrun first, then run the same command "
                        "with --time-only and without torchrun.")
    job = ranks.lead(lambda: _prepare(req, ranks))
    if job.todo and not req.time_only:
        _run(job, ranks)
    written = {}
    if ranks.main:
        store = EvalStore.open(job.req.out)
        store.merge_parts()
        if req.time or req.time_only or job.req.speed_only:
            timing_phase(job, store)
        written = finish(store, job.req.bench)
    ranks.gather(None)  # the ranks leave together, then close their process group in the normal flow:
    distributed.close()  # left to interpreter exit, gloo aborted ("terminate called without an active exception")
    return written


def _prepare(req: EvalRequest, ranks) -> EvalJob:
    """Every check, then the evaluation directory created or resumed, and what is left to run."""
    from sparsecal.evaluation.store import EvalStore

    req = resolve(req)
    check_options(req)
    plan = _check(req)
    if plan.cal.manifest is None:
        console.print("[yellow]warning:[/] no calibration run found next to the export; prompts are not "
                      "checked against calibration prompts (pass --calibration RUN)")
    if plan.export.dispatch:
        d = plan.export.dispatch
        console.print(f"the export holds a dispatch record ({d['name']}, {d['gpu']}): BSFA and BLASST prefills run "
                      "SDPA where it says the sparse kernel does not pay, as sparsify does; the rows measure that")
    from sparsecal.evaluation.laws import plan_lines

    for line in plan_lines(plan.methods, plan.export.path, req.lengths, req.extrapolate):
        console.print(f"[yellow]note:[/] {line}", soft_wrap=True)
    store, prompts = EvalStore.resume(req.out, _manifest(req, plan)), None
    if store is None:
        prompts = [] if req.speed_only else _prompts(req, plan)[1]
        store = EvalStore.create(req.out, dict(_manifest(req, plan, prompts), dispatch_option=req.dispatch))
    _check_dispatch_rows(store)
    store.merge_parts()  # rows a stopped rank of an earlier run left in its own file
    labels = [m.label for m in plan.methods]
    pending = store.pending(labels)
    console.print(f"[bold]sparsecal eval[/] {plan.ms.spec} on {plan.export.path} -> {req.out}: "
                  f"{len(store.manifest['prompts'])} prompts x {len(labels)} methods, "
                  f"{sum(map(len, pending.values()))} rows to compute, {len(store.rows)} finished"
                  + (f", on {ranks.world} ranks" if ranks.several else ""))
    if not pending or req.time_only:
        if pending:
            console.print(f"[yellow]warning:[/] --time-only: {sum(map(len, pending.values()))} rows are not "
                          "evaluated yet; their configurations are timed against the rows there are")
        return EvalJob(req, plan, [])
    if prompts is None:
        prompts = _prompts(req, plan)[1]
        if [_sid(p) for p in prompts] != [p["id"] for p in store.manifest["prompts"]]:
            raise UserError(f"{req.out} was planned with other prompt tokens (another tokenizer?); "
                            "evaluate again into a new --out directory.")
    by_label = {m.label: m for m in plan.methods}
    return EvalJob(req, plan, [(p, [by_label[x] for x in pending[_sid(p)]]) for p in prompts if _sid(p) in pending])


def _check_dispatch_rows(store) -> None:
    """Refuse to resume an evaluation made before --dispatch existed whose export has a dispatch
    record: its BSFA and BLASST rows ran dispatched under the labels that now mean dispatch off."""
    from sparsecal.evaluation.methods import DISPATCHED

    man = store.manifest
    if man.get("dispatch") and "dispatch_option" not in man and any(r["method"] in DISPATCHED for r in store.rows):
        raise UserError(f"{store.root} was evaluated before --dispatch existed, with the export's dispatch record: "
                        "its BSFA and BLASST rows ran dispatched; evaluate again into a new --out directory.")


def _run(job: EvalJob, ranks) -> None:
    """Evaluate this rank's share of the pending prompts (each rank into its own row file)."""
    from sparsecal.capture import distributed
    from sparsecal.capture.models import load_for_rank
    from sparsecal.evaluation.store import EvalStore

    req, plan = job.req, job.plan
    store = EvalStore.open(req.out)
    if ranks.several:
        store.own_rows(ranks.rank)
    mine = ranks.share(job.todo, weight=lambda item: item[0].length * len(item[1]))
    tok = _tokenizer(plan.ms)
    device = ranks.device(req.device)
    from sparsecal.evaluation.timing import gpu_lock

    with gpu_lock(device, exclusive=False, say=console.print):  # the timing phase waits for every holder
        model = load_for_rank(ranks, plan.ms, req.dtype, req.device, req.device_map, req.max_memory, console)
        if ranks.main:  # which code on which machine makes these rows (rank 0 writes the manifest)
            store.note_run("rows", world=ranks.world, device=req.device, batch=req.batch)
        rows = _rows(model, tok, store, plan, mine, req.batch)
        if ranks.several:
            for group in rows:
                store.add_rows(group)
                for row in group:
                    console.print(f"{ranks.tag}{row['sample_id']} {row['label']}: score {row['score']:.2f}, "
                                  f"top-1 {row['top1']:.3f}, KL {row['kl']:.2e}", soft_wrap=True)
        else:
            _with_bars(store, plan, rows)
    peaks = ranks.gather(distributed.peak_memory(model, device))  # every rank is done
    if ranks.main and distributed.memory_line(peaks):
        console.print(distributed.memory_line(peaks), soft_wrap=True)


def _rows(model, tok, store, plan: Plan, todo, batch: int = 1):
    """Every row of ``todo``'s prompts, a method's rows of one batch of prompts at a time."""
    from sparsecal.evaluation.model import eos_ids

    stop = eos_ids(model, tok)
    for group in batches(todo, batch):
        yield from run_batch(model, tok, [p for p, _ in group], plan.methods, [m for _, m in group],
                             plan.export.path, store.manifest, stop)


def _with_bars(store, plan: Plan, rows) -> None:
    """Record each row, with one progress bar per method."""
    total = len(store.manifest["prompts"])
    with Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[acc]}"), TimeElapsedColumn(), console=console) as bar:
        jobs = {m.label: bar.add_task(m.label, total=total, acc="") for m in plan.methods}
        for label, job in jobs.items():
            bar.update(job, completed=sum(r["label"] == label for r in store.rows), acc=_so_far(store, label))
        for group in rows:
            store.add_rows(group)
            label = group[0]["label"]
            bar.update(jobs[label], advance=len(group), acc=_so_far(store, label))
            if not console.is_terminal:  # a log file sees no live bar: one line per batch and method
                done = int(bar.tasks[jobs[label]].completed)
                console.print(f"{time.strftime('%H:%M:%S')} {label} {done}/{total} {_so_far(store, label)}  "
                              f"batch {_batch_seconds(group)}",
                              soft_wrap=True)


def _batch_seconds(rows: list) -> str:
    """Where one batch's wall time went (the rows' timing columns summed over the batch)."""
    parts = {k: sum(r.get(f"{k}_s") or 0.0 for r in rows) for k in ("prefill", "decode", "answer", "fidelity")}
    return " ".join(f"{k} {v:.2f}s" for k, v in parts.items())


def _so_far(store, label: str) -> str:
    """Per-configuration accuracy so far: mean score, top-1 agreement and KL of its rows."""
    rows = [r for r in store.rows if r["label"] == label]
    if not rows:
        return ""
    mean = lambda key: sum(r[key] for r in rows) / len(rows)
    return f"acc {mean('score'):.2f}  top1 {mean('top1'):.3f}  kl {mean('kl'):.4f}"


def timing_phase(job: EvalJob, store) -> None:
    """The timing phase (evaluation/timing.py): one process, the GPU's lock held exclusively, the
    model loaded again on ``--device``; every timed configuration on one of its own evaluated
    prompts (random ids for --speed-only); records to EVAL/data/timing.parquet."""
    import polars as pl
    import torch

    from sparsecal.capture.models import load_model
    from sparsecal.evaluation.store import TIMING, read_timing, write_parquet
    from sparsecal.evaluation.timing import TimingOptions, gpu_lock, other_gpu_processes, run_timing

    req, plan = job.req, job.plan
    opts = req.timing or TimingOptions()
    speed_only = bool(store.manifest["request"].get("speed_only"))
    ids = None if speed_only else _prompt_ids(plan, store)
    lengths = sorted({r["length"] for r in store.rows}) if not speed_only else req.lengths
    if req.time_lengths:
        lengths = [n for n in lengths if n in req.time_lengths]
    with gpu_lock(req.device, exclusive=True, say=console.print):
        others = [other_gpu_processes(req.device)]
        console.print(f"[bold]timing phase[/] on {req.device}: {len(lengths)} lengths, {opts.rounds} round-robin rounds")
        model = load_model(plan.ms, req.dtype, req.device)
        store.note_run("timing", device=req.device)
        records = run_timing(model, plan.methods, lengths, plan.export.path, plan.info["id"], store.rows, ids, opts,
                             say=lambda line: console.print(line, soft_wrap=True),
                             extrapolate=(store.manifest.get("request") or {}).get("extrapolate", False))
        others.append(other_gpu_processes(req.device))
        del model
    if not records:
        console.print(f"[yellow]warning:[/] nothing to time at {lengths or 'no length'}: no evaluated rows there")
        return
    dev = torch.device(req.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    known = [n for n in others if n is not None]
    for r in records:
        r.update(speed_device=name, gpu_other_processes=max(known) if known else None, speed_only=speed_only,
                 dtype=req.dtype, rounds=opts.rounds, reps=opts.reps, warmup=opts.warmup, decode_steps=opts.decode_steps)
    if known and max(known):
        console.print(f"[yellow]warning:[/] {max(known)} other processes used the GPU during the timing phase; "
                      "the timings are recorded with that count (gpu_other_processes)")
    new = pl.DataFrame(records, infer_schema_length=None)
    old = read_timing(store.root)  # records of lengths not timed now stay
    if old is not None and new.height:
        old = old.join(new.select("label", "length"), on=["label", "length"], how="anti")
        new = pl.concat([old, new], how="diagonal_relaxed") if old.height else new
    write_parquet(store.root / TIMING, new.sort(["length", "label"]))


def _prompt_ids(plan: Plan, store):
    """sample id -> prompt token ids, rebuilt from the prompt's manifest entry (task, length, seed,
    index) when first asked and checked against its id."""
    from sparsecal.capture.prompts.tasks import build_sample

    entry = {p["id"]: p for p in store.manifest["prompts"]}

    @functools.cache
    def ids(sid: str) -> list:
        p = entry[sid]
        s = build_sample(_tokenizer(plan.ms), p["task"], p["length"], p["seed"], p["index"])
        if _sid(s) != sid:
            raise UserError(f"{store.root} was planned with other prompt tokens (another tokenizer?); time it with "
                            "the model it was evaluated with.")
        return s.input_ids
    return ids


def finish(store, bench_files=()) -> dict:
    """Write data/summary.parquet and results.json from the rows and the timing phase's records,
    and curves.parquet when there are timings or bench files (bench rows that are not an evaluated
    configuration are refused); print the summary. Returns the paths written."""
    import json

    import polars as pl

    from sparsecal.evaluation.intervals import cells
    from sparsecal.evaluation.laws import law_cells, law_lines
    from sparsecal.evaluation.store import CURVES, RESULTS, SUMMARY, read_timing, write_parquet
    from sparsecal.evaluation.summary import check_bench, curves, noise_floor, read_bench, result_rows, summarize
    from sparsecal.evaluation.timing import print_speed, with_speed
    from sparsecal.formats.files import atomic_write_text
    from sparsecal.formats.provenance import provenance

    timing = read_timing(store.root)
    if not store.rows and timing is None:
        return {}
    prov = dict(provenance(), eval=str(store.root), export=store.manifest["export_path"],
                model=store.manifest["model"]["id"], rows_versions=store.manifest.get("versions"),
                rows_device=store.manifest["request"].get("device"))  # the rows may come from another machine
    summary = ci = None
    written = {}
    if store.rows:
        ci = cells(store.rows)  # the bootstrap, once for the summary, the result rows and the curves
        summary = summarize(store.rows, ci)
        write_parquet(store.root / SUMMARY, summary)
        written["summary"] = store.root / SUMMARY
    bench, bench_prov = read_bench(bench_files) if bench_files else (pl.DataFrame(), [])
    cur = curves(summary, bench, ci, timing)
    meaningful = not store.manifest["request"].get("speed_only")
    doc = {"kind": "sparsecal-eval", "rows": with_speed(result_rows(summary, ci) if summary is not None else [], cur),
           "noise_floor": noise_floor(summary) if summary is not None else [], "accuracy_meaningful": meaningful,
           "provenance": prov, "request": store.manifest["request"], "calibration": store.manifest["calibration"],
           "dispatch": store.manifest.get("dispatch"), "splits": _split_rows(summary), "timing": timing is not None,
           "laws": law_cells(store.rows)}
    atomic_write_text(store.root / RESULTS, json.dumps(doc, indent=1, allow_nan=False))
    written["results"] = store.root / RESULTS
    if bench.height:
        check_bench(bench, cur)
    if bench.height or timing is not None:
        meta = {"kind": "sparsecal-curves", "eval_provenance": json.dumps(prov),
                "bench_provenance": json.dumps(bench_prov), "accuracy_meaningful": json.dumps(meaningful)}
        write_parquet(store.root / CURVES, cur, metadata=meta)
        written["curves"] = store.root / CURVES
    if summary is not None:
        print_summary(summary, store.root)
        for line in law_lines(store.rows, store.manifest["request"].get("extrapolate", False)):
            Console(width=max(170, Console().width)).print(line, soft_wrap=True)
    if timing is not None:
        print_speed(cur, meaningful)
    return written

