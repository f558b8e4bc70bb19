"""Run a loaded model on exported thresholds: ``sparsify(model, EXPORT_DIR, method=..., ...)``
switches its attention to ``sparsecal_bsfa``, ``sparsecal_blasst`` or ``sparsecal_window``
(registered with transformers' AttentionInterface), ``densify(model)`` switches back.
``register(EXPORT_DIR, method=..., ...)`` does the same for models loaded afterwards with
``from_pretrained(..., attn_implementation="sparsecal_bsfa")`` (the geometry is checked at the
first forward; the counts are in the returned state's ``stats``).

Prefill (unpadded sequences of one length per batch, causal) and decode (one new token against the
KV cache) run the Triton kernels (kernels/sparse/prefill.py, kernels/sparse/decode.py) on a
CUDA device and the plain-torch reference (kernels/sparse/reference.py) elsewhere (``backend``:
auto | triton | reference; triton on a CPU needs TRITON_INTERPRET=1). After each forward,
``model.sparsecal_stats`` holds per layer and head the candidate tiles skipped and the reachable
tiles of that forward, on the device the attention ran on:
``{"skipped": [L, H] int64, "reachable": [L, H] int64}`` (the sums over the batch of the per-row
``"row_skipped"`` / ``"row_reachable"`` [L, B, H], so a batch of prompts is counted prompt by
prompt; sparsify_stats.py), and ``model.sparsecal_law`` the forward's
``{"mode", "length", "law"}`` (BLASST: below | interpolated | extrapolated; sparsify_laws.py).

BLASST uses lambda = threshold_scale_factor[mode] / sequence length (prefill) or the current
cache length (decode), and runs dense below the export's validated lengths, past the longest of them
unless ``extrapolate=True`` (each forward flagged in ``model.sparsecal_law``, sparsify_laws.py) and
wherever lambda > 1 (formats.exports.blasst_runtime_lambda: never every candidate skipped); BSFA uses
thresholds[k][layer][head, min(query block, P - 1)]; window:B (the sliding-window baseline with
BSFA's block budget) keeps each query block's diagonal and the B candidate key blocks nearest to it,
with the export's block sizes. The baselines and variants ``window_sink``, ``blasst_sl``, ``vfa``
and ``vsa`` are described in sparsify_variants.py.

One dense implementation: a call that skips nothing by construction (BLASST outside its law's
lengths, a window prefill whose candidates all fit the window) runs exactly what ``dense`` runs at
that call (``dense_first``): the kernels with skipping off, or, under an export's dispatch record
(dispatch on), the SDPA backend the record picks for that length bucket, the same one for every
method and operating point. So a method that skips nothing equals ``dense`` bit for bit.

Dispatch (``dispatch=True``, the default): when blasst.json holds a ``dispatch`` record
(``sparsecal export --break-even FILE``, formats.dispatch) with an entry for the operating point
(BSFA k, BLASST target), a prefill of N tokens runs a layer sparse only where the plan says so at
the bucket of the largest calibrated length <= N (dense below the shortest); elsewhere the layer
runs PyTorch SDPA (kernels/layer_dense.py) with the break-even file's fastest backend tried first
(the others in PyTorch's order as fall-backs) and counts nothing. ``dense`` with dispatch on (the
default) under a record runs every prefill layer that way. Decode steps follow the record's decode
entry where it has one for the operating point, sparsify's ``decode_decision`` and decode mode
(sparsify_dense.decode_plan): a step of batch B against N cached tokens runs a layer sparse only
where the decode plan of the largest measured batch <= B (the smallest below them all) says so at
N's bucket, else what ``dense`` runs at decode (SDPA with the record's decode backend first; counts
nothing). Without decode entries decode runs as without dispatch.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparsecal.formats.errors import UserError
from sparsecal.integrations.sparsify_dense import (  # noqa: F401 - dispatched_dense, _sdpa_first: public to tests
    DECODE_DENSE,
    _decode_dense,
    _dense_backends,
    _dispatch_plan,
    _exact_dense,
    _sdpa_first,
    dense_first,
    dispatched_dense,
)
from sparsecal.integrations.sparsify_stats import Stats

METHODS = {"bsfa": "sparsecal_bsfa", "blasst": "sparsecal_blasst", "window": "sparsecal_window",
           "dense": "sparsecal_dense", **{m: f"sparsecal_{m}" for m in ("window_sink", "blasst_sl", "vfa", "vsa")}}
DECODES = {"bsfa": ("dense", "topk", "thresholds"), "blasst": ("sparse", "dense"), "window": ("sparse", "dense"),
           "dense": ("dense",), **{m: ("sparse", "dense") for m in ("window_sink", "blasst_sl", "vfa", "vsa")}}
PRECISIONS = ("model", "fp32")
BACKENDS = ("auto", "triton", "reference")
_STATE_ATTR = "_sparsecal_state"
_REGISTERED: dict = {}  # attn_implementation name -> _State for from_pretrained-loaded models


@dataclass
class _State:
    method: str
    block_m: int
    block_n: int
    previous: str = "sdpa"
    thresholds: torch.Tensor | None = None        # [L, H, P] (BSFA)
    factors: dict = field(default_factory=dict)   # mode -> a (BLASST)
    layer_factors: dict = field(default_factory=dict)  # mode -> [a per model layer] (BLASST --per-layer)
    min_lengths: dict = field(default_factory=dict)  # mode -> shortest validated length (BLASST; dense below)
    validity: dict = field(default_factory=dict)     # mode -> the law's validity entry (BLASST; sparsify_laws)
    group_law: dict | None = None                    # BLASST: the export's decode law of the group decision
    extrapolate: bool = False                        # BLASST past max_length: a/L (True) or dense (False)
    law: dict = field(default_factory=dict)          # the last forward's {"mode", "length", "law"} (sparsify_laws)
    order: str = "forward"
    window: int | None = None                      # candidate blocks kept (window)
    sink: bool = False                             # window_sink: key block 0 kept besides the window
    vfa: bool = False                              # vfa / vsa: the frozen-max reference (sparsify_variants.py)
    backend: str = "auto"
    source: dict = field(default_factory=dict)     # register(): load_state arguments, re-checked at first use
    model_id: str | None = None                    # register(): the expected model id
    export_model: str | None = None                # the model id the export names (None: it names none)
    checked: bool = True                           # register(): False until checked against a model
    stats: Stats = field(default_factory=Stats)   # the counts of the last forward (sparsify_stats.py)
    layers: frozenset | None = None                # layers the export runs sparse (None: every layer)
    specs: dict = field(default_factory=dict)      # layer -> formats.layers.LayerSpec of the model
    said_fallback: bool = False                    # the head-dim fall-back to the reference was reported
    said_batch: bool = False                       # a decode batch unlike the decode break-even's was reported
    decode: str = "sparse"                         # decode steps: sparse | dense | topk | thresholds (DECODES)
    decision: str = "head"                         # decode skip decision: head | group (reference.group_skip)
    decode_dense: str = "reproducible"             # a dispatched dense decode step: DECODE_DENSE (_decode_dense)
    precision: str = "model"                       # attention from the model's dtype, or from fp32 Q, K, V
    topk: int | None = None                        # BSFA decode=topk: key blocks kept per decode row
    decode_thresholds: torch.Tensor | None = None  # BSFA decode=thresholds: [L, H, P] from decode rows
    plan: dict | None = None                       # dispatch: {"lengths" [NL], "sparse" [L][NL], "backends" [NL],
    #                                                "sparsity" [L][NL] calibrated, None where not sparse}
    dense_backends: dict | None = None             # dispatch record: {"lengths" [NL], "backends" [NL], "decode"
    #                                                {"batches", "picks"} | None}: every dense call's backend (dense_first)
    _on_device: dict = field(default_factory=dict)  # (device, decode) -> thresholds there
    geo: tuple = ()                                # (config, _geometry(config)) of the last config seen
    masks_ok: list = field(default_factory=list)   # weakrefs: this forward's masks found causal
    counts_written: bool = True                    # stats written since they were last zeroed (layer 0 zeroes
    #                                                them only then: a forward that counts nothing launches nothing)

    def thresholds_on(self, device, decode: bool = False) -> torch.Tensor:
        """The BSFA thresholds (``decode``: those calibrated on decode rows) on ``device``, cached."""
        key = (device, decode)
        if key not in self._on_device:
            thr = self.decode_thresholds if decode else self.thresholds
            self._on_device[key] = thr.to(device=device, dtype=torch.float32)
        return self._on_device[key]

    def stats_on(self, device, layers: int, heads: int, batch: int = 1) -> Stats:
        """The stats, their tensors (re)allocated on ``device`` for ``batch`` rows; the object stays
        the same."""
        return self.stats.on(device, layers, heads, batch)


def _geometry(config) -> dict:
    """What the model's config says an export must match: layers, query heads and head_dim."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return {"num_layers": text.num_hidden_layers, "num_heads": text.num_attention_heads, "head_dim": int(head_dim)}


