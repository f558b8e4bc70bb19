"""A compact per-(task, length) summary of a run, read back from its files (numpy only).

Columns: samples, tokens, capture seconds, and three first-look statistics averaged over layers,
heads and samples: BLASST sparsity and retained mass at lambda = 1e-3 (forward order; sparsity
over all reachable tiles, diagonal tiles counted as kept), and the share of rows whose running
max stabilizes at the sink block.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from sparsecal.formats.stats_config import StatsConfig

SUMMARY_LAMBDA = 1e-3
SUMMARY_KEYS = ("gap_count", "gap_mass", "tstar_where", "reachable")


def sample_summary(tensors: dict, cfg: StatsConfig, lam: float = SUMMARY_LAMBDA) -> dict:
    """Sparsity and retained mass at ``lam`` (forward order) and the sink-stabilized row share."""
    o = cfg.orders.index("forward") if "forward" in cfg.orders else 0
    edges = cfg.gap_edges()
    k = int(np.searchsorted(edges, math.log(lam), side="right"))  # bins 0..k-1 lie below e_{k-1}
    counts = tensors["gap_count"][:, :, o]
    masses = tensors["gap_mass"][:, :, o]
    reach = float(tensors["reachable"].sum())
    positions = len(tensors["reachable"])
    skipped = counts[..., :k].sum(-1)
    lost = masses[..., :k].sum(-1)
    where = tensors["tstar_where"][:, :, o]
    return {
        "sparsity": float((skipped / reach).mean()),
        "retained_mass": float((1 - lost / positions).mean()),
        "sink_rows": float((where[..., 0] / where.sum(-1)).mean()),
    }


def run_summary(store) -> list[dict]:
    """One row per (task, length) over the finished samples of ``store``."""
    cfg = StatsConfig.from_dict(store.manifest["config"])
    groups = defaultdict(list)
    for sid in sorted(store.done_ids()):
        rec, tensors = store.load_sample(sid, keys=SUMMARY_KEYS)  # not the large BSFA arrays
        groups[(rec["task"], rec["length"])].append((rec, sample_summary(tensors, cfg)))
    rows = []
    for (task, length), items in sorted(groups.items()):
        mean = lambda key: float(np.mean([s[key] for _, s in items]))
        rows.append({"task": task, "length": length, "samples": len(items),
                     "seconds": float(np.mean([r.get("seconds", float("nan")) for r, _ in items])),
                     "sparsity": mean("sparsity"), "retained_mass": mean("retained_mass"),
                     "sink_rows": mean("sink_rows")})
    return rows
