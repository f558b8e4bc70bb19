"""What an evaluation is given, checked before any model is loaded: the export (its identity,
geometry and what it can run), the requested methods and lengths against it, and the
calibration prompts the evaluation prompts must stay disjoint from.

The export's identity is its files' SHA-256 digests plus what they say about the model and
geometry; a resumed evaluation refuses an export whose files changed. The calibration run is
found from ``--calibration RUN``, else the ``run`` recorded in the BSFA export's metadata, else
the export directory's parent (where `sparsecal export RUN --out RUN/export` puts it).

Split: every evaluation prompt is "seen" (its task family was a calibration task) or "held-out"
(it was not, so neither its generator nor, for the text tasks, its corpus was calibrated on).
The calibration run's manifest decides; ``--holdout-tasks`` names task families that must be
held out (refused if the calibration captured them) and, with no calibration run found, is the
only source: the tasks it names are held-out, the others seen. Without either the split is
unknown (None).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from sparsecal.evaluation.methods import Method
from sparsecal.formats.errors import UserError


@dataclass
class ExportInfo:
    """The export directory's identity and capabilities (None where a file is absent)."""

    path: Path
    files: dict                      # file name -> sha256 (hex, 16 chars)
    model: str | None
    num_layers: int
    num_heads: int
    q_block_size: int
    k_block_size: int
    k_values: tuple = ()             # BSFA k values (empty: no BSFA file)
    max_num_blocks: int | None = None
    targets: tuple = ()              # BLASST target sparsities (empty: no blasst.json)
    calibration_lengths: list = field(default_factory=list)
    run: str | None = None           # calibration run recorded in the export
    bsfa_decode: bool = False        # BSFA thresholds calibrated on decode rows are in the export
    dispatch: dict | None = None     # blasst.json's dispatch record: its break-even file (name, GPU, commit)
    group_targets: tuple = ()        # BLASST targets with a decode law of the group decision (decode_group)

    @property
    def nmax(self) -> int | None:
        """Longest prompt the BSFA thresholds cover without reusing the last one."""
        return None if self.max_num_blocks is None else self.max_num_blocks * self.q_block_size

    def identity(self) -> dict:
        """What a resumed evaluation must find again (the path may change, the files may not)."""
        return {"files": self.files, "model": self.model,
                "num_layers": self.num_layers, "num_heads": self.num_heads,
                "q_block_size": self.q_block_size, "k_block_size": self.k_block_size,
                "k_values": list(self.k_values), "max_num_blocks": self.max_num_blocks,
                "targets": list(self.targets), "calibration_lengths": self.calibration_lengths}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _meta_lengths(path, meta: dict) -> list[int]:
    """The calibration lengths a BSFA export's metadata records (a JSON list of positive integers;
    [] when absent), or one line."""
    from sparsecal.formats.json_values import positive_int

    try:
        lens = json.loads(meta.get("lengths", "[]"))
    except (json.JSONDecodeError, TypeError):
        lens = None
    if not isinstance(lens, list) or not all(map(positive_int, lens)):
        raise UserError(f"export {path}: its thresholds' metadata lengths {meta.get('lengths')!r} is not a list of "
                        "positive token counts; export it again with `sparsecal export RUN --out DIR`.")
    return lens