def config_digest(config) -> str | None:
    """The digest sparsecal puts in the id of a model loaded from a local checkpoint directory
    (``<dir>#config-<digest>``, capture.models.resolve_model), from the directory the model was
    loaded from; None when it was not loaded from one."""
    import hashlib

    where = Path(str(getattr(config, "_name_or_path", "") or ""))
    if not where.is_dir() or not (where / "config.json").is_file():
        return None
    return hashlib.sha1((where / "config.json").read_bytes()).hexdigest()[:8]


def check_identity(export_model: str | None, config, export_dir) -> None:
    """Refuse an export of another checkpoint (``sparsify`` without ``model_id``): an export made from a
    local checkpoint names its config's digest; the model's own checkpoint must have the same one."""
    tag = "#config-"
    own = config_digest(config)
    if not export_model or tag not in export_model or own is None:
        return
    if export_model.rsplit(tag, 1)[1] != own:
        raise UserError(f"{export_dir} was calibrated for model {export_model}, but this model was loaded from "
                        f"{config._name_or_path} (config digest {own}); use an export made from a run of this model.")


def load_state(export_dir, method: str = "bsfa", k: int | None = None, target: float | None = None,
               blocks: int | None = None, expect: dict | None = None, backend: str = "auto",
               decode: str | None = None, precision: str = "model", dispatch: bool = True,
               extrapolate: bool = False) -> _State:
    """Read and check an export for one method's operating point (see ``sparsify``)."""
    if method not in METHODS:
        raise UserError(f"method {method!r} is not one of {', '.join(METHODS)}.")
    if backend not in BACKENDS:
        raise UserError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}.")
    decode = decode or DECODES[method][0]
    if decode not in DECODES[method]:
        raise UserError(f"decode {decode!r} is not a decode mode of {method} (one of {', '.join(DECODES[method])}).")
    if precision not in PRECISIONS or (precision != "model" and method != "dense"):
        raise UserError(f"precision {precision!r}: method 'dense' takes one of {', '.join(PRECISIONS)}, "
                        "the sparse methods run in the model's dtype.")
    from sparsecal.integrations.sparsify_variants import load_variant

    state = load_variant(export_dir, method, k, target, blocks, expect or {}, backend, _load_method)
    state.decode, state.precision, state.extrapolate = decode, precision, bool(extrapolate)
    if method == "bsfa" and decode == "topk":
        state.topk = int(k)
    if method == "bsfa" and decode == "thresholds":
        state.decode_thresholds = _decode_thresholds(export_dir, k, expect or {})
    if dispatch and method in ("bsfa", "blasst"):
        state.plan = _dispatch_plan(export_dir, method, k if method == "bsfa" else target, expect or {})
    if dispatch:
        state.dense_backends = _dense_backends(export_dir, expect or {}, method)
    return state


