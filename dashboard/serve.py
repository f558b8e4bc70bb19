"""Starting the dashboard server: ``sparsecal dashboard RUN [RUN ...]`` and the end of ``sparsecal
demo``. Light on purpose (no Streamlit import here): the CLI imports it inside the command.

The server is ``python -m streamlit run <this folder>/app.py`` in headless mode on the given
address and port, with the run directories after ``--`` (app.py reads them from its arguments),
result directories in $SPARSECAL_RESULTS, usage statistics off. It runs in the foreground until
Ctrl-C (or until the process is terminated).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from sparsecal.formats.errors import UserError

APP = Path(__file__).with_name("app.py")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(host: str, port: int) -> int:
    """The port to use: ``port``, or a free one when it is 0; refuses a port already taken."""
    if port == 0:
        return free_port(host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            raise UserError(f"port {port} on {host} is in use; pass another --port (0 picks a free one).") from None
    return port


def check_runs(runs) -> list[Path]:
    """Each path must be a run directory (manifest.json) or a directory holding runs."""
    from sparsecal.formats.run import RunStore

    out = []
    for r in runs:
        p = Path(r).expanduser().resolve()
        if not p.is_dir():
            raise UserError(f"{r} is not a directory; give run directories made by `sparsecal capture`.")
        if (p / "manifest.json").is_file():
            RunStore.open(p)  # kind and schema version, one line when wrong
        elif not any((c / "manifest.json").is_file() for c in p.iterdir()):
            raise UserError(f"{r} is neither a sparsecal run nor a directory of runs (no manifest.json); "
                            f"make one with `sparsecal capture --out {r}`.")
        out.append(p)
    return out


def command(runs, host: str, port: int) -> list[str]:
    """The streamlit command line that serves ``runs``."""
    return [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless=true",
            f"--server.address={host}", f"--server.port={port}", "--browser.gatherUsageStats=false",
            "--server.fileWatcherType=none", "--client.toolbarMode=minimal", "--", *map(str, runs)]


def serve(runs, host: str = "127.0.0.1", port: int = 8501, results=(), echo=print) -> int:
    """Serve the dashboard on ``runs`` in the foreground; returns the server's exit code."""
    paths = check_runs(runs)
    port = check_port(host, port)
    env = dict(os.environ)
    if results:
        env["SPARSECAL_RESULTS"] = os.pathsep.join(str(Path(r).expanduser().resolve()) for r in results)
    env.pop("SPARSECAL_RUNS", None)  # the arguments below are what this command serves
    shown = "localhost" if host in ("127.0.0.1", "0.0.0.0", "localhost") else host
    n = sum(1 if (p / "manifest.json").is_file() else sum((c / "manifest.json").is_file() for c in p.iterdir())
            for p in paths)
    echo(f"sparsecal dashboard: serving {n} run{'s' * (n != 1)} at http://{shown}:{port}  (Ctrl-C stops it)")
    proc = subprocess.Popen(command(paths, host, port), env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
