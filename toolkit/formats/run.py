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

from sparsecal.formats.errors import UserError
from sparsecal.formats.files import atomic_write_text, check_schema, read_json_manifest
from sparsecal.formats.tensors import load_arrays, save_arrays
from sparsecal.formats.version import SCHEMA_VERSION, __version__

RUN_KIND = "sparsecal-run"
MANIFEST = "manifest.json"
SAMPLES = "samples"
FIT_DIR = "fit"                 # RUN/fit/: fit.json (kind FIT_KIND) and the analysis tables
FIT_KIND = "sparsecal-fit"
# Mostly-zero histograms: stored as (index, value) pairs on disk, dense in memory.
SPARSE_KEYS = frozenset({"gap_count", "gap_mass", "decode_gap_count", "decode_gap_mass",
                         "tstar_where", "tstar_hist", "qinit_count"})


def as_arrays(tensors: dict) -> dict:
    """numpy arrays of a dict of numpy arrays or torch tensors (on any device), without importing torch."""
    return {k: v.detach().cpu().numpy() if hasattr(v, "detach") else v for k, v in tensors.items()}


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
        final = self.root / SAMPLES / record["id"]
        tmp = self.root / SAMPLES / f".tmp-{record['id']}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        meta = {"schema_version": SCHEMA_VERSION, "sample": record["id"], "model": self.manifest["model"]["id"]}
        save_arrays(tmp / "stats.safetensors", as_arrays(stats), sparse=SPARSE_KEYS, metadata=meta)
        if raw:
            save_arrays(tmp / "raw.safetensors", as_arrays(raw), metadata=meta)
        atomic_write_text(tmp / "sample.json", json.dumps(record, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        return final

    # ---- reading -------------------------------------------------------------------------
    def load_sample(self, sid: str, raw: bool = False, keys=None):
        """(record, numpy arrays) of a finished sample; arrays include raw tiles when raw=True.
        ``keys`` limits the statistics read (None: all)."""
        folder = self.root / SAMPLES / sid
        if not (folder / "sample.json").is_file():
            raise UserError(f"sample {sid} of {self.root} is not finished; re-run the capture to resume it.")
        record = json.loads((folder / "sample.json").read_text())
        tensors, meta = load_arrays(folder / "stats.safetensors", keys)
        check_schema(folder / "stats.safetensors", meta.get("schema_version"), "capture the run again")
        if raw and (folder / "raw.safetensors").is_file():
            tensors.update(load_arrays(folder / "raw.safetensors")[0])
        return record, tensors
