"""Plain-torch BSFA and BLASST sparse prefill attention: the semantics the sparse kernels implement
and the CPU backend.

Causal attention of one sequence, tiled BM x BN as in DESIGN.md. Query block i always computes its
diagonal (non-candidate) key blocks; a candidate block j < A_i is skipped when
    BSFA:    bmax[i, j] <  thresholds[h, min(i, Pt - 1)]      (max score of the tile)
    BLASST:  gap[i, j | order] < ln(lambda)                      (rowmax - running max, DESIGN.md)
    window:  j < A_i - W      (sliding window: the W candidates nearest the diagonal are kept)
    window with ``sink``: j < A_i - W and j >= 1  (StreamingLLM: key block 0, the attention sink,
             is kept besides the W nearest candidates; at most W + 1 candidates stay)
A skipped tile contributes nothing: no V load, no exponentials, no P.V, not in the normalizer. The
output is the softmax attention over the kept keys. A BLASST-skipped tile has every row below the
running max, so skipping never changes the running max: the decision made from the dense scan
(what capture records) is exactly the kernel's. thresholds = -inf or ln(lambda) = -inf skips
nothing (dense attention).

Soft-capping (``softcap`` c > 0, Gemma 2): every scaled score s becomes c * tanh(s / c) before the
decisions and the softmax, so BSFA tile maxima and BLASST gaps are those of the capped scores (what
a capture with the same cap records).

Decode (one new query row at position r = L - 1 against L cached keys): the row is its own block
(BM = 1), so its candidates are the key blocks j with (j + 1) * BN <= r and the last reachable
block is always computed; BSFA reads the threshold of the query block the row falls in,
min(r // BM, Pt - 1) (prefill thresholds, or thresholds calibrated on single decode rows: the same
layout). Decode also takes ``topk`` = k: per query head, keep the k candidates with the largest
tile max (the row's block max) and skip the others; ties are kept: every candidate whose tile max
is >= the k-th largest candidate tile max stays (``topk_skip_mask``), so more than k may stay. With
A <= k candidates nothing is skipped.

Shape legend: H query heads, Hkv KV heads, N tokens, D head dim, P = ceil(N/BM) query blocks,
Pt threshold positions (an export's max_num_blocks), Kb = ceil(N/BN) key blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecal.formats.geometry import cdiv, num_candidates, num_reachable, scan_order
from sparsecal.kernels.capture.reference import NEG_INF, block_scores, check_sequence, pad_blocks, scan_rows
from sparsecal.kernels.softcap import check_softcap, soft_cap_


@dataclass
class SkipCounts:
    """Tiles one sparse call skipped, per query head, next to what could be skipped."""

    skipped: torch.Tensor   # [H] int64 candidate tiles skipped
    candidates: int         # candidate tiles per head (sum of A_i)
    reachable: int          # reachable tiles per head (sparsity = skipped / reachable)
    v_skipped: torch.Tensor | None = None  # decode: [Hkv] int64 tiles every head of the group skips


def check_method(thresholds, log_lambda, window, topk=None, sink: bool = False) -> None:
    """Exactly one of BSFA ``thresholds``, BLASST ``log_lambda``, a ``window`` (>= 0 blocks) or a
    decode ``topk`` (>= 0 blocks kept per head); ``sink`` only with a window."""
    if sum(x is not None for x in (thresholds, log_lambda, window, topk)) != 1:
        raise ValueError("give exactly one of thresholds (BSFA), log_lambda (BLASST), window or topk (decode)")
    if sink and window is None:
        raise ValueError("sink (keep key block 0) goes with a window only")
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 key blocks, got {window}")
    if topk is not None and (isinstance(topk, bool) or int(topk) != topk or topk < 0):
        raise ValueError(f"topk must be an integer >= 0 key blocks, got {topk!r}")


def topk_skip_mask(tmax: torch.Tensor, a: int, k: int) -> torch.Tensor:
    """Decode top-k: which key blocks a row skips. tmax [..., Kb] tile maxima (any monotone units:
    natural or log2) -> [..., Kb] bool. Only candidates j < a are skipped, those whose tile max is
    strictly below the k-th largest candidate tile max (ties with it are kept); a <= k skips nothing."""
    kb = tmax.shape[-1]
    if a <= k:
        return torch.zeros_like(tmax, dtype=torch.bool)
    cand = torch.arange(kb, device=tmax.device) < a
    if k == 0:
        return cand.expand(tmax.shape).clone()
    kth = tmax[..., :a].topk(k, dim=-1, sorted=True).values[..., -1:]
    return cand & (tmax < kth)


def window_skip(nr: int, a: int, window: int, sink: bool, device=None) -> torch.Tensor:
    """The window's skipped key blocks of a row block with ``a`` candidates: [nr] bool, j < a - W
    (and j >= 1 with ``sink``)."""
    j = torch.arange(nr, device=device)
    return (j < a - window) & (j >= 1) if sink else j < a - window


def _skip_mask(rmax: torch.Tensor, i: int, a: int, thresholds, log_lambda, order: str,
               window: int | None = None, sink: bool = False) -> torch.Tensor:
    """Which of query block i's reachable key blocks are skipped. rmax [H, m, nr] -> [H, nr] bool."""
    h, _, nr = rmax.shape
    cand = torch.arange(nr, device=rmax.device) < a
    if window is not None:
        below = window_skip(nr, a, window, sink, rmax.device).expand(h, nr)
    elif thresholds is not None:
        thr = thresholds[:, min(i, thresholds.shape[1] - 1)].to(rmax)
        below = rmax.amax(dim=1) < thr.unsqueeze(-1)
    else:
        gap, _ = scan_rows(rmax, scan_order(order, a, nr), rmax.amax(dim=-1))
        below = gap.amax(dim=1) < log_lambda
    return below & cand.unsqueeze(0)


