"""The ``sparsecal`` command line. Heavy layers are imported inside the subcommands so that
``sparsecal --help`` answers instantly. Bad input prints one ``error:`` line and exits 2."""
from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

import typer

from sparsecal.formats.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Calibrate block-sparse attention (BSFA, BLASST) on a real model.")

DEFAULT_TASKS = "niah_single,niah_multikey,vt,cwe,text"
DEFAULT_LENGTHS = "1024,2048,4096"
DEMO_LENGTHS = "1024,2048"  # the demo's own capture: 10 prompts, about 2 minutes on a 2-core CPU
DEMO_TARGETS = [0.3, 0.5]  # what 1K/2K prompts reach (SmolLM2 prefill skips at most ~0.6 at 2K)
# The committed SmolLM2 calibration (1K-8K on an H100), served by the demo while its capture runs.
COMMITTED_CALIBRATION = Path(__file__).resolve().parents[2] / "data" / "calibration" / "smollm2-1k-8k"


def _out_of_memory(e: BaseException) -> str | None:
    """torch's first sentences of an allocation that failed (CUDA's OutOfMemoryError, the CPU allocator's
    RuntimeError), None for any other error. torch is looked up, not imported: ``--help`` stays light."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(e, RuntimeError):
        return None
    text = str(e)
    if isinstance(e, torch.OutOfMemoryError):
        return ". ".join(text.split(". ")[:3])
    cpu = text.find("DefaultCPUAllocator: can't allocate memory")
    return None if cpu < 0 else text[cpu:].split(". ")[0]


def _user_errors(fn):
    """Turn UserError (and an OS error on a path, and memory the device does not have) into one line on
    stderr and exit code 2; Ctrl-C into a resume hint."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
        except RuntimeError as e:
            what = _out_of_memory(e)
            if what is None:
                raise
            typer.echo(f"error: out of memory ({what}); use shorter prompts or --lengths, a smaller --batch where "
                       "the command has one, or a device with more memory. Finished work is kept: run the same "
                       "command again to resume.", err=True)
            raise typer.Exit(2)
        except OSError as e:  # permission, read-only or full file system on a path the user gave
            if e.filename is None:
                raise
            typer.echo(f"error: {e.filename}: {e.strerror}; choose a writable path with free space.", err=True)
            raise typer.Exit(2)
        except KeyboardInterrupt:
            typer.echo("interrupted: finished samples are kept; run the same command again to resume.", err=True)
            raise typer.Exit(130)
    return wrapper


def _list(text: str, name: str, cast, kind: str, example: str) -> list:
    from sparsecal.cli.options import parse_list

    return parse_list(text, name, cast, kind, example)


def _int_list(text: str, name: str) -> list[int]:
    return _list(text, name, int, "integers", "1024,2048")


def _float_list(text: str, name: str) -> list[float]:
    return _list(text, name, float, "numbers", "0.5,0.7")


GPUS_HELP = ("Ranks of a data-parallel run on this host, started by sparsecal as torchrun would: one per GPU with --device "
             "cuda, or N processes with --device cpu (README: Several GPUs).")
DEVICE_MAP_HELP = "'auto': spread one model over the GPUs (accelerate), for a model larger than one GPU."
MAX_MEMORY_HELP = "Budgets of --device-map auto per GPU (and cpu), e.g. 0=20GiB,1=20GiB,cpu=64GiB."


def _launch_ranks(ctx: typer.Context, gpus: int, device: str, device_map: str | None,
                  max_memory: str | None) -> None:
    """--gpus N > 1: run this very command (less --gpus) on N torchrun ranks, and exit with their code."""
    if gpus < 2:
        return
    from sparsecal.capture.distributed import check_placement, launch

    check_placement(device_map, max_memory, device, gpus)
    raise typer.Exit(launch(gpus, _rank_args(ctx), device))


