"""Per-kernel device time of a callable, from the CUDA profiler (torch.profiler): where a variant's
time goes, kernel by kernel, so a benchmark can say which pass limits it (profile, not guess).

``device_us(fn, reps)`` runs ``fn`` once to warm up, then ``reps`` times under the profiler, and
returns {kernel name: microseconds per call} (the kernel names as CUDA reports them; Triton
kernels keep their Python names). ``bandwidth(bytes_, us)`` is the achieved rate in GB/s.
"""
from __future__ import annotations

import torch


def device_us(fn, reps: int = 20) -> dict:
    """{kernel name: device microseconds per call of ``fn``}, summed over the kernel's launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name] = out.get(ev.name, 0.0) + ev.time_range.elapsed_us() / reps  # the kernel's own span
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def pick(times: dict, part: str) -> float:
    """Microseconds of the kernels whose name contains ``part`` (0 when none ran)."""
    return sum(t for name, t in times.items() if part in name)


def bandwidth(nbytes: float, us: float) -> float:
    """GB/s for ``nbytes`` moved in ``us`` microseconds."""
    return nbytes / us / 1e3 if us > 0 else float("nan")