def _decode_thresholds(export_dir, k: int, expect: dict) -> torch.Tensor:
    """BSFA thresholds calibrated on decode rows, [L, H, P]; one line when the export has none."""
    from sparsecal.integrations.exports import load_bsfa

    thr = load_bsfa(export_dir, expect).decode_for_k(k)
    if thr is None:
        raise UserError(f"{export_dir} has no BSFA decode thresholds (exported before they were calibrated): "
                        "capture and fit again, or use decode='dense' or 'topk'.")
    return thr


def _load_method(export_dir, method: str, k, target, blocks, expect: dict, backend: str) -> _State:
    from sparsecal.formats.exports import load_blasst
    from sparsecal.integrations.exports import load_bsfa

    if method == "dense":  # the block sizes and sparse layers of whichever file the export has
        try:
            exp = load_bsfa(export_dir, expect)
            return _State("dense", exp.q_block_size, exp.k_block_size, backend=backend,
                          layers=frozenset(exp.sparse_layers), export_model=exp.model)
        except UserError:
            doc = load_blasst(export_dir, expect)
            return _State("dense", doc["q_block_size"], doc["k_block_size"], backend=backend,
                          layers=None if doc.get("sparse_layers") is None else frozenset(doc["sparse_layers"]),
                          export_model=doc["model"])
    if method == "bsfa":
        if k is None:
            raise UserError("BSFA needs k: sparsify(model, EXPORT_DIR, method='bsfa', k=64).")
        exp = load_bsfa(export_dir, expect)
        return _State("bsfa", exp.q_block_size, exp.k_block_size, thresholds=exp.for_k(k), backend=backend,
                      layers=frozenset(exp.sparse_layers), export_model=exp.model)
    if method == "window":
        if blocks is None or blocks < 0:
            raise UserError("window needs blocks >= 0: sparsify(model, EXPORT_DIR, method='window', blocks=32).")
        exp = load_bsfa(export_dir, expect)
        return _State("window", exp.q_block_size, exp.k_block_size, window=int(blocks), backend=backend,
                      layers=frozenset(exp.sparse_layers), export_model=exp.model)
    doc = load_blasst(export_dir, expect)
    t = doc["target_sparsity"] if target is None else target
    from sparsecal.formats.exports import blasst_group_law, blasst_min_length  # dense below the validated lengths
    from sparsecal.integrations.sparsify_laws import law_validity, mode_factor  # and past them unless extrapolate

    factors = {mode: mode_factor(doc, t, mode) for mode in ("prefill", "decode")}

    return _State("blasst", doc["q_block_size"], doc["k_block_size"], factors=factors,
                  layer_factors={m: _layer_factors(doc, t, m) for m in factors if factors[m] is not None},
                  min_lengths={m: blasst_min_length(doc, m, t) for m in factors if factors[m] is not None},
                  validity=law_validity(doc, t, [m for m in factors if factors[m] is not None]),
                  group_law=blasst_group_law(doc, t),
                  order=doc.get("scan_order", "forward"), backend=backend,
                  layers=None if doc.get("sparse_layers") is None else frozenset(doc["sparse_layers"]),
                  export_model=doc["model"])


