"""Instrumented capture through transformers' AttentionInterface.

``sparsecal_capture`` is a registered attention function: every layer's call computes the real
attention output (so the model keeps running correctly) and that layer's statistics, reduced on
the device into the run's per-sample forms (kernels/capture/reduce_reference.py). A ``Collector`` set by
``collecting()`` receives them; ``capture_sample`` stacks the layers into [L, ...] tensors.

Backends (``resolve_backend``): ``reference`` is the plain-torch oracle (kernels/capture/reference.py),
``triton`` the Triton kernels (kernels/capture/instrumented.py; on a CPU only under
TRITON_INTERPRET=1), ``auto`` picks triton on a CUDA device and reference elsewhere. Both give
the same statistics in the same run format; each sample records the backend that produced it.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field

import torch

from sparsecal.formats.errors import UserError
from sparsecal.formats.geometry import CAPTURE_BACKENDS as BACKENDS
from sparsecal.formats.geometry import TRITON_HEAD_DIMS
from sparsecal.formats.sample_values import RAW_KEYS

ATTN_NAME = "sparsecal_capture"
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("sparsecal_collector", default=None)


@dataclass
class Collector:
    """Receives each layer's reduced statistics during one instrumented forward."""

    cfg: object  # formats.stats_config.StatsConfig
    layers: dict = field(default_factory=dict)
    backend: str = "reference"  # resolved: "triton" or "reference"
    captured: frozenset | None = None  # layer indices to instrument (None: every layer)
    specs: dict = field(default_factory=dict)  # layer index -> formats.layers.LayerSpec
    profiler: object = None  # capture.profile.Profiler: stamps kernels / reductions (None: off)


def _triton_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def resolve_backend(requested: str, device, head_dim: int | None = None, dtype: str | None = None,
                    block_m: int | None = None, quiet: bool = False) -> str:
    """The backend that runs: ``auto`` -> triton on a CUDA device (triton installed, head dim
    supported, the query tile of ``dtype`` / ``block_m`` fits the GPU), else reference, said in one
    line unless ``quiet``; ``triton`` and ``reference`` are taken as asked, or refused with a
    one-line UserError when triton cannot run here."""
    from sparsecal.formats.errors import unknown

    if requested not in BACKENDS:
        raise unknown("backend", requested, BACKENDS)
    try:
        on_cuda = torch.device(device).type == "cuda"
    except RuntimeError:
        raise UserError(f"Unknown device '{device}'; use cpu, cuda or cuda:N.")
    why = _no_triton_kernel(on_cuda, head_dim, dtype, block_m)
    if requested == "auto":
        if on_cuda and why and not quiet:
            import sys

            print(f"note: {why}; capturing with the plain-torch reference.", file=sys.stderr)
        return "triton" if on_cuda and not why and _triton_importable() else "reference"
    if requested == "reference":
        return "reference"
    if not _triton_importable():
        raise UserError("--backend triton needs the triton package (pip install triton); or use --backend reference.")
    if why:
        raise UserError(f"--backend triton: {why}; use --backend reference (or --dtype bfloat16).")
    from sparsecal.kernels.jit import interpreting

    if not on_cuda and not interpreting():
        raise UserError("--backend triton needs --device cuda, or TRITON_INTERPRET=1 to run the kernels in "
                        "Triton's (slow) CPU interpreter; or use --backend reference.")
    return "triton"


def _no_triton_kernel(on_cuda: bool, head_dim, dtype, block_m) -> str | None:
    """Why the Triton capture cannot take this geometry (None: it can)."""
    if head_dim is not None and head_dim not in TRITON_HEAD_DIMS:
        return f"head dim {head_dim} has no Triton capture kernel (head dims {', '.join(map(str, TRITON_HEAD_DIMS))})"
    if dtype and head_dim and block_m:
        from sparsecal.kernels.jit import fp32_tile_too_large

        if fp32_tile_too_large(getattr(torch, dtype), "cuda" if on_cuda else "cpu", block_m, head_dim):
            return f"float32 query tiles of {block_m} x {head_dim} do not fit the GPU's shared memory"
    return None


