"""Decode rows of ``sparsecal bench break-even``: where the sparse decode kernel pays on this GPU.

Per length and method (bsfa, blasst) and decode decision (head: kernels/sparse/decode.py's split-K
kernel; group: kernels/sparse/decode_group.py with the group decision; the kernel sparsify runs for
that decision), one decode step of one layer: ``batch`` rows, the model's H, Hkv, D, bf16, one new
token per row against ``length`` cached tokens (bench/decode.decode_qkv: sinks, a local component,
heavy hitters). Dense: every SDPA backend that runs the step as sparsify's dense decode calls it
(kernels/layer_dense.py: native GQA, enable_gqa), and the project's own dense decode kernel as
sparsify runs it for a record that picks it (formats.dispatch.OWN_DENSE: decode_group.py's
``group_decode_triton(..., dense=True)``, decode_group_dense.py's tuned launch). Sparse: the kernel at operating points bisected on
its own skip counts (BLASST's ln(lambda); BSFA's per-head quantile of the candidate tile maxima,
bench/decode.py), each recording the sparsity it counted (skipped / reachable tiles over rows and
heads, as sparsify counts). Timings: ``eager`` medians of ``rounds`` round-robin rounds of triton's
do_bench (one launch per call: host cost included), ``graph`` the median of replaying each call
captured as a CUDA graph (device time, what serving engines that replay decode graphs pay). A call
that cannot be captured is left out of the graph row, said on stderr.

``quick``: the CPU under TRITON_INTERPRET=1 (tiny shapes, wall clock of one call, eager only), for
the tests.

Shape legend: B batch rows, H query heads, Hkv KV heads, L cached tokens, D head dim.
"""
from __future__ import annotations

import statistics
import warnings

import torch

from sparsecal.bench.decode import bisect, bsfa_at, graph_ms, time_ms
from sparsecal.bench.harness import log
from sparsecal.evaluation.speed_stats import round_order

DECODE_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
QUICK_SDPA = ("FLASH_ATTENTION", "MATH")  # what runs on a CPU


def sparse_call(q, k, v, scale: float, bm: int, bn: int, decision: str, kw: dict):
    """The call sparsify makes for a decode step (integrations/sparsify._run_triton): -> (out, skipped [B, H])."""
    if decision == "group":
        from sparsecal.kernels.sparse.decode_group import group_decode_triton

        o, sk, _ = group_decode_triton(q, k, v, scale, bm, bn, decision="group", **kw)
        return o, sk
    from sparsecal.kernels.sparse.decode import sparse_decode_triton

    return sparse_decode_triton(q, k, v, scale, bm, bn, **kw)


