"""Start-up of `capture --gpus N` (issue 29, item 3): the launcher starts its ranks before torch is
imported, its device checks agree with torch's, a failed job names the rank that failed first, and
the warm-up prompt has a long prompt's tile multiples.

The two-rank runs themselves (real ranks, real gloo) are in test_distributed.py,
test_capture_torchrun.py and test_faults_options.py.
"""
import subprocess
import sys

import pytest
import torch

from sparsecal.capture.command import CaptureRequest, warm_length
from sparsecal.capture.distributed import _failure, parse_device, rank_env

from helpers import write_prompts

PROBE = """
import sys
import sparsecal.capture.distributed as D
def spawn(n, cmd):
    print("SPAWN", n, sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules))
    return 0
D.spawn = spawn
from sparsecal.cli import run
sys.argv = ["sparsecal", *sys.argv[1:]]
run()
"""


def test_gpus_launcher_spawns_before_importing_torch(tmp_path, seed):
    """The real CLI up to the spawn (option checks included; the model is read by the ranks, so the
    launcher needs none here); at the spawn no torch, transformers or triton has been imported."""
    ckpt = tmp_path / "ckpt"
    prompts = write_prompts(tmp_path / "p.jsonl", [70], seed)
    out = subprocess.run([sys.executable, "-c", PROBE, "capture", "--model", str(ckpt), "--prompts-file",
                          str(prompts), "--out", str(tmp_path / "run"), "--gpus", "2"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "SPAWN 2 []" in out.stdout, out.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text", ["cpu", "cuda", "cuda:1", "cpu:0", "mps:0", "xla", "tpu", "cuda:-1", "cuda: 1",
                                  "CUDA", "cuda:01", "cuda:", ""])
def test_parse_device_agrees_with_torch(text):
    try:
        want = torch.device(text)
    except (RuntimeError, ValueError):
        with pytest.raises(ValueError):
            parse_device(text)
        return
    assert parse_device(text) == (want.type, want.index)


def test_rank_env_is_torchruns_and_keeps_the_users_settings(monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = rank_env(2, 1, 12345)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "1", "2", "12345")
    assert env["TRITON_CACHE_DIR"] == "/somewhere" and int(env["OMP_NUM_THREADS"]) >= 1


def test_failure_names_the_rank_that_failed_first(capsys):
    assert _failure({1: -9, 0: -15}) == 1 and "rank 1 stopped (signal 9)" in capsys.readouterr().err
    assert _failure({1: 1, 0: 1}) == 1 and "rank 0 stopped (exit code 1)" in capsys.readouterr().err
    assert _failure({1: 2, 0: 2}) == 2 and capsys.readouterr().err == ""  # rank 0 printed its one line


def test_warm_up_length_has_a_long_prompts_tile_multiples():
    req = CaptureRequest(out=None, block_m=128, block_n=64)
    n = warm_length(req, 131072, cuda=True)
    assert n == 2048 and n % 16 == 0 and (n // 128) % 16 == 0 and (n // 64) % 16 == 0
    assert warm_length(req, 512, cuda=True) == 512 and warm_length(req, None, cuda=False) == 128


def test_early_loads_on_a_thread_with_a_short_switch_interval_and_restores_it(tmp_path, seed):
    """Early (every rank of several): the model loads and warms up on a thread, with the GIL's switch
    interval at EARLY_SWITCH_S meanwhile (a loading thread waits that long per op for the GIL from the
    checks beside it); ``model`` returns the warmed-up model and restores the interval; the
    timeline has transformers imported before the load and the warm-up."""
    import sys

    from sparsecal.capture.command import EARLY_SWITCH_S, Early
    from sparsecal.capture.distributed import Ranks
    from sparsecal.capture.profile import Startup

    from helpers import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", seed, layers=2, context=256)
    before = sys.getswitchinterval()
    assert before > EARLY_SWITCH_S
    clock = Startup()
    early = Early(CaptureRequest(out=tmp_path / "run", model=str(ckpt), backend="reference"), Ranks(), clock)
    assert sys.getswitchinterval() == EARLY_SWITCH_S
    model = early.model()
    assert sys.getswitchinterval() == before
    assert model.config.num_hidden_layers == 2 and not model.training
    assert clock.at["imported"] <= clock.at["loaded"] <= clock.at["warmed"]
    assert "transformers import" in clock.line() and "warm-up" in clock.line()


def test_early_load_failure_is_raised_where_the_model_is_needed(tmp_path):
    """A checkpoint that cannot load fails in ``model`` (after the checks beside it), not on the
    thread; the switch interval is restored all the same."""
    import sys

    from sparsecal.capture.command import Early
    from sparsecal.capture.distributed import Ranks
    from sparsecal.capture.profile import Startup

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 1}')
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    before = sys.getswitchinterval()
    early = Early(CaptureRequest(out=tmp_path / "run", model=str(bad), backend="reference"), Ranks(), Startup())
    with pytest.raises(Exception):  # noqa: B017 - whichever error the loader raises is re-raised here
        early.model()
    assert sys.getswitchinterval() == before
