"""The fit directory's files: Parquet tables (polars), the aggregated thresholds and the pooled
gap histograms (safetensors), fit.json; all written atomically, read back with checks. Also the
BSFA table builders (per-sample measurements -> rows).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sparsecal.formats.errors import UserError
from sparsecal.formats.files import atomic_write, atomic_write_text
from sparsecal.formats.table_values import check_ranges
from sparsecal.formats.tensors import save_arrays
from sparsecal.formats.version import SCHEMA_VERSION

THRESHOLDS = "bsfa_thresholds.safetensors"
GAP_CUM = "gap_cum.safetensors"


def write_table(path: Path, rows: list[dict]) -> None:
    import polars as pl

    df = pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()
    atomic_write(path, df.write_parquet)


def read_table(fit_dir, name: str):
    """A fit table as a polars DataFrame, or a UserError that says which command makes it."""
    import polars as pl

    path = Path(fit_dir) / f"{name}.parquet"
    if not path.is_file():
        raise UserError(f"{path} is missing; run `sparsecal fit {Path(fit_dir).parent}` to make it.")
    try:
        df = pl.read_parquet(path)
    except Exception as e:  # noqa: BLE001 - a damaged file is one user-facing line
        raise UserError(f"{path} is not a readable Parquet table ({type(e).__name__}); run `sparsecal fit` again.")
    check_table_values(df, path)
    return df


SHARES = ("measured", "measured_min", "measured_max", "predicted", "sparsity", "sparsity_candidates", "retained_mass",
          "retained_mass_topk", "retained_min", "candidate_share", "achieved", "achieved_candidates", "target",
          "max_sparsity", "share_zero", "share_below_range", "share_above_range", "head_p10", "head_p90")
COUNTS = ("k", "layer", "head", "samples", "rows", "positions", "bound_positions", "bound_rows", "n_lengths",
          "saturated_positions", "open_rows", "diagonal", "middle", "sink")


def check_table_values(df, path) -> None:
    """The values a fit table's readers rely on (export's dispatch record, the dashboard, fit's
    summary): shares and sparsities (SHARES) in [0, 1], counts and indices (COUNTS) finite and
    >= 0, lengths >= 1, where the column exists; null passes (not measured). Columns that may
    legitimately hold NaN or infinities (fit residuals, lambda bounds, histogram edges) are not
    constrained. One line naming the table, column, row and value."""
    rules = [(c, 0.0, 1.0) for c in SHARES] + [(c, 0.0, None) for c in COUNTS] + [("length", 1.0, None)]
    check_ranges(df, str(path), rules, "Run `sparsecal fit` again.")


def write_json(path: Path, doc: dict) -> None:
    atomic_write_text(path, json.dumps(doc, indent=1))


def write_thresholds(out: Path, thr: np.ndarray, ks, manifest: dict, split, extra: dict | None = None) -> None:
    """The aggregated BSFA thresholds [K, L, H, P] with what export needs to describe them; ``extra``:
    more arrays (the decode thresholds [K, L, H, P] f32 and their calibrated positions, bsfa_decode)."""
    meta = {"schema_version": SCHEMA_VERSION, "model": manifest["model"]["id"],
            "k_values": json.dumps(list(ks)), "samples": len(split.train),
            "lengths": json.dumps(sorted({r["length"] for r in split.train}))}
    arrays = {"thresholds": np.ascontiguousarray(thr, np.float32), "k_values": np.array(list(ks), dtype=np.int64)}
    arrays.update(extra or {})
    save_arrays(out / THRESHOLDS, arrays, metadata=meta)


def write_gap_cum(out: Path, pooled: dict, edges: np.ndarray, orders, stride: int) -> None:
    """Pooled gap histograms on a coarse ln(lambda) grid: per mode, the tiles (and their mass) with
    gap in [log_lambda[e-1], log_lambda[e]) (bin 0: below log_lambda[0]), for every ``stride``-th
    edge; a cumulative sum over the last axis gives the tiles below each log_lambda[e], i.e. the
    sparsity at any lambda on the grid. count_bins/mass_bins [Nlen, L, H, O, E'] float32 (stored as
    (index, value) pairs where that is smaller, see formats.tensors), reach/npos [Nlen] per layer and head,
    lengths [Nlen]. The dashboard's per-head sparsity at a chosen lambda."""
    pick = np.arange(len(edges) - 1, -1, -stride)[::-1]
    tensors, sparse = {"log_lambda": edges[pick].copy()}, set()
    for mode, sums in pooled.items():
        if not sums:
            continue
        lens = sorted(sums)

        def binned(key, sums=sums, lens=lens):
            cum = np.stack([np.cumsum(getattr(sums[n], key), -1)[..., pick] for n in lens])
            return np.diff(cum, axis=-1, prepend=0.0).astype(np.float32)

        tensors[f"{mode}.lengths"] = np.array(lens, dtype=np.int64)
        tensors[f"{mode}.count_bins"] = binned("count")
        tensors[f"{mode}.mass_bins"] = binned("mass")
        tensors[f"{mode}.reach"] = np.array([sums[n].reach for n in lens], dtype=np.float64)
        tensors[f"{mode}.npos"] = np.array([sums[n].npos for n in lens], dtype=np.float64)
        sparse |= {f"{mode}.count_bins", f"{mode}.mass_bins"}
    save_arrays(out / GAP_CUM, tensors, sparse=sparse,
                 metadata={"schema_version": SCHEMA_VERSION, "orders": json.dumps(list(orders))})


def bsfa_density_rows(evals: dict, ks, label: str) -> list[dict]:
    """Table 1 per k and length: predicted vs measured density with spread over samples and heads."""
    rows = []
    for n, items in sorted(evals.items()):
        dens = np.stack([e["density"] for e in items])           # [S, K, L, H]
        per_sample = dens.mean((2, 3))                            # [S, K]
        per_head = dens.mean(0).reshape(len(ks), -1)              # [K, L*H]
        ret = np.stack([e["retained"] for e in items]).mean((0, 2, 3))
        sat = np.stack([e["saturated"] for e in items]).sum(0)
        for i, k in enumerate(ks):
            rows.append({"k": k, "length": n, "samples": len(items), "split": label,
                         "predicted": float(items[0]["predicted"][i]),
                         "measured": float(per_sample[:, i].mean()), "measured_std": float(per_sample[:, i].std(ddof=1)) if len(items) > 1 else float("nan"),
                         "measured_min": float(per_sample[:, i].min()), "measured_max": float(per_sample[:, i].max()),
                         "head_p10": float(np.quantile(per_head[i], 0.1)),
                         "head_p90": float(np.quantile(per_head[i], 0.9)),
                         "retained_mass_topk": float(ret[i]), "saturated_positions": int(sat[i])})
    return rows


def bsfa_head_rows(evals: dict, ks) -> list[dict]:
    """Measured density and top-k retained mass per k, length, layer and head (held-out mean)."""
    rows = []
    for n, items in sorted(evals.items()):
        dens = np.stack([e["density"] for e in items]).mean(0)    # [K, L, H]
        ret = np.stack([e["retained"] for e in items]).mean(0)
        for (i, layer, head), v in np.ndenumerate(dens):
            rows.append({"k": ks[i], "length": n, "layer": layer, "head": head,
                         "predicted": float(items[0]["predicted"][i]), "measured": float(v),
                         "retained_mass_topk": float(ret[i, layer, head])})
    return rows
