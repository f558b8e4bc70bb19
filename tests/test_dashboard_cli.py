"""`sparsecal dashboard`: bad input is one error line and exit code 2 before any server starts;
the server command line it builds."""
import socket
import sys

import pytest
from typer.testing import CliRunner

from sparsecal.cli import app
from sparsecal.dashboard import serve

from helpers import FIXTURE


def _run(*args):
    r = CliRunner().invoke(app, ["dashboard", *map(str, args)])
    return r.exit_code, r.output


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "absent", "is not a directory"),
    (lambda tmp: (tmp / "file.txt").write_text("x") and tmp / "file.txt", "is not a directory"),
    (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "neither a sparsecal run nor a directory of runs"),
    (lambda tmp: (tmp / "old").mkdir() or (tmp / "old" / "manifest.json").write_text(
        '{"kind": "sparsecal-run", "schema_version": 0}') and tmp / "old", "schema version 0"),
])
def test_bad_run_paths(tmp_path, make, message):
    code, out = _run(make(tmp_path))
    assert code == 2 and out.startswith("error: ") and message in out and out.count("\n") == 1, out


def test_port_in_use_is_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code, out = _run(FIXTURE, "--port", s.getsockname()[1])
    assert code == 2 and "is in use" in out and "--port" in out


def test_server_command_line(tmp_path):
    runs = serve.check_runs([FIXTURE, FIXTURE.parent])  # a run, and a directory holding it
    assert runs == [FIXTURE, FIXTURE.parent]
    cmd = serve.command(runs, "127.0.0.1", 8765)
    assert cmd[:5] == [sys.executable, "-m", "streamlit", "run", str(serve.APP)]
    assert "--server.headless=true" in cmd and "--server.port=8765" in cmd
    assert cmd[cmd.index("--") + 1:] == [str(FIXTURE), str(FIXTURE.parent)]
    assert serve.check_port("127.0.0.1", 0) > 0
