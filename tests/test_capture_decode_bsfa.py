"""The BSFA arrays capture stores for the retained mass at any threshold (bsfa_top_mass,
bsfa_cand_mass) and for decode rows calibrated as blocks of their own (decode_bsfa_*): the
plain-torch reduction (reduce_reference.bsfa_reduce / decode_bsfa_reduce of the reference's
TileStats) against a float64 brute force from the full score matrix, and both Triton capture paths
(the two-pass instrumented capture of three orders, the single-order capture) against the reference,
under TRITON_INTERPRET=1 on ragged lengths."""
import math

import numpy as np
import pytest
import torch

from sparsecal.formats.geometry import ORDERS
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.pipeline import capture_triton
from sparsecal.kernels.capture.reduce_reference import reduce_tiles
from sparsecal.kernels.capture.reference import instrumented_attention

from helpers import INTERPRETER_WARNINGS, assert_same_floats, make_qkv

pytestmark = INTERPRETER_WARNINGS
NEG = -math.inf
KEYS = ("threshold", "kept", "skipped_mass", "top_bmax", "top_mass", "cand_mass")


def _bsfa_rows(bmax, mass, cand, k_values, t_len):
    """One head's BSFA keys from block maxima and masses [X, Kb] (float64) and A [X], plain loops."""
    out = {key: [] for key in KEYS}
    for x, a in enumerate(cand):
        order = sorted(range(a), key=lambda j: -bmax[x, j])
        vals = [bmax[x, j] for j in order]
        thr = [NEG if a <= k else (vals[k - 1] + vals[k]) / 2 for k in k_values]
        out["threshold"].append(thr)
        out["kept"].append([a - sum(bmax[x, j] < t for j in range(a)) for t in thr])
        out["skipped_mass"].append([sum(mass[x, j] for j in range(a) if bmax[x, j] < t) for t in thr])
        out["top_bmax"].append((vals + [NEG] * t_len)[:t_len])
        out["top_mass"].append(([mass[x, j] for j in order] + [0.0] * t_len)[:t_len])
        out["cand_mass"].append(sum(mass[x, j] for j in range(a)))
    return {key: np.array(v, dtype=np.float64) for key, v in out.items()}


