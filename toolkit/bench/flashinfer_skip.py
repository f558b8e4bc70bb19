"""FlashInfer's Hopper skip-softmax prefill on captured Q/K/V, against sparsecal's simulation of the
same rule (kernels/sparse/flashinfer_reference.py) and timed against dense FlashInfer and PyTorch
SDPA. One command on an H100 with flashinfer-python 0.7.2.post1 importable:

    python -m sparsecal.bench.flashinfer_skip --qkv DIR --out FILE.json [--prebuilt DIR]
        [--targets 0.3,0.5,0.7] [--prefix 3000] [--rounds 3] [--time-all]

For every capture DIR/qkv-N.safetensors (bench/flashinfer_qkv.py) and layer in it: the factor whose
simulated skipped share is nearest each target (bisection on the simulation); FlashInfer
``trtllm_fmha_v2_prefill`` (layout SEPARATE_Q_K_V, causal, bf16) dense and at each factor; the
output's max / mean absolute difference from the simulation's float32 output; the kernel's own
skipped/total tile counts (the ``stat`` build, bench/flashinfer_build.py) next to the simulation's;
a row at factor 1e-9 (the skip kernel on, nothing to skip: target null); ``--prefix P`` adds the
first P tokens of the shortest capture (a length that is no multiple of the tiles: rows past N).
Timing (one layer per length, ``--time-layer``, or all with ``--time-all``): CUDA-graph replays
(``triton.testing.do_bench_cudagraph``, median) of dense FlashInfer, skip FlashInfer at 1e-9 and
each factor, and SDPA (cuDNN and FLASH backends, K/V expanded to H heads; the best reported), ``--rounds``
rounds round-robin, the median over rounds. Writes FILE.json with provenance.

Tolerance stated in the file: |kernel - simulation| <= 2^-6 * max|simulation| + 2^-8 (bf16 has 8
significand bits; P is rounded to bf16 before P.V), the same bound the dense kernel is held to.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from pathlib import Path

import torch

from sparsecal.bench import flashinfer_build as fb
from sparsecal.evaluation.speed_stats import round_order
from sparsecal.kernels.sparse.flashinfer_reference import factor_for_share, simulate

WORKSPACE_BYTES = 128 << 20
NOTHING = 1e-9  # a factor > 0 (the skip kernel runs) whose lambda = 1e-9 / N skips no tile here


def tolerance(ref: torch.Tensor) -> float:
    """The bf16 bound of the module docstring for a reference output ``ref``."""
    return 2.0 ** -6 * float(ref.abs().max()) + 2.0 ** -8


class Runner:
    """Calls trtllm_fmha_v2_prefill on one sequence (q [N, H, D], k/v [N, Hkv, D] bf16)."""

    def __init__(self, q, k, v, scale: float):
        self.q, self.k, self.v, self.scale = q, k, v, scale
        n = q.shape[0]
        dev = q.device
        self.n = n
        self.seq_lens = torch.tensor([n], dtype=torch.int32, device=dev)
        self.cum = torch.tensor([0, n], dtype=torch.int32, device=dev)
        self.ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.out = torch.empty_like(q)

    def __call__(self, factor: float) -> torch.Tensor:
        from flashinfer.prefill import trtllm_fmha_v2_prefill

        return trtllm_fmha_v2_prefill(
            (self.q, self.k, self.v), "SEPARATE_Q_K_V", self.ws, self.seq_lens, self.n, self.n, self.scale, 1.0,
            1, self.cum, self.cum, out=self.out, mask_mode="causal", skip_softmax_threshold_scale_factor=factor)


def diffs(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """got [N, H, D] (kernel layout) against ref [H, N, D] float32."""
    d = (got.float().transpose(0, 1) - ref).abs()
    return {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()), "tolerance": tolerance(ref),
            "nan": bool(torch.isnan(got).any())}


def check_case(mods, q, k, v, scale, targets, hi_factor) -> list[dict]:
    """Dense and each target's factor: kernel output vs simulation, kernel counts vs simulated."""
    qf, kf, vf = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    run = Runner(qf, kf, vf, scale)
    fb.use_module(mods["stock"])
    dense_sim = simulate(q, k, v, 0.0, scale=scale)
    dense_out = run(0.0).clone()
    rows = [{"target": 0.0, "factor": 0.0, "lambda": 0.0, "sim_skipped": 0, "sim_total": dense_sim.total,
             "sim_share": 0.0, **diffs(dense_out, dense_sim.out)}]
    for target in [None] + list(targets):  # None: the skip kernel at a factor that skips nothing
        factor = NOTHING if target is None else factor_for_share(q, k, v, target, lo=1e-3, hi=hi_factor,
                                                                  scale=scale)[0]
        sim = simulate(q, k, v, factor, scale=scale)
        fb.use_module(mods["stock"])
        out = run(factor).clone()
        row = {"target": target, "factor": factor, "lambda": factor / q.shape[1], "sim_skipped": sim.skipped,
               "sim_total": sim.total, "sim_share": sim.share, **diffs(out, sim.out),
               "skip_effect_max_abs": float((sim.out - dense_sim.out).abs().max()),
               "kernel_vs_dense_max_abs": float((out.float() - dense_out.float()).abs().max())}
        if "stat" in mods:
            fb.use_module(mods["stat"])
            fb.zero_stat(run.ws)
            out_stat = run(factor)
            torch.cuda.synchronize()
            total, skipped = fb.stat_counts(run.ws)
            row.update(kernel_total=total, kernel_skipped=skipped, kernel_share=skipped / total if total else None,
                       stat_output_equal=bool(torch.equal(out_stat, out)))
        rows.append(row)
    fb.use_module(mods["stock"])
    return rows


