"""Atomic safetensors files of numpy arrays, with a compact encoding for mostly-zero histograms.

An array named in ``sparse`` is stored as ``<name>.idx`` (int32 flat indices of its non-zero
entries) and ``<name>.val`` (their values), its shape in the file metadata under
``sparsecal.sparse``, whenever that is smaller than the dense array; ``load_arrays`` gives it back
dense. Fine histogram bins then cost nothing on disk for the bins nobody hits. Writers holding
torch tensors convert them first (``tensor.cpu().numpy()``); every reader, torch-free or not,
decodes the file here.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sparsecal.formats.files import atomic_write

SPARSE_META = "sparsecal.sparse"


def encode(arrays: dict[str, np.ndarray], sparse=()) -> tuple[dict[str, np.ndarray], dict[str, list]]:
    """(arrays to store, {name: shape} of the ones stored as idx/val pairs)."""
    out, shapes = {}, {}
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        flat = a.reshape(-1)
        idx = np.flatnonzero(flat) if name in sparse else None
        if idx is not None and idx.size * (4 + a.itemsize) < a.size * a.itemsize:
            out[f"{name}.idx"] = idx.astype(np.int32)
            out[f"{name}.val"] = np.ascontiguousarray(flat[idx])
            shapes[name] = list(a.shape)
        else:
            out[name] = a
    return out, shapes


def decode(raw: dict[str, np.ndarray], shapes: dict[str, list]) -> dict[str, np.ndarray]:
    """The dense arrays of a file's stored arrays and its ``sparsecal.sparse`` shapes."""
    out = {k: v for k, v in raw.items() if not k.endswith((".idx", ".val"))}
    for name, shape in shapes.items():
        if f"{name}.val" not in raw:
            continue
        val = raw[f"{name}.val"]
        dense = np.zeros(int(np.prod(shape)) if shape else 1, dtype=val.dtype)
        dense[raw[f"{name}.idx"].astype(np.int64)] = val
        out[name] = dense.reshape(shape)
    return out


def serialize_arrays(arrays: dict[str, np.ndarray], sparse=(), metadata=None) -> bytes:
    """The safetensors file ``save_arrays`` writes, as bytes; ``metadata`` values are stringified."""
    from safetensors.numpy import save

    out, shapes = encode(arrays, sparse)
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    meta[SPARSE_META] = json.dumps(shapes)
    return save(out, metadata=meta)


def save_arrays(path: Path, arrays: dict[str, np.ndarray], sparse=(), metadata=None) -> None:
    """Save ``arrays`` to a safetensors file atomically; ``metadata`` values are stringified."""
    write_bytes(path, serialize_arrays(arrays, sparse, metadata))


def write_bytes(path: Path, data: bytes) -> None:
    """Write serialized bytes to ``path`` atomically."""
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def load_arrays(path: Path, keys=None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Load a file written by ``save_arrays``: (dense arrays, metadata). ``keys`` limits the
    arrays read (the file is memory-mapped, so skipped arrays cost nothing)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = dict(f.metadata() or {})
        want = None if keys is None else set(keys)
        raw = {k: f.get_tensor(k) for k in f.keys() if want is None or k.rsplit(".", 1)[0] in want or k in want}  # noqa: SIM118
    shapes = json.loads(meta.pop(SPARSE_META, "{}"))
    return decode(raw, shapes), meta


def header_shapes(path: Path) -> tuple[dict[str, tuple], dict[str, str]]:
    """({array name: shape}, metadata) of a file written by ``save_arrays``, from its header only
    (arrays stored as idx/val pairs by their dense shape)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = dict(f.metadata() or {})
        raw = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - a safe_open handle is not iterable
    sparse = json.loads(meta.pop(SPARSE_META, "{}"))
    out = {k: v for k, v in raw.items() if not k.endswith((".idx", ".val"))}
    out.update({name: tuple(shape) for name, shape in sparse.items() if f"{name}.val" in raw})
    return out, meta
