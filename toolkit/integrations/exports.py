"""The torch side of the export files: ``thresholds.bsfa.pt`` (torch.save of the BSFA reference's
dict) and BSFA thresholds as tensors for the kernels. The formats themselves, the safetensors
file and blasst.json live in ``sparsecal.formats.exports``.

Shape legend: K k values, L layers, H query heads, P query blocks (max_num_blocks).
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


def write_bsfa(out: Path, thr, k_values, block_m: int, block_n: int, aggregation: str, meta: dict) -> None:
    """thresholds.bsfa.pt and thresholds.safetensors from thresholds [K, L, H, P] (tensor or array)."""
    arr = thr.detach().to("cpu", torch.float32).numpy() if isinstance(thr, torch.Tensor) else np.asarray(thr, np.float32)
    arr = np.ascontiguousarray(arr)
    payload = bsfa_pt_payload(torch.from_numpy(arr), k_values, block_m, block_n, aggregation)
    atomic_write(Path(out) / BSFA_PT, lambda p: torch.save(payload, p))
    write_bsfa_safetensors(out, arr, k_values, block_m, block_n, aggregation, meta)


def _read_pt(path: Path) -> BsfaExport:
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable pickle is one user-facing error
        raise UserError(f"{path} is not a readable BSFA export ({type(e).__name__}); export it again with `sparsecal export`.")
    if isinstance(d, dict) and not isinstance(d.get("thresholds"), torch.Tensor) and "thresholds" in d:
        raise UserError(f"{path}: thresholds is not a tensor; the file is damaged: export it again.")
    exp = bsfa_from_payload(path, d)
    return replace(exp, thresholds=exp.thresholds.float())


def load_bsfa(path, expect: dict | None = None) -> BsfaExport:
    """BSFA thresholds as a float32 tensor [K, L, H, P] from an export directory, a .bsfa.pt or a
    .safetensors file, checked against ``expect`` (any of: model, num_layers, num_heads, block_m,
    block_n)."""
    path = bsfa_file(path)
    if path.suffix == ".pt":
        exp = _read_pt(path)
    else:
        exp = read_bsfa_safetensors(path)
        exp = replace(exp, thresholds=torch.from_numpy(exp.thresholds))
    return check_bsfa(path, exp, expect)
