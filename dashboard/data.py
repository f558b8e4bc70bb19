"""What the dashboard reads from a run directory: checked, cached, and torch-free.

Every loader takes a path, stats the file(s) it reads and calls a ``st.cache_data`` function keyed
by (path, mtime_ns, size): a re-fit or re-export is picked up on the next rerun, an unchanged file
is read once. Problems come back as one-line errors the pages show instead of a traceback:

- ``Missing``: the file is not there; the message names the command that makes it
  (`sparsecal capture ... --raw`, `sparsecal fit RUN`, `sparsecal export RUN --out RUN/export`).
- ``Broken``: the file is there but unreadable, of another schema version, or lacks columns this
  dashboard needs (an older sparsecal wrote it); the message says to re-run the command.

Files read (layouts and checks in sparsecal.formats: run.py, exports.py, tensors.py; the fit's in
analysis/fit.py and analysis/tables.py):

    RUN/manifest.json                           model, geometry/config, versions, planned samples
    RUN/samples/<id>/sample.json                finished samples (task, length, answer, seconds)
    RUN/samples/<id>/raw.safetensors            raw_bmax, raw_mass [L,H,P,Kb], raw_gap [L,H,O,P,Kb] fp16
    RUN/fit/fit.json                            the fit's request, split, BLASST laws, warnings
    RUN/fit/<table>.parquet                     the analysis tables (TABLE_COLUMNS)
    RUN/fit/bsfa_thresholds.safetensors         thresholds [K,L,H,P], k_values [K]
    RUN/fit/gap_cum.safetensors                 <mode>.count_bins/mass_bins [Nlen,L,H,O,E'] (cumulated on load), reach/npos/lengths [Nlen], log_lambda [E']
    RUN/export/ (or a directory given later)    thresholds.bsfa.pt, thresholds.safetensors, blasst.json

Safetensors are read with the numpy framework (``safe_open(..., framework="np")``), and raw tiles
one (layer, head) slice at a time, so an 8K run's tiles cost a few hundred KB per view.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import streamlit as st

from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import BLASST_JSON, BSFA_PT, BSFA_ST, load_blasst
from sparsecal.formats.files import check_schema, read_json_manifest
from sparsecal.formats.json_values import fit_values
from sparsecal.formats.run import (
    FIT_DIR,
    FIT_KIND,
    JOINT_MISSING,
    MANIFEST,
    RESCALE_MISSING,
    RUN_KIND,
    captured_layers,
    check_manifest,
)
from sparsecal.formats.sample_values import RAW_KEYS, check_record, raw_value_problem
from sparsecal.formats.tensors import SPARSE_META, decode

RUNS_ENV = "SPARSECAL_RUNS"          # os.pathsep-separated run directories (the CLI also passes argv)
RESULTS_ENV = "SPARSECAL_RESULTS"    # os.pathsep-separated result directories (Accuracy-speedup)
FIT = FIT_DIR
EXPORT_NAMES = (BSFA_PT, BSFA_ST, BLASST_JSON)

# Columns each page needs from a fit table; a table without them was written by an older sparsecal.
TABLE_COLUMNS = {
    "bsfa_density": ("k", "length", "samples", "split", "predicted", "measured", "measured_std",
                     "measured_min", "measured_max", "head_p10", "head_p90", "retained_mass_topk"),
    "bsfa_heads": ("k", "length", "layer", "head", "predicted", "measured", "retained_mass_topk"),
    "blasst_curves": ("mode", "order", "length", "log_lambda", "sparsity", "retained_mass"),
    "blasst_lambda": ("mode", "order", "target", "length", "lambda_best", "in_fit", "max_sparsity",
                      "lambda_law", "lambda_power", "residual_law"),
    "blasst_fit": ("mode", "order", "target", "law", "a", "b", "r2"),
    "blasst_eval": ("mode", "order", "target", "length", "method", "lambda", "achieved", "retained_mass"),
    "blasst_decode_group": ("order", "target", "length", "lambda_head", "head_sparsity_at_head_lambda",
                            "group_sparsity_at_head_lambda", "lambda_group_best", "a_head", "a_group"),
    "stab_where": ("order", "length", "layer", "head", "sink", "diagonal", "middle"),
    "stab_tstar": ("order", "length", "layer", "bin_lo", "bin_hi", "rows"),
    "qinit": ("length", "layer", "head", "rows", "q05", "q25", "q50", "q75", "q95"),
    "qinit_hist": ("length", "layer", "bin_lo", "bin_hi", "rows"),
    "joint": ("length", "layer", "head", "rows", "q50", "share_below_1", "share_below_5", "share_above_5"),
    "joint_hist": ("length", "layer", "bin_lo", "bin_hi", "rows"),
    "stab_rescale": ("order", "length", "layer", "head", "rows", "mean_rescales", "share_zero", "q50", "q90"),
    "stab_rescale_hist": ("order", "length", "layer", "rescales", "open", "rows"),
    "stab_shortfall": ("order", "prefix", "length", "layer", "head", "rows", "share_zero", "q50", "q90"),
    "stab_shortfall_hist": ("order", "prefix", "length", "layer", "bin_lo", "bin_hi", "rows"),
}


class Missing(UserError):
    """A file the page needs is absent; the message names the command that makes it."""


class Broken(UserError):
    """A file is present but unreadable, of another schema, or lacks needed columns."""


def _stamp(path: Path) -> tuple[int, int]:
    s = path.stat()
    return s.st_mtime_ns, s.st_size


def _fit_cmd(root) -> str:
    return f"`sparsecal fit {root}`"


def _broken(fn, *args):
    """fn(*args), with the floor's one-line UserError shown as Broken on the page."""
    try:
        return fn(*args)
    except (Missing, Broken):
        raise
    except UserError as e:
        raise Broken(str(e)) from None


