"""The group decode kernel (kernels/sparse/decode_group.py) against the plain-torch reference
(TRITON_INTERPRET=1): outputs, per-head skip counts and the group V-skip counts for BSFA (the
in-loop decision), BLASST forward (the tile-max pre-pass), top-k (the torch mask) and dense, with
the per-head and the group decision, one split (the attend pass writes the output) and several
(the merge), GQA groups 1 / 4 / 8, D 64 / 128, fp32 / bf16 / fp16."""
import math

import pytest
import torch

from sparsecal.kernels.sparse.decode_group import (
    SPARSE_DEFAULT,
    SPARSE_TABLE,
    SparseLaunch,
    group_decode_triton,
    sparse_launch_for,
)
from sparsecal.kernels.sparse.reference import group_skip, sparse_decode

from helpers import INTERPRETER_WARNINGS, TOL, blasst_cut_log_lambda, cut_point, decode_tiles, sparse_inputs

pytestmark = INTERPRETER_WARNINGS

CASES = [  # (B, L, H, Hkv, D, BM, BN, dtype): every L ragged
    (2, 141, 1, 1, 64, 32, 16, torch.float32),    # G = 1, two sequences
    (1, 150, 8, 2, 64, 64, 16, torch.bfloat16),   # G = 4
    (1, 133, 8, 1, 128, 32, 16, torch.float16),   # G = 8 (MQA), D = 128
]


def decode_inputs(seed, case):
    """The last row of helpers.sparse_inputs as the decode query, and the planted far candidate
    tiles [B, H, Kb] (every method's cut skips them)."""
    b, length, h, hkv, d, bm, bn, dtype = case
    q, k, v, far = sparse_inputs(seed, b, length, h, hkv, d, dtype, bm, bn)
    cand = torch.arange(far.shape[-1]) < (length - 1) // bn
    return q[:, :, -1:].contiguous(), k, v, far.repeat_interleave(h // hkv, dim=1) & cand


def cuts(q, k, far, bn):
    """BSFA thresholds [H, 1] and BLASST ln(lambda) cut from the rows' own tile maxima and forward
    gaps (helpers.cut_point: no value near the cut, the far tiles below it)."""
    tmax, gap = decode_tiles(q, k, bn)
    length = k.shape[2]
    cand = torch.arange(tmax.shape[-1]) < (length - 1) // bn
    thr = torch.empty(q.shape[1], 1)
    for hh in range(q.shape[1]):
        f, vals = far[:, hh], tmax[:, hh]
        thr[hh, 0] = cut_point(vals[cand & ~f], float(vals[f].max()) if f.any() else -math.inf)
    return thr, blasst_cut_log_lambda(gap, far, cand)


def check(case, q, k, v, splits, decision, **kw):
    """Kernel vs reference; returns the kernel's (skipped [B, H], v_skipped [B, Hkv])."""
    *_, d, bm, bn, dtype = case
    ref_kw = {"log_lambda": -math.inf} if kw.get("dense") else kw
    want, counts = sparse_decode(q, k, v, d ** -0.5, bm, bn, decision=decision, **ref_kw)
    got, skipped, v_skipped = group_decode_triton(q, k, v, d ** -0.5, bm, bn, splits=splits, decision=decision, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
    assert torch.equal(skipped.sum(0), counts.skipped), (decision, kw)
    assert torch.equal(v_skipped.sum(0), counts.v_skipped), (decision, kw)
    return skipped, v_skipped


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"G{c[2] // c[3]}-D{c[4]}-{str(c[7])[6:]}")
def test_group_kernel_matches_reference(case, seed):
    """Every method with both decisions equals the reference. The per-head rule skips the planted
    far tiles in every head; the group rule skips exactly the tiles every head skips, so it loads
    the same V tiles (equal v_skipped) and counts G of them per group."""
    q, k, v, far = decode_inputs(seed, case)
    thr, ll = cuts(q, k, far, case[6])
    group = case[2] // case[3]
    for splits, kw in ((2, {"thresholds": thr}), (3, {"log_lambda": ll}), (1, {"topk": 2})):
        head_sk, head_v = check(case, q, k, v, splits, "head", **kw)
        assert (head_sk >= far.sum(-1)).all() and far.any()
        grp_sk, grp_v = check(case, q, k, v, splits, "group", **kw)
        assert torch.equal(grp_v, head_v) and torch.equal(grp_sk, grp_v.repeat_interleave(group, 1))
        if group > 1 and kw.get("topk") is None:
            assert (grp_sk <= head_sk).all()
    check(case, q, k, v, 1, "head", dense=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"G{c[2] // c[3]}-D{c[4]}-{str(c[7])[6:]}")
def test_fused_merge_matches_the_merge_launch(case, seed):
    """SparseLaunch(fuse=c): the group's last program merges, c splits at a time (no merge launch);
    step_if: a tile's softmax step only when some head keeps it. At 2, 3 and 9 splits (9: one tile
    each, chunks of 2 and 8 with a partial last chunk) every method and decision gives the
    reference's output and the merge kernel's exact counts, the same bits twice (the group counters
    left zero)."""
    from sparsecal.kernels.sparse.decode_group_dense import _COUNTERS

    q, k, v, far = decode_inputs(seed, case)
    thr, ll = cuts(q, k, far, case[6])
    *_, d, bm, bn, dtype = case
    runs = ((2, {"thresholds": thr}, 2, False), (3, {"log_lambda": ll}, 8, True), (9, {"topk": 2}, 2, True),
            (9, {"thresholds": thr}, 8, False), (3, {"thresholds": thr}, 0, True))
    for splits, kw, chunk, step_if in runs:
        fused = SparseLaunch(warps=1, pps=4, fuse=chunk, step_if=step_if)
        for decision in ("head", "group"):
            want, counts = sparse_decode(q, k, v, d ** -0.5, bm, bn, decision=decision, **kw)
            plain = group_decode_triton(q, k, v, d ** -0.5, bm, bn, splits=splits, decision=decision, **kw)
            got = group_decode_triton(q, k, v, d ** -0.5, bm, bn, splits=splits, decision=decision, launch=fused, **kw)
            again = group_decode_triton(q, k, v, d ** -0.5, bm, bn, splits=splits, decision=decision, launch=fused,
                                        **kw)
            torch.testing.assert_close(got[0].float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
            torch.testing.assert_close(got[0].float(), plain[0].float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
            assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2]), (splits, decision)
            assert torch.equal(got[1].sum(0), counts.skipped) and torch.equal(got[2].sum(0), counts.v_skipped)
            assert all(torch.equal(a, b) for a, b in zip(got, again))
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def test_group_skip_rule():
    """The group decision of the reference: a tile is skipped by the group only when all its heads
    skip it, and then by every head (heads of a group adjacent)."""
    skip = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 1], [0, 0, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)  # [H=4, Kb]
    want = torch.tensor([[1, 0, 0, 1], [1, 0, 0, 1], [0, 0, 1, 0], [0, 0, 1, 0]], dtype=torch.bool)
    assert torch.equal(group_skip(skip, 2), want)
    assert torch.equal(group_skip(skip, 1), skip)


