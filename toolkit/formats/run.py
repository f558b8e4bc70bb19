"""The run directory: a manifest and one atomically written folder per finished sample.

    RUN/
      manifest.json              schema version, model, dtype, stats config (geometry, k values,
                                 bins), versions, the planned samples (task, length, seed, answer)
      samples/<id>/sample.json   the sample's record plus timing and backend
      samples/<id>/stats.safetensors   per-layer reductions stacked as [Lc, ...] over the captured
                                 layers (manifest "layers", every layer when absent) + input_ids [N]
      samples/<id>/raw.safetensors     raw tiles (only with --raw)

A sample folder is built under samples/.tmp-<id>~<host>~<pid>/ and renamed into place, so a crash
or Ctrl-C never leaves half a sample; leftovers of interrupted writes are removed on the next open
(a writer on another host sharing the run directory keeps its folder: it is removed only once it
is a day old).
Sample ids hash the token ids, so re-running the same command skips exactly the finished samples.

Several writers (two captures into one --out, the ranks of a distributed capture) are safe: the
manifest is only changed under an exclusive lock on RUN/.lock, re-read from disk first, so no
writer's planned samples are lost. The sample folders on disk are the truth about what is
finished: a folder whose sample.json or stats.safetensors does not read is "damaged", counts as
not finished (the same capture command recaptures it), and ``rebuild`` (``sparsecal doctor``) adds
finished samples the manifest lacks.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from sparsecal.formats.errors import UserError
from sparsecal.formats.files import atomic_write_text, read_json_manifest
from sparsecal.formats.sample_values import check_raw, check_record, check_shapes, check_values
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.formats.tensors import header_shapes, load_arrays, serialize_arrays, write_bytes
from sparsecal.formats.version import SCHEMA_VERSION, __version__

LOCK = ".lock"
RUN_KIND = "sparsecal-run"
MANIFEST = "manifest.json"
SAMPLES = "samples"
FIT_DIR = "fit"                 # RUN/fit/: fit.json (kind FIT_KIND) and the analysis tables
FIT_KIND = "sparsecal-fit"
# Mostly-zero histograms: stored as (index, value) pairs on disk, dense in memory.
SPARSE_KEYS = frozenset({"gap_count", "gap_mass", "decode_gap_count", "decode_gap_mass",
                         "diag_gap_count", "diag_gap_mass", "decode_diag_gap_count", "decode_diag_gap_mass",
                         "decode_group_gap_count", "decode_group_gap_mass",
                         "tstar_where", "tstar_hist", "qinit_count", "joint_count", "rescale_count",
                         "shortfall_count"})
# Running-max rescale / shortfall statistics (every row of prefill, per scan order): new in this
# sparsecal version; runs captured before it lack them and readers say so in one line.
RESCALE_KEYS = ("rescale_count", "rescale_excess", "shortfall_count")
RESCALE_SINCE = "0.2.0"
RESCALE_MISSING = f"not in this run (captured before sparsecal {RESCALE_SINCE}; re-capture)"
# Gap histograms of the diagonal tiles (prefill A_i <= j < R_i; a decode row's own last block): samples
# captured before them lack these keys, so readers load them as optional (analysis.samples.load_arrays).
DIAG_GAP_KEYS = ("diag_gap_count", "diag_gap_mass", "decode_diag_gap_count", "decode_diag_gap_mass")
# VFA's joint stabilization statistic max(Q-init, sink + diagonal max) - row max per prefill row, on the
# q-init bins: samples captured before it lack the key; fit leaves it out of the tables and says so.
JOINT_KEYS = ("joint_count",)
# The decode rows' gap histograms under the group decision (each head over its KV group's max gap):
# samples captured before them lack these keys; fit reports the group skip share only where present.
GROUP_GAP_KEYS = ("decode_group_gap_count", "decode_group_gap_mass")
JOINT_MISSING = "VFA's joint statistic is not in this run (captured before joint_count existed; re-capture)"


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
    def open(cls, root) -> RunStore:
        """Open an existing run for reading; validates the manifest's kind and schema version."""
        root = Path(root)
        path = root / MANIFEST
        if not path.is_file():
            raise UserError(f"{root} is not a sparsecal run (no {MANIFEST}). Create one with `sparsecal capture --out {root}`.")
        man = read_json_manifest(path, RUN_KIND, "capture the run again into a new directory with this sparsecal")
        check_manifest(path, man)
        return cls(root, man)

    @classmethod
    def create_or_resume(cls, root, model: dict, config: dict, dtype: str, backend: str,
                         scope: dict | None = None) -> RunStore:
        """Open RUN for writing: a new directory, or an existing run with the same model, config and
        ``scope`` ({"layers": captured layer indices, "layer_notes": {layer: why not captured}})."""
        root = Path(root)
        cls.check_target(root, model, config, dtype, scope)  # one line before anything is written
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create --out {root} ({e.strerror}); choose a writable directory.") from None
        with _locked(root):
            if cls.check_target(root, model, config, dtype, scope):  # another writer may have created it meanwhile
                store = cls.open(root)
                store._clean_tmp()
                return store
            man = {"schema_version": SCHEMA_VERSION, "kind": RUN_KIND, "created": _now(), "updated": _now(),
                   "model": model, "dtype": dtype, "backend": backend, "config": config,
                   "versions": versions(), **(scope or {}), "samples": []}
            store = cls(root, man)
            store._write_manifest()  # before samples/: a racing writer sees a run, not a foreign directory
            (root / SAMPLES).mkdir(parents=True, exist_ok=True)
            return store

    @classmethod
    def check_target(cls, root, model: dict, config: dict, dtype: str, scope: dict | None = None) -> bool:
        """Refuse an output path that cannot take this run; True when it holds the same run."""
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise UserError(f"--out {root} is a file; give a directory for the run.")
        if (root / MANIFEST).exists():
            store = cls.open(root)
            store._check_same(model, config, dtype)
            if scope and store.layers() != scope["layers"]:
                raise UserError(f"{root} captured layers {store.layers()}, not {scope['layers']}; use the same "
                                "--layers (and lengths within the same sliding windows) or a new --out directory.")
            return True
        # hidden entries (.lock, a manifest's atomic-write temp file) belong to a run another writer
        # is creating right now, which the locked second check then finds
        if root.exists() and any(not p.name.startswith(".") for p in root.iterdir()):
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

    def layers(self) -> list[int]:
        """The model layers with statistics, in the order of the stats arrays' first axis."""
        return captured_layers(self.manifest)

    # ---- writing -------------------------------------------------------------------------
    def _write_manifest(self) -> None:
        self.manifest["updated"] = _now()
        atomic_write_text(self.root / MANIFEST, json.dumps(self.manifest, indent=1))

    def _clean_tmp(self) -> None:
        """Remove leftovers of interrupted sample writes: of this process, of a dead process on this
        host, and of another host's writer once a day old (its liveness cannot be seen from here)."""
        import time

        for tmp in (self.root / SAMPLES).glob(".tmp-*"):
            host, pid = _tmp_owner(tmp.name)
            if host not in (None, HOST):
                try:
                    stale = time.time() - tmp.stat().st_mtime > FOREIGN_TMP_AGE_S
                except OSError:
                    continue
                if not stale:
                    continue
            elif pid is not None and pid != os.getpid() and _alive(pid):
                continue
            shutil.rmtree(tmp, ignore_errors=True)

    def _reload(self) -> None:
        """Re-read the manifest from disk (under the lock: other writers may have planned samples)."""
        self.manifest = read_json_manifest(self.root / MANIFEST, RUN_KIND, "run `sparsecal doctor` on it")
        check_manifest(self.root / MANIFEST, self.manifest)

    def plan(self, records: list[dict]) -> list[dict]:
        """Add sample records (dicts with at least 'id') not planned yet, and save the manifest.
        Returns the records that were new."""
        with _locked(self.root):
            self._reload()
            known = {s["id"] for s in self.manifest["samples"]}
            new = [r for r in records if r["id"] not in known]
            if new:
                self.manifest["samples"].extend(new)
                self._write_manifest()
        return new

    def sample_dirs(self) -> list[Path]:
        """The sample folders (a symbolic link among them is listed, and reads as damaged)."""
        base = self.root / SAMPLES
        return sorted(p for p in base.iterdir() if (p.is_dir() or p.is_symlink()) and not p.name.startswith(".")) \
            if base.is_dir() else []

    def mismatches(self, scan: dict | None = None) -> dict[str, str]:
        """{sample id: how the manifest's record differs from the sample's own sample.json} of the
        finished samples (RECORD_KEYS; a record lacking one counts)."""
        done = self.done_ids(scan)
        out = {}
        for rec in self.manifest["samples"]:
            if rec["id"] not in done or rec["id"] in out:
                continue
            own = json.loads((self.root / SAMPLES / rec["id"] / "sample.json").read_text())
            diff = [f"{k} {rec.get(k, '(missing)')!r} vs {own.get(k)!r}" for k in RECORD_KEYS
                    if rec.get(k) != own.get(k)]
            if diff:
                out[rec["id"]] = ", ".join(diff)
        return out

    def check_sample(self, sid: str) -> str | None:
        """None when sample ``sid`` is finished and readable, else what is wrong with it: its files,
        its record (sample.json) and the shapes its header gives (sample_values)."""
        folder = self.root / SAMPLES / sid
        if folder.is_symlink():
            return "its folder is a symbolic link out of the run (sparsecal does not follow it)"
        for name in ("sample.json", "stats.safetensors"):
            if not (folder / name).is_file():
                return f"{name} is missing"
        try:
            record = json.loads((folder / "sample.json").read_text())
            why = check_record(sid, record)
            if why is not None:
                return f"sample.json: {why}"
            shapes, meta = header_shapes(folder / "stats.safetensors")
        except (OSError, ValueError, UnicodeDecodeError) as e:  # truncated or garbled files
            return f"unreadable ({type(e).__name__})"
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type on a bad header
            return f"unreadable ({type(e).__name__})"
        if str(meta.get("schema_version")) != str(SCHEMA_VERSION):
            return f"stats.safetensors has schema version {meta.get('schema_version')}"
        model = self.manifest.get("model") or {}
        if isinstance(model.get("num_heads"), int):
            cfg = self.manifest["config"]
            full = {"orders", "k_values"} <= set(cfg)   # a run made by hand may name a few settings only
            return check_shapes(shapes, record["length"], cfg["block_m"], len(self.layers()), model["num_heads"],
                                StatsConfig.from_dict(cfg) if full else None, "rescale_bins" in cfg)
        return None

    def check_values(self, sid: str) -> str | None:
        """None when every statistic of a readable sample holds values it allows (reads them all);
        else the first out-of-range entry."""
        folder = self.root / SAMPLES / sid
        try:
            record = json.loads((folder / "sample.json").read_text())
            tensors, _ = load_arrays(folder / "stats.safetensors")
        except Exception as e:  # noqa: BLE001 - damaged past its header
            return f"unreadable ({type(e).__name__})"
        cfg = self.manifest["config"]
        return check_values(tensors, record.get("length"), cfg.get("block_m"), cfg.get("block_n"))

    def scan(self, values: bool = False) -> dict[str, str | None]:
        """{sample id: None when finished and readable, else what is wrong} of every sample folder;
        ``values``: also read every statistic and check its range (``check_values``)."""
        out = {p.name: self.check_sample(p.name) for p in self.sample_dirs()}
        if values:
            out.update({sid: self.check_values(sid) for sid, why in out.items() if why is None})
        return out

    def done_ids(self, scan: dict | None = None) -> set[str]:
        """Samples finished on disk and readable (damaged ones count as not finished)."""
        return {sid for sid, why in (self.scan() if scan is None else scan).items() if why is None}

    def damaged(self, scan: dict | None = None) -> dict[str, str]:
        """{sample id: what is wrong} of the sample folders that do not read."""
        return {sid: why for sid, why in (self.scan() if scan is None else scan).items() if why is not None}

    def finished_records(self, scan: dict | None = None) -> tuple[list[dict], list[str]]:
        """(records of the finished samples: the manifest's, in its order, then those only on disk,
        from their sample.json; ids of finished samples the manifest lacks). ``scan``: a ``scan()``
        already made."""
        done = self.done_ids(scan)
        planned = {r["id"] for r in self.manifest["samples"]}
        recs = [r for r in self.manifest["samples"] if r["id"] in done]
        extra = sorted(done - planned)
        for sid in extra:
            rec = json.loads((self.root / SAMPLES / sid / "sample.json").read_text())
            recs.append({k: v for k, v in rec.items() if k not in ("seconds", "backend")})
        return recs, extra

    def rebuild(self) -> tuple[list[str], dict[str, str]]:
        """Add the finished samples the manifest lacks (from their sample.json); returns (ids
        added, damaged samples {id: why}). What ``sparsecal doctor`` does."""
        with _locked(self.root):
            self._reload()
            scan = self.scan()
            recs, extra = self.finished_records(scan)
            if extra:
                self.manifest["samples"].extend(r for r in recs if r["id"] in set(extra))
                self._write_manifest()
        return extra, self.damaged(scan)

    def write_sample(self, record: dict, stats: dict, raw: dict | None = None, profile: dict | None = None) -> Path:
        """Write one finished sample atomically: build it in a temp folder, then rename. With
        ``profile`` (capture --profile: seconds per phase) the record gets it as ``profile``, plus
        ``serialize`` and ``disk`` (the safetensors files) measured here, added to its ``wall``
        unless ``write_overlapped``."""
        final = self.root / SAMPLES / record["id"]
        tmp = self.root / SAMPLES / f".tmp-{record['id']}~{HOST}~{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            t0 = time.perf_counter()
            meta = {"schema_version": SCHEMA_VERSION, "sample": record["id"], "model": self.manifest["model"]["id"],
                    RUN_META: json.dumps({k: self.manifest[k] for k in RUN_META_KEYS if k in self.manifest})}
            files = {"stats.safetensors": serialize_arrays(as_arrays(stats), SPARSE_KEYS, meta)}
            if raw:
                files["raw.safetensors"] = serialize_arrays(as_arrays(raw), metadata=meta)
            t1 = time.perf_counter()
            tmp.mkdir(parents=True)
            for name, data in files.items():
                write_bytes(tmp / name, data)
            if profile is not None:
                record = dict(record, profile=_timed(profile, t1 - t0, time.perf_counter() - t1))
            atomic_write_text(tmp / "sample.json", json.dumps(record, indent=1))
            if final.is_symlink():  # a link is removed, never followed (its target is not the run's)
                final.unlink()
            elif final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException as e:  # Ctrl-C or a full disk: leave no half-written folder behind
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise UserError(f"cannot write sample {record['id']} into {self.root} ({e.strerror or e}); free "
                                "space or fix permissions, then run the same command to resume.") from None
            raise
        return final

    # ---- reading -------------------------------------------------------------------------
    def load_sample(self, sid: str, raw: bool = False, keys=None):
        """(record, numpy arrays) of a finished sample; arrays include raw tiles when raw=True.
        ``keys`` limits the statistics read (None: all)."""
        folder = self.root / SAMPLES / sid
        if not (folder / "sample.json").is_file():
            raise UserError(f"sample {sid} of {self.root} is not finished; re-run the capture to resume it.")
        why = self.check_sample(sid)
        if why is not None:
            raise UserError(f"sample {sid} of {self.root} is damaged ({why}); run the same capture command to "
                            "recapture it.")
        record = json.loads((folder / "sample.json").read_text())
        try:
            tensors, _ = load_arrays(folder / "stats.safetensors", keys)
        except Exception as e:  # noqa: BLE001 - a file damaged past its header
            raise UserError(f"sample {sid} of {self.root} is damaged ({type(e).__name__}); run the same capture "
                            "command to recapture it.") from None
        cfg = self.manifest["config"]
        why = check_values(tensors, record["length"], cfg["block_m"], cfg["block_n"])
        if why is not None:
            raise UserError(f"sample {sid} of {self.root} holds an impossible value ({why}); `sparsecal fit` leaves "
                            f"it out: remove {folder} and run the same capture command to recapture it.")
        if raw and (folder / "raw.safetensors").is_file():
            tensors.update(self._load_raw(sid, folder / "raw.safetensors", record["length"]))
        return record, tensors

    def _load_raw(self, sid: str, path: Path, length: int) -> dict:
        """A sample's raw tile arrays, checked (sample_values.check_raw)."""
        try:
            raw = load_arrays(path)[0]
        except Exception as e:  # noqa: BLE001
            raise UserError(f"sample {sid} of {self.root}: raw.safetensors is damaged ({type(e).__name__}); "
                            "run the same capture command to recapture it.") from None
        cfg = self.manifest["config"]
        why = check_raw(raw, length, cfg["block_m"], cfg["block_n"], len(cfg.get("orders") or ()) or None)
        if why is not None:
            raise UserError(f"sample {sid} of {self.root}: raw.safetensors holds an impossible value or shape ({why}); "
                            f"remove {path.parent} and run the same capture command to recapture it.")
        return raw


