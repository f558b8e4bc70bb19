"""Run a loaded model on exported thresholds: ``sparsify(model, EXPORT_DIR, method=..., ...)``
switches its attention to ``sparsecal_bsfa``, ``sparsecal_blasst`` or ``sparsecal_window``
(registered with transformers' AttentionInterface), ``densify(model)`` switches back.

Prefill (one unpadded sequence per batch row, causal) and decode (one new token against the KV
cache) run the plain-torch reference (kernels/sparse_reference.py); the Triton sparse kernels
will take the same place on CUDA. After each forward, ``model.sparsecal_stats`` holds per layer
and head the candidate tiles skipped and the reachable tiles of that forward:
``{"skipped": [L, H] int64, "reachable": [L, H] int64}``.

BLASST uses lambda = threshold_scale_factor[mode] / sequence length (prefill) or the current
cache length (decode); BSFA uses thresholds[k][layer][head, min(query block, P - 1)]; window:B
(the sliding-window baseline with BSFA's block budget) keeps each query block's diagonal and the B
candidate key blocks nearest to it, with the export's block sizes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import UserError

METHODS = {"bsfa": "sparsecal_bsfa", "blasst": "sparsecal_blasst", "window": "sparsecal_window"}
_STATE_ATTR = "_sparsecal_state"


@dataclass
class _State:
    method: str
    block_m: int
    block_n: int
    previous: str
    thresholds: torch.Tensor | None = None        # [L, H, P] (BSFA)
    factors: dict = field(default_factory=dict)   # mode -> a (BLASST)
    order: str = "forward"
    window: int | None = None                      # candidate blocks kept (window)
    stats: dict = field(default_factory=dict)     # {"skipped": [L, H], "reachable": [L, H]} int64


def _geometry(model) -> dict:
    text = model.config.get_text_config()
    return {"num_layers": text.num_hidden_layers, "num_heads": text.num_attention_heads}


def sparsify(model, export_dir, method: str = "bsfa", k: int | None = None, target: float | None = None,
             model_id: str | None = None, blocks: int | None = None):
    """Switch ``model`` to sparse attention with the thresholds in ``export_dir``; returns the model.

    BSFA needs ``k`` (one of the export's k values); BLASST takes ``target`` (default: the file's
    own target sparsity); window needs ``blocks`` (candidate key blocks kept per query block; the
    export gives the block sizes). ``model_id`` (optional) is checked against the export's model."""
    from .exports import load_blasst, load_bsfa

    if method not in METHODS:
        raise UserError(f"method {method!r} is not one of {', '.join(METHODS)}.")
    expect = dict(_geometry(model), model=model_id)
    previous = model.config._attn_implementation
    if hasattr(model, _STATE_ATTR):
        previous = getattr(model, _STATE_ATTR).previous
    if method == "bsfa":
        if k is None:
            raise UserError("BSFA needs k: sparsify(model, EXPORT_DIR, method='bsfa', k=64).")
        exp = load_bsfa(export_dir, expect)
        state = _State("bsfa", exp.q_block_size, exp.k_block_size, previous, thresholds=exp.for_k(k))
    elif method == "window":
        if blocks is None or blocks < 0:
            raise UserError("window needs blocks >= 0: sparsify(model, EXPORT_DIR, method='window', blocks=32).")
        exp = load_bsfa(export_dir, expect)
        state = _State("window", exp.q_block_size, exp.k_block_size, previous, window=int(blocks))
    else:
        doc = load_blasst(export_dir, expect)
        t = doc["target_sparsity"] if target is None else target
        factors = {mode: _factor(doc, t, mode) for mode in ("prefill", "decode")}
        state = _State("blasst", doc["q_block_size"], doc["k_block_size"], previous, factors=factors,
                       order=doc.get("scan_order", "forward"))
    geo = _geometry(model)
    zeros = torch.zeros(geo["num_layers"], geo["num_heads"], dtype=torch.int64)
    state.stats.update(skipped=zeros, reachable=zeros.clone())
    register()
    for m in _attention_modules(model):
        m._sparsecal_state = state
    setattr(model, _STATE_ATTR, state)
    model.sparsecal_stats = state.stats
    model.set_attn_implementation(METHODS[method])
    return model


def _attention_modules(model):
    """The modules transformers calls attention functions with (they carry ``layer_idx``)."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if len(mods) != _geometry(model)["num_layers"]:
        raise UserError(f"found {len(mods)} attention modules for {_geometry(model)['num_layers']} layers; "
                        "sparsify supports decoder-only models with one attention per layer.")
    return mods


def _factor(doc: dict, target: float, mode: str) -> float | None:
    from .exports import blasst_lambda

    try:
        return blasst_lambda(doc, 1, target, mode)
    except UserError:
        if mode == "decode":
            return None  # no decode calibration: decode runs dense
        raise


def densify(model):
    """Back to the attention implementation the model had before ``sparsify``."""
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        model.set_attn_implementation(state.previous)
        for m in _attention_modules(model):
            del m._sparsecal_state
        delattr(model, _STATE_ATTR)
    return model


def register() -> None:
    from transformers import AttentionInterface

    for name in METHODS.values():
        AttentionInterface.register(name, sparse_attention_fn)


def sparse_attention_fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function. query [B, H, Nq, D], key/value [B, Hkv, Nk, D] -> ([B, Nq, H, D], None)."""
    from sparsecal.kernels.sparse_reference import sparse_attention, sparse_decode

    state = getattr(module, "_sparsecal_state", None)
    if state is None:
        raise RuntimeError("sparsecal sparse attention runs only on a model switched with sparsecal.sparsify()")
    b, h, nq, _ = query.shape
    nk = key.shape[2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    mode = "prefill" if nq == nk else "decode"
    if mode == "decode" and nq != 1:
        raise RuntimeError("sparse attention runs prefill of whole sequences and decode one token at a time")
    if attention_mask is not None and not _is_causal_only(attention_mask, nq, nk):
        raise RuntimeError("sparse attention takes unpadded sequences (no padding mask)")
    kw = _method_args(state, layer, mode, nk)
    if mode == "prefill":
        outs, skipped = [], 0
        for i in range(b):
            o, c = sparse_attention(query[i:i + 1], key[i:i + 1], value[i:i + 1], scale, state.block_m,
                                    state.block_n, order=state.order, **kw)
            outs.append(o)
            skipped = skipped + c.skipped
        out, reach = torch.cat(outs), c.reachable * b
    else:
        out, c = sparse_decode(query, key, value, scale, state.block_m, state.block_n, order=state.order, **kw)
        skipped, reach = c.skipped, c.reachable
    if layer == 0:  # a new forward starts: the counts describe the last forward only
        state.stats["skipped"].zero_()
        state.stats["reachable"].zero_()
    state.stats["skipped"][layer] = skipped.cpu()
    state.stats["reachable"][layer] = reach
    return out.transpose(1, 2).contiguous(), None


def _method_args(state: _State, layer: int, mode: str, length: int) -> dict:
    if state.method == "window":
        return {"window": state.window}
    if state.method == "bsfa":
        return {"thresholds": state.thresholds[layer]}
    a = state.factors.get(mode)
    return {"log_lambda": -math.inf if not a else math.log(a / length)}


def _is_causal_only(mask, nq: int, nk: int) -> bool:
    """True when a boolean/additive mask [B, 1, Nq, Nk] is exactly the causal mask (no padding)."""
    causal = torch.ones(nq, nk, dtype=torch.bool, device=mask.device).tril(nk - nq)
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return bool((allowed == causal).all())
