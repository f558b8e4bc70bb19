"""Atomic safetensors files, with a compact encoding for mostly-zero histograms.

A tensor named in ``sparse`` is stored as ``<name>.idx`` (int32 flat indices of its non-zero
entries) and ``<name>.val`` (their values), its shape in the file metadata, whenever that is
smaller than the dense tensor; ``load_tensors`` gives it back dense. Fine histogram bins then cost nothing on disk for the bins nobody hits.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_SPARSE_META = "sparsecal.sparse"


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to path via a temporary file and an atomic rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], sparse=(), metadata=None) -> None:
    """Save CPU copies of ``tensors`` to a safetensors file atomically."""
    path = Path(path)
    out, shapes = {}, {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        flat = t.flatten()
        idx = torch.nonzero(flat, as_tuple=True)[0] if name in sparse else None
        if idx is not None and idx.numel() * (4 + t.element_size()) < t.numel() * t.element_size():
            out[f"{name}.idx"] = idx.to(torch.int32)
            out[f"{name}.val"] = flat[idx].contiguous()
            shapes[name] = list(t.shape)
        else:
            out[name] = t
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    meta[_SPARSE_META] = json.dumps(shapes)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(out, str(tmp), metadata=meta)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def load_tensors(path: Path, keys=None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Load a file written by ``save_tensors``: (dense tensors, metadata). ``keys`` limits the
    tensors read (the file is memory-mapped, so skipped tensors cost nothing)."""
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        want = None if keys is None else set(keys)
        raw = {k: f.get_tensor(k) for k in f.keys() if want is None or k.rsplit(".", 1)[0] in want or k in want}
    shapes = {k: v for k, v in json.loads(meta.pop(_SPARSE_META, "{}")).items() if f"{k}.val" in raw}
    out = {k: v for k, v in raw.items() if not (k.endswith(".idx") or k.endswith(".val"))}
    for name, shape in shapes.items():
        val = raw[f"{name}.val"]
        dense = torch.zeros(int(torch.tensor(shape).prod()) if shape else 1, dtype=val.dtype)
        dense[raw[f"{name}.idx"].long()] = val
        out[name] = dense.view(shape)
    return out, meta