def _timed(profile: dict, serialize: float, disk: float) -> dict:
    """A sample's profile record with its serialization and disk seconds."""
    out = dict(profile, serialize=round(serialize, 4), disk=round(disk, 4))
    if not out.get("write_overlapped"):
        out["wall"] = round(out.get("wall", 0.0) + serialize + disk, 4)
    return out


MANIFEST_KEYS = {"model": dict, "config": dict, "dtype": str, "samples": list}
RECORD_KEYS = ("task", "length", "seed", "index")  # a manifest record must agree with its sample.json on these
RUN_META = "sparsecal.run"                          # stats.safetensors metadata: what the manifest says of the run
RUN_META_KEYS = ("model", "config", "dtype", "backend", "layers", "layer_notes")


def captured_layers(manifest: dict) -> list[int]:
    """A run manifest's captured layers (runs made before ``layers`` existed captured every layer)."""
    layers = manifest.get("layers")
    return list(range(manifest["model"]["num_layers"])) if layers is None else [int(i) for i in layers]


def check_manifest(path: Path, man: dict) -> None:
    """The keys every reader of a run manifest uses, with their types, and each planned sample's id."""
    for key, kind in MANIFEST_KEYS.items():
        if not isinstance(man.get(key), kind):
            raise UserError(f"{path} lacks {key!r} (or it is not a {kind.__name__}); the manifest is damaged: "
                            f"`sparsecal doctor {Path(path).parent}` rebuilds it from the samples.")
    if not isinstance(man["model"].get("id"), str) or not all(isinstance(r, dict) and "id" in r for r in man["samples"]):
        raise UserError(f"{path}: the model id or a planned sample's id is missing; the manifest is damaged: "
                        f"`sparsecal doctor {Path(path).parent}` rebuilds it from the samples.")
    for key in ("num_layers", "num_heads"):
        n = man["model"].get(key)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise UserError(f"{path}: model.{key} is {n!r}, not a positive integer; the manifest is damaged: "
                            f"`sparsecal doctor {Path(path).parent}` rebuilds it from the samples.")
    try:   # the settings it holds (a run made by hand may hold a few: the rest are the defaults)
        StatsConfig.from_dict({**StatsConfig().to_dict(), **man["config"]})
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"{path}: config is not a capture's settings ({e}); the manifest is damaged: "
                        f"`sparsecal doctor {Path(path).parent}` rebuilds it from the samples.") from None


@contextlib.contextmanager
def _locked(root: Path):
    """An exclusive lock on RUN/.lock for the duration of a manifest change (blocks until free). A
    .lock that is a symbolic link is refused, never followed (it would create a file outside the run)."""
    path = Path(root) / LOCK
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if not path.is_symlink():
            raise
        raise UserError(f"{path} is a symbolic link (to {os.readlink(path)}); sparsecal does not follow it out of the "
                        f"run: remove it (rm {path}) and run the command again.") from e
    with os.fdopen(fd, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


HOST = platform.node().replace("~", "-") or "localhost"
FOREIGN_TMP_AGE_S = 24 * 3600


def _tmp_owner(name: str) -> tuple[str | None, int | None]:
    """(host, pid) of a temp sample folder's name: .tmp-<id>~<host>~<pid>, or the older
    .tmp-<id>-<pid> (this host)."""
    parts = name.rsplit("~", 2)
    if len(parts) == 3:
        return parts[1], int(parts[2]) if parts[2].isdigit() else None
    pid = name.rsplit("-", 1)[-1]
    return None, int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
