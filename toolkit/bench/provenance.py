"""Who, where and when of a benchmark result: machine, versions, commit, date."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess

from ..runstore import versions


def provenance() -> dict:
    import torch

    commit = os.environ.get("SPARSECAL_COMMIT")  # a copy without its own git metadata names its commit
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__), timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit, "host_cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "versions": versions(),
    }