def brute_force_bsfa(q, k, scale, cfg):
    """{prefix + key: [H, X, ...]} of both prefixes ("bsfa_", "decode_bsfa_") in float64 from the
    full causal score matrix. q [H, N, D], k [Hkv, N, D] numpy."""
    h, n, _ = q.shape
    bm, bn, group = cfg.block_m, cfg.block_n, h // k.shape[0]
    p, kb = -(-n // bm), -(-n // bn)
    rows = list(range(max(n - cfg.decode_rows, 0), n))
    per_head = []
    for hh in range(h):
        s = scale * q[hh].astype(np.float64) @ k[hh // group].astype(np.float64).T
        s[np.triu_indices(n, 1)] = NEG
        prob = np.exp(s - s.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        rmax = np.full((n, kb), NEG)
        rmass = np.zeros((n, kb))
        for j in range(kb):
            rmax[:, j] = s[:, j * bn:(j + 1) * bn].max(1)
            rmass[:, j] = prob[:, j * bn:(j + 1) * bn].sum(1)
        bmax = np.stack([rmax[i * bm:(i + 1) * bm].max(0) for i in range(p)])
        mass = np.stack([rmass[i * bm:(i + 1) * bm].mean(0) for i in range(p)])
        cand = [i * bm // bn for i in range(p)]
        t_pre = max(1, min(cfg.top_count, max(cand)))
        t_dec = max(1, min(cfg.top_count, (n - 1) // bn))
        pre = _bsfa_rows(bmax, mass, cand, cfg.k_values, t_pre)
        dec = _bsfa_rows(rmax[rows], rmass[rows], [r // bn for r in rows], cfg.k_values, t_dec)
        per_head.append({**{f"bsfa_{x}": v for x, v in pre.items()}, **{f"decode_bsfa_{x}": v for x, v in dec.items()}})
    return {key: np.stack([d[key] for d in per_head]) for key in per_head[0]}


def check_bsfa_keys(got: dict, want: dict, atol: float = 1e-4) -> None:
    """The twelve BSFA keys: -inf patterns, floats within atol, kept counts exact, the masses of the
    sorted maxima compared as running sums (a near tie may swap two neighbours)."""
    for pre in ("bsfa_", "decode_bsfa_"):
        for key in KEYS:
            a, b = torch.as_tensor(got[pre + key]).double(), torch.as_tensor(want[pre + key]).double()
            assert a.shape == b.shape, (pre + key, a.shape, b.shape)
            if key in ("threshold", "top_bmax"):
                assert_same_floats(a, b, atol, pre + key)
            elif key == "kept":
                assert torch.equal(a, b), pre + key
            elif key == "top_mass":
                torch.testing.assert_close(a.cumsum(-1), b.cumsum(-1), atol=atol, rtol=atol)
            else:
                torch.testing.assert_close(a, b, atol=atol, rtol=atol)


CASES = [  # (N, KV heads, GQA group, D, BM, BN, decode rows)
    (150, 1, 4, 64, 32, 16, 40),    # decode rows over three key blocks, ragged
    (45, 2, 1, 64, 32, 16, 64),     # more decode rows than tokens: rows with A = 0, 1, 2
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-kv{c[1]}-g{c[2]}-R{c[6]}")
def test_reference_matches_bruteforce(case, seed):
    n, hkv, group, d, bm, bn, rows = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=("forward",), k_values=(1, 2, 4), decode_rows=rows)
    q, k, v = make_qkv(seed, n, hkv, group, d, torch.float32)
    scale = 1 / math.sqrt(d)
    _, t = instrumented_attention(q, k, v, scale, cfg)
    got = reduce_tiles(t, n, cfg)
    want = brute_force_bsfa(q[0].numpy(), k[0].numpy(), scale, cfg)
    check_bsfa_keys(got, want)
    assert got["decode_bsfa_threshold"].shape == (group * hkv, min(rows, n), 3)
    # the retained mass identity: a row's own top-k skipped mass = candidate mass - its kept tiles' mass
    kept = got["decode_bsfa_kept"]
    cum = torch.nn.functional.pad(got["decode_bsfa_top_mass"].double().cumsum(-1), (1, 0))
    fits = kept <= cum.shape[-1] - 1
    via_top = got["decode_bsfa_cand_mass"].double()[..., None] - cum.gather(-1, kept.clamp(max=cum.shape[-1] - 1))
    torch.testing.assert_close(via_top[fits], got["decode_bsfa_skipped_mass"].double()[fits], atol=1e-5, rtol=0)


TRITON_CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype, orders, decode rows)
    (150, 1, 4, 64, 32, 16, torch.bfloat16, ORDERS, 40),
    (131, 2, 1, 128, 32, 16, torch.float16, ("forward",), 50),
    (90, 1, 2, 64, 40, 24, torch.float32, ("reverse",), 64),
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: f"N{c[0]}-{str(c[6])[6:]}-{len(c[7])}o")
def test_triton_capture_matches_reference(case, seed):
    """capture_triton (two-pass for three orders, single-order for one) against reduce_tiles of the
    reference on the same inputs: the BSFA keys of the prefill tiles and of the decode rows."""
    n, hkv, group, d, bm, bn, dtype, orders, rows = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=orders, k_values=(1, 2, 4), decode_rows=rows)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    _, got = capture_triton(q, k, v, scale, cfg)
    _, t = instrumented_attention(q, k, v, scale, cfg)
    want = reduce_tiles(t, n, cfg)
    check_bsfa_keys(got, want)
    for key in got:
        if "bsfa_" in key:
            assert got[key].dtype == want[key].dtype, key
