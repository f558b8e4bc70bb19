"""The Gluon prefill kernel (kernels/sparse/prefill_gluon.py) on a machine without a GPU.

Gluon does not run in Triton's interpreter, so its numbers are checked against the reference on the
GPU at the start of every benchmark run (bench/prefill_gluon.py, results in data/bench). Here: the
kernel builds for sm_90 with this machine's Triton, through ptxas, for every method and head dim it
takes, and the build is the one the design relies on (TMA copies, async wgmma, two programs' worth
of shared memory per SM); and which calls it takes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sparsecal.kernels.sparse import prefill_gluon as pg

H100_SMEM_PER_SM = 228 * 1024  # bytes; each resident program also reserves 1 KiB
CASES = [(d, m) for d in (64, 128) for m in (0, 1, 2, 3)]  # head dim, method (dense, BSFA, BLASST, window)

# Run in a fresh process: the test session sets TRITON_INTERPRET=1, under which Triton's own jit
# helpers (the reductions' combine functions) are interpreter objects that no compiler accepts.
BUILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from sparsecal.kernels.sparse import prefill_gluon as pg

def desc(rows, d):
    layout = gl.NVMMASharedLayout.get_default_for([1, rows, d], gl.bfloat16)
    return f"tensordesc<bf16[1,{rows},{d}],{layout!r}>"

out = {}
for d, method in json.loads(sys.argv[1]):
    sig = {"q_desc": desc(128, d), "k_desc": desc(64, d), "v_desc": desc(64, d), "O": "*bf16", "THR": "*fp32",
           "SKIP": "*i32", "so_b": "i64", "so_h": "i64", "so_n": "i64", "n_ctx": "i32", "num_heads": "i32",
           "num_kv": "i32", "group": "i32", "n_thr": "i32", "qk_scale": "fp32", "log_lambda2": "fp32", "window": "i32"}
    consts = dict(METHOD=method, Q_ROWS=method % 2 == 0, KV_ROWS=method < 2, HEAD_DIM=d, BM=128, BN=64,
                  NBUF=pg.NBUF[d], num_warps=pg.NUM_WARPS)
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    src = GluonASTSource(pg._gluon_fwd_kernel, sig, {(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": pg.NUM_WARPS})
    ptx = k.asm["ptx"]
    out[f"{d}-{method}"] = {"tma": "cp.async.bulk.tensor" in ptx, "wgmma": "wgmma.mma_async" in ptx,
                            "cubin": bool(k.asm.get("cubin")), "shared": k.metadata.shared}
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def builds():
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", BUILD, json.dumps(CASES)], capture_output=True, text=True, env=env,
                       timeout=600, check=False)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line, f"the sm_90 build failed:\n{r.stderr[-3000:]}"
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("d,method", CASES, ids=[f"d{d}-{m}" for d, m in CASES])
def test_builds_for_hopper_with_tma_and_async_wgmma(builds, d, method):
    got = builds[f"{d}-{method}"]
    assert got["tma"], "K/V/Q should arrive by TMA"
    assert got["wgmma"], "Q.K^T and P.V should be warpgroup MMAs"
    assert got["cubin"], "ptxas should have assembled the kernel"
    # two programs per SM: what the 2-slot ring is for (NOTES.md: one per SM ran 1.2x slower)
    assert 2 * (got["shared"] + 1024) <= H100_SMEM_PER_SM, got["shared"]


def test_takes_only_the_calls_it_was_built_for(seed):
    q = torch.randn(1, 2, 256, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    assert not pg.gluon_supported(q, 128, 64, 1, "forward", None)  # no CUDA device here
    with pytest.raises(ValueError, match="Gluon prefill kernel does not take this call"):
        pg.sparse_attention_gluon(q, q, q, 0.125, 128, 64, thresholds=torch.zeros(2, 2))


def test_tma_views_address_both_storages(seed):
    """[B, H, N, D] storage merges heads into rows; [B, N, H, D] storage (what transformers hands the
    attention function, transposed) puts a token's heads side by side; anything else is copied."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(2, 3, 40, 64, generator=g)
    view, heads_in_rows = pg._tma_view(t, 64)
    assert heads_in_rows and view.shape == (6, 40, 64) and torch.equal(view[1 * 3 + 2], t[1, 2])
    bnhd = torch.randn(2, 40, 3, 64, generator=g)
    view, heads_in_rows = pg._tma_view(bnhd.transpose(1, 2), 64)
    assert not heads_in_rows and view.shape == (2, 40, 192)
    assert torch.equal(view[1, :, 2 * 64:3 * 64], bnhd[1, :, 2])
    odd = torch.randn(3, 2, 40, 64, generator=g).transpose(0, 1)  # batch and heads swapped in storage
    view, heads_in_rows = pg._tma_view(odd, 64)
    assert heads_in_rows and view.is_contiguous() and torch.equal(view.view(2, 3, 40, 64), odd)


