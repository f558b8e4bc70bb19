"""Inputs with real block sparsity for the sparse-kernel benchmark, and thresholds that reach a
chosen sparsity on them.

Random Q/K give almost no or almost total sparsity (data/bench/NOTES.md), so the long, wide shapes
use attention built the way trained models look (StreamingLLM / H2O observations): per KV head

    sinks          the first 4 keys align with a shared query direction u
    local window   queries and keys share a smooth positional component, so nearby keys score high
    heavy hitters  ~0.5% of keys at random positions also align with u

with strengths drawn per head (scaled scores: sinks about 4.5-10.5, the local peak 0.5-4, noise
about 0.4), so each row's maximum mostly sits at the sinks, as in trained models.

``bsfa_thresholds_for`` and ``blasst_log_lambda_for`` read the tile statistics of the very input
(the single-pass instrumented forward, forward order) and return the operating point that skips
a share ``s`` of the reachable tiles; the benchmark then reports the sparsity the kernel counted.

Shape legend: H query heads, Hkv KV heads, N tokens, D head dim, P query blocks, Kb key blocks.
"""
from __future__ import annotations

import math

import torch

from sparsecal.formats.geometry import block_counts
from sparsecal.formats.stats_config import StatsConfig

SINKS = 4
HEAVY_SHARE = 0.005


