"""A local cache of GGUF checkpoints as plain Hugging Face checkpoints.

transformers' GGUF loader parses and dequantizes the whole file on every load: for the default
SmolLM2 (Q4_1) the config takes 5.5 s, the tokenizer 4.5 s and the weights 19.7 s on the project's
2-core machine, paid again by every command (1.6, 0.2 and 2.2 s from the cache). The first load of a GGUF writes what it produced into a cache
entry; later loads read the entry: the config, the tokenizer files and the dequantized weights
(safetensors, float32, the values the GGUF loader returns; any other dtype is cast from them
exactly as the GGUF loader casts). Loads from the cache are bit-identical to the GGUF loader's
(tests/test_gguf_cache.py).

Layout, one entry per GGUF file and transformers version::

    $SPARSECAL_CACHE (default $XDG_CACHE_HOME/sparsecal or ~/.cache/sparsecal)
      gguf/<name>-<digest>/config/      config.json (the GGUF's config, no quantization record)
      gguf/<name>-<digest>/tokenizer/   tokenizer.json, tokenizer_config.json, ...
      gguf/<name>-<digest>/weights/     config.json, model.safetensors (~4 bytes a parameter)

``<digest>`` hashes the file's resolved path, size and modification time and the transformers
version, so a changed file or loader makes a new entry. Each part is written into a temporary
folder beside it and renamed into place, so concurrent processes (ranks, test workers) never see a
half-written part; the loser of a race discards its copy. ``SPARSECAL_CACHE=off`` turns the cache
off. Objects loaded from the cache report the GGUF's folder as their ``name_or_path``.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

ENV = "SPARSECAL_CACHE"
PARTS = ("config", "tokenizer", "weights")
_DROP = ("quantization_config", "dtype", "torch_dtype", "_name_or_path")


def root() -> Path | None:
    """The cache folder, or None when ``SPARSECAL_CACHE=off``."""
    env = os.environ.get(ENV, "")
    if env.lower() in ("off", "0", "none"):
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sparsecal"


def entry(path: Path, gguf_file: str) -> Path | None:
    """The cache entry of ``path / gguf_file`` (None: cache off)."""
    base = root()
    if base is None:
        return None
    import transformers

    f = (Path(path) / gguf_file).resolve()
    st = f.stat()
    key = f"{f}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}"
    return base / "gguf" / f"{Path(gguf_file).stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def part(path: Path, gguf_file: str, name: str) -> Path | None:
    """The folder of a finished part (config, tokenizer or weights), None when absent or off."""
    e = entry(path, gguf_file)
    return e / name if e is not None and (e / name / ".complete").is_file() else None


def _config_dict(cfg) -> dict:
    d = cfg.to_dict()
    for k in _DROP:
        d.pop(k, None)
    return d


def _publish(path: Path, gguf_file: str, name: str, write) -> None:
    """Write one part through ``write(folder)`` into a temporary folder and rename it into place.
    A cache that cannot be written (read-only home, full disk) is skipped: loading still works."""
    e = entry(path, gguf_file)
    if e is None or (e / name / ".complete").is_file():
        return
    try:
        e.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=e))
    except OSError:
        return
    try:
        write(tmp)
        (tmp / ".complete").write_text("")
        os.rename(tmp, e / name)
    except OSError:  # another process published it first, or the disk refused
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def store_config(path: Path, gguf_file: str, cfg) -> None:
    """Cache the config transformers read from the GGUF."""
    import json

    _publish(path, gguf_file, "config",
             lambda d: (d / "config.json").write_text(json.dumps(_config_dict(cfg), indent=2, sort_keys=True)))


def store_tokenizer(path: Path, gguf_file: str, tok) -> None:
    """Cache the tokenizer transformers built from the GGUF."""
    _publish(path, gguf_file, "tokenizer", lambda d: tok.save_pretrained(str(d)))


def store_weights(path: Path, gguf_file: str, model) -> None:
    """Cache a float32 model loaded from the GGUF: its config and dequantized weights (tied
    weights once, as ``save_pretrained`` would)."""
    import json

    import safetensors.torch

    def write(d: Path) -> None:
        sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        for tied in getattr(model, "_tied_weights_keys", None) or ():
            if getattr(model.config, "tie_word_embeddings", False):
                sd.pop(tied, None)
        (d / "config.json").write_text(json.dumps(_config_dict(model.config), indent=2, sort_keys=True))
        safetensors.torch.save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})

    _publish(path, gguf_file, "weights", write)


def renamed(obj, path: Path):
    """``obj`` (config, tokenizer or model) reporting the GGUF's folder as where it came from."""
    cfg = getattr(obj, "config", None)
    for target in (obj, cfg):
        if target is not None and hasattr(target, "_name_or_path"):
            target._name_or_path = str(path)
    if hasattr(obj, "name_or_path") and not hasattr(obj, "config"):
        try:
            obj.name_or_path = str(path)
        except AttributeError:
            pass
    return obj
