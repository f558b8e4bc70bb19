"""Calibration-driven dispatch: where the sparse prefill and decode kernels pay on a GPU, and which
layers run them (docs/formats.md "Break-even file" and "Dispatch record").

**Break-even file** (``sparsecal bench break-even``; kind ``sparsecal-break-even``): per (phase
prefill | decode, timing graph | eager, decode decision head | group, method, head_dim, group =
H / Hkv, length, decode batch) the best SDPA backend's time of one layer's attention (prefill: causal, B = 1;
decode: one new token per row against ``batch`` rows of cached keys) (``dense_ms``,
``dense_backend``), the sparse kernel's time at measured (kernel-counted) sparsities (``points``)
and ``break_even``: the smallest sparsity from which on the sparse kernel is no slower than that
dense path (JSON null = never in the measured range). ``graph``: CUDA-graph replays (device time,
what a serving engine replaying decode graphs pays); ``eager``: one launch per call (host cost
included). Rows written before phases and timings existed are prefill, eager. Several files (decode
rows of several batches measured apart) merge row-wise (``merge_break_even``), one row per key.

**Rule** (pure, here): a layer runs sparse at a length bucket iff its calibrated sparsity of that
phase there >= the phase's break-even there + margin. Break-even between measured lengths is
interpolated linearly in log(length) (never at either end: never); outside the measured range the
nearest measured length's value is used and flagged ``extrapolated``. A prefill of N tokens, or a
decode step against N cached tokens, uses the bucket of the largest calibrated length <= N; below
the shortest calibrated length it runs dense. Decode break-evens are kept per measured batch
(``decode.by_batch``): a decode step of batch B follows the entry of the largest measured batch <= B
(below every measured batch: the smallest). Each decode decision (head | group) has its own entry
per config (``decode``: head, ``decode_group``: group; DECODE_KEYS), from the decode rows and the
calibrated sparsity of that decision. A decode entry's ``dense_backend`` per length is the fastest
reproducible backend of the row's ``dense`` timings (DECODE_REPRODUCIBLE: never cuDNN; OWN_DENSE, the
project's dense decode kernel, among them), while its break-even stays measured against the fastest
of all (``dense_ms``).

Shape legend: L model layers, NL calibrated lengths (the buckets), NM measured lengths, NB measured
decode batches.
"""
from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

import numpy as np

from sparsecal.formats.errors import UserError
from sparsecal.formats.files import atomic_write_text, read_json_manifest
from sparsecal.formats.json_values import finite_number, positive_int
from sparsecal.formats.version import SCHEMA_VERSION, __version__

KIND = "sparsecal-break-even"
METHODS = ("bsfa", "blasst")
PHASES = ("prefill", "decode")
TIMINGS = ("graph", "eager")
DECISIONS = ("head", "group")  # decode skip decision (kernels.sparse.reference.DECISIONS)
DECODE_KEYS = {"head": "decode", "group": "decode_group"}  # a config's decode entry (and sparsity) per decision
DECODE_MODES = ("sparse", "topk", "thresholds")  # sparsify's decode modes that skip (integrations.sparsify.DECODES)
SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
# cuDNN's SDPA decode is not reproducible run to run: on an H100 (torch 2.11) the same evaluation's
# dispatched decode rows differ between two runs with it on and never with it off (data/bench/NOTES.md,
# "determinism"); a dispatched dense decode step is the floor every +dispatch row is compared with
# The project's own dense decode kernel as a decode backend: kernels/sparse/decode_group.py
# group_decode_triton(..., dense=True) (decode_group_dense.py's DENSE_TABLE launch), a fixed split count and
# merge order per shape and device (the first call of a process included), so reproducible
# run to run; a decode row's ``dense`` and a decode entry's ``dense_backend`` may
# name it, a prefill row or entry never
OWN_DENSE = "SPARSECAL_DENSE"
OWN_DENSE_MAX_D = 128  # the head dims its tuned launches cover (DENSE_TABLE: D 64, 128): past it neither timed nor run
DECODE_BACKENDS = (*SDPA_BACKENDS, OWN_DENSE)  # what decode rows and decode entries may name (ties: this order)
DECODE_REPRODUCIBLE = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", OWN_DENSE)
NEVER = math.inf  # break-even in memory when the sparse kernel never pays (JSON null)
GEOMETRY_KEYS = ("block_m", "block_n", "heads", "kv_heads", "head_dim")
REMEDY = "measure it again with `sparsecal bench break-even --run RUN --out FILE`"
RULE = ("a layer runs its sparse prefill at a length bucket iff its calibrated prefill sparsity there >= "
        "break_even + margin; a prefill of N tokens uses the bucket of the largest calibrated length <= N (dense "
        "below the shortest); elsewhere the best SDPA path runs")
