"""Shared pieces of the decode benchmark and its launch sweep (bench/decode.py, bench/decode_sweep.py):
the geometry, the structured decode inputs, counted sparsity and V-skip share, the bisection of an
operating point, BSFA thresholds at a quantile, and the SDPA backends.

Shape legend
    B batch   H query heads   Hkv KV heads   G = H / Hkv   D head dim   L cached tokens   Kb key blocks
"""
from __future__ import annotations

import math

import torch

from sparsecal.bench.harness import log
from sparsecal.kernels.jit import interpreting

HEADS, BM, BN = 32, 128, 64
SPARSITIES = (0.5, 0.75)
SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
BISECT_ITERS = {"gpu": 14, "quick": 3}
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def decode_qkv(batch: int, length: int, d: int, group: int, seed: int, dtype, device, heads: int = HEADS):
    """q [B, H, 1, D] (the row at L - 1), k/v [B, Hkv, L, D]: structured_qkv's construction (sinks,
    a smooth local component, ~0.5% heavy hitters) with only the decode row's query, one batch row
    at a time (no B x H x L x D temporaries)."""
    from sparsecal.bench.sparse_inputs import HEAVY_SHARE, SINKS

    g = torch.Generator(device=device).manual_seed(seed)
    hkv = heads // group

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=g)

    freqs = torch.exp(rnd(hkv, 1, d // 2) - 5.0)
    phase = rnd(hkv, 1, d // 2) * math.pi
    a_local = (0.7 + 1.3 * torch.rand(hkv, 1, 1, device=device, generator=g)) * d ** 0.25
    c_sink = (1.5 + 2.0 * torch.rand(hkv, 1, 1, device=device, generator=g)) * d ** 0.5
    k = torch.empty(batch, hkv, length, d, dtype=dtype, device=device)
    v = torch.empty_like(k)
    q = torch.empty(batch, heads, 1, d, dtype=dtype, device=device)
    pos = torch.arange(length, device=device, dtype=torch.float32).view(1, length, 1)
    for b in range(batch):
        u = torch.nn.functional.normalize(rnd(hkv, 1, d), dim=-1)
        ang = pos * freqs + phase
        local = torch.cat([ang.sin(), ang.cos()], dim=-1) / math.sqrt(d / 2)      # [Hkv, L, D]
        kb = 0.6 * rnd(hkv, length, d) + a_local * local
        kb[:, :SINKS] += c_sink * u
        kb += (torch.rand(hkv, length, 1, device=device, generator=g) < HEAVY_SHARE) * (0.5 * c_sink) * u
        k[b] = kb.to(dtype)
        v[b] = rnd(hkv, length, d).to(dtype)
        qk = 0.6 * rnd(hkv, 1, d) + a_local * local[:, -1:] + 3.0 * u
        q[b] = (qk.repeat_interleave(group, dim=0) + 0.4 * rnd(heads, 1, d)).to(dtype)
    return q, k, v


def counted(skipped, v_skipped, length: int) -> tuple[float, float]:
    """(sparsity: skipped / reachable over heads and rows, group V-skip share: tiles every head of a
    group skips / tiles) from a kernel's counters skipped [B, H], v_skipped [B, Hkv]."""
    reach = (length - 1) // BN + 1
    return float(skipped.sum()) / (reach * skipped.numel()), float(v_skipped.sum()) / (reach * v_skipped.numel())


def bisect(sparsity_at, lo: float, hi: float, target: float, iters: int | None = None) -> float:
    """The x in [lo, hi] whose counted sparsity (increasing in x) is nearest ``target``."""
    best = None
    for _ in range(iters or BISECT_ITERS["quick" if interpreting() else "gpu"]):
        mid = (lo + hi) / 2
        s = sparsity_at(mid)
        if best is None or abs(s - target) < abs(best[1] - target):
            best = (mid, s)
        lo, hi = (mid, hi) if s < target else (lo, mid)
    return best[0]


def bsfa_at(tmax: torch.Tensor, length: int, p: float) -> torch.Tensor:
    """BSFA thresholds [H, 1]: each head's p-quantile of its candidate tile maxima over the batch."""
    a = (length - 1) // BN
    if a == 0:
        return torch.full((tmax.shape[1], 1), -math.inf, device=tmax.device)
    vals = tmax[:, :, :a].transpose(0, 1).reshape(tmax.shape[1], -1)
    return torch.quantile(vals, min(max(p, 0.0), 1.0), dim=1, keepdim=True)


def sdpa_variants(q, k, v) -> dict:
    """{name: fn} of the SDPA backends that run here, GQA natively (enable_gqa) and on K/V expanded
    by repeat_interleave outside the timed call (G > 1): the faster per backend is kept later."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    kk, vv = (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    out = {}
    for backend in SDPA:
        be = getattr(SDPBackend, backend)
        name = backend.split("_")[0].lower()
        modes = {"native": lambda be=be: _sdpa(F, sdpa_kernel, be, q, k, v, True)}
        if group > 1:
            modes["expanded"] = lambda be=be: _sdpa(F, sdpa_kernel, be, q, kk, vv, False)
        for mode, fn in modes.items():
            try:
                fn()
                out[f"sdpa_{name}_{mode}"] = fn
            except Exception as e:  # noqa: BLE001  (a backend that does not run on this shape is left out, said once)
                log(f"  sdpa_{name}_{mode} unavailable: {type(e).__name__}: {str(e)[:120]}")
    return out


def _sdpa(F, sdpa_kernel, backend, q, k, v, gqa: bool):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa) if gqa else F.scaled_dot_product_attention(q, k, v)
