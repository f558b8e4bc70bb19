"""Fault injection: what a careful user can do wrong, or what can break, and what sparsecal promises
then: one `error:` line and exit code 2 with nothing written, nothing lost, and the next command
recovers. Concurrent captures into one run, damaged samples and manifests, exports edited by hand,
bad options, OS errors and signals."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from sparsecal.analysis.samples import finished_records
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import load_blasst
from sparsecal.formats.run import RunStore

from helpers import FIXTURE, assert_user_error, cli, make_checkpoint, write_prompts

pytestmark = pytest.mark.faults


def sparsecal(*args, **kw) -> subprocess.Popen:
    """`sparsecal ARGS` in its own process (the console entry point, not CliRunner)."""
    return subprocess.Popen([sys.executable, "-m", "sparsecal.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


@pytest.fixture
def tiny(tmp_path, seed):
    return make_checkpoint(tmp_path / "tiny", seed, layers=2)


def capture(model, prompts, out, *extra):
    return cli("capture", "--model", model, "--prompts-file", prompts, "--out", out, "--k", "1,2", *extra)


# ---- the run store -----------------------------------------------------------------------------
def test_two_concurrent_captures_keep_every_sample(tiny, tmp_path, seed):
    a = write_prompts(tmp_path / "a.jsonl", [70, 90, 110], seed)
    b = write_prompts(tmp_path / "b.jsonl", [80, 100, 120], seed + 1)
    out = tmp_path / "run"
    procs = [sparsecal("capture", "--model", tiny, "--prompts-file", p, "--out", out, "--k", "1,2", "--add")
             for p in (a, b)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    store = RunStore.open(out)
    assert len(store.done_ids()) == 6
    assert {r["id"] for r in store.manifest["samples"]} == store.done_ids()
    assert store.rebuild() == ([], {})


def test_doctor_adds_finished_samples_the_manifest_lost(tiny, tmp_path, seed):
    out = tmp_path / "run"
    assert capture(tiny, write_prompts(tmp_path / "p.jsonl", [70, 90, 110, 130], seed), out).exit_code == 0
    man = json.loads((out / "manifest.json").read_text())
    lost = man["samples"].pop(0)["id"]
    (out / "manifest.json").write_text(json.dumps(man))
    warnings = []
    assert len(finished_records(RunStore.open(out), warnings.append)) == 4  # fit reads all four
    assert "missing from its manifest" in warnings[0] and "sparsecal doctor" in warnings[0]
    res = cli("doctor", out)
    assert res.exit_code == 0 and "added 1" in res.output
    assert lost in {r["id"] for r in RunStore.open(out).manifest["samples"]}


@pytest.mark.parametrize("damage", ["truncated stats", "garbled record", "missing stats"])
def test_damaged_sample_is_named_skipped_and_recaptured(tiny, tmp_path, seed, damage):
    prompts = write_prompts(tmp_path / "p.jsonl", [70, 90, 110, 130], seed)
    out = tmp_path / "run"
    assert capture(tiny, prompts, out).exit_code == 0
    sid = sorted(RunStore.open(out).done_ids())[0]
    folder = out / "samples" / sid
    if damage == "truncated stats":
        data = (folder / "stats.safetensors").read_bytes()
        (folder / "stats.safetensors").write_bytes(data[: len(data) // 3])
    elif damage == "garbled record":
        (folder / "sample.json").write_text("{not json")
    else:
        (folder / "stats.safetensors").unlink()
    store = RunStore.open(out)
    assert sid not in store.done_ids() and sid in store.damaged()
    with pytest.raises(UserError, match="damaged"):
        store.load_sample(sid)
    warnings = []
    assert sid not in {r["id"] for r in finished_records(store, warnings.append)}  # fit leaves it out
    assert "damaged sample" in warnings[0] and sid in warnings[0]
    res = capture(tiny, prompts, out)  # the same command recaptures exactly the damaged sample
    assert res.exit_code == 0 and "captured 1 samples" in res.output
    assert RunStore.open(out).damaged() == {}


def test_damaged_manifest_is_one_line(tiny, tmp_path, seed):
    prompts = write_prompts(tmp_path / "p.jsonl", [70], seed)
    out = tmp_path / "run"
    assert capture(tiny, prompts, out).exit_code == 0
    man = json.loads((out / "manifest.json").read_text())
    del man["config"]
    (out / "manifest.json").write_text(json.dumps(man))
    assert_user_error(cli("fit", out), "lacks 'config'")
    assert_user_error(capture(tiny, prompts, out), "lacks 'config'")


def test_interrupted_sample_write_leaves_no_temp_folder(tmp_path, monkeypatch):
    import numpy as np

    from sparsecal.formats import run as run_module

    store = RunStore.open(shutil.copytree(FIXTURE, tmp_path / "run", ignore=shutil.ignore_patterns("samples")))
    (store.root / "samples").mkdir()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "write_bytes", interrupted)  # Ctrl-C inside the temp folder
    with pytest.raises(KeyboardInterrupt):
        store.write_sample({"id": "s-1-abc"}, {"x": np.zeros(3)})
    assert list((store.root / "samples").iterdir()) == []


# ---- refusing what is refused ------------------------------------------------------------------
def test_other_prompts_into_a_run_need_add_and_mark_fit_stale(tiny, tmp_path, seed):
    out = tmp_path / "run"
    assert capture(tiny, write_prompts(tmp_path / "a.jsonl", [70, 90], seed), out).exit_code == 0
    (out / "fit").mkdir()  # as `sparsecal fit` leaves it
    other = write_prompts(tmp_path / "b.jsonl", [80], seed + 1)
    assert_user_error(capture(tiny, other, out), "--add")
    assert len(RunStore.open(out).manifest["samples"]) == 2
    res = capture(tiny, other, out, "--add")
    assert res.exit_code == 0 and "predate the 1 added samples" in res.output


def test_export_does_not_overwrite_another_runs_export(tmp_path):
    out = tmp_path / "export"
    assert cli("export", FIXTURE, "--out", out).exit_code == 0
    doc = json.loads((out / "blasst.json").read_text())
    doc["run"]["created"] = "another run"
    (out / "blasst.json").write_text(json.dumps(doc))
    before = (out / "thresholds.safetensors").read_bytes()
    assert_user_error(cli("export", FIXTURE, "--out", out), "--force")
    assert (out / "thresholds.safetensors").read_bytes() == before
    assert cli("export", FIXTURE, "--out", out, "--force").exit_code == 0


# ---- exports edited by hand --------------------------------------------------------------------
def _blasst(tmp_path, edit):
    out = tmp_path / "export"
    if not out.is_dir():
        assert cli("export", FIXTURE, "--out", out).exit_code == 0
    doc = json.loads((out / "blasst.json").read_text())
    doc = edit(doc)
    (tmp_path / "blasst.json").write_text(json.dumps(doc))
    return tmp_path / "blasst.json"


def _set(path, value):
    def edit(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return doc
    return edit


@pytest.mark.parametrize("edit, needle", [
    (_set(["threshold_scale_factor", "prefill"], math.nan), "threshold_scale_factor.prefill"),
    (_set(["threshold_scale_factor", "prefill"], 0.0), "finite positive"),
    (_set(["threshold_scale_factor", "prefill"], -5.0), "finite positive"),
    (_set(["threshold_scale_factor", "prefill"], "abc"), "finite positive"),
    (_set(["target_sparsity"], KeyError), "target_sparsity"),
    (_set(["num_layers"], KeyError), "num_layers"),
    (_set(["targets"], "0.5"), "targets"),
    (_set(["targets", 0, "threshold_scale_factor", "decode"], -1.0), "targets[0]"),
    (lambda doc: [doc], "not a BLASST export object"),
    (_set(["threshold_scale_factor", "prefill"], 123.0), "differs from targets"),
], ids=["nan", "zero", "negative", "string", "no-target", "no-layers", "targets-string", "bad-entry",
        "array", "inconsistent"])
def test_blasst_export_is_validated_on_load(tmp_path, edit, needle):
    path = _blasst(tmp_path, edit)
    with pytest.raises(UserError) as e:
        load_blasst(path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_misspelt_expect_key_is_a_programming_error(tmp_path):
    path = _blasst(tmp_path, lambda doc: doc)
    with pytest.raises(ValueError, match="num_head"):
        load_blasst(path, expect={"num_head": 9})


# ---- bad options: nothing written --------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--dtype", "float8"], "Unknown dtype"),
    (["--device", "cuda:7"], "--device"),
    (["--device", "tpu"], "--device"),
])
def test_bad_capture_option_writes_nothing(tiny, tmp_path, seed, args, needle):
    out = tmp_path / "run"
    assert_user_error(capture(tiny, write_prompts(tmp_path / "p.jsonl", [70], seed), out, *args), needle)
    assert not out.exists()


def test_export_max_length_is_bounded_by_the_context(tmp_path):
    assert_user_error(cli("export", FIXTURE, "--out", tmp_path / "e", "--max-length", 100_000_000), "context")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("args, needle", [
    (["capture", "--samples", "0", "--out", "x"], "--samples"),
    (["capture", "--block-m", "0", "--out", "x"], "--block-m"),
    (["fit"], "Missing argument"),
    (["nosuch"], "No such command"),
    (["dashboard", str(FIXTURE), "--port", "99999"], "--port 99999"),
    (["dashboard", str(FIXTURE), "--host", "nosuch.invalid"], "--host"),
    (["export", str(FIXTURE), "--out", "/proc/sparsecal-x"], "/proc/sparsecal-x"),
])
def test_usage_and_os_errors_are_one_line(tmp_path, args, needle):
    p = sparsecal(*args, cwd=tmp_path)
    out, err = p.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert not (tmp_path / "x").exists()


# ---- signals -----------------------------------------------------------------------------------
def test_sigterm_on_dashboard_stops_its_server(tmp_path):
    from sparsecal.dashboard.serve import free_port

    port = free_port()
    p = sparsecal("dashboard", FIXTURE, "--port", port, start_new_session=True)
    deadline = time.monotonic() + 90
    child = None
    while time.monotonic() < deadline and child is None:
        found = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        child = int(found[0]) if found else None
        time.sleep(0.2)
    assert child is not None, "the dashboard started no server process"
    os.kill(p.pid, signal.SIGTERM)
    p.communicate(timeout=30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the streamlit server outlived a SIGTERM to `sparsecal dashboard`")


# ---- BSFA exports and fit outputs ----------------------------------------------------------------
@pytest.mark.parametrize("edit, needle", [
    ("nan", "must be finite or -inf"),
    ("posinf", "must be finite or -inf"),
    ("k_order", "ascending"),
    ("block", "metadata"),
])
def test_bsfa_safetensors_is_validated_on_load(tmp_path, edit, needle):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from sparsecal.formats.exports import load_bsfa

    out = tmp_path / "export"
    assert cli("export", FIXTURE, "--out", out).exit_code == 0
    path = out / "thresholds.safetensors"
    arrays = load_file(str(path))
    with safe_open(str(path), framework="np") as f:
        meta = dict(f.metadata())
    if edit in ("nan", "posinf"):
        arrays["thresholds"][0, 1, 2, 0] = math.nan if edit == "nan" else math.inf
    elif edit == "k_order":
        arrays["k_values"] = arrays["k_values"][::-1].copy()
    else:
        del meta["q_block_size"]
    save_file(arrays, str(path), metadata=meta)
    with pytest.raises(UserError) as e:
        load_bsfa(path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bsfa_pickle_of_another_shape_is_one_line(tmp_path):
    import torch

    from sparsecal.integrations.exports import load_bsfa

    torch.save({"thresholds": torch.zeros(2, 3), "k_values": 5}, tmp_path / "bad.bsfa.pt")
    with pytest.raises(UserError, match="BSFA export keys"):
        load_bsfa(tmp_path / "bad.bsfa.pt")


def test_damaged_fit_thresholds_are_one_line(tmp_path):
    run = shutil.copytree(FIXTURE, tmp_path / "run")
    path = run / "fit" / "bsfa_thresholds.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    assert_user_error(cli("export", run, "--out", tmp_path / "e"), "damaged", "sparsecal fit")


def test_fit_strict_refuses_damaged_samples(tmp_path):
    run = shutil.copytree(FIXTURE, tmp_path / "run")
    sid = sorted(p.name for p in (run / "samples").iterdir())[0]
    (run / "samples" / sid / "sample.json").write_text("[")
    assert_user_error(cli("fit", run, "--strict", "--targets", "0.03"), "damaged", sid)


def test_capture_into_an_unwritable_place_is_one_line(tiny, tmp_path, seed):
    prompts = write_prompts(tmp_path / "p.jsonl", [70], seed)
    assert_user_error(capture(tiny, prompts, "/proc/sparsecal-run"), "/proc/sparsecal-run")


def test_dashboard_export_page_reads_the_validated_blasst(tmp_path):
    from sparsecal.dashboard import data

    out = tmp_path / "export"
    assert cli("export", FIXTURE, "--out", out).exit_code == 0
    for bad in ("[1, 2]", json.dumps({**json.loads((out / "blasst.json").read_text()), "targets": "0.5"})):
        (out / "blasst.json").write_text(bad)
        with pytest.raises(data.Broken):
            data.export_blasst(out)


def test_demo_checks_its_port_before_any_work(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = sparsecal("demo", "--port", port, "--out", tmp_path / "demo")
        _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and err.strip().startswith("error: port") and "in use" in err, err
    assert not (tmp_path / "demo").exists()


def test_temp_sample_folders_of_other_hosts_are_kept_until_stale(tmp_path):
    """Ranks on several hosts share one run directory: a writer cannot see another host's process,
    so that host's temp folder is kept (removed once a day old); this host's dead writers' go."""
    import os
    import subprocess
    import sys
    import time

    from sparsecal.formats.run import FOREIGN_TMP_AGE_S, HOST, RunStore

    info = {"id": "m", "num_layers": 1, "num_heads": 1}
    RunStore.create_or_resume(tmp_path / "run", info, {"block_m": 16}, "float32", "reference")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    samples = tmp_path / "run" / "samples"
    mine, live_there, stale_there = (samples / f".tmp-{n}" for n in (f"a~{HOST}~{dead.pid}", "b~other-host~1",
                                                                       "c~other-host~2"))
    for d in (mine, live_there, stale_there):
        d.mkdir()
    old = time.time() - FOREIGN_TMP_AGE_S - 60
    os.utime(stale_there, (old, old))
    RunStore.create_or_resume(tmp_path / "run", info, {"block_m": 16}, "float32", "reference")
    assert sorted(p.name for p in samples.glob(".tmp-*")) == [live_there.name]
