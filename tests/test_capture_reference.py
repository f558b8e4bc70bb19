"""The plain-torch instrumented attention against the brute-force oracle (tests/bruteforce.py),
uncapped and with attention logit soft-capping."""
import math

import numpy as np
import pytest
import torch

from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.reduce_reference import reduce_tiles
from sparsecal.kernels.capture.reference import instrumented_attention

from bruteforce import brute_force, bsfa_thresholds
from helpers import block_counts_torch

CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype)
    (1, 1, 1, 64, 128, 64, torch.float32),
    (63, 1, 3, 128, 64, 64, torch.float32),
    (200, 2, 1, 64, 128, 64, torch.float16),
    (200, 1, 3, 128, 64, 64, torch.bfloat16),
    (700, 1, 3, 64, 128, 64, torch.float32),
    (700, 1, 1, 128, 64, 64, torch.float32),
    (333, 1, 3, 64, 64, 32, torch.float32),
    (250, 1, 2, 64, 80, 48, torch.float32),  # BM not a multiple of BN
    (300, 1, 2, 64, 128, 128, torch.float32),  # Model-Optimizer's tile: one diagonal tile per query block
]
ORDERS = ("forward", "reverse", "sink_local")


def make_qkv(seed, n, hkv, group, d, dtype):
    """Random inputs with some structure: a sink key and a recency bias, so gaps spread out."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hkv * group, n, d, generator=g) * 1.5
    k = torch.randn(1, hkv, n, d, generator=g)
    k[:, :, 0] += 2.0 * q[:, ::group].mean(2)  # key 0 aligned with the average query: a sink
    v = torch.randn(1, hkv, n, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def finite_close(a, b, atol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.array_equal(np.isneginf(a), np.isneginf(b))
    m = np.isfinite(b)
    np.testing.assert_allclose(a[m], b[m], atol=atol, rtol=1e-4)


SOFTCAP_CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype, softcap)
    (97, 1, 4, 64, 32, 16, torch.float32, 2.0),     # GQA 4 on one KV head (MQA)
    (70, 2, 2, 128, 32, 16, torch.float16, 3.0),
    (40, 1, 16, 256, 32, 16, torch.bfloat16, 2.5),  # D = 256, MQA with 16 query heads
]


def case_id(c):
    return f"N{c[0]}-kv{c[1]}-g{c[2]}-D{c[3]}-{c[4]}x{c[5]}-{str(c[6])[6:]}" + (f"-cap{c[7]}" if len(c) > 7 else "")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_matches_bruteforce(case, seed):
    check_against_bruteforce(case, seed)


@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=case_id)
def test_softcapped_reference_matches_bruteforce(case, seed):
    """Soft-capping: every output and statistic is the oracle's on the capped scores, and differs
    from the uncapped reference (the cap bites: scores well past it saturate)."""
    n, hkv, group, d, bm, bn, dtype, cap = case
    t = check_against_bruteforce(case[:7], seed, cap)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=ORDERS, k_values=(1, 2, 4), decode_rows=70, raw=True)
    _, plain = instrumented_attention(q, k, v, 1 / math.sqrt(d), cfg)
    fin = torch.isfinite(plain.bmax)
    assert float((plain.bmax[fin] - t.bmax[fin]).abs().max()) > 0.1
    assert float(t.bmax[fin].max()) < cap < float(plain.bmax[fin].max())
    assert float((plain.qinit_err - t.qinit_err).abs().max()) > 0.01


def test_softcap_off_and_errors(seed):
    """softcap 0 or None is exactly the uncapped computation; a negative or non-finite cap is refused."""
    q, k, v = make_qkv(seed, 50, 1, 2, 64, torch.float32)
    cfg = StatsConfig(block_m=32, block_n=16, decode_rows=8)
    out, t = instrumented_attention(q, k, v, 0.125, cfg)
    for off in (0, 0.0, None):
        o2, t2 = instrumented_attention(q, k, v, 0.125, cfg, softcap=off)
        assert torch.equal(out, o2) and torch.equal(t.gap, t2.gap) and torch.equal(t.qinit_err, t2.qinit_err)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="softcap"):
            instrumented_attention(q, k, v, 0.125, cfg, softcap=bad)


def check_against_bruteforce(case, seed, softcap=0.0):
    """The reference's output, TileStats and reductions against tests/bruteforce.py (both capped
    at ``softcap``); returns the reference TileStats."""
    n, hkv, group, d, bm, bn, dtype = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=ORDERS, k_values=(1, 2, 4), decode_rows=70, raw=True)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    out, t = instrumented_attention(q, k, v, scale, cfg, softcap=softcap)
    bf = brute_force(q[0].float().numpy(), k[0].float().numpy(), v[0].float().numpy(), scale, bm, bn, ORDERS, 70,
                     softcap=softcap)

    out_tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    np.testing.assert_allclose(out[0].float().numpy(), bf["out"], atol=out_tol, rtol=0)
    finite_close(t.bmax, bf["bmax"], 1e-4)
    finite_close(t.gap, bf["gap"], 1e-4)
    finite_close(t.dec_gap, bf["dec_gap"], 1e-4)
    np.testing.assert_allclose(t.mass.numpy(), bf["mass"], atol=1e-5)
    np.testing.assert_allclose(t.dec_mass.numpy(), bf["dec_mass"], atol=1e-5)
    np.testing.assert_allclose(t.qinit_err.numpy(), bf["qinit_err"], atol=1e-4)
    exact = ~bf["near_tie"][:, None, :].repeat(len(ORDERS), 1)  # t* exact except on (near) ties
    assert exact.mean() > 0.95
    assert np.array_equal(t.tstar_step.numpy()[exact], bf["tstar_step"][exact])
    assert np.array_equal(t.tstar_where.numpy()[exact], bf["tstar_where"][exact])
    check_rescales(t, bf)
    cand, _ = block_counts_torch(n, bm, bn)
    assert cand.tolist() == bf["cand"].tolist()
    check_reductions(reduce_tiles(t, n, cfg), bf, cfg, n)
    return t


def check_rescales(t, bf):
    """Rescales exact away from near records (a block max within 1e-4 of the running max before
    it); shortfall within float tolerance, +inf exactly where the oracle's is."""
    exact = ~bf["near_record"]
    assert exact.mean() > 0.95
    assert t.rescales.dtype == torch.int64 and t.rescales.shape == bf["rescales"].shape
    assert np.array_equal(t.rescales.numpy()[exact], bf["rescales"][exact])
    sf, want = t.shortfall.numpy().astype(np.float64), bf["shortfall"]
    assert sf.shape == want.shape and np.array_equal(np.isposinf(sf), np.isposinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(sf[fin], want[fin], atol=1e-4, rtol=1e-4)
    assert np.array_equal(sf[fin] == 0, want[fin] == 0)  # "already final" is exact


def edge_tolerant_hist_check(counts, values, edges, side="right"):
    """Histogram from the oracle's values; bins may differ only for values within 1e-4 of an edge
    (side "right": bucketize(right=True), "left": right=False)."""
    idx = np.searchsorted(edges, values, side=side)
    expect = np.bincount(idx, minlength=len(edges) + 1)
    near = np.min(np.abs(values[:, None] - edges[None, :]), axis=1) < 1e-4 if len(values) else []
    assert counts.sum() == len(values)
    assert np.abs(counts - expect).sum() <= 2 * int(np.sum(near))


def check_reductions(red, bf, cfg, n):
    h, o, p, kb = bf["gap"].shape
    cmask = np.arange(kb)[None, :] < bf["cand"][:, None]
    reach = block_counts_torch(n, cfg.block_m, cfg.block_n)[1].numpy()
    dmask = ~cmask & (np.arange(kb)[None, :] < reach[:, None])  # diagonal tiles A_i <= j < R_i
    dec_a = np.arange(max(n - 70, 0), n) // cfg.block_n  # decode row r: A = r // BN, diagonal j = A
    edges = cfg.gap_edges()
    for hh in range(h):
        for i in range(p):
            want = bsfa_thresholds(bf["bmax"][hh, i], bf["cand"][i], cfg.k_values)
            finite_close(red["bsfa_threshold"][hh, i], want, 1e-4)
            kept = red["bsfa_kept"][hh, i].numpy()
            assert np.all(kept >= np.minimum(cfg.k_values, bf["cand"][i]))
        for oo in range(o):
            edge_tolerant_hist_check(red["gap_count"][hh, oo].numpy(), bf["gap"][hh, oo][cmask], edges)
            mass_sum = bf["mass"][hh][cmask].sum()
            assert math.isclose(red["gap_mass"][hh, oo].sum().item(), mass_sum, abs_tol=1e-4)
            dcm = np.arange(kb)[None, :] < dec_a[:, None]
            edge_tolerant_hist_check(red["decode_gap_count"][hh, oo].numpy(), bf["dec_gap"][hh, oo][dcm], edges)
            edge_tolerant_hist_check(red["diag_gap_count"][hh, oo].numpy(), bf["gap"][hh, oo][dmask], edges)
            assert math.isclose(red["diag_gap_mass"][hh, oo].sum().item(), bf["mass"][hh][dmask].sum(), abs_tol=1e-4)
            ddm = np.arange(kb)[None, :] == dec_a[:, None]
            edge_tolerant_hist_check(red["decode_diag_gap_count"][hh, oo].numpy(), bf["dec_gap"][hh, oo][ddm], edges)
            assert math.isclose(red["decode_diag_gap_mass"][hh, oo].sum().item(), bf["dec_mass"][hh][ddm].sum(),
                                abs_tol=1e-4)
            assert red["tstar_where"][hh, oo].sum() == n
            assert red["tstar_hist"][hh, oo].sum() == n
            check_rescale_hist(red, bf, cfg, hh, oo)
    assert red["qinit_count"].sum() == h * n
    skipped_plus_kept = red["bsfa_skipped_mass"] >= 0
    assert bool(skipped_plus_kept.all())
    assert red["raw_bmax"].dtype == torch.float16


def check_rescale_hist(red, bf, cfg, hh, oo):
    """rescale_count / rescale_excess / shortfall_count of one (head, order) from the oracle's rows."""
    want = bf["rescales"][hh, oo]
    top = cfg.rescale_bins - 1
    near = int(bf["near_record"][hh, oo].sum())
    got = red["rescale_count"][hh, oo].numpy()
    assert np.abs(got - np.bincount(np.minimum(want, top), minlength=top + 1)).sum() <= 2 * near
    assert abs(int(red["rescale_excess"][hh, oo]) - int(np.maximum(want - top, 0).sum())) <= near
    for x in range(2):
        sf = bf["shortfall"][hh, oo, x]
        edge_tolerant_hist_check(red["shortfall_count"][hh, oo, x].numpy(), sf, cfg.shortfall_edges(), side="left")
        assert int(red["shortfall_count"][hh, oo, x, 0]) == int((sf == 0).sum())


def ridge_qkv(n, hkv, group, d, peak, seed):
    """Scores that rise block by block toward key ``peak`` and fall after it (plus noise): a row
    past the peak sets a new running max at every block up to it in forward order, at every
    block down to it in reverse order, and only among the later candidates in sink_local order."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n, dtype=torch.float32)
    k = 0.3 * torch.randn(1, hkv, n, d, generator=g) / math.sqrt(d)
    k[..., 0] += (-0.05 * (t - peak).abs())[None, None]
    q = 0.3 * torch.randn(1, hkv * group, n, d, generator=g) / math.sqrt(d)
    q[..., 0] += math.sqrt(d)  # scale * q . k ~ -0.05 |t - peak|
    return q, k, torch.randn(1, hkv, n, d, generator=g)


@pytest.mark.parametrize("n,bm,bn", [(333, 64, 32), (250, 80, 48)])
def test_rescales_and_shortfall_depend_on_the_order(n, bm, bn, seed):
    """Rescales and shortfall against the float64 oracle on a ridge input (GQA 3, ragged lengths),
    where the three orders differ in both, while the where-category shares agree."""
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=ORDERS, k_values=(1,), decode_rows=1, rescale_bins=3)
    q, k, v = ridge_qkv(n, 1, 3, 64, n // 3, seed)
    _, t = instrumented_attention(q, k, v, 0.125, cfg)
    bf = brute_force(q[0].numpy(), k[0].numpy(), v[0].numpy(), 0.125, bm, bn, ORDERS, 1)
    check_rescales(t, bf)
    red = reduce_tiles(t, n, cfg)
    for hh in range(3):
        for oo in range(3):
            check_rescale_hist(red, bf, cfg, hh, oo)
    assert red["rescale_excess"].sum() > 0  # some rows past the last bin: the excess keeps the mean
    mean = t.rescales.double().mean(dim=(0, 2))
    assert len({round(float(x), 3) for x in mean}) >= 2, mean
    local_mean = t.shortfall[:, :, 1].clamp(max=1e3).double().mean(dim=(0, 2))  # +inf: reverse rows seeing nothing
    assert len({round(float(x), 3) for x in local_mean}) == 3, local_mean
    late = torch.arange(n) >= n // 3 + 2 * bm  # rows well past the peak: the sink and local blocks miss it
    local = t.shortfall[:, :, 1, late]
    assert float((local[:, 2] > 0).float().mean()) > 0.5 and bool((local[:, 1] >= 0).all())
    assert torch.equal(red["tstar_where"][:, 0], red["tstar_where"][:, 1])


def test_thresholds_applied_back_keep_exactly_k(seed):
    """Thresholds of one sample applied back to it keep min(k, A_i) candidates (no ties here)."""
    n, cfg = 900, StatsConfig(block_m=64, block_n=32, k_values=(1, 3, 8, 40))
    q, k, v = make_qkv(seed, n, 1, 2, 64, torch.float32)
    _, t = instrumented_attention(q, k, v, 0.125, cfg)
    red = reduce_tiles(t, n, cfg)
    cand, _ = block_counts_torch(n, 64, 32)
    want = torch.minimum(torch.tensor(cfg.k_values)[None, :], cand[:, None])
    assert torch.equal(red["bsfa_kept"], want.expand_as(red["bsfa_kept"]))
    # -inf exactly where A_i <= k
    assert torch.equal(torch.isneginf(red["bsfa_threshold"][0]), cand[:, None] <= torch.tensor(cfg.k_values)[None, :])


def test_weighted_histogram_is_float_even_when_empty():
    from sparsecal.kernels.capture.reduce_reference import histogram

    edges = torch.tensor([-1.0, 0.0], dtype=torch.float64)
    empty = histogram(torch.zeros(2, 0), edges, torch.zeros(2, 0))
    assert empty.dtype == torch.float64 and empty.shape == (2, 3) and not empty.any()
    counts = histogram(torch.tensor([[-2.0, 0.5]]), edges)
    assert counts.dtype == torch.int64 and counts.tolist() == [[1, 0, 1]]


def diagonal_hist(gap, mass, blocks, edges):
    """Counts and masses [NG] of gap[x, j] (weights mass[x, j]) over the (x, j) pairs ``blocks``
    yields, binned as bucketize(right=True): bin k holds e_{k-1} <= gap < e_k."""
    vals = np.array([gap[x, j] for x, j in blocks], np.float64)
    w = np.array([mass[x, j] for x, j in blocks], np.float64)
    idx = np.searchsorted(edges, vals, side="right")
    return np.bincount(idx, minlength=len(edges) + 1), np.bincount(idx, weights=w, minlength=len(edges) + 1)


@pytest.mark.parametrize("n,hkv,group,bm,bn", [(1, 1, 1, 32, 16), (70, 1, 4, 32, 16), (250, 1, 2, 80, 48),
                                              (200, 2, 1, 64, 64), (300, 1, 2, 128, 128)],
                         ids=lambda x: str(x))
def test_diagonal_histograms_from_the_reference_gaps(n, hkv, group, bm, bn, seed):
    """diag_gap_* and decode_diag_gap_* of reduce_tiles equal the histograms of the reference's own
    gap tensors over the diagonal tiles, enumerated one by one from the geometry (prefill: key
    blocks (i * BM) // BN .. (last row of block i) // BN; decode row r: block r // BN), bit for bit
    in the counts; the candidate and diagonal histograms together hold every reachable tile."""
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=ORDERS, k_values=(1, 2), decode_rows=30)
    q, k, v = make_qkv(seed, n, hkv, group, 64, torch.float32)
    _, t = instrumented_attention(q, k, v, 0.125, cfg)
    red = reduce_tiles(t, n, cfg)
    edges = cfg.gap_edges()
    p = -(-n // bm)
    diag = [(i, j) for i in range(p) for j in range((i * bm) // bn, (min((i + 1) * bm, n) - 1) // bn + 1)]
    dec = [(x, int(r) // bn) for x, r in enumerate(t.dec_rows)]
    assert len(diag) >= p and len(dec) == min(30, n)
    gap, dgap = t.gap.double().numpy(), t.dec_gap.double().numpy()
    for hh in range(hkv * group):
        for oo in range(len(ORDERS)):
            for key, g, m, blocks in (("diag_", gap[hh, oo], t.mass[hh].numpy(), diag),
                                      ("decode_diag_", dgap[hh, oo], t.dec_mass[hh].numpy(), dec)):
                assert np.isfinite([g[x, j] for x, j in blocks]).all()  # every diagonal tile is seen
                count, mass = diagonal_hist(g, m, blocks, edges)
                assert np.array_equal(red[f"{key}gap_count"][hh, oo].numpy(), count), key
                np.testing.assert_allclose(red[f"{key}gap_mass"][hh, oo].numpy(), mass, atol=1e-6, rtol=1e-6)
            reachable = int(np.isfinite(gap[hh, oo]).sum())
            assert int(red["gap_count"][hh, oo].sum() + red["diag_gap_count"][hh, oo].sum()) == reachable
            total = red["gap_mass"][hh, oo].sum() + red["diag_gap_mass"][hh, oo].sum()
            assert math.isclose(float(total), p, rel_tol=1e-5)  # every query block's tiles sum to 1
