"""Benchmark: data-parallel capture on two GPUs, and one model spread over two GPUs (issue 18).

One command, within ``--budget`` seconds (default 450), through the real CLI in subprocesses:

    python -m sparsecal.bench.capture_distributed [--layers 8] [--length 32768] [--samples 24]
        [--commit SHA] [--out data/bench/capture-distributed-h200x2.json]

1. model: a random-weight Llama of Llama-3.1-8B's shape (32 heads, 8 KV heads, D=128, MLP 14336,
   vocabulary 128256; ``--layers`` of its 32 layers, bf16), saved as a checkpoint, and
   ``--samples`` random token-id prompts of ``--length`` tokens in a prompts file;
2. warm-up: a one-sample capture, so that the Triton kernels are compiled (and on disk) before
   anything is timed;
3. one rank: ``sparsecal capture`` of the prompts on cuda:0 (triton backend);
4. two ranks: ``torchrun --standalone --nproc-per-node 2 -m sparsecal.cli capture`` of the same
   prompts into a second run; samples/s of each (from the samples' own timestamps, each rank's
   first sample left out: steady state; and the command's own capture-phase figure), the ratio
   (target >= 1.8), and the statistics of the two runs compared sample by sample;
5. device map: ``--device-map auto --max-memory 0=X,1=X`` with X below the model's weights, so
   it does not fit one GPU's budget: where the layers went, per-sample seconds, the peak memory
   per GPU, and the statistics against the one-rank run.

Every launched process gets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1. The result
JSON (provenance, the commands) is written after every step. ``--tiny`` runs the same steps on
the CPU (gloo, a 2-layer Llama, 256 tokens, reference backend): the dry run of the plumbing.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from sparsecal.bench.harness import log, result_file, run_section
from sparsecal.bench.random_model import llama_config, save_checkpoint, write_prompts

TARGET_RATIO = 1.8
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "COLUMNS": "300",
       "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
CAPTURED = re.compile(r"captured (\d+) samples, skipped (\d+) already finished, in ([\d.]+) s(?: on (\d+) ranks)? "
                      r"\(([\d.e+-]+) samples/s\)")
LOADED = re.compile(r"model loaded in ([\d.]+) s \((.*)\)")
PEAK = re.compile(r"(?:rank (\d+) )?(cuda:\d+) ([\d.]+) GiB")


class Setup:
    """Where the bench works and what it runs: the checkpoint, the prompts, the CLI options."""

    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.tiny = args.tiny
        self.ckpt, self.prompts, self.warm = work / "model", work / "prompts.jsonl", work / "warm.jsonl"
        dev = ["--device", "cpu", "--dtype", "float32", "--backend", "reference"] if self.tiny else \
            ["--device", "cuda", "--dtype", "bfloat16", "--backend", "triton"]
        self.options = ["--model", str(self.ckpt), *dev]
        self.deadline = time.monotonic() + args.budget

    def left(self) -> float:
        return self.deadline - time.monotonic()


def build_model(s: Setup) -> dict:
    """Save the random-weight checkpoint and the prompt files; returns what was built."""
    cfg = llama_config(s.args.layers, s.tiny)
    t0 = time.perf_counter()
    weights = save_checkpoint(cfg, s.ckpt, torch.float32 if s.tiny else torch.bfloat16, "cpu" if s.tiny else "cuda")
    write_prompts(s.prompts, cfg.vocab_size, [s.args.length], s.args.samples, seed=1)
    write_prompts(s.warm, cfg.vocab_size, [s.args.length], 1, seed=2)
    log(f"checkpoint: {s.args.layers} layers, {weights / 2**30:.2f} GiB of weights, "
        f"in {time.perf_counter() - t0:.1f} s")
    return {"layers": s.args.layers, "weights_bytes": weights, "config": cfg.to_diff_dict(),
            "shape": "Llama-3.1-8B attention/MLP shape, random weights" + ("" if s.tiny else ", bf16"),
            "length": s.args.length, "samples": s.args.samples}


def run_cli(s: Setup, argv: list[str], ranks: int = 1) -> dict:
    """One `sparsecal` command (through torchrun for several ranks); its parsed report."""
    cmd = [sys.executable, "-m", "sparsecal.cli", *argv] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         "-m", "sparsecal.cli", *argv]
    env = dict(os.environ, **ENV)
    if s.tiny:
        env["OMP_NUM_THREADS"] = "1"
    if s.left() < 20:
        raise RuntimeError("skipped: the time budget is spent")
    log(f"$ {' '.join(cmd)}")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=s.left())
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun passes SIGTERM on to its ranks
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        raise RuntimeError(f"stopped at the time budget: {err[-3000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {err[-3000:]}")
    return dict(parse_report(err), command=" ".join(cmd), wall_s=time.perf_counter() - t0)


def parse_report(text: str) -> dict:
    """The capture command's own figures: samples/s of its capture phase, load times and placement,
    peak memory per GPU."""
    out: dict = {"loaded": [m.groups() for m in LOADED.finditer(text)]}
    found = CAPTURED.search(text)
    if found:
        done, skipped, secs, ranks, rate = found.groups()
        out.update(done=int(done), skipped=int(skipped), capture_s=float(secs), ranks=int(ranks or 1),
                   samples_per_s=float(rate))
    line = next((ln for ln in text.splitlines() if ln.startswith("peak GPU memory:")), "")
    out["peak_gib"] = {f"rank {r or 0} {dev}": float(g) for r, dev, g in PEAK.findall(line)}
    return out


def sample_times(run: Path) -> dict:
    """{sample id: (finished at, seconds)} from each sample.json (its write time and capture time)."""
    out = {}
    for path in (run / "samples").glob("*/sample.json"):
        out[path.parent.name] = (path.stat().st_mtime, json.loads(path.read_text())["seconds"])
    return out


def steady_rate(run: Path, ranks: int) -> dict:
    """Samples/s with each rank's first sample left out (compile-cache loads, allocator warm-up):
    the sum over ranks of (samples - 1) / (last finish - first finish). The ranks' shares are the
    manifest's samples dealt out in turn (equal lengths: distributed.share)."""
    from sparsecal.capture.distributed import share
    from sparsecal.formats.run import RunStore

    ids = [r["id"] for r in RunStore.open(run).manifest["samples"]]
    times = sample_times(run)
    rates, per_rank = [], []
    for r in range(ranks):
        mine = sorted(times[i][0] for i in share(ids, ranks, r, lambda _: 1))
        per_rank.append({"samples": len(mine), "window_s": mine[-1] - mine[0] if mine else 0.0})
        if len(mine) > 1 and mine[-1] > mine[0]:
            rates.append((len(mine) - 1) / (mine[-1] - mine[0]))
    first = min(t - secs for t, secs in times.values())
    return {"steady_samples_per_s": sum(rates) if len(rates) == ranks else None, "per_rank": per_rank,
            "end_to_end_samples_per_s": len(times) / (max(t for t, _ in times.values()) - first),
            "sample_seconds_median": sorted(secs for _, secs in times.values())[len(times) // 2]}


def compare(a: Path, b: Path) -> dict:
    """Run ``b``'s samples against run ``a``'s: how many are bit-identical, and the worst float
    difference and share of moved counts per statistic otherwise."""
    from sparsecal.formats.run import RunStore

    ra, rb = RunStore.open(a), RunStore.open(b)
    identical, worst = 0, {}
    common = sorted(ra.done_ids() & rb.done_ids())
    for sid in common:
        x, y = ra.load_sample(sid)[1], rb.load_sample(sid)[1]
        same = True
        for key, want in x.items():
            got = y[key]
            if want.tobytes() == got.tobytes():
                continue
            same = False
            fin = (want == want) & (abs(want.astype("float64")) != float("inf"))
            diff = abs(got.astype("float64") - want.astype("float64"))[fin]
            worst[key] = max(worst.get(key, 0.0), float(diff.max()) if diff.size else 0.0)
        identical += same
    return {"samples": len(common), "identical": identical, "max_abs_diff": worst}


def throughput(s: Setup, result: dict, save) -> None:
    """Steps 2-4: warm-up, one rank, two ranks, the ratio and the comparison."""
    runs = s.work / "runs"
    run_section(result, "warmup", lambda: run_cli(s, ["capture", *s.options, "--prompts-file", str(s.warm),
                                                      "--out", str(runs / "warm")]), save)
    for ranks in (1, 2):
        out = runs / f"ranks{ranks}"
        key = f"ranks_{ranks}"

        def step(out=out, ranks=ranks):
            report = run_cli(s, ["capture", *s.options, "--prompts-file", str(s.prompts), "--out", str(out)], ranks)
            return dict(report, **steady_rate(out, ranks))

        run_section(result, key, step, save)
        if key in result:
            r = result[key]
            log(f"{ranks} rank(s): {r['steady_samples_per_s']} samples/s steady, {r.get('samples_per_s')} capture "
                f"phase, {r['sample_seconds_median']:.3f} s/sample")
    one, two = result.get("ranks_1"), result.get("ranks_2")
    if one and two:
        result["ratio"] = {k: two[k] / one[k] if one.get(k) and two.get(k) else None
                           for k in ("steady_samples_per_s", "samples_per_s", "end_to_end_samples_per_s")}
        result["ratio"]["target"] = TARGET_RATIO
        run_section(result, "ranks_2_vs_1", lambda: compare(runs / "ranks1", runs / "ranks2"), save)
        log(f"2 ranks / 1 rank: {result['ratio']} (target >= {TARGET_RATIO}); statistics "
            f"{result.get('ranks_2_vs_1')}")
    save()


def device_map(s: Setup, result: dict, save, weights: int) -> None:
    """Step 5: the model over two GPUs within budgets that each hold only part of it."""
    runs = s.work / "runs"
    if s.tiny:
        budget = ["--max-memory", "cpu=4GiB"]
    else:
        each = max(1, int(weights * s.args.map_share / 2**20))
        budget = ["--max-memory", f"0={each}MiB,1={each}MiB"]
    n = s.args.map_samples
    head = s.work / "map.jsonl"
    head.write_text("".join(s.prompts.read_text().splitlines(keepends=True)[:n]))
    out = runs / "device-map"

    def step():
        report = run_cli(s, ["capture", *s.options, "--prompts-file", str(head), "--out", str(out),
                             "--device-map", "auto", *budget])
        times = sample_times(out)
        return dict(report, budget=budget[1], weights_gib=weights / 2**30,
                    sample_seconds=sorted(secs for _, secs in times.values()),
                    vs_ranks_1=compare(runs / "ranks1", out) if (runs / "ranks1").is_dir() else None)

    run_section(result, "device_map", step, save)
    if "device_map" in result:
        r = result["device_map"]
        log(f"device map ({r['budget']}): {r['loaded']}, peak {r['peak_gib']}, s/sample {r['sample_seconds']}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="layers of the 8B-shaped model (of 32)")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--samples", type=int, default=24, help="prompts of the throughput runs")
    ap.add_argument("--map-samples", type=int, default=4, help="prompts of the device-map run")
    ap.add_argument("--map-share", type=float, default=0.7, help="each GPU's --max-memory as a share of the "
                    "weights (0.7: the 8-layer model splits 4+4 layers; 0.6 would spill to disk)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for everything")
    ap.add_argument("--tiny", action="store_true", help="dry run on the CPU: tiny model, gloo, reference backend")
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one, removed)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.length, args.samples = min(args.layers, 2), min(args.length, 256), min(args.samples, 6)
    elif torch.cuda.device_count() < 2:
        sys.exit("error: this benchmark needs 2 CUDA GPUs (or --tiny for the CPU dry run).")
    work = args.work or Path(tempfile.mkdtemp(prefix="sparsecal-bench-"))
    out = args.out or (work / "capture-distributed-dry.json" if args.tiny else
                       Path("data/bench/capture-distributed-h200x2.json"))
    result, save = result_file("capture-distributed", out, args.commit)
    result.update(command=" ".join([sys.executable, "-m", "sparsecal.bench.capture_distributed", *(argv or
                                    sys.argv[1:])]), env=ENV, tiny=args.tiny, budget_s=args.budget)
    s = Setup(args, work)
    try:
        run_section(result, "model", lambda: build_model(s), save)
        if "model" in result:
            throughput(s, result, save)
            device_map(s, result, save, result["model"]["weights_bytes"])
    finally:
        result["elapsed_s"] = args.budget - s.left()
        save()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    log(f"-> {out}")


if __name__ == "__main__":
    main()
