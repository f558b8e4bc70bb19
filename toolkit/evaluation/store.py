"""The evaluation directory: a manifest and a per-(sample, method) row table, written atomically so
that an interrupted evaluation resumes where it stopped.

    EVAL/
      results.json             the dashboard's Accuracy-speedup rows (kind sparsecal-eval)
      curves.parquet           accuracy joined to `sparsecal bench` speedups, with provenance
      data/manifest.json       kind sparsecal-eval-run, schema version, the request (tasks, lengths,
                               samples, seed, methods, dtype, device, reuse rule), model, export
                               identity, calibration run (tasks, sample count), the planned prompts
                               (id, task, length, index, seed, answer, held-out task), versions
      data/rows.parquet        one row per finished (sample, method); rewritten whole, atomically
      data/rows.part-<r>.parquet  rank r's rows of a distributed evaluation (its own file, rewritten
                               whole, atomically); rank 0 merges them into rows.parquet at the end,
                               or at the start of the next run after a rank stopped
      data/summary.parquet     every metric per method, config, length and task
      data/timing.parquet      the timing phase's records, one per (method label, length)
                               (evaluation/timing.py; rewritten whole by each timing phase;
                               read back by ``read_timing``)

Every table is checked when read: rows (``check_rows``) and timing (``read_timing``) values
finite and in range, else one line (UserError).

Only the dashboard's result files sit at the top: `sparsecal dashboard RUN --results EVAL` reads
every Parquet and JSON file there as accuracy-speedup rows.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from sparsecal.formats.errors import UserError
from sparsecal.formats.files import read_json_manifest
from sparsecal.formats.results import SPEEDS
from sparsecal.formats.table_values import check_ranges
from sparsecal.formats.version import SCHEMA_VERSION

EVAL_KIND = "sparsecal-eval-run"
DATA = "data"
MANIFEST = Path(DATA) / "manifest.json"
ROWS = Path(DATA) / "rows.parquet"
PARTS = "rows.part-*.parquet"  # under DATA: one rank's rows each
SUMMARY = Path(DATA) / "summary.parquet"
RESULTS = "results.json"
CURVES = "curves.parquet"
TIMING = Path(DATA) / "timing.parquet"


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_parquet(path: Path, df, metadata: dict | None = None) -> None:
    """Write a polars frame to ``path`` through a temporary file and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    df.write_parquet(tmp, metadata=metadata)
    os.replace(tmp, path)


