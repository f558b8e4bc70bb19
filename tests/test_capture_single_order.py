"""The single-order Triton capture (kernels/capture/single_order.py) and its parts against the
plain-torch reference, under TRITON_INTERPRET=1 on tiny shapes with fresh random inputs: the mass
pass (kernels/capture/mass.py), the capture's reductions for each scan order (reduce_tiles of the
reference's TileStats), the torch.topk BSFA reduction against a full sort with ties, and a CLI
capture with --orders and --backend triton against --backend reference. Soft-capped cases run the
mass pass and the single-order capture on capped scores (D 64/256, MQA with group 16)."""
import math

import pytest
import torch

from sparsecal.formats.geometry import ORDERS
from sparsecal.formats.run import RunStore
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.mass import block_mass_triton
from sparsecal.kernels.capture.pipeline import capture_triton
from sparsecal.kernels.capture.reduce_reference import bsfa_reduce
from sparsecal.kernels.capture.reference import instrumented_attention

from bruteforce import capped
from bruteforce import near_tie_rows as capped_near_ties
from helpers import (
    INTERPRETER_WARNINGS,
    OUT_RTOL,
    OUT_TOL,
    as_torch,
    assert_reduced_match,
    assert_same_floats,
    assert_user_error,
    block_counts_torch,
    cli,
    make_checkpoint,
    make_qkv,
    near_tie_rows,
    write_prompts,
)

pytestmark = INTERPRETER_WARNINGS
MASS_CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype)
    (1, 1, 1, 64, 32, 16, torch.float32),
    (70, 1, 4, 64, 32, 16, torch.bfloat16),
    (131, 2, 1, 128, 32, 16, torch.float16),
    (90, 1, 4, 128, 40, 24, torch.float32),  # BM, BN not powers of two
    (45, 1, 1, 64, 128, 64, torch.bfloat16),  # the default geometry, one ragged block
]
CAPTURE_CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype, order)
    (70, 1, 4, 64, 32, 16, torch.bfloat16, "forward"),
    (100, 2, 1, 128, 32, 16, torch.float16, "reverse"),
    (90, 1, 2, 64, 40, 24, torch.float32, "sink_local"),
    (260, 1, 2, 64, 128, 128, torch.bfloat16, "sink_local"),  # Model-Optimizer's tile: block 0 diagonal for i = 0
]


SOFTCAP_CASES = [  # (N, KV heads, GQA group, D, BM, BN, dtype, order, softcap)
    (70, 1, 4, 64, 32, 16, torch.bfloat16, "reverse", 3.0),        # GQA 4 on one KV head (MQA)
    (40, 1, 16, 256, 32, 16, torch.float16, "sink_local", 2.0),    # D = 256, MQA, group 16
]


def reference_lse(q, k, scale, softcap=0.0):
    """[H, N] float64 log-sum-exp of each row's causal (capped) scores."""
    group = q.shape[1] // k.shape[1]
    s = capped(scale * q[0].double() @ k[0].double().repeat_interleave(group, 0).transpose(1, 2), softcap)
    n = s.shape[-1]
    return s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf")).logsumexp(-1)


@pytest.mark.parametrize("case", MASS_CASES, ids=lambda c: f"N{c[0]}-kv{c[1]}-g{c[2]}-D{c[3]}-{c[4]}x{c[5]}-{str(c[6])[6:]}")
def test_mass_matches_reference(case, seed):
    n, hkv, group, d, bm, bn, dtype = case
    cfg = StatsConfig(block_m=bm, block_n=bn, decode_rows=1)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    mass = block_mass_triton(q, k, reference_lse(q, k, scale).float(), scale, cfg)
    want = instrumented_attention(q, k, v, scale, cfg)[1].mass
    assert mass.dtype == torch.float32 and mass.shape == want.shape
    torch.testing.assert_close(mass, want, atol=1e-5, rtol=1e-4)
    _, reach = block_counts_torch(n, bm, bn)
    assert torch.allclose(mass.sum(-1), torch.ones(()), atol=1e-5)  # each query block's tiles sum to 1
    beyond = torch.arange(mass.shape[-1]) >= reach[:, None]
    assert not mass[:, beyond].any()


