"""The baselines and variants ``sparsify`` runs besides BSFA, BLASST and window (issue 27, part 5):

- ``window_sink`` (``blocks`` = B >= 1): StreamingLLM's configuration at the window's block budget:
  key block 0 (the attention sink) and the B - 1 candidates nearest the diagonal, so B candidates
  per query block are kept, as ``window`` B keeps (kernels: window W = B - 1 with ``sink``).
- ``blasst_sl`` (``target``): BLASST in the ``sink_local`` scan order (block 0, the diagonal blocks,
  then the other candidates), with the export's lambda law for the target. The law was calibrated
  in the export's own ``scan_order`` (blasst.json): unless the export was fitted with ``sparsecal
  fit RUN --order sink_local``, it is the forward order's lambda applied in another order, so the
  sparsity reached is not the target; the evaluation rows record the measured one. Not dispatched
  (the dispatch record was measured in the export's order).
- ``vfa``: exact attention with the running max initialised from the Q-init estimate and the sink
  and local blocks, then frozen (kernels/sparse/vfa.py defines it); skips nothing.
- ``vsa`` (``target``): VFA with BLASST skipping against the frozen max, in sink_local order, at
  the export's lambda law for the target (the same caveat as blasst_sl). Not dispatched.

vfa and vsa run the plain-torch reference (kernels/sparse/vfa.py) on every device: there is no
Triton VFA kernel yet, so their rows measure accuracy, not speed. A prefill or decode step in which
no query block has a candidate besides block 0 (``vfa.nothing_to_freeze``) and ``decode="dense"``
steps run the ``dense`` method's own path, bit for bit. Besides ``skipped`` / ``reachable``,
``model.sparsecal_stats`` then holds per layer and head ([L, H]): ``vfa_rescales`` (rescales VFA
still does), ``fa_rescales`` (those of the dense kernel's forward online softmax), ``vfa_exceed``
((row, tile) pairs above the frozen max), ``vfa_frozen`` ((row, tile) pairs under the frozen max)
and ``vfa_excess`` (largest row max above the frozen max, float32).
"""
from __future__ import annotations

import math
import sys

import torch

from sparsecal.formats.errors import UserError

VARIANT_BASE = {"window_sink": "window", "blasst_sl": "blasst", "vfa": "dense", "vsa": "blasst"}  # export read as
VFA_STATS = {"rescales": "vfa_rescales", "fa_rescales": "fa_rescales", "exceed": "vfa_exceed",
             "frozen": "vfa_frozen", "excess": "vfa_excess"}


def load_variant(export_dir, method: str, k, target, blocks, expect: dict, backend: str, load_method):
    """The state of ``method``: ``load_method`` (sparsify._load_method) for the method a variant
    reads its export as, then the variant's changes."""
    base = VARIANT_BASE.get(method, method)
    if method == "window_sink":
        if blocks is None or blocks < 1:
            raise UserError("window_sink needs blocks >= 1 (the sink and blocks - 1 nearest candidates): "
                            "sparsify(model, EXPORT_DIR, method='window_sink', blocks=32).")
        blocks = blocks - 1
    state = load_method(export_dir, base, k, target, blocks, expect, backend)
    state.sink = method == "window_sink"
    state.vfa = method in ("vfa", "vsa")
    if method in ("blasst_sl", "vsa"):
        state.order = "sink_local"
    return state


def vfa_args(state, mode: str, length: int, blasst_args) -> dict:
    """The call's arguments for vfa / vsa: {"dense": True} where the dense path runs (decode="dense",
    nothing to freeze), else {"vfa": True, "log_lambda": ln(lambda) or None (vfa, or vsa where the
    lambda law runs dense)}; ``blasst_args()``: sparsify.method_args of the call (vsa's lambda)."""
    from sparsecal.kernels.sparse.vfa import nothing_to_freeze

    block_m = state.block_m if mode == "prefill" else 1
    if (mode == "decode" and state.decode == "dense") or nothing_to_freeze(length, block_m, state.block_n):
        return {"dense": True}
    if state.method == "dense":  # vfa
        return {"vfa": True, "log_lambda": None}
    ll = blasst_args().get("log_lambda")  # {"dense": True} where BLASST's law runs dense: no skipping
    return {"vfa": True, "log_lambda": None if ll is None or ll == -math.inf else ll}


def run_vfa(state, mode: str, query, key, value, scale: float, kw: dict, stats: dict, layer: int):
    """The VFA reference per sequence: (out [B, Nq, H, D], skipped [B, H], reachable tiles per row
    and head); writes the layer's VFA counts, summed over the batch, into ``stats`` (VFA_STATS, [L, H])."""
    from sparsecal.kernels.sparse.vfa import vfa_attention, vfa_decode

    if query.is_cuda and not state.said_fallback:
        print("note: vfa / vsa run the plain-torch reference (no Triton VFA kernel yet).", file=sys.stderr)
        state.said_fallback = True
    args = {"log_lambda": kw.get("log_lambda"), "softcap": kw.get("softcap") or 0.0}
    run = vfa_attention if mode == "prefill" else vfa_decode
    b, h = query.shape[:2]
    # The batch folded into the heads ([1, B*H, ...]): every (sequence, head) is independent and
    # query head b*H + h maps to KV head b*Hkv + h // G, its own sequence's; so one call does the
    # whole batch and its per-head counts [B*H] are the per-sequence counts [B, H].
    fold = lambda x: x.reshape(1, b * x.shape[1], *x.shape[2:])
    out, c = run(fold(query), fold(key), fold(value), scale, state.block_m, state.block_n, **args)
    for name, key_name in VFA_STATS.items():
        t = stats.get(key_name)
        rows = stats["row_skipped"]  # [L, B, H]: the layer and head counts are [L, H]
        if t is None or t.shape != (rows.shape[0], rows.shape[2]) or t.device != rows.device:
            dtype = torch.float32 if name == "excess" else torch.int64
            stats[key_name] = t = torch.zeros(rows.shape[0], rows.shape[2], dtype=dtype, device=rows.device)
        val = getattr(c, name).view(b, h)
        t[layer] = val.amax(dim=0) if name == "excess" else val.sum(dim=0)
    return out.view(b, h, *out.shape[2:]).transpose(1, 2).contiguous(), c.skipped.view(b, h), c.reachable
