"""The Triton instrumented attention (kernels/triton_instrumented.py) against the plain-torch
reference, under TRITON_INTERPRET=1 on tiny shapes with fresh random inputs: every TileStats field
and every reduction, and a whole CLI capture with --backend triton against --backend reference."""
import json
import math

import pytest
import torch

from sparsecal.capture import resolve_backend
from sparsecal.errors import UserError
from sparsecal.kernels.config import StatsConfig
from sparsecal.kernels.reduce import reduce_tiles
from sparsecal.kernels.reference import instrumented_attention
from sparsecal.kernels.triton_instrumented import (instrumented_attention_triton, instrumented_capture_triton,
                                                   instrumented_forward)
from sparsecal.runstore import RunStore

from test_capture import cli, make_checkpoint, write_prompts

# the interpreter evaluates log2(0) and -inf - -inf on lanes that are masked afterwards
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                                        "ignore:invalid value:RuntimeWarning")
ALL = ("forward", "reverse", "sink_local")
CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype, orders)
    (1, 1, 1, 64, 32, 16, torch.float32, ALL),
    (70, 1, 4, 64, 32, 16, torch.bfloat16, ALL),
    (200, 2, 1, 128, 32, 16, torch.float16, ("reverse", "forward")),
    (333, 1, 4, 64, 32, 16, torch.float32, ALL),
    (150, 1, 4, 128, 32, 16, torch.bfloat16, ALL),
    (333, 1, 1, 64, 128, 64, torch.bfloat16, ALL),  # the default geometry
    (250, 1, 2, 64, 80, 48, torch.float32, ("sink_local",)),  # BM, BN not powers of two
]
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
    return int((torch.cdist(v[:, None], edges.double()[:, None]).amin(1) < tol).sum())


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


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-kv{c[1]}-g{c[2]}-D{c[3]}-{c[4]}x{c[5]}-{str(c[6])[6:]}-{len(c[7])}o")
def test_triton_matches_reference(case, seed):
    n, hkv, group, d, bm, bn, dtype, orders = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=orders, k_values=(1, 2, 4), decode_rows=40, raw=True)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    out, t = instrumented_attention_triton(q, k, v, scale, cfg)
    ref_out, r = instrumented_attention(q, k, v, scale, cfg)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref_out.double(), atol=OUT_TOL[dtype], rtol=OUT_RTOL[dtype])
    ties = near_tie_rows(q, k, scale, bn)
    assert ties.float().mean() < 0.05
    assert_tiles_match(t, r, ties, orders)
    assert_reductions_match(t, r, n, cfg, ties)


@pytest.mark.parametrize("case", [(1, 1, 1, 64, 32, 16, torch.float32, ALL, True),
                                  (150, 1, 2, 64, 32, 16, torch.bfloat16, ("sink_local", "forward"), False),
                                  (100, 1, 2, 128, 40, 24, torch.float16, ("reverse",), True)],
                         ids=lambda c: f"N{c[0]}-{c[4]}x{c[5]}-{len(c[7])}o")
def test_fused_reductions_equal_reduce_tiles(case, seed):
    """The two-pass capture path's in-kernel histograms and BSFA counts give exactly what reduce_tiles
    makes of TileStats."""
    n, hkv, group, d, bm, bn, dtype, orders, raw = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=orders, k_values=(1, 2, 4), decode_rows=40, raw=raw)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    out, tiles = instrumented_attention_triton(q, k, v, 0.125, cfg)
    want = reduce_tiles(tiles, n, cfg)
    out2, got = instrumented_capture_triton(q, k, v, 0.125, cfg, single_pass=False)  # two-pass path
    assert torch.equal(out, out2) and list(got) == list(want)
    for key, w in want.items():
        g = got[key]
        assert g.shape == w.shape, key
        if key.endswith("gap_mass") and not w.is_floating_point():  # reduce_tiles: integer zeros when empty
            assert not g.any() and not w.any()
        elif w.is_floating_point():
            assert g.dtype == w.dtype and torch.equal(torch.isinf(g), torch.isinf(w)), key
            torch.testing.assert_close(g[torch.isfinite(w)], w[torch.isfinite(w)], atol=1e-5, rtol=1e-5)
        else:
            assert g.dtype == w.dtype and torch.equal(g, w), key