@pytest.mark.parametrize("case", CAPTURE_CASES, ids=lambda c: f"N{c[0]}-kv{c[1]}-g{c[2]}-D{c[3]}-{c[4]}x{c[5]}-{c[7]}")
def test_single_order_capture_matches_reference(case, seed):
    """The single-order path's reductions equal reduce_tiles of the reference's TileStats for the
    same one-order config (floats within tolerance; counts exact up to bin edges and near ties)."""
    n, hkv, group, d, bm, bn, dtype, order = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=(order,), k_values=(1, 2, 4), decode_rows=40, raw=True)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    out, got = capture_triton(q, k, v, scale, cfg)
    ref_out, r = instrumented_attention(q, k, v, scale, cfg)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref_out.double(), atol=OUT_TOL[dtype], rtol=OUT_RTOL[dtype])
    ties = near_tie_rows(q, k, scale, bn)
    assert ties.float().mean() < 0.05
    assert_reduced_match(got, r, n, cfg, ties)


@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=lambda c: f"N{c[0]}-g{c[2]}-D{c[3]}-{c[7]}-cap{c[8]}")
def test_softcap_single_order_matches_reference(case, seed):
    """Soft-capped scores: the mass pass (from the capped log-sum-exp) and the single-order
    capture's reductions against the capped reference; a cap that bites changes the mass."""
    n, hkv, group, d, bm, bn, dtype, order, cap = case
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=(order,), k_values=(1, 2, 4), decode_rows=20, raw=True)
    q, k, v = make_qkv(seed, n, hkv, group, d, dtype)
    scale = 1 / math.sqrt(d)
    ref_out, r = instrumented_attention(q, k, v, scale, cfg, softcap=cap)
    mass = block_mass_triton(q, k, reference_lse(q, k, scale, cap).float(), scale, cfg, softcap=cap)
    torch.testing.assert_close(mass, r.mass, atol=1e-5, rtol=1e-4)
    plain = instrumented_attention(q, k, v, scale, cfg)[1].mass  # the kernel is far from the uncapped mass
    assert float((plain - mass).abs().max()) > 0.01
    out, got = capture_triton(q, k, v, scale, cfg, softcap=cap)
    torch.testing.assert_close(out.double(), ref_out.double(), atol=OUT_TOL[dtype], rtol=OUT_RTOL[dtype])
    ties = capped_near_ties(q, k, scale, bn, cap)
    assert ties.float().mean() < 0.05
    assert_reduced_match(got, r, n, cfg, ties)


def test_softcap_errors(seed):
    """A negative or non-finite cap is refused by every Triton capture entry point."""
    q, k, v = make_qkv(seed, 8, 1, 1, 64, torch.float32)
    cfg = StatsConfig(block_m=32, block_n=16)
    one = StatsConfig(block_m=32, block_n=16, orders=("forward",))
    for fn in (lambda c: capture_triton(q, k, v, 0.125, cfg, softcap=c),
               lambda c: capture_triton(q, k, v, 0.125, one, softcap=c),
               lambda c: block_mass_triton(q, k, torch.zeros(1, 8), 0.125, cfg, softcap=c)):
        for bad in (-2.0, float("nan")):
            with pytest.raises(ValueError, match="softcap"):
                fn(bad)


def test_single_pass_needs_one_order(seed):
    q, k, v = make_qkv(seed, 8, 1, 1, 64, torch.float32)
    with pytest.raises(ValueError, match="one scan order"):
        capture_triton(q, k, v, 0.125, StatsConfig(block_m=32, block_n=16), single_pass=True)


