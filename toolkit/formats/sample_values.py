"""What a run sample must hold beyond a readable file: its record, the shapes its length and the
run's config imply, and values in the range each statistic allows (docs/formats.md "Runs").

Checked by every reader of a sample (``RunStore.load_sample`` on the arrays it reads, ``fit`` and
``doctor`` on every array of every sample), torch-free:

- sample.json: an object whose ``id`` is the folder's name, ``task`` a string and ``length`` a
  positive integer N;
- stats.safetensors, from its header: ``input_ids`` [N], ``candidates`` and ``reachable`` [P] with
  P = ceil(N / block_m), every other array [Lc, H, ...] (captured layers, query heads),
  ``joint_count`` (where present) the shape of ``qinit_count`` (the same bins), and the trailing
  axes the run's settings fix (``trailing_shapes``: histogram bins, orders, k values, and the
  rescale / shortfall bins where the run recorded their settings);
- values: no NaN anywhere; thresholds and sorted block maxima (THRESHOLD_KEYS) finite or -inf
  (-inf: keep every candidate / padding); every other statistic finite and >= 0; per-position
  masses (UNIT_KEYS) at most 1 + UNIT_EPS; ``candidates`` and ``reachable`` exactly the block
  counts of N (geometry.block_counts).

raw.safetensors (capture --raw; ``check_raw``, by ``RunStore.load_sample(raw=True)``; the dashboard
checks the one layer and head it shows by ``raw_value_problem``): ``raw_bmax`` and ``raw_mass``
[Lc, H, P, Kb], ``raw_gap`` [Lc, H, O, P, Kb] (O the run's scan orders), one [Lc, H] for all three;
no NaN or +inf (-inf marks an unreachable tile), masses in [0, 1 + UNIT_EPS].

Shape legend: N tokens, P query blocks, Kb = ceil(N / block_n) key blocks, O scan orders, Lc
captured layers, H query heads.
"""
from __future__ import annotations

import numpy as np

from sparsecal.formats.geometry import PREFIXES, block_counts, cdiv
from sparsecal.formats.stats_config import StatsConfig

THRESHOLD_KEYS = frozenset({"bsfa_threshold", "bsfa_top_bmax", "decode_bsfa_threshold", "decode_bsfa_top_bmax"})
UNIT_KEYS = frozenset({"bsfa_skipped_mass", "bsfa_top_mass", "bsfa_cand_mass", "decode_bsfa_skipped_mass",
                       "decode_bsfa_top_mass", "decode_bsfa_cand_mass"})
UNIT_EPS = 1e-3          # float32 sums of a row's softmax weights land a little above 1
FLAT_KEYS = ("input_ids", "candidates", "reachable")
SAME_SHAPE = {"joint_count": "qinit_count"}  # arrays on another's bins


def check_record(sid: str, record) -> str | None:
    """None when a sample record (sample.json, or the manifest's entry) describes sample ``sid``
    with a task and a positive integer length; else what is wrong."""
    if not isinstance(record, dict) or record.get("id") != sid:
        return "its record does not describe this sample (id)"
    n = record.get("length")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return f"its record's length is {n!r}, not a positive integer"
    if not isinstance(record.get("task"), str):
        return f"its record's task is {record.get('task')!r}, not a string"
    return None


GAP_KEYS = ("gap_count", "gap_mass", "decode_gap_count", "decode_gap_mass", "diag_gap_count", "diag_gap_mass",
            "decode_diag_gap_count", "decode_diag_gap_mass")
K_KEYS = ("bsfa_kept", "bsfa_skipped_mass", "bsfa_threshold")


def trailing_shapes(cfg: StatsConfig, length: int, rescale: bool = True) -> dict[str, tuple]:
    """The trailing axes (after [Lc, H]) the run's settings fix for a ``length``-token sample: the
    gap histograms [O, gap bins], t* [O, 3] and [O, tstar_bins], q-init and joint [q-init bins], the
    BSFA per-position statistics [P, K] (O scan orders, P query blocks, K k values); with
    ``rescale`` (the run recorded its rescale / shortfall settings) the running-max rescales
    [O, rescale_bins], their excess [O] and shortfalls [O, 2 prefixes, shortfall bins]."""
    o, p = len(cfg.orders), cdiv(length, cfg.block_m)
    out = {k: (o, len(cfg.gap_edges()) + 1) for k in GAP_KEYS}
    out |= {k: (p, len(cfg.k_values)) for k in K_KEYS}
    out |= {"tstar_where": (o, 3), "tstar_hist": (o, cfg.tstar_bins)}
    out |= {k: (len(cfg.qinit_edges()) + 1,) for k in ("qinit_count", "joint_count")}
    if rescale:
        out |= {"rescale_count": (o, cfg.rescale_bins), "rescale_excess": (o,),
                "shortfall_count": (o, len(PREFIXES), len(cfg.shortfall_edges()) + 1)}
    return out


