"""The counts a sparsified model keeps of its last forward (``model.sparsecal_stats``), held so that a
counted layer costs two small device writes: the per-row tensors are stored, and the per-layer totals
are their sums over the batch, computed when read (no reduction on the forward's path).

    row_skipped    [L, B, H] int64  candidate tiles each row and head skipped, per layer
    row_reachable  [L, B, H] int64  the tiles each row and head could reach (a host number, filled)
    skipped        [L, H]    int64  row_skipped summed over the batch (read-only)
    reachable      [L, H]    int64  row_reachable summed over the batch (read-only)
    vfa_* / ...    [L, H]           what a variant adds (sparsify_variants.VFA_STATS), stored

Shape legend
    L layers   B batch rows of the forward   H query heads
"""
from __future__ import annotations

from collections.abc import MutableMapping

import torch

DERIVED = {"skipped": "row_skipped", "reachable": "row_reachable"}  # total -> the per-row tensor it sums


class Stats(MutableMapping):
    """A mapping of name -> tensor on the attention's device (module docstring); ``skipped`` and
    ``reachable`` are read from the per-row tensors, never stored."""

    def __init__(self):
        self._held: dict = {}

    def __getitem__(self, key):
        if key in DERIVED and DERIVED[key] in self._held:
            return self._held[DERIVED[key]].sum(dim=1)
        return self._held[key]

    def __setitem__(self, key, value) -> None:
        if key in DERIVED:
            raise KeyError(f"sparsecal_stats[{key!r}] is the sum of {DERIVED[key]!r} over the batch; write that")
        self._held[key] = value

    def __delitem__(self, key) -> None:
        del self._held[key]

    def __iter__(self):
        yield from self._held
        yield from (k for k, rows in DERIVED.items() if rows in self._held)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def held(self):
        """The stored tensors (what a new forward zeroes)."""
        return self._held.values()

    def on(self, device, layers: int, heads: int, batch: int) -> Stats:
        """(Re)allocate the per-row tensors as zeros on ``device`` for ``batch`` rows when they are
        missing or of another device or shape; returns self."""
        rows = self._held.get("row_skipped")
        if rows is None or rows.device != torch.device(device) or rows.shape != (layers, batch, heads):
            zeros = torch.zeros(layers, batch, heads, dtype=torch.int64, device=device)
            self._held.update(row_skipped=zeros, row_reachable=zeros.clone())
        return self

    def record(self, layer: int, skipped: torch.Tensor, reach: int) -> None:
        """A counted layer: skipped [B, H] int64 on the device, ``reach`` tiles per row and head."""
        self._held["row_skipped"][layer] = skipped
        self._held["row_reachable"][layer].fill_(reach)  # a host number: filled, no tensor made of it
