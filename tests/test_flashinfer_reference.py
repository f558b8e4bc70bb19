"""The simulation of FlashInfer's Hopper skip-softmax prefill (kernels/sparse/flashinfer_reference.py)
against a row-by-row, tile-by-tile replay of the kernel's loop (running max and sums of processed
tiles only, float64 online softmax), plus the rule's edges: dense at factor 0, the first tile kept,
lambda > 1, rows past N, the count formula and the factor search."""
import math

import pytest
import torch

from sparsecal.kernels.sparse.flashinfer_reference import LOG2E, factor_for_share, simulate, step_kv_for

STEP_Q, STEP_KV, GROUPS = 8, 16, 2


def replay(q, k, v, factor, step_q=STEP_Q, step_kv=STEP_KV, groups=GROUPS):
    """The kernel's loop, one head, one 64-row step (here step_q rows) and one tile at a time.
    Returns (out [H, N, D] float64, kept {(h, t, j): bool}, total)."""
    heads, n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    scale_log2 = torch.tensor(scale, dtype=torch.float32) * torch.tensor(LOG2E, dtype=torch.float32)
    lam = torch.tensor(factor, dtype=torch.float32) / n
    cta = step_q * groups
    steps = -(-n // cta) * groups
    out = torch.zeros(heads, n, d, dtype=torch.float64)
    kept, total = {}, 0
    for h in range(heads):
        kh, vh = k[h // (heads // k.shape[0])].float(), v[h // (heads // k.shape[0])].float()
        for t in range(steps):
            tiles = ((t // groups + 1) * cta - 1) // step_kv + 1
            rows = range(t * step_q, (t + 1) * step_q)
            run = [None] * step_q
            acc = torch.zeros(step_q, d, dtype=torch.float64)
            den = torch.zeros(step_q, dtype=torch.float64)
            for j in range(tiles):
                total += 1
                scores, maxes = [], []
                for i, r in enumerate(rows):
                    qr = q[h, r].float() if r < n else torch.zeros(d)
                    cols = [c for c in range(j * step_kv, (j + 1) * step_kv) if c <= r]
                    s = torch.stack([qr @ kh[c] if c < n else torch.tensor(0.0) for c in cols]) if cols else None
                    scores.append((cols, s))
                    maxes.append(s.max() if cols else torch.tensor(-math.inf))
                if j > 0 and factor > 0:
                    votes = [bool(torch.exp2((maxes[i] - run[i]) * scale_log2) < lam) for i in range(step_q)]
                    if all(votes):
                        kept[(h, t, j)] = False
                        continue
                kept[(h, t, j)] = True
                for i, r in enumerate(rows):
                    old = run[i]
                    run[i] = maxes[i] if j == 0 else torch.maximum(run[i], maxes[i])
                    if j > 0 and r < n:  # rescale what the earlier tiles accumulated
                        corr = math.exp(scale * (float(old) - float(run[i])))
                        acc[i] *= corr
                        den[i] *= corr
                    cols, s = scores[i]
                    if r >= n or not cols:
                        continue
                    p = torch.exp(scale * (s.double() - float(run[i])))
                    acc[i] += p @ torch.stack([vh[c] for c in cols]).double()
                    den[i] += p.sum()
            for i, r in enumerate(rows):
                if r < n:
                    out[h, r] = acc[i] / den[i]
    return out, kept, total


def gqa_inputs(seed, h, hkv, n, d, dtype=torch.bfloat16, spread=3.0):
    """Random q, k, v with a per-key offset along a shared direction: tile maxima differ enough
    that any factor skips some tiles and keeps others."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d, generator=g)
    u /= u.norm()
    q = torch.randn(h, n, d, generator=g) + 2.0 * u
    bump = spread * torch.randn(hkv, n, 1, generator=g)
    k = torch.randn(hkv, n, d, generator=g) + bump * u
    v = torch.randn(hkv, n, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("n,h,hkv", [(37, 2, 1), (64, 2, 2), (100, 4, 2), (129, 3, 1)])
@pytest.mark.parametrize("share_of_n", [0.0, 0.05, 0.6, 2.5])
def test_matches_replay(seed, n, h, hkv, share_of_n):
    q, k, v = gqa_inputs(seed, h, hkv, n, 16)
    factor = share_of_n * n
    res = simulate(q, k, v, factor, step_q=STEP_Q, step_kv=STEP_KV, groups=GROUPS)
    out, kept, total = replay(q, k, v, factor)
    assert res.total == total
    assert res.skipped == sum(1 for x in kept.values() if not x)
    for (hh, t, j), x in kept.items():
        assert bool(res.kept[hh, t, j]) == x, (hh, t, j)
    torch.testing.assert_close(res.out.double(), out, atol=2e-5, rtol=2e-5)


def test_dense_is_causal_attention(seed):
    n, h, hkv, d = 150, 4, 2, 32
    q, k, v = gqa_inputs(seed, h, hkv, n, d, dtype=torch.float32)
    res = simulate(q, k, v, 0.0, step_q=STEP_Q, step_kv=STEP_KV)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), is_causal=True)
    assert res.skipped == 0
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)


def test_total_counts_every_step_of_a_cta(seed):
    """The two steps of a CTA walk the same tiles, up to the CTA's last row, past N too."""
    n = 70  # CTAs of 16 rows: 5 CTAs, 10 steps; the last CTA's rows 64..79 reach tile 79 // 16 = 4
    q, k, v = gqa_inputs(seed, 1, 1, n, 8)
    res = simulate(q, k, v, 0.5 * n, step_q=STEP_Q, step_kv=STEP_KV)
    assert res.total == sum(2 * (((c + 1) * 16 - 1) // 16 + 1) for c in range(5)) == 30
    assert res.kept.shape == (1, 10, 5)


def test_huge_factor_keeps_only_first_tiles_for_full_steps(seed):
    """lambda far above 1: every tile but a step's first is skipped, when no row lies past N."""
    n, d = 96, 16
    q, k, v = gqa_inputs(seed, 2, 1, n, d, dtype=torch.float32)
    res = simulate(q, k, v, 1e9, step_q=STEP_Q, step_kv=STEP_KV)
    assert bool(res.kept[:, :, 0].all())
    assert not bool(res.kept[:, :, 1:].any())
    s = (q @ k[0].T.unsqueeze(0)) / math.sqrt(d)
    row = torch.arange(n)
    first = (row[None, :] < STEP_KV) & (row[None, :] <= row[:, None])
    ref = torch.softmax(s.masked_fill(~first, -math.inf), dim=-1) @ v[0]
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)


def test_lambda_above_one_keeps_a_large_new_max():
    """Tile 1 raises every row's max by 2 (scaled): kept while ln(lambda) <= 2, skipped above."""
    d, n = 16, 32
    q = torch.zeros(1, n, d)
    q[0, :, 0] = 1.0
    k = torch.zeros(1, n, d)
    k[0, STEP_KV:, 0] = 2.0 * math.sqrt(d)  # scaled score 2 for keys of tile 1, 0 for tile 0
    v = torch.randn(1, n, d, generator=torch.Generator().manual_seed(0))
    for ln_lam, kept in [(1.9, True), (2.1, False)]:
        res = simulate(q, k, v, math.exp(ln_lam) * n, step_q=STEP_Q, step_kv=STEP_KV)
        assert bool(res.kept[0, 2, 1]) is kept and bool(res.kept[0, 3, 1]) is kept


def test_rows_past_n_veto_below_one(seed):
    """Rows past N score 0 on every key: with lambda < 1 a step holding them never skips."""
    n = 43  # the last step, rows 40..47, holds rows 43..47 past N
    q, k, v = gqa_inputs(seed, 1, 1, n, 16, spread=0.0)
    q = -q.abs() - 5.0  # every real score well below 0
    k = k.abs() + 1.0
    res = simulate(q, k, v, 0.99 * n, step_q=STEP_Q, step_kv=STEP_KV)
    assert res.kept.shape == (1, 6, 3) and bool(res.kept[0, 5].all())
    assert res.skipped > 0


def test_factor_for_share_hits_target(seed):
    n = 512
    q, k, v = gqa_inputs(seed, 2, 1, n, 16, spread=4.0)
    for target in (0.3, 0.6):
        factor, res = factor_for_share(q, k, v, target, step_q=STEP_Q, step_kv=STEP_KV)
        assert abs(res.share - target) < 0.05
        assert simulate(q, k, v, factor, step_q=STEP_Q, step_kv=STEP_KV, need_out=False).skipped == res.skipped


def test_step_kv_for():
    assert [step_kv_for(d) for d in (32, 64, 80, 128, 192, 256)] == [256, 256, 128, 128, 64, 64]


def test_rejects_bad_shapes():
    q = torch.zeros(3, 10, 8)
    with pytest.raises(ValueError):
        simulate(q, torch.zeros(2, 10, 8), torch.zeros(2, 10, 8), 1.0)
    with pytest.raises(ValueError):
        simulate(q, torch.zeros(1, 9, 8), torch.zeros(1, 9, 8), 1.0)