def counted(skipped, length: int, bn: int) -> float:
    """skipped [B, H] -> skipped / reachable tiles over rows and heads."""
    return float(skipped.sum()) / (((length - 1) // bn + 1) * skipped.numel())


def operating_points(q, k, v, scale: float, bm: int, bn: int, method: str, decision: str, sparsities) -> dict:
    """{target: kernel kwargs} bisected on the kernel's own counts (bench/decode.py's search)."""
    length = k.shape[2]
    out = {}
    if method == "blasst":
        for s in sparsities:
            out[s] = {"log_lambda": bisect(lambda x: counted(sparse_call(q, k, v, scale, bm, bn, decision,
                                                                         {"log_lambda": x})[1], length, bn),
                                           -40.0, 0.0, s)}
        return out
    from sparsecal.kernels.sparse.decode_group import decode_tile_maxima

    tmax = decode_tile_maxima(q, k, scale, bn)
    for s in sparsities:
        p = bisect(lambda x: counted(sparse_call(q, k, v, scale, bm, bn, decision,
                                                 {"thresholds": bsfa_at(tmax, length, x)})[1], length, bn), 0.0, 1.0, s)
        out[s] = {"thresholds": bsfa_at(tmax, length, p)}
    return out


def own_dense_call(q, k, v, scale: float, bm: int, bn: int) -> dict:
    """{OWN_DENSE: fn}: the project's dense decode kernel as a dispatched dense decode step runs it
    (integrations/sparsify_dense.own_dense_decode); {} where it does not run this shape (D past
    formats.dispatch.OWN_DENSE_MAX_D, as sparsify), said once."""
    from sparsecal.formats.dispatch import OWN_DENSE, OWN_DENSE_MAX_D
    from sparsecal.kernels.sparse.decode_group import group_decode_triton

    if q.shape[-1] > OWN_DENSE_MAX_D:
        log(f"  decode {OWN_DENSE} not timed: D {q.shape[-1]} > {OWN_DENSE_MAX_D} (sparsify does not run it there)")
        return {}

    def fn():
        return group_decode_triton(q, k, v, scale, bm, bn, dense=True)[0]

    try:
        fn()
    except Exception as e:  # noqa: BLE001  (left out of the row, as an SDPA backend that cannot run it)
        log(f"  decode {OWN_DENSE} unavailable: {type(e).__name__}: {str(e)[:120]}")
        return {}
    return {OWN_DENSE: fn}


def sdpa_calls(q, k, v, scale: float, backends) -> dict:
    """{backend: fn} of the SDPA backends that run the decode step as sparsify's dense decode does."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]

    def call(be):
        def fn():
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
        return fn

    out = {}
    for name in backends:
        fn = call(getattr(SDPBackend, name))
        try:
            with warnings.catch_warnings():  # torch says why each backend it skips cannot run: said below once
                warnings.simplefilter("ignore", UserWarning)
                fn()
            out[name] = fn
        except Exception as e:  # noqa: BLE001  (a backend that does not run this shape is left out, said once)
            log(f"  decode sdpa {name} unavailable: {type(e).__name__}: {str(e)[:120]}")
    return out


def measure_decode_length(n: int, geo: dict, methods, decisions, sparsities, rounds: int, batch: int,
                          timings, quick: bool = False) -> list[dict]:
    """One cached length: rows {"phase": "decode", "timing", "decision", "batch", "method",
    "head_dim", "group", "length", "dense" {backend: ms}, "points" [{"sparsity", "ms", "target"}]}
    (formats.dispatch.break_even_rows' input), per timing in ``timings`` (graph not in quick)."""
    from sparsecal.bench.decode import decode_qkv

    h, hkv, d, bm, bn = geo["heads"], geo["kv_heads"], geo["head_dim"], geo["block_m"], geo["block_n"]
    device = "cpu" if quick else "cuda"
    q, k, v = decode_qkv(batch, n, d, h // hkv, seed=n + 7 * h + d, dtype=torch.bfloat16, device=device, heads=h)
    scale = d ** -0.5
    dense = sdpa_calls(q, k, v, scale, QUICK_SDPA if quick else DECODE_SDPA) | own_dense_call(q, k, v, scale, bm, bn)
    fns = {("dense", b): fn for b, fn in dense.items()}
    sparsity = {}
    for method in methods:
        for decision in decisions:
            for s, kw in operating_points(q, k, v, scale, bm, bn, method, decision, sparsities).items():
                key = (method, decision, s)
                sparsity[key] = counted(sparse_call(q, k, v, scale, bm, bn, decision, kw)[1], n, bn)
                fns[key] = lambda kw=kw, decision=decision: sparse_call(q, k, v, scale, bm, bn, decision, kw)
    ms = {}
    if "eager" in timings:
        times = {key: [] for key in fns}
        for r in range(rounds):
            for key in round_order(fns, r):
                times[key].append(time_ms(fns[key], quick))
        ms["eager"] = {key: statistics.median(t) for key, t in times.items()}
    if "graph" in timings and not quick:
        got = {key: graph_ms(fn) for key, fn in fns.items()}
        for key, t in got.items():
            if not isinstance(t, float):
                log(f"  decode N={n} {key}: {t}")
        ms["graph"] = {key: t for key, t in got.items() if isinstance(t, float)}
    rows = []
    for timing, t in ms.items():
        dense = {key[1]: x for key, x in t.items() if key[0] == "dense"}
        log(f"decode N={n} B={batch} {timing}: dense " + ", ".join(f"{b} {x:.4f} ms" for b, x in dense.items()))
        if not dense:
            continue
        for method in methods:
            for decision in decisions:
                pts = [{"sparsity": sparsity[(method, decision, s)], "ms": t[(method, decision, s)], "target": s}
                       for s in sparsities if (method, decision, s) in t]
                if pts:
                    rows.append({"phase": "decode", "timing": timing, "decision": decision, "batch": batch,
                                 "method": method, "head_dim": d, "group": h // hkv, "length": n, "dense": dense,
                                 "points": pts})
    return rows

