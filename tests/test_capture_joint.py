"""VFA's joint statistic (max(Q-init estimate, exact max over block 0 and the diagonal blocks) - true
row max) in the Triton capture, under TRITON_INTERPRET=1 against the plain-torch reference: the
``joint_count`` histogram of both capture paths (two-pass for several orders, single-order for one)
equals the reference's on awkward lengths, GQA, D 64/128, fp16/bf16, a soft cap, and rows whose
sink block is their local block (every block diagonal: the frozen max is never below the true
max). The other capture tests compare it too (helpers.assert_reduced_match)."""
import math

import pytest
import torch

from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.pipeline import capture_triton
from sparsecal.kernels.capture.reduce_reference import histogram, reduce_tiles
from sparsecal.kernels.capture.reference import instrumented_attention

from bruteforce import near_tie_rows as capped_near_ties
from helpers import INTERPRETER_WARNINGS, assert_joint_match, make_qkv

pytestmark = INTERPRETER_WARNINGS
ALL = ("forward", "reverse", "sink_local")
CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype, orders, softcap)
    (77, 1, 2, 64, 32, 16, torch.bfloat16, ALL, 0.0),               # two-pass, middle blocks
    (77, 2, 2, 128, 32, 16, torch.float16, ("forward",), 0.0),      # single-order, D 128
    (61, 1, 4, 64, 24, 16, torch.float16, ("sink_local",), 2.5),    # capped, BM not a power of two
    (20, 1, 2, 64, 32, 32, torch.bfloat16, ALL, 0.0),               # one block: sink = local
    (20, 1, 2, 128, 32, 32, torch.float16, ("reverse",), 0.0),      # the same on the single-order path
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-g{c[2]}-D{c[3]}-{c[4]}x{c[5]}-{len(c[7])}o-cap{c[8]}")
def test_joint_count_matches_reference(case, seed):
    n, hkv, group, d, bm, bn, dtype, orders, cap = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=orders, k_values=(1, 2), decode_rows=4)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    _, got = capture_triton(q, k, v, scale, cfg, softcap=cap)
    _, r = instrumented_attention(q, k, v, scale, cfg, softcap=cap)
    want = reduce_tiles(r, n, cfg)
    ties = capped_near_ties(q, k, scale, bn, cap)
    assert ties.float().mean() < 0.05
    assert_joint_match(got["joint_count"], want["joint_count"], r.joint_err, cfg, ties)
    edges = torch.from_numpy(cfg.qinit_edges())
    zero = int(torch.searchsorted(edges, torch.tensor(0.0, dtype=torch.float64), right=True))  # bin of [0, step)
    # the frozen max is never below the Q-init estimate: joint's CDF lies at or below q-init's
    assert (got["joint_count"].cumsum(-1) <= got["qinit_count"].cumsum(-1)).all()
    if n <= bn:  # block 0 is every row's diagonal block: the exact local max is the row max
        assert not got["joint_count"][:, :zero].any() and (r.joint_err >= 0).all()
        assert torch.equal(want["joint_count"], histogram(r.qinit_err.clamp(min=0), edges))
    else:  # a middle block holds some row's max and Q-init misses it: VFA's p > 1 rows exist
        assert (r.joint_err < -0.25).any() and got["joint_count"][:, :zero].sum() > 0
        assert not torch.equal(got["joint_count"], got["qinit_count"])