def load_export(path: Path, model: dict) -> ExportInfo:
    """Read the export directory and check it against the model (``model_info`` dict)."""
    from sparsecal.formats.exports import BLASST_JSON, BSFA_PT, BSFA_ST, blasst_group_law, load_blasst
    from sparsecal.integrations.exports import load_bsfa

    path = Path(path)
    if not path.is_dir():
        raise UserError(f"export {path} is not a directory; make one with `sparsecal export RUN --out DIR`.")
    present = [n for n in (BSFA_ST, BSFA_PT, BLASST_JSON) if (path / n).is_file()]
    if not present:
        raise UserError(f"export {path} holds none of {BSFA_ST}, {BSFA_PT}, {BLASST_JSON}; "
                        "make one with `sparsecal export RUN --out DIR`.")
    expect = {"model": model["id"], "num_layers": model["num_layers"], "num_heads": model["num_heads"]}
    info = None
    if BSFA_ST in present or BSFA_PT in present:
        exp = load_bsfa(path, expect)
        meta = exp.meta or {}
        info = ExportInfo(path.resolve(), {}, exp.model, exp.num_layers, exp.num_heads, exp.q_block_size,
                          exp.k_block_size, exp.k_values, int(exp.thresholds.shape[3]),
                          calibration_lengths=_meta_lengths(path, meta), run=meta.get("run"),
                          bsfa_decode=exp.decode_thresholds is not None)
    if BLASST_JSON in present:
        doc = load_blasst(path, expect)
        targets = tuple(sorted({float(doc["target_sparsity"])} | {float(t["target_sparsity"])
                                                                  for t in doc.get("targets", [])}))
        if info is None:
            info = ExportInfo(path.resolve(), {}, doc.get("model"), doc["num_layers"], doc["num_heads"],
                              doc["q_block_size"], doc["k_block_size"],
                              calibration_lengths=list(doc.get("lengths", [])))
        elif (doc["q_block_size"], doc["k_block_size"]) != (info.q_block_size, info.k_block_size):
            raise UserError(f"export {path}: {BLASST_JSON} and the BSFA thresholds have different block sizes; "
                            "export them again from one run.")
        info.targets = targets
        info.group_targets = tuple(t for t in targets if blasst_group_law(doc, t) is not None)
        if doc.get("dispatch"):
            src = doc["dispatch"]["break_even_file"]
            info.dispatch = {k: src.get(k) for k in ("name", "gpu", "commit", "date")}
    info.files = {n: _digest(path / n) for n in present}
    return info


def check_methods(methods: list[Method], info: ExportInfo) -> None:
    """Refuse methods the export cannot run (a k it lacks, a target it was not fitted for, a
    window without the BSFA file that gives sparsify its block sizes)."""
    for m in methods:
        if m.name in ("window", "window_sink") and info.max_num_blocks is None:
            raise UserError(f"method {m.label}: export {info.path} has no BSFA thresholds file, which gives the "
                            "window baseline its block sizes; export the run again with `sparsecal export`.")
        if m.name == "bsfa" and m.value not in info.k_values:
            have = ", ".join(map(str, info.k_values)) or "none: the export has no BSFA thresholds"
            raise UserError(f"method {m.label}: k={m.value} is not in export {info.path} (k values {have}); "
                            "fit and export it with `sparsecal fit RUN --k ...`.")
        if m.name == "bsfa" and m.decode == "thresholds" and not info.bsfa_decode:
            raise UserError(f"method {m.label}: export {info.path} has no BSFA decode thresholds (exported before "
                            "they were calibrated); capture, fit and export again, or use decode topk or dense.")
        if m.name in ("blasst", "blasst_sl", "vsa") and not any(abs(m.value - t) < 1e-9 for t in info.targets):
            have = ", ".join(f"{t:g}" for t in info.targets) or "none: the export has no blasst.json"
            raise UserError(f"method {m.label}: target {m.value:g} is not in export {info.path} (targets {have}); "
                            "fit it with `sparsecal fit RUN --targets ...` and export again.")
        if m.decode == "group" and not any(abs(m.value - t) < 1e-9 for t in info.group_targets):
            raise UserError(f"method {m.label}: export {info.path} has no decode law of the group decision for "
                            f"target {m.value:g} (blasst.json decode_group: a run captured before the group "
                            f"statistic); capture, fit and export again, or use blasst:{m.value:g}.")


def check_lengths(lengths: list[int], methods: list[Method], info: ExportInfo, reuse_last: bool) -> None:
    """Refuse a length past the BSFA thresholds' Nmax unless the reuse rule is asked for."""
    if reuse_last or info.nmax is None or not any(m.name == "bsfa" for m in methods):
        return
    over = [n for n in lengths if n > info.nmax]
    if over:
        raise UserError(f"length {over[0]} is over export {info.path}'s Nmax of {info.nmax} tokens "
                        f"({info.max_num_blocks} query blocks of {info.q_block_size}); pass --reuse-last-threshold "
                        "to reuse the last threshold past it, or export with `--max-length`.")