DECODE_RULE = ("a decode step of batch B against N cached tokens runs a layer's sparse decode kernel iff the layer's "
               "calibrated decode sparsity (of sparsify's decode mode and decision: decode head, decode_group group) at the bucket of the largest calibrated length "
               "<= N >= its decision's decode break_even + margin of the largest measured batch <= B (the smallest below every "
               "measured batch; dense below the shortest length); elsewhere dense's own decode path (the decode "
               "dense_backend, the fastest reproducible one: that SDPA backend first, or the project's dense decode "
               f"kernel for {OWN_DENSE}); a config without a decode entry does not dispatch decode")


def decode_backend(backend: str) -> str:
    """The backend a dispatched dense decode step runs first: the record's pick, or Flash where that
    is one whose decode is not reproducible (cuDNN, picked by records written before decode picks
    were limited to DECODE_REPRODUCIBLE)."""
    return backend if backend in DECODE_REPRODUCIBLE else "FLASH_ATTENTION"


def decode_dense_pick(row: dict) -> str:
    """The dense backend a decode entry records for a decode row's length: the fastest of the row's
    ``dense`` timings among DECODE_REPRODUCIBLE (never cuDNN); the row's own fastest where it timed
    none of them (decode_backend runs Flash for a cuDNN one). The row's break-even stays measured
    against its fastest backend of all (``dense_ms``)."""
    dense = {b: ms for b, ms in (row.get("dense") or {}).items() if b in DECODE_REPRODUCIBLE}
    return min(dense, key=lambda b: (dense[b], DECODE_BACKENDS.index(b))) if dense else row["dense_backend"]


def break_even(points, dense_ms: float) -> float:
    """The smallest sparsity from which on the sparse kernel is no slower than ``dense_ms``.

    points: [{"sparsity", "ms"}] of the sparse kernel (any order). Sorted by sparsity, the last
    point slower than dense and the next one bound the crossing, found by linear interpolation of
    ms in sparsity (so a noisy dip below dense followed by a slower point does not count).
    Returns the first point's sparsity when no point is slower (it pays from there on; below it is
    not measured), NEVER when the densest-skipping point is still slower (or there are no points)."""
    pts = sorted((float(p["sparsity"]), float(p["ms"])) for p in points)
    slower = [i for i, (_, ms) in enumerate(pts) if ms > dense_ms]
    if not pts or (slower and slower[-1] == len(pts) - 1):
        return NEVER
    if not slower:
        return pts[0][0]
    (s0, t0), (s1, t1) = pts[slower[-1]], pts[slower[-1] + 1]
    return s0 + (t0 - dense_ms) / (t0 - t1) * (s1 - s0)


def _json_be(x: float):
    return None if math.isinf(x) else float(x)


def _mem_be(x) -> float:
    return NEVER if x is None else float(x)


def row_key(r: dict) -> tuple:
    """(phase, timing, decision or "", method, head_dim, group, length, decode batch or 0): one row per key."""
    return (r.get("phase", "prefill"), r.get("timing", "eager"), r.get("decision") or "", r["method"],
            r["head_dim"], r["group"], r["length"], r.get("batch") or 0)


def break_even_rows(measured) -> list[dict]:
    """Rows of the file from timings. measured: [{"method", "head_dim", "group", "length",
    "dense": {SDPA backend name: ms}, "points": [{"sparsity", "ms"}], optional "phase" (prefill),
    "timing" (eager), and for decode "decision" and "batch"}]; the fastest backend is the dense path."""
    rows = []
    for m in measured:
        if not m["dense"]:
            raise UserError(f"no SDPA backend ran at {m['method']} length {m['length']}: nothing to break even with.")
        backend = min(m["dense"], key=m["dense"].get)
        pts = sorted(({"sparsity": float(p["sparsity"]), "ms": float(p["ms"])} for p in m["points"]),
                     key=lambda p: p["sparsity"])
        row = {"phase": m.get("phase", "prefill"), "timing": m.get("timing", "eager"), "method": m["method"],
               "head_dim": int(m["head_dim"]), "group": int(m["group"]), "length": int(m["length"])}
        if row["phase"] == "decode":
            row.update(decision=m["decision"], batch=int(m["batch"]))
        rows.append(row | {"dense_ms": float(m["dense"][backend]), "dense_backend": backend,
                           "dense": {k: float(v) for k, v in m["dense"].items()}, "points": pts,
                           "break_even": _json_be(break_even(pts, m["dense"][backend]))})
    return sorted(rows, key=row_key)


