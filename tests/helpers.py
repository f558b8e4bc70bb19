"""Helpers shared by the test modules: tiny checkpoints and prompt files, the CLI runner, tolerances
and input builders of the kernel tests, and comparisons of captured statistics.

Every random draw takes a seed (the ``seed`` fixture of conftest.py, derived from the test's node
id) and uses its own generator; nothing here touches a global RNG.
"""
import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from typer.testing import CliRunner

from sparsecal.cli import app
from sparsecal.formats import dispatch as D
from sparsecal.formats.exports import write_blasst
from sparsecal.formats.geometry import block_counts, cdiv
from sparsecal.integrations.exports import write_bsfa
from sparsecal.kernels.capture.reduce_reference import group_gap, reduce_tiles

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "data" / "fixture"                       # the committed fixture run (scripts/make-fixture)
# the Triton interpreter evaluates log2(0) and -inf - -inf on lanes that are masked afterwards
INTERPRETER_WARNINGS = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                                                  "ignore:invalid value:RuntimeWarning")
CALIBRATION = ROOT / "data" / "calibration" / "smollm2-1k-8k"  # the committed SmolLM2 calibration


def block_counts_torch(n: int, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """geometry.block_counts as int64 tensors: (A_i candidates, reachable) [ceil(n/bm)]."""
    return tuple(torch.from_numpy(x) for x in block_counts(n, bm, bn))


def as_torch(arrays: dict) -> dict:
    """A run sample's numpy arrays (RunStore.load_sample) as tensors."""
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}


runner = CliRunner()

# A BLASST factor that skips nothing: an export holds a finite positive factor (lambda = factor / L),
# and ln(1e-30 / L) < -69 skips only a tile e^69 below the running max, whose weight an fp32 softmax
# rounds to nothing anyway; the scores of a tiny random Llama are O(1), so no tile is that far below.
NOOP_BLASST_FACTOR = 1e-30


def make_checkpoint(path, seed, heads=4, kv_heads=2, head_dim=64, layers=3, context=512, vocab_size=300):
    """A random-weight Llama saved under path: a deterministic function of seed.

    transformers initialises the weights from torch's global generator (no generator argument), so
    the construction runs inside torch.random.fork_rng: seeded there, and the global state is
    restored afterwards, so no other draw in the process sees (or depends on) this one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=heads * head_dim, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=context)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
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
    assert (t["qinit_count"].sum(-1) == n).all() and (t["joint_count"].sum(-1) == n).all()
    assert t["joint_count"].shape == t["qinit_count"].shape
    assert (t["rescale_count"].sum(-1) == n).all() and (t["shortfall_count"].sum(-1) == n).all()
    assert t["rescale_excess"].shape == (layers, heads, o) and (t["rescale_excess"] >= 0).all()
    rows = torch.arange(max(n - cfg.decode_rows, 0), n)
    assert (t["decode_gap_count"].sum(-1) == int((rows // cfg.block_n).sum())).all()
    # and every diagonal tile (A_i <= j < R_i; a decode row's own block) in one diagonal gap bin
    assert (t["diag_gap_count"].sum(-1) == int((reach - cand).sum())).all()
    assert (t["decode_diag_gap_count"].sum(-1) == len(rows)).all()
    assert ((t["gap_mass"] + t["diag_gap_mass"]).sum(-1) - p).abs().max() < 1e-3  # a block's tiles sum to 1
    assert ((t["decode_gap_mass"] + t["decode_diag_gap_mass"]).sum(-1) - len(rows)).abs().max() < 1e-3
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


def near_pairs(bmax, tol=1e-4):
    """[H, N] rows of per-row block maxima bmax [H, N, Kb] (-inf where unseen) where some two
    finite ones lie within tol: t*, a rescale count or the shortfall's zero may differ there."""
    srt = bmax.sort(dim=-1, descending=True).values
    a, b = srt[..., :-1], srt[..., 1:]
    return (torch.isfinite(b) & ((a - b) < tol)).any(-1)


