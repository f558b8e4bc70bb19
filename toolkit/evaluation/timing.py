"""The timing phase of `sparsecal eval`: the speed of exactly the configurations whose accuracy rows
the evaluation holds, measured after those rows, with the GPU to itself.

What is timed, per length N of the evaluation and per evaluated method (``dense`` and every sparse
method; the noise floors ``dense:fp32`` and ``sdpa`` are not configurations anyone deploys):

    ttft   one prefill forward (batch 1, [1, N] prompt ids, last-position logits, KV cache built):
           median of ``reps`` after ``warmup`` (CUDA events on a GPU), and with ``graph`` the same
           forward without a cache captured in a CUDA graph and replayed
    tpot   greedy decode steps from that prompt's cache: ``warmup`` untimed steps, then the median
           of ``decode_steps`` single-step times (eager), and with ``graph`` one decode step against
           the prompt's cache captured in a CUDA graph, the median of ``decode_steps`` replays
           (device time: what a serving engine that replays decode graphs pays; the eager step of a
           small model is host-bound; a step is cheap next to a prefill, so it gets the decode
           count, not ``reps``: with 2 replays the 8B graph TPOT read +-3 %). The prompt's cache
           appends in place (kv_append.in_place: no copy of the whole cache a step, as in serving;
           ``decode_cache`` "in_place", or "dynamic" where a cache layout could not convert)

each against the best PyTorch SDPA on the same length: the model's own attention as causal SDPA
in PyTorch's backend order (``sdpa``) and with cuDNN first (``sdpa_cudnn``, GPU only), the faster
kept per measure. ``rest`` (the attention replaced by a copy of Q) gives the attention share of the
forward a = 1 - rest / best SDPA (from the graph replays where captured: device time; null outside
[0, 1]), and the ideal speedup of a counted sparsity s is
1 / (1 - a * s / 2) (skipping a tile saves its V load and P.V, about half its work), for prefill
and decode alike. Every variant of a length runs in ``rounds`` round-robin rounds and the median
over rounds is kept, so drift hits all alike.

The same configuration: each method is switched on with the very ``sparsify`` call its rows ran
(model.use_method: export, method, value, decode mode, dispatch on or off), on one of its own
evaluated prompts (the one whose row's prefill sparsity is nearest the point's), and the kernels'
skipped / reachable tiles of the timed forwards are recorded and compared with the evaluated rows:
``sparsity_match`` holds when the timed prefill sparsity is within SPARSITY_TOL of the point's (the
mean over tasks of the rows' mean, as the summary reports it) and the timed reachable tiles equal
those of the row of the same prompt (the same layers ran sparse: dispatch that runs a layer dense
counts none of its tiles, so the ratio alone cannot tell the two forms apart);
``decode_sparsity_match`` compares the decode sparsity within SPARSITY_TOL. A point whose timed
counts do not match gets no speedup in the curves. ``--speed-only`` evaluations (a random-weight
checkpoint: no accuracy rows, the accuracy is meaningless) time random token ids instead and have
nothing to compare.

The GPU to itself: the accuracy phase may run several processes on one GPU; each holds a shared
lock on that GPU's lock file (``gpu_lock``) while its model is there, and the timing phase takes it
exclusively, so it starts only when every accuracy process on the GPU has finished and none starts
while it runs. Other programs' processes on the GPU (NVML) are counted before and after and
recorded (``gpu_other_processes``). The timing phase is one process (never a rank of torchrun).

Records: EVAL/data/timing.parquet, one row per (label, length) (TIMING_COLUMNS).
"""
from __future__ import annotations

import contextlib
import functools
import statistics
import time
from dataclasses import dataclass

import torch

from sparsecal.evaluation.kv_append import in_place
from sparsecal.evaluation.speed_stats import round_order
from sparsecal.formats.results import SPEED_INTERVALS, SPEEDS

