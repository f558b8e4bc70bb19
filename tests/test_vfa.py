"""VFA / VSA (kernels/sparse/vfa.py) against a float64 brute force written from the module's
definitions with Python loops over rows and blocks; nothing to freeze is the dense reference bit
for bit, also through ``sparsify(method="vfa")`` in a tiny model."""
import math

import numpy as np
import pytest
import torch
from test_sparsify import _noop_export, tiny_model  # noqa: F401  (fixture)

import sparsecal
from sparsecal.kernels.sparse.reference import sparse_attention
from sparsecal.kernels.sparse.vfa import nothing_to_freeze, vfa_attention, vfa_decode

NEG = -math.inf


def _inputs(seed, n, h, hkv, d, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, n, d, generator=g) * 1.5
    k = torch.randn(1, hkv, n, d, generator=g)
    k[:, :, 0] += 2.0  # a sink-like first key
    return q.to(dtype), k.to(dtype), torch.randn(1, hkv, n, d, generator=g).to(dtype)


def _brute(q, k, v, scale, bm, bn, log_lambda=None, rows=None):
    """Float64 VFA / VSA of one sequence from the definitions: (out [H, N, D], counts {name: [H]}).
    ``rows``: compute only these query rows, each its own block (decode, BM = 1)."""
    _, h, n, d = q.shape
    group = h // k.shape[1]
    qq, kk, vv = q[0].double().numpy(), k[0].double().numpy(), v[0].double().numpy()
    out = np.zeros((h, n, d))
    cnt = {x: np.zeros(h, dtype=np.int64) for x in ("skipped", "rescales", "fa_rescales", "exceed", "frozen")}
    cnt["excess"] = np.zeros(h)
    blocks = [[r] for r in rows] if rows is not None else [list(range(i, min(i + bm, n))) for i in range(0, n, bm)]
    for hh in range(h):
        kh, vh = kk[hh // group], vv[hh // group]
        for blk in blocks:
            r0, r1 = blk[0], blk[-1] + 1
            nr, a = (r1 - 1) // bn + 1, (r0 // bn) if rows is not None else (r0 // bm * bm) // bn
            keys = lambda j: range(j * bn, min((j + 1) * bn, n))
            rep = [np.array([kh[max(keys(j), key=lambda t: (abs(kh[t, e]), -t)), e] for e in range(d)])
                   for j in range(nr)]
            s = {r: scale * kh[: r + 1] @ qq[hh, r] for r in blk}
            rmax = {r: [max((s[r][t] for t in keys(j) if t <= r), default=NEG) for j in range(nr)] for r in blk}
            frozen = {}
            for r in blk:
                run = NEG
                for x in rmax[r]:
                    cnt["fa_rescales"][hh] += x > run > NEG
                    run = max(run, x)
                if a <= 1:
                    cnt["rescales"][hh] += sum(x > y > NEG for x, y in zip(np.maximum.accumulate(rmax[r])[1:],
                                                                        np.maximum.accumulate(rmax[r])[:-1]))
                    continue
                run = max(scale * float(rep[j] @ qq[hh, r]) for j in range(nr))  # Q-init
                for j in [0] + list(range(a, nr)):
                    cnt["rescales"][hh] += rmax[r][j] > run
                    run = max(run, rmax[r][j])
                frozen[r] = run
            skip = set()
            if a > 1:
                for j in range(1, a):
                    gap = max(min(rmax[r][j] - frozen[r], 0.0) for r in blk)
                    if log_lambda is not None and gap < log_lambda:
                        skip.add(j)
                        continue
                    for r in blk:
                        cnt["frozen"][hh] += 1
                        cnt["exceed"][hh] += rmax[r][j] > frozen[r]
                        cnt["excess"][hh] = max(cnt["excess"][hh], rmax[r][j] - frozen[r])
            cnt["skipped"][hh] += len(skip)
            for r in blk:
                kept = [t for t in range(r + 1) if t // bn not in skip]
                p = np.exp(s[r][kept] - s[r][kept].max())
                out[hh, r] = p @ vh[kept] / p.sum()
    return out, cnt


def _check_counts(counts, want):
    for name in ("skipped", "rescales", "fa_rescales", "exceed", "frozen"):
        assert getattr(counts, name).tolist() == want[name].tolist(), name
    np.testing.assert_allclose(counts.excess.numpy(), want["excess"], atol=1e-4)


@pytest.mark.parametrize("n,h,hkv,d,bm,bn", [(150, 4, 2, 64, 32, 16), (101, 2, 1, 128, 24, 12)])
def test_vfa_and_vsa_match_bruteforce(n, h, hkv, d, bm, bn, seed):
    q, k, v = _inputs(seed, n, h, hkv, d)
    scale = d ** -0.5
    out, counts = vfa_attention(q, k, v, scale, bm, bn)
    want, wc = _brute(q, k, v, scale, bm, bn)
    np.testing.assert_allclose(out[0].double().numpy(), want, atol=3e-5)
    _check_counts(counts, wc)
    assert counts.frozen.sum() > 0 and (counts.fa_rescales > counts.rescales).all()  # rescales avoided
    assert counts.skipped.sum() == 0
    out, counts = vfa_attention(q, k, v, scale, bm, bn, log_lambda=-0.05)
    want, wc = _brute(q, k, v, scale, bm, bn, log_lambda=-0.05)
    np.testing.assert_allclose(out[0].double().numpy(), want, atol=3e-5)
    _check_counts(counts, wc)
    assert 0 < counts.skipped.sum() < counts.candidates * h


def test_vfa_decode_matches_bruteforce(seed):
    q, k, v = _inputs(seed, 140, 4, 2, 64)
    scale = 0.125
    for ll in (None, -2.0):
        out, counts = vfa_decode(q[:, :, -1:], k, v, scale, 32, 16, log_lambda=ll)
        want, wc = _brute(q, k, v, scale, 32, 16, log_lambda=ll, rows=[139])
        np.testing.assert_allclose(out[0, :, 0].double().numpy(), want[:, 139], atol=3e-5)
        _check_counts(counts, wc)
        assert counts.frozen.sum() > 0 and (ll is None or 0 < counts.skipped.sum() < 4 * 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nothing_to_freeze_is_the_dense_reference_bit_for_bit(dtype, seed):
    """N = 40 with BM 32, BN 32: query block 1 has one candidate (block 0, the sink): no phase 2."""
    q, k, v = _inputs(seed, 40, 4, 2, 64, dtype)
    assert nothing_to_freeze(40, 32, 32) and not nothing_to_freeze(40, 32, 16)
    out, counts = vfa_attention(q, k, v, 0.125, 32, 32, log_lambda=-1.0)
    dense, _ = sparse_attention(q, k, v, 0.125, 32, 32, log_lambda=-math.inf)
    assert torch.equal(out, dense) and counts.frozen.sum() == 0 and torch.equal(counts.rescales, counts.fa_rescales)


def test_sparsify_vfa(tiny_model, tmp_path, seed):  # noqa: F811
    """Through sparsify: below 129 tokens (one query block) vfa's logits are dense's bit for bit;
    at 333 they agree to rounding, with the rescales counted per layer and head."""
    _, model = tiny_model
    gen = torch.Generator().manual_seed(seed)
    short, ids = torch.randint(0, 300, (1, 100), generator=gen), torch.randint(0, 300, (1, 333), generator=gen)
    exp = _noop_export(tmp_path / "e")
    with torch.no_grad():
        sparsecal.sparsify(model, exp, method="dense", backend="reference")
        dense_short, dense = model(short).logits, model(ids).logits
        sparsecal.sparsify(model, exp, method="vfa", backend="reference")
        assert torch.equal(model(short).logits, dense_short)
        got = model(ids).logits
    torch.testing.assert_close(got, dense, atol=1e-4, rtol=1e-4)
    st = model.sparsecal_stats
    assert st["skipped"].sum() == 0 and st["vfa_frozen"].min() > 0
    assert (st["fa_rescales"] >= st["vfa_rescales"]).all() and st["fa_rescales"].sum() > st["vfa_rescales"].sum()


def test_capture_joint_statistic_matches_bruteforce(seed):
    """The capture reference's joint_err = max(Q-init, exact max over sink + diagonal blocks) - row
    max, from the definitions; its histogram on the Q-init edges (reduce_tiles' joint_count, the
    sample key) counts every row."""
    from sparsecal.formats.stats_config import StatsConfig
    from sparsecal.kernels.capture.reduce_reference import reduce_tiles
    from sparsecal.kernels.capture.reference import instrumented_attention

    n, bm, bn, d = 150, 32, 16, 64
    q, k, v = _inputs(seed, n, 4, 2, d)
    cfg = StatsConfig(block_m=bm, block_n=bn, orders=("sink_local",), decode_rows=0)
    _, t = instrumented_attention(q, k, v, d ** -0.5, cfg)
    kk = k[0].double().repeat_interleave(2, 0)
    s = (q[0].double() @ kk.transpose(1, 2)) * d ** -0.5
    want = torch.empty(4, n, dtype=torch.float64)
    for r in range(n):
        i, nr = r // bm, (min((r // bm + 1) * bm, n) - 1) // bn + 1
        a = (i * bm) // bn
        local = torch.tensor([c for c in range(r + 1) if c // bn == 0 or c // bn >= a])
        reps = []
        for j in range(nr):  # signed-absmax representative of key block j (first key on ties)
            blk = kk[:, j * bn: min((j + 1) * bn, n)]
            reps.append(blk.gather(1, blk.abs().argmax(dim=1, keepdim=True)).squeeze(1))
        m_init = torch.stack([(q[0, :, r].double() * rep).sum(-1) for rep in reps], -1).amax(-1) * d ** -0.5
        want[:, r] = torch.maximum(m_init, s[:, r, local].amax(-1)) - s[:, r, : r + 1].amax(-1)
    torch.testing.assert_close(t.joint_err.double(), want, atol=2e-5, rtol=0)
    assert (t.joint_err >= t.qinit_err - 1e-6).all() and (want < 0).any() and (want > 0).any()
    assert reduce_tiles(t, n, cfg)["joint_count"].sum(dim=-1).tolist() == [n] * 4


def test_joint_statistic_per_layer_summary():
    """bench/vfa.py's per-layer summary of joint_err (frozen max - true max): shares below -1 / -5
    and above +5 nats, median, 1st percentile and max over every value given for the layer."""
    from sparsecal.bench.vfa import layer_rows

    errs = {3: [torch.tensor([0.0, -2.0, 6.0]), torch.tensor([-6.0, 0.0])]}
    (r,) = layer_rows(errs)
    assert r["layer"] == 3 and r["rows"] == 5 and r["max"] == 6.0 and r["median"] == 0.0
    assert (r["below_1"], r["below_5"], r["above_5"]) == (0.4, 0.2, 0.2) and -6.0 < r["p01"] < -5.8  # -6 + 0.04 * 4


def test_sparsify_vsa_batch_is_each_sequence_alone(tiny_model, tmp_path, seed):  # noqa: F811
    """A batch of two sequences (folded into the heads by run_vfa) gives each sequence the logits
    and the per-row counts it gets alone, prefill and a decode step, and the batch's [L, H]
    counts are their sums. The decode row skips data-dependently (q and k projections scaled up
    so scores spread), so the two sequences' counts differ."""
    from sparsecal.formats.exports import write_blasst

    _, model = tiny_model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    ids = torch.randint(0, 300, (2, 261), generator=torch.Generator().manual_seed(seed))
    exp = _noop_export(tmp_path / "e")
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    write_blasst(exp, {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": 100.0, "decode": 100.0},
                       "target_sparsity": 0.5, "targets": [], "model": "tiny", "num_layers": layers,
                       "num_heads": heads, "q_block_size": 128, "k_block_size": 64, "schema_version": 1})

    def run(rows):
        """Prefill of 260 tokens, then one decode step: (logits of both, the step's row counts, frozen)."""
        pre = model(ids[rows, :260], use_cache=True)
        step = model(ids[rows, 260:], past_key_values=pre.past_key_values, use_cache=True)
        st = model.sparsecal_stats
        return pre.logits, step.logits, st["row_skipped"].clone(), st["skipped"].clone(), st["vfa_frozen"].clone()

    with torch.no_grad():
        sparsecal.sparsify(model, exp, method="vsa", target=0.5, backend="reference")
        alone = [run(slice(i, i + 1)) for i in range(2)]
        both = run(slice(0, 2))
    for i in range(2):
        torch.testing.assert_close(both[0][i:i + 1], alone[i][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(both[1][i:i + 1], alone[i][1], atol=1e-5, rtol=1e-5)
        assert torch.equal(both[2][:, i], alone[i][2][:, 0])
    assert torch.equal(both[3], alone[0][3] + alone[1][3])
    assert torch.equal(both[4], alone[0][4] + alone[1][4])
    assert not torch.equal(alone[0][3], alone[1][3]) and both[3].sum() > 0
