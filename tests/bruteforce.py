"""Test oracle: every DESIGN.md statistic computed from the full N x N score matrix in float64,
with plain Python loops over blocks and rows, straight from the definitions. Slow on purpose;
shares no code with kernels/ (only the definitions).

Soft-capping (Gemma 2): with softcap c > 0 every score s = scale * q.k is replaced by
c * tanh(s / c) before anything reads it, so every statistic is the uncapped definition applied to
the capped matrix; the Q-init estimate max_j scale * q . kb_j is capped the same way (tanh is
monotone: capping each product and taking the max is capping the max).

Shape legend: H query heads, Hkv KV heads, N tokens, D head dim, P = ceil(N/BM), Kb = ceil(N/BN).
"""
from __future__ import annotations

import math

import numpy as np
import torch

NEG = -math.inf


def capped(s, softcap):
    """c * tanh(s / c) of float64 scores (numpy or torch); s itself when softcap is 0 / None."""
    if not softcap:
        return s
    if isinstance(s, torch.Tensor):
        return softcap * torch.tanh(s / softcap)
    return softcap * np.tanh(np.asarray(s, np.float64) / softcap)


def near_tie_rows(q, k, scale, bn, softcap=0.0, tol=1e-4):
    """[H, N] bool: rows where some two block maxima of the (capped) float64 scores lie within tol,
    where t* (the two largest) or a rescale count (any two) may legitimately differ.
    q [1, H, N, D], k [1, Hkv, N, D] tensors."""
    group = q.shape[1] // k.shape[1]
    s = capped(scale * q[0].double() @ k[0].double().repeat_interleave(group, 0).transpose(1, 2), softcap)
    n = s.shape[-1]
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), NEG)
    s = torch.nn.functional.pad(s, (0, -n % bn), value=NEG)
    srt = s.view(s.shape[0], n, -1, bn).amax(-1).sort(dim=-1, descending=True).values
    a, b = srt[..., :-1], srt[..., 1:]
    return (torch.isfinite(b) & ((a - b) < tol)).any(-1)


