"""`sparsecal capture --profile` (issue 29): each sample's phases on the CPU's wall clock.

The phases are stamped inside the real capture (the attention interface, the kernels' boundary,
the copies, the run store's write): every sample.json of a profiled run holds them, they add up
to no more than the sample's wall time, the captured statistics are bit-identical to an
unprofiled run's, and the command prints the table. The Profiler's own sums are checked against
spans of known length.
"""
import json
import time

import pytest

from sparsecal.capture.profile import PHASES, Profiler, finish, totals
from sparsecal.formats.run import RunStore

from helpers import INTERPRETER_WARNINGS, cli, make_checkpoint, write_prompts

OPTIONS = ["--block-m", "32", "--block-n", "16", "--k", "2,4", "--decode-rows", "8"]


def records(out) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "samples").glob("*/sample.json"))]


def test_profiler_sums_spans_and_splits_the_forward():
    prof = Profiler("cpu")
    with prof.span("forward"):
        with prof.span("attention_kernels"):
            time.sleep(0.02)
        with prof.span("reductions"):
            time.sleep(0.01)
        time.sleep(0.03)
    with prof.span("device_to_host"):
        time.sleep(0.01)
    s = prof.seconds()
    assert 0.02 <= s["attention_kernels"] < 0.2 and 0.01 <= s["reductions"] < 0.2
    assert 0.03 <= s["forward_other"] < 0.2 and 0.01 <= s["device_to_host"] < 0.2
    rec = finish(s, {"serialize": 0.5}, 2.0, False)
    assert list(rec)[:len(PHASES)] == list(PHASES) and rec["serialize"] == 0.5 and rec["disk"] == 0.0
    assert totals([rec, rec])["wall"] == 4.0 and totals([rec])["samples"] == 1
    prof.reset()
    assert prof.spans == []


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=INTERPRETER_WARNINGS)])
def test_profiled_capture_records_phases_and_the_same_statistics(tmp_path, seed, backend):
    triton = backend == "triton"  # Triton's CPU interpreter: one short sample of a one-layer model
    ckpt = make_checkpoint(tmp_path / "tiny", seed, layers=1 if triton else 2)
    prompts = write_prompts(tmp_path / "p.jsonl", [40] if triton else [60, 130, 90], seed)
    args = ["capture", "--model", ckpt, "--prompts-file", prompts, "--backend", backend, *OPTIONS]
    res = cli(*args, "--out", tmp_path / "prof", "--profile")
    assert res.exit_code == 0, res.output
    assert "where a sample's time goes" in res.output and "attention_kernels" in res.output
    assert "timeline since the process started" in res.output.replace("\n", " ")
    recs = records(tmp_path / "prof")
    assert recs and all(set(PHASES) | {"wall", "write_overlapped"} <= set(r["profile"]) for r in recs)
    for r in recs:
        p = r["profile"]
        assert all(p[k] >= 0 for k in PHASES)
        assert p["attention_kernels"] > 0 and p["reductions"] > 0 and p["forward_other"] > 0
        assert p["serialize"] > 0 and p["disk"] > 0  # device_to_host: nothing to copy on a CPU
        assert p["write_overlapped"] is True  # written on the background thread
        in_wall = [k for k in PHASES if k not in ("serialize", "disk")]
        assert sum(p[k] for k in in_wall) <= p["wall"] + 1e-3  # parts of the sample's wall time
        assert p["wall"] >= r["seconds"] - 1e-3  # seconds: the previous sample's overlap counted once
    assert "kern " in res.output and "d2h " in res.output  # each sample's progress line
    if triton:
        return  # the statistics of both backends are the kernel tests' business
    plain = cli(*args, "--out", tmp_path / "plain")
    assert plain.exit_code == 0, plain.output
    assert all("profile" not in r for r in records(tmp_path / "plain"))
    a, b = RunStore.open(tmp_path / "plain"), RunStore.open(tmp_path / "prof")
    assert a.done_ids() == b.done_ids()
    for sid in a.done_ids():
        x, y = a.load_sample(sid)[1], b.load_sample(sid)[1]
        assert x.keys() == y.keys() and all(x[k].tobytes() == y[k].tobytes() for k in x), sid


@pytest.mark.parametrize("background", [True, False])
def test_failed_background_write_stops_the_capture_in_one_line(tmp_path, seed, background):
    """A write that fails on the writer thread (here the run's samples/ folder turned into a file, so
    the sample's folder cannot be made) is raised in the capture's thread as the store's one-line
    UserError; nothing is reported finished."""
    from sparsecal.capture.models import load_config, load_model, model_info, resolve_model
    from sparsecal.capture.prompts.jsonl import load_prompts_file
    from sparsecal.capture.runner import run_capture
    from sparsecal.formats.errors import UserError
    from sparsecal.formats.stats_config import StatsConfig

    ms = resolve_model(str(make_checkpoint(tmp_path / "tiny", seed, layers=1)))
    cfg = StatsConfig(block_m=32, block_n=16, k_values=(2,), decode_rows=4)
    store = RunStore.create_or_resume(tmp_path / "run", model_info(ms, load_config(ms)), cfg.to_dict(), "float32",
                                      "reference")
    (tmp_path / "run" / "samples").rmdir()
    (tmp_path / "run" / "samples").write_text("not a folder")
    landed = []
    with pytest.raises(UserError, match="cannot write sample"):
        run_capture(store, load_model(ms), load_prompts_file(write_prompts(tmp_path / "p.jsonl", [40, 50], seed), None),
                    cfg, lambda *a: landed.append(a), background=background)
    assert landed == []
