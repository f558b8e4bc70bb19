"""Build a Triton kernel for sm_90 on a machine without a GPU, through ptxas, and report registers a
thread, spills and shared memory (tests/test_decode_group_dense.py). The arguments named in
``divisible`` are specialized as a launch with 16-divisible pointers and strides is (without that
hint the build is another kernel: scalar loads, and spills that a GPU launch never has).

Run in a fresh process: the test session sets TRITON_INTERPRET=1, under which Triton's jit helpers
are interpreter objects that no compiler accepts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import importlib, json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

out = {}
for case in json.loads(sys.argv[1]):
    kernel = getattr(importlib.import_module(case["module"]), case["kernel"])
    sig = dict(case["signature"])
    sig.update({k: "constexpr" for k in case["constexprs"]})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in case["divisible"]}
    src = ASTSource(kernel, sig, {(names.index(k),): v for k, v in case["constexprs"].items()}, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=case["options"])
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\\d+) registers", log)
    spill = re.search(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", log)
    out[case["key"]] = {"regs": int(regs.group(1)) if regs else None, "shared": k.metadata.shared,
                        "spills": int(spill.group(1)) + int(spill.group(2)) if spill else None}
print("RESULT" + json.dumps(out))
"""


def run(script: str, cases: list[dict]) -> dict:
    """A build ``script`` run on ``cases`` in a fresh process without the interpreter: the JSON it
    prints after "RESULT" (also tests/gluon_build.py's runner)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True, env=env,
                       timeout=900, check=False)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line, f"the sm_90 build failed:\n{r.stderr[-3000:]}"
    return json.loads(line[len("RESULT"):])


def build(cases: list[dict]) -> dict:
    """key -> {regs, spills, shared} for cases {key, module, kernel (the @triton.jit name), signature
    {arg: type} in argument order (constexprs last), constexprs {name: value}, divisible [arg names],
    options {num_warps, num_stages}}."""
    return run(SCRIPT, cases)
