"""Data-parallel capture and evaluation on torch.distributed: real torchrun, real gloo, on the CPU.

A two-rank capture of SmolLM2 writes the same run as one process (every statistic bit for bit,
the same planned samples); a two-rank capture whose rank is killed after its first samples land
is finished by one process with nothing lost and nothing twice; a two-rank evaluation gives the
rows of a one-process one. Plus the deterministic share, the ranks' row files, and the placement
options' bad input (one line, exit 2).

Every process runs one intra-op thread (torchrun's default for several ranks; the one-process
runs are set to match), so the floating-point reductions are the same in all of them.
"""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from sparsecal.capture.distributed import Ranks, from_env, parse_max_memory, share
from sparsecal.formats.errors import UserError
from sparsecal.formats.run import RunStore

from helpers import assert_user_error, cli, make_checkpoint, write_prompts

# 4 samples of two lengths (the share deals them out longest first), statistics at a short length
CAPTURE = ["--task", "niah_single", "--lengths", "128,256", "--samples", "2", "--backend", "reference",
           "--k", "4,16", "--decode-rows", "16"]
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")


def sparsecal(*args) -> subprocess.Popen:
    """`sparsecal ARGS` in its own process (as a user runs it)."""
    return subprocess.Popen([sys.executable, "-m", "sparsecal.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ONE_THREAD)


def torchrun(n: int, *args) -> subprocess.Popen:
    """`torchrun --standalone --nproc-per-node N -m sparsecal.cli ARGS` (a free port per job)."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(n), "-m", "sparsecal.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ONE_THREAD)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return err


def in_process(*args):
    """The CLI in this process with one intra-op thread, like every rank."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cli(*args)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smollm2(tok, tmp_path_factory):
    """The default model as a checkpoint directory: the very weights `--model smollm2` loads from its
    GGUF (dequantized, float32) and its tokenizer, so that each process loads it in a second instead
    of parsing the GGUF for 20 s."""
    from transformers import AutoModelForCausalLM

    from sparsecal.capture.models import load_model, resolve_model

    gguf = load_model(resolve_model("smollm2"))
    config = gguf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model does not save; its weights do
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf.state_dict(), assign=True)
    path = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(smollm2, tmp_path_factory):
    """The one-process capture every distributed one must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "run"
    res = in_process("capture", "--model", smollm2, *CAPTURE, "--out", out)
    assert res.exit_code == 0, res.output
    return out


def assert_same_run(want, got) -> None:
    """The same planned samples, each finished once, with bit-identical statistics and the same
    record (but its timing); no temp folders left."""
    a, b = RunStore.open(want), RunStore.open(got)
    ids = [r["id"] for r in a.manifest["samples"]]
    assert [r["id"] for r in b.manifest["samples"]] == ids and len(set(ids)) == len(ids) == 4
    assert a.done_ids() == b.done_ids() == set(ids) and b.damaged() == {}
    assert sorted(p.name for p in (got / "samples").iterdir()) == sorted(ids)  # no temp folder, no extra
    for sid in ids:
        (ra, ta), (rb, tb) = a.load_sample(sid), b.load_sample(sid)
        assert {k: v for k, v in ra.items() if k != "seconds"} == {k: v for k, v in rb.items() if k != "seconds"}
        assert ta.keys() == tb.keys()
        for key in ta:
            x, y = ta[key], tb[key]
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), (sid, key)


def finished(out) -> int:
    folder = out / "samples"
    return sum(1 for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else 0


# ---- capture -----------------------------------------------------------------------------------
@pytest.mark.model
def test_two_ranks_capture_the_run_of_one_process(smollm2, reference, tmp_path):
    out = tmp_path / "run"
    err = finish(torchrun(2, "capture", "--model", smollm2, *CAPTURE, "--out", out))
    assert "x 2 ranks" in err and "captured 4 samples, skipped 0 already finished" in err
    assert {ln.split("]")[0] for ln in err.splitlines() if "tok/s" in ln} == {"[rank 0/2", "[rank 1/2"}
    assert_same_run(reference, out)


@pytest.mark.model
def test_killed_rank_loses_only_unfinished_samples_and_one_process_resumes(smollm2, reference, tmp_path):
    """`--gpus 2` (torchrun from the command itself): one rank is killed once the first samples
    land; the launcher names it in one line; one process then captures exactly what is missing."""
    out = tmp_path / "run"
    proc = sparsecal("capture", "--model", smollm2, *CAPTURE, "--out", out, "--gpus", "2")
    deadline = time.monotonic() + 300
    while finished(out) == 0:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.05)
    ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(ranks) == 2
    os.kill(int(ranks[-1]), signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rank ") and "(signal 9)" in last and "run the same command to resume" in last
    landed = RunStore.open(out).done_ids()
    assert 1 <= len(landed) <= 3
    res = in_process("capture", "--model", smollm2, *CAPTURE, "--out", out)
    assert res.exit_code == 0, res.output
    assert f"captured {4 - len(landed)} samples, skipped {len(landed)} already finished" in res.stderr
    assert_same_run(reference, out)


def test_share_is_deterministic_disjoint_and_longest_first():
    items = [("a", 512), ("b", 128), ("c", 128), ("d", 256), ("e", 128), ("f", 128)]
    length = lambda item: item[1]
    for world in (1, 2, 3, 7):
        parts = [share(items, world, r, length) for r in range(world)]
        assert sorted(x for p in parts for x in p) == sorted(items)
        assert parts == [share(list(items), world, r, length) for r in range(world)]
        assert all(p == sorted(p, key=items.index) for p in parts)  # each part in the list's order
    assert [[n for n, _ in share(items, 2, r, length)] for r in range(2)] == [["a", "e"], ["b", "c", "d", "f"]]
    assert [[n for n, _ in share(items, 3, r, length)] for r in range(3)] == [["a"], ["d", "e"], ["b", "c", "f"]]
    assert Ranks().tag == "" and not Ranks().several and Ranks(1, 2, 1).tag == "\\[rank 1/2] "


def test_ranks_from_the_torchrun_environment():
    assert from_env({}) == Ranks()
    assert from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}) == Ranks(3, 4, 1)
    for bad in ({"WORLD_SIZE": "2", "RANK": "2"}, {"WORLD_SIZE": "two"}, {"WORLD_SIZE": "0"}):
        with pytest.raises(UserError):
            from_env(bad)


# ---- placement options ---------------------------------------------------------------------------
@pytest.fixture
def tiny(tmp_path, seed):
    return make_checkpoint(tmp_path / "tiny", seed, layers=2)


def test_placement_and_memory_lines():
    from types import SimpleNamespace

    from sparsecal.capture.distributed import memory_line, placement

    where = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.3": 0,
             "model.layers.2": 1, "model.layers.4": "cuda:1", "model.norm": "cpu", "lm_head": "cpu"}
    assert placement(SimpleNamespace(hf_device_map=where)) == \
        "cuda:0 layers 0-1,3 + 1 other modules; cuda:1 layers 2,4; cpu 2 other modules"
    assert memory_line([{"cuda:0": 3 * 2**30, "cuda:1": 2**29}]) == "peak GPU memory: cuda:0 3.00 GiB, cuda:1 0.50 GiB"
    assert memory_line([{"cuda:0": 2**30}, {"cuda:1": 2**31}]) == \
        "peak GPU memory: rank 0 cuda:0 1.00 GiB, rank 1 cuda:1 2.00 GiB"
    assert memory_line([{}, {}]) == ""


def test_max_memory_grammar():
    assert parse_max_memory("0=20GiB, 1=18.5GB,cpu=64GiB") == {0: "20GiB", 1: "18.5GB", "cpu": "64GiB"}
    for bad in ("0:20GiB", "gpu0=20GiB", "0=20", "0=20TB", "0=1GiB,0=2GiB", ""):
        with pytest.raises(UserError):
            parse_max_memory(bad)


@pytest.mark.parametrize("args,needle", [
    (["--device-map", "balanced"], "only 'auto'"),
    (["--max-memory", "cpu=8GiB"], "add --device-map auto"),
    (["--device-map", "auto", "--max-memory", "0:20GiB"], "each item is GPU=SIZE or cpu=SIZE"),
    (["--device-map", "auto", "--max-memory", "0=20GiB"], "names GPU 0"),
    (["--device-map", "auto", "--device", "cpu:0"], "give --device cpu, not cpu:0"),
    (["--device-map", "auto", "--gpus", "2"], "does not combine with --gpus"),
])
def test_bad_placement_is_one_line_and_writes_nothing(tiny, tmp_path, seed, args, needle):
    out = tmp_path / "run"
    prompts = write_prompts(tmp_path / "p.jsonl", [70], seed)
    assert_user_error(cli("capture", "--model", tiny, "--prompts-file", prompts, "--out", out, *args), needle)
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpus_without_gpus_is_one_line(tiny, tmp_path, seed):
    out = tmp_path / "run"
    prompts = write_prompts(tmp_path / "p.jsonl", [70], seed)
    assert_user_error(cli("capture", "--model", tiny, "--prompts-file", prompts, "--out", out, "--device", "cuda",
                          "--gpus", "2"), "--gpus 2: only 0 CUDA device(s)")
    assert not out.exists()


def test_device_map_auto_on_the_cpu_captures_the_same_statistics(tiny, tmp_path, seed):
    prompts = write_prompts(tmp_path / "p.jsonl", [70, 130], seed)
    base = ["capture", "--model", tiny, "--prompts-file", prompts, "--k", "1,2"]
    for name, extra in (("plain", []), ("auto", ["--device-map", "auto"]),
                        ("budget", ["--device-map", "auto", "--max-memory", "cpu=4GiB"])):
        res = in_process(*base, "--out", tmp_path / name, *extra)
        assert res.exit_code == 0, res.output
    for name in ("auto", "budget"):
        a, b = RunStore.open(tmp_path / "plain"), RunStore.open(tmp_path / name)
        for sid in a.done_ids():
            ta, tb = a.load_sample(sid)[1], b.load_sample(sid)[1]
            assert all(ta[k].tobytes() == tb[k].tobytes() for k in ta), (name, sid)
    # a budget the model does not fit is found by the placement itself, after the run is planned
    res = cli(*base, "--out", tmp_path / "tight", "--device-map", "auto", "--max-memory", "cpu=1KB")
    assert res.exit_code == 2 and res.stderr.strip().splitlines()[-1].startswith("error: --max-memory leaves no room")


# ---- evaluation ----------------------------------------------------------------------------------
def _noop_export(out, model_id: str, layers: int, heads: int):
    """An export of ``model_id`` that skips nothing (BSFA thresholds -inf, k = 1, 2)."""
    from sparsecal.formats.exports import write_blasst
    from sparsecal.integrations.exports import write_bsfa

    from helpers import NOOP_BLASST_FACTOR

    out.mkdir()
    write_bsfa(out, torch.full((2, layers, heads, 4), -math.inf), [1, 2], 128, 64, "mean", {"model": model_id})
    write_blasst(out, {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": NOOP_BLASST_FACTOR,
                                                                   "decode": NOOP_BLASST_FACTOR},
                       "target_sparsity": 0.5, "targets": [], "model": model_id, "num_layers": layers,
                       "num_heads": heads, "q_block_size": 128, "k_block_size": 64, "schema_version": 1})
    return out


def test_two_rank_eval_gives_the_rows_of_one_process(tok, tmp_path, seed):
    """A tiny random Llama with SmolLM2's tokenizer (real task prompts, fast model): `eval --gpus 2`
    writes each rank's rows to its own file and rank 0 merges them into the one-process table."""
    import polars as pl

    from sparsecal.capture.models import resolve_model

    model = make_checkpoint(tmp_path / "m", seed, heads=2, kv_heads=1, layers=2, vocab_size=len(tok))
    tok.save_pretrained(model)
    exp = _noop_export(tmp_path / "export", resolve_model(str(model)).model_id, 2, 2)
    args = [exp, "--model", model, "--tasks", "niah_single", "--lengths", "200,300", "--methods", "window:0"]
    res = in_process("eval", *args, "--out", tmp_path / "one")
    assert res.exit_code == 0, res.output
    err = finish(sparsecal("eval", *args, "--out", tmp_path / "two", "--gpus", "2"))
    assert "on 2 ranks" in err
    from sparsecal.evaluation.rows import TIMING_COLUMNS as timing
    one, two = (pl.read_parquet(tmp_path / d / "data" / "rows.parquet").drop(*timing).sort("sample_id", "label")
                for d in ("one", "two"))
    assert one.height == 2 * 3 and one.to_dicts() == two.to_dicts()  # dense, dense:fp32, window:0
    assert not list((tmp_path / "two" / "data").glob("rows.part-*"))
    results = json.loads((tmp_path / "two" / "results.json").read_text())
    assert results["rows"] == json.loads((tmp_path / "one" / "results.json").read_text())["rows"]


def test_rank_row_files_are_merged_once(tmp_path):
    """Rows a rank left in its own file (it stopped before rank 0 merged) are read with the table's,
    each (sample, method) once, and folded into rows.parquet by the next run."""
    from sparsecal.evaluation.store import ROWS, EvalStore

    man = {"request": {}, "model": {}, "export": {}, "prompts": [{"id": "s1"}, {"id": "s2"}]}
    store = EvalStore.create(tmp_path / "ev", man)
    store.add_row({"sample_id": "s1", "label": "dense", "score": 1.0})
    for rank, sid in ((1, "s2"), (2, "s1")):  # rank 2 repeats a row the table already has
        part = EvalStore.open(tmp_path / "ev")
        part.own_rows(rank)
        part.add_row({"sample_id": sid, "label": "dense", "score": 0.5})
    assert (tmp_path / "ev" / ROWS).is_file() and len(list((tmp_path / "ev" / "data").glob("rows.part-*"))) == 2
    store = EvalStore.open(tmp_path / "ev")
    assert sorted((r["sample_id"], r["score"]) for r in store.rows) == [("s1", 1.0), ("s2", 0.5)]
    assert store.pending(["dense"]) == {}
    store.merge_parts()
    assert not list((tmp_path / "ev" / "data").glob("rows.part-*"))
    assert sorted(r["sample_id"] for r in EvalStore.open(tmp_path / "ev").rows) == ["s1", "s2"]