def sparse_attention(q, k, v, scale: float, block_m: int, block_n: int, *, thresholds=None,
                     log_lambda: float | None = None, window: int | None = None, order: str = "forward",
                     softcap: float = 0.0, sink: bool = False):
    """BSFA (``thresholds`` [H, Pt]), BLASST (``log_lambda``, scan ``order``) or sliding-window
    (``window`` candidate blocks; ``sink``: key block 0 kept too) causal attention.

    q [1, H, N, D], k/v [1, Hkv, N, D] (any float dtype; computed in fp32). Exactly one of
    thresholds, log_lambda and window; softcap: the cap c of c * tanh(s / c) (0 or None: off).
    Returns (out [1, H, N, D] in q.dtype, SkipCounts).
    """
    check_method(thresholds, log_lambda, window, sink=sink)
    softcap = check_softcap(softcap)
    check_sequence(q, k, "sparse reference attention")
    _, h, n, d = q.shape
    hkv = k.shape[1]
    if thresholds is not None and thresholds.shape[0] != h:
        raise ValueError(f"thresholds have {thresholds.shape[0]} heads, attention has {h}")
    group, bm, bn = h // hkv, block_m, block_n
    qs = q[0].float() * scale
    kp, vp = pad_blocks(k[0].float(), bn), pad_blocks(v[0].float(), bn)
    out = torch.empty(h, n, d, dtype=torch.float32, device=q.device)
    skipped = torch.zeros(h, dtype=torch.int64, device=q.device)
    n_cand = n_reach = 0
    for i in range(cdiv(n, bm)):
        r0, r1 = i * bm, min((i + 1) * bm, n)
        m, nr, a = r1 - r0, num_reachable(i, n, bm, bn), num_candidates(i, bm, bn)
        s = block_scores(qs, kp, r0, r1, nr, bn, group, softcap)             # [H, m, nr*BN]
        skip = _skip_mask(s.view(h, m, nr, bn).amax(dim=-1), i, a, thresholds, log_lambda, order, window, sink)
        s.view(h, m, nr, bn).masked_fill_(skip[:, None, :, None], NEG_INF)
        p = torch.softmax(s, dim=-1)
        out[:, r0:r1] = torch.bmm(p.view(hkv, group * m, nr * bn), vp[:, : nr * bn]).view(h, m, d)
        skipped += skip.sum(dim=-1)
        n_cand, n_reach = n_cand + a, n_reach + nr
    return out.to(q.dtype).unsqueeze(0), SkipCounts(skipped, n_cand, n_reach)


DECISIONS = ("head", "group")  # decode: one skip decision per query head, or one per KV group


def check_decision(decision: str) -> None:
    if decision not in DECISIONS:
        raise ValueError(f"Unknown decode decision '{decision}'. Available: {', '.join(DECISIONS)}.")


