"""Plain-torch VFA and VSA attention (the reference path): flash attention whose running max is
initialised from the Q-init estimate and the sink and local key blocks, then frozen.

VFA (Vector-relieved Flash Attention; Sun, Li et al., Huawei, arXiv 2604.12798) cuts the
vector work of online softmax: the running max starts from a cheap estimate, the key blocks that
usually hold a row's max are scanned first, and the max is frozen for the rest, so those blocks
need no row-max reduction and no accumulator rescale. VSA adds BLASST skipping. Here, for query
block i of BM rows (a decode row: a block of one row, BM = 1), R_i reachable and A_i candidate key
blocks (formats.geometry):

- **sink** = key block 0; **local** = the diagonal (non-candidate) blocks A_i .. R_i - 1. Together
  they are the first ``geometry.local_prefix`` blocks of the ``sink_local`` scan order.
- **Q-init** m_init_r = max over the reachable blocks j < R_i of scale * q_r . kb_j with kb the
  signed-absmax key representative of each block (capture.reference.signed_absmax_keys; with a
  softcap, the capped value): the capture's Q-init estimate, the same number.
- **Phase 1**: the sink and local blocks are scanned in sink_local order with the ordinary online
  softmax, the running max starting at m_init_r (finite), so each step where a block's row max
  exceeds the running max is a rescale (``rescales``, counted as the capture counts them: a strict
  increase from a finite value).
- **Freeze**: M_r = the running max after phase 1 = max(m_init_r, exact max of row r over the sink
  and local blocks). M_r - true row max is the capture's joint statistic (``joint_err``).
- **Phase 2**: the other candidates 1 .. A_i - 1, ascending, accumulate p = exp(s - M_r) with M_r
  fixed: no row-max reduction, no rescale, also where a tile's row max exceeds M_r (p > 1 there).
  VSA skips such a candidate tile when max over its rows of (rowmax_r(j) - M_r) < ln(lambda)
  (BLASST's gap, taken against the frozen max; a tile above M_r has a positive gap and stays).
- A query block with A_i <= 1 has nothing to freeze (phase 2 is empty): it runs the plain dense
  softmax, bit for bit the reference's dense path (sparse.reference with nothing skipped).

**Exactness.** The output is the softmax attention over the kept keys: sum p v / sum p is the same
for any M_r in exact arithmetic, so VFA is exact attention and VSA is exactly BLASST-style skipping
with another decision rule. In floating point it stays exact up to rounding while p = exp(s - M_r)
neither overflows nor underflows: ``excess`` (the largest rowmax_r(j) - M_r over phase-2 tiles
kept, >= 0) must stay below ln of the P dtype's largest value (fp16 11.09, bf16 / fp32 88.7), and
M_r - true max below ~87 (fp32 underflow of every p of the row). The reference computes in fp32 and
reports ``excess`` so a caller can see the margin; it does not guard it.

**Counts** (``VfaCounts``, per query head, summed over rows and query blocks): ``rescales`` that
VFA still does (phase 1), ``fa_rescales`` that the dense kernel's forward online softmax does over
all reachable blocks (capture's forward rescales), so ``fa_rescales - rescales`` are the rescales
VFA avoids; ``exceed`` (row, phase-2 tile) pairs computed with rowmax above M_r; ``frozen`` phase-2
(row, tile) pairs computed under the frozen max; ``skipped`` candidate tiles VSA skipped (0 for VFA).

Shape legend: H query heads, Hkv KV heads, N tokens, D head dim, m rows of a query block, nr
reachable key blocks of the block, BN key block size, B batch (decode), L cached keys (decode).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparsecal.formats.geometry import cdiv, num_candidates, num_reachable
from sparsecal.kernels.capture.reference import (
    NEG_INF,
    block_scores,
    check_sequence,
    forward_rescales,
    pad_blocks,
    signed_absmax_keys,
)
from sparsecal.kernels.softcap import check_softcap, soft_cap, soft_cap_

COUNT_NAMES = ("skipped", "rescales", "fa_rescales", "exceed", "frozen")


@dataclass
class VfaCounts:
    """What one VFA / VSA call did, per query head ([H] int64, ``excess`` [H] float32)."""

    heads: int
    device: object = None
    candidates: int = 0     # candidate tiles per head (sum of A_i)
    reachable: int = 0      # reachable tiles per head
    tensors: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in COUNT_NAMES:
            self.tensors[name] = torch.zeros(self.heads, dtype=torch.int64, device=self.device)
        self.tensors["excess"] = torch.zeros(self.heads, dtype=torch.float32, device=self.device)

    def __getattr__(self, name):
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)

    def add(self, part: dict) -> None:
        for name, value in part.items():
            if name == "excess":
                self.tensors[name] = torch.maximum(self.tensors[name], value)
            else:
                self.tensors[name] += value


def nothing_to_freeze(n: int, block_m: int, block_n: int) -> bool:
    """True when no query block of an N-token prefill (or, with block_m = 1, a decode row at
    position N - 1) has a candidate besides block 0: VFA is then the dense softmax everywhere."""
    return num_candidates((n - 1) // block_m, block_m, block_n) <= 1


def _probs(s: torch.Tensor, rmax: torch.Tensor, m_init: torch.Tensor, a: int, log_lambda: float | None):
    """One row block. s [H, m, nr*BN] scores (-inf masked, modified in place), rmax [H, m, nr] row
    maxima per block, m_init [H, m] Q-init. Returns (p [H, m, nr*BN] normalised probabilities,
    counts {name: [H]})."""
    h, m, nr = rmax.shape
    row_max = rmax.amax(dim=-1)
    fa = forward_rescales(rmax, row_max, 1)[0].sum(dim=1)
    zeros = torch.zeros(h, dtype=torch.int64, device=s.device)
    if a <= 1:  # nothing to freeze: the plain dense softmax (the reference's dense path)
        return torch.softmax(s, dim=-1), {"fa_rescales": fa, "rescales": fa}
    local = (rmax[..., :1], rmax[..., a:])  # the sink and diagonal blocks, slices: no index uploaded
    run = torch.cummax(torch.cat([m_init.unsqueeze(-1), *local], dim=-1), dim=-1).values
    resc = (run[..., 1:] > run[..., :-1]).sum(dim=(1, 2))
    frozen = run[..., -1]                                               # [H, m]
    xr = rmax[..., 1:a]                                                 # [H, m, a-1] phase-2 row maxima
    over = xr - frozen.unsqueeze(-1)
    skip = torch.zeros(h, nr, dtype=torch.bool, device=s.device)
    if log_lambda is not None:
        skip[:, 1:a] = over.clamp(max=0.0).amax(dim=1) < log_lambda
    kept = ~skip[:, None, 1:a]
    seen = xr > NEG_INF
    s.view(h, m, nr, -1).masked_fill_(skip[:, None, :, None], NEG_INF)
    p = torch.exp(s - frozen.unsqueeze(-1))
    p = p / p.sum(dim=-1, keepdim=True)
    excess = torch.where(kept & seen, over.clamp(min=0.0), torch.zeros_like(over)).amax(dim=(1, 2))
    return p, {"fa_rescales": fa, "rescales": resc, "skipped": skip.sum(dim=-1) if log_lambda is not None else zeros,
               "exceed": ((over > 0) & kept).sum(dim=(1, 2)), "frozen": (kept & seen).sum(dim=(1, 2)),
               "excess": excess}


def _m_init(qi: torch.Tensor, krep: torch.Tensor, nr: int, h: int, m: int, softcap: float) -> torch.Tensor:
    """Q-init [H, m] from pre-scaled queries qi [Hkv, group*m, D] and representatives krep [Hkv, Kb, D]."""
    return soft_cap(torch.bmm(qi, krep[:, :nr].transpose(1, 2)).view(h, m, nr).amax(dim=-1), softcap)


def vfa_attention(q, k, v, scale: float, block_m: int, block_n: int, *, log_lambda: float | None = None,
                  softcap: float = 0.0):
    """VFA (``log_lambda`` None) or VSA (BLASST skipping against the frozen max) causal prefill.

    q [1, H, N, D], k/v [1, Hkv, N, D] (any float dtype; computed in fp32). Returns (out [1, H, N, D]
    in q.dtype, VfaCounts)."""
    softcap = check_softcap(softcap)
    check_sequence(q, k, "VFA reference attention")
    _, h, n, d = q.shape
    hkv = k.shape[1]
    group, bm, bn = h // hkv, block_m, block_n
    qs = q[0].float() * scale
    kp, vp = pad_blocks(k[0].float(), bn), pad_blocks(v[0].float(), bn)
    krep = signed_absmax_keys(kp, bn)
    out = torch.empty(h, n, d, dtype=torch.float32, device=q.device)
    counts = VfaCounts(h, q.device)
    for i in range(cdiv(n, bm)):
        r0, r1 = i * bm, min((i + 1) * bm, n)
        m, nr, a = r1 - r0, num_reachable(i, n, bm, bn), num_candidates(i, bm, bn)
        s = block_scores(qs, kp, r0, r1, nr, bn, group, softcap)             # [H, m, nr*BN]
        m_init = _m_init(qs[:, r0:r1].reshape(hkv, group * m, d), krep, nr, h, m, softcap)
        p, part = _probs(s, s.view(h, m, nr, bn).amax(dim=-1), m_init, a, log_lambda)
        out[:, r0:r1] = torch.bmm(p.view(hkv, group * m, nr * bn), vp[:, : nr * bn]).view(h, m, d)
        counts.add(part)
        counts.candidates, counts.reachable = counts.candidates + a, counts.reachable + nr
    return out.to(q.dtype).unsqueeze(0), counts


def vfa_decode(q, k, v, scale: float, block_m: int, block_n: int, *, log_lambda: float | None = None,
               softcap: float = 0.0):
    """One VFA / VSA decode step: q [B, H, 1, D] against k/v [B, Hkv, L, D] (the row sits at L - 1,
    its own block). Returns (out [B, H, 1, D] in q.dtype, VfaCounts summed over the batch)."""
    softcap = check_softcap(softcap)
    b, h, one, d = q.shape
    if one != 1:
        raise ValueError(f"decode takes one query row per sequence, got {one}")
    hkv, length = k.shape[1], k.shape[2]
    group, bn, r = h // hkv, block_n, length - 1
    nr, a = r // bn + 1, num_candidates(r, 1, bn)
    outs, counts = [], VfaCounts(h, q.device, candidates=a * b, reachable=nr * b)
    for s_i in range(b):
        kp, vp = pad_blocks(k[s_i].float(), bn), pad_blocks(v[s_i].float(), bn)
        qi = q[s_i].float().reshape(hkv, group, d) * scale
        s = soft_cap_(torch.bmm(qi, kp[:, : nr * bn].transpose(1, 2)), softcap).view(h, 1, nr * bn)
        s[..., length:].fill_(NEG_INF)                                        # padding keys
        m_init = _m_init(qi, signed_absmax_keys(kp, bn), nr, h, 1, softcap)
        p, part = _probs(s, s.view(h, 1, nr, bn).amax(dim=-1), m_init, a, log_lambda)
        outs.append(torch.bmm(p.view(hkv, group, nr * bn), vp[:, : nr * bn]).view(h, 1, d))
        counts.add(part)
    return torch.stack(outs).to(q.dtype), counts