def test_bsfa_topk_equals_full_sort_with_ties(seed):
    """bsfa_reduce (torch.topk) against the full-sort definition, on block maxima with many ties
    (a few distinct values, +-0.0) and every k/top setting shape: bit-identical values and counts."""
    g = torch.Generator().manual_seed(seed)
    for n, bm, bn, ks, top in ((1000, 128, 64, (4, 8, 16, 32, 64), 0), (333, 32, 16, (1, 2, 4), 3),
                               (250, 80, 48, (1, 8), 40), (40, 32, 16, (2,), 0)):
        cfg = StatsConfig(block_m=bm, block_n=bn, k_values=ks, top_bmax=top)
        cand, _ = block_counts_torch(n, bm, bn)
        p, kb = len(cand), -(-n // bn)
        bmax = torch.randint(-4, 4, (3, p, kb), generator=g).float() / 2
        bmax[..., 0] = torch.where(torch.rand(3, p, generator=g) < 0.5, 0.0, -0.0)
        mass = torch.rand(3, p, kb, generator=g)
        got = bsfa_reduce(bmax, mass, cand, cfg)
        cmask = torch.arange(kb) < cand[:, None]
        cb = bmax.masked_fill(~cmask, float("-inf"))
        vals = cb.sort(dim=-1, descending=True).values
        want_top = vals[..., :max(1, min(cfg.top_count, int(cand.max())))]
        assert torch.equal(got["bsfa_top_bmax"], want_top)
        for x, k in enumerate(ks):
            t = (vals[..., k - 1] + vals[..., k]) / 2 if k < kb else torch.full((3, p), float("-inf"))
            t = torch.where(cand > k, t, float("-inf"))
            below = cmask & (cb < t[..., None])
            assert torch.equal(got["bsfa_threshold"][..., x], t)
            assert torch.equal(got["bsfa_kept"][..., x], (cmask & ~below).sum(-1))
            assert torch.equal(got["bsfa_skipped_mass"][..., x], (mass * below).sum(-1))


def test_cli_single_order_capture(tmp_path, seed):
    """`sparsecal capture --orders reverse --backend triton` writes the run that --backend reference
    writes (one order everywhere), and an unknown order is one error line."""
    model = make_checkpoint(tmp_path / "tiny", seed, heads=2, kv_heads=1, head_dim=64, layers=2)
    prompts = write_prompts(tmp_path / "p.jsonl", [90], seed)
    runs = {}
    for backend in ("triton", "reference"):
        res = cli("capture", "--model", model, "--prompts-file", prompts, "--out", tmp_path / backend,
                  "--backend", backend, "--block-m", 32, "--block-n", 16, "--k", "1,2,4", "--decode-rows", 16,
                  "--orders", "reverse", "--raw")
        assert res.exit_code == 0, res.output
        runs[backend] = RunStore.open(tmp_path / backend)
        assert runs[backend].manifest["config"]["orders"] == ["reverse"]
    for rec in runs["reference"].manifest["samples"]:
        a = as_torch(runs["triton"].load_sample(rec["id"], raw=True)[1])
        b = as_torch(runs["reference"].load_sample(rec["id"], raw=True)[1])
        assert a.keys() == b.keys()
        assert a["gap_count"].shape[2] == 1 and a["raw_gap"].shape[2] == 1  # [L, H, O = 1, ...]
        for key in a:
            assert a[key].shape == b[key].shape, key
            if a[key].dtype != b[key].dtype:  # reduce_tiles: integer zeros for an empty mass histogram
                assert key.endswith("gap_mass") and not a[key].any() and not b[key].any(), key
            elif a[key].is_floating_point():
                assert_same_floats(a[key], b[key], 1e-4, key)  # raw_* (fp16): one storage step more
            else:  # counts: a value next to a bin edge (or a near tie) may move one bin
                diff = int((a[key].long() - b[key].long()).abs().sum())
                assert diff <= max(4, int(b[key].long().abs().sum()) // 100), (key, diff)
    bad = cli("capture", "--model", model, "--prompts-file", prompts, "--out", tmp_path / "bad", "--orders", "sideways")
    assert_user_error(bad, "Unknown scan order 'sideways'", ", ".join(sorted(ORDERS)))
    dup = cli("capture", "--model", model, "--prompts-file", prompts, "--out", tmp_path / "dup",
              "--orders", "forward,forward")
    assert_user_error(dup, "distinct scan orders")


def test_gpu_check_tolerances_follow_moved_counts_and_fp16_storage():
    """bench.check's criteria: a near-tie row carries its mass into the next bin (bin totals agree),
    raw tiles may differ by one fp16 step; a mass that leaves the histogram is still an error."""
    from sparsecal.bench.capture_single_order import reduced_errors

    want = {"gap_mass": torch.tensor([[0.5, 0.0, 0.5]]), "raw_bmax": torch.tensor([7.0], dtype=torch.float16)}
    moved = {"gap_mass": torch.tensor([[0.41, 0.09, 0.5]]), "raw_bmax": torch.tensor([7.0039], dtype=torch.float16)}
    assert all(e["within"] for e in reduced_errors(moved, want).values())
    lost = {"gap_mass": torch.tensor([[0.41, 0.0, 0.5]]), "raw_bmax": torch.tensor([7.02], dtype=torch.float16)}
    assert not any(e["within"] for e in reduced_errors(lost, want).values())
