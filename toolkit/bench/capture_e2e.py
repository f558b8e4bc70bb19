"""Benchmark: `sparsecal capture` end to end against a plain forward, and 1 vs 2 GPUs (issue 29).

    python -m sparsecal.bench.capture_e2e [--layers 4] [--lengths 32768,65536,131072] [--samples 3]
        [--sections plain,capture,scaling] [--label after] [--work DIR] [--commit SHA] [--out FILE]
        [--cli-pythonpath DIR]
        [--scale-layers 16] [--scale-length 65536] [--scale-samples 16] [--tiny]

Model: a random-weight Llama of Llama-3.1-8B's shape (bench.random_model; ``--layers`` of its 32
layers, bf16), saved once under ``--work`` (kept between invocations that name the same DIR), and
``--samples`` random token-id prompts per length.

plain    the model with PyTorch SDPA (transformers' "sdpa"), batch 1, no KV cache, logits of the
         last position (what capture computes too); per length one warm-up and three timed
         forwards (synchronised wall clock), the median.
capture  the CLI as a user runs it (`python -m sparsecal capture --profile ... --device cuda
         --dtype bfloat16 --backend triton`, a subprocess per length, after one warm-up command
         on a short prompt that fills Triton's on-disk cache): per sample the profile phases
         (capture/profile.py), the steady interval between finished samples (each run's first
         sample left out), bytes stored per sample (and per statistic), the capture phase's
         samples/s, and interval / plain forward (goal <= 2).
scaling  the whole command (process start to exit) for ``--scale-samples`` prompts of
         ``--scale-length`` tokens on a ``--scale-layers`` model: one GPU, then `--gpus 2`;
         the ratio (goal >= 1.8) and each run's start-up (first sample's finish - command start).

``--label`` names this invocation's rows (e.g. before / after, run with different PYTHONPATHs on
one machine); rows of earlier invocations in ``--out`` are kept. ``--tiny`` is the CPU dry run
(a tiny Llama, float32, reference backend, gloo ranks).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from sparsecal.bench.harness import log, run_section
from sparsecal.bench.random_model import llama_config, save_checkpoint, write_prompts

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "COLUMNS": "300",
       "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
CAPTURED = re.compile(r"captured (\d+) samples, skipped \d+ already finished, in ([\d.]+) s")
LOADED = re.compile(r"model loaded in ([\d.]+) s")
TIMELINE = re.compile(r"(?:\[rank (\d+)/\d+\] )?timeline since the process started \(s\): (.*?); total ([\d.]+); "
                      r"started at ([\d.]+)")
PHASES = ("forward_other", "attention_kernels", "reductions", "device_to_host", "serialize", "disk", "wall")


class Bench:
    """Paths, options and the model of one invocation."""

    def __init__(self, args):
        self.args, self.tiny = args, args.tiny
        self.work = Path(args.work)
        self.dev = ["--device", "cpu", "--dtype", "float32", "--backend", "reference"] if self.tiny else \
            ["--device", "cuda", "--dtype", "bfloat16", "--backend", "triton"]

    def checkpoint(self, layers: int) -> Path:
        """The random-weight checkpoint with ``layers`` layers (built once per work directory)."""
        path = self.work / f"model-{layers}l"
        if not (path / "config.json").is_file():
            t0 = time.perf_counter()
            dtype, device = (torch.float32, "cpu") if self.tiny else (torch.bfloat16, "cuda")
            weights = save_checkpoint(llama_config(layers, self.tiny), path, dtype, device)
            log(f"checkpoint {path}: {weights / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
        return path

    def prompts(self, length: int, samples: int, seed: int) -> Path:
        path = self.work / f"prompts-{length}x{samples}-s{seed}.jsonl"
        if not path.is_file():
            write_prompts(path, llama_config(1, self.tiny).vocab_size, [length], samples, seed)
        return path


CLI_PATH: list = []  # --cli-pythonpath: the sparsecal the commands run (another version of it)


def cli(argv: list, gpus: int = 1) -> dict:
    """`python -m sparsecal ARGV` (with `--gpus N` for several); its wall time and report."""
    cmd = [sys.executable, "-m", "sparsecal", *map(str, argv)] + (["--gpus", str(gpus)] if gpus > 1 else [])
    log("$ " + " ".join(cmd))
    env = dict(os.environ, **ENV)
    if CLI_PATH:
        env["PYTHONPATH"] = CLI_PATH[0]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-3000:]}")
    found = CAPTURED.search(proc.stderr)
    return {"command": " ".join(cmd), "started": t0, "wall_s": wall,
            "capture_s": float(found.group(2)) if found else None, "done": int(found.group(1)) if found else None,
            "load_s": [float(x) for x in LOADED.findall(proc.stderr)], "timeline_s": timeline(proc.stderr),
            "stderr_tail": proc.stderr[-1500:]}


def timeline(text: str) -> dict | None:
    """Each rank's --profile timeline: {rank: {step: seconds, 'total': s, 'started': Unix time}}."""
    out = {}
    for rank, steps, total, started in TIMELINE.findall(text.replace("\n", " ")):
        row = {}
        for part in steps.split(", "):
            label, _, value = part.rpartition(" ")
            row[label.strip()] = float(value)
        out[int(rank or 0)] = dict(row, total=float(total), started=float(started))
    return out or None


