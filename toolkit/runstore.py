"""The run directory: a manifest and one atomically written folder per finished sample.

    RUN/
      manifest.json              schema version, model, dtype, stats config (geometry, k values,
                                 bins), versions, the planned samples (task, length, seed, answer)
      samples/<id>/sample.json   the sample's record plus timing and backend
      samples/<id>/stats.safetensors   per-layer reductions stacked as [L, ...] + input_ids [N]
      samples/<id>/raw.safetensors     raw tiles (only with --raw)

A sample folder is built under samples/.tmp-<id>-<pid>/ and renamed into place, so a crash or
Ctrl-C never leaves half a sample; leftovers of interrupted writes are removed on the next open.
Sample ids hash the token ids, so re-running the same command skips exactly the finished samples.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from . import SCHEMA_VERSION, __version__
from .errors import UserError

RUN_KIND = "sparsecal-run"
MANIFEST = "manifest.json"
SAMPLES = "samples"
# Mostly-zero histograms: stored as (index, value) pairs on disk, dense in memory.
SPARSE_KEYS = frozenset({"gap_count", "gap_mass", "decode_gap_count", "decode_gap_mass",
                         "tstar_where", "tstar_hist", "qinit_count"})


def sample_id(task: str, length: int, input_ids) -> str:
    digest = hashlib.sha1(json.dumps(list(map(int, input_ids))).encode()).hexdigest()[:10]
    return f"{task}-{length}-{digest}"


def versions() -> dict:
    out = {"sparsecal": __version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "triton", "safetensors"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def read_json_manifest(path: Path, kind: str, remedy: str) -> dict:
    """The JSON manifest at ``path``, checked to be of ``kind`` at this sparsecal's schema version;
    anything else is one UserError line ending in ``remedy`` (what the user should do)."""
    try:
        man = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg}); {remedy}.") from None
    if not isinstance(man, dict) or man.get("kind") != kind:
        found = man.get("kind") if isinstance(man, dict) else type(man).__name__
        raise UserError(f"{path} holds a {found!r}, not a {kind} manifest; {remedy}.")
    if man.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{path} has schema version {man.get('schema_version')}; this sparsecal reads "
                        f"{SCHEMA_VERSION}: {remedy}.")
    return man


@dataclass
class RunStore:
    root: Path
    manifest: dict

    # ---- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, root) -> "RunStore":
        """Open an existing run for reading; validates the manifest's kind and schema version."""
        root = Path(root)
        path = root / MANIFEST
        if not path.is_file():
            raise UserError(f"{root} is not a sparsecal run (no {MANIFEST}). Create one with `sparsecal capture --out {root}`.")
        man = read_json_manifest(path, RUN_KIND, "capture the run again into a new directory with this sparsecal")
        return cls(root, man)

    @classmethod
    def create_or_resume(cls, root, model: dict, config: dict, dtype: str, backend: str) -> "RunStore":
        """Open RUN for writing: a new directory, or an existing run with the same model and config."""
        root = Path(root)
        if cls.check_target(root, model, config, dtype):
            store = cls.open(root)
            store._clean_tmp()
            return store
        man = {"schema_version": SCHEMA_VERSION, "kind": RUN_KIND, "created": _now(), "updated": _now(),
               "model": model, "dtype": dtype, "backend": backend, "config": config,
               "versions": versions(), "samples": []}
        (root / SAMPLES).mkdir(parents=True, exist_ok=True)
        store = cls(root, man)
        store._write_manifest()
        return store

    @classmethod
    def check_target(cls, root, model: dict, config: dict, dtype: str) -> bool:
        """Refuse an output path that cannot take this run; True when it holds the same run."""
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise UserError(f"--out {root} is a file; give a directory for the run.")
        if (root / MANIFEST).exists():
            cls.open(root)._check_same(model, config, dtype)
            return True
        if root.exists() and any(root.iterdir()):
            raise UserError(f"--out {root} is a non-empty directory that is not a sparsecal run; choose a new directory.")
        return False

    def _check_same(self, model: dict, config: dict, dtype: str) -> None:
        have = self.manifest
        if have["model"].get("id") != model.get("id"):
            raise UserError(f"{self.root} holds a run of model {have['model'].get('id')}, not {model.get('id')}; "
                            "use a new --out directory.")
        diff = [k for k in sorted(set(config) | set(have["config"])) if config.get(k) != have["config"].get(k)]
        if have.get("dtype") != dtype:
            diff.append("dtype")
        if diff:
            desc = ", ".join(f"{k} {have['config'].get(k, have.get(k))!r} vs {config.get(k, dtype)!r}" for k in diff)
            raise UserError(f"{self.root} holds a run with a different geometry/config ({desc}); use a new --out directory.")

    # ---- writing -------------------------------------------------------------------------
    def _write_manifest(self) -> None:
        from .tensorio import atomic_write_text

        self.manifest["updated"] = _now()
        atomic_write_text(self.root / MANIFEST, json.dumps(self.manifest, indent=1))

    def _clean_tmp(self) -> None:
        for tmp in (self.root / SAMPLES).glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def plan(self, records: list[dict]) -> None:
        """Add sample records (dicts with at least 'id') not planned yet, and save the manifest."""
        known = {s["id"] for s in self.manifest["samples"]}
        new = [r for r in records if r["id"] not in known]
        if new:
            self.manifest["samples"].extend(new)
            self._write_manifest()

    def done_ids(self) -> set[str]:
        base = self.root / SAMPLES
        return {p.parent.name for p in base.glob("*/sample.json") if not p.parent.name.startswith(".")}

    def write_sample(self, record: dict, stats: dict, raw: dict | None = None) -> Path:
        """Write one finished sample atomically: build it in a temp folder, then rename."""
        from .tensorio import atomic_write_text, save_tensors

        final = self.root / SAMPLES / record["id"]
        tmp = self.root / SAMPLES / f".tmp-{record['id']}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        meta = {"schema_version": SCHEMA_VERSION, "sample": record["id"], "model": self.manifest["model"]["id"]}
        save_tensors(tmp / "stats.safetensors", stats, sparse=SPARSE_KEYS, metadata=meta)
        if raw:
            save_tensors(tmp / "raw.safetensors", raw, metadata=meta)
        atomic_write_text(tmp / "sample.json", json.dumps(record, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        return final

    # ---- reading -------------------------------------------------------------------------
    def load_sample(self, sid: str, raw: bool = False, keys=None):
        """(record, tensors) of a finished sample; tensors include raw tiles when raw=True.
        ``keys`` limits the statistics read (None: all)."""
        from .tensorio import load_tensors

        folder = self.root / SAMPLES / sid
        if not (folder / "sample.json").is_file():
            raise UserError(f"sample {sid} of {self.root} is not finished; re-run the capture to resume it.")
        record = json.loads((folder / "sample.json").read_text())
        tensors, meta = load_tensors(folder / "stats.safetensors", keys)
        if meta.get("schema_version") != str(SCHEMA_VERSION):
            raise UserError(f"{folder}/stats.safetensors has schema version {meta.get('schema_version')}; "
                            f"expected {SCHEMA_VERSION}.")
        if raw and (folder / "raw.safetensors").is_file():
            tensors.update(load_tensors(folder / "raw.safetensors")[0])
        return record, tensors
