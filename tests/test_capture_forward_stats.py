"""The single-pass instrumented forward (kernels/capture/forward_stats.py) against the plain-torch
reference, under TRITON_INTERPRET=1 on tiny shapes: output, LSE, and for each scan order bmax,
gap, t* (step and where, exact away from near-ties) and the q-init error; uncapped and
soft-capped, D 64/128/256, GQA 1-16 and MQA."""
import math

import pytest
import torch

from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.forward_stats import instrumented_forward_triton
from sparsecal.kernels.capture.reference import instrumented_attention
from sparsecal.kernels.dense import attention_dense

from bruteforce import near_tie_rows as capped_near_ties
from helpers import INTERPRETER_WARNINGS, OUT_RTOL, OUT_TOL, assert_same_floats, make_qkv, near_tie_rows

pytestmark = INTERPRETER_WARNINGS
ALL = ("forward", "reverse", "sink_local")
CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype)
    (1, 1, 1, 64, 32, 16, torch.float32),
    (70, 1, 4, 64, 32, 16, torch.bfloat16),
    (130, 2, 1, 128, 32, 16, torch.float16),
    (120, 1, 4, 128, 32, 16, torch.float32),
    (90, 1, 2, 64, 40, 24, torch.bfloat16),  # BM, BN not powers of two
]


def check_order(got, ref_out, r, o, ties, dtype):
    """got: instrumented_forward_triton's tuple; r: the reference TileStats; o: order index.
    t*, rescales and the shortfall's zeros exact away from (near) ties of two block maxima."""
    out, lse, bmax, gap, tstep, twhere, qerr, resc, short, jerr = got
    torch.testing.assert_close(out.double(), ref_out.double(), atol=OUT_TOL[dtype], rtol=OUT_RTOL[dtype])
    assert_same_floats(bmax, r.bmax, 1e-4, "bmax")
    assert_same_floats(gap, r.gap[:, o], 1e-4, "gap")
    torch.testing.assert_close(qerr, r.qinit_err, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(jerr, r.joint_err, atol=1e-4, rtol=1e-4)
    assert tstep.dtype == torch.int32 and twhere.dtype == torch.int8 and tstep.shape == r.tstar_step[:, o].shape
    ok = ~ties
    assert torch.equal(tstep[ok].long(), r.tstar_step[:, o][ok]), "tstar_step differs away from ties"
    assert torch.equal(twhere[ok], r.tstar_where[:, o][ok]), "tstar_where differs away from ties"
    assert resc.dtype == torch.int32 and short.shape == r.shortfall[:, o].shape
    assert torch.equal(resc[ok].long(), r.rescales[:, o][ok]), "rescales differ away from ties"
    want = r.shortfall[:, o]
    assert torch.equal(torch.isposinf(short), torch.isposinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(short[fin], want[fin], atol=1e-4, rtol=1e-4)
    z = ok[:, None, :].expand_as(want)
    assert torch.equal(short[z] == 0, want[z] == 0), "already-final rows differ away from ties"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-kv{c[1]}-g{c[2]}-D{c[3]}-{c[4]}x{c[5]}-{str(c[6])[6:]}")
def test_forward_stats_match_reference(case, seed):
    n, hkv, group, d, bm, bn, dtype = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=ALL, decode_rows=1)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    ref_out, r = instrumented_attention(q, k, v, scale, cfg)
    ties = near_tie_rows(q, k, scale, bn)
    assert ties.float().mean() < 0.05
    lse_dense = attention_dense(q, k, v, scale)[1][0]
    for o, order in enumerate(ALL):
        got = instrumented_forward_triton(q, k, v, scale, cfg, order)
        check_order(got, ref_out, r, o, ties, dtype)
        torch.testing.assert_close(got[1], lse_dense, atol=1e-4, rtol=1e-5)


SOFTCAP_CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype, softcap)
    (50, 1, 4, 64, 32, 16, torch.bfloat16, 3.0),    # GQA 4 on one KV head (MQA)
    (40, 1, 16, 256, 32, 16, torch.float32, 2.0),   # D = 256, MQA with 16 query heads
    (45, 2, 2, 256, 32, 16, torch.float16, 0.0),    # D = 256 uncapped
]


@pytest.mark.parametrize("case", SOFTCAP_CASES,
                         ids=lambda c: f"N{c[0]}-kv{c[1]}-g{c[2]}-D{c[3]}-{str(c[6])[6:]}-cap{c[7]}")
def test_softcap_matches_reference(case, seed):
    """Soft-capped scores in every order: the statistics of the capped reference, the LSE of the
    capped dense kernel; a cap that bites changes every statistic."""
    n, hkv, group, d, bm, bn, dtype, cap = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=ALL, decode_rows=1)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    ref_out, r = instrumented_attention(q, k, v, scale, cfg, softcap=cap)
    ties = capped_near_ties(q, k, scale, bn, cap)
    assert ties.float().mean() < 0.05
    lse_dense = attention_dense(q, k, v, scale, softcap=cap)[1][0]
    for o, order in enumerate(ALL):
        got = instrumented_forward_triton(q, k, v, scale, cfg, order, softcap=cap)
        check_order(got, ref_out, r, o, ties, dtype)
        torch.testing.assert_close(got[1], lse_dense, atol=1e-4, rtol=1e-5)
    if cap:  # the kernels agree with the capped reference, far from the uncapped one
        plain_out, plain = instrumented_attention(q, k, v, scale, cfg)
        fin = torch.isfinite(plain.bmax)
        assert float((plain.bmax[fin] - r.bmax[fin]).abs().max()) > 0.1
        assert float((plain_out.double() - ref_out.double()).abs().max()) > 10 * OUT_TOL[dtype]


def test_rejects_unknown_order(seed):
    q, k, v = make_qkv(seed, 8, 1, 1, 64, torch.float32)
    with pytest.raises(ValueError, match="Unknown scan order"):
        instrumented_forward_triton(q, k, v, 0.125, StatsConfig(block_m=32, block_n=16), "sideways")


def test_stats_off_same_output(seed):
    """The cost-measurement variant (stats=False) computes the same output and LSE."""
    q, k, v = make_qkv(seed, 70, 1, 2, 64, torch.float32)
    cfg = StatsConfig(block_m=32, block_n=16)
    a = instrumented_forward_triton(q, k, v, 0.125, cfg, "reverse")
    b = instrumented_forward_triton(q, k, v, 0.125, cfg, "reverse", stats=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.isneginf(b[2]).all()