def test_a_targets_row_carries_the_intervals_of_its_rounds():
    """bench.prefill_gluon.target_row (CPU: fabricated round times): each ratio is the ratio of
    medians against its baseline (best SDPA, the project's fastest dense, the faster of the two),
    with speed_stats' interval from exactly those rounds, divided by the ideal for the of_ideal ones."""
    from sparsecal.bench.prefill_gluon import target_row
    from sparsecal.bench.sparse import ideal
    from sparsecal.evaluation.speed_stats import ratio_interval

    times = {"sdpa_cudnn": [3.9, 3.86, 3.88, 3.87, 3.9], "sdpa_flash": [6.5, 6.6, 6.55, 6.5, 6.52],
             "dense_triton": [4.5, 4.46, 4.47, 4.5, 4.49], "gluon_ws_off": [4.1, 4.12, 4.11, 4.13, 4.1],
             "gluon_ws_bsfa_s75": [3.0, 2.98, 3.01, 2.99, 3.02]}
    row = target_row("gluon_ws_bsfa_s75", times, 0.75, {"target": 0.75}, 16384, 128)
    got = ratio_interval(times["sdpa_cudnn"], times["gluon_ws_bsfa_s75"])
    assert row["vs_sdpa"] == 3.88 / 3.0 and (row["vs_sdpa_lo"], row["vs_sdpa_hi"]) == (got["lo"], got["hi"])
    dense = ratio_interval(times["gluon_ws_off"], times["gluon_ws_bsfa_s75"])
    assert row["of_ideal"] == 4.11 / 3.0 / ideal(0.75) and row["of_ideal_lo"] == dense["lo"] / ideal(0.75)
    assert row["of_ideal_best"] == 3.88 / 3.0 / ideal(0.75)   # cuDNN the faster dense here
    assert row["of_ideal_best_lo"] < row["of_ideal_best"] < row["of_ideal_best_hi"]
    assert "of_ideal" not in target_row("sdpa_flash", times, None, {}, 16384, 128)


def test_rounds_time_every_pair_once_each_way_round(monkeypatch):
    """bench.sparse.round_robin_times (CPU: a timer that records the calls) in speed_stats.round_order: round 0
    times the variants in their order, round 1 reversed, so over an even number of rounds no variant is always
    timed before another (a fixed order read the second of two identical kernels 2-5 % slower on the GPU, s49)."""
    from sparsecal.bench import sparse

    calls = []
    monkeypatch.setattr(sparse, "bench_ms", lambda fn: calls.append(fn()) or float(len(calls)))
    variants = {name: (lambda name=name: name, None, {}) for name in ("a", "b", "c")}
    times = sparse.round_robin_times(variants, 4)
    assert calls == ["a", "b", "c", "c", "b", "a"] * 2
    assert times == {"a": [1.0, 6.0, 7.0, 12.0], "b": [2.0, 5.0, 8.0, 11.0], "c": [3.0, 4.0, 9.0, 10.0]}
    before = {(x, y): sum(calls[i:i + 3].index(x) < calls[i:i + 3].index(y) for i in range(0, 12, 3))
              for x in "abc" for y in "abc" if x != y}
    assert set(before.values()) == {2}