SPARSITY_TOL = 0.02
PROMPT_SEED = 20261123  # random prompt ids of --speed-only evaluations


@dataclass
class TimingOptions:
    rounds: int = 5        # round-robin rounds over the variants of a length (median kept; from 4: intervals)
    reps: int = 5          # timed prefill forwards per round (median)
    warmup: int = 2        # untimed forwards (and decode steps) first
    graph: bool = True     # also CUDA-graph replays of the prefill and of a decode step (CUDA only)
    decode_steps: int = 16  # timed decode steps (and decode-graph replays) per round (median per step)


def ideal_speedup(share: float, sparsity: float) -> float:
    """Speedup if the attention (share ``share`` of the forward) ran at the kernel ideal."""
    return 1.0 / (1.0 - share * sparsity / 2.0)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """Start/stop of one timed region: CUDA events on a GPU, perf_counter elsewhere; ms."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
        _sync(self.device)
        self.ms = self.a.elapsed_time(self.b) if self.cuda else 1e3 * (time.perf_counter() - self.t0)
        return False


def forward_ms(model, ids, reps: int, warmup: int) -> float:
    """Median wall ms of one prefill forward of ``ids`` [1, N] (synchronized)."""
    times = []
    with torch.no_grad():
        for i in range(warmup + reps):
            with _Clock(ids.device) as c:
                model(ids, logits_to_keep=1)
            if i >= warmup:
                times.append(c.ms)
    return statistics.median(times)


@functools.cache
def _side_stream(index: int):
    """The one side stream of CUDA device ``index`` for the warm-ups before a capture. With a new stream
    a capture, s51's probe (scripts/gpu-timing-memory) saw live memory grow ~32 MiB with each captured
    measure: the size of the cuBLAS workspace PyTorch keeps per stream on Hopper, for the process's life."""
    return torch.cuda.Stream(device=index)