def sample_rows(run: Path) -> list[dict]:
    """Each finished sample: its finish time (sample.json's mtime), record and bytes on disk."""
    rows = []
    for path in (run / "samples").glob("*/sample.json"):
        rec = json.loads(path.read_text())
        files = {p.name: p.stat().st_size for p in path.parent.iterdir()}
        rows.append({"finished": path.stat().st_mtime, "record": rec, "bytes": sum(files.values()), "files": files})
    return sorted(rows, key=lambda r: r["finished"])


def stat_bytes(run: Path) -> dict:
    """{statistic: bytes in one sample's stats.safetensors} (sparse pairs summed under their name)."""
    path = next((run / "samples").glob("*/stats.safetensors"))
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    out: dict = {}
    for key, info in header.items():
        if key != "__metadata__":
            name = key.rsplit(".", 1)[0] if key.endswith((".idx", ".val")) else key
            out[name] = out.get(name, 0) + info["data_offsets"][1] - info["data_offsets"][0]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@torch.no_grad()
def plain(b: Bench) -> dict:
    """Median synchronised wall time of the plain SDPA forward at each length."""
    from sparsecal.capture.models import load_model, resolve_model

    device = "cpu" if b.tiny else "cuda"
    model = load_model(resolve_model(str(b.checkpoint(b.args.layers))), "float32" if b.tiny else "bfloat16", device)
    out = {}
    for n in b.args.lengths:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(device)
        times = []
        for _ in range(4):
            if not b.tiny:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            if not b.tiny:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[str(n)] = {"seconds": times[1:], "median_s": statistics.median(times[1:])}
        log(f"plain forward {n} tokens: {out[str(n)]['median_s']:.3f} s")
    del model
    if not b.tiny:
        torch.cuda.empty_cache()
    return out


def capture(b: Bench, result: dict) -> dict:
    """The CLI per length: phases, steady interval, sizes, ratio to the plain forward."""
    ckpt = b.checkpoint(b.args.layers)
    runs = b.work / f"runs-{b.args.label}"
    warm = cli(["capture", "--model", ckpt, *b.dev, "--prompts-file", b.prompts(b.args.warm_length, 1, 7),
                "--out", runs / "warm"])
    out = {"warmup": {k: warm[k] for k in ("wall_s", "load_s")}}
    for n in b.args.lengths:
        run = runs / f"n{n}"
        rep = cli(["capture", "--model", ckpt, *b.dev, "--prompts-file", b.prompts(n, b.args.samples, 1),
                   "--out", run, "--profile"])
        rows = sample_rows(run)
        gaps = [y["finished"] - x["finished"] for x, y in zip(rows, rows[1:])]
        profiles = [r["record"]["profile"] for r in rows[1:]] or [rows[0]["record"]["profile"]]
        row = {"command": rep["command"], "command_wall_s": rep["wall_s"], "capture_s": rep["capture_s"],
               "load_s": rep["load_s"], "samples": len(rows), "intervals_s": gaps,
               "interval_median_s": statistics.median(gaps) if gaps else None,
               "phases_median_s": {p: statistics.median(q[p] for q in profiles) for p in PHASES},
               "write_overlapped": profiles[0].get("write_overlapped"),
               "sample_bytes": rows[0]["bytes"], "sample_files": rows[0]["files"], "stat_bytes": stat_bytes(run)}
        base = (result.get("plain") or {}).get(str(n), {}).get("median_s")
        if base and row["interval_median_s"]:
            row["ratio_interval_to_plain"] = row["interval_median_s"] / base
            row["ratio_wall_to_plain"] = row["phases_median_s"]["wall"] / base
        out[str(n)] = row
        log(f"capture {n}: interval {row['interval_median_s']} s, phases {row['phases_median_s']}, "
            f"{row['sample_bytes'] / 2**20:.1f} MiB/sample, ratio {row.get('ratio_interval_to_plain')}")
    return out


