"""Small computations between the files and the charts: pure numpy/polars, no Streamlit.

- ``prompts_frame``: the manifest's planned samples with whether each finished (Overview).
- ``head_sparsity_frame``: BLASST sparsity and retained mass per layer x head at any ln(lambda) on
  the gap_cum grid, from RUN/fit/gap_cum.safetensors (no sample is re-read).
- ``law_lambda``: lambda of a fitted law at a length, from the blasst_fit table.
- ``tile_frame``: one (sample, layer, head)'s raw tiles with the BSFA and BLASST skip decisions.
- ``thresholds_frame``: a [H, P] slice of BSFA thresholds as rows.
- ``pareto_front``: the accuracy-speedup points no other point of the same length beats.

Geometry is DESIGN.md's: query block i covers rows [i*BM, min((i+1)*BM, N)), key block j keys
[j*BN, ...); j is reachable from i when j*BN <= min((i+1)*BM, N) - 1 and a candidate (skippable)
when (j+1)*BN <= i*BM; reachable non-candidates are diagonal tiles, always computed.
"""
from __future__ import annotations

import math

import numpy as np
import polars as pl

from sparsecal.formats.geometry import TILE_KINDS, tile_kinds


def prompts_frame(manifest: dict, finished: list[dict]) -> pl.DataFrame:
    """Planned samples: id, task, length, answer (joined), seed, finished, raw (tiles stored),
    seconds (capture time, null when unfinished). Finished samples absent from the plan are kept."""
    done = {r["id"]: r for r in finished}
    planned = list(manifest.get("samples", []))
    known = {r["id"] for r in planned}
    planned += [r for r in finished if r["id"] not in known]
    rows = []
    for r in planned:
        f = done.get(r["id"])
        ans = r.get("answer")
        rows.append({"id": r["id"], "task": str(r.get("task", "?")), "length": int(r.get("length", 0)),
                     "answer": ", ".join(map(str, ans)) if isinstance(ans, list) else str(ans or ""),
                     "seed": r.get("seed"), "finished": f is not None, "raw": bool(f and f.get("raw")),
                     "seconds": float(f["seconds"]) if f and f.get("seconds") is not None else None})
    schema = {"id": pl.Utf8, "task": pl.Utf8, "length": pl.Int64, "answer": pl.Utf8, "seed": pl.Int64,
              "finished": pl.Boolean, "raw": pl.Boolean, "seconds": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def snap(grid: np.ndarray, x: float) -> int:
    """Index of the grid point nearest to x."""
    return int(np.argmin(np.abs(np.asarray(grid) - x)))


def head_sparsity_frame(gc, length: int, order: str, log_lambda: float, layers: list | None = None) -> pl.DataFrame:
    """Per layer x head at the grid point nearest ``log_lambda``: layer, head, sparsity (skipped
    candidate tiles / reachable tiles), retained_mass (1 - skipped mass / query positions),
    log_lambda (the grid value used). ``gc`` is a data.GapCum; ``layers`` maps its layer axis to the
    model's layer indices (data.layer_map; None: the identity)."""
    li = int(np.flatnonzero(np.asarray(gc.lengths) == length)[0])
    o = list(gc.orders).index(order)
    e = snap(gc.log_lambda, log_lambda)
    sp = gc.count_below[li, :, :, o, e] / max(float(gc.reach[li]), 1.0)
    rm = 1.0 - gc.mass_below[li, :, :, o, e] / max(float(gc.npos[li]), 1.0)
    pos, heads = np.indices(sp.shape)
    model_layer = np.asarray(layers if layers is not None else range(sp.shape[0]))[pos]
    return pl.DataFrame({"layer": model_layer.ravel(), "head": heads.ravel(),
                         "sparsity": sp.ravel().astype(np.float64), "retained_mass": rm.ravel().astype(np.float64),
                         "log_lambda": np.full(sp.size, float(gc.log_lambda[e]))})


def law_lambda(fits: pl.DataFrame, mode: str, order: str, target: float, length: int, law: str = "a/L"):
    """lambda = a L^-b of the fitted ``law`` ('a/L' has b = 1) at ``length``; None if not fitted."""
    row = fits.filter((pl.col("mode") == mode) & (pl.col("order") == order) & (pl.col("law") == law)
                      & ((pl.col("target") - target).abs() < 1e-9))
    if not row.height:
        return None
    a, b = float(row["a"][0]), float(row["b"][0])
    return a * float(length) ** (-b) if a > 0 and math.isfinite(a) else None


def tile_frame(tiles: dict, n: int, bm: int, bn: int, order_index: int, thresholds=None,
               log_lambda: float | None = None) -> pl.DataFrame:
    """One (sample, layer, head) tile by tile. ``tiles``: bmax, mass [P, Kb], gap [O, P, Kb]
    (data.raw_tiles); ``thresholds``: BSFA thresholds [P'] of this layer and head (position i uses
    min(i, P'-1)) or None; ``log_lambda``: BLASST's ln(lambda) or None.
    Columns: q_block, k_block, kind, bmax, gap, mass (null where unreachable), bsfa_skip,
    blasst_skip (candidates only: bmax < threshold, gap < ln(lambda))."""
    kind = tile_kinds(n, bm, bn)
    p, kb = kind.shape
    bmax = np.asarray(tiles["bmax"], np.float64)[:p, :kb]
    gap = np.asarray(tiles["gap"], np.float64)[order_index, :p, :kb]
    mass = np.asarray(tiles["mass"], np.float64)[:p, :kb]
    cand = kind == 1
    bsfa = np.zeros_like(cand)
    if thresholds is not None and len(thresholds):
        thr = np.asarray(thresholds, np.float64)[np.minimum(np.arange(p), len(thresholds) - 1)]
        bsfa = cand & (bmax < thr[:, None])
    blasst = cand & (gap < log_lambda) if log_lambda is not None else np.zeros_like(cand)
    i, j = np.indices(kind.shape)
    reach = kind > 0
    clean = lambda a: np.where(reach & np.isfinite(a), a, np.nan).ravel()
    return pl.DataFrame({"q_block": i.ravel(), "k_block": j.ravel(),
                         "kind": np.array(TILE_KINDS)[kind.ravel()], "bmax": clean(bmax), "gap": clean(gap),
                         "mass": clean(mass), "bsfa_skip": bsfa.ravel(), "blasst_skip": blasst.ravel()}
                        ).with_columns(pl.col(c).fill_nan(None) for c in ("bmax", "gap", "mass"))


def mask_summary(tiles: pl.DataFrame) -> dict:
    """Sparsity (skipped / reachable tiles) and retained mass share of each skip mask; the mass is
    the tile mass of DESIGN.md (mean over rows), so retained = 1 - skipped mass / query blocks."""
    reach = tiles.filter(pl.col("kind") != "unreachable")
    blocks = max(int(reach["q_block"].n_unique()), 1)
    out = {"reachable": reach.height}
    for m in ("bsfa", "blasst"):
        s = reach.filter(pl.col(f"{m}_skip"))
        out[f"{m}_sparsity"] = s.height / max(reach.height, 1)
        out[f"{m}_retained_mass"] = 1.0 - float(s["mass"].fill_null(0).sum()) / blocks
    return out


def thresholds_frame(thr: np.ndarray, ks: list, k: int, layer: int) -> pl.DataFrame:
    """BSFA thresholds of one k and layer as rows: head, q_block, threshold (null where -inf:
    every candidate kept). ``thr`` [K, L, H, P]."""
    t = np.asarray(thr[ks.index(k), layer], np.float64)
    heads, blocks = np.indices(t.shape)
    return pl.DataFrame({"head": heads.ravel(), "q_block": blocks.ravel(),
                         "threshold": np.where(np.isfinite(t), t, np.nan).ravel()}
                        ).with_columns(pl.col("threshold").fill_nan(None))


def pareto_front(points: pl.DataFrame) -> pl.DataFrame:
    """Rows of ``points`` (length, speedup, accuracy_rel_dense) that no other row of the same length
    dominates: none is at least as fast and as accurate and strictly better in one of the two."""
    if not points.height:
        return points
    keep = []
    for n in sorted(set(points["length"])):
        g = points.filter(pl.col("length") == n)
        s, a = g["speedup"].to_numpy(), g["accuracy_rel_dense"].to_numpy()
        beaten = ((s[None, :] >= s[:, None]) & (a[None, :] >= a[:, None])
                  & ((s[None, :] > s[:, None]) | (a[None, :] > a[:, None]))).any(axis=1)
        keep.append(g.filter(pl.Series(~beaten)))
    return pl.concat(keep)
