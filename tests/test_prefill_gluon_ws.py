"""The warp-specialized Gluon prefill kernel (kernels/sparse/prefill_gluon_ws.py) on a machine without a GPU.

Gluon does not run in Triton's interpreter: its numbers are checked against the reference on the GPU
by bench/prefill_gluon.py (``--variants gluon_ws``). Here: the kernel builds for sm_90 with this
machine's Triton, through ptxas, for every method and head dim it takes and both of its forms (a
producer warp or not), and the build is the one the design relies on: TMA copies, async wgmma,
warp-specialized partitions with register reallocation, no register spills, no serialized wgmma
(ptxas warning C7514), and registers and shared memory that let the intended programs share an SM.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sparsecal.kernels.sparse import prefill_gluon_ws as pw

H100_SMEM_PER_SM = 228 * 1024  # bytes; each resident program also reserves 1 KiB
H100_REGS_PER_SM = 64 * 1024
# head dim, method (dense, BSFA, BLASST, window), producer warp
CASES = [(d, m, pw.PRODUCER[d]) for d in (64, 128) for m in (0, 1, 2, 3)] + [(128, m, True) for m in (0, 1, 2, 3)]


def programs_per_sm(d: int, producer: bool) -> int:
    """What the configuration is for: two programs per SM, except D = 128 with a producer warp (one,
    with a deep ring: its consumers need 128 registers, which two programs cannot give them)."""
    return 1 if (d, producer) == (128, True) else 2


# Run in a fresh process: the test session sets TRITON_INTERPRET=1, under which Triton's own jit
# helpers (the reductions' combine functions) are interpreter objects that no compiler accepts.
BUILD = """
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from sparsecal.kernels.sparse import prefill_gluon_ws as pw

def desc(rows, d):
    layout = gl.NVMMASharedLayout.get_default_for([1, rows, d], gl.bfloat16)
    return f"tensordesc<bf16[1,{rows},{d}],{layout!r}>"

def ptxas_v(ptx):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                       capture_output=True, text=True)
    os.unlink(f.name)
    return r.stderr

out = {}
for d, method, producer in json.loads(sys.argv[1]):
    sig = {"q_desc": desc(64, d), "k_desc": desc(64, d), "v_desc": desc(64, d), "O": "*bf16", "THR": "*fp32",
           "SKIP": "*i32", "so_b": "i64", "so_h": "i64", "so_n": "i64", "n_ctx": "i32", "num_heads": "i32",
           "num_kv": "i32", "group": "i32", "n_thr": "i32", "qk_scale": "fp32", "log_lambda2": "fp32", "window": "i32"}
    kw = pw.ws_config(d, producer)
    opts = {k: kw.pop(k) for k in ("num_warps", "maxnreg") if k in kw}
    consts = dict(METHOD=method, Q_ROWS=method % 2 == 0, KV_ROWS=method < 2, HEAD_DIM=d, BM=128, BN=64, **kw,
                  num_warps=opts["num_warps"])
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    src = GluonASTSource(pw._ws_fwd_kernel, sig, {(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = k.asm["ptx"]
    log = ptxas_v(ptx)
    regs = re.search(r"Used (\\d+) registers", log)
    spill = re.search(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", log)
    out[f"{d}-{method}-{int(producer)}"] = {
        "tma": "cp.async.bulk.tensor" in ptx, "wgmma": "wgmma.mma_async" in ptx, "setmaxnreg": "setmaxnreg" in ptx,
        "cubin": bool(k.asm.get("cubin")), "shared": k.metadata.shared, "warps": k.metadata.num_warps,
        "regs": int(regs.group(1)) if regs else None,
        "spills": int(spill.group(1)) + int(spill.group(2)) if spill else None,
        "warnings": [x for x in log.splitlines() if "warning" in x.lower()]}
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def builds():
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", BUILD, json.dumps(CASES)], capture_output=True, text=True, env=env,
                       timeout=900, check=False)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line, f"the sm_90 build failed:\n{r.stderr[-3000:]}"
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("d,method,producer", CASES, ids=[f"d{d}-{m}-{'prod' if p else 'inline'}" for d, m, p in CASES])
def test_builds_for_hopper_warp_specialized(builds, d, method, producer):
    got = builds[f"{d}-{method}-{int(producer)}"]
    assert got["tma"], "K/V/Q should arrive by TMA"
    assert got["wgmma"], "Q.K^T and P.V should be warpgroup MMAs"
    assert got["setmaxnreg"], "the partitions should reallocate registers"
    assert got["cubin"], "ptxas should have assembled the kernel"
    assert got["spills"] == 0, got
    assert not [w for w in got["warnings"] if "C7514" in w or "wgmma" in w.lower()], got["warnings"]
    # 2 consumer warpgroups, plus the producer warp's warpgroup (padded to 4 warps) when there is one
    assert got["warps"] == (12 if producer else 8), got["warps"]
    n = programs_per_sm(d, producer)
    assert n * (got["shared"] + 1024) <= H100_SMEM_PER_SM, got["shared"]
    assert n * got["regs"] * got["warps"] * 32 <= H100_REGS_PER_SM, got["regs"]


def test_config_is_the_one_each_head_dim_runs():
    """D = 64 gets a producer warp and 4 slots at 80 launch registers (104 + 112 + 24 after
    setmaxnreg: two programs per SM); D = 128 runs without one (128 registers, 2 slots)."""
    common = {"PRODUCER_REGS": 24, "num_warps": 4}
    assert pw.ws_config(64) == {"NBUF": 4, "PRODUCER": True, "WORKER_REGS": 112, "maxnreg": 80, **common}
    assert pw.ws_config(128) == {"NBUF": 2, "PRODUCER": False, "WORKER_REGS": 128, "maxnreg": 128, **common}
    assert "maxnreg" not in pw.ws_config(128, producer=True) and pw.ws_config(128, True, nbuf=3)["NBUF"] == 3


def test_takes_only_the_calls_the_gluon_kernel_takes(seed):
    q = torch.randn(1, 2, 256, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="Gluon prefill kernel does not take this call"):
        pw.sparse_attention_gluon_ws(q, q, q, 0.125, 128, 64, thresholds=torch.zeros(2, 2))