def break_even_file(measured, geometry: dict, provenance: dict, run: dict | None = None) -> dict:
    """The break-even document: rows from ``measured`` (see break_even_rows), the measured
    ``geometry`` (GEOMETRY_KEYS, dtype), ``provenance`` (formats.provenance) and the run it was
    made for ({"name", "model"})."""
    doc = {"kind": KIND, "schema_version": SCHEMA_VERSION, "sparsecal": __version__,
           "gpu": provenance.get("gpu"), "provenance": provenance, "geometry": geometry, "run": run,
           "rows": break_even_rows(measured)}
    check_break_even("break-even document", doc)
    return doc


def write_break_even(path, doc: dict) -> None:
    check_break_even(path, doc)
    atomic_write_text(Path(path), json.dumps(doc, indent=1, allow_nan=False))


def load_break_even(path) -> dict:
    """A break-even file, checked (kind, schema version, rows as break_even_rows writes them)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist; {REMEDY}.")
    doc = read_json_manifest(path, KIND, REMEDY)
    for r in doc.get("rows") or []:  # a file written before phases and timings: prefill rows, eager launches
        if isinstance(r, dict):
            r.setdefault("phase", "prefill")
            r.setdefault("timing", "eager")
    check_break_even(path, doc)
    return doc


def _row_backends(r: dict) -> tuple:
    """The dense backends a row may name: SDPA's; a decode row's also the project's own (OWN_DENSE)."""
    return DECODE_BACKENDS if r.get("phase") == "decode" else SDPA_BACKENDS


def _dense_ok(r: dict) -> bool:
    """A row's ``dense`` timings (optional): {backend the row may name: positive ms}."""
    dense = r.get("dense", {})
    return isinstance(dense, dict) and all(b in _row_backends(r) and finite_number(ms) and ms > 0 for b, ms in dense.items())


def _row_ok(r) -> bool:
    pts = r.get("points") if isinstance(r, dict) else None
    return (isinstance(r, dict) and r.get("method") in METHODS and all(positive_int(r.get(k)) for k in
            ("head_dim", "group", "length")) and finite_number(r.get("dense_ms")) and r["dense_ms"] > 0
            and r.get("dense_backend") in _row_backends(r) and _dense_ok(r) and isinstance(pts, list) and bool(pts)
            and all(isinstance(p, dict) and finite_number(p.get("sparsity")) and 0 <= p["sparsity"] <= 1 and finite_number(p.get("ms"))
                    and p["ms"] > 0 for p in pts)
            and (r.get("break_even") is None or (finite_number(r["break_even"]) and 0 <= r["break_even"] <= 1))
            and r.get("phase", "prefill") in PHASES and r.get("timing", "eager") in TIMINGS
            and ((r.get("decision") in DECISIONS and positive_int(r.get("batch"))) if r.get("phase") == "decode"
                 else r.get("decision") is None))


def check_break_even(path, doc) -> None:
    """Geometry of positive integers, rows of known methods with positive times, sparsities in
    [0, 1], one row per key (row_key: decode rows of several batches side by side), and each
    break_even what its points give."""
    geo = doc.get("geometry") if isinstance(doc, dict) else None
    if not isinstance(geo, dict) or not all(positive_int(geo.get(k)) for k in GEOMETRY_KEYS):
        raise UserError(f"{path}: geometry must give {', '.join(GEOMETRY_KEYS)} as positive integers; {REMEDY}.")
    rows = doc.get("rows")
    if not isinstance(rows, list) or not rows:
        raise UserError(f"{path} holds no rows; {REMEDY}.")
    seen = set()
    for i, r in enumerate(rows):
        if not _row_ok(r):
            raise UserError(f"{path}: rows[{i}] is not a (phase, timing, method {'/'.join(METHODS)}, head_dim, group, "
                            f"length, dense_ms, dense_backend, points, break_even; decode: decision, batch) row; "
                            f"{REMEDY}.")
        key = row_key(r)
        if key in seen:
            raise UserError(f"{path}: two rows for {key}; {REMEDY}.")
        seen.add(key)
        want = break_even(r["points"], r["dense_ms"])
        got = _mem_be(r["break_even"])
        if not (got == want or abs(got - want) <= 1e-9):
            raise UserError(f"{path}: rows[{i}] break_even {r['break_even']} is not what its points give "
                            f"({_json_be(want)}); the file was edited: {REMEDY}.")


