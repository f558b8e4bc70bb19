"""The GGUF cache (capture/gguf_cache.py): what it returns is what the GGUF file holds, bit for bit,
and its parts are published atomically, once, whatever the race."""
import os

import numpy as np
import pytest
import torch

from sparsecal.capture import gguf_cache
from sparsecal.capture.models import load_config, load_model, resolve_model


@pytest.mark.model
def test_cached_smollm2_is_the_gguf_bit_for_bit(tok):
    """Config, vocabulary and weights read back from the cache equal the GGUF's own values, read
    with the gguf package's reader and dequantizer (not through transformers)."""
    import gguf
    from gguf.quants import dequantize

    ms = resolve_model("smollm2")
    cfg, model = load_config(ms), load_model(ms)
    for name in gguf_cache.PARTS:
        assert gguf_cache.part(ms.path, ms.gguf_file, name) is not None, f"{name} not cached"
    assert model.config._name_or_path == cfg._name_or_path == str(ms.path)
    reader = gguf.GGUFReader(ms.path / ms.gguf_file)

    def field(key):
        f = reader.fields[key]
        return f.parts[f.data[0]]

    assert cfg.num_hidden_layers == int(field("llama.block_count")[0])
    assert cfg.num_key_value_heads == int(field("llama.attention.head_count_kv")[0])
    assert not hasattr(cfg, "quantization_config") or cfg.quantization_config is None
    f = reader.fields["tokenizer.ggml.tokens"]
    vocab = [bytes(f.parts[i]).decode() for i in f.data]
    assert tok.convert_ids_to_tokens(list(range(len(vocab)))) == vocab
    tensors = {t.name: t for t in reader.tensors}
    sd = model.state_dict()
    for gname, hname in [("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                         ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight"),
                         ("token_embd.weight", "model.embed_tokens.weight"),
                         ("output_norm.weight", "model.norm.weight")]:
        t = tensors[gname]
        want = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        assert torch.equal(sd[hname], want.reshape(sd[hname].shape)), hname
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tied as in the GGUF"


def test_parts_are_published_once_and_atomically(tmp_path, monkeypatch):
    """A part appears whole or not at all; a second writer's copy is discarded; an unwritable cache
    is skipped, not an error; SPARSECAL_CACHE=off turns it off."""
    src = tmp_path / "m"
    src.mkdir()
    (src / "x.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv(gguf_cache.ENV, str(tmp_path / "cache"))
    assert gguf_cache.part(src, "x.gguf", "config") is None

    def boom(d):
        (d / "half").write_text("1")
        raise OSError("disk full")

    gguf_cache._publish(src, "x.gguf", "config", boom)
    assert gguf_cache.part(src, "x.gguf", "config") is None
    gguf_cache._publish(src, "x.gguf", "config", lambda d: (d / "a").write_text("first"))
    gguf_cache._publish(src, "x.gguf", "config", lambda d: (d / "a").write_text("second"))
    done = gguf_cache.part(src, "x.gguf", "config")
    assert done is not None and (done / "a").read_text() == "first"
    assert [p.name for p in done.parent.iterdir()] == ["config"], "no temporary folder left behind"
    os.utime(src / "x.gguf", ns=(1, 1))
    assert gguf_cache.part(src, "x.gguf", "config") is None, "a changed file is a new entry"
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    monkeypatch.setenv(gguf_cache.ENV, str(ro / "cache"))
    if not os.access(ro, os.W_OK):  # root writes anywhere: the refusal cannot be simulated
        gguf_cache._publish(src, "x.gguf", "config", lambda d: (d / "a").write_text("x"))
        assert gguf_cache.part(src, "x.gguf", "config") is None
    monkeypatch.setenv(gguf_cache.ENV, "off")
    assert gguf_cache.entry(src, "x.gguf") is None and gguf_cache.root() is None
