"""The command line stays light: --help answers without importing torch or transformers."""
import subprocess
import sys


def test_help_imports_no_heavy_modules():
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom sparsecal.cli import app\n"
            "r = CliRunner().invoke(app, ['--help'])\nassert r.exit_code == 0 and 'capture' in r.output\n"
            "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\nprint(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_memory_a_device_lacks_is_one_line_and_exit_code_2(capsys):
    """A command that runs out of memory (the CPU allocator's real refusal here; CUDA's OutOfMemoryError with the
    message s51's 8B timing got) prints one error line with torch's first sentences and what to do, exit 2; any
    other RuntimeError still propagates."""
    import pytest
    import torch
    import typer

    from sparsecal.cli import _user_errors

    def cpu():
        torch.empty((2 ** 61,), dtype=torch.uint8)

    def cuda():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of "
                                     "79.18 GiB of which 1.68 GiB is free. Including non-PyTorch memory, this process "
                                     "has 77.49 GiB memory in use. Of the allocated memory 61.68 GiB is allocated")

    def other():
        raise RuntimeError("Expected all tensors to be on the same device")

    said_cpu = "(DefaultCPUAllocator: can't allocate memory: you tried to allocate 2305843009213693952 bytes)"
    said_cuda = ("(CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
                 "1.68 GiB is free)")
    for fn, said in ((cpu, said_cpu), (cuda, said_cuda)):
        with pytest.raises(typer.Exit) as got:
            _user_errors(fn)()
        err = capsys.readouterr().err
        assert got.value.exit_code == 2 and err.count("\n") == 1 and err.startswith("error: out of memory "), err
        assert said in err and "--lengths" in err and "run the same command again to resume" in err, err
    with pytest.raises(RuntimeError, match="same device"):
        _user_errors(other)()