def check_shapes(shapes: dict[str, tuple], length: int, block_m: int, layers: int, heads: int,
                 cfg: StatsConfig | None = None, rescale: bool = True) -> str | None:
    """None when the arrays' shapes {name: shape} fit a sample of ``length`` tokens (with ``cfg``,
    the run's settings: ``trailing_shapes`` too, the rescale statistics' with ``rescale``); else
    what is wrong."""
    want = {"input_ids": (length,), "candidates": (cdiv(length, block_m),), "reachable": (cdiv(length, block_m),)}
    for name in FLAT_KEYS:
        if name not in shapes:
            return f"stats.safetensors lacks {name}"
        if tuple(shapes[name]) != want[name]:
            return (f"{name} has shape {list(shapes[name])}, not {list(want[name])} of a {length}-token sample "
                    "(its record's length)")
    for name, shape in sorted(shapes.items()):
        if name not in FLAT_KEYS and tuple(shape[:2]) != (layers, heads):
            return f"{name} has shape {list(shape)}, not [{layers} layers, {heads} heads, ...] of this run"
    for name, like in SAME_SHAPE.items():
        if name in shapes and like in shapes and tuple(shapes[name]) != tuple(shapes[like]):
            return f"{name} has shape {list(shapes[name])}, not {list(shapes[like])} of {like} (the same bins)"
    for name, tail in (trailing_shapes(cfg, length, rescale) if cfg is not None else {}).items():
        if name in shapes and tuple(shapes[name][2:]) != tail:
            return (f"{name} has shape {list(shapes[name])}, not [{layers}, {heads}, {', '.join(map(str, tail))}] "
                    "of this run's settings")
    return None


def _first_bad(name: str, a: np.ndarray, bad: np.ndarray) -> str:
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    return f"{name}{list(idx)} is {a[idx].item()!r}"


def check_values(arrays: dict[str, np.ndarray], length: int | None = None, block_m: int | None = None,
                 block_n: int | None = None) -> str | None:
    """None when every array holds values its statistic allows (module docstring); else the first
    offending entry, e.g. "gap_mass[0, 1, 0, 3] is nan". With the geometry given, ``candidates``
    and ``reachable`` must be the block counts of ``length``."""
    for name in sorted(arrays):
        a = np.asarray(arrays[name])
        if a.size == 0:
            continue
        if a.dtype.kind == "f":
            bad = np.isnan(a) | (a == np.inf) | ((a == -np.inf) if name not in THRESHOLD_KEYS else False)
            if bad.any():
                return _first_bad(name, a, bad)
        if name in THRESHOLD_KEYS or a.dtype.kind not in "fiu":
            continue
        bad = a < 0
        if name in UNIT_KEYS:
            bad = bad | (a > 1.0 + UNIT_EPS)
        if bad.any():
            return _first_bad(name, a, bad) + (" (outside [0, 1])" if name in UNIT_KEYS else " (negative)")
    if None not in (length, block_m, block_n):
        for name, want in zip(("candidates", "reachable"), block_counts(length, block_m, block_n)):
            if name in arrays and not np.array_equal(np.asarray(arrays[name]), want):
                return f"{name} are not the block counts of a {length}-token sample"
    return None


RAW_KEYS = ("raw_bmax", "raw_gap", "raw_mass")   # raw.safetensors (capture --raw)


def raw_value_problem(name: str, a: np.ndarray) -> str | None:
    """None when raw tile array ``name`` (or a slice of it) holds only values a tile can have: no
    NaN or +inf, and for ``raw_mass`` finite masses in [0, 1 + UNIT_EPS]; else the first offending
    entry of ``a``."""
    a = np.asarray(a)
    bad = np.isnan(a) | (a == np.inf)
    if name == "raw_mass":
        bad = bad | (np.isfinite(a) & ((a < 0) | (a > 1.0 + UNIT_EPS)))
    return _first_bad(name, a, bad) if bad.any() else None


def check_raw(arrays: dict[str, np.ndarray], length: int, block_m: int, block_n: int,
              orders: int | None = None) -> str | None:
    """None when the raw tile arrays present in ``arrays`` have the shapes a ``length``-token sample
    gives them (module docstring; ``orders``: the run's scan orders, when known) and possible
    values; else what is wrong."""
    tiles = (cdiv(length, block_m), cdiv(length, block_n))
    lead = None
    for name in RAW_KEYS:
        if name not in arrays:
            continue
        shape = tuple(np.shape(arrays[name]))
        order_axis = name == "raw_gap"   # [Lc, H, O, P, Kb]; the others [Lc, H, P, Kb]
        want = ((orders,) if order_axis and orders else ()) + tiles
        if len(shape) != 4 + order_axis or shape[-len(want):] != want or lead not in (None, shape[:2]):
            return (f"{name} has shape {list(shape)}, not [{', '.join(map(str, lead or ('layers', 'heads')))}, "
                    f"{'O, ' if order_axis and not orders else ''}{', '.join(map(str, want))}] of a "
                    f"{length}-token sample")
        lead = shape[:2]
        why = raw_value_problem(name, arrays[name])
        if why is not None:
            return why
    return None
