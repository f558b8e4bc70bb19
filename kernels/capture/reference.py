"""Plain-torch instrumented causal attention: the semantics of every statistic, and the CPU backend.

One pass over the query blocks computes the real attention output and the tile-level statistics
of DESIGN.md. It never holds more than one query block's scores (per head) at a time: for block i
the scores are [H, BM, num_reachable(i) * BN]. GQA is native: query head h reads KV head
h // (H // Hkv), and K/V are never repeated per query head. With ``softcap`` c > 0 (Gemma 2's
attention logit soft-capping) every scaled score s becomes c * tanh(s / c) before anything reads
it: the output and every statistic are those of the capped scores (kernels/softcap.py).

Shape legend
    H   query heads            Hkv  key/value heads (H % Hkv == 0)
    N   sequence length        D    head dim
    P   ceil(N / BM) query blocks      Kb  ceil(N / BN) key blocks
    O   scan orders (cfg.orders)       R   decode rows (the last min(cfg.decode_rows, N) rows)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecal.formats.geometry import cdiv, local_prefix, num_candidates, num_reachable, scan_order, where_code
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.softcap import check_softcap, soft_cap, soft_cap_

NEG_INF = float("-inf")


@dataclass
class TileStats:
    """Tile- and row-level statistics of one attention call (one sequence).

    bmax        [H, P, Kb]    max score over the visible pairs of each tile (-inf unreachable)
    gap         [H, O, P, Kb] max over rows of (rowmax - running max after the tile) per order
                              (-inf unreachable)
    mass        [H, P, Kb]    mean over the block's rows of the softmax probability in the tile
    tstar_step  [H, O, N]     scan step at which each row's running max reaches its final value
    tstar_where [H, O, N]     0 sink block, 1 diagonal block, 2 middle (geometry.where_code)
    tstar_norm  [H, O, N]     tstar_step / max(num_reachable - 1, 1)
    rescales    [H, O, N]     scan steps at which the row's running max strictly increases from a
                              finite value (each an O(D) accumulator rescale), int64
    shortfall   [H, O, 2, N]  final row max minus the running max after the first scanned block
                              (prefix 0, "first") and after the first geometry.local_prefix blocks
                              (prefix 1, "local"); 0 when already final, +inf when the row has
                              seen no key yet
    qinit_err   [H, N]        signed-absmax Q-init estimate of the row max minus the true row max
    dec_gap     [H, O, R, Kb] decode-mode gaps: each of the last R rows is its own block
    dec_mass    [H, R, Kb]    softmax mass of each decode row in each key block
    dec_rows    [R]           the row indices of the decode rows
    dec_bmax    [H, R, Kb]    each decode row's max score in each key block (its block max as a
                              block of its own; -inf where the row sees none of it)
    joint_err   [H, N]        VFA's frozen max minus the true row max: max(Q-init estimate, exact
                              max over the sink block 0 and the diagonal blocks A_i .. R_i - 1) -
                              row max (>= the Q-init error and >= minus the sink_local "local"
                              shortfall; < 0 exactly when a middle candidate holds a larger score)
    group       G = H / Hkv, the query heads of a KV group (adjacent heads): the decode group gap
                histograms (reduce_reference.group_gap_hist) take each group's max
    """

    bmax: torch.Tensor
    gap: torch.Tensor
    mass: torch.Tensor
    tstar_step: torch.Tensor
    tstar_where: torch.Tensor
    tstar_norm: torch.Tensor
    qinit_err: torch.Tensor
    dec_gap: torch.Tensor
    dec_mass: torch.Tensor
    dec_rows: torch.Tensor
    rescales: torch.Tensor
    shortfall: torch.Tensor
    dec_bmax: torch.Tensor | None = None
    joint_err: torch.Tensor | None = None
    group: int = 1


def pad_blocks(x: torch.Tensor, bn: int) -> torch.Tensor:
    """[Hkv, N, D] -> [Hkv, ceil(N/bn)*bn, D], zero rows appended (they are always masked)."""
    n = x.shape[1]
    pad = cdiv(n, bn) * bn - n
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def signed_absmax_keys(kp: torch.Tensor, bn: int) -> torch.Tensor:
    """VFA key representative per block: kb[j, d] = k[t, d] with t = argmax_t |k[t, d]|.

    kp [Hkv, Kb*BN, D] (zero padded past n) -> [Hkv, Kb, D]. Padding rows are zero, so they can
    only win a tie with an all-zero column, where the representative is 0 either way.
    """
    hkv, npad, d = kp.shape
    blocks = kp.view(hkv, npad // bn, bn, d)
    idx = blocks.abs().argmax(dim=2, keepdim=True)
    return blocks.gather(2, idx).squeeze(2)


def scan_rows(rmax: torch.Tensor, perm: list[int], row_max: torch.Tensor):
    """Running-max scan of per-row block maxima in one order.

    rmax [H, m, nr] per-row max of each block (-inf where a row sees nothing); perm: scan order;
    row_max [H, m] final row max. Returns (gap [H, m, nr] per row in block order, -inf where the row
    sees nothing; tstar [H, m] first scan step at which the running max equals row_max).
    """
    idx = torch.tensor(perm, dtype=torch.long, device=rmax.device)
    rp = rmax.index_select(-1, idx)
    running = torch.cummax(rp, dim=-1).values
    g = torch.where(rp > NEG_INF, rp - running, torch.full_like(rp, NEG_INF))
    gap = torch.empty_like(g)
    gap.index_copy_(-1, idx, g)
    tstar = (rp == row_max.unsqueeze(-1)).to(torch.int8).argmax(dim=-1)
    return gap, tstar


def scan_rescales(rmax: torch.Tensor, perm: list[int], row_max: torch.Tensor, n_local: int):
    """Running-max rescales and shortfall of per-row block maxima in one order.

    rmax [H, m, nr] (-inf where a row sees nothing); perm: scan order; row_max [H, m];
    n_local: geometry.local_prefix. Returns (rescales [H, m] int64: steps s >= 1 with
    m(s) > m(s - 1) > -inf; shortfall [H, 2, m]: row_max - m(0) and row_max - m(n_local - 1)).
    """
    idx = torch.tensor(perm, dtype=torch.long, device=rmax.device)
    return _rescales(torch.cummax(rmax.index_select(-1, idx), dim=-1).values, row_max, n_local)


def forward_rescales(rmax: torch.Tensor, row_max: torch.Tensor, n_local: int):
    """``scan_rescales`` in the forward order (perm 0 .. nr-1), the same numbers without the index
    tensor scan_rescales uploads: for a caller on a per-block host path (kernels/sparse/vfa.py)."""
    return _rescales(torch.cummax(rmax, dim=-1).values, row_max, n_local)


def _rescales(running: torch.Tensor, row_max: torch.Tensor, n_local: int):
    """(rescales [H, m], shortfall [H, 2, m]) of a running max [H, m, nr] in scan order."""
    prev, cur = running[..., :-1], running[..., 1:]
    rescales = ((cur > prev) & (prev > NEG_INF)).sum(dim=-1)
    shortfall = torch.stack([row_max - running[..., 0], row_max - running[..., n_local - 1]], dim=1)
    return rescales, shortfall


def block_scores(qs, kp, r0, r1, nr, bn, group, softcap: float = 0.0):
    """Scaled (and, with softcap, capped) causal scores of rows [r0, r1) against key blocks
    0..nr-1 -> [H, m, nr*BN]."""
    hkv, _, d = kp.shape
    m = r1 - r0
    qi = qs[:, r0:r1].reshape(hkv, group * m, d)
    s = soft_cap_(torch.bmm(qi, kp[:, : nr * bn].transpose(1, 2)), softcap).view(hkv * group, m, nr * bn)
    a_start = (r0 // bn) * bn  # keys before the block holding row r0 are visible to every row
    keys = torch.arange(a_start, nr * bn, device=s.device)
    rows = torch.arange(r0, r1, device=s.device)
    s[:, :, a_start:].masked_fill_(keys[None, :] > rows[:, None], NEG_INF)
    return s


def _softmax_blocks(s, nr, bn):
    """In place: s -> exp(s - rowmax). Returns (rmax [H,m,nr], row_max [H,m], block probability
    sums [H,m,nr], row normalizer [H,m])."""
    h, m, _ = s.shape
    rmax = s.view(h, m, nr, bn).amax(dim=-1)
    row_max = rmax.amax(dim=-1)
    s.sub_(row_max.unsqueeze(-1)).exp_()
    bsum = s.view(h, m, nr, bn).sum(dim=-1)
    return rmax, row_max, bsum, bsum.sum(dim=-1)


def check_sequence(q, k, what: str) -> None:
    """One sequence (batch 1) whose query heads are a multiple of the KV heads."""
    if q.shape[0] != 1:
        raise ValueError(f"{what} takes one sequence at a time (batch size 1)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")


def instrumented_attention(q, k, v, scale: float, cfg: StatsConfig, *, softcap: float = 0.0):
    """Causal attention output and TileStats of one sequence.

    q [1, H, N, D], k/v [1, Hkv, N, D] (any float dtype; computed in fp32). softcap: the cap c of
    c * tanh(s / c) on every scaled score (0 or None: off). Returns (out [1, H, N, D] in q.dtype,
    TileStats).
    """
    check_sequence(q, k, "instrumented attention")
    softcap = check_softcap(softcap)
    _, h, n, d = q.shape
    hkv = k.shape[1]
    group, bm, bn, orders = h // hkv, cfg.block_m, cfg.block_n, cfg.orders
    p, kb = cdiv(n, bm), cdiv(n, bn)
    qs = q[0].float() * scale
    kp = pad_blocks(k[0].float(), bn)
    vp = pad_blocks(v[0].float(), bn)
    krep = signed_absmax_keys(kp, bn)

    out = torch.empty(h, n, d, dtype=torch.float32, device=q.device)
    f32 = dict(dtype=torch.float32, device=q.device)
    bmax = torch.full((h, p, kb), NEG_INF, **f32)
    gap = torch.full((h, len(orders), p, kb), NEG_INF, **f32)
    mass = torch.zeros((h, p, kb), **f32)
    tstar_step = torch.zeros((h, len(orders), n), dtype=torch.int64, device=q.device)
    tstar_where = torch.zeros((h, len(orders), n), dtype=torch.int8, device=q.device)
    tstar_norm = torch.zeros((h, len(orders), n), **f32)
    qinit_err = torch.zeros((h, n), **f32)
    joint_err = torch.zeros((h, n), **f32)
    rescales = torch.zeros((h, len(orders), n), dtype=torch.int64, device=q.device)
    shortfall = torch.zeros((h, len(orders), 2, n), **f32)

    for i in range(p):
        r0, r1 = i * bm, min((i + 1) * bm, n)
        m, nr, a = r1 - r0, num_reachable(i, n, bm, bn), num_candidates(i, bm, bn)
        s = block_scores(qs, kp, r0, r1, nr, bn, group, softcap)
        rmax, row_max, bsum, norm = _softmax_blocks(s, nr, bn)
        pv = torch.bmm(s.view(hkv, group * m, nr * bn), vp[:, : nr * bn])
        out[:, r0:r1] = pv.view(h, m, d) / norm.unsqueeze(-1)
        mass[:, i, :nr] = (bsum / norm.unsqueeze(-1)).mean(dim=1)
        bmax[:, i, :nr] = rmax.amax(dim=1)
        for o, order in enumerate(orders):
            perm = scan_order(order, a, nr)
            g, step = scan_rows(rmax, perm, row_max)
            gap[:, o, i, :nr] = g.amax(dim=1)
            codes = torch.tensor([where_code(j, a) for j in perm], dtype=torch.int8, device=q.device)
            tstar_step[:, o, r0:r1] = step
            tstar_where[:, o, r0:r1] = codes[step]
            tstar_norm[:, o, r0:r1] = step.float() / max(nr - 1, 1)
            rescales[:, o, r0:r1], shortfall[:, o, :, r0:r1] = scan_rescales(rmax, perm, row_max, local_prefix(a, nr))
        qi = qs[:, r0:r1].reshape(hkv, group * m, d)
        m_init = torch.bmm(qi, krep[:, :nr].transpose(1, 2)).view(h, m, nr).amax(dim=-1)
        qinit_err[:, r0:r1] = soft_cap(m_init, softcap) - row_max  # tanh is monotone: cap the max
        local = rmax[..., [0] + list(range(max(a, 1), nr))].amax(dim=-1)  # sink + diagonal blocks
        joint_err[:, r0:r1] = torch.maximum(soft_cap(m_init, softcap), local) - row_max

    dec_rows, dec_gap, dec_mass, dec_bmax = decode_tiles(qs, kp, n, group, cfg, softcap=softcap)
    stats = TileStats(bmax, gap, mass, tstar_step, tstar_where, tstar_norm, qinit_err,
                      dec_gap, dec_mass, dec_rows, rescales, shortfall, dec_bmax, joint_err, group)
    return out.to(q.dtype).unsqueeze(0), stats


def decode_tiles(qs, kp, n: int, group: int, cfg: StatsConfig, *, softcap: float = 0.0):
    """Decode-mode gaps and masses for the last R rows, each row its own block (BM = 1).

    qs [H, N, D] pre-scaled queries; kp [Hkv, Kb*BN, D]; softcap as in instrumented_attention.
    Returns (rows [R], gap [H, O, R, Kb], mass [H, R, Kb], bmax [H, R, Kb] each row's max score per
    key block, -inf where it sees none). Rows that share a key block share the scan order, so they
    run together.
    """
    bn, orders = cfg.block_n, cfg.orders
    h, kb = qs.shape[0], kp.shape[1] // bn
    r_first = max(n - cfg.decode_rows, 0)
    rows = torch.arange(r_first, n, device=qs.device)
    gap = torch.full((h, len(orders), n - r_first, kb), NEG_INF, dtype=torch.float32, device=qs.device)
    mass = torch.zeros((h, n - r_first, kb), dtype=torch.float32, device=qs.device)
    bmax = torch.full((h, n - r_first, kb), NEG_INF, dtype=torch.float32, device=qs.device)
    r = r_first
    while r < n:
        r_end = min(n, (r // bn + 1) * bn)  # rows in the same key block share nr and A
        nr, a = r // bn + 1, num_candidates(r, 1, bn)
        s = block_scores(qs, kp, r, r_end, nr, bn, group, softcap)
        rmax, row_max, bsum, norm = _softmax_blocks(s, nr, bn)
        mass[:, r - r_first : r_end - r_first, :nr] = bsum / norm.unsqueeze(-1)
        bmax[:, r - r_first : r_end - r_first, :nr] = rmax
        for o, order in enumerate(orders):
            g, _ = scan_rows(rmax, scan_order(order, a, nr), row_max)
            gap[:, o, r - r_first : r_end - r_first, :nr] = g
        r = r_end
    return rows, gap, mass, bmax