def rows_for(doc: dict, method: str, head_dim: int, group: int, phase: str = "prefill", timing: str = "eager",
             decision: str | None = None, batch: int | None = None) -> list[dict]:
    """The rows of one method at one head_dim and group, phase, timing (and decode decision; and
    decode ``batch`` where given), by length."""
    want = (phase, timing, decision or "", method, head_dim, group)
    return sorted((r for r in doc["rows"] if row_key(r)[:6] == want and batch in (None, r.get("batch"))),
                  key=lambda r: r["length"])


def decode_batches(doc: dict, method: str, head_dim: int, group: int, timing: str, decision: str) -> list[int]:
    """The batches the file has decode rows of for one method, head_dim, group, timing and decision, ascending."""
    return sorted({r["batch"] for r in rows_for(doc, method, head_dim, group, "decode", timing, decision)})


def merge_break_even(docs: list[tuple[str, dict]]) -> dict:
    """Several checked break-even files (``[(name, doc)]``) as one: their rows side by side (e.g. the
    decode rows of batch 1 from one file, of batch 16 from another), the first file's provenance and
    run, ``files`` [{"name", "gpu", "commit", "date"}] per file. Refused in one line: files of
    another GPU or geometry, and two files with a row of the same key (row_key)."""
    (first, doc), seen = docs[0], {}
    for name, d in docs:
        if d.get("gpu") != doc.get("gpu") or any(d["geometry"].get(k) != doc["geometry"].get(k) for k in GEOMETRY_KEYS):
            raise UserError(f"{name} was measured on {d.get('gpu')} at {_geo_text(d)}, {first} on {doc.get('gpu')} at "
                            f"{_geo_text(doc)}: give break-even files of one GPU and one model geometry.")
        for r in d["rows"]:
            if row_key(r) in seen:
                raise UserError(f"{seen[row_key(r)]} and {name} both hold a row for {_key_text(r)}: give each row "
                                "in one file only (measure further decode batches alone with `sparsecal bench break-even "
                                "--phases decode --decode-batch B`).")
            seen[row_key(r)] = name
    files = [{"name": n, "gpu": d.get("gpu"), "commit": (d.get("provenance") or {}).get("commit"),
              "date": (d.get("provenance") or {}).get("date")} for n, d in docs]
    out = dict(doc, rows=sorted((r for _, d in docs for r in d["rows"]), key=row_key), files=files)
    check_break_even(" + ".join(n for n, _ in docs), out)
    return out


def _geo_text(doc: dict) -> str:
    return " ".join(f"{k} {doc['geometry'].get(k)}" for k in GEOMETRY_KEYS)


def _key_text(r: dict) -> str:
    """A row's key in words: 'decode graph head blasst head_dim 128 group 4 length 32768 batch 16'."""
    p, t, dec, m, d, g, n, b = row_key(r)
    return " ".join(x for x in (p, t, dec, m, f"head_dim {d} group {g} length {n}", b and f"batch {b}") if x)


def timing_for(doc: dict, phase: str, want: str, head_dim: int, group: int, decision: str | None = None) -> str | None:
    """The timing whose rows a phase's dispatch uses: ``want`` where the file has rows of it at this
    head_dim and group (and decision), else the other one, else None (no rows of the phase)."""
    have = {row_key(r)[1] for r in doc["rows"] if row_key(r)[0] == phase and row_key(r)[2] == (decision or "")
            and (r["head_dim"], r["group"]) == (head_dim, group)}
    return want if want in have else next(iter(sorted(have)), None)


def check_model(path, doc: dict, head_dim: int, group: int, block_m: int, block_n: int) -> None:
    """Refuse a break-even file measured for another head_dim, GQA group or tile geometry (one line)."""
    have = sorted({(r["head_dim"], r["group"]) for r in doc["rows"]})
    geo = doc["geometry"]
    if (head_dim, group) not in have:
        got = ", ".join(f"head_dim {d} group {g}" for d, g in have)
        raise UserError(f"{path} was measured for {got}, but the model has head_dim {head_dim} group {group} "
                        "(H / Hkv); measure it for this model with `sparsecal bench break-even --run RUN --out FILE`.")
    if (geo["block_m"], geo["block_n"]) != (block_m, block_n):
        raise UserError(f"{path} was measured with {geo['block_m']} x {geo['block_n']} tiles, but the run is "
                        f"calibrated at {block_m} x {block_n}; measure it with `sparsecal bench break-even --run RUN`.")


