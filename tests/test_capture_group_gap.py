"""The capture's decode group gap histograms (``decode_group_gap_count`` / ``_mass``, issue 28 part
2): on the reference capture, the count of a head's group gaps below an edge e equals the tiles the
decode reference skips for that head with the group decision at ln lambda = e (forward order),
row by row over the capture's decode rows; with one head per group they equal the per-head
histograms; every head of a group holds the same counts."""
import math

import torch

from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.reduce_reference import reduce_tiles
from sparsecal.kernels.capture.reference import instrumented_attention
from sparsecal.kernels.sparse.reference import sparse_decode

from helpers import make_qkv

N, R, BM, BN = 150, 24, 32, 16


def _capture(seed, hkv, group):
    cfg = StatsConfig(block_m=BM, block_n=BN, orders=("forward",), k_values=(1, 2), decode_rows=R)
    q, k, v = make_qkv(seed, N, hkv, group, 32, torch.float32)
    _, tiles = instrumented_attention(q, k, v, 0.25, cfg)
    return cfg, (q, k, v), tiles, reduce_tiles(tiles, N, cfg)


def test_group_counts_are_what_the_group_decision_skips(seed):
    cfg, (q, k, v), tiles, red = _capture(seed, hkv=2, group=4)
    count = red["decode_group_gap_count"][:, 0]  # [H, NG], forward order
    edges = cfg.gap_edges()
    below = count.cumsum(-1)  # below[h, i]: the head's group gaps < edges[i]
    assert tiles.group == 4 and torch.equal(count.view(2, 4, -1), count.view(2, 4, -1)[:, :1].expand(2, 4, -1))
    tried = 0
    for i in sorted({int(abs(edges - x).argmin()) for x in (-6.0, -4.0, -2.5, -1.0)}):
        e = float(edges[i])
        vals = tiles.dec_gap[:, 0]
        if bool(((vals - e).abs() < 1e-4).any()):
            continue  # a gap at the edge: float order may put it on either side in the two computations
        skipped = torch.zeros(q.shape[1], dtype=torch.int64)
        for r in range(N - R, N):
            _, c = sparse_decode(q[:, :, r:r + 1], k[:, :, :r + 1], v[:, :, :r + 1], 0.25, BM, BN,
                                 log_lambda=e, decision="group")
            skipped += c.skipped
        assert torch.equal(below[:, i], skipped), i
        tried += int(skipped.sum() > 0)
    assert tried >= 1  # at least one edge where the group skipped something: the test can fail


def test_one_head_per_group_is_the_per_head_histogram(seed):
    _, _, _, red = _capture(seed, hkv=4, group=1)
    assert torch.equal(red["decode_group_gap_count"], red["decode_gap_count"])
    torch.testing.assert_close(red["decode_group_gap_mass"], red["decode_gap_mass"].double())


def test_the_group_skips_no_more_than_any_of_its_heads(seed):
    cfg, _, _, red = _capture(seed, hkv=1, group=4)
    g, h = red["decode_group_gap_count"][:, 0].cumsum(-1), red["decode_gap_count"][:, 0].cumsum(-1)
    assert torch.equal(g[:, -1], h[:, -1])  # the same candidate tiles
    assert (g <= h.min(dim=0).values).all() and (g < h).any()
    assert math.isclose(float(red["decode_group_gap_mass"].sum()), float(red["decode_gap_mass"].sum()), rel_tol=1e-9)
