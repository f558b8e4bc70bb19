"""Shared machinery of the consumer skip-rule simulators (``consumer_rules.py``): the causal mask
as a consumer applies it, row maxima per key tile, the rows a query tile holds, and the sequential
running-max vote of a flash-attention kernel.

A kernel walks its key tiles in order (forward scan). Per query row it keeps a running max m; a row
votes "skip" for key tile t when (tile row max - m) < ln(lambda), with m the max over the tiles
already taken in (exclusive of t). Rows are grouped into voters (a warp, a warpgroup, a whole
tile): a voter skips when all its valid rows vote skip. Padding rows never veto. The first tile of
every running-max sequence is never skipped. Where the kernel does not update the running max of a
voter that skipped (``update="kept"``) the max is over kept tiles only; ``update="all"`` takes
every tile in (what XQA's reference and Model-Optimizer's Triton calibration kernel do). For
lambda <= 1 the two agree: a skipped tile lies below the running max of every one of its rows.

Shape legend: B batch, H query heads, G query heads sharing one tile (a GQA group in decode; 1 in
prefill), Hg = H / G, Nq query rows, Nk keys, R rows of a query tile, T key tiles of ``block_n``
keys (T = ceil(Nk / block_n)), U decision units (B * Hg * query tiles), W voters per query tile
(R / voter rows), S running-max sequences (KV chunks of a split-KV decode; 1 otherwise).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Decision:
    """One consumer's skip decision: ``kept`` per decision unit (shape given by the rule) and the
    consumer's own count of skipped and total units (an int each, exact)."""

    kept: torch.Tensor   # bool, per decision unit
    skipped: int
    total: int
    unit: str            # what one unit is, in words

    @property
    def sparsity(self) -> float:
        """skipped / total (0.0 when the consumer counted nothing)."""
        return self.skipped / self.total if self.total else 0.0


def causal_fill(scores: torch.Tensor, fill: float) -> torch.Tensor:
    """``scores`` [B, H, Nq, Nk] with every future key set to ``fill``: the Nq query rows are the
    last Nq positions of the Nk keys (row i sees keys j <= i + Nk - Nq)."""
    nq, nk = scores.shape[-2:]
    i = torch.arange(nq, device=scores.device).unsqueeze(1)
    j = torch.arange(nk, device=scores.device).unsqueeze(0)
    return scores.masked_fill(j > i + (nk - nq), fill)


