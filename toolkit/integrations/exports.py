"""The torch side of the export files: ``thresholds.bsfa.pt`` (torch.save of the BSFA reference's
dict) and BSFA thresholds as tensors for the kernels. The formats themselves, the safetensors
file and blasst.json live in ``sparsecal.formats.exports``.

Shape legend: K k values, L layers, H query heads, P query blocks (max_num_blocks), C calibrated
decode positions.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import (
    BSFA_PT,
    BsfaExport,
    bsfa_file,
    bsfa_from_payload,
    bsfa_pt_payload,
    check_bsfa,
    read_bsfa_safetensors,
    write_bsfa_safetensors,
)
from sparsecal.formats.files import atomic_write


def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy() if isinstance(x, torch.Tensor)
                                else np.asarray(x, np.float32))


def write_bsfa(out: Path, thr, k_values, block_m: int, block_n: int, aggregation: str, meta: dict,
               decode: tuple = (None, None)) -> None:
    """thresholds.bsfa.pt and thresholds.safetensors from thresholds [K, L, H, P] (tensor or array);
    ``decode``: (decode thresholds [K, L, H, P] calibrated on decode rows, calibrated positions [C])
    or (None, None)."""
    arr = _f32(thr)
    dthr = None if decode[0] is None else _f32(decode[0])
    dpos = None if decode[1] is None else [int(p) for p in np.asarray(decode[1]).tolist()]
    payload = bsfa_pt_payload(torch.from_numpy(arr), k_values, block_m, block_n, aggregation,
                              None if dthr is None else (torch.from_numpy(dthr), dpos), identity=meta)
    atomic_write(Path(out) / BSFA_PT, lambda p: torch.save(payload, p))
    write_bsfa_safetensors(out, arr, k_values, block_m, block_n, aggregation, meta,
                           None if dthr is None else (dthr, dpos))


def _read_pt(path: Path) -> BsfaExport:
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable pickle is one user-facing error
        raise UserError(f"{path} is not a readable BSFA export ({type(e).__name__}); export it again with `sparsecal export`.")
    if isinstance(d, dict) and not isinstance(d.get("thresholds"), torch.Tensor) and "thresholds" in d:
        raise UserError(f"{path}: thresholds is not a tensor; the file is damaged: export it again.")
    exp = bsfa_from_payload(path, d)
    dec = None if exp.decode_thresholds is None else exp.decode_thresholds.float()
    return replace(exp, thresholds=exp.thresholds.float(), decode_thresholds=dec)


def load_bsfa(path, expect: dict | None = None) -> BsfaExport:
    """BSFA thresholds as a float32 tensor [K, L, H, P] from an export directory, a .bsfa.pt or a
    .safetensors file, checked against ``expect`` (any of: model, num_layers, num_heads, block_m,
    block_n). ``decode_for_k(k)`` gives the decode thresholds [L, H, P] as a tensor, or None for an
    export without them."""
    path = bsfa_file(path)
    if path.suffix == ".pt":
        exp = _read_pt(path)
    else:
        exp = read_bsfa_safetensors(path)
        dec = None if exp.decode_thresholds is None else torch.from_numpy(exp.decode_thresholds)
        exp = replace(exp, thresholds=torch.from_numpy(exp.thresholds), decode_thresholds=dec)
    return check_bsfa(path, exp, expect)
