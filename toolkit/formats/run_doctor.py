"""``sparsecal doctor RUN``: check a run against its samples and repair what the samples determine.

The sample folders are the truth about a run. Each sample's sample.json is its record, and its
stats.safetensors metadata (``sparsecal.run``, since sparsecal 0.2.0) records the run's model,
config, dtype, backend and captured layers. From them doctor rebuilds:

- the manifest's ``samples``: a finished sample the manifest lacks is added, a record that
  disagrees with its sample (RECORD_KEYS: task, length, seed, index) is replaced by the sample's
  own, a planned record without an id or with an impossible length is dropped (the capture
  command plans it again);
- ``model``, ``config``, ``dtype`` (and the captured ``layers``) when missing: from the samples'
  metadata, else (runs captured before it) model and config from RUN/fit/fit.json.

Then every statistic of every finished sample is read and checked (formats/sample_values.py):
damaged samples are listed with what is wrong and what to do.
"""
from __future__ import annotations

import json
from pathlib import Path

from sparsecal.formats.errors import UserError
from sparsecal.formats.run import (
    FIT_DIR,
    FIT_KIND,
    MANIFEST,
    MANIFEST_KEYS,
    RUN_KIND,
    RUN_META,
    SAMPLES,
    RunStore,
    _locked,
    _now,
)
from sparsecal.formats.sample_values import check_record
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.formats.tensors import header_shapes
from sparsecal.formats.version import SCHEMA_VERSION


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _on_disk(root: Path) -> tuple[dict[str, dict], dict]:
    """({sample id: its record} of the sample folders whose sample.json reads as a record, what the
    first of them that records it says of the run (stats metadata ``sparsecal.run``))."""
    records, run = {}, {}
    base = root / SAMPLES
    for folder in sorted(base.iterdir()) if base.is_dir() else []:
        if folder.name.startswith(".") or folder.is_symlink() or not folder.is_dir():
            continue
        rec = _read_json(folder / "sample.json")
        if check_record(folder.name, rec) is not None:
            continue
        records[folder.name] = {k: v for k, v in rec.items() if k not in ("seconds", "backend")}
        if not run:
            try:
                meta = header_shapes(folder / "stats.safetensors")[1]
                run = json.loads(meta.get(RUN_META, "{}"))
            except Exception:  # noqa: BLE001 - a damaged sample says nothing of the run
                run = {}
    return records, run


def _restore_keys(root: Path, man: dict, run: dict, said: list[str]) -> None:
    """Fill the manifest's missing model/config/dtype from the samples' metadata, else the fit."""
    fit = _read_json(root / FIT_DIR / "fit.json")
    fit = fit if isinstance(fit, dict) and fit.get("kind") == FIT_KIND else {}
    for key, kind in MANIFEST_KEYS.items():
        if key == "samples" or isinstance(man.get(key), kind):
            continue
        for source, where in ((run, "its samples"), (fit, f"{FIT_DIR}/fit.json")):
            if isinstance(source.get(key), kind):
                man[key] = source[key]
                said.append(f"restored {key!r} from {where}")
                break
    for key in ("layers", "layer_notes", "backend"):
        if key not in man and key in run:
            man[key] = run[key]
    missing = [k for k, kind in MANIFEST_KEYS.items() if k != "samples" and not isinstance(man.get(k), kind)]
    if missing:
        raise UserError(f"{root}/{MANIFEST} lacks {', '.join(missing)}, which neither its samples (captured before "
                        f"sparsecal recorded it there) nor a {FIT_DIR}/fit.json hold; capture into a new directory.")