def test_group_decision_argument(seed):
    q, k, v, _ = decode_inputs(seed, CASES[0])
    for fn in (sparse_decode, group_decode_triton):
        with pytest.raises(ValueError, match="decision"):
            fn(q, k, v, 0.125, 32, 16, log_lambda=-1.0, decision="heads")


def test_launch_table_buckets():
    """The table's launch by (D, G bucket, length bucket); shapes it does not list take the default."""
    assert sparse_launch_for(128, 8, 20000) == SPARSE_TABLE[(128, 8, 16384)]
    assert sparse_launch_for(128, 8, 70000) == SPARSE_TABLE[(128, 8, 65536)] != SPARSE_TABLE[(128, 8, 16384)]
    assert sparse_launch_for(64, 3, 40000) == SPARSE_TABLE[(64, 4, 32768)]
    assert sparse_launch_for(64, 1, 1 << 20) == SPARSE_TABLE[(64, 1, 131072)]
    assert sparse_launch_for(96, 4, 16384) == SPARSE_DEFAULT
    assert SparseLaunch(warps=2, pps=8).name() == "w2s3p8"
    assert SparseLaunch(warps=1, pps=16, fuse=2).name() == "w1s3p16-fuse2"
    assert SparseLaunch(warps=2, pps=8, step_if=True).name() == "w2s3p8-if"


SPARSE_NEAR = 0.03   # the table's launch at most this much slower than the fastest sparse launch a sweep tried


def test_sparse_table_holds_the_sweeps_fastest_launches():
    """At every shape and sparsity of the newest committed H100 sweep of that shape (B=16, H=32,
    16K-64K, BSFA group decision at 50 % / 75 %: data/bench/decode-sweep10-b16-h100-d*.json, s42, for
    G=1; decode-resweep-s43-h100-d*.json for G = 4/8), the table's launch is one the sweep checked and
    within SPARSE_NEAR of the fastest sparse launch it tried (one launch serves both sparsities)."""
    import json

    from helpers import ROOT

    for d in (128, 64):
        old, new = (json.loads((ROOT / "data" / "bench" / name).read_text())["shapes"] for name in (
            f"decode-sweep10-b16-h100-d{d}.json", f"decode-resweep-s43-h100-d{d}.json"))
        shapes = [s for s in old if s["group"] == 1] + new
        assert len(shapes) == 9 and {s["group"] for s in new} == {4, 8}
        for shape in shapes:
            cfg = sparse_launch_for(d, shape["group"], shape["length"])
            for target in (0.5, 0.75):
                rows = {r["variant"]: r for r in shape["rows"]
                        if r["kind"] == "sparse" and r["target"] == target and r.get("ok") and r.get("ms")}
                mine = rows[f"bsfa_group_s{int(target * 100)}_{cfg.name()}"]
                assert mine["ms"] <= (1 + SPARSE_NEAR) * min(r["ms"] for r in rows.values()), (d, shape, target)