@dataclass
class EvalStore:
    root: Path
    manifest: dict
    rows: list = field(default_factory=list)
    part: Path | None = None  # this writer's own row file (a rank of a distributed evaluation)
    mine: list = field(default_factory=list)  # the rows it wrote there

    @staticmethod
    def read_manifest(root: Path) -> dict | None:
        """The manifest of an existing evaluation directory, None for a new (absent or empty) one."""
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise UserError(f"--out {root} is a file; give a directory for the evaluation.")
        path = root / MANIFEST
        if not path.is_file():
            if root.exists() and any(root.iterdir()):
                raise UserError(f"--out {root} is a non-empty directory that is not a sparsecal evaluation; "
                                "choose a new directory.")
            return None
        man = read_json_manifest(path, EVAL_KIND, "evaluate again into a new directory")
        return man

    @classmethod
    def resume(cls, root: Path, manifest: dict) -> EvalStore | None:
        """The evaluation in ``root`` if it holds the same request, model and export as
        ``manifest`` (anything else is refused in one line); None for a new directory."""
        root = Path(root)
        have = cls.read_manifest(root)
        if have is None:
            return None
        for key in ("request", "model", "export"):
            diff = _first_difference(have.get(key) or {}, manifest[key])
            if diff:
                raise UserError(f"{root} holds an evaluation with a different {key} ({diff}); "
                                "use a new --out directory, or the options it was started with.")
        for tmp in (root / DATA).glob(".*.tmp-*"):  # a write cut short by Ctrl-C or a crash
            tmp.unlink(missing_ok=True)
        store = cls(root, have)
        store.rows = store._read_rows()
        return store

    @classmethod
    def create(cls, root: Path, manifest: dict) -> EvalStore:
        """A new evaluation directory holding ``manifest``."""
        root = Path(root)
        (root / DATA).mkdir(parents=True, exist_ok=True)
        store = cls(root, dict(manifest, kind=EVAL_KIND, schema_version=SCHEMA_VERSION, created=now()))
        store.save_manifest()
        return store

    @classmethod
    def open(cls, root: Path) -> EvalStore:
        """An existing evaluation with its rows, touching nothing (what every rank reads)."""
        store = cls(Path(root), cls.read_manifest(root))
        store.rows = store._read_rows()
        return store

    def note_run(self, phase: str, **extra) -> None:
        """Append this process's provenance (commit, GPU, versions, date: formats.provenance) to the
        manifest's ``runs`` for ``phase`` ("rows" or "timing"): which code on which machine made the
        rows and the timings, resumed calls and merged shards included."""
        from sparsecal.formats.provenance import provenance

        self.manifest.setdefault("runs", []).append(dict(provenance(), phase=phase, **extra))
        self.save_manifest()

    def save_manifest(self) -> None:
        from sparsecal.formats.files import atomic_write_text

        self.manifest["updated"] = now()
        atomic_write_text(self.root / MANIFEST, json.dumps(self.manifest, indent=1))

    def _read_rows(self) -> list[dict]:
        """The rows of rows.parquet and of every rank's file, each (sample, method) once."""
        import polars as pl

        rows, seen = [], set()
        for path in [self.root / ROWS, *self._parts()]:
            if not path.is_file():
                continue
            try:
                table = pl.read_parquet(path)
            except Exception as e:  # noqa: BLE001 - a damaged table is one line
                raise UserError(f"{path} is not readable ({type(e).__name__}); remove it to evaluate again.")
            check_rows(table, path)
            for r in table.to_dicts():
                if (r["sample_id"], r["label"]) not in seen:
                    seen.add((r["sample_id"], r["label"]))
                    rows.append(r)
        return rows

    def _parts(self) -> list[Path]:
        return sorted((self.root / DATA).glob(PARTS))

    def own_rows(self, rank: int) -> None:
        """Write this process's rows to its own file (rank ``rank`` of a distributed evaluation)."""
        self.part, self.mine = self.root / DATA / PARTS.replace("*", str(rank)), []

    def merge_parts(self) -> None:
        """Fold the ranks' row files into rows.parquet (atomically, then remove them); no-op without."""
        import polars as pl

        parts = self._parts()
        if not parts:
            return
        self.rows = self._read_rows()
        write_parquet(self.root / ROWS, pl.DataFrame(self.rows, infer_schema_length=None))
        for path in parts:  # a crash before this leaves rows in both files, read once (deduplicated)
            path.unlink(missing_ok=True)

    def done(self) -> set[tuple[str, str]]:
        """(sample id, method label) of every finished row."""
        return {(r["sample_id"], r["label"]) for r in self.rows}

    def pending(self, labels: list[str]) -> dict[str, list[str]]:
        """Planned sample id -> the method labels it still lacks (samples lacking none left out)."""
        done = self.done()
        out = {p["id"]: [m for m in labels if (p["id"], m) not in done] for p in self.manifest["prompts"]}
        return {sid: missing for sid, missing in out.items() if missing}

    def add_row(self, row: dict) -> None:
        """Record one finished (sample, method) row (``add_rows``)."""
        self.add_rows([row])

    def add_rows(self, rows: list[dict]) -> None:
        """Record finished (sample, method) rows and rewrite the row table (or this rank's own
        file) atomically, once for all of them."""
        import polars as pl

        self.rows.extend(rows)
        if self.part is None:
            write_parquet(self.root / ROWS, pl.DataFrame(self.rows, infer_schema_length=None))
        else:
            self.mine.extend(rows)
            write_parquet(self.part, pl.DataFrame(self.mine, infer_schema_length=None))


