"""Who, where and when of a result file (benchmark or evaluation): machine, versions, commit, date.

Torch-free: the GPU name and torch's thread count are read from an already imported torch (every
caller that measures something has imported it), so reading or writing provenance never loads it.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys

from sparsecal.formats.run import versions


def provenance() -> dict:
    torch = sys.modules.get("torch")  # the caller's torch, never imported here
    commit = os.environ.get("SPARSECAL_COMMIT")  # a copy without its own git metadata names its commit
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=os.path.dirname(__file__), timeout=10,
                                          check=False).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit, "host_cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads() if torch else None,
        "gpu": torch.cuda.get_device_name() if torch and torch.cuda.is_available() else None,
        "versions": versions(),
    }