def _check_layers(state: _State, config) -> None:
    """Per-layer specs of the model; refuse features the sparse kernels cannot honour on a sparse layer."""
    from sparsecal.formats.layers import layer_specs

    state.specs = {s.index: s for s in layer_specs(config)}
    for s in state.specs.values():
        if s.sinks and (state.layers is None or s.index in state.layers):
            raise UserError(f"layer {s.index} ({config.model_type}) uses learned attention sinks, which the sparse "
                            "kernels do not model; this model cannot run sparse.")


def sparsify(model, export_dir, method: str = "bsfa", k: int | None = None, target: float | None = None,
             model_id: str | None = None, blocks: int | None = None, backend: str = "auto",
             decode: str | None = None, precision: str = "model", dispatch: bool = True, extrapolate: bool = False,
             decode_decision: str = "head", decode_dense: str = "reproducible"):
    """Switch ``model`` to sparse attention with the thresholds in ``export_dir``; returns the model.

    BSFA needs ``k`` (one of the export's k values); BLASST takes ``target`` (default: the file's
    own target sparsity); window needs ``blocks`` (candidate key blocks kept per query block; the
    export gives the block sizes); ``dense`` runs the same kernels with skipping off (the
    evaluation's reference), from float32 Q, K, V with ``precision="fp32"``. ``decode``: how decode
    steps run, DECODES[method] (the first is the default: BSFA decodes dense, as the BSFA paper).
    ``model_id`` (optional) is checked against the export's model; without it the export must match
    the model's layers, heads and head_dim, and an export of a local checkpoint that checkpoint's
    config digest (check_identity).
    ``backend``: auto (Triton on CUDA, else the reference), triton, reference. ``dispatch``: follow
    the export's dispatch record (prefill sparse only where it pays, SDPA elsewhere; ``dense``
    then runs that SDPA on every prefill layer, so compare methods with a ``dense`` of the same
    ``dispatch``); False runs every exported layer sparse at every length. ``extrapolate``: BLASST past
    its law's longest validated length applies a/L (True) or runs what ``dense`` runs (False, the
    default); ``model.sparsecal_law`` flags each forward (integrations/sparsify_laws.py). ``decode_decision``: "head" (each query head skips by its own
    rule) or "group" (a KV group skips a tile only when all its heads would; the group decode kernel,
    kernels/sparse/decode_group.py). ``decode_dense``: what a dense decode step under the dispatch
    record runs first, DECODE_DENSE (``_decode_dense``)."""
    geo = _geometry(model.config)
    dd = _decode_dense(decode_dense)
    state = load_state(export_dir, method, k, target, blocks, dict(geo, model=model_id), backend, decode, precision,
                       dispatch, extrapolate)
    state.decision, state.decode_dense = _decision(decode_decision, state), dd
    if model_id is None:
        check_identity(state.export_model, model.config, export_dir)
    state.previous = model.config._attn_implementation
    if hasattr(model, _STATE_ATTR):
        state.previous = getattr(model, _STATE_ATTR).previous
    state.stats_on(model.device, geo["num_layers"], geo["num_heads"])
    _check_layers(state, model.config)
    register()
    for m in _attention_modules(model):
        m._sparsecal_state = state
    setattr(model, _STATE_ATTR, state)
    model.sparsecal_stats, model.sparsecal_law = state.stats, state.law
    model.set_attn_implementation(METHODS[method])
    return model


