"""The timing harness every benchmark in sparsecal.bench uses (run on a GPU).

``bench_ms`` (triton's do_bench median, L2 flushed), ``sweep`` (time launch variants, keep the best,
record failures), ``sdpa_fns`` (the torch SDPA backends that run on given inputs, GQA natively or
expanded outside the timed call), ``random_qkv`` (seeded GPU inputs), ``compiled_info`` (registers
and spills of a kernel's last launch), ``run_section`` (a failing section is recorded, not fatal),
``log`` and ``sync``. ``CHECK_CASES`` are the capture benchmarks' correctness shapes.

Shape legend
    H query heads (HEADS)   Hkv KV heads (KV_HEADS)   N length   D head dim
"""
from __future__ import annotations

import time
import traceback

import torch

from sparsecal.kernels.jit import LAST_COMPILED

HEADS = 32


KV_HEADS = 8


DEVICE = "cuda"  # a smoke test may point this at "cpu" under TRITON_INTERPRET=1


CHECK_CASES = [  # (N, KV heads, group, D, BM, BN, dtype)
    (1000, 2, 4, 128, 128, 64, torch.bfloat16),
    (777, 1, 3, 64, 128, 64, torch.float16),
    (513, 1, 2, 64, 64, 32, torch.bfloat16),
    (300, 1, 2, 128, 80, 48, torch.bfloat16),
    (640, 1, 2, 64, 128, 64, torch.float32),
    (1000, 1, 16, 256, 128, 64, torch.bfloat16),  # D = 256, MQA with 16 query heads
    (600, 2, 8, 256, 64, 32, torch.float16),      # D = 256, GQA 8
    (700, 1, 16, 64, 128, 64, torch.bfloat16),    # MQA with 16 query heads at D = 64
]


def run_cli(main) -> None:
    """A benchmark module's ``python -m`` entry: ``main()``, with a UserError (bad input, a file of
    another kind) printed as its one line and exit code 2."""
    from sparsecal.formats.errors import UserError

    try:
        main()
    except UserError as e:
        print(f"error: {e}")
        raise SystemExit(2) from None


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"))


def random_qkv(n, d, dtype=torch.bfloat16, heads=HEADS, kv=KV_HEADS, seed=0, sink=False):
    """Random [1, H, N, D] q and [1, Hkv, N, D] k, v on the GPU (never zeros); ``sink`` aligns key 0
    with the mean query so gaps spread out, as the CPU tests draw them."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(1, heads, n, d, device=DEVICE, generator=g) * (1.5 if sink else 1.0)
    k = torch.randn(1, kv, n, d, device=DEVICE, generator=g)
    v = torch.randn(1, kv, n, d, device=DEVICE, generator=g)
    if sink:
        k[:, :, 0] += 2.0 * q[:, :: heads // kv].mean(2)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sweep(name: str, variants, make_fn) -> tuple:
    """Time make_fn(variant)() for each variant; returns (best variant, rows)."""
    rows, best = [], None
    for var in variants:
        try:
            ms = bench_ms(make_fn(var))
            rows.append({"variant": list(var), "ms": ms})
            if best is None or ms < best[1]:
                best = (var, ms)
            log(f"  {name} {var}: {ms:.3f} ms")
        except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is recorded, not fatal
            rows.append({"variant": list(var), "error": f"{type(e).__name__}: {str(e)[:300]}"})
            log(f"  {name} {var}: FAILED {type(e).__name__}: {str(e)[:200]}")
    return (best[0] if best else None), rows


def graph_replay(fn):
    """``fn`` (its inputs fixed) warmed on a side stream and captured in a CUDA graph: the graph's
    replay (one launch for all of fn's kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def sdpa_fn(q, k, v, backend, causal: bool = True):
    """A callable running SDPA with one backend: GQA natively when supported, else on K/V expanded
    outside the timed call. ``causal`` False for decode (one query row sees the whole cache).
    Returns (fn, gqa mode)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def native():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    try:
        native()
        return native, "native"
    except Exception:  # noqa: BLE001 - any refusal of the native GQA call: expand the KV heads instead
        group = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def expanded():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal)

        expanded()
        return expanded, "expanded"


PREFILL_SDPA = ("CUDNN_ATTENTION", "FLASH_ATTENTION")


def sdpa_fns(q, k, v, backends=PREFILL_SDPA, causal: bool = True) -> tuple[dict, dict]:
    """The SDPA backends that run on these inputs: ({"sdpa_cudnn": (fn, gqa mode), ...},
    {name: "unavailable: why"} for those that do not)."""
    from torch.nn.attention import SDPBackend

    fns, missing = {}, {}
    for backend in backends:
        name = f"sdpa_{backend.split('_')[0].lower()}"
        try:
            fns[name] = sdpa_fn(q, k, v, getattr(SDPBackend, backend), causal=causal)
        except Exception as e:  # noqa: BLE001 - a backend that does not run here is recorded, not fatal
            missing[name] = f"unavailable: {type(e).__name__}: {str(e)[:200]}"
            log(f"  {name} {missing[name]}")
    return fns, missing


def compiled_info(name: str) -> dict:
    k = LAST_COMPILED.get(name)
    return {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
            "shared": getattr(getattr(k, "metadata", None), "shared", None)}


def run_section(result: dict, key: str, fn, save) -> None:
    try:
        result[key] = fn()
    except Exception as e:  # noqa: BLE001 - a failing section is recorded and the run goes on
        log(f"{key} FAILED: {type(e).__name__}: {e}")
        result.setdefault("errors", {})[key] = traceback.format_exc()[-3000:]
    save()


def result_file(name: str, out, commit: str | None = None):
    """A benchmark's result: ({"benchmark": name, "provenance": ...}, save), where save() writes it
    to ``out`` as JSON (call it after every section, so a crash keeps what was measured).
    ``commit`` overrides the recorded commit (the device copy's .git may be stale or absent)."""
    import json
    from pathlib import Path

    from sparsecal.formats.provenance import provenance

    result = {"benchmark": name, "provenance": provenance()}
    result["provenance"]["commit"] = commit or result["provenance"]["commit"]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(result, indent=1, default=str))

    log(f"GPU: {result['provenance']['gpu']}, torch {torch.__version__}")
    return result, save
