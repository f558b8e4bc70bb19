"""The sparse benchmark's operating points: thresholds read from an input's own tile statistics
skip the requested share of tiles, as the sparse reference counts them (CPU, interpreter).

The achievable sparsity is quantized by whole tiles: an operating point asks for round(s * T) of
T tiles (BSFA per query block, BLASST over all query blocks and heads), so the share it reaches
is exact up to that rounding, i.e. within half a tile of s * T. The only other slack is a tile
whose statistic lies within 1e-4 of the cut: the benchmark reads the single-pass Triton
statistics, the reference recomputes them, and the two may round it to opposite sides."""
import math

import torch

from sparsecal.bench.sparse_inputs import (
    blasst_log_lambda_for,
    bsfa_thresholds_for,
    decode_log_lambda_for,
    decode_tile_max,
    structured_qkv,
    tile_stats,
)
from sparsecal.kernels.sparse.reference import sparse_attention, sparse_decode

from helpers import block_counts_torch, candidate_mask

NEAR = 1e-4


def test_operating_points_reach_the_requested_sparsity(seed):
    n, d, h, hkv, bm, bn = 900, 64, 4, 2, 128, 64  # short: BLASST cannot reach 75% here
    q, k, v = structured_qkv(n, d, h, hkv, seed=seed % 10_000, dtype=torch.float32, device="cpu")
    scale = d ** -0.5
    bmax, gap = tile_stats(q, k, v, scale, bm, bn)
    cand, reach = block_counts_torch(n, bm, bn)
    cmask = candidate_mask(n, bm, bn)
    gaps = gap[:, cmask]                                  # BLASST skips at most the tiles below the running max
    below, total = int((gaps < 0).sum()), int(reach.sum()) * h
    for s in (0.0, 0.25, 0.75):
        thr = bsfa_thresholds_for(bmax, n, bm, bn, s)
        _, c = sparse_attention(q, k, v, scale, bm, bn, thresholds=thr)
        want = int(torch.minimum(torch.round(s * reach), cand).sum())  # per query block, capped at A_i
        near = (cmask & ((bmax - thr[..., None]).abs() < NEAR)).sum(dim=(1, 2))  # [H]
        assert ((c.skipped - want).abs() <= near).all(), (c.skipped.tolist(), want)
        ll = blasst_log_lambda_for(gap, n, bm, bn, s)
        _, c = sparse_attention(q, k, v, scale, bm, bn, log_lambda=ll)
        if s == 0:
            assert ll == -math.inf and c.skipped.sum() == 0
            continue
        want = min(round(s * total), below)  # round(s * T) of T tiles, or every tile below the running max
        assert abs(int(c.skipped.sum()) - want) <= int(((gaps - ll).abs() < NEAR).sum())
    qd = q[:, :, -1:].expand(2, -1, -1, -1).contiguous()
    kd, vd = k.expand(2, -1, -1, -1).contiguous(), v.expand(2, -1, -1, -1).contiguous()
    ll = decode_log_lambda_for(qd, kd, scale, bn, 0.5)
    _, c = sparse_decode(qd, kd, vd, scale, bm, bn, log_lambda=ll)
    tmax = decode_tile_max(qd, kd, scale, bn)                 # the decode rows' tiles, forward gaps
    dgap = (tmax - torch.cummax(tmax, dim=-1).values)[..., : (n - 1) // bn]
    total = c.reachable * h                                   # both sequences, every head
    want = min(round(0.5 * total), int((dgap < 0).sum()))
    assert abs(int(c.skipped.sum()) - want) <= int(((dgap - ll).abs() < NEAR).sum())