def _attention_modules(model):
    """The modules transformers calls attention functions with (they carry ``layer_idx``)."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if len(mods) != _geometry(model.config)["num_layers"]:
        raise UserError(f"found {len(mods)} attention modules for {_geometry(model.config)['num_layers']} layers; "
                        "sparsify supports decoder-only models with one attention per layer.")
    return mods


def _layer_factors(doc: dict, target: float, mode: str) -> list | None:
    """Per-layer factors of a ``--per-layer`` export (None otherwise: one factor for every layer)."""
    from sparsecal.formats.exports import blasst_layer_factors

    if not any(e.get("per_layer") for e in [doc, *doc.get("targets", [])]):
        return None
    return blasst_layer_factors(doc, mode, target)


def densify(model):
    """Back to the attention implementation the model had before ``sparsify``."""
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        model.set_attn_implementation(state.previous)
        for m in _attention_modules(model):
            del m._sparsecal_state
        delattr(model, _STATE_ATTR)
    return model


def register(export_dir=None, method: str = "bsfa", k: int | None = None, target: float | None = None,
             blocks: int | None = None, model_id: str | None = None, backend: str = "auto",
             decode: str | None = None, precision: str = "model", dispatch: bool = True, extrapolate: bool = False,
             decode_decision: str = "head", decode_dense: str = "reproducible"):
    """Register the sparse attention functions with transformers' AttentionInterface.

    With ``export_dir``, models loaded afterwards with ``from_pretrained(...,
    attn_implementation=METHODS[method])`` run on that export (checked against the model's
    layers and heads at the first forward); returns the state, whose ``stats`` are those of the
    last forward."""
    from transformers import AttentionInterface

    for name in METHODS.values():
        AttentionInterface.register(name, sparse_attention_fn)
    if export_dir is None:
        return None
    source = {"export_dir": export_dir, "method": method, "k": k, "target": target, "blocks": blocks,
              "backend": backend, "decode": decode, "precision": precision, "dispatch": dispatch,
              "extrapolate": extrapolate}
    dd = _decode_dense(decode_dense)
    state = load_state(**source, expect={"model": model_id})
    state.source, state.model_id, state.checked = source, model_id, False
    state.decision, state.decode_dense = _decision(decode_decision, state), dd
    _REGISTERED[METHODS[method]] = state
    return state


def _decision(decision: str, state: _State) -> str:
    """The decode decision, checked; "group" on BLASST also takes the export's group law (sparsify_laws)."""
    from sparsecal.integrations.sparsify_laws import use_group_law
    from sparsecal.kernels.sparse.reference import DECISIONS

    if decision not in DECISIONS:
        raise UserError(f"unknown decode decision '{decision}'; use one of {', '.join(DECISIONS)}.")
    use_group_law(state, decision)
    return decision


