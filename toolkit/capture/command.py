"""The capture command's steps in the order that refuses bad input before any work: resolve the
model, check the output directory and lengths, build the prompts, then load and capture."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sparsecal.formats.errors import UserError

console = Console(stderr=True)


@dataclass
class CaptureRequest:
    out: Path
    model: str = "smollm2"
    tasks: list = field(default_factory=lambda: ["niah_single"])
    lengths: list = field(default_factory=lambda: [1024, 2048, 4096])
    samples: int = 1
    seed: int = 0
    prompts_file: Path | None = None
    block_m: int = 128
    block_n: int = 64
    k_values: list = field(default_factory=lambda: [4, 8, 16, 32, 64])
    decode_rows: int = 64
    raw: bool = False
    orders: list = field(default_factory=lambda: ["forward", "reverse", "sink_local"])
    dtype: str = "float32"
    device: str = "cpu"
    backend: str = "auto"  # auto | triton | reference
    add: bool = False       # allow prompts the run did not plan yet (another task, more lengths)
    layers: str | None = None  # "0,3,8-11": capture only these layers (the rest run dense)
    device_map: str | None = None  # "auto": accelerate spreads the model over the GPUs
    max_memory: str | None = None  # --max-memory "0=20GiB,1=20GiB,cpu=64GiB" (with --device-map auto)
    profile: bool = False   # --profile: per-sample phases, printed and in each sample.json


def stats_config(req: CaptureRequest):
    from sparsecal.formats.stats_config import StatsConfig

    ks = sorted(set(req.k_values))
    if ks[0] < 1:
        raise UserError(f"--k values must be positive integers, got {req.k_values}.")
    from sparsecal.formats.geometry import ORDERS

    for o in req.orders:
        if o not in ORDERS:
            from sparsecal.formats.errors import unknown
            raise unknown("scan order", o, ORDERS)
    if not req.orders or len(set(req.orders)) != len(req.orders):
        raise UserError(f"--orders must name distinct scan orders from {', '.join(ORDERS)}, got {req.orders}.")
    return StatsConfig(block_m=req.block_m, block_n=req.block_n, k_values=tuple(ks), orders=tuple(req.orders),
                       decode_rows=req.decode_rows, raw=req.raw)


def build_prompts(req: CaptureRequest, ms, max_context, vocab_size=None):
    """Task prompts and/or the user's prompts file, validated against the model's context."""
    from sparsecal.capture import prompts as P
    from sparsecal.capture.models import load_tokenizer
    from sparsecal.capture.runner import check_lengths

    for t in req.tasks:
        if t not in P.TASKS:
            from sparsecal.formats.errors import unknown
            raise unknown("task", t, P.TASKS)
    if req.tasks:
        check_lengths(req.lengths, max_context)
    tok = _LazyTokenizer(lambda: load_tokenizer(ms))
    out = P.build_task_prompts(tok.get(), req.tasks, req.lengths, req.samples, req.seed) if req.tasks else []
    if req.prompts_file:
        from_file = P.load_prompts_file(req.prompts_file, tok, vocab_size)
        for s in from_file:
            if max_context and s.length > max_context:
                raise UserError(f"{req.prompts_file} line {s.index}: {s.length} tokens is over the model's "
                                f"context of {max_context}; shorten it.")
        out += from_file
    return out


def check_additions(store, prompts, add: bool) -> None:
    """An existing run takes prompts it did not plan only with --add; then its fit and export
    (made before them) are reported stale."""
    from sparsecal.capture.runner import pending

    planned = {r["id"] for r in store.manifest["samples"]}
    new = [r for r, _ in pending(store, prompts)[0] if r["id"] not in planned]
    if new and not add:
        tasks = sorted({r["task"] for r in new})
        raise UserError(f"{store.root} holds another set of prompts; {len(new)} of these are new to it (tasks "
                        f"{', '.join(tasks)}): add them with --add, or use a new --out directory.")
    stale = [d for d in ("fit", "export") if (store.root / d).is_dir()]
    if new and stale:
        console.print(f"[yellow]warning:[/] {store.root}/{' and '.join(stale)} predate the {len(new)} added samples: "
                      f"run `sparsecal fit {store.root}` (and export) again once the capture is done.")


def layer_scope(req: CaptureRequest, hf_cfg, info: dict, prompts) -> dict:
    """{"layers": captured layer indices, "layer_notes": {layer: why it runs dense}}."""
    from sparsecal.formats.layers import layer_specs, parse_layers, plan_layers

    requested = parse_layers(req.layers, info["num_layers"])
    layers, notes = plan_layers(layer_specs(hf_cfg), requested, max(p.length for p in prompts), info["model_type"])
    return {"layers": layers, "layer_notes": notes}


def print_layer_scope(scope: dict, num_layers: int) -> None:
    """One line: how many layers are captured, and why the others are not."""
    if not scope["layer_notes"]:
        return
    reasons: dict[str, list[str]] = {}
    for i, why in scope["layer_notes"].items():
        reasons.setdefault(why, []).append(i)
    console.print(f"capturing {len(scope['layers'])} of {num_layers} layers; not captured: " +
                  "; ".join(f"layers {', '.join(ids)}: {why}" for why, ids in reasons.items()))


class _LazyTokenizer:
    """Loads the tokenizer on first use, so token-id prompt files need none."""

    def __init__(self, load):
        self._load, self._tok = load, None

    def get(self):
        if self._tok is None:
            self._tok = self._load()
        return self._tok

    def __call__(self, *args, **kwargs):
        return self.get()(*args, **kwargs)

    def __len__(self):
        return len(self.get())


@dataclass
class CaptureJob:
    """What rank 0 hands every rank after the checks (all of it for one process)."""

    cfg: object    # StatsConfig
    ms: object     # models.ModelSpec
    backend: str
    total: int     # prompts asked for
    todo: list     # their (record, prompt) pairs not finished yet, in prompt order


def capture_command(req: CaptureRequest) -> None:
    """One process, or one rank of ``torchrun ... -m sparsecal.cli capture`` (capture/distributed.py):
    rank 0 checks and plans while the others wait, then every rank captures its share. With several
    ranks every rank starts loading its model and warming its kernels up (``Early``, on a thread)
    before it joins the process group: rank 0's checks and the other ranks' wait for its plan (and
    the group's rendezvous) run beside it."""
    from sparsecal.capture import distributed
    from sparsecal.capture.profile import Startup

    clock = Startup()
    mine = distributed.from_env()
    early = Early(req, mine, clock) if mine.several else None
    ranks = distributed.start()
    if ranks.several:
        clock.mark("group")

    def checked():
        job = prepare(req, ranks)
        clock.mark("checked")
        return job

    job = ranks.lead(checked)
    clock.mark("planned")
    if job.todo:
        capture_share(req, job, ranks, clock, early.model() if early is not None else None)


# The GIL's switch interval while a rank's model loads beside its checks: the loading thread gives
# the GIL up in every torch op and file read and waits up to this long to get it back from a
# thread running Python (CPython's default, 5 ms, per op; capture/profile.py's notes).
EARLY_SWITCH_S = 0.0005


class Early:
    """This rank's model, loaded and warmed up on a thread before rank 0's plan arrives. The options
    were checked before the ranks started (cli/options.py), so only rank 0's checks of the model,
    prompts and run directory run beside it; a failure here (an unreadable checkpoint) is raised where
    the model is needed, after those checks, so a bad input is still reported by the check that names
    it. The warm-up is one instrumented forward of ``warm_length`` tokens: Triton's kernels for these
    shapes come from its on-disk cache (TRITON_CACHE_DIR, capture/distributed.shared_defaults) or are
    compiled once, CUDA's libraries and the model's first-call paths start, before the first sample.
    While the thread runs, the GIL's switch interval is ``EARLY_SWITCH_S`` (restored in ``model``).
    The rank ends with os._exit (cli._exit) when it stops early, so the thread is never joined then."""

    def __init__(self, req: CaptureRequest, ranks, clock, background: bool = True):
        self.req, self.ranks, self.clock = req, ranks, clock
        self._model, self._error, self._thread, self._interval = None, None, None, None
        if background:
            import sys
            import threading

            import transformers  # noqa: F401 - imported whole before two threads ask its lazy module for names
            from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

            clock.mark("imported")
            self._interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._interval, EARLY_SWITCH_S))
            self._thread = threading.Thread(target=self._run, name="sparsecal-early-load", daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        from sparsecal.capture.models import load_for_rank, resolve_model

        try:
            model = load_for_rank(self.ranks, resolve_model(self.req.model), self.req.dtype, self.req.device, None,
                                  None, console)
            self.clock.mark("loaded")
            warm_up(model, self.req)
            self.clock.mark("warmed")
            self._model = model
        except BaseException as e:  # noqa: BLE001 - raised again where the model is needed
            self._error = e

    def model(self):
        """The warmed-up model (waits for rank 0's thread); the load's error, if it failed."""
        if self._thread is not None:
            import sys

            self._thread.join()
            sys.setswitchinterval(self._interval)
        if self._error is not None:
            raise self._error
        return self._model


def warm_length(req: CaptureRequest, max_context: int | None, cuda: bool) -> int:
    """The warm-up prompt's tokens: on CUDA 16 query and key tiles' lcm (2048 at 128 x 64), so that
    the token count and the tile counts are multiples of 16 like a long prompt's and Triton picks the
    same specialisation; on a CPU one lcm (its reference path compiles nothing). At most the model's
    context."""
    import math

    tiles = math.lcm(req.block_m, req.block_n) * (16 if cuda else 1)
    return max(1, min(tiles, max_context or tiles))


def warm_up(model, req: CaptureRequest) -> None:
    """One instrumented forward of ``warm_length`` tokens through the run's backend; nothing stored."""
    from sparsecal.capture.runner import capture_sample

    cuda = model.device.type == "cuda"
    n = warm_length(req, getattr(model.config, "max_position_embeddings", None), cuda)
    vocab = getattr(model.config, "vocab_size", None) or 2
    capture_sample(model, [i % vocab for i in range(n)], stats_config(req), backend=req.backend)
    if cuda:
        import torch

        torch.cuda.synchronize(model.device)


def prepare(req: CaptureRequest, ranks) -> CaptureJob:
    """Every check, then the run directory created or resumed and its samples planned."""
    from sparsecal.capture.distributed import check_placement
    from sparsecal.capture.models import check_dtype_device, load_config, model_info, resolve_model
    from sparsecal.capture.runner import pending, resolve_backend
    from sparsecal.formats.run import RunStore

    cfg = stats_config(req)
    check_dtype_device(req.dtype, req.device)
    check_placement(req.device_map, req.max_memory, req.device)
    ms = resolve_model(req.model)
    hf_cfg = load_config(ms)
    info = model_info(ms, hf_cfg)
    backend = resolve_backend(req.backend, req.device, info["head_dim"], req.dtype, cfg.block_m)
    exists = RunStore.check_target(req.out, info, cfg.to_dict(), req.dtype)  # before any heavy work
    prompts = build_prompts(req, ms, info["max_context"], info["vocab_size"])
    if not prompts:
        raise UserError("No prompts: give --task and --lengths, or --prompts-file.")
    scope = layer_scope(req, hf_cfg, info, prompts)
    if exists:
        check_additions(RunStore.open(req.out), prompts, req.add)
    store = RunStore.create_or_resume(req.out, info, cfg.to_dict(), req.dtype, backend, scope)
    where = f" x {ranks.world} ranks" if ranks.several else (" (device map auto)" if req.device_map else "")
    console.print(f"[bold]sparsecal capture[/] {ms.spec} -> {req.out}  ({len(prompts)} samples, "
                  f"BM={cfg.block_m} BN={cfg.block_n}, {req.dtype} on {req.device}{where}, {backend} backend)")
    print_layer_scope(scope, info["num_layers"])
    records, todo = pending(store, prompts)
    store.plan([r for r, _ in records])  # also repairs a plan another writer's lost write dropped
    if not todo:
        console.print(f"all {len(prompts)} samples are already captured in {req.out}")
        print_summary(store)
    return CaptureJob(cfg, ms, backend, len(prompts), todo)


def capture_share(req: CaptureRequest, job: CaptureJob, ranks, clock=None, model=None) -> None:
    """Load the model on this rank's device(s) (unless ``model``: loaded early) and capture this
    rank's share of the unfinished samples; rank 0 then prints the totals, the peak GPU memory and
    the summary."""
    from sparsecal.capture import distributed
    from sparsecal.capture.models import load_for_rank
    from sparsecal.capture.profile import Startup
    from sparsecal.formats.run import RunStore

    try:
        store = RunStore.open(req.out)  # on several hosts: the shared directory rank 0 created
    except UserError:
        raise UserError(f"rank {ranks.rank} does not see the run {req.out} that rank 0 created: with ranks on "
                        "several hosts, --out must be on a filesystem they share.") from None
    mine = ranks.share(job.todo, weight=lambda pair: pair[0]["length"])
    device = ranks.device(req.device)
    if model is None:
        model = load_for_rank(ranks, job.ms, req.dtype, req.device, req.device_map, req.max_memory, console)
    clock = clock or Startup()
    clock.mark("loaded")
    ranks.gather(None)  # the ranks start together: the time below is the capture's own
    t0 = time.perf_counter()
    result = _capture(store, model, [p for _, p in mine], job, ranks, req.profile, clock)
    clock.mark("captured")
    results = ranks.gather(dict(result, peak=distributed.peak_memory(model, device)))
    distributed.close()  # the last collective: close the group now, not at interpreter exit
    if not ranks.main:
        if req.profile:
            console.print(f"{ranks.tag}{clock.line()}", soft_wrap=True)
        return
    seconds, done = time.perf_counter() - t0, sum(r["done"] for r in results)
    console.print(f"captured {done} samples, skipped {job.total - done} already finished, in "
                  f"{seconds:.1f} s" + (f" on {ranks.world} ranks" if ranks.several else "") +
                  f" ({done / max(seconds, 1e-9):.3g} samples/s)", soft_wrap=True)
    peaks = distributed.memory_line([r["peak"] for r in results])
    if peaks:
        console.print(peaks, soft_wrap=True)
    if req.profile:
        print_profile([p for r in results for p in r["profiles"]])
    print_summary(store)
    clock.mark("summary")
    if req.profile:
        console.print(f"{ranks.tag}{clock.line()}", soft_wrap=True)


def _capture(store, model, prompts, job: CaptureJob, ranks, profile: bool = False, clock=None) -> dict:
    """run_capture with progress: a bar for one process, rank-tagged lines for several."""
    from sparsecal.capture.profile import line as profile_line
    from sparsecal.capture.runner import run_capture

    def line(rec, secs, mark=""):
        phases = f"  ({profile_line(rec['profile'])})" if "profile" in rec else ""
        return (f"{ranks.tag}  {rec['id']:<32} {rec['length']:>6} tok  {secs:6.1f} s  "
                f"({rec['length'] / secs:,.0f} tok/s){phases}{mark}")

    if ranks.several:
        def progress(done, total, rec, secs):
            if clock is not None:
                clock.mark("first")
            console.print(line(rec, secs, f"  {done}/{total}"), soft_wrap=True)

        return run_capture(store, model, prompts, job.cfg, progress, job.backend, plan=False, profile=profile)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("capturing", total=job.total)

        def progress(done, total, rec, secs):
            if clock is not None:
                clock.mark("first")
            bar.console.print(line(rec, secs))
            bar.update(task, completed=job.total - total + done)

        return run_capture(store, model, prompts, job.cfg, progress, job.backend, plan=False, profile=profile)


def print_profile(profiles: list[dict]) -> None:
    """The --profile table: seconds per sample in each phase (mean over the samples), and its share."""
    from sparsecal.capture.profile import PHASES, totals

    if not profiles:
        return
    tot = totals(profiles)
    table = Table(title=f"where a sample's time goes (mean of {tot['samples']} samples)")
    for col in ("phase", "s/sample", "share of wall"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for p in (*PHASES, "wall"):
        table.add_row(p, f"{tot[p] / tot['samples']:.4f}", f"{tot[p] / max(tot['wall'], 1e-12):.1%}")
    Console(width=max(100, Console().width)).print(table)
    if any(r.get("write_overlapped") for r in profiles):
        console.print("serialize and disk ran on a background thread, beside the next sample's forward")


def print_summary(store) -> None:
    from sparsecal.capture.summary import SUMMARY_LAMBDA, run_summary

    table = Table(title=f"{store.root}: {store.manifest['model']['id']}")
    for col in ("task", "tokens", "samples", "s/sample", f"sparsity λ={SUMMARY_LAMBDA:g}",
                "mass kept", "sink rows"):
        table.add_column(col, justify="left" if col == "task" else "right")
    for r in run_summary(store):
        table.add_row(r["task"], str(r["length"]), str(r["samples"]), f"{r['seconds']:.1f}",
                      f"{r['sparsity']:.3f}", f"{r['retained_mass']:.4f}", f"{r['sink_rows']:.3f}")
    Console(width=max(100, Console().width)).print(table)
    console.print("sparsity and mass kept: BLASST at a fixed lambda, forward order; sink rows: share of rows "
                  "whose running max settles on block 0 (means over layers, heads, samples)")
