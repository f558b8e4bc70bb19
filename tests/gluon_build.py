"""Build a warp-specialized Gluon prefill kernel for sm_90 on a machine without a GPU, through ptxas,
and report what the build is: TMA copies, async wgmma, register reallocation, the cubin, shared
memory, warps, registers a thread, spills and ptxas's warnings (tests/test_prefill_gluon_ws.py and
tests/test_prefill_gluon_pair.py).

Run in a fresh process: the test session sets TRITON_INTERPRET=1, under which Triton's own jit
helpers (the reductions' combine functions) are interpreter objects that no compiler accepts.
"""
from __future__ import annotations

from triton_build import run

SCRIPT = """
import importlib, json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

def desc(rows, d):
    layout = gl.NVMMASharedLayout.get_default_for([1, rows, d], gl.bfloat16)
    return f"tensordesc<bf16[1,{rows},{d}],{layout!r}>"

def under_mma(ptx):
    # TMA copies issued between a wgmma.commit_group and the next wgmma.wait_group (in PTX text order)
    n, open_ = 0, False
    for line in ptx.splitlines():
        if "wgmma.commit_group" in line:
            open_ = True
        elif "wgmma.wait_group" in line:
            open_ = False
        elif "cp.async.bulk.tensor" in line and open_:
            n += 1
    return n

def ptxas_v(ptx):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                       capture_output=True, text=True)
    os.unlink(f.name)
    return r.stderr

out = {}
for case in json.loads(sys.argv[1]):
    d, method = case["d"], case["method"]
    kernel = getattr(importlib.import_module(case["module"]), case["kernel"])
    sig = {"q_desc": desc(case["q_rows"], d), "k_desc": desc(64, d), "v_desc": desc(64, d), "O": "*bf16",
           "THR": "*fp32", "SKIP": "*i32", "so_b": "i64", "so_h": "i64", "so_n": "i64", "n_ctx": "i32",
           "num_heads": "i32", "num_kv": "i32", "group": "i32", "n_thr": "i32", "qk_scale": "fp32",
           "log_lambda2": "fp32", "window": "i32"}
    kw = dict(case["launch"])
    opts = {k: kw.pop(k) for k in ("num_warps", "maxnreg") if k in kw}
    consts = dict(METHOD=method, Q_ROWS=method % 2 == 0, KV_ROWS=method < 2, HEAD_DIM=d, BM=128, BN=64, **kw,
                  num_warps=opts["num_warps"])
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    src = GluonASTSource(kernel, sig, {(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = k.asm["ptx"]
    log = ptxas_v(ptx)
    regs = re.search(r"Used (\\d+) registers", log)
    spill = re.search(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", log)
    out[case["key"]] = {
        "tma": "cp.async.bulk.tensor" in ptx, "wgmma": "wgmma.mma_async" in ptx, "setmaxnreg": "setmaxnreg" in ptx,
        "cubin": bool(k.asm.get("cubin")), "shared": k.metadata.shared, "warps": k.metadata.num_warps,
        "bar_red": "bar.red.or.pred" in ptx, "vote": "vote.sync" in ptx, "copies_under_mma": under_mma(ptx),
        "bar_red_at": sorted({(int(b), int(n)) for b, n in re.findall(r"bar\\.red\\.or\\.pred %\\w+, (\\d+), (\\d+)", ptx)}),
        "regs": int(regs.group(1)) if regs else None,
        "spills": int(spill.group(1)) + int(spill.group(2)) if spill else None,
        "warnings": [x for x in log.splitlines() if "warning" in x.lower()]}
print("RESULT" + json.dumps(out))
"""


def build(cases: list[dict]) -> dict:
    """key -> build facts, for cases {key, module, kernel (the @gluon.jit name), d, method, q_rows (Q's
    TMA box rows), launch (the kernel's constexpr launch keywords, num_warps and maxnreg included)}."""
    return run(SCRIPT, cases)
