"""BSFA calibration: per-(layer, head, query block, k) thresholds aggregated over samples, and
predicted vs measured density.

Per sample, capture stores the BSFA reference's threshold: the midpoint of the k-th and
(k+1)-th largest candidate block maxima, -inf when A_i <= k. Here they are aggregated over the
calibration samples (mean, or median), position by position; positions no sample reached take
the last computed threshold. A tile is kept iff its max score >= threshold; diagonal tiles are
always kept.

Shape legend: K k values, L layers, H query heads, P query blocks (of the sample or the export),
T sorted candidate block maxima kept per position by capture.
"""
from __future__ import annotations

import numpy as np

AGGREGATIONS = ("mean", "median")


class ThresholdAccumulator:
    """Adds per-sample thresholds [L, H, P_s, K] of samples of any length; ``result`` gives the
    aggregated [K, L, H, P] with P = the longest sample's query blocks (or more, carried forward)."""

    def __init__(self, method: str = "mean"):
        if method not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {method!r}")
        self.method = method
        self.sum = None      # [L, H, P, K] float64
        self.count = None    # [P] samples that reached each position
        self.kept = []       # per-sample arrays (median only)

    def add(self, thr: np.ndarray) -> None:
        t = np.asarray(thr)  # [L, H, P_s, K]; summed in float64 without a converted copy
        p = t.shape[2]
        if self.sum is None:
            self.sum, self.count = np.zeros(t.shape[:2] + (0, t.shape[3])), np.zeros(0, np.int64)
        if p > self.sum.shape[2]:
            grow = np.zeros(self.sum.shape[:2] + (p - self.sum.shape[2], self.sum.shape[3]))
            self.sum = np.concatenate([self.sum, grow], axis=2)
            self.count = np.concatenate([self.count, np.zeros(p - len(self.count), np.int64)])
        np.add(self.sum[:, :, :p], t, out=self.sum[:, :, :p])  # -inf stays -inf: every sample or none
        self.count[:p] += 1
        if self.method == "median":
            self.kept.append(t.astype(np.float32))

    def result(self, num_blocks: int | None = None) -> np.ndarray:
        """Aggregated thresholds [K, L, H, num_blocks] (float32)."""
        if self.sum is None:
            raise ValueError("no samples added")
        if self.method == "mean":
            out = self.sum / self.count[:, None]
        else:
            out = np.empty_like(self.sum)
            for p in range(self.sum.shape[2]):
                out[:, :, p] = np.median(np.stack([t[:, :, p] for t in self.kept if t.shape[2] > p]), axis=0)
        out = np.moveaxis(out, -1, 0).astype(np.float32)  # [K, L, H, P]
        return extend_positions(out, num_blocks or out.shape[-1])


def extend_positions(thr: np.ndarray, num_blocks: int) -> np.ndarray:
    """[..., P] -> [..., num_blocks]: positions past P take the last computed threshold."""
    p = thr.shape[-1]
    if num_blocks <= p:
        return thr[..., :num_blocks]
    tail = np.repeat(thr[..., -1:], num_blocks - p, axis=-1)
    return np.concatenate([thr, tail], axis=-1)


def predicted_density(cand: np.ndarray, reach: np.ndarray, k_values) -> np.ndarray:
    """(min(k, A_i) + diagonal blocks) / reachable over one sequence. cand, reach [P] -> [K]."""
    cand, reach = np.asarray(cand, np.int64), np.asarray(reach, np.int64)
    diag = (reach - cand).sum()
    return np.array([(np.minimum(k, cand).sum() + diag) / reach.sum() for k in k_values])


def measured_kept(thr: np.ndarray, top: np.ndarray, cand: np.ndarray):
    """Candidates kept by fitted thresholds on one sample.

    thr [K, L, H, Pt] fitted; top [L, H, P, T] the sample's candidate bmax sorted descending
    (-inf padded); cand [P]. Query block p uses thr[..., min(p, Pt - 1)]. Returns
    (kept [K, L, H, P] int64, saturated [K]: positions where all T stored maxima pass and
    A_i > T, so the count is a lower bound).
    """
    k_n, _, _, pt = thr.shape
    p, t_len = top.shape[2], top.shape[3]
    pos = np.minimum(np.arange(p), pt - 1)
    top = np.asarray(top, np.float32)
    th = thr[..., pos].astype(np.float32)                                            # [K, L, H, P]
    n_pass = np.stack([(top >= th[i][..., None]).sum(-1) for i in range(k_n)], -1)  # [L, H, P, K]
    cand = np.asarray(cand, np.int64)
    kept = np.minimum(n_pass, cand[None, None, :, None])
    saturated = ((n_pass == t_len) & (cand[None, None, :, None] > t_len)).sum(axis=(0, 1, 2))
    return np.moveaxis(kept, -1, 0), saturated


def density(kept: np.ndarray, cand: np.ndarray, reach: np.ndarray) -> np.ndarray:
    """Kept candidates + diagonal blocks over reachable, per leading index. kept [..., P] -> [...]."""
    cand, reach = np.asarray(cand, np.int64), np.asarray(reach, np.int64)
    return (kept.sum(-1) + (reach - cand).sum()) / reach.sum()


def retained_mass(skipped_mass: np.ndarray) -> np.ndarray:
    """1 - skipped softmax mass, averaged over query blocks. [..., P] -> [...]."""
    return 1.0 - np.asarray(skipped_mass, np.float64).mean(-1)