def test_head_chunks_and_pass1_alone(seed):
    """A scratch budget of one head at a time gives the same statistics; pass 1 alone gives the
    same output, log-sum-exp and q-init error."""
    cfg = StatsConfig(block_m=32, block_n=16)
    q, k, v = make_qkv(seed, 90, 1, 3, 64, torch.float32)
    whole = instrumented_forward(q, k, v, 0.125, cfg)
    chunked = instrumented_forward(q, k, v, 0.125, cfg, scratch_bytes=1)
    fused = [instrumented_forward(q, k, v, 0.125, cfg, scratch_bytes=b, fused=True) for b in (None, 1)]
    assert torch.equal(fused[0].part, fused[1].part) and torch.equal(fused[0].gap, whole.gap)
    alone = instrumented_forward(q, k, v, 0.125, cfg, stats=False)
    for name in ("out", "lse", "qinit_err", "bmax", "mass", "gap", "tstar_step", "tstar_where", "tstar_norm"):
        assert torch.equal(getattr(whole, name), getattr(chunked, name)), name
    for name in ("out", "lse", "qinit_err"):
        assert torch.equal(getattr(whole, name), getattr(alone, name)), name
    assert alone.gap is None


def test_backend_resolution(monkeypatch):
    assert resolve_backend("auto", "cpu") == "reference"
    assert resolve_backend("reference", "cpu") == "reference"
    assert resolve_backend("triton", "cpu", 64) == "triton"  # TRITON_INTERPRET=1 in tests
    with pytest.raises(UserError, match="Unknown backend 'tpu'"):
        resolve_backend("tpu", "cpu")
    with pytest.raises(UserError, match="head dims"):
        resolve_backend("triton", "cpu", 80)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UserError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu", 64)


def test_cli_capture_triton_equals_reference(tmp_path, seed):
    model = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=1, head_dim=64, layers=2)
    # (N = 1 is covered above: its q-init error is exactly 0, a bin edge, where rounding decides the bin)
    prompts = write_prompts(tmp_path / "p.jsonl", [2, 70, 150], seed)
    runs = {}
    for backend in ("triton", "reference"):
        out = tmp_path / backend
        res = cli("capture", "--model", model, "--prompts-file", prompts, "--out", out, "--backend", backend,
                  "--block-m", 32, "--block-n", 16, "--k", "1,2,4", "--decode-rows", 40, "--raw")
        assert res.exit_code == 0, res.output
        runs[backend] = RunStore.open(out)
        assert runs[backend].manifest["backend"] == backend
    tri, ref = runs["triton"], runs["reference"]
    for rec in ref.manifest["samples"]:
        rt, a = tri.load_sample(rec["id"], raw=True)
        rr, b = ref.load_sample(rec["id"], raw=True)
        assert rt["backend"] == "triton" and rr["backend"] == "reference"
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].shape == b[key].shape, key
            if b[key].dtype != a[key].dtype:  # reduce_tiles gives integer zeros for empty mass histograms
                assert key.endswith("gap_mass") and not b[key].any() and not a[key].any(), key
                continue
            if a[key].is_floating_point():
                assert_same_floats(a[key], b[key], 2e-3 if key.startswith("raw") else 1e-4, key)
            else:  # counts: a value next to a bin edge (or a near tie) may move one bin
                diff = int((a[key].long() - b[key].long()).abs().sum())
                assert diff <= max(4, int(b[key].long().abs().sum()) // 100), (key, diff)
    assert json.loads((tri.root / "manifest.json").read_text())["config"] == ref.manifest["config"]