# ---- run discovery -----------------------------------------------------------------------------
def run_paths(argv=None) -> list[Path]:
    """Run directories given to the app: $SPARSECAL_RUNS if set, else the script's arguments.
    A directory without manifest.json stands for the runs directly inside it."""
    env = os.environ.get(RUNS_ENV)
    items = [p for p in env.split(os.pathsep) if p] if env else list(argv or [])
    out: list[Path] = []
    for item in items:
        p = Path(item).expanduser().resolve()
        if (p / "manifest.json").is_file() or not p.is_dir():
            out.append(p)
        else:  # capture runs only: an evaluation directory inside is not offered as a run
            from sparsecal.dashboard.serve import child_runs

            out.extend(child_runs(p) or [p])
    return list(dict.fromkeys(out))


def shipped_result_dirs() -> list[Path]:
    """The evaluations committed with the project (data/eval/*/ holding a curves.parquet), when this
    sparsecal runs from a checkout; none otherwise."""
    root = Path(__file__).resolve().parents[1] / "data" / "eval"  # dashboard/ sits in the checkout root
    return sorted(d for d in root.glob("*") if (d / "curves.parquet").is_file()) if root.is_dir() else []


def result_dirs(root: Path) -> list[Path]:
    """Where Accuracy-speedup looks: RUN/results/ and every directory in $SPARSECAL_RESULTS; while
    that variable is unset, the committed evaluations (shipped_result_dirs) stand in for it."""
    env = os.environ.get(RESULTS_ENV)
    extra = shipped_result_dirs() if env is None else [Path(p).expanduser().resolve() for p in env.split(os.pathsep) if p]
    return [Path(root) / "results"] + extra


@st.cache_data(show_spinner=False, max_entries=32)
def _manifest(path: str, stamp, kind: str, remedy: str) -> dict:
    return _broken(read_json_manifest, Path(path), kind, remedy)


