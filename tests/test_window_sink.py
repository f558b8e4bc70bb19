"""The window baseline with a sink (StreamingLLM: key block 0 always kept): the reference against a
float64 full-matrix oracle, the Triton prefill and decode kernels against the reference
(TRITON_INTERPRET=1), the eval grammar, and ``sparsify(method="window_sink")`` in a tiny model."""
import math

import numpy as np
import pytest
import torch
from test_sparsify import _noop_export, tiny_model  # noqa: F401  (fixture)

import sparsecal
from sparsecal.evaluation.methods import Method, parse_methods
from sparsecal.formats.errors import UserError
from sparsecal.formats.geometry import cdiv
from sparsecal.kernels.sparse.decode import sparse_decode_triton
from sparsecal.kernels.sparse.prefill import sparse_attention_triton
from sparsecal.kernels.sparse.reference import sparse_attention, sparse_decode

from helpers import TOL, block_counts_torch


def _inputs(seed, b, n, h, hkv, d, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g)
    k, v = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _brute(q, k, v, scale, bm, bn, window):
    """Float64 full-matrix attention of one sequence; query block i keeps key block j when it is
    reachable and not a candidate (j*BN + BN > i*BM), or j == 0, or j >= A_i - W."""
    _, h, n, _ = q.shape
    group = h // k.shape[1]
    s = q[0].double() @ k[0].double().repeat_interleave(group, 0).transpose(1, 2) * scale
    keep = torch.zeros(n, n, dtype=torch.bool)
    for r in range(n):
        i = r // bm
        a = (i * bm) // bn
        for c in range(r + 1):
            j = c // bn
            keep[r, c] = j >= a or j == 0 or j >= a - window
    s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, dim=-1) @ v[0].double().repeat_interleave(group, 0)


@pytest.mark.parametrize("n,h,hkv,d,bm,bn", [(200, 4, 2, 64, 64, 32), (97, 3, 1, 128, 32, 16)])
@pytest.mark.parametrize("window", [0, 2])
def test_reference_matches_bruteforce(n, h, hkv, d, bm, bn, window, seed):
    q, k, v = _inputs(seed, 1, n, h, hkv, d, torch.float32)
    out, counts = sparse_attention(q, k, v, d ** -0.5, bm, bn, window=window, sink=True)
    torch.testing.assert_close(out[0].double(), _brute(q, k, v, d ** -0.5, bm, bn, window), atol=2e-5, rtol=0)
    cand, _ = block_counts_torch(n, bm, bn)
    want = int(torch.clamp(cand - window - 1, min=0).sum())  # all but block 0 and the W nearest
    assert counts.skipped.tolist() == [want] * h and want > 0


@pytest.mark.parametrize("case", [(2, 70, 4, 2, 64, 32, 16, torch.bfloat16),   # a batch, GQA 2
                                  (1, 100, 2, 1, 128, 48, 24, torch.float16)])  # D 128, ragged blocks, MQA
def test_triton_prefill_matches_reference(case, seed):
    b, n, h, hkv, d, bm, bn, dtype = case
    q, k, v = _inputs(seed, b, n, h, hkv, d, dtype)
    for w in (0, 1):
        got, skipped = sparse_attention_triton(q, k, v, d ** -0.5, bm, bn, window=w, sink=True)
        for i in range(b):
            want, c = sparse_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], d ** -0.5, bm, bn, window=w, sink=True)
            torch.testing.assert_close(got[i:i + 1].float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
            assert torch.equal(skipped[i], c.skipped) and c.skipped.sum() > 0
    plain_skip = sparse_attention_triton(q, k, v, d ** -0.5, bm, bn, window=1)[1]
    assert (plain_skip > skipped).all()  # the sink is kept where the plain window drops it


@pytest.mark.parametrize("length,d", [(130, 64), (77, 128)])
def test_triton_decode_matches_reference(length, d, seed):
    q, k, v = _inputs(seed, 2, length, 4, 2, d, torch.bfloat16)
    q = q[:, :, -1:]
    for w in (0, 1):
        got, skipped = sparse_decode_triton(q, k, v, d ** -0.5, 32, 16, window=w, sink=True)
        want, c = sparse_decode(q, k, v, d ** -0.5, 32, 16, window=w, sink=True)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[torch.bfloat16][0], rtol=TOL[torch.bfloat16][1])
        a = (length - 1) // 16
        assert skipped.sum(dim=0).tolist() == c.skipped.tolist() == [2 * max(a - w - 1, 0)] * 4


def test_sink_goes_with_a_window_only(seed):
    q, k, v = _inputs(seed, 1, 40, 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="sink"):
        sparse_attention(q, k, v, 0.125, 16, 8, log_lambda=-1.0, sink=True)


def test_grammar():
    ms = parse_methods("window:4,window_sink:4,5:dense,blasst_sl:0.5,vsa:0.7,vfa,vfa:dense")
    assert [m.label for m in ms] == ["window:4", "window_sink:4", "window_sink:5:dense", "blasst_sl:0.5",
                                     "vsa:0.7", "vfa", "vfa:dense"]
    assert ms[1].sparsify_kwargs == {"method": "window_sink", "blocks": 4, "decode": "sparse", "dispatch": False}
    assert ms[3].sparsify_kwargs == {"method": "blasst_sl", "target": 0.5, "decode": "sparse", "dispatch": False}
    assert ms[5].sparsify_kwargs == {"method": "vfa", "decode": "sparse", "dispatch": False} and ms[5].config == "frozen max"
    assert Method("vsa", 0.7).config == "target=0.7"
    for bad, why in (("window_sink:0", "positive whole number"), ("vsa:2", "between 0 and 1"),
                     ("vfa:sometimes", "not a method")):
        with pytest.raises(UserError, match=why):
            parse_methods(bad)


def test_sparsify_keeps_the_sink_at_the_window_budget(tiny_model, tmp_path, seed):  # noqa: F811
    """window_sink:4 keeps block 0 and the 3 nearest candidates: as many tiles as window:4 skips,
    different ones (the logits differ); at 333 tokens (at most 4 candidates) it is `dense`, bit for bit."""
    _, model = tiny_model
    gen = torch.Generator().manual_seed(seed)
    short, ids = torch.randint(0, 300, (1, 333), generator=gen), torch.randint(0, 300, (1, 700), generator=gen)
    exp = _noop_export(tmp_path / "e")
    with torch.no_grad():
        sparsecal.sparsify(model, exp, method="dense")
        dense = model(short).logits
        sparsecal.sparsify(model, exp, method="window", blocks=4)
        plain = model(ids).logits
        plain_skip = model.sparsecal_stats["skipped"].clone()
        sparsecal.sparsify(model, exp, method="window_sink", blocks=4)
        assert torch.equal(model(short).logits, dense)
        sink = model(ids).logits
    cand, _ = block_counts_torch(700, 128, 64)
    assert (model.sparsecal_stats["skipped"] == int(np.clip(cand - 4, 0, None).sum())).all()
    assert torch.equal(model.sparsecal_stats["skipped"], plain_skip) and not torch.allclose(sink, plain)
    with pytest.raises(UserError, match="blocks >= 1"):
        sparsecal.sparsify(model, exp, method="window_sink", blocks=0)
    assert cdiv(700, 128) == 6