def near_tie_rows(q, k, scale, bn, tol=1e-4):
    """[H, N] rows where some two block maxima (float64 scores) lie within tol (the two largest:
    t* may differ; any two: a rescale may be counted or not)."""
    group = q.shape[1] // k.shape[1]
    s = scale * q[0].double() @ k[0].double().repeat_interleave(group, 0).transpose(1, 2)
    n = s.shape[-1]
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    pad = -n % bn
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
    return near_pairs(s.view(s.shape[0], n, -1, bn).amax(-1), tol)


def storage_step(x, dtype):
    """One rounding step of a float dtype at the magnitude of x (float64): the spacing of dtype's
    values in x's binade (subnormals included), e.g. 2**-8 for float16 values in [4, 8)."""
    fi = torch.finfo(dtype)
    _, e = torch.frexp(x.abs().clamp(min=fi.smallest_normal))
    return fi.eps * torch.pow(2.0, (e - 1).double())


def assert_same_floats(a, b, atol, name, rtol=1e-4):
    """Same -inf pattern, finite values within atol + rtol * |b|. A 16-bit stored value (fp16/bf16,
    as the raw_* fields are) may also sit one rounding step of its dtype away: two computations a
    hair apart in fp32 can round to neighbouring values, one step apart, at any magnitude."""
    stored = a.dtype if a.dtype in (torch.float16, torch.bfloat16) else None
    a, b = a.double(), b.double()
    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), f"{name}: -inf pattern differs"
    m = torch.isfinite(b)
    assert torch.isfinite(a[m]).all(), f"{name}: non-finite values"
    a, b = a[m], b[m]
    allowed = atol + rtol * b.abs()
    if stored is not None:
        allowed = allowed + storage_step(torch.maximum(a.abs(), b.abs()), stored)
    diff = (a - b).abs()
    bad = diff > allowed
    if bad.any():
        i = int(torch.argmax(torch.where(bad, diff - allowed, torch.zeros_like(diff))))
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.numel()} values differ beyond tolerance; worst "
                             f"{float(a[i])} vs {float(b[i])} (abs diff {float(diff[i]):.3g}, allowed "
                             f"{float(allowed[i]):.3g}{'' if stored is None else f' incl. one {stored} step'})")


