"""What an instrumented attention pass computes and how it bins it (recorded in every run)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from sparsecal.formats.geometry import ORDERS


@dataclass(frozen=True)
class StatsConfig:
    """Geometry and reduction settings of a capture.

    Gap bins: edges e_0 < ... < e_{E-1} = 0 spaced ``gap_step`` apart from ``gap_lo``; bin 0 holds
    gap < e_0, bin k holds e_{k-1} <= gap < e_k, bin E holds gap >= 0. The skip count for
    ln(lambda) = e_k is then exactly the sum of bins 0..k. Q-init error bins work the same way
    on [qinit_lo, qinit_hi]. Normalized t* uses ``tstar_bins`` equal bins on [0, 1].

    Running-max rescales per row: ``rescale_bins`` integer bins, bin k = k rescales for
    k < rescale_bins - 1, the last bin k >= rescale_bins - 1 (with the rows' excess over it summed
    separately, so the mean stays exact). Running-max shortfall (>= 0): edges e_0 = 0 < e_1 < ...
    < e_E = ``shortfall_hi`` spaced ``shortfall_step`` apart; bin 0 holds shortfall = 0 exactly (the
    row already holds its final max), bin k holds e_{k-1} < x <= e_k, bin E + 1 holds x > e_E
    (and +inf: the row has seen no key yet). That is torch.bucketize(x, edges, right=False).
    """

    block_m: int = 128
    block_n: int = 64
    orders: tuple[str, ...] = ORDERS
    k_values: tuple[int, ...] = (4, 8, 16, 32, 64)
    top_bmax: int = 0  # sorted candidate block maxima kept per position; 0 = 2 * max(k_values)
    gap_lo: float = -25.0
    gap_step: float = 0.05
    qinit_lo: float = -20.0
    qinit_hi: float = 20.0
    qinit_step: float = 0.25
    tstar_bins: int = 20
    rescale_bins: int = 64
    shortfall_hi: float = 20.0
    shortfall_step: float = 0.25
    decode_rows: int = 64
    raw: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.block_m < 1 or self.block_n < 1:
            raise ValueError("block sizes must be positive")
        if list(self.k_values) != sorted(set(self.k_values)) or min(self.k_values) < 1:
            raise ValueError("k values must be distinct positive integers in ascending order")
        if self.rescale_bins < 2 or self.shortfall_hi <= 0 or self.shortfall_step <= 0:
            raise ValueError("rescale_bins must be at least 2, shortfall_hi and shortfall_step positive")
        if not (self.gap_step > 0 and self.gap_lo < 0 and self.qinit_step > 0 and self.qinit_lo < self.qinit_hi):
            raise ValueError("gap_step and qinit_step must be positive, gap_lo below 0 and qinit_lo below qinit_hi")
        if self.tstar_bins < 1 or self.top_bmax < 0 or self.decode_rows < 0:
            raise ValueError("tstar_bins must be at least 1, top_bmax and decode_rows at least 0")
        for o in self.orders:
            if o not in ORDERS:
                raise ValueError(f"Unknown scan order '{o}'. Available: {', '.join(ORDERS)}.")

    @property
    def top_count(self) -> int:
        return self.top_bmax or 2 * max(self.k_values)

    def gap_edges(self) -> np.ndarray:
        """Gap bin edges, float64 [NG - 1]."""
        n = round(-self.gap_lo / self.gap_step)
        return np.linspace(self.gap_lo, 0.0, n + 1, dtype=np.float64)

    def qinit_edges(self) -> np.ndarray:
        """Q-init error bin edges, float64 [NQ - 1]."""
        n = round((self.qinit_hi - self.qinit_lo) / self.qinit_step)
        return np.linspace(self.qinit_lo, self.qinit_hi, n + 1, dtype=np.float64)

    def shortfall_edges(self) -> np.ndarray:
        """Running-max shortfall bin edges, float64 [NS - 1] from 0 (bins: class docstring)."""
        n = round(self.shortfall_hi / self.shortfall_step)
        return np.linspace(0.0, self.shortfall_hi, n + 1, dtype=np.float64)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["orders"] = list(self.orders)
        d["k_values"] = list(self.k_values)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> StatsConfig:
        d = dict(d)
        d["orders"] = tuple(d["orders"])
        d["k_values"] = tuple(d["k_values"])
        return cls(**d)
