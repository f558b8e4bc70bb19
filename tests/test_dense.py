"""The dense Triton flash forward (kernels/dense.py) against plain causal softmax attention
in float64 (kernels/dense_reference.py), under TRITON_INTERPRET=1 on tiny shapes with fresh random
inputs: uncapped and soft-capped, D 64/128/256, GQA 1-16 and MQA."""
import math

import pytest
import torch

from sparsecal.kernels.dense import attention_dense, flops_causal
from sparsecal.kernels.dense_reference import attention_reference

CASES = [  # (B, N, KV heads, GQA group, D, dtype, (BLOCK_M, BLOCK_N, warps, stages) or None)
    (1, 1, 1, 1, 64, torch.float32, None),
    (1, 70, 1, 4, 64, torch.bfloat16, None),
    (2, 200, 2, 1, 128, torch.float16, None),
    (1, 333, 1, 4, 128, torch.float32, (64, 32, 4, 1)),
    (1, 200, 1, 1, 64, torch.bfloat16, (128, 64, 4, 1)),
]
SOFTCAP_CASES = [  # (B, N, KV heads, GQA group, D, dtype, softcap)
    (2, 100, 2, 2, 64, torch.float32, 3.0),
    (1, 70, 1, 16, 256, torch.bfloat16, 2.0),   # D = 256, MQA with 16 query heads
    (1, 130, 1, 4, 128, torch.float16, 5.0),
    (1, 40, 1, 2, 256, torch.float32, 0.0),     # D = 256 uncapped
]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def random_qkv(seed, b, n, hkv, group, d, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * group, n, d, generator=g) * 1.5
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-N{c[1]}-kv{c[2]}-g{c[3]}-D{c[4]}-{str(c[5])[6:]}-{c[6]}")
def test_dense_matches_softmax_attention(case, seed):
    b, n, hkv, group, d, dtype, config = case
    q, k, v = random_qkv(seed, b, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    out, lse = attention_dense(q, k, v, scale, config=config)
    ref, ref_lse = attention_reference(q, k, v, scale)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("case", SOFTCAP_CASES,
                         ids=lambda c: f"B{c[0]}-N{c[1]}-kv{c[2]}-g{c[3]}-D{c[4]}-{str(c[5])[6:]}-cap{c[6]}")
def test_softcap_matches_reference(case, seed):
    """cap * tanh(s / cap) of the scaled scores before the softmax: output and LSE of the capped
    reference; with scores well past the cap, far from the uncapped answer."""
    b, n, hkv, group, d, dtype, cap = case
    q, k, v = random_qkv(seed, b, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    out, lse = attention_dense(q, k, v, scale, softcap=cap)
    ref, ref_lse = attention_reference(q, k, v, scale, softcap=cap)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    if cap:
        plain, plain_lse = attention_reference(q, k, v, scale)
        assert float((plain - ref).abs().max()) > 10 * TOL[dtype]
        assert float((plain_lse - ref_lse).abs().max()) > 0.1


def test_softcap_off_and_errors(seed):
    q, k, v = random_qkv(seed, 1, 40, 1, 2, 64, torch.float32)
    out, lse = attention_dense(q, k, v, 0.125)
    for off in (0.0, None):
        o2, l2 = attention_dense(q, k, v, 0.125, softcap=off)
        assert torch.equal(out, o2) and torch.equal(lse, l2)
    for fn in (attention_dense, attention_reference):
        with pytest.raises(ValueError, match="softcap"):
            fn(q, k, v, 0.125, softcap=-1.0)


def test_dense_configs_fit_head_dims():
    """Every supported head dim has a GPU launch config: D = 256 explicitly, with 32-bit inputs
    on smaller tiles and fewer stages (shared memory)."""
    from sparsecal.kernels import dense

    for d in (64, 128, 256):
        for dtype in (torch.bfloat16, torch.float32):
            bm, bn, warps, stages = dense.gpu_config(d, dtype)
            assert bm >= 16 and bn >= 16 and warps in (4, 8) and stages >= 1
    assert dense.gpu_config(256, torch.float32)[:2] <= dense.gpu_config(256, torch.bfloat16)[:2]


def test_dense_strided_inputs_and_output_buffer(seed):
    """Inputs seen through .transpose (the layout transformers hands over) and an output buffer
    laid out [B, N, H, D]: no copies, same result."""
    g = torch.Generator().manual_seed(seed)
    n, h, hkv, d = 90, 4, 2, 64
    q = torch.randn(1, n, h, d, generator=g).transpose(1, 2)
    k = torch.randn(1, n, hkv, d, generator=g).transpose(1, 2)
    v = torch.randn(1, n, hkv, d, generator=g).transpose(1, 2)
    buf = torch.full((1, n, h, d), float("nan"))
    out, _ = attention_dense(q, k, v, 0.1, out=buf.transpose(1, 2))
    ref, _ = attention_reference(q, k, v, 0.1)
    assert out.data_ptr() == buf.data_ptr() and not torch.isnan(buf).any()
    torch.testing.assert_close(buf.transpose(1, 2).double(), ref, atol=1e-5, rtol=0)


def test_dense_rejects_bad_shapes():
    q = torch.zeros(1, 3, 8, 64)
    with pytest.raises(ValueError, match="multiple"):
        attention_dense(q, torch.zeros(1, 2, 8, 64), torch.zeros(1, 2, 8, 64))
    with pytest.raises(ValueError, match="head dim"):
        attention_dense(torch.zeros(1, 2, 8, 80), torch.zeros(1, 1, 8, 80), torch.zeros(1, 1, 8, 80))
    assert flops_causal(1, 32, 1024, 128) == 2 * 32 * 1024 * 1024 * 128
