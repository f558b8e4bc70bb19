"""Helpers shared by the test modules: tiny checkpoints and prompt files, the CLI runner, tolerances
and input builders of the kernel tests, and comparisons of captured statistics.

Every random draw takes a seed (the ``seed`` fixture of conftest.py, derived from the test's node
id) and uses its own generator; nothing here touches a global RNG.
"""
import json
from pathlib import Path

import numpy as np
import torch
from typer.testing import CliRunner

from sparsecal.cli import app
from sparsecal.formats.geometry import block_counts, cdiv
from sparsecal.kernels.capture.reduce_reference import reduce_tiles

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "data" / "fixture"                       # the committed fixture run (scripts/make-fixture)
CALIBRATION = ROOT / "data" / "calibration" / "smollm2-1k-8k"  # the committed SmolLM2 calibration


def block_counts_torch(n: int, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """geometry.block_counts as int64 tensors: (A_i candidates, reachable) [ceil(n/bm)]."""
    return tuple(torch.from_numpy(x) for x in block_counts(n, bm, bn))


def as_torch(arrays: dict) -> dict:
    """A run sample's numpy arrays (RunStore.load_sample) as tensors."""
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}


runner = CliRunner()


def make_checkpoint(path, seed, heads=4, kv_heads=2, head_dim=64, layers=3, context=512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=heads * head_dim, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=context)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def write_prompts(path, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for n in lengths:
            f.write(json.dumps({"input_ids": torch.randint(0, 300, (n,), generator=g).tolist()}) + "\n")
    return path


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, *needles):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def check_sample_tensors(t, n, cfg, layers, heads):
    t = as_torch(t)
    p, kb, o = cdiv(n, cfg.block_m), cdiv(n, cfg.block_n), len(cfg.orders)
    cand, reach = block_counts_torch(n, cfg.block_m, cfg.block_n)
    assert t["bsfa_threshold"].shape == (layers, heads, p, len(cfg.k_values))
    assert t["raw_bmax"].shape == (layers, heads, p, kb) and t["raw_gap"].shape == (layers, heads, o, p, kb)
    assert torch.equal(t["candidates"], cand) and torch.equal(t["reachable"], reach)
    # every candidate tile lands in exactly one gap bin, every row in one t* and one q-init bin
    assert (t["gap_count"].sum(-1) == int(cand.sum())).all()
    assert (t["tstar_where"].sum(-1) == n).all() and (t["tstar_hist"].sum(-1) == n).all()
    assert (t["qinit_count"].sum(-1) == n).all()
    rows = torch.arange(max(n - cfg.decode_rows, 0), n)
    assert (t["decode_gap_count"].sum(-1) == int((rows // cfg.block_n).sum())).all()
    # the mass of a query block's tiles sums to 1; candidates hold part of it
    cand_mass = t["gap_mass"].sum(-1)
    assert (cand_mass <= p + 1e-3).all() and (cand_mass >= 0).all()
    raw_mass = t["raw_mass"].float().sum(-1)
    assert torch.allclose(raw_mass, torch.ones_like(raw_mass), atol=1e-2)
    assert torch.equal(t["bsfa_kept"], torch.minimum(torch.tensor(cfg.k_values), cand[:, None]).expand_as(t["bsfa_kept"]).int())


OUT_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


# plus one rounding step of the output dtype (two kernels may round a large output differently)
OUT_RTOL = {torch.float32: 0.0, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def make_qkv(seed, n, hkv, group, d, dtype):
    """Random inputs with a sink key and spread-out gaps (as tests/test_reference.py draws them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hkv * group, n, d, generator=g) * 1.5
    k = torch.randn(1, hkv, n, d, generator=g)
    k[:, :, 0] += 2.0 * q[:, ::group].mean(2)
    v = torch.randn(1, hkv, n, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def near_tie_rows(q, k, scale, bn, tol=1e-4):
    """[H, N] rows whose two largest block maxima (float64 scores) lie within tol: t* may differ."""
    group = q.shape[1] // k.shape[1]
    s = scale * q[0].double() @ k[0].double().repeat_interleave(group, 0).transpose(1, 2)
    n = s.shape[-1]
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    pad = -n % bn
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
    bmax = s.view(s.shape[0], n, -1, bn).amax(-1)
    top = bmax.topk(min(2, bmax.shape[-1]), dim=-1).values
    if top.shape[-1] < 2:
        return torch.zeros(s.shape[:2], dtype=torch.bool)
    return (top[..., 0] - top[..., 1]) < tol


def assert_same_floats(a, b, atol, name):
    a, b = a.double(), b.double()
    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), f"{name}: -inf pattern differs"
    m = torch.isfinite(b)
    assert torch.isfinite(a[m]).all(), f"{name}: non-finite values"
    torch.testing.assert_close(a[m], b[m], atol=atol, rtol=1e-4, msg=lambda s: f"{name}: {s}")


def assert_tiles_match(t, r, ties, orders):
    for name in ("bmax", "gap", "dec_gap"):
        assert_same_floats(getattr(t, name), getattr(r, name), 1e-4, name)
    for name in ("mass", "dec_mass"):
        torch.testing.assert_close(getattr(t, name), getattr(r, name), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(t.qinit_err, r.qinit_err, atol=1e-4, rtol=1e-4)
    assert torch.equal(t.dec_rows, r.dec_rows)
    exact = ~ties[:, None, :].expand(-1, len(orders), -1)
    for name in ("tstar_step", "tstar_where", "tstar_norm"):
        a, b = getattr(t, name), getattr(r, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a[exact], b[exact]), f"{name} differs away from ties"


def hist_slack(values, edges, tol=1e-4):
    """How many values lie within tol of a bin edge (each may land one bin over)."""
    v = values[torch.isfinite(values)].double().flatten()
    if not v.numel():
        return 0
    return int((torch.cdist(v[:, None], torch.as_tensor(edges).double()[:, None]).amin(1) < tol).sum())


def assert_reductions_match(t, r, n, cfg, ties):
    assert_reduced_match(reduce_tiles(t, n, cfg), r, n, cfg, ties)


def assert_reduced_match(a, r, n, cfg, ties):
    """a: a capture path's reductions; r: the reference TileStats (reduce_tiles gives the oracle).
    Floats within tolerance; counts exact except values next to a bin edge or rows at a near tie."""
    b = reduce_tiles(r, n, cfg)
    assert list(a) == list(b)
    for k in a:  # reduce_tiles gives integer zeros for an empty mass histogram
        assert a[k].shape == b[k].shape, k
        assert a[k].dtype == b[k].dtype or (k.endswith("gap_mass") and not a[k].any() and not b[k].any()), k
    for k in ("raw_bmax", "raw_gap", "raw_mass"):
        if k in b:
            assert_same_floats(a[k], b[k], 2e-3, k)
    assert_same_floats(a["bsfa_threshold"], b["bsfa_threshold"], 1e-4, "bsfa_threshold")
    assert_same_floats(a["bsfa_top_bmax"], b["bsfa_top_bmax"], 1e-4, "bsfa_top_bmax")
    assert torch.equal(a["bsfa_kept"], b["bsfa_kept"])
    torch.testing.assert_close(a["bsfa_skipped_mass"], b["bsfa_skipped_mass"], atol=1e-4, rtol=1e-4)
    edges = cfg.gap_edges()
    for prefix, gap in (("", r.gap), ("decode_", r.dec_gap)):
        slack = hist_slack(gap, edges)
        ca, cb = a[f"{prefix}gap_count"], b[f"{prefix}gap_count"]
        assert torch.equal(ca.sum(-1), cb.sum(-1)) and int((ca - cb).abs().sum()) <= 2 * slack
        torch.testing.assert_close(a[f"{prefix}gap_mass"].double().sum(-1), b[f"{prefix}gap_mass"].double().sum(-1),
                                   atol=1e-4, rtol=1e-4)
    n_ties = int(ties.sum()) * len(cfg.orders)
    for k in ("tstar_where", "tstar_hist"):
        assert int((a[k] - b[k]).abs().sum()) <= 2 * n_ties, k
    slack = hist_slack(r.qinit_err, cfg.qinit_edges())
    assert int((a["qinit_count"] - b["qinit_count"]).abs().sum()) <= 2 * slack


TOL = {torch.float32: (2e-4, 1e-4), torch.bfloat16: (3e-2, 1e-2), torch.float16: (4e-3, 2e-3)}  # atol, rtol


def sparse_inputs(seed, b, n, h, hkv, d, dtype):
    """Attention with a sink (key 0) and a strong diagonal (each key resembles its own query
    group's query), so tiles far below the running max exist in every scan order."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d, generator=g)
    u /= u.norm()
    base = torch.randn(b, hkv, n, d, generator=g)
    q = base.repeat_interleave(h // hkv, dim=1) + 0.5 * torch.randn(b, h, n, d, generator=g) + 3.0 * u
    k = base + 0.5 * torch.randn(b, hkv, n, d, generator=g)
    k[:, :, 0] = 6.0 * d ** 0.5 * u
    v = torch.randn(b, hkv, n, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)