def tile_row_max(scores: torch.Tensor, block_n: int) -> torch.Tensor:
    """[..., R, Nk] -> [..., R, T]: each row's max over every key tile of ``block_n`` keys (a partial
    last tile is padded with -inf)."""
    nk = scores.shape[-1]
    t = -(-nk // block_n)
    x = F.pad(scores, (0, t * block_n - nk), value=NEG_INF)
    return x.reshape(*x.shape[:-1], t, block_n).amax(-1)


def log_lambda(factor: float | None, lam: float | None, kv_len: int) -> tuple[float, float]:
    """(lambda, ln lambda) from a threshold scale ``factor`` (lambda = factor / kv_len) or a given
    ``lam``; exactly one of the two. lambda must be > 0."""
    if (factor is None) == (lam is None):
        raise ValueError("give exactly one of factor (lambda = factor / kv_len) or lam")
    value = float(lam) if lam is not None else float(factor) / kv_len
    if not value > 0:
        raise ValueError(f"lambda must be > 0, got {value}")
    return value, math.log(value)


def group_rows(scores: torch.Tensor, group: int) -> torch.Tensor:
    """[B, H, Nq, Nk] -> [B, Hg, Nq * G, Nk]: the G consecutive query heads of a group share a tile;
    row r of the tile is token r // G, head r % G (token-major, as trtllm-gen's generation kernels
    and XQA lay out a group)."""
    b, h, nq, nk = scores.shape
    if h % group:
        raise ValueError(f"{h} query heads do not split into groups of {group}")
    x = scores.reshape(b, h // group, group, nq, nk).permute(0, 1, 3, 2, 4)
    return x.reshape(b, h // group, nq * group, nk)


def query_tiles(scores: torch.Tensor, group: int, block_m: int, block_n: int):
    """Decision units of a tiled kernel over causal ``scores`` [B, H, Nq, Nk] (future keys already
    masked with -inf or finfo.min).

    Returns (tmax [U, block_m, T] row maxima per key tile, valid [U, block_m] real (not padding)
    rows, n_iter [U] key tiles the unit visits, unit_shape (B, Hg, P) with P query tiles). A query
    tile visits key tiles up to the causal bound of its last real row."""
    rows = group_rows(scores.float(), group)                   # [B, Hg, R_all, Nk]
    b, hg, r_all, nk = rows.shape
    p = -(-r_all // block_m)
    rows = F.pad(rows, (0, 0, 0, p * block_m - r_all), value=NEG_INF)
    tmax = tile_row_max(rows, block_n).reshape(b * hg * p, block_m, -1)
    r = torch.arange(p * block_m).reshape(p, block_m)
    valid = (r < r_all).expand(b * hg, p, block_m).reshape(-1, block_m)
    nq = r_all // group
    last_tok = torch.clamp((torch.arange(1, p + 1) * block_m - 1) // group, max=nq - 1)
    bound = torch.clamp(last_tok + 1 + (nk - nq), max=nk)
    n_iter = (-(-bound // block_n)).repeat(b * hg)
    return tmax, valid, n_iter, (b, hg, p)


def vote(tmax: torch.Tensor, valid: torch.Tensor, n_iter: torch.Tensor, log_lam: float, voter_rows: int,
         chunk_of_tile: torch.Tensor | None = None, update: str = "kept") -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential skip vote. ``tmax`` [U, R, T], ``valid`` [U, R], ``n_iter`` [U] tiles visited
    (tiles 0 .. n_iter - 1), ``chunk_of_tile`` [T] the running-max sequence (KV chunk) of each tile
    (None: one sequence). Returns (skip [U, W, T]: voter w skipped tile t, visited [U, T])."""
    if update not in ("kept", "all"):
        raise ValueError(f"update must be 'kept' or 'all', got {update!r}")
    u, r, t = tmax.shape
    pad = -r % voter_rows
    tmax = F.pad(tmax, (0, 0, 0, pad), value=NEG_INF)
    valid = F.pad(valid, (0, pad), value=False)
    w = (r + pad) // voter_rows
    chunks = torch.zeros(t, dtype=torch.long) if chunk_of_tile is None else chunk_of_tile.long()
    run = torch.full((u, r + pad, int(chunks.max()) + 1), NEG_INF)
    skip = torch.zeros(u, w, t, dtype=torch.bool)
    visited = torch.arange(t).unsqueeze(0) < n_iter.unsqueeze(1)
    seen: set[int] = set()
    for k in range(t):
        c = int(chunks[k])
        first = c not in seen
        seen.add(c)
        m, prev = tmax[:, :, k], run[:, :, c]
        can = ((m - prev) < log_lam) | ~valid                   # -inf - -inf is nan: no skip
        voters = can.reshape(u, w, voter_rows).all(-1) & visited[:, k:k + 1] & (not first)
        skip[:, :, k] = voters
        take = visited[:, k:k + 1].expand(u, r + pad)
        if update == "kept":
            take = take & ~voters.repeat_interleave(voter_rows, dim=1)
        run[:, :, c] = torch.where(take, torch.maximum(prev, m), prev)
    return skip, visited


def counts(skip: torch.Tensor, visited: torch.Tensor) -> tuple[int, int]:
    """(skipped, total) tiles: a tile is skipped when every voter of it skipped; only visited tiles
    count. ``skip`` [U, W, T], ``visited`` [U, T]."""
    tiles = skip.all(1) & visited
    return int(tiles.sum()), int(visited.sum())
