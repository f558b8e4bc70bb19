"""Where a captured sample's time goes (``sparsecal capture --profile``).

A ``Profiler`` stamps the boundaries of one sample's phases and adds them up once the sample is
done. On a CUDA device a stamp is a CUDA event recorded on the current stream (no host
synchronisation: ``seconds`` synchronises once per sample, on the last event); on the CPU it is the
wall clock, the work there being synchronous. Phases (seconds, in ``PHASES`` order):

    forward_other      the model forward outside the instrumented attention (projections, MLP,
                       norms, RoPE, logits, the dense attention of layers not captured)
    attention_kernels  the instrumented attention kernels of the captured layers (output, tile
                       statistics, decode rows)
    reductions         the on-device reductions of those statistics into the per-sample forms
                       (BSFA thresholds, histograms); on the one-order Triton path also its
                       decode-row kernel, which runs after the mass pass
    device_to_host     the copies of the reduced statistics to host memory
    serialize          encoding them into the safetensors bytes (sparse histograms as idx/val)
    disk               writing the sample's files and renaming its folder into place

``wall`` is the sample's own wall clock from the start of its forward to its folder in place;
with writes on a background thread the last two run beside the next sample's forward and
``wall`` ends when the sample's statistics are on the host (``write_overlapped``: true).
"""
from __future__ import annotations

import contextlib
import time

import torch

PHASES = ("forward_other", "attention_kernels", "reductions", "device_to_host", "serialize", "disk")
DEVICE_PHASES = ("forward", "attention_kernels", "reductions", "device_to_host")
SHORT = {"forward_other": "fwd", "attention_kernels": "kern", "reductions": "red", "device_to_host": "d2h",
         "serialize": "ser", "disk": "disk"}


class Profiler:
    """Stamps and spans of one sample's device phases (see the module docstring)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.spans: list[tuple[str, object, object]] = []

    def reset(self) -> None:
        self.spans = []

    def stamp(self):
        """A point on the device's timeline: a recorded CUDA event, or the wall clock on a CPU."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, phase: str, start, end) -> None:
        self.spans.append((phase, start, end))

    @contextlib.contextmanager
    def span(self, phase: str):
        start = self.stamp()
        try:
            yield
        finally:
            self.add(phase, start, self.stamp())

    def seconds(self) -> dict[str, float]:
        """{phase: seconds} summed over this sample's spans (one synchronisation on CUDA), with
        ``forward_other`` = the forward less the captured layers' kernels and reductions."""
        if self.cuda and self.spans:
            torch.cuda.synchronize()  # once per sample: every recorded event has completed
        out = {p: 0.0 for p in DEVICE_PHASES}
        for phase, start, end in self.spans:
            out[phase] = out.get(phase, 0.0) + (start.elapsed_time(end) / 1e3 if self.cuda else end - start)
        out["forward_other"] = max(0.0, out.pop("forward") - out["attention_kernels"] - out["reductions"])
        return out


def finish(device_s: dict, host_s: dict, wall: float, overlapped: bool) -> dict:
    """A sample's ``profile`` record: every phase of PHASES in seconds (rounded to 0.1 ms), ``wall``
    and ``write_overlapped``."""
    both = dict(device_s, **host_s)
    out = {p: round(both.get(p, 0.0), 4) for p in PHASES}
    return dict(out, wall=round(wall, 4), write_overlapped=overlapped)


def line(profile: dict) -> str:
    """'fwd 0.52 kern 1.20 red 0.31 d2h 0.10 ser 0.20 disk 0.30 s' for a progress line."""
    return " ".join(f"{SHORT[p]} {profile[p]:.2f}" for p in PHASES) + " s"


def totals(profiles: list[dict]) -> dict:
    """{phase or 'wall': summed seconds} over samples' profile records; 'samples': how many."""
    out = {p: sum(r[p] for r in profiles) for p in (*PHASES, "wall")}
    return dict(out, samples=len(profiles))


def process_age() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since this module's import)."""
    try:
        import os

        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


class Startup:
    """The command's milestones in seconds since its process started: 'cli' (the command parsed,
    torch imported), 'imported' (several ranks: transformers imported, the model's load starts on a
    thread), 'group' (the ranks' process group joined), 'preloaded' (a rank other than 0:
    its imports done while rank 0 checks), 'checked' (rank 0: checks, prompts and plan done),
    'planned' (every rank: rank 0's plan received), 'loaded' (this rank's model loaded), 'warmed'
    (several ranks: its warm-up forward done, capture/command.Early), 'first' (its first sample
    written), 'captured', 'summary'. With several ranks the model loads beside rank 0's checks, so
    the line lists the steps in the order they were reached."""

    STEPS = (("cli", "python+CLI+torch"), ("imported", "transformers import"), ("group", "process group"),
             ("preloaded", "preload"), ("checked", "checks+imports+plan"), ("planned", "wait for rank 0"), ("loaded", "model load"),
             ("warmed", "warm-up"), ("first", "first sample"), ("captured", "other samples"),
             ("summary", "totals+summary"))

    def __init__(self):
        age = process_age()
        self.at = {"cli": age}
        self.started = time.time() - age

    def mark(self, name: str) -> None:
        self.at.setdefault(name, process_age())

    def line(self) -> str:
        """'timeline since the process started (s): python+CLI+torch 0.9, ...; total 60.2; started
        at 1764163200.12' (the steps reached; the start as a Unix time)."""
        parts, last = [], 0.0
        for key, label in sorted(((k, lb) for k, lb in self.STEPS if k in self.at), key=lambda s: self.at[s[0]]):
            parts.append(f"{label} {self.at[key] - last:.1f}")
            last = self.at[key]
        return (f"timeline since the process started (s): {', '.join(parts)}; total {last:.1f}; "
                f"started at {self.started:.2f}")
