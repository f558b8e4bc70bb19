"""A decode cache that appends in place, as a serving engine's does, for the timed decode steps.

transformers' ``DynamicCache`` grows each layer by ``torch.cat`` of the whole cache with the new
token's keys and values: every decode step reads and writes the entire cache once more (for a
4-layer Llama-3.1-8B-shaped model at 64K cached tokens, ~2.1 GB a step against the attention's own
1.07 GB). No serving engine pays that copy (paged caches write the new token into a free slot), so a
TPOT timed with it measures a step that no deployment runs, with the attention's share diluted.

``in_place(cache, capacity)`` moves each layer of a prefilled cache into buffers of ``capacity``
tokens and makes the layer's ``update`` write the new tokens after the cached ones and return views
of the first L tokens (strided [B, Hkv, L, D]: the same values the cat returns, no copy), by moving
the layer to a subclass whose ``update`` does that: a bound method stored on the layer would make it
refer to itself, and such a cache lives until the cyclic collector runs (s51, the 8B timing at 128K:
2 GiB left alive by each eager decode measure and 8 GiB by each graph one, until it ran out of GPU
memory). Every
cache layout transformers' models update through ``cache.layers[i].update(keys, values, ...)``
(transformers 4.56 onwards) and whose layers are all plain ``DynamicLayer`` (no sliding window: a
sliding layer keeps only its last tokens) converts; any other cache is left as it is and
``in_place`` says so by returning False.

Shape legend
    B batch   Hkv KV heads   L cached tokens   D head dim   C capacity (tokens)
"""
from __future__ import annotations

import functools

import torch


def in_place(cache, capacity: int) -> bool:
    """Make a prefilled cache append in place with room for ``capacity`` tokens per layer; True when
    every layer converted (then the cache's tensors live in new buffers; a cache converted before, or a
    deep copy of one, gets new buffers of the new capacity), False when the cache's layout is not one
    this knows (nothing changed)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(_plain(type(lay)).__name__ == "DynamicLayer" and isinstance(getattr(lay, "keys", None),
                                                                                          torch.Tensor)
                             and lay.keys.dim() == 4 for lay in layers):
        return False
    for lay in layers:
        k, v = lay.keys, lay.values
        n = k.shape[2]
        if capacity < n:
            raise ValueError(f"in-place cache capacity {capacity} is below the {n} tokens already cached")
        kb = k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3])
        vb = v.new_empty(v.shape[0], v.shape[1], capacity, v.shape[3])
        kb[:, :, :n], vb[:, :, :n] = k, v
        lay.kv_buffers = (kb, vb)
        lay.keys, lay.values = kb[:, :, :n], vb[:, :, :n]
        lay.__class__ = _appending(_plain(type(lay)))
    return True


@functools.cache
def _appending(base: type) -> type:
    """``base``'s subclass whose ``update`` is ``_append`` (``_plain`` gives ``base`` back)."""
    return type(f"InPlace{base.__name__}", (base,), {"update": _append, "__module__": __name__, "_plain": base})


def _plain(cls: type) -> type:
    """The layer class a converted layer's class was made from (``_appending``); any other class itself."""
    return cls.__dict__.get("_plain", cls)


def _append(layer, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
    """A converted layer's update: key/value states [B, Hkv, T, D] written at tokens L .. L + T - 1 of
    its buffers [B, Hkv, C, D]; returns the views (keys, values) [B, Hkv, L + T, D]."""
    kb, vb = layer.kv_buffers
    n0 = layer.keys.shape[2]
    n = n0 + key_states.shape[2]
    if n > kb.shape[2]:
        raise ValueError(f"in-place cache full: {n} tokens into a capacity of {kb.shape[2]}")
    kb[:, :, n0:n], vb[:, :, n0:n] = key_states, value_states
    layer.keys, layer.values = kb[:, :, :n], vb[:, :, :n]
    return layer.keys, layer.values