def manifest(root: Path) -> dict:
    """manifest.json of a run, with its kind and schema version checked (formats.files)."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise Missing(f"{root} is not a sparsecal run (no {MANIFEST}); make one with "
                      f"`sparsecal capture --out {root}`.")
    man = _manifest(str(path), _stamp(path), RUN_KIND, "capture the run again with this sparsecal")
    _broken(check_manifest, path, man)
    return man


def layer_map(root: Path) -> tuple[list[int], list[str] | None, dict]:
    """(captured model layers, in the stats arrays' order; each model layer's attention type, None
    for runs that predate them; {layer: why it was not captured})."""
    man = manifest(root)
    return captured_layers(man), man["model"].get("layer_types"), man.get("layer_notes", {})


@st.cache_data(show_spinner=False, max_entries=32)
def _samples(root: str, stamp) -> tuple[list[dict], list[str]]:
    out, damaged = [], []
    for d in sorted((Path(root) / "samples").glob("*/sample.json")):
        if d.parent.name.startswith("."):
            continue
        why = None
        try:
            rec = json.loads(d.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            rec, why = None, f"not readable JSON ({type(e).__name__})"
        if why is None:
            bad = check_record(d.parent.name, rec)   # the run reader's rule: its id, a task, a length >= 1
            why = None if bad is None else f"not this sample's record: {bad}"
        if why is not None:
            damaged.append(f"{d.parent.name}: {d.name} is {why}")
            continue
        rec["raw"] = (d.parent / "raw.safetensors").is_file()
        out.append(rec)
    return out, damaged


def samples(root: Path) -> list[dict]:
    """Finished samples' records (sample.json) with ``raw``: whether raw tiles were stored. A
    damaged record is left out (``damaged_samples`` names it), so one bad file hides one sample."""
    base = Path(root) / "samples"
    if not base.is_dir():
        return []
    return _samples(str(root), _stamp(base))[0]


def damaged_samples(root: Path) -> list[str]:
    """'<sample>: sample.json is ...' for each finished sample whose record cannot be read."""
    base = Path(root) / "samples"
    return _samples(str(root), _stamp(base))[1] if base.is_dir() else []


def show_damaged(root: Path) -> None:
    """One warning naming the samples the pages leave out, and what recaptures them."""
    bad = damaged_samples(root)
    if bad:
        st.warning(f"{len(bad)} sample(s) left out, their records are damaged ({'; '.join(bad[:5])}"
                   f"{'; ...' if len(bad) > 5 else ''}): run `sparsecal doctor {root}`, then the capture command "
                   "again to recapture them.", icon=":material/warning:")


# ---- fit ---------------------------------------------------------------------------------------
def fit_doc(root: Path) -> dict:
    """RUN/fit/fit.json, checked like analysis.fit.load_fit (without importing the fit machinery)."""
    path = Path(root) / FIT / "fit.json"
    if not path.is_file():
        raise Missing(f"{root} has no fit yet; run {_fit_cmd(root)} to make RUN/fit/.")
    doc = _manifest(str(path), _stamp(path), FIT_KIND, f"run {_fit_cmd(root)} again")
    why = fit_values(doc)
    if why:
        raise Broken(f"{path}: {why}; run {_fit_cmd(root)} again.")
    return doc


@st.cache_data(show_spinner=False, max_entries=64)
def _table(fit_dir: str, name: str, stamp):
    from sparsecal.analysis.tables import read_table

    try:
        return read_table(fit_dir, name)
    except UserError as e:
        raise Broken(str(e)) from None


def table(root: Path, name: str):
    """A fit table (polars DataFrame) with the columns the dashboard needs (TABLE_COLUMNS)."""
    fit_dir = Path(root) / FIT
    path = fit_dir / f"{name}.parquet"
    if not path.is_file():
        raise Missing(f"{path.name} is missing from {fit_dir}; run {_fit_cmd(root)} to make it.")
    df = _table(str(fit_dir), name, _stamp(path))
    lacking = [c for c in TABLE_COLUMNS.get(name, ()) if c not in df.columns]
    if lacking and df.height:
        raise Broken(f"{path} lacks columns {', '.join(lacking)} (written by an older sparsecal); "
                     f"run {_fit_cmd(root)} again.")
    return df


def rescale_table(root: Path, name: str):
    """A running-max rescale / shortfall table (stab_rescale*, stab_shortfall*). A run captured
    before these statistics (its config has no ``rescale_bins``, or its fit wrote the table
    empty) is Missing with the one line formats.run.RESCALE_MISSING; a fit older than the run's
    capture is Missing with `sparsecal fit` as the remedy."""
    old_run = "rescale_bins" not in manifest(root).get("config", {})
    if old_run and not (Path(root) / FIT / f"{name}.parquet").is_file():
        raise Missing(RESCALE_MISSING)
    df = table(root, name)
    if not df.height:
        raise Missing(RESCALE_MISSING)
    return df


def joint_table(root: Path, name: str):
    """VFA's joint-statistic table (joint, joint_hist). Absent (a fit older than the statistic):
    Missing naming `sparsecal fit`; empty (a run captured before it): Missing with the one line
    formats.run.JOINT_MISSING."""
    df = table(root, name)
    if not df.height:
        raise Missing(JOINT_MISSING)
    return df


def _read_safetensors(path: Path, keys=None) -> tuple[dict, dict]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            meta = dict(f.metadata() or {})
            arrays = {k: f.get_tensor(k) for k in f.keys() if keys is None or k in keys}  # noqa: SIM118 - not iterable
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line on the page
        raise Broken(f"{path} is not a readable safetensors file ({type(e).__name__}).") from None
    return arrays, meta


@dataclass(frozen=True)
class GapCum:
    """Pooled, cumulated gap histograms of one mode (analysis/tables.py ``write_gap_cum``).

    count_below/mass_below [Nlen, L, H, O, E']: candidate tiles (their softmax mass) with gap below
    log_lambda[e], all samples of a length pooled; reach/npos [Nlen]: reachable tiles and query
    positions per (layer, head) over those samples; lengths [Nlen]; orders [O]."""

    log_lambda: np.ndarray
    lengths: np.ndarray
    count_below: np.ndarray
    mass_below: np.ndarray
    reach: np.ndarray
    npos: np.ndarray
    orders: tuple


@st.cache_data(show_spinner=False, max_entries=16)
def _gap_cum(path: str, stamp) -> dict:
    arrays, meta = _read_safetensors(Path(path))
    _broken(check_schema, path, meta.get("schema_version"), "run `sparsecal fit` again")
    arrays = decode(arrays, json.loads(meta.get(SPARSE_META, "{}")))
    out = {}
    for mode in ("prefill", "decode"):
        keys = [f"{mode}.{k}" for k in ("lengths", "count_bins", "mass_bins", "reach", "npos")]
        if all(k in arrays for k in keys) and "log_lambda" in arrays:
            lens, count, mass, reach, npos = (arrays[k] for k in keys)
            why = _gap_cum_values(arrays["log_lambda"], lens, count, mass, reach)
            if why:
                raise Broken(f"{path}: {mode} {why}; run `sparsecal fit` again.")
            out[mode] = GapCum(arrays["log_lambda"].astype(np.float64), lens, np.cumsum(count, -1),
                               np.cumsum(mass, -1), reach, npos, tuple(json.loads(meta.get("orders", "[]"))))
    return out


def _gap_cum_values(log_lambda, lens, count, mass, reach) -> str | None:
    """What is impossible in one mode's pooled gap histograms, else None: the ln(lambda) grid finite
    and ascending, lengths positive, counts and masses finite and >= 0 with one row per length."""
    ll = np.asarray(log_lambda, np.float64)
    if ll.size and (not np.isfinite(ll).all() or (np.diff(ll) <= 0).any()):
        return "log_lambda is not a finite ascending grid"
    if (np.asarray(lens) < 1).any():
        return "a length is below 1"
    for name, a in (("count_bins", count), ("mass_bins", mass), ("reach", reach)):
        a = np.asarray(a, np.float64)
        if not np.isfinite(a).all() or (a < 0).any():
            return f"{name} holds a NaN, infinite or negative value"
        if a.shape[:1] != np.shape(lens):
            return f"{name} has {a.shape[0] if a.ndim else 0} rows for {len(lens)} lengths"
    return None


def gap_cum(root: Path) -> dict[str, GapCum]:
    """Per mode ('prefill', 'decode' when captured) the pooled cumulated gap histograms."""
    path = Path(root) / FIT / "gap_cum.safetensors"
    if not path.is_file():
        raise Missing(f"gap_cum.safetensors is missing from {Path(root) / FIT}; run {_fit_cmd(root)} to make it.")
    return _gap_cum(str(path), _stamp(path))


@st.cache_data(show_spinner=False, max_entries=16)
def _thresholds(path: str, stamp) -> tuple[np.ndarray, list]:
    arrays, meta = _read_safetensors(Path(path))
    _broken(check_schema, path, meta.get("schema_version"), "run `sparsecal fit` again")
    if "thresholds" not in arrays or "k_values" not in arrays:
        raise Broken(f"{path} holds no thresholds or k values; run `sparsecal fit` again.")
    thr, ks = arrays["thresholds"].astype(np.float32), [int(k) for k in arrays["k_values"].tolist()]
    if thr.ndim != 4 or len(ks) != thr.shape[0] or ks != sorted(set(ks)) or min(ks, default=0) < 1:
        raise Broken(f"{path}: k values {ks} do not index the thresholds' first axis {list(thr.shape)} (positive, "
                     "ascending); run `sparsecal fit` again.")
    if np.isnan(thr).any() or np.isposinf(thr).any():
        raise Broken(f"{path}: a threshold is NaN or +inf (each is finite, or -inf: keep every candidate); "
                     "run `sparsecal fit` again.")
    return thr, ks


def fit_thresholds(root: Path) -> tuple[np.ndarray, list]:
    """The fitted BSFA thresholds [K, L, H, P] (float32, -inf where every candidate is kept) and k."""
    path = Path(root) / FIT / "bsfa_thresholds.safetensors"
    if not path.is_file():
        raise Missing(f"bsfa_thresholds.safetensors is missing from {Path(root) / FIT}; run {_fit_cmd(root)}.")
    return _thresholds(str(path), _stamp(path))


def fit_thresholds_file(path: Path) -> tuple[np.ndarray, list]:
    """Thresholds [K, L, H, P] and k values of any thresholds safetensors (fit or export)."""
    path = Path(path)
    if not path.is_file():
        raise Missing(f"{path} is missing; write it with `sparsecal export RUN --out {path.parent}`.")
    return _thresholds(str(path), _stamp(path))


# ---- raw tiles ---------------------------------------------------------------------------------
@st.cache_data(show_spinner=False, max_entries=64)
def _raw_slice(path: str, stamp, layer: int, head: int) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="np") as f:
            names = set(f.keys())
            lacking = set(RAW_KEYS) - names
            if lacking:
                raise Broken(f"{path} lacks {', '.join(sorted(lacking))}; capture the run again with --raw.")
            shape = f.get_slice("raw_bmax").get_shape()
            if not (0 <= layer < shape[0] and 0 <= head < shape[1]):
                raise Broken(f"{path} has {shape[0]} layers x {shape[1]} heads; no layer {layer}, head {head}.")
            out = {k[4:]: np.asarray(f.get_slice(k)[layer, head], dtype=np.float32)
                   for k in RAW_KEYS}
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001
        raise Broken(f"{path} is not a readable raw tile file ({type(e).__name__}).") from None
    for name, a in out.items():   # -inf marks an unreachable tile; NaN and +inf are never a tile's value
        why = raw_value_problem(f"raw_{name}", a)
        if why is not None:
            raise Broken(f"{path}: layer {layer}, head {head}: {why} (NaN, +inf or a mass outside [0, 1]); "
                         "capture the sample again with --raw.")
    return out


def raw_tiles(root: Path, sid: str, layer: int, head: int) -> dict[str, np.ndarray]:
    """One (layer, head) of a sample's raw tiles: bmax, mass [P, Kb] and gap [O, P, Kb] (float32;
    -inf where a tile is not reachable)."""
    path = Path(root) / "samples" / sid / "raw.safetensors"
    if not path.is_file():
        raise Missing(f"sample {sid} has no raw tiles; capture with `sparsecal capture ... --raw` to see them.")
    return _raw_slice(str(path), _stamp(path), int(layer), int(head))


# ---- exports -----------------------------------------------------------------------------------
def export_dirs(root: Path) -> list[Path]:
    """Export directories of a run: RUN/export and RUN/exports/* holding any export file."""
    root = Path(root)
    cands = [root / "export"] + sorted((root / "exports").glob("*"))
    return [d for d in cands if d.is_dir() and any((d / n).is_file() for n in EXPORT_NAMES)]


@st.cache_data(show_spinner=False, max_entries=16)
def _export_meta(path: str, stamp) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="np") as f:
            meta = dict(f.metadata() or {})
            shape = f.get_slice("thresholds").get_shape()
    except Exception as e:  # noqa: BLE001
        raise Broken(f"{path} is not a readable BSFA export ({type(e).__name__}); export it again.") from None
    if meta.get("kind") != "sparsecal-bsfa":
        raise Broken(f"{path} is not a sparsecal BSFA export (kind {meta.get('kind')!r}); export it again.")
    _broken(check_schema, path, meta.get("schema_version"), "export it again with `sparsecal export`")
    meta.pop(SPARSE_META, None)
    return {"metadata": meta, "shape": list(shape)}


def export_bsfa_meta(export_dir: Path) -> dict:
    """thresholds.safetensors' metadata and thresholds shape [num_k, L, H, P]."""
    path = Path(export_dir) / BSFA_ST
    if not path.is_file():
        raise Missing(f"{path} is missing; write it with `sparsecal export RUN --out {export_dir}`.")
    return _export_meta(str(path), _stamp(path))


def export_blasst(export_dir: Path) -> dict:
    """blasst.json, checked for the skip-softmax algorithm and the schema version."""
    path = Path(export_dir) / BLASST_JSON
    if not path.is_file():
        raise Missing(f"{path} is missing; write it with `sparsecal export RUN --out {export_dir}`.")
    return _blasst(str(path), _stamp(path))


@st.cache_data(show_spinner=False, max_entries=16)
def _blasst(path: str, stamp) -> dict:
    return _broken(load_blasst, Path(path))


@st.cache_data(show_spinner=False, max_entries=16)
def _bytes(path: str, stamp) -> bytes:
    return Path(path).read_bytes()


def file_bytes(path: Path) -> bytes:
    """A file's content for a download button (cached on path + mtime)."""
    return _bytes(str(path), _stamp(Path(path)))
