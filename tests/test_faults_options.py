"""Fault injection, round two (issue 30): every option refused before any work, children that end
with the command that started them, and the messages a user sees.

- Options: a bad option of capture, eval, export, fit or verify is one `error:` line and exit code 2
  before the model's config, tokenizer or weights are read and before `--gpus` starts ranks; each
  case runs with those loads and the rank launcher replaced by tripwires that fail the test (so a
  command that started work first is caught, not only a slow one), and leaves nothing written.
- Children: the ranks of `capture --gpus 2` and the Streamlit server of `sparsecal dashboard` end
  within seconds when their launcher is killed with SIGKILL (real torchrun, real gloo ranks on the
  CPU, a real server on a free port); a child whose parent is already gone ends at once.
- Signals and messages: SIGTERM of a capture ends it with one line saying what is kept (exit 143);
  a garbled sample.json leaves one sample out of the dashboard's Overview and Tiles pages, named
  in a warning; an evaluation directory is not offered as a run; the committed calibration says
  its samples are not committed; transformers' GGUF progress bar is silenced.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from streamlit.testing.v1 import AppTest

from sparsecal.formats.errors import UserError
from sparsecal.formats.run import RunStore

from helpers import CALIBRATION, FIXTURE, ROOT, assert_user_error, cli, make_checkpoint, write_prompts

pytestmark = pytest.mark.faults
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")
EVAL_DIR = ROOT / "data" / "eval" / "smollm2-1k-8k-h100"


def sparsecal(*args) -> subprocess.Popen:
    """`sparsecal ARGS` in its own process (the console entry point, as a user runs it)."""
    return subprocess.Popen([sys.executable, "-m", "sparsecal.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ONE_THREAD)


@pytest.fixture
def tiny(tmp_path, seed):
    return make_checkpoint(tmp_path / "tiny", seed, layers=2)


@pytest.fixture
def tripwire(monkeypatch):
    """Reading the model (config, tokenizer, weights) or starting ranks fails the test."""
    import sparsecal.capture.distributed as D
    import sparsecal.capture.models as M

    def trip(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"work started before the options were checked: {name}")
        return fail

    for name in ("load_config", "load_tokenizer", "load_model"):
        monkeypatch.setattr(M, name, trip(name))
    monkeypatch.setattr(D, "launch", trip("launch"))


# ---- options, before any work ------------------------------------------------------------------
CAPTURE_CASES = [
    (["--task", "niah_single", "--lengths", "256,,512"], "has an empty item"),
    (["--task", "niah_single", "--lengths", "256,512,"], "has an empty item"),
    (["--task", "niah_single", "--lengths", "0"], "--lengths 0 is not a positive token count"),
    (["--layers", "3-1"], "the range 3-1 runs backwards; write it low-high (1-3)"),
    (["--layers", "1-x"], "not a list of layer indices"),
    (["--prompts-file", "PROMPTS", "--lengths", "512"], "--lengths sets the length of --task prompts"),
    (["--prompts-file", "PROMPTS", "--samples", "4"], "--samples sets how many --task prompts"),
    (["--prompts-file", "MISSING.jsonl"], "--prompts-file MISSING.jsonl does not exist"),
    (["--backend", "cuda"], "Unknown backend 'cuda'"),
    (["--dtype", "float8"], "Unknown dtype 'float8'"),
    (["--orders", "forward,forward"], "distinct scan orders"),
    (["--k", "0,4"], "--k values must be positive"),
    (["--max-memory", "0=1GiB"], "add --device-map auto"),
    (["--gpus", "2", "--task", "niah_single", "--lengths", "256,,512"], "has an empty item"),
]


@pytest.mark.parametrize("args,needle", CAPTURE_CASES, ids=[" ".join(a) for a, _ in CAPTURE_CASES])
def test_capture_options_refused_before_the_model_is_read(tripwire, tiny, tmp_path, seed, args, needle):
    prompts = write_prompts(tmp_path / "p.jsonl", [64], seed)
    args = [str(prompts) if a == "PROMPTS" else a for a in args]
    res = cli("capture", "--model", tiny, "--out", tmp_path / "run", *args)
    assert_user_error(res, needle)
    assert not (tmp_path / "run").exists()


def _bench_like(tmp_path) -> str:
    path = tmp_path / "not-bench.json"
    path.write_text(json.dumps({"kind": "something else"}))
    return str(path)


EVAL_CASES = [
    (["--bench", "MISSING.json"], "--bench MISSING.json does not exist"),
    (["--bench", "NOT_BENCH"], "is not a `sparsecal bench` result"),
    (["--lengths", "1024,,2048"], "has an empty item"),
    (["--lengths", "0"], "--lengths 0 is not a positive token count"),
    (["--tasks", "nope"], "Unknown task 'nope'"),
    (["--device", "tpu"], "is not a torch device"),
    (["--calibration", "MISSING_RUN"], "--calibration MISSING_RUN is not a directory"),
    (["--gpus", "2", "--bench", "MISSING.json"], "--bench MISSING.json does not exist"),
    (["--methods", "bsfa:4", "--extrapolate"], "--extrapolate applies the BLASST law"),
    (["--gpus", "2", "--methods", "dense", "--extrapolate"], "has no blasst method"),
]


@pytest.mark.parametrize("args,needle", EVAL_CASES, ids=[" ".join(a) for a, _ in EVAL_CASES])
def test_eval_options_refused_before_the_model_is_read(tripwire, tiny, tmp_path, args, needle):
    """`eval --bench MISSING.json` used to compute every row (minutes) before refusing the file."""
    args = [_bench_like(tmp_path) if a == "NOT_BENCH" else a for a in args]
    res = cli("eval", FIXTURE / "export", "--model", tiny, "--out", tmp_path / "ev", *args)
    assert_user_error(res, needle)
    assert not (tmp_path / "ev").exists()


OTHER_CASES = [
    (["export", FIXTURE, "--out", "OUT", "--break-even", "MISSING.json"], "--break-even MISSING.json does not exist"),
    (["export", FIXTURE, "--out", "OUT", "--max-length", "0"], "--max-length 0 is not a positive token count"),
    (["export", FIXTURE, "--out", "OUT", "--target", "1.5"], "--target 1.5 is not a sparsity"),
    (["fit", "RUN", "--targets", "0.5,,0.7"], "--targets '0.5,,0.7' has an empty item"),
    (["verify", FIXTURE / "export", "--lengths", "256,,512"], "--lengths '256,,512' has an empty item"),
    (["fit", "RUN", "--holdout", "1.5"], "--holdout 1.5 must be in [0, 1)"),
    (["dashboard", "RUN", "--results", "MISSING_DIR"], "--results MISSING_DIR is not a directory"),
]


@pytest.mark.parametrize("args,needle", OTHER_CASES, ids=[" ".join(map(str, a[:1] + a[3:])) for a, _ in OTHER_CASES])
def test_export_fit_verify_options_refused_before_reading_the_run(tripwire, tmp_path, args, needle):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    res = cli(*[tmp_path / "out" if a == "OUT" else run if a == "RUN" else a for a in args])
    assert_user_error(res, needle)
    assert not (tmp_path / "out").exists() and sorted(p.relative_to(run) for p in run.rglob("*")) == before


# ---- children end with their launcher ----------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout.split()
    return [int(x) for x in out]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def launcher(tmp_path, *args) -> subprocess.Popen:
    """`sparsecal ARGS` writing to files, not pipes: a child that outlives it cannot hold them open."""
    with open(tmp_path / "launcher.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sparsecal.cli", *map(str, args)], stdout=log,
                                stderr=subprocess.STDOUT, env=ONE_THREAD)
    proc.log = tmp_path / "launcher.log"
    return proc


def _wait(cond, proc, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the command ended first: {proc.log.read_text()[-2000:]}")
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.05)


def _kill_parent_then_watch(proc, children: list[int], gone, seconds: float = 10) -> None:
    """SIGKILL ``proc``; ``gone()`` must hold within ``seconds``. Children still alive after that
    (the failure) are ended here, so that a failing test leaves nothing running."""
    proc.kill()
    proc.wait()
    try:
        _wait(gone, None, seconds, "children ending with their parent")
    finally:
        for pid in filter(_alive, children):
            os.kill(pid, signal.SIGKILL)


def _finished(out) -> int:
    folder = out / "samples"
    return sum(1 for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else 0


def test_ranks_end_when_the_gpus_launcher_is_killed(tiny, tmp_path, seed):
    """`capture --gpus 2` on the CPU (torchrun, gloo): SIGKILL of the launcher once samples land ends
    both ranks within seconds and nothing more is written (they used to finish under PID 1)."""
    prompts = write_prompts(tmp_path / "p.jsonl", [256] * 400, seed)
    out = tmp_path / "run"
    proc = launcher(tmp_path, "capture", "--model", tiny, "--prompts-file", prompts, "--out", out, "--k", "1,2",
                    "--backend", "reference", "--decode-rows", "8", "--gpus", "2")
    ranks = []
    try:
        _wait(lambda: _finished(out) >= 1, proc, 180, "first samples")
        ranks = _children(proc.pid)
        assert len(ranks) == 2
    finally:
        _kill_parent_then_watch(proc, ranks, lambda: not any(map(_alive, ranks)))
    landed = _finished(out)
    time.sleep(1.0)
    assert _finished(out) == landed < 400


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_dashboard_server_ends_when_its_command_is_killed(tmp_path):
    """SIGKILL of `sparsecal dashboard`: its Streamlit child ends and the port is free within seconds."""
    from sparsecal.dashboard.serve import free_port

    port = free_port()
    proc = launcher(tmp_path, "dashboard", FIXTURE, "--port", port)
    server = []
    try:
        _wait(lambda: _listening(port), proc, 120, "the server listening")
        server = _children(proc.pid)
        assert len(server) == 1
    finally:
        _kill_parent_then_watch(proc, server, lambda: not any(map(_alive, server)) and not _listening(port))


def test_a_child_whose_parent_is_gone_ends_at_once():
    """The race of PR_SET_PDEATHSIG: a parent that died before the child asked is caught by getppid()."""
    code = "from sparsecal.formats.children import die_with_parent; die_with_parent(1); print('alive')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert res.stdout == "" and res.returncode == 128 + signal.SIGKILL
    ok = subprocess.run([sys.executable, "-c", code.replace("(1)", f"({os.getpid()})")],
                        capture_output=True, text=True, timeout=60, check=False)
    assert ok.stdout == "alive\n" and ok.returncode == 0


# ---- signals and messages ----------------------------------------------------------------------
def test_sigterm_of_a_capture_says_what_is_kept(tiny, tmp_path, seed):
    prompts = write_prompts(tmp_path / "p.jsonl", [256] * 400, seed)
    out = tmp_path / "run"
    proc = sparsecal("capture", "--model", tiny, "--prompts-file", prompts, "--out", out, "--k", "1,2",
                     "--backend", "reference", "--decode-rows", "8")
    try:
        _wait(lambda: _finished(out) >= 1, proc, 120, "first sample")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    last = err.strip().splitlines()[-1]
    assert last == "terminated (SIGTERM): finished samples are kept; run the same command again to resume."
    store = RunStore.open(out)
    assert store.damaged() == {} and 1 <= len(store.done_ids()) < 400


def test_gguf_progress_bar_is_silenced(capsys):
    """transformers' GGUF loader draws its own tqdm bar; load_model silences it (quiet_gguf)."""
    import transformers.modeling_gguf_pytorch_utils as gguf

    from sparsecal.capture.models import quiet_gguf

    with quiet_gguf():
        list(gguf.tqdm(range(50), desc="Converting and de-quantizing GGUF tensors..."))
    assert "de-quantizing" not in capsys.readouterr().err
    list(gguf.tqdm(range(5), desc="still drawn outside"))
    assert "still drawn outside" in capsys.readouterr().err  # the bar is restored, and visible when drawn