def scaling(b: Bench) -> dict:
    """The whole command on one GPU and on two (`--gpus 2`), the same prompts, fresh runs."""
    a = b.args
    ckpt = b.checkpoint(a.scale_layers)
    prompts = b.prompts(a.scale_length, a.scale_samples, 3)
    runs = b.work / f"scale-{a.label}"
    cli(["capture", "--model", ckpt, *b.dev, "--prompts-file", b.prompts(a.warm_length, 1, 7),
         "--out", runs / "warm"])  # Triton's cache and the page cache warm for both
    out = {"layers": a.scale_layers, "length": a.scale_length, "samples": a.scale_samples}
    for gpus in (1, 2):
        rep = cli(["capture", "--model", ckpt, *b.dev, "--prompts-file", prompts, "--out", runs / f"g{gpus}",
                   "--profile"], gpus)
        rows = sample_rows(runs / f"g{gpus}")
        rep.update(first_sample_after_s=rows[0]["finished"] - rep["started"] - rows[0]["record"]["seconds"],
                   last_sample_after_s=rows[-1]["finished"] - rep["started"])
        for r in (rep["timeline_s"] or {}).values():  # when the launcher had the rank's process started
            r["process_started_after_s"] = r["started"] - rep["started"]
        rep.pop("started")
        out[f"gpus_{gpus}"] = rep
        log(f"{gpus} GPU(s): whole command {rep['wall_s']:.1f} s, capture phase {rep['capture_s']} s, "
            f"first sample started after {rep['first_sample_after_s']:.1f} s; rank 0 {rep['timeline_s']}")
    out["ratio_whole_command"] = out["gpus_1"]["wall_s"] / out["gpus_2"]["wall_s"]
    out["ratio_capture_phase"] = out["gpus_1"]["capture_s"] / out["gpus_2"]["capture_s"]
    log(f"1 -> 2 GPUs: whole command {out['ratio_whole_command']:.2f}x (goal >= 1.8), capture phase "
        f"{out['ratio_capture_phase']:.2f}x")
    return out


def load_result(path: Path, commit: str | None) -> tuple:
    """(the result file with earlier invocations' rows, its save(), this invocation's provenance)."""
    from sparsecal.formats.provenance import provenance

    result = json.loads(path.read_text()) if path.is_file() else {"benchmark": "capture-e2e"}
    prov = provenance()
    prov["commit"] = commit or prov["commit"]
    result.setdefault("provenance", {})

    def save():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))

    return result, save, prov


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lengths", default="32768,65536,131072")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--warm-length", type=int, default=2048)
    ap.add_argument("--sections", default="plain,capture")
    ap.add_argument("--label", default="run")
    ap.add_argument("--scale-layers", type=int, default=16)
    ap.add_argument("--scale-length", type=int, default=65536)
    ap.add_argument("--scale-samples", type=int, default=16)
    ap.add_argument("--work", default="/tmp/sparsecal-capture-e2e")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", type=Path, default=Path("data/bench/capture-e2e-h100.json"))
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny Llama, float32, reference backend")
    ap.add_argument("--cli-pythonpath", default=None, help="PYTHONPATH of the sparsecal commands (default: "
                    "this one's): to measure another version of the capture on the same machine")
    args = ap.parse_args(argv)
    if args.cli_pythonpath:
        CLI_PATH.append(args.cli_pythonpath)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.tiny:
        args.lengths = sorted({min(n, 64 * (i + 2)) for i, n in enumerate(args.lengths)})
        args.scale_layers, args.scale_length, args.warm_length = 2, min(args.scale_length, 128), 64
        args.scale_samples = min(args.scale_samples, 4)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    b = Bench(args)
    result, save, prov = load_result(args.out, args.commit)
    mine = result.setdefault(args.label, {})
    mine.update(provenance=prov, command=" ".join([sys.executable, "-m", "sparsecal.bench.capture_e2e",
                                                    *(argv if argv is not None else sys.argv[1:])]),
                model={"shape": "Llama-3.1-8B attention/MLP shape, random weights", "layers": args.layers,
                       "dtype": "float32" if args.tiny else "bfloat16"}, env=ENV)
    log(f"GPU: {prov['gpu']}, torch {torch.__version__}, label {args.label}")
    sections = args.sections.split(",")
    if "plain" in sections:
        run_section(mine, "plain", lambda: plain(b), save)
    if "capture" in sections:
        base = mine if "plain" in mine else next((v for v in result.values() if isinstance(v, dict)
                                                  and "plain" in v), {})
        run_section(mine, "capture", lambda: capture(b, base), save)
    if "scaling" in sections:
        run_section(mine, "scaling", lambda: scaling(b), save)
    save()
    print_table(result)
    log(f"-> {args.out}")


def print_table(result: dict) -> None:
    """One line per label and length: plain, interval, ratio, the phases, MiB per sample."""
    for label, rows in result.items():
        if not isinstance(rows, dict) or "capture" not in rows:
            continue
        for n, r in rows["capture"].items():
            if n == "warmup" or not isinstance(r, dict):
                continue
            ph = r["phases_median_s"]
            print(f"{label:>8} {n:>7}  interval {r['interval_median_s'] or 0:7.3f} s  ratio "
                  f"{r.get('ratio_interval_to_plain', float('nan')):5.2f}  " +
                  " ".join(f"{p[:6]} {ph[p]:.3f}" for p in PHASES) + f"  {r['sample_bytes'] / 2**20:.1f} MiB")
        if "scaling" in rows:
            s = rows["scaling"]
            print(f"{label:>8} scaling: 1 GPU {s['gpus_1']['wall_s']:.1f} s, 2 GPUs {s['gpus_2']['wall_s']:.1f} s, "
                  f"{s['ratio_whole_command']:.2f}x whole command, {s['ratio_capture_phase']:.2f}x capture phase")


if __name__ == "__main__":
    main()