def _replay_ms(warm, record, device, reps: int, warmup: int) -> float:
    """Median ms of replaying a CUDA graph of ``record()``, after ``warm()`` ran ``warmup`` times
    (at least once) on a side stream, as capture needs."""
    dev = torch.device(device)
    side = _side_stream(dev.index if dev.index is not None else torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            warm()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        record()
    times = []
    for i in range(warmup + reps):
        with _Clock(device) as c:
            graph.replay()
        if i >= warmup:
            times.append(c.ms)
    del graph
    return statistics.median(times)


def graph_ms(model, ids, reps: int, warmup: int) -> float:
    """Median ms of the same forward (no KV cache) captured in a CUDA graph and replayed: device
    time without Python's launch cost (which bounds a small model's eager forward)."""
    with torch.no_grad():
        forward = lambda: model(ids, logits_to_keep=1, use_cache=False)
        return _replay_ms(forward, forward, ids.device, reps, warmup)


def decode_ms(model, ids, steps: int, warmup: int) -> dict:
    """Greedy decode from the prompt ``ids`` [1, N]: one untimed prefill, ``warmup`` untimed steps,
    then ``steps`` steps each timed, the cache appending in place; {"ms": median ms per step,
    "skipped", "reachable": the kernels' tiles summed over the timed steps, "cache": "in_place" or
    "dynamic" (kv_append.in_place)}."""
    from sparsecal.evaluation.model import _counts

    times, skipped, reachable = [], 0, 0
    with torch.no_grad():
        out = model(ids, logits_to_keep=1, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        kind = "in_place" if in_place(cache, ids.shape[1] + warmup + steps) else "dynamic"
        for i in range(warmup + steps):
            with _Clock(ids.device) as c:
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            if i >= warmup:
                times.append(c.ms)
                s, r = _counts(model)
                skipped, reachable = skipped + s, reachable + r
    return {"ms": statistics.median(times), "skipped": skipped, "reachable": reachable, "cache": kind}


def decode_graph_ms(model, ids, reps: int, warmup: int) -> float:
    """Median ms of one decode step against the cache of the prompt ``ids`` [1, N], captured in a CUDA
    graph and replayed. Every replay recomputes the same step (position N): warm-ups and the capture
    append to copies of the cache, so the prompt's cache is left as it was (appending in place, as
    ``decode_ms``'s)."""
    import copy

    with torch.no_grad():
        out = model(ids, logits_to_keep=1, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        in_place(cache, ids.shape[1] + 1)
        step = copy.deepcopy(cache)
        return _replay_ms(lambda: model(input_ids=nxt, past_key_values=copy.deepcopy(cache), use_cache=True),
                          lambda: model(input_ids=nxt, past_key_values=step, use_cache=True),
                          ids.device, reps, warmup)


def _causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """Causal SDPA without a mask tensor (unpadded prompts; the sparse functions get none either).
    Under CUDA-graph capture transformers' own "sdpa" path was measured to materialize a mask and
    take a slower kernel (SmolLM2 8K: 38 ms replayed vs 22 ms eager), so the baseline is this."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def _causal_cudnn(module, query, key, value, attention_mask, **kwargs):
    from sparsecal.integrations.sparsify import _sdpa_first

    with _sdpa_first("CUDNN_ATTENTION"):
        return _causal_sdpa(module, query, key, value, attention_mask, **kwargs)


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """Q copied to SDPA's output layout [B, N, H, D]: the forward without the attention kernel."""
    return query.transpose(1, 2).contiguous(), None


BASELINES = {"sdpa": _causal_sdpa, "sdpa_cudnn": _causal_cudnn, "rest": _no_attention}


def baseline_variants(model, cuda: bool) -> dict:
    """{name: (enter, leave)} of the BASELINES (cuDNN first only on a GPU)."""
    from transformers import AttentionInterface

    out = {}
    for name, fn in BASELINES.items():
        if name != "sdpa_cudnn" or cuda:
            AttentionInterface.register(f"sparsecal_{name}", fn)
            out[name] = (lambda n=name: model.set_attn_implementation(f"sparsecal_{n}"),
                         lambda: model.set_attn_implementation("sdpa"))
    return out


# ----------------------------------------------------------------------------- the GPU to itself
def _lock_path(device):
    """The lock file of a CUDA device (by its UUID where torch gives one), None off CUDA."""
    import tempfile
    from pathlib import Path

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return Path(tempfile.gettempdir()) / f"sparsecal-gpu-{uuid or index}.lock"


@contextlib.contextmanager
def gpu_lock(device, exclusive: bool, say=None):
    """Hold ``device``'s lock: shared (an accuracy process) or exclusive (the timing phase: waits
    until no accuracy process holds it). No-op off CUDA."""
    import fcntl

    path = _lock_path(device)
    if path is None:
        yield
        return
    with open(path, "a") as f:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            say and say(f"waiting for {path} (another sparsecal process uses the GPU)")
            fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def other_gpu_processes(device) -> int | None:
    """Compute processes on ``device`` other than this one (NVML), None where NVML cannot say."""
    import os

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return sum(p.pid != os.getpid() for p in procs)
    except Exception:  # noqa: BLE001 - NVML absent or not permitted: unknown, recorded as null
        return None


# ----------------------------------------------------------------------------- the same configuration
def point_sparsity(rows: list[dict], label: str, length: int, key: str = "sparsity") -> float | None:
    """The point's sparsity as the summary reports it: the mean over tasks of the rows' mean
    (None without rows)."""
    by_task: dict = {}
    for r in rows:
        if r["label"] == label and r["length"] == length and r.get(key) is not None:
            by_task.setdefault(r["task"], []).append(float(r[key]))
    if not by_task:
        return None
    return statistics.fmean(statistics.fmean(v) for v in by_task.values())


def pick_prompt(rows: list[dict], label: str, length: int) -> str | None:
    """The sample id of the evaluated row of (label, length) whose prefill sparsity is nearest the
    point's (the first such row on ties; None without rows)."""
    target = point_sparsity(rows, label, length)
    mine = [r for r in rows if r["label"] == label and r["length"] == length]
    if target is None or not mine:
        return None
    return min(mine, key=lambda r: abs(float(r["sparsity"]) - target))["sample_id"]


def timed_methods(methods) -> list:
    """The methods the timing phase times: every evaluated one but the noise floors."""
    return [m for m in methods if not m.is_floor]


def _measure(model, ids, opts: TimingOptions, sparse: bool) -> dict:
    """One round of one variant: eager TTFT (and its kernel counts), graph TTFT, TPOT eager and graph."""
    from sparsecal.evaluation.model import _counts

    cuda = ids.device.type == "cuda"
    got = {"ttft_ms": forward_ms(model, ids, opts.reps, opts.warmup)}
    if sparse:
        got["prefill_skipped"], got["prefill_reachable"] = _counts(model)
        got["sparse_layers"] = int((model.sparsecal_stats["reachable"].sum(1) > 0).sum())
    if opts.graph and cuda:
        try:
            got["ttft_graph_ms"] = graph_ms(model, ids, opts.reps, opts.warmup)
        except RuntimeError as e:  # recorded: graph capture can fail where eager runs
            got["ttft_graph_ms"], got["graph_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    dec = decode_ms(model, ids, opts.decode_steps, opts.warmup)
    got["tpot_ms"], got["decode_cache"] = dec["ms"], dec["cache"]
    if opts.graph and cuda:
        try:
            got["tpot_graph_ms"] = decode_graph_ms(model, ids, opts.decode_steps, opts.warmup)
        except RuntimeError as e:  # recorded beside the prefill's: a decode capture can fail where eager runs
            got["tpot_graph_ms"] = None
            got["graph_error"] = got.get("graph_error") or f"decode {type(e).__name__}: {str(e)[:200]}"
    if sparse:
        got["decode_skipped"], got["decode_reachable"] = dec["skipped"], dec["reachable"]
    return got


def _variants(model, methods, ids_of: dict, base_ids, export_dir, model_id: str, extrapolate: bool = False) -> dict:
    """key -> (ids, enter, leave, sparse): the baselines on ``base_ids``, each method on its own
    prompt ``ids_of[label]``, switched on with the same call its rows ran (model.use_method)."""
    from sparsecal.evaluation.model import use_method
    from sparsecal.integrations.sparsify import densify

    out = {("base", n): (base_ids, enter, leave, False)
           for n, (enter, leave) in baseline_variants(model, base_ids.device.type == "cuda").items()}
    for m in methods:
        out[("method", m.label)] = (ids_of[m.label], lambda m=m: use_method(model, m, export_dir, model_id, extrapolate),
                                    lambda: densify(model), True)
    return out


def time_length(model, methods, ids_of: dict, base_ids, export_dir, model_id: str, opts: TimingOptions,
                extrapolate: bool = False) -> dict:
    """key -> {measure: [one value per round]} for every variant of one length, in round-robin
    rounds (each round enters every variant once, in ``speed_stats.round_order``: reversed every other round)."""
    from sparsecal.integrations.sparsify import densify

    table = _variants(model, methods, ids_of, base_ids, export_dir, model_id, extrapolate)
    got = {key: {} for key in table}
    densify(model)
    for r in range(opts.rounds):
        for key in round_order(table, r):
            ids, enter, leave, sparse = table[key]
            enter()
            try:
                for name, v in _measure(model, ids, opts, sparse).items():
                    got[key].setdefault(name, []).append(v)
            finally:
                leave()
    return got


def _median(values):
    vals = [v for v in values or [] if v is not None]
    return statistics.median(vals) if vals and len(vals) == len(values) else None


def attention_share(rest: float | None, ms: float | None) -> float | None:
    """1 - rest / ms, the attention's share of a forward or step; None where either is missing or
    the share falls outside [0, 1] (an eager batch-1 decode step is host-bound: its attention-free
    twin can time slower than the step itself, which says nothing about the attention)."""
    if not rest or not ms:
        return None
    share = 1.0 - rest / ms
    return share if 0.0 <= share <= 1.0 else None


def _baseline(got: dict) -> dict:
    """Best SDPA per measure (name, ms), the rest ms and the attention shares, from a length's timings."""
    out = {}
    for measure in ("ttft_ms", "ttft_graph_ms", "tpot_ms", "tpot_graph_ms"):
        cands = {n: _median(got[("base", n)].get(measure)) for n in ("sdpa", "sdpa_cudnn") if ("base", n) in got}
        cands = {n: v for n, v in cands.items() if v}
        best = min(cands, key=cands.get) if cands else None
        rest = _median(got[("base", "rest")].get(measure))
        out[measure] = {"best": best, "ms": cands.get(best), "rest": rest,
                        "share": attention_share(rest, cands.get(best)),
                        "rounds": got[("base", best)].get(measure) if best else None}
    return out


SPEEDUPS = dict(zip(SPEEDS, ("ttft_ms", "ttft_graph_ms", "tpot_ms", "tpot_graph_ms")))   # speedup -> its measure


def _intervals(t: dict, base: dict) -> dict:
    """Each speedup's 95% interval (``<speedup>_lo``/``_hi``) from the best SDPA's rounds and the
    configuration's own (speed_stats.ratio_interval: exact, distribution-free; null with fewer than
    4 rounds of either or a round missing), and the graph rounds themselves."""
    from sparsecal.evaluation.speed_stats import ratio_interval

    out = {"ttft_graph_rounds_ms": t.get("ttft_graph_ms"), "tpot_graph_rounds_ms": t.get("tpot_graph_ms")}
    for name, measure in SPEEDUPS.items():
        mine, theirs = t.get(measure) or [], (base.get(measure) or {}).get("rounds") or []
        ok = mine and theirs and all(v is not None and v > 0 for v in [*mine, *theirs])
        ci = ratio_interval(theirs, mine) if ok else {"lo": None, "hi": None}
        out[f"{name}_lo"], out[f"{name}_hi"] = ci["lo"], ci["hi"]
    return out


def _ratio(a, b):
    return a / b if a and b else None


def _tiles(t: dict, kind: str) -> tuple[int | None, int | None, float | None]:
    """(skipped, reachable, sparsity) of the first round's counts (0 when nothing was reachable)."""
    sk, re = t.get(f"{kind}_skipped"), t.get(f"{kind}_reachable")
    if not sk:
        return None, None, None
    return sk[0], re[0], sk[0] / re[0] if re[0] else 0.0


def method_record(m, length: int, t: dict, base: dict, prompt: str | None, rows: list[dict]) -> dict:
    """One timing record: the configuration, its timings, speedups against best SDPA, the ideal,
    the timed counts and their match with the evaluated rows' sparsity."""
    ps, pr, s = _tiles(t, "prefill")
    ds, dr, sd = _tiles(t, "decode")
    want, want_d = point_sparsity(rows, m.label, length), point_sparsity(rows, m.label, length, "decode_sparsity")
    row = next((r for r in rows if r["sample_id"] == prompt and r["label"] == m.label), None)
    row_reach = None if row is None else row["prefill_reachable"]  # the same layers ran sparse: the same count
    ttft, graph, tpot = _median(t["ttft_ms"]), _median(t.get("ttft_graph_ms")), _median(t["tpot_ms"])
    tpot_graph = _median(t.get("tpot_graph_ms"))
    b, g, d = base["ttft_ms"], base["ttft_graph_ms"], base["tpot_ms"]
    dg = base.get("tpot_graph_ms") or {"ms": None}
    a_pre = g["share"] if g.get("share") is not None else b["share"]     # device time where captured
    a_dec = dg["share"] if dg.get("share") is not None else d["share"]
    return {"label": m.label, "method": m.name, "config": m.config, "value": m.value, "decode": m.decode_mode,
            "dispatch": m.dispatch, "length": length, "prompt": prompt,
            "ttft_ms": ttft, "ttft_rounds_ms": t["ttft_ms"], "ttft_graph_ms": graph, "tpot_ms": tpot,
            "tpot_rounds_ms": t["tpot_ms"], "tpot_graph_ms": tpot_graph, "sdpa_tpot_graph_ms": dg["ms"],
            "graph_error": (t.get("graph_error") or [None])[0], "decode_cache": (t.get("decode_cache") or [None])[0],
            "sdpa_ttft_ms": b["ms"], "sdpa_ttft_backend": b["best"], "sdpa_ttft_graph_ms": g["ms"],
            "sdpa_tpot_ms": d["ms"], "sdpa_tpot_backend": d["best"], "rest_ttft_ms": b["rest"],
            "rest_tpot_ms": d["rest"], "attention_share": a_pre, "attention_share_decode": a_dec,
            "speedup_ttft": _ratio(b["ms"], ttft), "speedup_ttft_graph": _ratio(g["ms"], graph),
            "speedup_tpot": _ratio(d["ms"], tpot), "speedup_tpot_graph": _ratio(dg["ms"], tpot_graph),
            "ideal_ttft": ideal_speedup(a_pre, s) if a_pre is not None and s is not None else None,
            "ideal_tpot": ideal_speedup(a_dec, sd) if a_dec is not None and sd is not None else None,
            "prefill_skipped": ps, "prefill_reachable": pr, "sparsity": s,
            "sparse_layers": (t.get("sparse_layers") or [None])[0],
            "decode_skipped": ds, "decode_reachable": dr, "decode_sparsity": sd,
            "point_sparsity": want, "point_decode_sparsity": want_d, "row_prefill_reachable": row_reach,
            "sparsity_match": None if want is None or s is None else abs(s - want) <= SPARSITY_TOL and pr == row_reach,
            "decode_sparsity_match": None if want_d is None or sd is None else abs(sd - want_d) <= SPARSITY_TOL,
            **_intervals(t, base)}


def random_ids(vocab_size: int, length: int, device):
    """Random prompt ids [1, N] of a --speed-only evaluation (seeded per length)."""
    g = torch.Generator().manual_seed(PROMPT_SEED + length)
    return torch.randint(0, vocab_size, (1, length), generator=g).to(device)


def run_timing(model, methods, lengths, export_dir, model_id: str, rows: list[dict], ids_of_sample,
               opts: TimingOptions, say=print, extrapolate: bool = False) -> list[dict]:
    """Timing records of every timed method at every length. ``ids_of_sample``: a function, sample
    id -> prompt ids of an evaluated prompt (None: --speed-only, random ids); ``rows``: the
    evaluation's rows (empty for --speed-only); ``extrapolate``: the evaluation's own (sparsify's keyword),
    so the timed call is the evaluated one."""
    device = model.device
    vocab = model.get_output_embeddings().weight.shape[0]
    methods, records = timed_methods(methods), []
    for n in sorted(lengths):
        prompt_of = {m.label: pick_prompt(rows, m.label, n) if ids_of_sample else None for m in methods}
        here = [m for m in methods if ids_of_sample is None or prompt_of[m.label] is not None]  # rows to match
        ids_of = {m.label: random_ids(vocab, n, device) if ids_of_sample is None else
                  torch.tensor([ids_of_sample(prompt_of[m.label])], device=device) for m in here}
        if not here:
            continue
        got = time_length(model, here, ids_of, ids_of[here[0].label], export_dir, model_id, opts, extrapolate)
        base = _baseline(got)
        for m in here:
            rec = method_record(m, n, got[("method", m.label)], base, prompt_of[m.label], rows)
            records.append(rec)
            say(speed_line(n, m.label, rec))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def speed_line(n: int, label: str, rec: dict) -> str:
    """The timing phase's line for one record: each speedup with its interval where it has one (an eager
    TPOT's, host-bound, is often wide: the reader sees it), the ideal, and the timed and evaluated sparsity."""
    return (f"  {n} tokens {label}: TTFT {rec['speedup_ttft'] or 0:.3f}x {_band(rec, 'speedup_ttft')}, "
            f"TPOT {rec['speedup_tpot'] or 0:.3f}x {_band(rec, 'speedup_tpot')} "
            f"(graph {_speed(rec, 'speedup_tpot_graph')}) of best SDPA (ideal {rec['ideal_ttft'] or 0:.3f}x); "
            f"sparsity {_fmt(rec['sparsity'])} timed vs {_fmt(rec['point_sparsity'])} evaluated")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _speed(rec: dict, name: str) -> str:
    """A speedup as "1.234x [lo, hi]" ("-x " without a value, no interval where it has none)."""
    return f"{_fmt(rec.get(name))}x {_band(rec, name)}"


def _band(rec: dict, name: str) -> str:
    """A speedup's interval as "[lo, hi]", "" where it has none."""
    lo, hi = rec.get(f"{name}_lo"), rec.get(f"{name}_hi")
    return "" if lo is None or hi is None else f"[{lo:.3f}, {hi:.3f}]"


# ----------------------------------------------------------------------------- the records
SPEED_COLUMNS = ("speedup", *SPEEDUPS, *SPEED_INTERVALS, "ideal_ttft",
                 "ideal_tpot", "attention_share", "timed_sparsity", "timed_decode_sparsity", "sparsity_match",
                 "decode_sparsity_match", "speed_device", "accuracy_meaningful")


def with_speed(rows: list[dict], cur) -> list[dict]:
    """results.json rows: the accuracy rows with each point's own speed (curves' SPEED_COLUMNS);
    without accuracy rows (--speed-only) the curves' points themselves."""
    import polars as pl

    from sparsecal.evaluation.summary import KEYS

    speed = cur.select(*KEYS, "label", "sparsity", "decode_sparsity",
                       *[c for c in SPEED_COLUMNS if c in cur.columns])
    if not rows:
        return speed.with_columns(pl.lit(None, pl.Float64).alias("accuracy_rel_dense")).to_dicts()
    return pl.DataFrame(rows, infer_schema_length=None).join(
        speed.drop("label", "sparsity", "decode_sparsity"), on=KEYS, how="left").to_dicts()


def print_speed(cur, meaningful: bool) -> None:
    """One line per timed point: its own TTFT and TPOT speedups against best SDPA, each with its interval
    where it has one, the ideal, and whether the timed sparsity matched the evaluated one."""
    from rich.console import Console

    out = Console(width=max(170, Console().width))
    if not meaningful:
        out.print("accuracy: meaningless (--speed-only: random weights or no accuracy rows); speed only")
    for r in cur.filter(cur["speedup_ttft"].is_not_null() | cur["timed_sparsity"].is_not_null()).iter_rows(named=True):
        out.print(f"speed {r['label']} @ {r['length']}: TTFT {_speed(r, 'speedup_ttft')} (graph "
                  f"{_speed(r, 'speedup_ttft_graph')}, ideal {_fmt(r.get('ideal_ttft'))}x), TPOT "
                  f"{_speed(r, 'speedup_tpot')} (graph {_speed(r, 'speedup_tpot_graph')}) of best SDPA; "
                  f"sparsity timed {_fmt(r.get('timed_sparsity'))}"
                  f" / evaluated {_fmt(r['sparsity'])} (match {r.get('sparsity_match')}) on "
                  f"{r.get('speed_device')}", soft_wrap=True)