def model_head_dim(model) -> int:
    text = model.config.get_text_config()
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function. query [B, H, N, D], key/value [B, Hkv, N, D] -> ([B, N, H, D], None).

    A captured layer computes its output and statistics; any other layer (sliding, chunked, outside
    --layers) its exact dense attention (kernels/layer_dense.py), with the model's window, chunk,
    soft cap and sinks."""
    col = _ACTIVE.get()
    if col is None:
        raise RuntimeError(f"attn_implementation='{ATTN_NAME}' runs only inside sparsecal.capture.collecting()")
    if query.shape[2] != key.shape[2] or attention_mask is not None:
        raise RuntimeError("capture instruments causal prefill of one unpadded sequence (no KV cache, no padding)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    idx, n = module.layer_idx, query.shape[2]
    spec = col.specs.get(idx)
    window = kwargs.get("sliding_window") or (spec.window if spec else None)
    softcap = kwargs.get("softcap") or None
    if col.captured is not None and idx not in col.captured:
        from sparsecal.kernels.layer_dense import layer_attention

        out = layer_attention(query, key, value, scale, window=window, chunk=spec.chunk if spec else None,
                              softcap=softcap, sinks=kwargs.get("s_aux"))
        return out.transpose(1, 2).contiguous(), None
    if kwargs.get("s_aux") is not None:
        raise UserError(f"layer {idx} uses learned attention sinks, which sparsecal's capture does not model.")
    if window and window < n:
        raise UserError(f"layer {idx} attends over a sliding window of {window} tokens, shorter than this {n}-token "
                        "sample; capture it with --lengths up to the window, or leave it out with --layers.")
    col.layers[idx], out = _instrumented(query, key, value, scale, col, softcap)
    return out.transpose(1, 2).contiguous(), None


def _instrumented(query, key, value, scale: float, col: Collector, softcap: float | None):
    """(the layer's per-sample reductions, out [1, H, N, D]) on the collector's backend."""
    cap = {"softcap": softcap} if softcap else {}
    prof, marks = col.profiler, []
    if prof is not None:
        marks.append(prof.stamp())
    if col.backend == "triton":  # histograms counted in the kernels, same keys/shapes/dtypes
        from sparsecal.kernels.capture.pipeline import capture_triton

        mark = (lambda: marks.append(prof.stamp())) if prof is not None else None
        out, reduced = capture_triton(query, key, value, scale, col.cfg, **cap, mark=mark)
    else:
        from sparsecal.kernels.capture.reduce_reference import reduce_tiles
        from sparsecal.kernels.capture.reference import instrumented_attention

        out, tiles = instrumented_attention(query, key, value, scale, col.cfg, **cap)
        if prof is not None:
            marks.append(prof.stamp())
        reduced = reduce_tiles(tiles, query.shape[2], col.cfg)
    if prof is not None:
        prof.add("attention_kernels", marks[0], marks[1])
        prof.add("reductions", marks[1], prof.stamp())
    return reduced, out


def register() -> None:
    """Register ``sparsecal_capture`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, capture_attention)


@contextlib.contextmanager
def collecting(cfg, backend: str = "reference", layers=None, specs=None, profiler=None):
    """Collect the statistics of the layers in ``layers`` (None: all) during forwards in this context;
    ``specs`` [LayerSpec] gives the other layers' windows and chunks; ``profiler`` (capture.profile)
    stamps each captured layer's kernels and reductions."""
    col = Collector(cfg, backend=backend, captured=None if layers is None else frozenset(layers),
                    specs={s.index: s for s in specs or ()}, profiler=profiler)
    token = _ACTIVE.set(col)
    try:
        yield col
    finally:
        _ACTIVE.reset(token)


@torch.no_grad()
def capture_sample(model, input_ids: list[int], cfg, logits_to_keep: int = 1, backend: str = "auto",
                   layers: list[int] | None = None, profiler=None):
    """One instrumented forward. Returns (stats {name: [Lc, ...]}, raw {name: [Lc, ...]}, logits) over
    the captured layers ``layers`` in order (None: every layer ``formats.layers.plan_layers`` admits
    at this length), on the host. ``backend``: auto | triton | reference (see ``resolve_backend``).
    ``profiler`` (capture.profile.Profiler) gets the forward's, kernels', reductions' and copies' spans."""
    staged, logits = capture_staged(model, input_ids, cfg, logits_to_keep, backend, layers, profiler)
    stacked = dict(staged.result())
    raw = {k: stacked.pop(k) for k in RAW_KEYS if k in stacked}
    return stacked, raw, logits


@torch.no_grad()
def capture_staged(model, input_ids: list[int], cfg, logits_to_keep: int = 1, backend: str = "auto",
                   layers: list[int] | None = None, profiler=None):
    """``capture_sample`` without waiting: (capture.staging.Staged of every statistic, raw keys
    included, whose copy to the host is under way; logits)."""
    from sparsecal.capture.staging import stage
    from sparsecal.formats.layers import layer_specs, plan_layers

    backend = resolve_backend(backend, model.device, model_head_dim(model), str(model.dtype).removeprefix("torch."),
                              cfg.block_m, quiet=True)
    specs = layer_specs(model.config)
    if layers is None:
        layers = plan_layers(specs, None, len(input_ids), model.config.model_type)[0]
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        ids = torch.tensor([input_ids], device=model.get_input_embeddings().weight.device)
        with collecting(cfg, backend, layers, specs, profiler) as col, _span(profiler, "forward"):
            logits = model(ids, use_cache=False, logits_to_keep=logits_to_keep).logits
    finally:
        model.set_attn_implementation(previous)
    if sorted(col.layers) != sorted(layers):
        raise RuntimeError(f"captured layers {sorted(col.layers)}, planned {sorted(layers)}: a layer bypassed the "
                           "attention interface")
    return stage(col.layers, layers, profiler), logits


def _span(profiler, phase: str):
    return profiler.span(phase) if profiler is not None else contextlib.nullcontext()


def sample_record(prompt, sid: str) -> dict:
    """The JSON record of a prompt sample (everything but its token ids)."""
    return {"id": sid, "task": prompt.task, "length": prompt.length, "seed": prompt.seed,
            "index": prompt.index, "answer": list(prompt.answer), "meta": dict(prompt.meta)}


def pending(store, prompts) -> tuple[list, list]:
    """(all (record, prompt) pairs, those not finished in ``store`` yet)."""
    from sparsecal.formats.run import sample_id

    records = [(sample_record(p, sample_id(p.task, p.length, p.input_ids)), p) for p in prompts]
    finished = store.done_ids()
    return records, [(r, p) for r, p in records if r["id"] not in finished]


def run_capture(store, model, prompts, cfg, progress=None, backend: str = "auto", plan: bool = True,
                profile: bool = False, background: bool = True) -> dict:
    """Capture every prompt not finished yet into ``store`` (``plan``: first add them to its manifest;
    the ranks of a distributed capture leave that to rank 0). ``progress(done, total, record, secs)``
    is called after each sample lands. ``profile``: each record gets its phases (capture/profile.py);
    ``background``: samples are written on a thread beside the next forward (capture/staging.py).
    Returns {'done': n, 'skipped': n, 'seconds': s, 'backend': b, 'profiles': [the records' profiles]}."""
    from sparsecal.capture.profile import Profiler
    from sparsecal.capture.staging import SampleWriter
    from sparsecal.formats.geometry import block_counts

    backend = resolve_backend(backend, model.device, model_head_dim(model), str(model.dtype).removeprefix("torch."),
                              cfg.block_m, quiet=True)
    records, todo = pending(store, prompts)
    if plan:
        store.plan([r for r, _ in records])
    profiler = Profiler(model.device) if profile else None
    landed: list[dict] = []

    def report(recs):
        for rec in recs:
            landed.append(rec)
            if progress:
                progress(len(landed), len(todo), rec, rec["seconds"])

    total_start = time.perf_counter()
    with SampleWriter(store, background, RAW_KEYS) as writer:
        for rec, prompt in todo:
            start = time.perf_counter()
            if profiler is not None:
                profiler.reset()
            staged, _ = capture_staged(model, prompt.input_ids, cfg, backend=backend, layers=store.layers(),
                                       profiler=profiler)
            cand, reach = block_counts(prompt.length, cfg.block_m, cfg.block_n)
            staged.host.update(input_ids=torch.tensor(prompt.input_ids, dtype=torch.int32),
                               candidates=cand, reachable=reach)
            prof = profiler.seconds() if profiler is not None else None  # the one synchronisation
            report(writer.drain())  # the previous sample, written while this one ran on the device
            report(writer.submit(dict(rec, backend=backend), staged, start, prof))
        report(writer.drain())
    return {"done": len(todo), "skipped": len(records) - len(todo), "seconds": time.perf_counter() - total_start,
            "backend": backend, "profiles": [r["profile"] for r in landed if "profile" in r]}


def check_lengths(lengths, max_context) -> None:
    """Refuse lengths the model cannot attend over."""
    for n in lengths:
        if n < 1:
            raise UserError(f"length {n} is not a positive token count.")
        if max_context and n > max_context:
            raise UserError(f"length {n} is over the model's context of {max_context} tokens; "
                            f"use --lengths up to {max_context}.")