def group_skip(skip: torch.Tensor, group: int) -> torch.Tensor:
    """The group decision: a tile is skipped by every head of a KV group only when every head's
    own rule skips it (so the group keeps what any head keeps: the V load is paid then anyway).
    skip [..., H, Kb] bool (heads of a group adjacent) -> the same shape."""
    *lead, h, kb = skip.shape
    g = skip.reshape(*lead, h // group, group, kb).all(dim=-2, keepdim=True)
    return g.expand(*lead, h // group, group, kb).reshape(skip.shape)


def sparse_decode(q, k, v, scale: float, block_m: int, block_n: int, *, thresholds=None,
                  log_lambda: float | None = None, window: int | None = None, order: str = "forward",
                  softcap: float = 0.0, topk: int | None = None, sink: bool = False,
                  decision: str = "head"):
    """One decode step: q [B, H, 1, D] against k/v [B, Hkv, L, D] (the row sits at position L - 1).

    Exactly one of thresholds [H, Pt] (BSFA), log_lambda (BLASST), window (``sink``: block 0 kept
    too) or topk (keep the topk
    candidates with the largest tile max per head, ties kept: topk_skip_mask); softcap as in
    sparse_attention. ``decision``: "head" (each query head its own rule) or "group" (``group_skip``:
    a tile is skipped by the whole KV group when every head's rule skips it, else kept by all).
    Returns (out [B, H, 1, D] in q.dtype, SkipCounts summed over the batch; its v_skipped [Hkv]
    counts the tiles every head of a group skips, the V tiles a kernel need not load).
    """
    check_method(thresholds, log_lambda, window, topk, sink)
    check_decision(decision)
    softcap = check_softcap(softcap)
    b, h, one, d = q.shape
    if one != 1:
        raise ValueError(f"decode takes one query row per sequence, got {one}")
    hkv, length = k.shape[1], k.shape[2]
    group, bn, r = h // hkv, block_n, k.shape[2] - 1
    nr, a = r // bn + 1, num_candidates(r, 1, bn)
    outs, skipped = [], torch.zeros(h, dtype=torch.int64, device=q.device)
    v_skipped = torch.zeros(hkv, dtype=torch.int64, device=q.device)
    for s_i in range(b):
        kp, vp = pad_blocks(k[s_i].float(), bn), pad_blocks(v[s_i].float(), bn)
        qi = q[s_i].float().reshape(hkv, group, d) * scale
        s = soft_cap_(torch.bmm(qi, kp[:, : nr * bn].transpose(1, 2)), softcap).view(h, 1, nr * bn)
        s[..., length:] = NEG_INF                                             # padding keys
        tmax = s.view(h, 1, nr, bn).amax(dim=-1)                             # [H, 1, nr]
        if topk is not None:
            skip = topk_skip_mask(tmax[:, 0], a, int(topk))
        else:
            skip = _skip_mask(tmax, r // block_m, a, thresholds, log_lambda, order, window, sink)
        if decision == "group":
            skip = group_skip(skip, group)
        s.view(h, 1, nr, bn).masked_fill_(skip[:, None, :, None], NEG_INF)
        p = torch.softmax(s, dim=-1)
        outs.append(torch.bmm(p.view(hkv, group, nr * bn), vp[:, : nr * bn]).view(h, 1, d))
        skipped += skip.sum(dim=-1)
        v_skipped += skip.view(hkv, group, nr).all(dim=1).sum(dim=-1)
    return torch.stack(outs).to(q.dtype), SkipCounts(skipped, a * b, nr * b, v_skipped)


def paged_to_rows(k_pages: torch.Tensor, block_table: torch.Tensor, lengths) -> list[torch.Tensor]:
    """The cache of each batch row, contiguous: k_pages [P, Hkv, page_size, D] (a page pool),
    block_table [B, max_pages] int (row b's i-th page), lengths [B] -> [Hkv, L_b, D] per row."""
    ps = k_pages.shape[2]
    rows = []
    for b, length in enumerate(int(x) for x in lengths):
        pages = block_table[b, : cdiv(length, ps)].long().to(k_pages.device)
        rows.append(k_pages[pages].transpose(0, 1).reshape(k_pages.shape[1], -1, k_pages.shape[3])[:, :length])
    return rows


def sparse_decode_ragged(q, k, v, lengths, scale: float, block_m: int, block_n: int, *,
                         block_table=None, **kw):
    """A decode step over a batch of different cache lengths, row by row through ``sparse_decode``:
    the semantics of the ragged and paged kernels (each row exactly as a batch of one of its length).

    q [B, H, 1, D]; lengths [B] (>= 1); k/v either contiguous [B, Hkv, Lmax, D] (row b's cache is
    its first L_b keys) or, with ``block_table`` [B, max_pages], page pools [P, Hkv, page_size, D]
    (paged_to_rows). kw: the method arguments of sparse_decode (thresholds, log_lambda, window,
    topk, order, softcap, decision). Returns (out [B, H, 1, D] in q.dtype, skipped [B, H] int64,
    v_skipped [B, Hkv] int64, reachable [B] int64)."""
    lens = [int(x) for x in lengths]
    if block_table is not None:
        ks, vs = paged_to_rows(k, block_table, lens), paged_to_rows(v, block_table, lens)
    else:
        ks, vs = [k[i, :, :n] for i, n in enumerate(lens)], [v[i, :, :n] for i, n in enumerate(lens)]
    outs, skipped, v_skipped, reach = [], [], [], []
    for i, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"every decode row needs at least one cached key, row {i} has {n}")
        o, c = sparse_decode(q[i:i + 1], ks[i][None], vs[i][None], scale, block_m, block_n, **kw)
        outs.append(o)
        skipped.append(c.skipped)
        v_skipped.append(c.v_skipped)
        reach.append(c.reachable)
    dev = q.device
    return (torch.cat(outs), torch.stack(skipped), torch.stack(v_skipped),
            torch.tensor(reach, dtype=torch.int64, device=dev))
