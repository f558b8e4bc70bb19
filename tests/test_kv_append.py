"""evaluation/kv_append.py: a prefilled DynamicCache made to append in place decodes exactly what the
concatenating cache decodes, never reallocates, copies into an independent cache, and refuses what
it cannot hold (tiny random-weight model on the CPU)."""
import copy

import pytest
import torch

from sparsecal.evaluation.kv_append import in_place


def _prefill(model, ids):
    with torch.no_grad():
        out = model(ids, logits_to_keep=1, use_cache=True)
    return out.past_key_values, out.logits[:, -1:].argmax(-1)


def _greedy(model, cache, nxt, steps: int) -> list:
    logits = []
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float())
            nxt = out.logits[:, -1:].argmax(-1)
    return logits


def test_in_place_decodes_what_the_cat_decodes(tiny_sdpa_model, rng):
    """Six greedy steps from a 37-token prompt: the same logits as DynamicCache's, the buffers never
    move, the keys are views of them of the right length."""
    ids = torch.randint(0, tiny_sdpa_model.config.vocab_size, (1, 37), generator=rng)
    cache, nxt = _prefill(tiny_sdpa_model, ids)
    want = _greedy(tiny_sdpa_model, copy.deepcopy(cache), nxt, 6)
    assert in_place(cache, 37 + 6)
    ptrs = [lay.kv_buffers[0].data_ptr() for lay in cache.layers]
    got = _greedy(tiny_sdpa_model, cache, nxt, 6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert [lay.kv_buffers[0].data_ptr() for lay in cache.layers] == ptrs
    assert all(lay.keys.shape[2] == 43 and lay.keys.data_ptr() == p for lay, p in zip(cache.layers, ptrs))
    assert cache.get_seq_length() == 43


def test_a_copy_is_independent_and_the_capacity_holds(tiny_sdpa_model, rng):
    """A deep copy steps on its own buffers (the original's length and values stay); a step past the
    capacity is one clear error; a capacity below the cached tokens too."""
    ids = torch.randint(0, tiny_sdpa_model.config.vocab_size, (1, 20), generator=rng)
    cache, nxt = _prefill(tiny_sdpa_model, ids)
    assert in_place(cache, 21)
    before = cache.layers[0].keys.clone()
    twin = copy.deepcopy(cache)
    _greedy(tiny_sdpa_model, twin, nxt, 1)
    assert twin.get_seq_length() == 21 and cache.get_seq_length() == 20
    assert torch.equal(cache.layers[0].keys, before)
    assert twin.layers[0].kv_buffers[0].data_ptr() != cache.layers[0].kv_buffers[0].data_ptr()
    with pytest.raises(ValueError, match="in-place cache full"):
        _greedy(tiny_sdpa_model, twin, nxt, 1)
    fresh, _ = _prefill(tiny_sdpa_model, ids)
    with pytest.raises(ValueError, match="below the 20 tokens"):
        in_place(fresh, 10)


def test_other_caches_are_left_alone():
    """No layers, or a layer that is not a plain DynamicLayer (a sliding window keeps its last tokens
    only): False, nothing changed."""
    from transformers.cache_utils import DynamicLayer

    class Sliding(DynamicLayer):
        pass

    lay = Sliding()
    lay.keys = lay.values = torch.zeros(1, 1, 3, 4)
    holder = type("Cache", (), {"layers": [lay]})()
    assert not in_place(holder, 8) and not hasattr(lay, "kv_buffers")
    assert not in_place(object(), 8)


def test_a_dropped_cache_frees_its_buffers_at_once(tiny_sdpa_model, rng):
    """With the cyclic collector off, a converted cache and a deep copy of it free their buffers when
    the last reference goes: no layer refers to itself (s51: a bound ``update`` on each layer kept
    every timed cache alive until a collection, 8 GiB a decode timing at 128K, and the 8B timing ran
    out of GPU memory)."""
    import gc
    import weakref

    ids = torch.randint(0, tiny_sdpa_model.config.vocab_size, (1, 12), generator=rng)
    cache, nxt = _prefill(tiny_sdpa_model, ids)
    assert in_place(cache, 14)
    twin = copy.deepcopy(cache)
    _greedy(tiny_sdpa_model, twin, nxt, 1)
    refs = [weakref.ref(c.layers[0].kv_buffers[0]) for c in (cache, twin)]
    gc.collect()
    gc.disable()
    try:
        del cache, twin
        assert [r() is None for r in refs] == [True, True]
    finally:
        gc.enable()


def test_a_converted_cache_converts_again_with_room(tiny_sdpa_model, rng):
    """A cache converted before (or its deep copy) is converted again: new buffers of the new capacity, the same
    keys, and it steps on where the full one would refuse (the eval scores an answer on a copy of a prompt's cache
    that generation already converted)."""
    ids = torch.randint(0, tiny_sdpa_model.config.vocab_size, (1, 9), generator=rng)
    cache, nxt = _prefill(tiny_sdpa_model, ids)
    want = _greedy(tiny_sdpa_model, copy.deepcopy(cache), nxt, 3)
    assert in_place(cache, 10)
    got = _greedy(tiny_sdpa_model, cache, nxt, 1)
    twin = copy.deepcopy(cache)
    old = twin.layers[0].kv_buffers[0].data_ptr()
    assert in_place(twin, 12)
    assert twin.layers[0].kv_buffers[0].shape[2] == 12 and twin.layers[0].kv_buffers[0].data_ptr() != old
    assert torch.equal(twin.layers[0].keys, cache.layers[0].keys)
    got += _greedy(tiny_sdpa_model, twin, want[0].argmax(-1)[:, None], 2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="in-place cache full"):
        _greedy(tiny_sdpa_model, cache, nxt, 1)
