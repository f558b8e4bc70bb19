"""`python -m sparsecal` is the sparsecal command, under torchrun too (issue 29, item 4).

A tiny random-weight Llama checkpoint (helpers.make_checkpoint) and a token-id prompts file: the
command in one process and `torchrun --nproc-per-node 2 -m sparsecal capture ...`
(gloo on the CPU) write the same run: the same planned samples, each finished once, with
bit-identical statistics. Every process runs one intra-op thread, so the reductions agree bit for bit.
"""
import os
import subprocess
import sys

from test_distributed import assert_same_run, in_process

from helpers import make_checkpoint, write_prompts

ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")
OPTIONS = ["--backend", "reference", "--block-m", "32", "--block-n", "16", "--k", "2,4", "--decode-rows", "8"]


def run(cmd: list) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=ONE_THREAD, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_module_entry_point_prints_the_cli_help():
    out = subprocess.run([sys.executable, "-m", "sparsecal", "capture", "--help"], capture_output=True, text=True,
                         env=ONE_THREAD, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--prompts-file" in out.stdout and "--gpus" in out.stdout


def test_torchrun_two_ranks_write_the_run_of_one_process(tmp_path, seed):
    ckpt = make_checkpoint(tmp_path / "tiny", seed, layers=2)
    prompts = write_prompts(tmp_path / "p.jsonl", [70, 130, 90, 110], seed)
    args = ["capture", "--model", ckpt, "--prompts-file", prompts, *OPTIONS]
    one = in_process(*args, "--out", tmp_path / "one")  # the one-process run, in this process
    assert one.exit_code == 0 and "captured 4 samples, skipped 0 already finished" in one.stderr, one.output
    two = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "sparsecal", *args, "--out", tmp_path / "two"])
    assert "x 2 ranks" in two and "captured 4 samples, skipped 0 already finished" in two
    assert {ln.split("]")[0] for ln in two.splitlines() if "tok/s" in ln} == {"[rank 0/2", "[rank 1/2"}
    assert_same_run(tmp_path / "one", tmp_path / "two")