@dataclass
class Calibration:
    """The calibration run's prompts: where they were read, their tasks, seeds and sample ids."""

    manifest: Path | None
    tasks: list = field(default_factory=list)
    seeds: set = field(default_factory=set)  # (task, length, seed)
    ids: set = field(default_factory=set)

    def record(self) -> dict:
        return {"manifest": None if self.manifest is None else str(self.manifest), "tasks": self.tasks,
                "samples": len(self.ids)}


def find_calibration(info: ExportInfo, given: Path | None, model_id: str) -> Calibration:
    """The calibration run's prompts (an empty record when no run is found and none is given)."""
    from sparsecal.formats.run import MANIFEST, RunStore

    if given is not None:
        candidates = [Path(given)]
    else:
        candidates = [Path(info.run)] if info.run and Path(info.run).is_absolute() else []
        candidates += [info.path.parent]
    for root in candidates:
        if not (root / MANIFEST).is_file():
            if given is not None:
                raise UserError(f"--calibration {given} is not a sparsecal run (no {MANIFEST}).")
            continue
        try:
            kind = json.loads((root / MANIFEST).read_text()).get("kind")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            kind = None   # not readable as a run manifest: not a calibration run
        if kind != "sparsecal-run":
            continue
        man = RunStore.open(root).manifest
        if man["model"].get("id") != model_id:
            raise UserError(f"calibration run {root} is of model {man['model'].get('id')}, not {model_id}; "
                            "give the run the export was fitted from with --calibration RUN.")
        samples = man.get("samples", [])
        return Calibration(root / MANIFEST, sorted({s["task"] for s in samples if s.get("task")}),
                           {(s["task"], s["length"], int(s["seed"])) for s in samples if s.get("seed") is not None},
                           {s["id"] for s in samples})
    return Calibration(None)


def _tokens(sid: str) -> tuple:
    """(length, token digest) of a sample id ``<task>-<length>-<digest>``: the prompt without its task name."""
    return tuple(sid.rsplit("-", 2)[-2:])


def check_disjoint(prompts, calibration: Calibration, seed: int) -> None:
    """Refuse evaluation prompts that are calibration prompts: the same (task, length, seed), or
    the same tokens under any task name (another corpus or a prompts file holding the same text)."""
    from sparsecal.formats.run import sample_id

    tokens = {_tokens(i) for i in calibration.ids}
    for p in prompts:
        same_tokens = _tokens(sample_id(p.task, p.length, p.input_ids)) in tokens
        if (p.task, p.length, p.seed) in calibration.seeds or same_tokens:
            raise UserError(f"evaluation prompt {p.task}/{p.length}/#{p.index} (seed {p.seed}) is a calibration "
                            f"prompt of {calibration.manifest}; choose another --seed than {seed}.")


SEEN, HELD_OUT = "seen", "held-out"


def check_holdout(holdout: list | None, calibration: Calibration) -> None:
    """Refuse a ``--holdout-tasks`` task family that the calibration run captured."""
    seen = [t for t in holdout or [] if t in calibration.tasks]
    if seen:
        raise UserError(f"--holdout-tasks {seen[0]}: the calibration run {calibration.manifest} captured task "
                        f"{seen[0]}, so it is not held out; drop it from --holdout-tasks.")


def split_of(task: str, calibration: Calibration, holdout: list | None) -> str | None:
    """"seen" or "held-out" for a prompt of ``task`` (None: no calibration run and no
    ``--holdout-tasks`` to tell)."""
    if calibration.manifest is not None:
        return SEEN if task in calibration.tasks else HELD_OUT
    if holdout:
        return HELD_OUT if task in holdout else SEEN
    return None
