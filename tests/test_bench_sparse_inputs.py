"""The sparse benchmark's operating points: thresholds read from an input's own tile statistics
skip the requested share of tiles, as the sparse reference counts them (CPU, interpreter)."""
import math

import torch

from sparsecal.bench.sparse_inputs import blasst_log_lambda_for, bsfa_thresholds_for, decode_log_lambda_for, structured_qkv, tile_stats
from sparsecal.kernels.sparse.reference import sparse_attention, sparse_decode

from helpers import block_counts_torch


def test_operating_points_reach_the_requested_sparsity(seed):
    n, d, h, hkv, bm, bn = 900, 64, 4, 2, 128, 64  # short: BLASST cannot reach 75% here
    q, k, v = structured_qkv(n, d, h, hkv, seed=seed % 10_000, dtype=torch.float32, device="cpu")
    scale = d ** -0.5
    bmax, gap = tile_stats(q, k, v, scale, bm, bn)
    cand, reach = block_counts_torch(n, bm, bn)
    kb = torch.arange(gap.shape[-1])
    below = gap[:, kb[None, :] < cand[:, None]] < 0  # BLASST skips at most the tiles below the running max
    reachable = float(below.sum()) / (float(reach.sum()) * h)
    for s in (0.0, 0.25, 0.75):
        thr = bsfa_thresholds_for(bmax, n, bm, bn, s)
        _, c = sparse_attention(q, k, v, scale, bm, bn, thresholds=thr)
        want = torch.minimum(torch.round(s * reach), cand).sum()  # per query block, capped at A_i
        assert c.skipped.tolist() == [int(want)] * h
        ll = blasst_log_lambda_for(gap, n, bm, bn, s)
        _, c = sparse_attention(q, k, v, scale, bm, bn, log_lambda=ll)
        got = float(c.skipped.sum()) / (float(reach.sum()) * h)
        assert (ll == -math.inf and got == 0) if s == 0 else abs(got - min(s, reachable)) < 0.03
    qd = q[:, :, -1:].expand(2, -1, -1, -1).contiguous()
    kd, vd = k.expand(2, -1, -1, -1).contiguous(), v.expand(2, -1, -1, -1).contiguous()
    ll = decode_log_lambda_for(qd, kd, scale, bn, 0.5)
    _, c = sparse_decode(qd, kd, vd, scale, bm, bn, log_lambda=ll)
    assert abs(float(c.skipped.sum()) / c.reachable / h - 0.5) < 0.05
