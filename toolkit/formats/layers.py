"""Each decoder layer's attention as the checkpoint's config defines it, and which layers a capture
instruments.

sparsecal captures full causal attention. A layer of another kind runs its exact dense attention
(sparsecal.kernels.layer_dense) and is recorded as not captured, with the reason:

- sliding-window layers (Gemma 2/3, Mistral, gpt-oss, Qwen2/3 with sliding layers, Cohere2, OLMo 3):
  the window is already the layer's budget. A window that covers every captured length computes
  full causal attention there, so such a layer is captured as a full one (its statistics hold up
  to the window);
- chunked layers (Llama 4), the same way with the chunk size;
- linear-attention layers (Qwen3-Next) have no softmax attention;
- layers left out by ``--layers``.

Refused with one line: learned attention sinks on a layer that would be captured (gpt-oss), per-
layer head dims. Soft-capping (Gemma 2) is captured: the statistics are defined on capped scores.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparsecal.formats.errors import UserError

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
SINK_MODEL_TYPES = ("gpt_oss",)  # families whose attention adds learned per-head sink logits


@dataclass(frozen=True)
class LayerSpec:
    """One layer's attention: ``kind`` is transformers' layer type; ``window`` / ``chunk`` the
    sliding window or chunk size of such a layer; ``softcap`` the logit cap (None: off)."""

    index: int
    kind: str
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: bool = False

    def binds(self, length: int) -> bool:
        """True when the window or chunk restricts attention at ``length`` tokens."""
        return (self.kind == SLIDING and (self.window or 0) < length) or \
               (self.kind == CHUNKED and (self.chunk or 0) < length) or self.kind not in (FULL, SLIDING, CHUNKED)

    def describe(self) -> str:
        if self.kind == SLIDING:
            return f"sliding window {self.window}"
        if self.kind == CHUNKED:
            return f"chunked attention, chunk {self.chunk}"
        return self.kind.replace("_", " ")


def text_config(cfg):
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def layer_specs(cfg) -> list[LayerSpec]:
    """Per-layer attention specs from a transformers config (``layer_types`` where the family has
    them; configs without them (Mistral, Mixtral, Phi-3, Starcoder2) slide every layer when
    ``sliding_window`` is set and not switched off by ``use_sliding_window``). The capture checks
    each layer's window again when transformers passes it, so a config that misstates it is caught."""
    text = text_config(cfg)
    n = text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    slides = bool(window) and getattr(text, "use_sliding_window", True) is not False
    types = list(getattr(text, "layer_types", None) or [SLIDING if slides else FULL] * n)
    if len(types) != n:
        raise UserError(f"the config lists {len(types)} layer types for {n} layers; the checkpoint's config is inconsistent.")
    softcap = getattr(text, "attn_logit_softcapping", None) or None
    chunk = getattr(text, "attention_chunk_size", None)
    sinks = cfg.model_type in SINK_MODEL_TYPES
    return [LayerSpec(i, t, window if t == SLIDING else None, chunk if t == CHUNKED else None, softcap, sinks)
            for i, t in enumerate(types)]


def parse_layers(text: str | None, num_layers: int | None) -> list[int] | None:
    """'0,3,8-11' -> [0, 3, 8, 9, 10, 11]; None or '' -> None (every layer). ``num_layers`` None
    checks the syntax only (before the model's config is read)."""
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi if dash else lo)
        except ValueError:
            raise UserError(f"--layers {text!r} is not a list of layer indices such as 0,3,8-11.") from None
        if a > b:
            raise UserError(f"--layers {text!r}: the range {part.strip()} runs backwards; write it low-high "
                            f"({b}-{a}).")
        out.update(range(a, b + 1))
    bad = sorted(i for i in out if i < 0 or (num_layers is not None and i >= num_layers))
    if bad:
        span = f"0..{num_layers - 1}; the model has {num_layers} layers" if num_layers is not None else "0 and up"
        raise UserError(f"--layers {text!r} names layer {bad[0]}, outside {span}.")
    return sorted(out)


def plan_layers(specs: list[LayerSpec], requested: list[int] | None, max_length: int,
                model_type: str = "") -> tuple[list[int], dict[str, str]]:
    """(captured layer indices, {layer: why it is not captured}) for a capture up to ``max_length``
    tokens. Raises UserError when nothing can be captured or a captured layer has a feature the
    capture cannot honour."""
    captured, notes = [], {}
    for s in specs:
        if requested is not None and s.index not in requested:
            notes[str(s.index)] = "not in --layers: runs dense"
        elif s.binds(max_length):
            notes[str(s.index)] = f"{s.describe()}: runs dense, the window is its budget" \
                if s.kind in (SLIDING, CHUNKED) else f"{s.describe()}: no softmax attention to capture"
        elif s.sinks:
            raise UserError(f"layer {s.index} ({model_type}) uses learned attention sinks (per-head sink logits in "
                            "the softmax); sparsecal's capture and sparse kernels do not model them, so this model "
                            "cannot be calibrated.")
        else:
            captured.append(s.index)
    if not captured:
        kinds = sorted({specs[int(i)].describe() for i in notes})
        raise UserError(f"no layer of this model can be captured at {max_length} tokens ({'; '.join(kinds)}): "
                        "sparsecal captures full-attention layers; choose them with --layers or shorter --lengths.")
    return captured, notes


def layers_info(specs: list[LayerSpec]) -> dict:
    """What the manifest's model entry records about the layers."""
    s0 = specs[0]
    return {"layer_types": [s.kind for s in specs],
            "sliding_window": next((s.window for s in specs if s.window), None),
            "attention_chunk_size": next((s.chunk for s in specs if s.chunk), None),
            "softcap": s0.softcap, "attention_sinks": s0.sinks}
