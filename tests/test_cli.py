"""The command line stays light: --help answers without importing torch or transformers."""
import subprocess
import sys


def test_help_imports_no_heavy_modules():
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom sparsecal.cli import app\n"
            "r = CliRunner().invoke(app, ['--help'])\nassert r.exit_code == 0 and 'capture' in r.output\n"
            "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\nprint(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
