"""The Triton instrumented attention (kernels/capture/instrumented.py) against the plain-torch
reference, under TRITON_INTERPRET=1 on tiny shapes with fresh random inputs: every TileStats field
and every reduction (uncapped and soft-capped; D 64/128/256, GQA 1-16, MQA), and a whole CLI
capture with --backend triton against --backend reference."""
import json
import math

import pytest
import torch

from sparsecal.capture.runner import resolve_backend
from sparsecal.formats.errors import UserError
from sparsecal.formats.run import RunStore
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.instrumented import (
    instrumented_attention_triton,
    instrumented_capture_triton,
    instrumented_forward,
)
from sparsecal.kernels.capture.pipeline import capture_triton
from sparsecal.kernels.capture.reduce_reference import reduce_tiles
from sparsecal.kernels.capture.reference import instrumented_attention

from bruteforce import near_tie_rows as capped_near_ties
from helpers import (
    INTERPRETER_WARNINGS,
    OUT_RTOL,
    OUT_TOL,
    as_torch,
    assert_reduced_match,
    assert_reductions_match,
    assert_same_floats,
    assert_tiles_match,
    cli,
    make_checkpoint,
    make_qkv,
    near_tie_rows,
    write_prompts,
)

pytestmark = INTERPRETER_WARNINGS
ALL = ("forward", "reverse", "sink_local")
CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype, orders)
    (1, 1, 1, 64, 32, 16, torch.float32, ALL),
    (70, 1, 4, 64, 32, 16, torch.bfloat16, ALL),
    (200, 2, 1, 128, 32, 16, torch.float16, ("reverse", "forward")),
    (100, 1, 4, 64, 32, 16, torch.float32, ALL),
    (100, 1, 4, 128, 32, 16, torch.bfloat16, ALL),
    (333, 1, 1, 64, 128, 64, torch.bfloat16, ALL),  # the default geometry
    (250, 1, 2, 64, 80, 48, torch.float32, ("sink_local",)),  # BM, BN not powers of two
]


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


SOFTCAP_CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype, orders, softcap; 0 = off)
    (70, 1, 4, 64, 32, 16, torch.bfloat16, ALL, 3.0),               # GQA 4 on one KV head (MQA)
    (40, 1, 16, 256, 32, 16, torch.float32, ("forward", "reverse"), 2.0),  # D = 256, MQA, group 16
    (40, 1, 2, 256, 32, 16, torch.float16, ALL, 0.0),               # D = 256 uncapped
]


@pytest.mark.parametrize("case", SOFTCAP_CASES,
                         ids=lambda c: f"N{c[0]}-kv{c[1]}-g{c[2]}-D{c[3]}-{str(c[6])[6:]}-{len(c[7])}o-cap{c[8]}")
def test_softcap_matches_reference(case, seed):
    """Soft-capped scores (cap applied before every max, softmax and statistic): the TileStats of
    instrumented_attention_triton against the capped reference, and (first case) the capture
    path's fused reductions (capture_triton, two-pass for two or three orders); a cap that bites
    changes the answer."""
    n, hkv, group, d, bm, bn, dtype, orders, cap = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=orders, k_values=(1, 2, 4), decode_rows=20, raw=True)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    out, t = instrumented_attention_triton(q, k, v, scale, cfg, softcap=cap)
    ref_out, r = instrumented_attention(q, k, v, scale, cfg, softcap=cap)
    torch.testing.assert_close(out.double(), ref_out.double(), atol=OUT_TOL[dtype], rtol=OUT_RTOL[dtype])
    ties = capped_near_ties(q, k, scale, bn, cap)
    assert ties.float().mean() < 0.05
    assert_tiles_match(t, r, ties, orders)
    assert_reductions_match(t, r, n, cfg, ties)
    if case == SOFTCAP_CASES[0]:  # the fused path: the same pass 1, histograms counted in pass 2
        out2, got = capture_triton(q, k, v, scale, cfg, softcap=cap)
        assert torch.equal(out, out2)
        assert_reduced_match(got, r, n, cfg, ties)
    if cap:
        plain_out, plain = instrumented_attention(q, k, v, scale, cfg)
        assert float((plain_out.double() - ref_out.double()).abs().max()) > 10 * OUT_TOL[dtype]
        fin = torch.isfinite(plain.bmax)
        assert float(t.bmax[fin].max()) < cap < float(plain.bmax[fin].max())


@pytest.mark.parametrize("case", [(1, 1, 1, 64, 32, 16, torch.float32, ALL, True),
                                  (110, 1, 2, 64, 32, 16, torch.bfloat16, ("sink_local", "forward"), False),
                                  (100, 1, 2, 128, 40, 24, torch.float16, ("reverse",), True),
                                  (200, 1, 2, 64, 128, 128, torch.float32, ALL, False, 4)],  # Model-Optimizer's tile
                         ids=lambda c: f"N{c[0]}-{c[4]}x{c[5]}-{len(c[7])}o")
def test_fused_reductions_equal_reduce_tiles(case, seed):
    """The two-pass capture path's in-kernel histograms and BSFA counts give exactly what reduce_tiles
    makes of TileStats, and match the reference's reductions (the diagonal-tile histograms too).
    A tenth case element is pass 2's tiles per chunk (4 at 128 x 128: the interpreter pays for every
    one of a chunk's tiles, and a block here has at most two)."""
    n, hkv, group, d, bm, bn, dtype, orders, raw, *tj = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=orders, k_values=(1, 2, 4), decode_rows=40, raw=raw)
    launch = {"tile_chunk": tj[0]} if tj else None
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    out, tiles = instrumented_attention_triton(q, k, v, 0.125, cfg, launch=launch)
    want = reduce_tiles(tiles, n, cfg)
    out2, got = instrumented_capture_triton(q, k, v, 0.125, cfg, launch=launch)  # two-pass path
    assert torch.equal(out, out2) and list(got) == list(want)
    assert_reduced_match(got, instrumented_attention(q, k, v, 0.125, cfg)[1], n, cfg, near_tie_rows(q, k, 0.125, bn))
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
    q, k, v = make_qkv(seed, 60, 1, 3, 64, torch.float32)
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
    model = make_checkpoint(tmp_path / "tiny", seed, heads=2, kv_heads=1, head_dim=64, layers=2)
    # (N = 1 is covered above: its q-init error is exactly 0, a bin edge, where rounding decides the bin)
    prompts = write_prompts(tmp_path / "p.jsonl", [2, 50, 90], seed)  # 90: ragged, decode rows < N
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
        a, b = as_torch(a), as_torch(b)
        assert rt["backend"] == "triton" and rr["backend"] == "reference"
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].shape == b[key].shape, key
            if b[key].dtype != a[key].dtype:  # reduce_tiles gives integer zeros for empty mass histograms
                assert key.endswith("gap_mass") and not b[key].any() and not a[key].any(), key
                continue
            if a[key].is_floating_point():
                assert_same_floats(a[key], b[key], 1e-4, key)  # raw_* (fp16): one storage step more
            else:  # counts: a value next to a bin edge (or a near tie) may move one bin
                diff = int((a[key].long() - b[key].long()).abs().sum())
                assert diff <= max(4, int(b[key].long().abs().sum()) // 100), (key, diff)
    assert json.loads((tri.root / "manifest.json").read_text())["config"] == ref.manifest["config"]
