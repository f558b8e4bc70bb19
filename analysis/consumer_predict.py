"""What sparsecal predicts a consumer's skip rule does on one captured sample (numpy, torch-free).

Model-Optimizer's ``flash_skip_softmax`` (NVIDIA/Model-Optimizer 0.47.0,
``modelopt/torch/sparsity/attention_sparsity/methods/flash_skip_softmax.py``,
``calc_correction_factor_and_p``) on the HF eager path decides per 128 x 128 block (decode: one row
against 128-key blocks) with the inclusive cumulative max, the rule sparsecal's gap statistic
records, but it differs from sparsecal's runtime in three places that the prediction follows:

- every reachable tile is a candidate, the diagonal tile too (sparsecal always computes it): the
  diagonal tiles' gaps come from the sample's ``diag_gap_count`` / ``decode_diag_gap_count``
  histograms (captures since they exist), else from its raw tiles (``capture --raw``, prefill),
  else they count as kept and the row says so;
- at lambda >= 1 (ln lambda >= 0) every tile is skipped, the diagonal and a row's first tile
  included (its block max minus the inclusive running max is <= 0, never above ln lambda);
- a partial last query block (N % 128 != 0) is padded with finfo.min rows whose difference is 0,
  so at lambda < 1 every tile of that block row is kept (needs the raw tiles to be subtracted).

Counts are over the enabled layers only (Model-Optimizer's disabled modules record nothing), and
the denominator is Model-Optimizer's: every reachable (causal) tile of every enabled layer and head.

Shape legend: L' captured layers, H query heads, O scan orders, NG gap bins, P query blocks,
Kb key blocks.
"""
from __future__ import annotations

import numpy as np

from sparsecal.analysis.blasst import skipped as hist_skipped
from sparsecal.analysis.samples import decode_reachable

PREFILL_KEYS = ("gap_count", "decode_gap_count", "reachable", "candidates")
DIAG_KEYS = ("diag_gap_count", "decode_diag_gap_count")
RAW_KEYS = ("raw_gap",)


def _raw_prefill(raw_gap: np.ndarray, cand: np.ndarray, reach: np.ndarray, log_lambda: float, partial: bool):
    """(diagonal tiles skipped, tiles of the last query block skipped) from raw gaps [L', H, P, Kb]
    (one order) at ``log_lambda`` < 0; the second is 0 unless the last query block is ``partial``."""
    g = np.asarray(raw_gap, np.float64)
    j = np.arange(g.shape[-1])
    diag = (j[None, :] >= cand[:, None]) & (j[None, :] < reach[:, None])               # [P, Kb]
    below = g < log_lambda
    diag_skipped = float((below & diag).sum())
    last = float((below[..., -1, :] & (j < reach[-1])).sum()) if partial else 0.0
    return diag_skipped, last


def modelopt_prefill(arrays: dict, edges, pos: np.ndarray, order: int, block_m: int, length: int,
                     log_lambda: float) -> dict:
    """Predicted prefill skip count of one sample under Model-Optimizer's rule at ``log_lambda``.
    ``arrays``: the sample's PREFILL_KEYS (and raw_gap [L', H, O, P, Kb] if captured); ``pos``:
    positions of the enabled layers among the captured ones. Returns {skipped, total, diagonal}."""
    reach = np.asarray(arrays["reachable"], np.int64)
    heads = arrays["gap_count"].shape[1]
    total = float(reach.sum()) * len(pos) * heads
    raw, hist = arrays.get("raw_gap"), arrays.get("diag_gap_count")
    if log_lambda >= 0.0:
        return {"skipped": total, "total": total, "diagonal": "all skipped (lambda >= 1)"}
    skip = float(hist_skipped(np.asarray(arrays["gap_count"])[pos, :, order].sum((0, 1)), edges, log_lambda))
    known = "unknown (counted kept)"
    if raw is not None:
        diag, last = _raw_prefill(np.asarray(raw)[pos, :, order], np.asarray(arrays["candidates"], np.int64),
                                  reach, log_lambda, length % block_m != 0)
        skip, known = skip + diag - last, "raw tiles"
    if hist is not None:   # the histogram replaces the raw diagonal count (the partial-block fix stays)
        if raw is not None:
            skip -= diag
        skip += float(hist_skipped(np.asarray(hist)[pos, :, order].sum((0, 1)), edges, log_lambda))
        known = "diagonal gap histogram" + (" (partial last block from raw tiles)" if raw is not None else "")
    return {"skipped": skip, "total": total, "diagonal": known}


def modelopt_decode(arrays: dict, edges, pos: np.ndarray, order: int, length: int, cfg, log_lambda: float) -> dict:
    """Predicted decode skip count of one sample's decode rows (the last min(decode_rows, N) rows,
    each its own block against block_n-key tiles). The row's own (last) block counts as kept at
    lambda < 1 unless the sample has ``decode_diag_gap_count``; at lambda >= 1 every tile is skipped."""
    heads = arrays["decode_gap_count"].shape[1]
    total = float(decode_reachable(length, cfg)) * len(pos) * heads
    if log_lambda >= 0.0:
        return {"skipped": total, "total": total, "diagonal": "all skipped (lambda >= 1)"}
    skip = float(hist_skipped(np.asarray(arrays["decode_gap_count"])[pos, :, order].sum((0, 1)), edges, log_lambda))
    hist = arrays.get("decode_diag_gap_count")
    if hist is None:
        return {"skipped": skip, "total": total, "diagonal": "the row's own block counted kept"}
    skip += float(hist_skipped(np.asarray(hist)[pos, :, order].sum((0, 1)), edges, log_lambda))
    return {"skipped": skip, "total": total, "diagonal": "diagonal gap histogram"}


def load_sample_arrays(store, rec: dict) -> dict:
    """The statistics a prediction needs (raw gaps where the run captured them) and the token ids."""
    from sparsecal.analysis.samples import load_arrays

    arrays = load_arrays(store, rec, PREFILL_KEYS + ("input_ids",), optional=DIAG_KEYS)
    if store.manifest["config"].get("raw"):
        _, raw = store.load_sample(rec["id"], raw=True, keys=("reachable",))
        if "raw_gap" in raw:
            arrays["raw_gap"] = np.asarray(raw["raw_gap"])
    return arrays
