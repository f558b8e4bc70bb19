"""Starting the dashboard server: ``sparsecal dashboard RUN [RUN ...]`` and the end of ``sparsecal
demo``. Light on purpose (no Streamlit import here): the CLI imports it inside the command.

The server is ``python -m streamlit run <this folder>/app.py`` in headless mode on the given
address and port, with the run directories after ``--`` (app.py reads them from its arguments),
result directories in $SPARSECAL_RESULTS, usage statistics off. It runs in the foreground until
Ctrl-C (or until the process is terminated); the server gets a parent-death signal, so it never
outlives this process (a SIGKILL of ``sparsecal dashboard`` frees the port too).
"""
from __future__ import annotations

import errno
import os
import signal
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
    """The port to use: ``port``, or a free one when it is 0; refuses a port out of range, a host
    that is not an address of this machine, and a port already taken."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port; give one in 1-65535 (0 picks a free one).")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, port))
            return s.getsockname()[1]
    except socket.gaierror:
        raise UserError(f"--host {host} is not a name or address this machine can resolve; use 127.0.0.1 "
                        "or 0.0.0.0.") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is in use; pass another --port (0 picks a free one).") from None
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); --host must be an address of this "
                        "machine (127.0.0.1, 0.0.0.0).") from None


def manifest_kind(path: Path) -> str | None:
    """The ``kind`` of PATH/manifest.json (None: no readable manifest there)."""
    import json

    try:
        doc = json.loads((Path(path) / "manifest.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return doc.get("kind") if isinstance(doc, dict) else None


def is_run(path: Path) -> bool:
    """PATH holds a capture run's manifest (an evaluation's data/manifest.json is not one)."""
    from sparsecal.formats.run import RUN_KIND

    return manifest_kind(path) == RUN_KIND


def child_runs(path: Path) -> list[Path]:
    """The capture runs directly inside PATH, sorted."""
    return sorted(c for c in Path(path).iterdir() if c.is_dir() and is_run(c))


def check_runs(runs, pending=()) -> list[Path]:
    """Each path must be a run directory (manifest.json) or a directory holding runs; a path in
    ``pending`` (a run still being captured, as in ``sparsecal demo``) may not exist yet: the app
    shows it once its manifest is written. An evaluation directory is refused with the option that
    shows it (--results)."""
    from sparsecal.formats.run import RunStore

    out = []
    waiting = {Path(r).expanduser().resolve() for r in pending}
    for r in runs:
        p = Path(r).expanduser().resolve()
        if p in waiting and not (p / "manifest.json").is_file():
            out.append(p)
            continue
        if not p.is_dir():
            raise UserError(f"{r} is not a directory; give run directories made by `sparsecal capture`.")
        if (p / "results.json").is_file() or manifest_kind(p / "data") is not None:
            raise UserError(f"{r} is an evaluation directory (`sparsecal eval`), not a run: show it on the "
                            f"Accuracy-speedup page with --results {r}, next to a run.")
        if (p / "manifest.json").is_file():
            RunStore.open(p)  # kind and schema version, one line when wrong
        elif not child_runs(p):
            raise UserError(f"{r} is neither a sparsecal run nor a directory of runs (no manifest.json); "
                            f"make one with `sparsecal capture --out {r}`.")
        out.append(p)
    return out


def command(runs, host: str, port: int) -> list[str]:
    """The streamlit command line that serves ``runs``."""
    return [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless=true",
            f"--server.address={host}", f"--server.port={port}", "--browser.gatherUsageStats=false",
            "--server.fileWatcherType=none", "--client.toolbarMode=minimal", "--", *map(str, runs)]


def start(runs, host: str = "127.0.0.1", port: int = 8501, results=(), pending=(), echo=print) -> subprocess.Popen:
    """Start the dashboard server on ``runs`` in the background and print its URL; returns the
    server process (``wait`` or ``stop`` it)."""
    paths = check_runs(runs, pending)
    for r in results:
        if not Path(r).expanduser().is_dir():
            raise UserError(f"--results {r} is not a directory; give an evaluation directory (`sparsecal eval "
                            "--out`) or a directory of result files.")
    port = check_port(host, port)
    env = dict(os.environ)
    if results:
        env["SPARSECAL_RESULTS"] = os.pathsep.join(str(Path(r).expanduser().resolve()) for r in results)
    env.pop("SPARSECAL_RUNS", None)  # the arguments below are what this command serves
    shown = "localhost" if host in ("127.0.0.1", "0.0.0.0", "localhost") else host
    n = sum(1 if (p / "manifest.json").is_file() else len(child_runs(p)) for p in paths if p.is_dir())
    echo(f"sparsecal dashboard: serving {n} run{'s' * (n != 1)} at http://{shown}:{port}  (Ctrl-C stops it)")
    from sparsecal.formats.children import preexec

    # the server ends with this process, however it ends (SIGKILL included): formats/children.py
    return subprocess.Popen(command(paths, host, port), env=env, preexec_fn=preexec())


def stop(proc: subprocess.Popen) -> int:
    """Terminate a server started by ``start`` (killed after 10 s); returns its exit code."""
    proc.terminate()
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def stop_on_signals():
    """Turn SIGTERM and SIGHUP into KeyboardInterrupt (as Ctrl-C), so the server child is stopped
    on every way out instead of being orphaned; returns the previous handlers."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}


def serve(runs, host: str = "127.0.0.1", port: int = 8501, results=(), echo=print) -> int:
    """Serve the dashboard on ``runs`` in the foreground; returns the server's exit code."""
    proc = start(runs, host, port, results, echo=echo)
    stop_on_signals()
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return stop(proc)