def _blocks(i, n, bm, bn):
    """(rows, reachable blocks, candidate blocks) of query block i, from the definitions."""
    last_row = min((i + 1) * bm, n) - 1
    rows = list(range(i * bm, last_row + 1))
    kb = -(-n // bn)
    reach = [j for j in range(kb) if j * bn <= last_row]
    cand = [j for j in reach if (j + 1) * bn <= i * bm]
    return rows, reach, cand


def _order(name, reach, cand):
    diag = [j for j in reach if j not in cand]
    if name == "forward":
        return sorted(reach)
    if name == "reverse":
        return sorted(reach, reverse=True)
    rest = [j for j in sorted(cand) if j != 0]
    return [0] + [j for j in sorted(diag) if j != 0] + rest


def _rowmax_table(s, n, bn):
    """rm[r, j] = max of S over row r's visible keys in key block j (-inf if none visible)."""
    return np.stack([s[:, j * bn: min((j + 1) * bn, n)].max(1) for j in range(-(-n // bn))], 1)


def _scan(rm, rows, blocks_in_order):
    """Per-order gap per block and per-row first stabilization step."""
    gap = {j: NEG for j in blocks_in_order}
    tstar = {}
    for r in rows:
        final = max(rm[r, j] for j in blocks_in_order)
        running = NEG
        for step, j in enumerate(blocks_in_order):
            rm_rj = rm[r, j]
            running = max(running, rm_rj)
            if rm_rj > NEG:
                gap[j] = max(gap[j], rm_rj - running)
            if r not in tstar and running == final:
                tstar[r] = step
    return gap, tstar


def _rescales(rm, rows, seq, n_local, tol=1e-4):
    """Per row of one order: (rescales: steps after which the running max rose from a finite value,
    shortfall after the first block, shortfall after the first n_local blocks, near: some block max
    within tol of the running max before it, where a float32 count may differ)."""
    out = {}
    for r in rows:
        final = max(rm[r, j] for j in seq)
        running, count, near, after = NEG, 0, False, []
        for j in seq:
            x = rm[r, j]
            if x > NEG and running > NEG:
                count += x > running
                near |= abs(x - running) < tol
            running = max(running, x)
            after.append(running)
        out[r] = (count, final - after[0], final - after[n_local - 1], near)
    return out


def brute_force(q, k, v, scale, bm, bn, orders, decode_rows, softcap=0.0):
    """q [H, N, D], k/v [Hkv, N, D] numpy arrays; softcap c > 0 caps every score (module
    docstring). Returns a dict of float64 arrays shaped like the reference TileStats fields (-inf
    for unreachable tiles)."""
    h, n, _ = q.shape
    group = h // k.shape[0]
    p, kb = -(-n // bm), -(-n // bn)
    res = {
        "bmax": np.full((h, p, kb), NEG), "mass": np.zeros((h, p, kb)),
        "gap": np.full((h, len(orders), p, kb), NEG), "tstar_step": np.zeros((h, len(orders), n), int),
        "tstar_where": np.zeros((h, len(orders), n), int), "qinit_err": np.zeros((h, n)),
        "out": np.zeros(q.shape), "cand": np.zeros(p, int),
        "near_tie": np.zeros((h, n), bool), "rescales": np.zeros((h, len(orders), n), int),
        "shortfall": np.zeros((h, len(orders), 2, n)), "near_record": np.zeros((h, len(orders), n), bool),
    }
    for hh in range(h):
        kk, vv = k[hh // group].astype(np.float64), v[hh // group].astype(np.float64)
        s = capped(scale * q[hh].astype(np.float64) @ kk.T, softcap)
        s[np.triu_indices(n, 1)] = NEG
        prob = np.exp(s - s.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        res["out"][hh] = prob @ vv
        rm = _rowmax_table(s, n, bn)
        rep = []
        for j in range(kb):
            blk = kk[j * bn: min((j + 1) * bn, n)]
            rep.append(np.array([blk[np.argmax(np.abs(blk[:, d])), d] for d in range(blk.shape[1])]))
        for i in range(p):
            rows, reach, cand = _blocks(i, n, bm, bn)
            res["cand"][i] = len(cand)
            for j in reach:
                keys = range(j * bn, min((j + 1) * bn, n))
                res["bmax"][hh, i, j] = max(rm[r, j] for r in rows)
                res["mass"][hh, i, j] = np.mean([sum(prob[r, c] for c in keys) for r in rows])
            for o, name in enumerate(orders):
                seq = _order(name, reach, cand)
                gap, tstar = _scan(rm, rows, seq)
                for j, g in gap.items():
                    res["gap"][hh, o, i, j] = g
                for r, step in tstar.items():
                    j = seq[step]
                    res["tstar_step"][hh, o, r] = step
                    res["tstar_where"][hh, o, r] = 0 if j == 0 else (1 if j not in cand else 2)
                n_local = len({0} | {j for j in reach if j not in cand})  # the sink and the diagonal blocks
                for r, (count, first, local, near) in _rescales(rm, rows, seq, n_local).items():
                    res["rescales"][hh, o, r] = count
                    res["shortfall"][hh, o, :, r] = first, local
                    res["near_record"][hh, o, r] = near
            for r in rows:
                bm_r = sorted((rm[r, j] for j in reach), reverse=True)
                res["near_tie"][hh, r] = len(bm_r) > 1 and bm_r[0] - bm_r[1] < 1e-4
                m_init = max(scale * float(q[hh, r].astype(np.float64) @ rep[j]) for j in reach)
                res["qinit_err"][hh, r] = float(capped(m_init, softcap)) - s[r].max()
        res.setdefault("dec", []).append(_decode(rm, prob, n, bn, orders, decode_rows))
    res["dec_gap"] = np.stack([d[0] for d in res["dec"]])
    res["dec_mass"] = np.stack([d[1] for d in res["dec"]])
    return res


def _decode(rm, prob, n, bn, orders, decode_rows):
    """Decode-mode gaps of one head: each of the last rows alone is a block with BM = 1."""
    kb = -(-n // bn)
    first = max(n - decode_rows, 0)
    gap = np.full((len(orders), n - first, kb), NEG)
    mass = np.zeros((n - first, kb))
    for x, r in enumerate(range(first, n)):
        reach = [j for j in range(kb) if j * bn <= r]
        cand = [j for j in reach if (j + 1) * bn <= r]
        for j in reach:
            mass[x, j] = prob[r, j * bn: min((j + 1) * bn, n)].sum()
        for o, name in enumerate(orders):
            g, _ = _scan(rm, [r], _order(name, reach, cand))
            for j, val in g.items():
                gap[o, x, j] = val
    return gap, mass


def bsfa_thresholds(bmax_row, n_cand, k_values):
    """Per position: midpoint of the k-th and (k+1)-th largest candidate bmax, -inf if A <= k."""
    vals = sorted(bmax_row[:n_cand], reverse=True)
    return [NEG if n_cand <= k else (vals[k - 1] + vals[k]) / 2 for k in k_values]
