"""Option checks that run before any work: lists typed on the command line, and each command's
options that can be judged without the model (files named, layer lists, backends, placement).
A command calls its check before it starts ranks, reads a checkpoint or computes anything; each
failure is one UserError line that says what is wrong and what to do."""
from __future__ import annotations

from pathlib import Path

from sparsecal.formats.errors import UserError


def parse_list(text: str, name: str, cast, kind: str, example: str) -> list:
    """'1024,2048' -> [1024, 2048]; an empty item ('256,,512', a trailing comma) is refused."""
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise UserError(f"--{name} is empty; give a comma-separated list of {kind} (e.g. {example}).")
    if not all(items):
        raise UserError(f"--{name} '{text}' has an empty item; give a comma-separated list of {kind} without "
                        f"empty places (e.g. {example}).")
    try:
        return [cast(x) for x in items]
    except ValueError:
        raise UserError(f"--{name} '{text}' is not a comma-separated list of {kind} (e.g. {example}).") from None


def positive(values: list, name: str, what: str = "token count") -> list:
    """Refuse a value below 1 in an integer list option."""
    bad = [v for v in values if v < 1]
    if bad:
        raise UserError(f"--{name} {bad[0]} is not a positive {what}; give values of at least 1.")
    return values


def from_command_line(ctx, name: str) -> bool:
    """Whether option ``name`` (its Python name) was typed, rather than left at its default."""
    return getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"


def existing_file(path: Path | None, option: str, what: str) -> None:
    """An input file option must name a file."""
    if path is not None and not Path(path).is_file():
        where = "is a directory" if Path(path).is_dir() else "does not exist"
        raise UserError(f"{option} {path} {where}; give {what}.")


def check_capture(ctx, req) -> None:
    """``sparsecal capture``: every option judged without the model, before ranks start."""
    from sparsecal.capture.command import stats_config
    from sparsecal.capture.distributed import check_gpus, check_placement
    from sparsecal.capture.models import check_dtype_device
    from sparsecal.formats.errors import unknown
    from sparsecal.formats.geometry import CAPTURE_BACKENDS as BACKENDS
    from sparsecal.formats.layers import parse_layers

    positive(req.lengths, "lengths")
    if req.prompts_file is not None and not req.tasks:
        if from_command_line(ctx, "lengths"):
            raise UserError("--lengths sets the length of --task prompts; a --prompts-file line is as long as its "
                            "own text: leave out --lengths, or add --task to capture task prompts at those lengths too.")
        if from_command_line(ctx, "samples"):
            raise UserError("--samples sets how many --task prompts per task and length; a --prompts-file is "
                            "captured line by line: leave out --samples, or add --task.")
    existing_file(req.prompts_file, "--prompts-file", 'a JSONL file of {"text": ...} or {"input_ids": [...]} lines')
    parse_layers(req.layers, None)
    stats_config(req)
    if req.backend not in BACKENDS:
        raise unknown("backend", req.backend, BACKENDS)
    check_gpus(ctx.params.get("gpus") or 1, req.device)
    check_dtype_device(req.dtype, req.device)
    check_placement(req.device_map, req.max_memory, req.device, ctx.params.get("gpus") or 1)


def check_export(break_even, max_length: int | None, target: float | None, timing: str = "graph") -> None:
    """``sparsecal export``: the files it reads exist (``break_even``: a path, several, or None) and
    the numbers are in range, before the run is read."""
    if target is not None and not 0.0 < target < 1.0:
        raise UserError(f"--target {target:g} is not a sparsity; give one of the fitted targets, in (0, 1).")
    if max_length is not None and max_length < 1:
        raise UserError(f"--max-length {max_length} is not a positive token count; give at least 1.")
    for path in break_even if isinstance(break_even, (list, tuple)) else [break_even]:
        existing_file(path, "--break-even", "the file `sparsecal bench break-even --run RUN --out FILE` wrote")
    if timing not in ("graph", "eager"):
        raise UserError(f"--dispatch-timing takes graph or eager, got {timing!r}.")


def check_fit(holdout: float) -> None:
    """``sparsecal fit``: the hold-out share, before the run's samples are read."""
    if not 0.0 <= holdout < 1.0:
        raise UserError(f"--holdout {holdout:g} must be in [0, 1); e.g. 0.25 holds out a quarter of each length's "
                        "samples, 0 validates on the calibration samples.")
