"""A captured sample on its way to disk: copied to host memory beside the next forward, written on
a background thread.

``stage`` stacks the captured layers' reductions into their stored [Lc, ...] forms (storage dtypes,
on the device) and, on a CUDA device, starts one asynchronous copy per statistic into pinned host
memory on a side stream that waits for the forward; no host synchronisation. ``Staged.result()``
waits for that copy (its event) and gives the host tensors.

``SampleWriter`` writes finished samples into the run store on one background thread, at most one
sample behind the capture (so host memory holds at most two samples' statistics): while the GPU
runs sample i + 1, the thread waits for sample i's copy, serializes it and writes its folder. Each
record's ``seconds`` is the time from the later of the sample's start and the previous sample's
statistics reaching the host to its own statistics reaching the host: the per-sample cost of the
pipeline (with nothing overlapped, the sample's own capture time). A failed write (a full disk:
one UserError line) is raised in the capture's thread at the next sample or at the end.

Shape legend
    Lc captured layers
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch


class Staged:
    """A sample's statistics: host tensors once ``result()`` returns (see the module docstring)."""

    def __init__(self, host: dict, event=None, keep=None):
        self.host, self.event, self.keep = host, event, keep

    def result(self) -> dict:
        if self.event is not None:
            self.event.synchronize()
            self.event, self.keep = None, None  # the device tensors may go now
        return self.host


def compact(t: torch.Tensor) -> torch.Tensor:
    """Storage dtypes: counts as int32, sums as float32 (analysis adds samples in float64)."""
    if t.dtype == torch.int64:
        return t.to(torch.int32)
    return t.float() if t.dtype == torch.float64 else t


def stage(per_layer: dict, layers: list[int], profiler=None) -> Staged:
    """Stack ``per_layer`` {layer: {name: tensor}} over ``layers`` into {name: [Lc, ...]} in storage
    dtypes and start their copy to host memory (module docstring). ``profiler`` times the copy."""
    names = per_layer[layers[0]].keys()
    stacked = {k: compact(torch.stack([per_layer[i][k] for i in layers])) for k in names}
    device = next(iter(stacked.values())).device
    if device.type != "cuda":
        if profiler is not None:
            with profiler.span("device_to_host"):
                return Staged({k: v.cpu() for k, v in stacked.items()})
        return Staged({k: v.cpu() for k, v in stacked.items()})
    main, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        start = profiler.stamp() if profiler is not None else None
        host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in stacked.items()}
        for k, v in stacked.items():
            host[k].copy_(v, non_blocking=True)
        done = torch.cuda.Event(enable_timing=profiler is not None)
        done.record(side)
    if profiler is not None:
        profiler.add("device_to_host", start, done)
    return Staged(host, done, stacked)


_SIDE: dict = {}


def _side_stream(device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index)
    return _SIDE[index]


class SampleWriter:
    """Writes samples into ``store`` on a background thread (``background=False``: in the caller's
    thread, at submit). Use as a context manager: leaving it waits for the last write."""

    def __init__(self, store, background: bool = True, raw_keys=()):
        self.store, self.raw_keys = store, tuple(raw_keys)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="sparsecal-writer") if background else None
        self.inflight = None
        self.last_ready = 0.0

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        try:
            if kind is None:
                self.drain()
            elif self.inflight is not None:  # stopping: let the sample in flight land whole, or not at all
                self.inflight.exception()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)

    def submit(self, record: dict, staged: Staged, started: float, profile: dict | None = None) -> list[dict]:
        """Queue a captured sample (``started``: its perf_counter start; ``raw_keys`` of its
        statistics go to raw.safetensors); returns the records of the samples written here
        (with ``seconds`` and, when profiled, ``profile``): with a background thread the caller
        collects the previous sample first (``drain``), so that one is the most in flight."""
        job = (record, staged, started, profile)
        if self.pool is None:
            return [self._write(*job)]
        if self.inflight is not None:
            raise RuntimeError("SampleWriter.submit: drain the sample in flight first")
        self.inflight = self.pool.submit(self._write, *job)
        return []

    def drain(self) -> list[dict]:
        """Wait for the write in flight; its record ([] if none)."""
        if self.inflight is None:
            return []
        fut, self.inflight = self.inflight, None
        return [fut.result()]

    def _write(self, record: dict, staged: Staged, started: float, profile: dict | None):
        stats = dict(staged.result())
        raw_host = {k: stats.pop(k) for k in self.raw_keys if k in stats}
        ready = time.perf_counter()
        secs = ready - max(started, self.last_ready)  # throughput: time two samples overlap counted once
        self.last_ready = ready
        record = dict(record, seconds=round(secs, 3))
        if profile is not None:
            from sparsecal.capture.profile import finish

            # the sample's own wall clock, from its forward: its phases lie inside it even where the
            # previous sample's statistics reached the host after this forward began
            profile = finish(profile, {}, ready - started, self.pool is not None)
        folder = self.store.write_sample(record, stats, raw_host or None, profile=profile)
        return json.loads((folder / "sample.json").read_text()) if profile is not None else record