def _module_state(module) -> _State:
    state = getattr(module, "_sparsecal_state", None)
    if state is not None:
        return state
    state = _REGISTERED.get(getattr(module.config, "_attn_implementation", None))
    if state is None:
        raise RuntimeError("sparsecal sparse attention needs sparsecal.sparsify(model, ...) or "
                           "sparsecal.register(EXPORT_DIR, ...) before from_pretrained")
    if not state.checked:  # the export against the model it now runs in: the same checks as sparsify
        load_state(**state.source, expect=dict(_geometry(module.config), model=state.model_id))
        if state.model_id is None:
            check_identity(state.export_model, module.config, state.source["export_dir"])
        _check_layers(state, module.config)
        state.checked = True
    return state


def sparse_attention_fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function. query [B, H, Nq, D], key/value [B, Hkv, Nk, D] -> ([B, Nq, H, D], None).

    Layers the export leaves alone run what ``dense`` runs (dense_first) and count nothing; sliding
    or chunked layers whose window binds at this length, and prefills the dispatch plan runs dense,
    run their exact dense attention (kernels/layer_dense.py) and count nothing."""
    from sparsecal.integrations.sparsify_laws import note_law

    state = _module_state(module)
    _, h, nq, d = query.shape
    nk = key.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    layer = module.layer_idx
    mode = "prefill" if nq == nk else "decode"
    if mode == "decode" and nq != 1:
        raise RuntimeError("sparse attention runs prefill of whole sequences and decode one token at a time")
    _check_mask(state, attention_mask, nq, nk, layer)
    geo = _state_geometry(state, module.config)
    stats = state.stats_on(query.device, geo["num_layers"], h, query.shape[0])
    if layer == 0 and state.counts_written:  # a new forward starts: the counts describe the last forward only
        for counts in stats.held():
            counts.zero_()
        state.counts_written = False
    note_law(state, mode, nk)  # state.law = model.sparsecal_law: interpolated | extrapolated | below | None
    spec = state.specs.get(layer)
    window = kwargs.get("sliding_window") or (spec.window if spec else None)
    first, kw, counted = dispatched_dense(state, layer, mode, nk, query.shape[0]), None, True
    if first is None and _runs_sparse(state, layer, spec, window, nk):
        kw = {"dense": True} if _window_covers(state, mode, nk) else call_args(state, layer, mode, nk, query.device)
        first = dense_first(state, mode, nk, query.shape[0]) if kw.get("dense") else None  # skips nothing: dense's
    elif first is None and _runs_sparse(state, layer, spec, window, nk, every_layer=True):
        kw, first, counted = {"dense": True}, dense_first(state, mode, nk, query.shape[0]), False  # left dense
    if kw is None or first is not None:
        return _exact_dense(state, query, key, value, scale, first, spec, window, kwargs), None
    if kwargs.get("softcap"):
        kw["softcap"] = kwargs["softcap"]
    if state.precision == "fp32":
        dtype = query.dtype
        query, key, value = query.float(), key.float(), value.float()
    if kw.pop("vfa", False):  # vfa / vsa: the frozen-max reference (sparsify_variants.py)
        from sparsecal.integrations.sparsify_variants import run_vfa

        out, skipped, reach = run_vfa(state, mode, query, key, value, scale, kw, stats, layer)
    elif _use_triton(state, query, mode):
        out, skipped, reach = _run_triton(state, mode, query, key, value, scale, kw,
                                          expected_sparsity(state, layer, mode, nk))
    else:
        out, skipped, reach = _run_reference(state, mode, query, key, value, scale, kw)
    if counted:  # a layer the export leaves dense counts nothing; skipped [B, H], reach per row
        state.counts_written = True
        stats.record(layer, skipped, reach)
    return (out.to(dtype) if state.precision == "fp32" else out), None


def _runs_sparse(state: _State, layer: int, spec, window: int | None, length: int, every_layer: bool = False) -> bool:
    """A layer runs sparse when the export covers it (``every_layer``: whether or not it does) and
    its window or chunk does not bind."""
    if state.layers is not None and layer not in state.layers and not every_layer:
        return False
    if window and window <= length:  # a decode step's sliding cache holds at most the window
        return False
    return spec is None or spec.kind in ("full_attention", "sliding_attention") or not spec.binds(length)


def _window_covers(state: _State, mode: str, length: int) -> bool:
    """The window baseline skips nothing in this call (prefill: every query block's candidate key
    blocks fit its budget; decode: the row L - 1's), so it runs what ``dense`` runs (dense_first)
    instead of the window kernels, which with nothing skipped differ from dense's in rounding (H100,
    batch 32, 9/3 heads, D 64: data/bench/NOTES.md)."""
    if state.method != "window":
        return False
    last = (length - 1) // state.block_m * state.block_m if mode == "prefill" else length - 1
    return last // state.block_n <= state.window + state.sink  # the sink keeps one more


def _use_triton(state: _State, query, mode: str) -> bool:
    """Triton when asked (or on CUDA for auto) and the kernels take this head dim and query tile;
    otherwise the reference, said once per state."""
    from sparsecal.formats.geometry import TRITON_HEAD_DIMS
    from sparsecal.kernels.jit import fp32_tile_too_large

    if state.backend == "reference" or not (state.backend == "triton" or query.is_cuda):
        return False
    d = query.shape[-1]
    if d not in TRITON_HEAD_DIMS:
        why = f"head dim {d} has no Triton sparse kernel"
    elif mode == "prefill" and fp32_tile_too_large(query.dtype, query.device.type, state.block_m, d):
        why = f"float32 query tiles of {state.block_m} x {d} do not fit the GPU's shared memory"
    else:
        return True
    if not state.said_fallback:
        import sys

        print(f"note: {why}; running the plain-torch reference.", file=sys.stderr)
        state.said_fallback = True
    return False


def expected_sparsity(state: _State, layer: int, mode: str, length: int) -> float | None:
    """The layer's calibrated prefill sparsity at this length's bucket in the dispatch plan (the
    kernel pick's hint, kernels/sparse/prefill_pick.py); None without a plan or for decode."""
    if state.plan is None or mode != "prefill" or "sparsity" not in state.plan:
        return None
    from sparsecal.formats.dispatch import bucket

    j = bucket(state.plan["lengths"], length)
    return None if j is None else state.plan["sparsity"][layer][j]


# A decode step that skips nothing runs the group kernel's tuned dense path up to this head dim (0.97-1.003x the best
# SDPA on an H100 against 0.73-0.90x for decode.py's; data/bench/NOTES.md "decode-sweep 2"), decode.py's past it.
GROUP_DENSE_MAX_D = 128


def _run_triton(state: _State, mode: str, query, key, value, scale: float, kw: dict,
                expected: float | None = None):
    """GPU kernels over the whole batch: (out [B, Nq, H, D], skipped [B, H], reachable tiles per row
    and head);
    ``expected``: the prefill's calibrated sparsity (the kernel pick's hint)."""
    from sparsecal.kernels.sparse.decode import sparse_decode_triton
    from sparsecal.kernels.sparse.prefill import candidate_tiles
    from sparsecal.kernels.sparse.prefill_pick import sparse_prefill

    b, h, nq, d = query.shape
    if mode == "prefill":  # the Gluon kernels where they are the faster ones (Hopper), else Triton
        out = torch.empty((b, nq, h, d), dtype=query.dtype, device=query.device)
        _, skipped = sparse_prefill(query, key, value, scale, state.block_m, state.block_n,
                                    order=state.order, out=out.transpose(1, 2), expected_sparsity=expected, **kw)
        return out, skipped, candidate_tiles(nq, state.block_m, state.block_n)[1]
    if state.decision == "group" or (kw.get("dense") and d <= GROUP_DENSE_MAX_D):
        from sparsecal.kernels.sparse.decode_group import group_decode_triton

        o, skipped, _ = group_decode_triton(query, key, value, scale, state.block_m, state.block_n, order=state.order,
                                            decision=state.decision, **kw)
    else:
        o, skipped = sparse_decode_triton(query, key, value, scale, state.block_m, state.block_n, order=state.order,
                                          **kw)
    return o.transpose(1, 2), skipped, (key.shape[2] - 1) // state.block_n + 1


def _run_reference(state: _State, mode: str, query, key, value, scale: float, kw: dict):
    """Plain-torch reference per sequence: (out [B, Nq, H, D], skipped [B, H], reachable tiles per
    row and head)."""
    from sparsecal.kernels.sparse.reference import sparse_attention, sparse_decode

    if kw.pop("dense", False):
        kw["log_lambda"] = -math.inf  # the reference's dense: nothing is below -inf
    outs, skipped = [], []
    for i in range(query.shape[0]):
        if mode == "prefill":
            o, c = sparse_attention(query[i:i + 1], key[i:i + 1], value[i:i + 1], scale, state.block_m,
                                    state.block_n, order=state.order, **kw)
        else:
            o, c = sparse_decode(query[i:i + 1], key[i:i + 1], value[i:i + 1], scale, state.block_m,
                                 state.block_n, order=state.order, decision=state.decision, **kw)
        outs.append(o)
        skipped.append(c.skipped)
    return torch.cat(outs).transpose(1, 2).contiguous(), torch.stack(skipped), c.reachable


def call_args(state: _State, layer: int, mode: str, length: int, device) -> dict:
    """The kernels' method arguments for one call: dense when the method or its decode mode says
    so, the decode-row BSFA modes, the frozen-max variants (vfa_args), else ``method_args``."""
    if state.vfa:
        from sparsecal.integrations.sparsify_variants import vfa_args

        return vfa_args(state, mode, length, lambda: method_args(state, layer, mode, length, device))
    if state.method == "dense" or (mode == "decode" and state.decode == "dense"):
        return {"dense": True}
    if mode == "decode" and state.decode == "topk":
        return {"topk": state.topk}
    if mode == "decode" and state.decode == "thresholds":
        return {"thresholds": state.thresholds_on(device, decode=True)[layer]}
    return method_args(state, layer, mode, length, device)


def method_args(state: _State, layer: int, mode: str, length: int, device) -> dict:
    if state.method == "window":
        return {"window": state.window, "sink": True} if state.sink else {"window": state.window}
    if state.method == "bsfa":
        return {"thresholds": state.thresholds_on(device)[layer]}
    from sparsecal.formats.exports import blasst_runtime_lambda
    from sparsecal.integrations.sparsify_laws import law_max_length

    per_layer = state.layer_factors.get(mode)
    a = per_layer[layer] if per_layer else state.factors.get(mode)
    lam = blasst_runtime_lambda(a or None, length, state.min_lengths.get(mode),  # None: dense (never every tile,
                                law_max_length(state, mode))                  # nor past the law unless extrapolate)
    return {"dense": True} if lam is None else {"log_lambda": math.log(lam)}  # dense: the reference's own call


def _state_geometry(state: _State, config) -> dict:
    """``_geometry(config)`` once per config (slow to read; every layer of every step asks)."""
    if not state.geo or state.geo[0] is not config:
        state.geo = (config, _geometry(config))
    return state.geo[1]


def _check_mask(state: _State, mask, nq: int, nk: int, layer: int) -> None:
    """Refuse a padding mask: a boolean/additive mask [B, 1, Nq, Nk] must be exactly the causal one.
    Reading it syncs with the device: layer 0 reads each mask it is given, later layers of the
    forward skip a mask object already read (transformers passes the same one to every layer)."""
    if mask is None or (layer != 0 and any(seen() is mask for seen in state.masks_ok)):
        return
    causal = torch.ones(nq, nk, dtype=torch.bool, device=mask.device).tril(nk - nq)
    if not bool(((mask if mask.dtype == torch.bool else mask == 0) == causal).all()):
        raise RuntimeError("sparse attention takes unpadded sequences (no padding mask)")
    if layer == 0:
        state.masks_ok.clear()
    state.masks_ok.append(weakref.ref(mask))