def time_case(mods, q, k, v, scale, factors, rounds: int) -> dict:
    """Medians (ms) of dense FlashInfer, skip FlashInfer per factor, SDPA cuDNN / FLASH."""
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qf, kf, vf = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    run = Runner(qf, kf, vf, scale)
    fb.use_module(mods["stock"])
    h, hkv = q.shape[0], k.shape[0]
    q4, k4, v4 = q[None], k.repeat_interleave(h // hkv, 0)[None], v.repeat_interleave(h // hkv, 0)[None]
    fns = {"flashinfer_dense": lambda: run(0.0), "flashinfer_skip_nothing": lambda: run(NOTHING)}
    for f in factors:
        fns[f"flashinfer_skip@{f:.6g}"] = (lambda f=f: run(f))
    for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def sdpa(be=be):
            with sdpa_kernel([be]):
                return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
        fns[name] = sdpa
    times: dict[str, list[float]] = {name: [] for name in fns}
    how = {}
    for r in range(rounds):
        for name in round_order(fns, r):
            fn = fns[name]
            try:
                times[name].append(tt.do_bench_cudagraph(fn, rep=200, return_mode="median"))
                how[name] = "cudagraph"
            except Exception as e:  # a backend that cannot run or be captured here
                try:
                    times[name].append(tt.do_bench(fn, warmup=50, rep=200, return_mode="median"))
                    how[name] = f"do_bench ({type(e).__name__})"
                except Exception as e2:
                    how[name] = f"failed: {type(e2).__name__}: {str(e2)[:160]}"
    med = {name: statistics.median(v) for name, v in times.items() if v}
    n, d = q.shape[1], q.shape[2]
    flops = 2 * 2 * h * n * n * d / 2
    return {"ms": med, "all_ms": times, "how": how, "tflops": {k_: flops / (t * 1e-3) / 1e12 for k_, t in med.items()},
            "flop_formula": "2*2*H*N^2*D/2 (causal)"}


def build_all(d: int, prebuilt, stat: bool, log: list) -> dict:
    """The stock module (required) and the stat module (skipped, with the error logged, if it fails)."""
    mods = {}
    for variant in ("stock", "stat") if stat else ("stock",):
        try:
            mods[variant], info = fb.build(variant, d, prebuilt)
        except Exception as e:
            if variant == "stock":
                raise
            info = {"variant": variant, "error": f"{type(e).__name__}: {str(e)[-800:]}"}
        log.append(info)
        print("built", info, flush=True)
    return mods


def provenance() -> dict:
    import flashinfer
    import triton

    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "sms": p.multi_processor_count, "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "flashinfer": flashinfer.__version__,
            "flashinfer_commit": getattr(flashinfer, "__git_commit__", None), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def load(path: Path, dev):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        layers = json.loads(meta["layers"])
        data = {i: tuple(f.get_tensor(f"L{i}.{x}").to(dev) for x in "qkv") for i in layers}
    return meta, data


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qkv", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prebuilt", type=Path, default=None)
    ap.add_argument("--targets", default="0.3,0.5,0.7")
    ap.add_argument("--prefix", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-layer", type=int, default=None, help="layer timed per length (default: the middle one)")
    ap.add_argument("--time-all", action="store_true", help="time every layer of every full-length capture")
    ap.add_argument("--no-stat", action="store_true")
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    targets = [float(x) for x in a.targets.split(",")]
    result = {"kind": "sparsecal-flashinfer-skip", "provenance": {**provenance(), "sparsecal_commit": a.commit},
              "tolerance": "|kernel - simulation| <= 2^-6 * max|simulation| + 2^-8", "cases": [], "timing": [],
              "build": []}
    files = sorted(a.qkv.glob("qkv-*.safetensors"), key=lambda p: int(p.stem.split("-")[1]))
    d = next(iter(load(files[0], dev)[1].values()))[0].shape[-1]
    mods = build_all(d, a.prebuilt, not a.no_stat, result["build"])
    for idx, path in enumerate(files):
        meta, data = load(path, dev)
        layers = sorted(data)
        time_layer = a.time_layer if a.time_layer is not None else layers[len(layers) // 2]
        inputs = [(meta["length"], layer, data[layer]) for layer in layers]
        if idx == 0 and a.prefix:
            cut = tuple(t[:, :a.prefix].contiguous() for t in data[layers[0]])
            inputs.append((str(a.prefix), layers[0], cut))
        for n, layer, (q, k, v) in inputs:
            scale = float(meta["scale"]) if meta.get("scale") not in (None, "None") else q.shape[-1] ** -0.5
            rows = check_case(mods, q, k, v, scale, targets, hi_factor=4.0 * q.shape[1])
            for r in rows:
                r.update(n=int(n), layer=layer, task=meta["task"], heads=q.shape[0], kv_heads=k.shape[0],
                         d=q.shape[2])
                print(json.dumps({k_: round(v_, 6) if isinstance(v_, float) else v_ for k_, v_ in r.items()}),
                      flush=True)
            result["cases"] += rows
            if (a.time_all or layer == time_layer) and n == meta["length"]:
                sparse = [r for r in rows if r["target"]]
                t = time_case(mods, q, k, v, scale, [r["factor"] for r in sparse], a.rounds)
                t.update(n=int(n), layer=layer, targets=targets, factors=[r["factor"] for r in sparse],
                         sim_shares=[r["sim_share"] for r in sparse],
                         kernel_shares=[r.get("kernel_share") for r in sparse])
                print(json.dumps({"n": n, "layer": layer, "ms": t["ms"], "how": t["how"]}), flush=True)
                result["timing"].append(t)
    from sparsecal.formats.files import atomic_write_text

    a.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, json.dumps(result, indent=1))
    print("wrote", a.out, flush=True)


if __name__ == "__main__":
    main()