def interpolate(rows: list[dict], length: int, backend_of=None) -> tuple[float, bool, str]:
    """(break-even, extrapolated, dense backend) at ``length`` from one method's rows sorted by
    length: linear in log(length) between measured lengths (NEVER if either end is), the nearest
    measured length outside the range (extrapolated = True). Backend: the nearer row's
    ``backend_of(row)`` (default its fastest, ``dense_backend``; decode: decode_dense_pick)."""
    backend_of = backend_of or (lambda r: r["dense_backend"])
    lens = [r["length"] for r in rows]
    vals = [_mem_be(r["break_even"]) for r in rows]
    if length <= lens[0] or length >= lens[-1]:
        i = 0 if length <= lens[0] else len(lens) - 1
        return vals[i], length not in (lens[0], lens[-1]), backend_of(rows[i])
    i = bisect.bisect_right(lens, length) - 1
    t = (math.log(length) - math.log(lens[i])) / (math.log(lens[i + 1]) - math.log(lens[i]))
    backend = backend_of(rows[i if length * length <= lens[i] * lens[i + 1] else i + 1])  # nearer in log
    if t == 0.0:
        return vals[i], False, backend
    if math.isinf(vals[i]) or math.isinf(vals[i + 1]):
        return NEVER, False, backend
    return vals[i] + t * (vals[i + 1] - vals[i]), False, backend