def merge_shards(root: Path, shards: list) -> EvalStore:
    """One evaluation directory ``root`` from shard directories of the same export, model and
    methods, each run as its own process over some tasks and lengths (several processes sharing
    one GPU). The manifest lists every shard's prompts; the request's tasks and lengths are the
    union and ``samples`` maps "task@length" to the samples run there; the shards' timing records
    are joined (_merged_timing). Refuses shards of another export, model or method list, and a
    non-empty ``root``."""
    import polars as pl

    mans = [EvalStore.open(Path(s)) for s in shards]
    if not mans:
        raise UserError("give at least one evaluation shard directory to merge.")
    first = mans[0].manifest
    for st in mans[1:]:
        for key in ("model", "export"):
            if st.manifest[key] != first[key]:
                raise UserError(f"{st.root} has another {key} than {mans[0].root}; shards must share it.")
        if st.manifest["request"]["methods"] != first["request"]["methods"]:
            raise UserError(f"{st.root} evaluated other methods than {mans[0].root}.")
    if EvalStore.read_manifest(Path(root)) is not None:
        raise UserError(f"{root} already holds an evaluation; merge into a new directory.")
    timing = _merged_timing(mans)  # refused before anything is written
    prompts = [p for st in mans for p in st.manifest["prompts"]]
    samples: dict = {}
    for p in prompts:
        samples[f"{p['task']}@{p['length']}"] = samples.get(f"{p['task']}@{p['length']}", 0) + 1
    request = dict(first["request"], tasks=sorted({p["task"] for p in prompts}),
                   lengths=sorted({p["length"] for p in prompts}), samples=samples)
    runs = [dict(r, shard=str(st.root)) for st in mans for r in st.manifest.get("runs", [])]
    store = EvalStore.create(Path(root), dict(first, request=request, prompts=prompts, runs=runs,
                                              merged_from=[str(st.root) for st in mans]))
    store.rows = [r for st in mans for r in st.rows]
    write_parquet(store.root / ROWS, pl.DataFrame(store.rows, infer_schema_length=None))
    if timing is not None:
        write_parquet(store.root / TIMING, timing)
    return store


ROW_RANGES = ([(c, 0.0, 1.0) for c in ("sparsity", "decode_sparsity", "top1")]
              + [(c, 0.0, None) for c in ("kl", "nll", "prefill_skipped", "prefill_reachable", "decode_skipped",
                                          "decode_reachable", "new_tokens", "answer_tokens", "prefill_s", "decode_s",
                                          "seconds")]
              + [("ppl", 1.0, None), ("length", 1.0, None), ("answer_logprob", None, 0.0)])


def check_rows(table, path) -> None:
    """An evaluation's rows as ``finish`` and the pages use them: sample_id and label present, every
    number finite (no measure is NaN: an undefined one is null), ROW_RANGES held; one line."""
    from sparsecal.formats.table_values import numeric_columns

    lacking = [c for c in ("sample_id", "label") if c not in table.columns]
    redo = "Remove it to evaluate those rows again."
    if lacking:
        raise UserError(f"{path} lacks columns {', '.join(lacking)}. {redo}")
    check_ranges(table, str(path), [(c, None, None) for c in numeric_columns(table)] + ROW_RANGES, redo)


def _merged_timing(stores: list):
    """The shards' timing records in one polars DataFrame (each length is timed in one shard, `eval
    --time-only`), None when no shard has any; a (label, length) timed in two shards is refused."""
    import polars as pl

    parts = [t for t in (read_timing(st.root) for st in stores) if t is not None]
    if not parts:
        return None
    table = pl.concat(parts, how="diagonal_relaxed")
    twice = table.group_by("label", "length").len().filter(pl.col("len") > 1)
    if twice.height:
        label, length = twice.row(0)[:2]
        raise UserError(f"{label} at {length} tokens was timed in two shards; keep one shard's timing.parquet "
                        "(delete the other's data/timing.parquet) and merge again.")
    return table.sort("length", "label")