def assert_tiles_match(t, r, ties, orders):
    for name in ("bmax", "gap", "dec_gap"):
        assert_same_floats(getattr(t, name), getattr(r, name), 1e-4, name)
    for name in ("mass", "dec_mass"):
        torch.testing.assert_close(getattr(t, name), getattr(r, name), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(t.qinit_err, r.qinit_err, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(t.joint_err, r.joint_err, atol=1e-4, rtol=1e-4)
    assert torch.equal(t.dec_rows, r.dec_rows)
    exact = ~ties[:, None, :].expand(-1, len(orders), -1)
    for name in ("tstar_step", "tstar_where", "tstar_norm", "rescales"):
        a, b = getattr(t, name), getattr(r, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a[exact], b[exact]), f"{name} differs away from ties"
    assert t.shortfall.shape == r.shortfall.shape and t.shortfall.dtype == r.shortfall.dtype
    sf, want = t.shortfall.double(), r.shortfall.double()
    assert torch.equal(torch.isposinf(sf), torch.isposinf(want)), "shortfall: +inf pattern differs"
    fin = torch.isfinite(want)
    torch.testing.assert_close(sf[fin], want[fin], atol=1e-4, rtol=1e-4)
    zero = exact[:, :, None, :].expand_as(want)
    assert torch.equal(sf[zero] == 0, want[zero] == 0), "shortfall: already-final rows differ away from ties"


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
    for k, atol in (("raw_bmax", 1e-4), ("raw_gap", 1e-4), ("raw_mass", 1e-5)):  # the fp32 tolerances of
        if k in b:                                                                # assert_tiles_match, then
            assert_same_floats(a[k], b[k], atol, k)                               # one fp16 storage step
    for pre in ("bsfa_", "decode_bsfa_"):  # prefill tiles, then the decode rows (each its own block)
        assert_same_floats(a[f"{pre}threshold"], b[f"{pre}threshold"], 1e-4, f"{pre}threshold")
        assert_same_floats(a[f"{pre}top_bmax"], b[f"{pre}top_bmax"], 1e-4, f"{pre}top_bmax")
        assert torch.equal(a[f"{pre}kept"], b[f"{pre}kept"]), pre
        for key in ("skipped_mass", "cand_mass"):
            torch.testing.assert_close(a[pre + key], b[pre + key], atol=1e-4, rtol=1e-4)
        # masses of the sorted maxima: a near tie may swap two neighbours, so compare running sums
        torch.testing.assert_close(a[f"{pre}top_mass"].double().cumsum(-1), b[f"{pre}top_mass"].double().cumsum(-1),
                                   atol=1e-4, rtol=1e-4)
    edges = cfg.gap_edges()
    group = group_gap(r.dec_gap, r.group)
    for prefix, gap in (("", r.gap), ("decode_", r.dec_gap), ("diag_", r.gap), ("decode_diag_", r.dec_gap),
                        ("decode_group_", group)):
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
    assert_joint_match(a["joint_count"], b["joint_count"], r.joint_err, cfg, ties)
    assert int((a["rescale_count"] - b["rescale_count"]).abs().sum()) <= 2 * n_ties
    assert int((a["rescale_excess"] - b["rescale_excess"]).abs().sum()) <= n_ties
    sc_a, sc_b = a["shortfall_count"], b["shortfall_count"]
    assert torch.equal(sc_a.sum(-1), sc_b.sum(-1)), "shortfall_count: rows per (head, order, prefix)"
    slack = hist_slack(r.shortfall, cfg.shortfall_edges()) + 2 * n_ties  # edges, and 0 vs > 0 at ties
    assert int((sc_a - sc_b).abs().sum()) <= 2 * slack


def assert_joint_match(got, want, joint_err, cfg, ties):
    """VFA's joint statistic histograms [H, NQ]: every row counted once, and no row in another bin
    than the reference's except a value next to a bin edge or a row at a near tie. Exact zeros
    (the row max in block 0 or a diagonal block, the q-init estimate no higher) sit on the edge 0
    in both paths, so they give no slack."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.sum(-1), want.sum(-1)), "joint_count: rows per head"
    slack = hist_slack(joint_err[joint_err != 0], cfg.qinit_edges()) + int(ties.sum())
    assert int((got - want).abs().sum()) <= 2 * slack, "joint_count"


TOL = {torch.float32: (2e-4, 1e-4), torch.bfloat16: (3e-2, 1e-2), torch.float16: (4e-3, 2e-3)}  # atol, rtol


SINK = 6.0  # the sink key's scaled score, for every query row


def far_bound(d: int) -> float:
    """How far (scaled) below zero the planted far keys score: FAR = 4 M + 4 with M = max(R, SINK)
    and R = sqrt(d) the bound on every other score (see sparse_inputs), so a far tile sits at least
    4 below any gap or block max of an ordinary tile, whatever the draw."""
    r = d ** 0.5
    return 4.0 * max(r, SINK) + 4.0


def sparse_inputs(seed, b, n, h, hkv, d, dtype, bm, bn):
    """Attention inputs whose candidate tiles include planted far tiles that every BSFA threshold
    and BLASST ln(lambda) of cut_point skips, in every scan order, by construction.

    Per sequence and KV head, with u a random unit direction and every random part w orthogonal to
    u and of norm exactly sqrt(d) (so |w . w'| <= d, Cauchy-Schwarz):
        query   2 u + w_q          w_q, w_k share a per-position base: a strong diagonal
        key     w_k                scaled score in [-R, R], R = sqrt(d) (typically N(0, 1))
        key 0   s u                the sink: scores SINK for every row
        far     w_k - f u          every key of a far block: scores within R of -FAR (far_bound)
    Far blocks (random, and always the first eligible one) are never block 0 and never the first
    diagonal block A_i of a query block nor the decode row's block (N - 1) // BN, so every row has
    seen an ordinary key (>= -R) before it reaches a far candidate tile in every scan order: the
    tile's gap is <= 2 R - FAR and its max <= R - FAR, at least 4 below any ordinary tile's
    (gap >= -R - max(R, SINK), max >= -R), up to the dtype's rounding of the inputs (< 0.1).

    Returns q [B, H, N, D], k/v [B, Hkv, N, D] in dtype, far [B, Hkv, Kb] bool.
    """
    g = torch.Generator().manual_seed(seed)
    kb, group = cdiv(n, bn), h // hkv
    u = torch.randn(b, hkv, 1, d, generator=g)
    u /= u.norm(dim=-1, keepdim=True)

    def orth(x, uu):  # x without its component along uu, rescaled to norm sqrt(d)
        x = x - (x * uu).sum(-1, keepdim=True) * uu
        return x * (d ** 0.5 / x.norm(dim=-1, keepdim=True))

    base = torch.randn(b, hkv, 1, n, d, generator=g)
    uq = u[:, :, None]                                                    # [B, Hkv, 1, 1, D]
    wq = orth(base + 0.5 * torch.randn(b, hkv, group, n, d, generator=g), uq)  # [B, Hkv, G, N, D]
    q = (2.0 * uq + wq).reshape(b, h, n, d)
    k = orth(base[:, :, 0] + 0.5 * torch.randn(b, hkv, n, d, generator=g), u)
    k[:, :, 0] = (SINK * d ** 0.5 / 2.0) * u[:, :, 0]
    eligible = torch.ones(kb, dtype=torch.bool)
    eligible[0] = False
    eligible[torch.arange(cdiv(n, bm)) * bm // bn] = False  # A_i: the first diagonal block of query block i
    eligible[(n - 1) // bn] = False                          # the decode row's own block
    far = eligible & (torch.rand(b, hkv, kb, generator=g) < 1 / 3)
    if eligible.any():
        far[..., int(eligible.nonzero()[0])] = True
    far_keys = far.repeat_interleave(bn, dim=-1)[..., :n]    # [B, Hkv, N]
    k = torch.where(far_keys[..., None], k - (far_bound(d) * d ** 0.5 / 2.0) * u, k)
    v = torch.randn(b, hkv, n, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), far


def cut_point(values, floor=-math.inf, min_margin=0.01):
    """A cut c > floor among decision values (1-D: tile maxima for BSFA, tile gaps for BLASST): the
    midpoint of the widest gap between consecutive sorted values in the middle half of those above
    floor, so part of them fall below c and every value lies at least min_margin / 2 from c (the
    kernels and the reference compute scores a few float32 ulps apart: no decision can flip). When
    the middle half has no gap that wide (ties), the widest gap of [floor, values]; with no value
    above floor, floor + 1. Values at or below floor (the planted far tiles) always fall below c."""
    v = values[values > floor].double().sort().values
    if not v.numel():
        return floor + 1.0 if math.isfinite(floor) else 0.0

    def widest(w):
        if w.numel() < 2:
            return 0.0, None
        gaps = w[1:] - w[:-1]
        i = int(gaps.argmax())
        return float(gaps[i]), float((w[i] + w[i + 1]) / 2)

    m = v.numel()
    gap, c = widest(v[(m - 1) // 4: -(-3 * (m - 1) // 4) + 1])
    if gap < min_margin and math.isfinite(floor):
        gap, c = widest(torch.cat([v.new_tensor([floor]), v]))
    if gap < min_margin and not math.isfinite(floor):  # all tie, nothing planted below: under them all
        c = float(v[0]) - 1.0
    return c


def candidate_mask(n, bm, bn):
    """[P, Kb] bool: key block j is a candidate (j < A_i) of query block i."""
    cand, _ = block_counts_torch(n, bm, bn)
    return torch.arange(cdiv(n, bn))[None, :] < cand[:, None]


def far_tiles(far, n, bm, bn, group):
    """[B, H, P, Kb] bool: the planted far candidate tiles (sparse_inputs' far [B, Hkv, Kb])."""
    return far.repeat_interleave(group, dim=1)[:, :, None, :] & candidate_mask(n, bm, bn)


def prefill_tiles(q, k, v, bm, bn, order="forward"):
    """(bmax, gap in ``order``), each [B, H, P, Kb], of every sequence from the instrumented
    reference: the decision values of BSFA and BLASST (the sparse reference's own)."""
    from sparsecal.formats.stats_config import StatsConfig
    from sparsecal.kernels.capture.reference import instrumented_attention

    cfg = StatsConfig(block_m=bm, block_n=bn, orders=(order,), decode_rows=0)
    stats = [instrumented_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], q.shape[-1] ** -0.5, cfg)[1]
             for i in range(q.shape[0])]
    return torch.stack([t.bmax for t in stats]), torch.stack([t.gap[:, 0] for t in stats])


def bsfa_cut_thresholds(bmax, far, cand, positions):
    """BSFA thresholds [H, positions] from the input's own block maxima (bmax, far [B, H, P, Kb],
    cand [P, Kb]): per head and threshold position, cut_point of the candidate maxima of every
    sequence and query block that reads it (query block i reads min(i, positions - 1)), above the
    planted far ones. Every far candidate is skipped; no tile max lies near a threshold."""
    h, p = bmax.shape[1], bmax.shape[2]
    pos = torch.clamp(torch.arange(p), max=positions - 1)
    thr = torch.zeros(h, positions)
    for hh in range(h):
        for x in range(positions):
            rows = pos == x
            c = cand[rows][None].expand(bmax.shape[0], -1, -1)
            vals, f = bmax[:, hh, rows], far[:, hh, rows]
            floor = float(vals[c & f].max()) if (c & f).any() else -math.inf
            thr[hh, x] = cut_point(vals[c & ~f], floor)
    return thr


def blasst_cut_log_lambda(gap, far, cand):
    """BLASST ln(lambda) from the input's own tile gaps (gap, far [B, H, P, Kb] or [..., Kb], cand a
    broadcastable candidate mask): cut_point of the candidate gaps over every sequence, head and
    query block, above the planted far ones. Every far candidate is skipped; no gap lies near it."""
    c = cand.expand_as(gap)
    floor = float(gap[c & far].max()) if (c & far).any() else -math.inf
    return cut_point(gap[c & ~far & torch.isfinite(gap)], floor)


def decode_tiles(q, k, bn, order="forward"):
    """(tile max, gap in ``order``) of each decode row, [B, H, Kb]: q [B, H, 1, D], k [B, Hkv, L, D]
    (the sparse decode reference's decision values; gap -inf past the row)."""
    from sparsecal.formats.geometry import scan_order
    from sparsecal.kernels.capture.reference import scan_rows

    b, h, _, d = q.shape
    length = k.shape[2]
    kb, r = cdiv(length, bn), length - 1
    kk = k.float().repeat_interleave(h // k.shape[1], dim=1)
    s = (q.float() * d ** -0.5) @ kk.transpose(-1, -2)                 # [B, H, 1, L]
    s = torch.nn.functional.pad(s, (0, kb * bn - length), value=-math.inf)
    tmax = s.view(b * h, 1, kb, bn).amax(-1)
    gap, _ = scan_rows(tmax, scan_order(order, r // bn, kb), tmax.amax(-1))
    return tmax.view(b, h, kb), gap.view(b, h, kb)


def write_results(folder: Path) -> Path:
    """Result files in the documented format (toolkit/formats/results.py), made up for the test."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"method": m, "config": c, "length": n, "accuracy_rel_dense": acc}
            for n in (256, 512) for m, c, acc in (("bsfa", "k=1", 0.93), ("bsfa", "k=2", 0.97), ("blasst", "target=0.03", 0.99),
                                                   ("blasst", "target=0.1", 0.95))]
    pl.DataFrame(rows).write_parquet(folder / "eval.parquet")
    bench = [{"method": r["method"], "config": r["config"], "length": r["length"],
              "speedup": 1.0 + (1.0 - r["accuracy_rel_dense"]) * 10, "sparsity": 0.1} for r in rows]
    (folder / "bench.json").write_text(json.dumps({"kind": "sparsecal-bench", "rows": bench, "provenance": {}}))
    return folder


DISPATCH_LENGTHS = [256, 512]


def _dispatch_be_doc():
    """Break-even 0.5 at 256 and 512 tokens for both methods (dense 6 ms; 10 ms unskipped, 2 ms all skipped);
    cuDNN the faster dense backend at 256, FLASH at 512."""
    pts = [{"sparsity": 0.0, "ms": 10.0}, {"sparsity": 1.0, "ms": 2.0}]
    dense = {256: {"CUDNN_ATTENTION": 6.0, "FLASH_ATTENTION": 7.0}, 512: {"CUDNN_ATTENTION": 7.0, "FLASH_ATTENTION": 6.0}}
    measured = [{"method": m, "head_dim": 64, "group": 2, "length": n, "dense": dense[n], "points": pts}
                for m in D.METHODS for n in DISPATCH_LENGTHS]
    geo = {"block_m": 128, "block_n": 64, "heads": 4, "kv_heads": 2, "head_dim": 64}
    return D.break_even_file(measured, geo, {"gpu": "test", "commit": "c0ffee1"})


def dispatch_export(out, sparse_layers=(0, 1), dispatch=True, layer1=(0.1, 0.9), model="tiny"):
    """For a 2-layer, 4-head model of make_checkpoint(heads=4, kv_heads=2, layers=2):
    BSFA k=1 thresholds 1e30 (every candidate skipped) and a blasst.json whose dispatch record
    runs layer 0 sparse at both buckets and layer 1 (calibrated ``layer1``) sparse where >= 0.5."""
    out.mkdir()
    thr = torch.full((1, 2, 4, 8), 1e30)
    ignored = {str(i): "test" for i in range(2) if i not in sparse_layers}
    write_bsfa(out, thr, [1], 128, 64, "mean", {"model": model, "sparse_layers": list(sparse_layers),
                                                 "ignored_layers": ignored})
    doc = {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": NOOP_BLASST_FACTOR, "decode": None},
           "target_sparsity": 0.5, "targets": [], "model": model, "num_layers": 2, "num_heads": 4,
           "q_block_size": 128, "k_block_size": 64, "schema_version": 1, "sparse_layers": list(sparse_layers),
           "ignored_layers": ignored}
    if dispatch:
        s = np.array([[0.9, 0.9], list(layer1)])
        cfgs = [{"method": "bsfa", "config": "k=1", "value": 1, "source": "test", "sparsity": s},
                {"method": "blasst", "config": "target=0.5", "value": 0.5, "source": "test", "sparsity": s}]
        doc["dispatch"], _ = D.dispatch_record(cfgs, DISPATCH_LENGTHS, _dispatch_be_doc(), "be.json", 64, 2)
    write_blasst(out, doc)
    return out


def tiny_dispatch_export(out, record, model="tiny", **blasst):
    """For the 2-layer, 4-head model of make_checkpoint(heads=4, kv_heads=2, layers=2) (``model``
    the id the export names), both layers sparse: BSFA k=1 thresholds 1e30 and a blasst.json holding
    the dispatch ``record``; ``blasst`` replaces top-level blasst.json fields (default factors:
    prefill NOOP_BLASST_FACTOR, no decode)."""
    out.mkdir()
    write_bsfa(out, torch.full((1, 2, 4, 8), 1e30), [1], 128, 64, "mean",
               {"model": model, "sparse_layers": [0, 1], "ignored_layers": {}})
    doc = {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": NOOP_BLASST_FACTOR, "decode": None},
           "target_sparsity": 0.5, "targets": [], "model": model, "num_layers": 2, "num_heads": 4,
           "q_block_size": 128, "k_block_size": 64, "schema_version": 1, "sparse_layers": [0, 1],
           "ignored_layers": {}, "dispatch": record}
    write_blasst(out, doc | blasst)
    return out


def hybrid_synthetic_run(run, cfg, heads=2, seed=0, **model):
    """A synthetic run of a 3-layer model whose layer 1 was not captured (a sliding-window layer:
    runs dense, noted in the manifest), fitted at targets 0.3 and 0.5 on every sample; ``model``
    overrides manifest model fields (e.g. id)."""
    from sparsecal.bench.synthetic import write_synthetic_run

    write_synthetic_run(run, [1024, 2048], 2, layers=2, heads=heads, cfg=cfg, seed=seed)
    man = json.loads((Path(run) / "manifest.json").read_text())
    man["model"].update(num_layers=3, **model)
    man.update(layers=[0, 2], layer_notes={"1": "sliding window 512: runs dense"})
    (Path(run) / "manifest.json").write_text(json.dumps(man))
    res = cli("fit", run, "--holdout", "0", "--targets", "0.3,0.5")
    assert res.exit_code == 0, res.output
    return run