def _rank_args(ctx: typer.Context) -> list[str]:
    """The subcommand's arguments as given, less --gpus: what each rank runs."""
    args, options = [ctx.command.name], []
    for p in ctx.command.params:
        value = ctx.params.get(p.name)
        if p.name == "gpus" or value is None:
            continue
        if getattr(ctx.get_parameter_source(p.name), "name", None) == "DEFAULT" and value == p.default:
            continue  # left out: the ranks take the same default, and see what the user typed as typed
        if p.param_type_name == "argument":
            args += [str(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
        elif p.is_flag:
            options += [p.opts[0]] if value else p.secondary_opts[:1]
        else:
            options += [x for v in (value if p.multiple else [value]) for x in (p.opts[0], str(v))]
    return args + options


@app.callback()
def main():
    """sparsecal: capture attention statistics, fit thresholds, browse and export them."""


@app.command()
@_user_errors
def capture(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Run directory (created, or resumed if it holds the same run)."),
    model: str = typer.Option("smollm2", help="'smollm2' (embedded default) or a local HF checkpoint directory."),
    task: str | None = typer.Option(None, help=f"Comma-separated tasks [default: niah_single]; from: {DEFAULT_TASKS},text_stdlib."),
    lengths: str = typer.Option(DEFAULT_LENGTHS, help="Prompt lengths in tokens of the model's tokenizer."),
    samples: int = typer.Option(1, min=1, help="Samples per task and length."),
    seed: int = typer.Option(0, help="Base seed; each sample's own seed is recorded."),
    prompts_file: Path | None = typer.Option(None, help='JSONL of {"text": ...} or {"input_ids": [...]} lines.'),
    block_m: int = typer.Option(128, min=1, help="Query block size BM."),
    block_n: int = typer.Option(64, min=1, help="Key block size BN."),
    k: str = typer.Option("4,8,16,32,64", help="BSFA k values (top-k key blocks kept)."),
    decode_rows: int = typer.Option(64, min=0, help="Last rows captured as decode queries."),
    orders: str = typer.Option("forward,reverse,sink_local", help="Scan orders of the BLASST gaps and t*; one order "
                               "captures fastest on the triton backend (single-pass kernel)."),
    raw: bool = typer.Option(False, "--raw", help="Also store raw tiles (bmax, gap, mass) for heatmaps."),
    dtype: str = typer.Option("float32", help="Model dtype: float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", help="torch device for the model."),
    backend: str = typer.Option("auto", help="Attention backend: auto (triton on CUDA, else reference), triton, reference."),
    add: bool = typer.Option(False, "--add", help="Add prompts an existing run did not plan (another task, "
                             "more lengths); its fit and export are then stale."),
    layers: str | None = typer.Option(None, help="Capture only these layers, e.g. 0,3,8-11 (the rest run dense); "
                                         "default: every full-attention layer."),
    gpus: int = typer.Option(1, min=1, help=GPUS_HELP),
    device_map: str | None = typer.Option(None, help=DEVICE_MAP_HELP),
    max_memory: str | None = typer.Option(None, help=MAX_MEMORY_HELP),
    engine: str | None = typer.Option(None, help="Capture at a serving engine's skip-softmax tiles (sets BM x BN): "
                                         "trtllm (trtllm-gen: TensorRT-LLM on Blackwell, SGLang, vLLM; 128x128), "
                                         "trtllm-hopper (fmha_v2: 64 x 256/128/64 by head_dim), modelopt (128x128), "
                                         "sparsecal (128x64)."),
    profile: bool = typer.Option(False, "--profile", help="Time each sample's phases (forward, attention kernels, "
                                 "reductions, copies, serialization, disk): printed, and in its sample.json."),
):
    """Run the model on prompts with instrumented attention and store the statistics in OUT."""
    from sparsecal.capture.command import CaptureRequest, capture_command
    from sparsecal.cli.options import check_capture

    if engine is not None:
        from sparsecal.cli.calibrate import engine_blocks

        block_m, block_n = engine_blocks(ctx, engine, model, block_m, block_n)

    tasks = task.split(",") if task else ([] if prompts_file else ["niah_single"])
    req = CaptureRequest(out=out, model=model, tasks=[t.strip() for t in tasks if t.strip()],
                         lengths=_int_list(lengths, "lengths"), samples=samples, seed=seed,
                         prompts_file=prompts_file, block_m=block_m, block_n=block_n,
                         k_values=_int_list(k, "k"), decode_rows=decode_rows, raw=raw,
                         orders=[o.strip() for o in orders.split(",") if o.strip()],
                         dtype=dtype, device=device, backend=backend, add=add, layers=layers,
                         device_map=device_map, max_memory=max_memory, profile=profile)
    check_capture(ctx, req)  # every option, before ranks start or the model is read
    _launch_ranks(ctx, gpus, device, device_map, max_memory)
    capture_command(req)


@app.command()
@_user_errors
def fit(
    run: Path = typer.Argument(..., help="Run directory made by `sparsecal capture`."),
    k: str | None = typer.Option(None, help="BSFA k values to fit [default: every k the run captured]."),
    targets: str = typer.Option("0.5,0.7", help="BLASST target sparsities."),
    holdout: float = typer.Option(0.25, help="Share of each length's samples held out for validation (0: none)."),
    seed: int = typer.Option(0, help="Seed of the hold-out split."),
    aggregation: str = typer.Option("mean", help="BSFA threshold aggregation over samples: mean or median."),
    order: str = typer.Option("forward", help="Scan order whose BLASST calibration is exported."),
    strict: bool = typer.Option(False, "--strict", help="Refuse a run with damaged samples (default: leave them "
                                "out with a warning)."),
    engine: str | None = typer.Option(None, help="Fit for a serving engine (trtllm, trtllm-hopper, modelopt, "
                                         "sparsecal): refuses a run captured at other tiles; engines scan forward."),
):
    """Fit BSFA thresholds and the BLASST lambda law, validate them on held-out samples, and
    write the analysis tables (Parquet) to RUN/fit/."""
    from sparsecal.analysis.fit import FitRequest
    from sparsecal.cli.calibrate import check_fit_engine, fit_command
    from sparsecal.cli.options import check_fit

    check_fit(holdout)
    if engine is not None:
        check_fit_engine(run, engine, order)

    req = FitRequest(k_values=_int_list(k, "k") if k else None, targets=_float_list(targets, "targets"),
                     holdout=holdout, seed=seed, aggregation=aggregation, order=order, strict=strict)
    fit_command(run, req)


@app.command()
@_user_errors
def export(
    run: Path = typer.Argument(..., help="A fitted run directory."),
    out: Path = typer.Option(..., "--out", help="Export directory (created)."),
    target: float | None = typer.Option(None, help="BLASST target written at the top of blasst.json [default: the first fitted]."),
    max_length: int | None = typer.Option(None, help="Cover positions up to this many tokens (past the longest calibrated length, the last threshold is reused)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an export of another run in OUT."),
    format: str | None = typer.Option(None, "--format", help="Also write serving-engine files (comma-separated, "
                                         "or all): modelopt (config.json block), trtllm (YAML), sglang (env), vllm "
                                         "(flags); the run must be captured at that engine's tiles."),
    patch_config: Path | None = typer.Option(None, "--patch-config", help="Write the modelopt block into this "
                                                "checkpoint's config.json (backup kept; another model's is refused)."),
    per_layer: bool = typer.Option(False, "--per-layer", help="Add each layer's own BLASST factor to blasst.json."),
    min_layer_sparsity: float = typer.Option(0.05, min=0.0, max=1.0, help="Leave a layer dense when it skips less "
                                             "than this at every length at the exported factor (0: never)."),
    break_even: list[Path] | None = typer.Option(None, "--break-even", help="A break-even file of the serving GPU "
                                                    "(`sparsecal bench break-even --run RUN --out FILE`): blasst.json "
                                                    "gets a dispatch record, sparse only where a layer's calibrated "
                                                    "sparsity reaches the break-even, the best SDPA path elsewhere "
                                                    "(repeatable: the files' rows merged, e.g. decode rows of "
                                                    "several batches)."),
    dispatch_margin: float = typer.Option(0.0, min=0.0, max=1.0, help="With --break-even: run sparse only where the "
                                          "calibrated sparsity >= break-even + this margin."),
    dispatch_timing: str = typer.Option("graph", "--dispatch-timing", help="With --break-even: the break-even "
                                        "rows used, graph (CUDA-graph replays: device time, as serving engines "
                                        "replay decode) or eager (one launch per call, host cost included)."),
    serve_lengths: str | None = typer.Option(None, "--serve-lengths", help="MIN[-MAX]: the lengths the engines "
                                                "will serve (default: any); the export says where an engine file's "
                                                "lambda = factor / L reaches 1 there, what each engine does, and the "
                                                "remedies."),
    length_weights: str | None = typer.Option(None, "--length-weights", help="Fit the engine files' factors where "
                                                 "the traffic is: LENGTH:WEIGHT,... (e.g. 1024:0.5,4096:0.5) or a "
                                                 "prompts file (JSONL, its prompts' lengths); within the calibrated "
                                                 "lengths."),
):
    """Write thresholds.bsfa.pt, thresholds.safetensors, blasst.json and report.txt (the engines'
    rule replayed on the held-out samples) from RUN's fit; with --format, the engines' files too;
    with --break-even, where each layer runs sparse (the dispatch record and its table)."""
    from sparsecal.cli.calibrate import export_command
    from sparsecal.cli.options import check_export
    from sparsecal.formats.engines import parse_formats

    check_export(break_even, max_length, target, dispatch_timing)
    export_command(run, out, target, max_length, force, formats=parse_formats(format), patch_config=patch_config,
                   per_layer=per_layer, min_layer_sparsity=min_layer_sparsity, break_even=break_even or None,
                   margin=dispatch_margin, serve_lengths=serve_lengths, length_weights=length_weights,
                   timing=dispatch_timing)


@app.command()
@_user_errors
def dashboard(
    runs: list[Path] = typer.Argument(..., help="Run directories (or directories holding runs)."),
    port: int = typer.Option(8501, help="Local port to serve on (0: any free port)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 for other machines)."),
    results: list[Path] | None = typer.Option(None, "--results", help="Directory of evaluation/benchmark result files for the Accuracy-speedup page (repeatable)."),
):
    """Serve the Streamlit dashboard over the runs (prints the URL; Ctrl-C stops it)."""
    from sparsecal.dashboard.serve import serve

    raise typer.Exit(serve(runs, host, port, results or ()))


@app.command()
@_user_errors
def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Where the demo run goes."),
    serve: bool = typer.Option(True, "--serve/--no-serve", help="Serve the dashboard (from the start) and keep it up."),
    port: int = typer.Option(8501, help="Port of the dashboard (0: any free port)."),
):
    """Serve the dashboard at once on the committed SmolLM2 calibration, then capture the default
    model on a small prompt set on the CPU (5 tasks x 1K/2K tokens), fit it, export the thresholds
    (to OUT/export); the new run appears in the dashboard's run list as soon as it is written."""
    from sparsecal.analysis.fit import FitRequest
    from sparsecal.capture.command import CaptureRequest, capture_command
    from sparsecal.cli.calibrate import export_command, fit_command

    server = None
    if serve:
        from sparsecal.dashboard import serve as dashboard

        runs = ([COMMITTED_CALIBRATION] if (COMMITTED_CALIBRATION / "manifest.json").is_file() else []) + [out]
        server = dashboard.start(runs, "127.0.0.1", port, pending=[out])
        dashboard.stop_on_signals()
    try:
        req = CaptureRequest(out=out, model="smollm2", tasks=DEFAULT_TASKS.split(","),
                             lengths=_int_list(DEMO_LENGTHS, "lengths"), samples=1, seed=0)
        capture_command(req)
        fit_command(out, FitRequest(targets=DEMO_TARGETS))
        export_command(out, out / "export", None, None)
        if server is None:
            return
        typer.echo(f"demo run ready: pick '{out.name}' in the dashboard's Run list (Ctrl-C stops the server)")
        raise typer.Exit(server.wait())
    except BaseException:
        if server is not None:
            dashboard.stop(server)
        raise


@app.command()
@_user_errors
def doctor(run: Path = typer.Argument(..., help="Run directory made by `sparsecal capture`.")):
    """Check a run against its samples: repair its manifest from them (missing samples, records that
    disagree with their sample, lost model/config/dtype), check every statistic, and list damaged
    samples with what to do."""
    from sparsecal.formats.run_doctor import doctor as run_doctor

    for line in run_doctor(run):
        typer.echo(line)


@app.command(name="eval")
@_user_errors
def eval_(
    ctx: typer.Context,
    export: Path = typer.Argument(..., help="Export directory (thresholds.safetensors/.bsfa.pt, blasst.json)."),
    out: Path = typer.Option(..., "--out", help="Evaluation directory (created, or resumed if it holds the same request)."),
    model: str | None = typer.Option(None, help="'smollm2' or a local HF checkpoint directory (default: smollm2)."),
    tasks: str | None = typer.Option(None, help=f"Comma-separated tasks (default: {DEFAULT_TASKS})."),
    lengths: str | None = typer.Option(None, help=f"Prompt lengths in tokens (default: {DEFAULT_LENGTHS})."),
    samples: int | None = typer.Option(None, min=1, help="Samples per task and length (default: 1)."),
    seed: int | None = typer.Option(None, help="Base seed of the evaluation prompts, disjoint from calibration's (default: 1009)."),
    methods: str | None = typer.Option(None, help="dense | sdpa | bsfa:K[:dense|topk|thresholds][,K...] | blasst:T[:sparse|dense][,T...] | window:B[:sparse|dense][,B...], joined by commas (default: dense); dense (the kernels, skipping off) and dense:fp32 always run; the third field is the decode mode (bsfa decodes dense by default, :dense makes blasst/window prefill-only)."),
    dtype: str | None = typer.Option(None, help="Model dtype: float32, bfloat16 or float16 (default: float32)."),
    device: str | None = typer.Option(None, help="torch device for the model (default: cpu)."),
    reuse_last_threshold: bool | None = typer.Option(None, "--reuse-last-threshold/--no-reuse-last-threshold", help="Allow lengths past the BSFA export's Nmax (the last threshold is reused) (default: no)."),
    calibration: Path | None = typer.Option(None, help="The calibration run (default: the one recorded in the export, or its parent directory)."),
    extrapolate: bool | None = typer.Option(None, "--extrapolate/--no-extrapolate", help="BLASST past its law's longest validated length applies a/L (default: no, it runs dense there); rows flag each phase's law as interpolated, extrapolated or below."),
    held_out_tasks_only: bool = typer.Option(False, "--held-out-tasks-only", help="Refuse tasks the export was calibrated on."),
    holdout_tasks: str | None = typer.Option(None, "--holdout-tasks", help="Comma-separated task families that must be held out (e.g. vt,text_stdlib): added to --tasks, refused if the calibration captured them; rows get split seen|held-out from the calibration run, else from this list."),
    bench: list[Path] | None = typer.Option(None, "--bench", help="`sparsecal bench` result files to join into OUT/curves.parquet (repeatable)."),
    gpus: int = typer.Option(1, min=1, help=GPUS_HELP),
    device_map: str | None = typer.Option(None, help=DEVICE_MAP_HELP),
    max_memory: str | None = typer.Option(None, help=MAX_MEMORY_HELP),
    dispatch: str | None = typer.Option(None, help="off | on | both: BSFA and BLASST without and/or with the export's dispatch record (labels with it end in +dispatch) (default: off)."),
    time_: bool = typer.Option(False, "--time", help="After the rows, the timing phase: TTFT and TPOT of every evaluated configuration against the best SDPA, one process with the GPU's lock held exclusively (OUT/data/timing.parquet)."),
    time_only: bool = typer.Option(False, "--time-only", help="Only the timing phase, on the rows OUT holds (after an evaluation run by several processes or torchrun)."),
    speed_only: bool | None = typer.Option(None, "--speed-only/--no-speed-only", help="No accuracy rows (a random-weight checkpoint: accuracy is meaningless, and labelled so): time random prompt ids of --lengths; with --time."),
    rounds: int = typer.Option(5, min=1, help="Timing phase: round-robin rounds over a length's variants (median kept; "
                               "from 4, each speedup also gets its 95% interval)."),
    reps: int = typer.Option(5, min=1, help="Timing phase: timed prefill forwards per round (median)."),
    warmup: int = typer.Option(2, min=0, help="Timing phase: untimed forwards (and decode steps) before the timed ones."),
    decode_steps: int = typer.Option(16, min=1, help="Timing phase: timed decode steps per round, eager and CUDA-graph replays (median per step)."),
    graph: bool = typer.Option(True, "--graph/--no-graph", help="Timing phase: also CUDA-graph replays of the prefill (CUDA only)."),
    time_lengths: str | None = typer.Option(None, help="Timing phase: only these of the evaluated lengths (the other lengths' timings are kept), e.g. to split a long timing over several calls."),
    batch: int = typer.Option(1, min=1, help="Prompts of one length evaluated together as one batch (rows stay per prompt and independent; a GPU's host-bound decode steps are shared): 16-32 on a GPU, one process per GPU (processes sharing one are time-sliced)."),
):
    """Evaluate methods on held-out task prompts against dense: answers, next-token KL, top-1
    agreement, perplexity, achieved sparsity and time per sample; summary and result files in OUT
    (options left out on a resumed OUT take the values it was started with)."""
    from sparsecal.evaluation.command import EvalRequest, check_options, eval_command
    from sparsecal.evaluation.timing import TimingOptions

    req = EvalRequest(export=export, out=out, model=model,
                      tasks=[t.strip() for t in tasks.split(",") if t.strip()] if tasks else None,
                      lengths=_int_list(lengths, "lengths") if lengths else None, samples=samples, seed=seed,
                      methods=methods, dtype=dtype, device=device, reuse_last_threshold=reuse_last_threshold,
                      calibration=calibration, held_out_tasks_only=held_out_tasks_only, bench=list(bench or []),
                      holdout_tasks=[t.strip() for t in holdout_tasks.split(",") if t.strip()] if holdout_tasks else None,
                      device_map=device_map, max_memory=max_memory, dispatch=dispatch, speed_only=speed_only,
                      time=time_ or bool(speed_only), time_only=time_only,
                      timing=TimingOptions(rounds=rounds, reps=reps, warmup=warmup, decode_steps=decode_steps,
                                           graph=graph),
                      time_lengths=_int_list(time_lengths, "time-lengths") if time_lengths else None,
                      extrapolate=extrapolate, batch=batch)
    check_options(req)  # every option, --bench files included, before ranks start or the model is read
    _launch_ranks(ctx, gpus, device or "cpu", device_map, max_memory)
    eval_command(req)


@app.command()
@_user_errors
def verify(
    export: Path = typer.Argument(..., help="An export directory written with --format modelopt."),
    engine: str = typer.Option("modelopt", help="The consumer whose own code runs the export: modelopt "
                               "(Model-Optimizer's loader and Hugging Face skip-softmax path)."),
    run: Path | None = typer.Option(None, help="The run the export was made from (default: EXPORT's parent)."),
    targets: str | None = typer.Option(None, help="Target sparsities S (factor = a exp(b S)) [default: the fitted ones]."),
    lengths: str | None = typer.Option(None, help="Only samples of these lengths [default: every captured one]."),
    samples: str = typer.Option("held-out", help="held-out (the fit's test split) or all finished samples."),
    per_length: int | None = typer.Option(None, "--per-length", help="At most this many samples per length."),
    masks: bool = typer.Option(True, "--masks/--no-masks", help="Also run with each layer's mask applied (one run per target)."),
    device: str = typer.Option("cpu", help="torch device for the model."),
):
    """Run the export through the consumer's own code on the run's samples and print predicted vs measured
    sparsity per phase, target and length (on dense statistics, and with masks applied); writes
    EXPORT/verify-modelopt.json, which the dashboard's Export page shows."""
    from sparsecal.cli.consumers import verify_command

    verify_command(export, run, engine, _float_list(targets, "targets") if targets else None,
                   _int_list(lengths, "lengths") if lengths else None, samples, per_length, masks, device)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_user_errors
def bench(ctx: typer.Context):
    """Benchmark the sparse kernels on a CUDA GPU against dense Triton and SDPA; writes JSON with
    provenance. Options (all optional): --dims 128,64 --lengths 16384,32768,65536 --groups 1,4,8
    --rounds 3 --decode-batch 16 --decode-length 32768 --sections check,sweep,prefill,decode
    --smollm2 (captured SmolLM2 Q/K/V and TTFT with --export DIR, --model-lengths) --out FILE.
    `sparsecal bench break-even --run RUN --out FILE [--lengths ...] [--methods bsfa,blasst]
    [--sparsities 0,0.25,0.5,0.75,0.9] [--rounds 3]`: where the sparse prefill kernel pays against the
    best SDPA backend at the run's model geometry (the file `sparsecal export --break-even` reads)."""
    args = list(ctx.args)
    if args[:1] == ["break-even"]:
        from sparsecal.bench.breakeven import main as break_even_main

        break_even_main(args[1:])
        return
    from sparsecal.bench.sparse import main as bench_main

    bench_main(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())


def run() -> None:
    """The console entry point (``sparsecal``): typer's own usage errors (a bad option value, an
    unknown option) become one ``error:`` line with exit code 2 too."""
    from sparsecal.formats.children import adopt_from_env

    adopt_from_env()  # a rank of --gpus N: end with the launcher, however it ends
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` prints where every thread is (a long run that seems stuck)
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if "WORLD_SIZE" not in os.environ:  # ranks keep the default: torchrun stops them and says so itself
        signal.signal(signal.SIGTERM, _terminate)
    click_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    try:
        rc = app(standalone_mode=False)  # typer.Exit(code) comes back as its code here
    except Terminated:
        typer.echo("terminated (SIGTERM): finished samples are kept; run the same command again to resume.", err=True)
        _exit(128 + signal.SIGTERM)
    except click_error as e:
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()
            _exit(e.exit_code)
        where = e.ctx.command_path if getattr(e, "ctx", None) else "sparsecal"
        message = " ".join(e.format_message().split())
        typer.echo(f"error: {message} (see `{where} --help`)", err=True)
        _exit(2)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("interrupted: finished samples are kept; run the same command again to resume.", err=True)
        _exit(130)
    except SystemExit as e:  # None: success, a message: failure
        _exit(0 if e.code is None else e.code if isinstance(e.code, int) else 1)
    except Exception as e:
        if type(e).__name__ == "Exit":  # typer.Exit / click's Exit in non-standalone mode
            _exit(getattr(e, "exit_code", 0))
        raise
    _exit(rc if isinstance(rc, int) else 0)


class Terminated(BaseException):
    """SIGTERM, raised where the command is (not an Exception: nothing may swallow it); the
    ``finally`` blocks and atomic writes on the way out keep every finished sample."""


def _terminate(signum, frame):
    raise Terminated()


def _exit(code: int) -> None:
    """sys.exit, except in one rank of several (torchrun): its work is written and the ranks have
    left together, so it ends without interpreter teardown, where gloo's threads were seen to abort a
    finished rank now and then ("terminate called without an active exception", signal 6)."""
    from sparsecal.capture.distributed import from_env

    try:
        several = from_env().several
    except UserError:  # a malformed torchrun environment: the command itself has said so
        several = False
    if several:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