def _first_difference(have: dict, want: dict) -> str:
    for key in sorted(set(have) | set(want)):
        if have.get(key) != want.get(key):
            return f"{key} {have.get(key)!r} vs {want.get(key)!r}"
    return ""


TIMING_REQUIRED = ("label", "length", "ttft_ms", "tpot_ms", "speedup_ttft", "speedup_tpot", "sparsity_match",
                   "decode_sparsity_match", "speed_device")


def read_timing(root):
    """The timing phase's records (EVAL/data/timing.parquet), None before any timing phase; checked:
    readable, TIMING_REQUIRED columns, every time and speedup (and interval end) finite and > 0 where
    present, each interval's lo <= hi, sparsities in [0, 1], counts >= 0, lengths >= 1
    (TIMING_RANGES). A damaged file is one line (UserError) saying how to redo it. Attention shares
    outside [0, 1] and their ideals read as null (``_derived_in_range``)."""
    import polars as pl

    path = Path(root) / TIMING
    if not path.is_file():
        return None
    redo = "delete it and time again (sparsecal eval ... --time-only)"
    try:
        df = pl.read_parquet(path)
    except Exception as e:  # noqa: BLE001 - a damaged table is one line
        raise UserError(f"{path} is not readable ({type(e).__name__}); {redo}.") from None
    lacking = [c for c in TIMING_REQUIRED if c not in df.columns]
    if lacking:
        raise UserError(f"{path} lacks columns {', '.join(lacking)}; {redo}.")
    values = [c for c in df.columns if (c.endswith("_ms") and not c.endswith("rounds_ms")) or c.startswith("speedup_")]
    for c in values:
        try:
            v = df[c].cast(pl.Float64, strict=True).drop_nulls()
        except Exception:  # noqa: BLE001 - text where a time belongs
            raise UserError(f"{path}: column {c} is {df[c].dtype}, not numeric; {redo}.") from None
        if v.len() and not bool((v.is_finite() & (v > 0)).all()):
            raise UserError(f"{path}: column {c} holds a value that is not a finite positive number; {redo}.")
    for name in SPEEDS:
        if f"{name}_lo" in df.columns and f"{name}_hi" in df.columns and bool((df[f"{name}_lo"] > df[f"{name}_hi"]).any()):
            raise UserError(f"{path}: {name}_lo exceeds {name}_hi; {redo}.")
    check_ranges(df, str(path), TIMING_RANGES, f"{redo.capitalize()}.")
    return _derived_in_range(df)


TIMING_RANGES = ([(c, 0.0, 1.0) for c in ("sparsity", "decode_sparsity", "point_sparsity", "point_decode_sparsity")]
                 + [(c, 0.0, None) for c in ("prefill_skipped", "prefill_reachable", "decode_skipped", "decode_reachable",
                                             "sparse_layers", "row_prefill_reachable", "rounds", "reps", "warmup",
                                             "decode_steps")] + [("length", 1.0, None)])


def _derived_in_range(df):
    """The attention shares and their ideals as a reader may use them: a share outside [0, 1]
    (tables written before shares came from graph replays: an eager host-bound step timed its
    attention-free twin slower than itself) is null, and so is the ideal derived from it."""
    import polars as pl

    for share, ideal in (("attention_share", "ideal_ttft"), ("attention_share_decode", "ideal_tpot")):
        if share not in df.columns or not df[share].dtype.is_numeric():
            continue
        ok = df[share].cast(pl.Float64).is_between(0.0, 1.0).fill_null(False)
        df = df.with_columns(pl.when(ok).then(pl.col(share)).otherwise(None).alias(share))
        if ideal in df.columns:
            df = df.with_columns(pl.when(ok).then(pl.col(ideal)).otherwise(None).alias(ideal))
    return df