def break_even_at(rows: list[dict], lengths, backend_of=None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``interpolate`` at each length: (break-even [NL] float, NEVER = inf; extrapolated [NL] bool;
    dense backend per length, ``backend_of`` the row's: default its fastest)."""
    got = [interpolate(rows, int(n), backend_of) for n in lengths]
    return (np.array([g[0] for g in got], float), np.array([g[1] for g in got], bool), [g[2] for g in got])


def plan(sparsity, break_even_values, margin: float = 0.0) -> np.ndarray:
    """sparsity [L, NL] (NaN: the layer is not sparse in the export), break-even [NL] (inf: never)
    -> [L, NL] bool: sparse iff sparsity >= break-even + margin."""
    s = np.asarray(sparsity, float)
    be = np.asarray(break_even_values, float)
    return np.where(np.isnan(s), False, s >= be[None, :] + float(margin))


def bucket(lengths, n: int) -> int | None:
    """Index of the largest calibrated length <= n in ascending ``lengths``; None below the shortest."""
    i = bisect.bisect_right(list(lengths), int(n)) - 1
    return None if i < 0 else i


def config_name(method: str, value) -> str:
    """The operating point as eval and bench name it: ``k=16``, ``target=0.5``."""
    return f"k={int(value)}" if method == "bsfa" else f"target={float(value):g}"


def _grid(s: np.ndarray) -> list:
    return [[None if math.isnan(x) else float(x) for x in row] for row in s]


def _decode_entry(c: dict, be_doc: dict, lengths: list[int], head_dim: int, group: int, timing: str,
                  decision: str, margin: float) -> dict | None:
    """A config's decode entry of one ``decision`` (``decode``: head, ``decode_group``: group): per
    decode mode its calibrated sparsity under that decision (the config's own DECODE_KEYS[decision];
    the same at every batch) and per measured batch of that decision's decode rows (``by_batch``,
    keyed by str(batch)) the break-even, extrapolation flag and dense backend per length (the fastest
    reproducible one, decode_dense_pick; the break-even against the fastest of all, which
    ``fastest_backend`` names: what sparsify(..., decode_dense="fastest") runs) and
    per mode the sparse flags [L, NL]. None: no such decode rows for the method or no decode
    sparsity of the decision for the config."""
    batches = decode_batches(be_doc, c["method"], head_dim, group, timing, decision)
    modes = c.get(DECODE_KEYS[decision])
    if not batches or not modes:
        return None
    sparsity = {m: np.asarray(d["sparsity"], float) for m, d in modes.items()}
    by_batch = {}
    for b in batches:
        rows = rows_for(be_doc, c["method"], head_dim, group, "decode", timing, decision, b)
        be, ext, backends = break_even_at(rows, lengths, decode_dense_pick)
        by_batch[str(b)] = {"break_even": [_json_be(x) for x in be], "extrapolated": [bool(x) for x in ext],
                            "dense_backend": backends, "fastest_backend": break_even_at(rows, lengths)[2],
                            "sparse": {m: plan(s, be, margin).tolist() for m, s in sparsity.items()}}
    return {"decision": decision, "batches": batches,
            "modes": {m: {"source": d["source"], "sparsity": _grid(sparsity[m])} for m, d in modes.items()},
            "by_batch": by_batch}


def _decode_lengths(be_doc: dict, head_dim: int, group: int, t_dec: str | None, decision: str) -> dict:
    """{method: {str(batch): measured decode lengths}} of one decision's rows ({} without them)."""
    if not t_dec:
        return {}
    dec = {m: {str(b): [r["length"] for r in rows_for(be_doc, m, head_dim, group, "decode", t_dec, decision, b)]
               for b in decode_batches(be_doc, m, head_dim, group, t_dec, decision)} for m in METHODS}
    return {m: v for m, v in dec.items() if v}


def _file_info(be_doc: dict, name: str, head_dim: int, group: int, t_pre: str | None, t_dec: dict) -> dict:
    """The record's ``break_even_file``: name(s), GPU, commit(s), date(s), geometry, the measured
    prefill lengths per method and decode lengths per method and batch (head decision; the group
    decision's in ``decode_group_measured_lengths`` where the file has its rows), provenance (the
    first file's) and ``files`` (one per merged file)."""
    files = be_doc.get("files") or []
    prov = be_doc.get("provenance") or {}

    def joined(key):
        got = list(dict.fromkeys(f[key] for f in files if f.get(key)))
        return ", ".join(got) if len(got) > 1 else (got[0] if got else prov.get(key))

    pre = {m: sorted({r["length"] for r in rows_for(be_doc, m, head_dim, group, "prefill", t_pre)}) for m in METHODS}
    out = {"name": name, "gpu": be_doc.get("gpu"), "commit": joined("commit"), "date": joined("date"),
           "geometry": be_doc["geometry"], "measured_lengths": {m: v for m, v in pre.items() if v},
           "decode_measured_lengths": _decode_lengths(be_doc, head_dim, group, t_dec["head"], "head"),
           "provenance": prov}
    if t_dec["group"]:
        out["decode_group_measured_lengths"] = _decode_lengths(be_doc, head_dim, group, t_dec["group"], "group")
    return out | ({"files": files} if files else {})


def dispatch_record(configs: list[dict], lengths, be_doc: dict, name: str, head_dim: int, group: int,
                    margin: float = 0.0, timing: str = "graph") -> tuple[dict, list[str]]:
    """The export's ``dispatch`` record and the methods the break-even file lacks prefill rows for
    (their configs are left out: they run sparse as without dispatch).

    configs: [{"method", "config", "value" (k or target), "source", "sparsity" [L, NL] (NaN: not
    sparse in the export), optional "decode" (head decision) and "decode_group" (group decision)
    {decode mode: {"source", "sparsity" [L, NL]}}}]; lengths: the calibrated lengths [NL], ascending.
    ``timing``: the rows used (graph | eager; the other where the file has only that, recorded in
    ``timing``, per decision: ``decode`` head, ``decode_group`` group, the latter only where the file
    has group rows); each decision's decode rows, of every batch the file measured, give the config's
    entry of that decision (``_decode_entry``; DECODE_KEYS)."""
    lengths = [int(n) for n in lengths]
    t_pre = timing_for(be_doc, "prefill", timing, head_dim, group)
    t_dec = {d: timing_for(be_doc, "decode", timing, head_dim, group, d) for d in DECISIONS}
    out, missing = [], []
    for c in configs:
        rows = rows_for(be_doc, c["method"], head_dim, group, "prefill", t_pre) if t_pre else []
        if not rows:
            missing.append(c["method"])
            continue
        be, ext, backends = break_even_at(rows, lengths)
        s = np.asarray(c["sparsity"], float)
        entry = {"method": c["method"], "config": c["config"], "value": c["value"], "source": c["source"],
                 "break_even": [_json_be(x) for x in be], "extrapolated": [bool(x) for x in ext],
                 "dense_backend": backends, "sparsity": _grid(s), "sparse": plan(s, be, margin).tolist()}
        for d in DECISIONS:
            dec = _decode_entry(c, be_doc, lengths, head_dim, group, t_dec[d], d, margin) if t_dec[d] else None
            if dec is not None:
                entry[DECODE_KEYS[d]] = dec
        out.append(entry)
    timings = {"prefill": t_pre, "decode": t_dec["head"]} | ({"decode_group": t_dec["group"]} if t_dec["group"] else {})
    rec = {"rule": RULE, "decode_rule": DECODE_RULE, "margin": float(margin), "lengths": lengths,
           "timing": timings, "decode_decision": "head",
           "break_even_file": _file_info(be_doc, name, head_dim, group, t_pre, t_dec), "configs": out}
    return rec, sorted(set(missing))


def decode_views(dec: dict) -> list[tuple[int | None, dict]]:
    """A checked decode entry as [(batch, entry of one batch)], ascending in batch; each entry in the
    single-batch layout {"decision", "batch", "break_even", "extrapolated", "dense_backend",
    "fastest_backend", "modes" {mode: {"source", "sparsity", "sparse"}}}. A record written before
    ``by_batch`` is its own one entry (batch: its ``batch``, or None where it does not say); one
    written before ``fastest_backend`` names its ``dense_backend`` there."""
    if "by_batch" not in dec:
        return [(dec.get("batch"), dict(dec, fastest_backend=dec.get("fastest_backend", dec.get("dense_backend"))))]
    out = []
    for b in dec["batches"]:
        e = dec["by_batch"][str(b)]
        out.append((b, {"decision": dec["decision"], "batch": b, "break_even": e["break_even"],
                        "extrapolated": e["extrapolated"], "dense_backend": e["dense_backend"],
                        "fastest_backend": e.get("fastest_backend", e["dense_backend"]),
                        "modes": {m: dict(g, sparse=e["sparse"][m]) for m, g in dec["modes"].items()}}))
    return out


def _grid_ok(grid, n_layers: int, n_len: int, cell) -> bool:
    return (isinstance(grid, list) and len(grid) == n_layers
            and all(isinstance(r, list) and len(r) == n_len and all(map(cell, r)) for r in grid))


def _backends_ok(backends, n_len: int, allowed: tuple) -> bool:
    """A backend (one of ``allowed``) per length."""
    return isinstance(backends, list) and len(backends) == n_len and all(b in allowed for b in backends)


def _per_length_ok(e: dict, n_len: int, allowed: tuple = SDPA_BACKENDS) -> bool:
    """A break-even, extrapolation flag and dense backend (one of ``allowed``) per length."""
    be, ext = e.get("break_even"), e.get("extrapolated")
    return (isinstance(be, list) and len(be) == n_len and all(x is None or (finite_number(x) and 0 <= x <= 1) for x in be)
            and isinstance(ext, list) and len(ext) == n_len and all(isinstance(x, bool) for x in ext)
            and _backends_ok(e.get("dense_backend"), n_len, allowed))


def _grids_ok(e, n_layers: int, n_len: int) -> bool:
    return (isinstance(e, dict)
            and _grid_ok(e.get("sparsity"), n_layers, n_len, lambda x: x is None or (finite_number(x) and 0 <= x <= 1))
            and _grid_ok(e.get("sparse"), n_layers, n_len, lambda x: isinstance(x, bool)))


def _one_batch_ok(d, n_layers: int, n_len: int) -> bool:
    """A decode entry of one batch (decode_views' layout, and records written before ``by_batch``)."""
    modes = d.get("modes") if isinstance(d, dict) else None
    return (d.get("decision") in DECISIONS and _per_length_ok(d, n_len, DECODE_BACKENDS) and isinstance(modes, dict)
            and bool(modes)
            and ("fastest_backend" not in d or _backends_ok(d["fastest_backend"], n_len, DECODE_BACKENDS))
            and ("batch" not in d or positive_int(d["batch"]))  # the decode rows' batch (older records lack it)
            and all(m in DECODE_MODES and _grids_ok(g, n_layers, n_len) for m, g in modes.items()))


def _batches_ok(d: dict) -> bool:
    """``batches`` ascending positive integers, ``by_batch`` one entry per batch with flags per mode."""
    bs, by, modes = d.get("batches"), d.get("by_batch"), d.get("modes")
    return (isinstance(bs, list) and bool(bs) and all(map(positive_int, bs)) and bs == sorted(set(bs))
            and isinstance(by, dict) and set(by) == {str(b) for b in bs} and isinstance(modes, dict)
            and all(isinstance(g, dict) for g in modes.values())
            and all(isinstance(e, dict) and isinstance(e.get("sparse"), dict) and set(e["sparse"]) == set(modes)
                    for e in by.values()))


def _decode_ok(d, n_layers: int, n_len: int) -> bool:
    if d is None:
        return True
    if not isinstance(d, dict):
        return False
    if "by_batch" not in d:
        return _one_batch_ok(d, n_layers, n_len)
    return _batches_ok(d) and all(_one_batch_ok(v, n_layers, n_len) for _, v in decode_views(d))


def _entry_ok(e, n_layers: int, n_len: int, timing: dict) -> bool:
    """A config's entry: per-length break-evens, its grids, and each decode entry well formed where
    the record names that decision's decode timing (``decode_group``: of the group decision)."""
    if not isinstance(e, dict) or e.get("method") not in METHODS or not isinstance(e.get("config"), str):
        return False
    grp = e.get("decode_group")
    return (_per_length_ok(e, n_len) and _grids_ok(e, n_layers, n_len) and _decode_ok(e.get("decode"), n_layers, n_len)
            and (e.get("decode") is None or timing.get("decode") is not None)
            and (grp is None or (_decode_ok(grp, n_layers, n_len) and grp.get("decision") == "group"
                                 and timing.get("decode_group") is not None)))


def decode_entries(e: dict) -> list[dict]:
    """A checked config entry's decode entries: ``decode`` then ``decode_group``, those it has."""
    return [e[k] for k in DECODE_KEYS.values() if e.get(k)]


def _flags_follow(grids: dict, break_even_values, margin: float, n_layers: int) -> bool:
    s = np.array([[np.nan if x is None else x for x in r] for r in grids["sparsity"]], float).reshape(n_layers, -1)
    return plan(s, [_mem_be(x) for x in break_even_values], margin).tolist() == grids["sparse"]


def check_dispatch(path, rec, num_layers: int) -> None:
    """blasst.json's optional ``dispatch`` record: ascending positive lengths, per config the
    break-even per length, a sparsity and a sparse flag per layer and length (and the same per decode
    mode under the decode break-even of each measured batch, for each decision's entry: ``decode``,
    ``decode_group``), the flags being exactly ``plan`` of the sparsities (an edited flag is refused)."""
    bad = f"{path}: dispatch "
    if not isinstance(rec, dict):
        raise UserError(f"{bad}is not an object; export it again with `sparsecal export --break-even FILE`.")
    lens = rec.get("lengths")
    timing = rec.get("timing", {"prefill": "eager", "decode": None})  # records written before timings: eager
    if not (isinstance(lens, list) and lens and all(map(positive_int, lens)) and lens == sorted(set(lens))
            and finite_number(rec.get("margin")) and isinstance(rec.get("configs"), list) and isinstance(timing, dict)
            and timing.get("prefill") in TIMINGS and timing.get("decode") in (*TIMINGS, None)
            and timing.get("decode_group") in (*TIMINGS, None)):
        raise UserError(f"{bad}needs ascending positive lengths, a margin, timings and configs; export it again.")
    for i, e in enumerate(rec["configs"]):
        if isinstance(e, dict) and isinstance(e.get("dense_backend"), list) and OWN_DENSE in e["dense_backend"]:
            raise UserError(f"{bad}configs[{i}] names {OWN_DENSE} as a prefill dense backend, but it is a decode "
                            "kernel (decode entries only); export it again.")
        if not _entry_ok(e, num_layers, len(lens), timing):
            raise UserError(f"{bad}configs[{i}] does not hold a break-even, sparsity and sparse flag per layer "
                            f"({num_layers}) and length ({len(lens)}) (decode, decode_group: per mode and batch, "
                            "the decision's timing named); export it again.")
        views = [v for d in decode_entries(e) for _, v in decode_views(d)]
        if not (_flags_follow(e, e["break_even"], rec["margin"], num_layers)
                and all(_flags_follow(g, v["break_even"], rec["margin"], num_layers)
                        for v in views for g in v["modes"].values())):
            raise UserError(f"{bad}configs[{i}] ({e['config']}): the sparse flags are not the rule applied to its "
                            "sparsities; the file was edited: export it again.")


def find_config(rec: dict | None, method: str, value) -> dict | None:
    """The dispatch entry of one operating point (BSFA k, BLASST target), or None."""
    if not rec:
        return None
    want = config_name(method, value)
    return next((e for e in rec["configs"] if e["method"] == method and e["config"] == want), None)


def layer_ranges(layers) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' ('-' when empty)."""
    xs, out = sorted(int(x) for x in layers), []
    for x in xs:
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out) or "-"