def structured_qkv(n: int, d: int, heads: int, kv_heads: int, seed: int = 0, dtype=torch.bfloat16,
                   device="cuda", batch: int = 1):
    """q [B, H, N, D], k/v [B, Hkv, N, D] with sinks, local windows and heavy hitters (see above)."""
    g = torch.Generator(device=device).manual_seed(seed)
    group = heads // kv_heads

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=g)

    u = torch.nn.functional.normalize(rnd(batch, kv_heads, 1, d), dim=-1)
    pos = torch.arange(n, device=device, dtype=torch.float32)
    freqs = torch.exp(rnd(kv_heads, 1, d // 2) * 1.0 - 5.0)              # periods ~100-2000 tokens
    phase = rnd(kv_heads, 1, d // 2) * math.pi
    ang = pos.view(1, n, 1) * freqs + phase
    local = torch.cat([ang.sin(), ang.cos()], dim=-1) / math.sqrt(d / 2)   # [Hkv, N, D], unit norm
    a_local = (0.7 + 1.3 * torch.rand(kv_heads, 1, 1, device=device, generator=g)) * d ** 0.25
    c_sink = (1.5 + 2.0 * torch.rand(kv_heads, 1, 1, device=device, generator=g)) * d ** 0.5
    k = 0.6 * rnd(batch, kv_heads, n, d) + a_local * local
    k[:, :, :SINKS] += c_sink * u
    heavy = torch.rand(batch, kv_heads, n, 1, device=device, generator=g) < HEAVY_SHARE
    k += heavy * (0.5 * c_sink) * u
    qk = 0.6 * rnd(batch, kv_heads, n, d) + a_local * local + 3.0 * u
    q = qk.repeat_interleave(group, dim=1) + 0.4 * rnd(batch, heads, n, d)
    v = rnd(batch, kv_heads, n, d)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def tile_stats(q, k, v, scale: float, block_m: int, block_n: int):
    """(bmax, gap) [H, P, Kb] f32 (forward order) of one sequence, from the single-pass kernel."""
    from sparsecal.kernels.capture.forward_stats import instrumented_forward_triton

    cfg = StatsConfig(block_m=block_m, block_n=block_n, orders=("forward",), decode_rows=0)
    _, _, bmax, gap, *_ = instrumented_forward_triton(q[:1], k[:1], v[:1], scale, cfg, "forward")
    return bmax, gap


def _candidate_mask(n: int, block_m: int, block_n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    cand, reach = (torch.from_numpy(x) for x in block_counts(n, block_m, block_n))
    kb = -(-n // block_n)
    return (torch.arange(kb, device=device)[None, :] < cand.to(device)[:, None]), reach.to(device)


def bsfa_thresholds_for(bmax: torch.Tensor, n: int, block_m: int, block_n: int, s: float) -> torch.Tensor:
    """Thresholds [H, P] that skip round(s * R_i) candidates of each query block (at most A_i): the
    midpoint between the last kept and the first skipped candidate block max. s = 0 gives -inf."""
    cmask, reach = _candidate_mask(n, block_m, block_n, bmax.device)
    cb = bmax.masked_fill(~cmask, -math.inf)
    vals = cb.sort(dim=-1, descending=True).values                       # [H, P, Kb]
    a = cmask.sum(dim=-1)                                                # [P]
    keep = (a - torch.clamp(torch.round(s * reach).long(), max=a)).clamp(min=0)  # [P]
    kb = vals.shape[-1]
    last = vals.gather(-1, (keep - 1).clamp(min=0).view(1, -1, 1).expand(vals.shape[0], -1, 1))[..., 0]
    nxt = vals.gather(-1, keep.clamp(max=kb - 1).view(1, -1, 1).expand(vals.shape[0], -1, 1))[..., 0]
    thr = torch.where(torch.isfinite(nxt), (last + nxt) / 2, torch.full_like(last, -math.inf))
    thr = torch.where(keep == a, torch.full_like(thr, -math.inf), thr)
    return torch.where(keep == 0, vals[..., 0] + 1.0, thr)


def blasst_log_lambda_for(gap: torch.Tensor, n: int, block_m: int, block_n: int, s: float) -> float:
    """ln(lambda) below which a share s of all reachable tiles (over heads) fall: the midpoint of
    two consecutive candidate gaps. s = 0 gives -inf."""
    if s <= 0:
        return -math.inf
    cmask, reach = _candidate_mask(n, block_m, block_n, gap.device)
    gaps = gap[:, cmask].flatten().float().sort().values
    want = min(int(round(s * float(reach.sum()) * gap.shape[0])), gaps.numel())
    if want >= gaps.numel():  # every candidate: lambda = 1 at most, never past the tiles that raise the max
        return min(float(gaps[-1]) + 1.0, 0.0)
    lo = float(gaps[want - 1]) if want else float(gaps[0]) - 1.0
    return (lo + float(gaps[want])) / 2


def decode_tile_max(q, k, scale: float, block_n: int) -> torch.Tensor:
    """The decode row's tile maxima [B, H, Kb] (natural units, -inf padding). q [B, H, 1, D],
    k [B, Hkv, L, D]."""
    b, h, _, _ = q.shape
    length = k.shape[2]
    kb = -(-length // block_n)
    kk = k.repeat_interleave(h // k.shape[1], dim=1).float()
    sc = (q.float() @ kk.transpose(-1, -2))[:, :, 0] * scale             # [B, H, L]
    pad = torch.full((b, h, kb * block_n - length), -math.inf, device=sc.device)
    return torch.cat([sc, pad], dim=-1).view(b, h, kb, block_n).amax(-1)


def decode_log_lambda_for(q, k, scale: float, block_n: int, s: float) -> float:
    """ln(lambda) at which a share s of the decode row's reachable tiles (all sequences and heads)
    sit below the forward running max. q [B, H, 1, D], k [B, Hkv, L, D]."""
    if s <= 0:
        return -math.inf
    tmax = decode_tile_max(q, k, scale, block_n)
    gap = tmax - torch.cummax(tmax, dim=-1).values
    a = (k.shape[2] - 1) // block_n
    gaps = gap[..., :a].flatten().sort().values
    want = min(int(round(s * tmax.numel())), gaps.numel())
    if want >= gaps.numel():  # every candidate: lambda = 1 at most, never past the tiles that raise the max
        return min(float(gaps[-1]) + 1.0, 0.0)
    return (float(gaps[want - 1]) + float(gaps[want])) / 2 if want else float(gaps[0]) - 1.0
