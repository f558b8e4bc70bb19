"""kernels/layer_dense.py, the exact attention of layers sparsecal leaves alone, against a float64
brute force: causal rows of the last Nq positions, windows, chunks, soft cap and sinks, GQA."""
import pytest
import torch

from sparsecal.kernels.layer_dense import layer_attention


def brute(q, k, v, scale, window=None, chunk=None, softcap=None, sinks=None):
    group = q.shape[1] // k.shape[1]
    kr, vr = (x.double().repeat_interleave(group, 1) for x in (k, v))
    s = scale * q.double() @ kr.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    nq, nk = q.shape[2], k.shape[2]
    p = torch.arange(nk - nq, nk)[:, None]
    t = torch.arange(nk)[None, :]
    ok = (t <= p) & ((t > p - window) if window else True) & ((t // chunk == p // chunk) if chunk else True)
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    w = torch.softmax(s, -1)
    return (w[..., :nk] if sinks is not None else w) @ vr


@pytest.mark.parametrize("nq,nk", [(37, 37), (1, 37), (5, 40)])
@pytest.mark.parametrize("feature", [{}, {"window": 8}, {"chunk": 16}, {"softcap": 2.0}, {"sinks": True},
                                     {"window": 8, "softcap": 2.0, "sinks": True}])
def test_layer_attention_matches_brute_force(nq, nk, feature, rng):
    q = torch.randn(2, 4, nq, 16, generator=rng) * 2
    k, v = (torch.randn(2, 2, nk, 16, generator=rng) * 2 for _ in range(2))
    kw = dict(feature)
    if kw.pop("sinks", None):
        kw["sinks"] = torch.randn(4, generator=rng)
    out = layer_attention(q, k, v, 0.25, **kw)
    torch.testing.assert_close(out.double(), brute(q, k, v, 0.25, **kw), atol=1e-5, rtol=1e-5)
    if feature:  # the feature changes the answer: the test would see it ignored
        assert not torch.allclose(out, layer_attention(q, k, v, 0.25), atol=1e-3)