def _app(monkeypatch, run) -> AppTest:
    monkeypatch.setenv("SPARSECAL_RUNS", str(run))
    monkeypatch.setenv("SPARSECAL_RESULTS", "")
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=120)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_garbled_sample_leaves_one_sample_out_of_overview_and_tiles(monkeypatch, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    bad = min((run / "samples").iterdir())
    (bad / "sample.json").write_text('{"id": "garbl')
    at = _app(monkeypatch, run)
    at.switch_page("page_overview.py").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any(bad.name in w.value and "sparsecal doctor" in w.value for w in at.warning)
    frame = at.dataframe[0].value
    assert frame.shape[0] == 8 and int(frame["finished"].sum()) == 7
    at.switch_page("page_tiles.py").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any(bad.name in w.value for w in at.warning) and len(at.get("plotly_chart")) == 3


def test_a_sample_record_with_length_zero_is_left_out_by_name(monkeypatch, tmp_path):
    """The dashboard checks a sample record as the run reader does (formats.sample_values.check_record):
    a length of 0 leaves the sample out with a warning naming it, the other samples are shown."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    bad = min((run / "samples").iterdir())
    rec = json.loads((bad / "sample.json").read_text())
    (bad / "sample.json").write_text(json.dumps(dict(rec, length=0)))
    at = _app(monkeypatch, run)
    at.switch_page("page_overview.py").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any(bad.name in w.value and "length is 0" in w.value for w in at.warning), [w.value for w in at.warning]
    assert int(at.dataframe[0].value["finished"].sum()) == 7


def test_committed_calibration_says_its_samples_are_not_here(monkeypatch):
    at = _app(monkeypatch, CALIBRATION)
    at.switch_page("page_overview.py").run()
    assert not at.exception and not at.error
    planned = len(json.loads((CALIBRATION / "manifest.json").read_text())["samples"])
    assert any(m.label == "samples" and m.value == f"{planned} (not here)" for m in at.metric)
    assert any("not in this directory" in i.value for i in at.info)
    used = json.loads((CALIBRATION / "fit" / "fit.json").read_text())["split"]
    assert int(at.dataframe[0].value["finished"].sum()) == len(used["train"]) + len(used["test"])


def test_an_evaluation_directory_is_not_a_run(tmp_path):
    from sparsecal.dashboard.serve import check_runs, child_runs

    with pytest.raises(UserError, match=r"evaluation directory .*--results"):
        check_runs([EVAL_DIR])
    both = tmp_path / "runs"
    both.mkdir()
    (both / "fixture").symlink_to(FIXTURE)
    (both / "eval").symlink_to(EVAL_DIR)
    assert check_runs([both]) == [both.resolve()] and child_runs(both) == [both / "fixture"]
    res = cli("dashboard", EVAL_DIR)
    assert_user_error(res, "--results")


# ---- the promise list ----------------------------------------------------------------------------
def test_every_promise_names_a_test():
    """docs/testing.md: every promise names tests, and every named test exists; the README (at most
    200 lines) keeps the promise list in its test section and points there."""
    import ast
    import re

    text = (ROOT / "docs" / "testing.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    assert len(sections) >= 6
    for section in sections:
        named = re.findall(r"^- (tests/\w+\.py)::(\w+)$", section, flags=re.MULTILINE)
        assert named, f"the promise '{section.splitlines()[0]}' names no test"
        for module, name in named:
            tree = ast.parse((ROOT / module).read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in defined, f"{module}::{name} is named in docs/testing.md but does not exist"
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    tests = readme.split("## Tests", 1)[1].split("\n## ", 1)[0]
    assert "docs/testing.md" in tests and sum(ln.startswith("- ") for ln in tests.splitlines()) >= 5
