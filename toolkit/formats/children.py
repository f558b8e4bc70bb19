"""Child processes that end with their parent: the ranks of ``--gpus N`` and the dashboard's
Streamlit server must not outlive the command that started them, whatever killed it (SIGKILL
included, which leaves the parent no chance to stop them).

On Linux the child asks the kernel for a parent-death signal (``prctl(PR_SET_PDEATHSIG)``): when
the thread that forked it exits, the child gets SIGKILL. The request is made in the child, so a
parent that died before it was made would be missed; the child therefore compares ``getppid()``
with the parent it expects right after the request and ends at once when they differ. Elsewhere
(no prctl) nothing is set up and the children behave as before.

Two ways in: ``preexec`` for a ``subprocess.Popen`` the command starts itself (the dashboard), and
``PARENT_ENV`` for children started by another library (torchrun's ranks): the launcher names
itself in that variable, and the child calls ``adopt_from_env`` at its start.
"""
from __future__ import annotations

import os
import signal
import sys

PARENT_ENV = "SPARSECAL_DIE_WITH_PARENT"  # the launcher's pid, read (and removed) by the child
PR_SET_PDEATHSIG = 1                      # linux/prctl.h


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> bool:
    """In the child: get ``sig`` when the parent dies, and end now if ``parent`` is already gone
    (the child was reparented). False where the kernel offers no parent-death signal."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request: nobody will send the signal
        os._exit(128 + int(sig))
    return True


def preexec(sig: int = signal.SIGKILL):
    """A ``preexec_fn`` for Popen (called in the parent, before the fork): the child dies with
    this process."""
    parent = os.getpid()
    return lambda: die_with_parent(parent, sig)


def launcher_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) naming this process as the parent that
    children started through it must not outlive."""
    out = dict(os.environ if env is None else env)
    out[PARENT_ENV] = str(os.getpid())
    return out


def adopt_from_env(sig: int = signal.SIGKILL) -> bool:
    """In a child started with ``launcher_env``: die with that parent. The variable is removed so
    that this child's own children do not inherit a parent that is not theirs."""
    value = os.environ.pop(PARENT_ENV, None)
    if not value or not value.isdigit():
        return False
    return die_with_parent(int(value), sig)