def _open_for_repair(root: Path, said: list[str]) -> tuple[dict, dict[str, dict]]:
    """(the manifest as far as it reads, with missing keys restored; the samples' own records)."""
    root = Path(root)
    if not (root / MANIFEST).is_file() and not (root / SAMPLES).is_dir():
        raise UserError(f"{root} is not a sparsecal run (no {MANIFEST}, no {SAMPLES}/). Create one with "
                        f"`sparsecal capture --out {root}`.")
    man = _read_json(root / MANIFEST)
    if isinstance(man, dict) and man.get("kind") not in (None, RUN_KIND):
        raise UserError(f"{root}/{MANIFEST} holds a {man.get('kind')!r}, not a run; doctor repairs runs only.")
    if isinstance(man, dict) and str(man.get("schema_version", SCHEMA_VERSION)) != str(SCHEMA_VERSION):
        raise UserError(f"{root}/{MANIFEST} has schema version {man.get('schema_version')}; this sparsecal reads "
                        f"{SCHEMA_VERSION}: capture into a new directory.")
    if not isinstance(man, dict):
        said.append(f"{MANIFEST} did not read as a run manifest: rebuilt from the samples")
        man = {}
    man.setdefault("schema_version", SCHEMA_VERSION)
    man.setdefault("kind", RUN_KIND)
    man.setdefault("created", _now())
    records, run = _on_disk(root)
    _restore_keys(root, man, run, said)
    return man, records


def _repair_samples(man: dict, records: dict[str, dict], done: set, said: list[str]) -> None:
    """Planned records checked against the samples (module docstring); finished ones added."""
    from sparsecal.formats.run import RECORD_KEYS

    planned = man.get("samples") if isinstance(man.get("samples"), list) else []
    if not isinstance(man.get("samples"), list):
        said.append("restored 'samples' from the sample folders")
    out, seen = [], set()
    for rec in planned:
        sid = rec.get("id") if isinstance(rec, dict) else None
        if sid in seen or not isinstance(sid, str):
            said.append(f"dropped a planned record without an id ({str(rec)[:60]})" if sid not in seen else
                        f"dropped a second record of {sid}")
            continue
        seen.add(sid)
        own = records.get(sid) if sid in done else None
        if own is not None:
            diff = [f"{k} {rec.get(k, '(missing)')!r} -> {own.get(k)!r}" for k in RECORD_KEYS
                    if rec.get(k) != own.get(k)]
            if diff:
                said.append(f"record of {sid}: {', '.join(diff)} (from its sample.json)")
                rec = own
        elif check_record(sid, rec) is not None:
            said.append(f"dropped the planned record of {sid}: {check_record(sid, rec)} (the capture command plans "
                        "it again)")
            continue
        out.append(rec)
    added = sorted(sid for sid in done - seen if sid in records)
    out += [records[sid] for sid in added]
    if added:
        said.append(f"added {len(added)} finished sample(s) missing from the manifest")
    man["samples"] = out


def recapture_advice(store: RunStore, damaged: dict[str, str]) -> str:
    """What to do about damaged samples: recapture with the same command, unless this sparsecal
    cannot add to the run (its config lacks settings this version records)."""
    lacking = sorted(set(StatsConfig().to_dict()) - set(store.manifest["config"]))
    version = (store.manifest.get("versions") or {}).get("sparsecal", "an older version")
    if lacking:
        return (f"this run was captured by sparsecal {version}, whose config lacks {', '.join(lacking)}: this "
                "sparsecal cannot capture into it. `sparsecal fit` leaves the damaged samples out; to replace them, "
                "capture the run again into a new directory.")
    impossible = [sid for sid, why in damaged.items() if "is missing" not in why and not why.startswith("unreadable")]
    if impossible:
        return (f"remove the damaged sample folders (rm -r {store.root}/{SAMPLES}/ID), then run the same capture "
                "command: it recaptures exactly those.")
    return "run the same capture command again: it recaptures exactly the damaged samples."


def doctor(root) -> list[str]:
    """Check and repair run ``root``; the lines to print (module docstring)."""
    root = Path(root)
    said: list[str] = []
    man, records = _open_for_repair(root, said)
    (root / SAMPLES).mkdir(exist_ok=True)
    with _locked(root):
        store = RunStore(root, dict(man, samples=[r for r in man.get("samples", []) if isinstance(r, dict)
                                                   and isinstance(r.get("id"), str)]))
        scan = store.scan(values=True)
        done = store.done_ids(scan)
        _repair_samples(man, records, done, said)
        store.manifest = man
        if said:
            store._write_manifest()
    damaged = store.damaged(scan)
    lines = [f"{root}: {len(done)} finished samples, {len(man['samples'])} planned"
             + ("" if said else "; the manifest agrees with the samples")]
    lines += [f"repaired: {x}" for x in said]
    lines += [f"damaged: {sid}: {why}" for sid, why in damaged.items()]
    if damaged:
        lines.append(recapture_advice(store, damaged))
    return lines
