"""Plain-torch simulation of FlashInfer's Hopper skip-softmax prefill: what
``flashinfer.prefill.trtllm_fmha_v2_prefill(..., skip_softmax_threshold_scale_factor=a)`` computes
on one causal sequence (the TRT-LLM fmha_v2 warp-specialized sm90 kernel that FlashInfer 0.7.2.post1
JIT-builds; its other Hopper paths (fa2/fa3 wrappers, cuDNN) refuse or ignore the factor).

Read in flashinfer-ai/flashinfer at commit beabf5004585b03da60e927bbb803acbaa62fe36 (the wheel
flashinfer-python 0.7.2.post1), facts only:

- Tiles (``flashinfer/jit/attention/fmha_v2/fmha_library.py``, ``generate_kernel_spec``): a
  compute warpgroup owns ``STEP_Q = loop_step = 64`` query rows; ``STEP_KV = kv_loop_step`` keys =
  256 for head_dim <= 64, 128 for <= 128, 64 above (bf16/fp16). A CTA runs two compute
  warpgroups on two consecutive 64-row steps (``NUM_COMPUTE_GROUPS``; ``q_steps`` is always
  even, ``fmha/warpspec/dma.h``), so the last step may lie wholly past the sequence.
- Key range (``dma.h`` ``compute_kv_tile_idx``, causal): both steps of a CTA walk the key tiles
  0 .. (q_step_end // STEP_KV) inclusive, q_step_end the CTA's last row; no cap at the sequence's
  tile count.
- Vote (``fmha/warpspec/epilogue.h`` ``Softmax::compute_and_update_scale``, ``compute.h``): every
  tile but the step's first (``IS_FIRST_COL``) is a candidate, the diagonal ones included. Each
  row r tests ``exp2f((local_max_r - global_max_r) * scale_bmm1) < threshold`` where
  ``scale_bmm1 = bmm1_scale * log2(e)`` (``fmha_v2_run.cu`` ``set_params``), local_max_r the row's
  max raw score Q.K over the tile's visible keys (-FLT_MAX where it sees none) and global_max_r the
  running max of the tiles the step has processed so far; ``__all_sync`` over a warp's 16 rows,
  then ``atomicAnd`` of the 4 warps' votes: the 64 rows skip together.
- A skipped tile returns before the exponentials: no P.V, and neither the running max nor the
  row sums change (they are updated only by processed tiles). K and V are still loaded.
- ``threshold = skip_softmax_threshold_scale_factor / actual_kv_seqlen`` (``compute.h``), the
  sequence's whole key length; no clamp, so lambda > 1 also skips tiles that raise the running
  max by less than ln(lambda). A factor <= 0 selects the kernel without skipping
  (``fmha_v2_run.cu``: ``enable_skip_softmax = factor > 0``).
- Causal mask (``epilogue.h`` ``apply_alibi_and_mask``): key col visible to row iff col <= row,
  no length test. Rows past N are modelled as zero query rows (the Q tile is a TMA load, which
  fills out-of-bounds rows with zeros): they score 0 on every key up to their index and, for
  lambda <= 1, veto skipping. Keys past N likewise score 0 (visible only to rows past N).
- Counts (``#ifdef SKIP_SOFTMAX_STAT`` in ``compute.h`` / ``epilogue.h``, not compiled by
  FlashInfer's JIT): ``total_blocks`` = tile visits of all 64-row steps (first tiles included),
  ``skipped_blocks`` = skipped visits. ``simulate`` returns exactly these two numbers.

Shape legend: H query heads, Hkv KV heads (H % Hkv == 0, head h reads KV head h // (H / Hkv)),
N tokens, D head dim, T = number of 64-row steps (a multiple of 2), J = key tiles walked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG2E = 1.4426950408889634


def step_kv_for(head_dim: int) -> int:
    """FlashInfer fmha_v2's bf16/fp16 Hopper key tile for ``head_dim`` (``kv_loop_step``)."""
    if head_dim <= 64:
        return 256
    if head_dim <= 128:
        return 128
    return 64


@dataclass
class SkipResult:
    """``out`` [H, N, D] float32 (rows < N); ``skipped`` and ``total`` the kernel's
    ``skipped_blocks`` / ``total_blocks``; ``kept`` [H, T, J] bool (True = processed; tiles past a
    step's range are False and not counted)."""

    out: torch.Tensor
    skipped: int
    total: int
    kept: torch.Tensor

    @property
    def share(self) -> float:
        """Skipped tile visits over all tile visits."""
        return self.skipped / self.total if self.total else 0.0


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError("q [H, N, D], k and v [Hkv, N, D] expected")
    if q.shape[1:] != k.shape[1:] or q.shape[0] % k.shape[0]:
        raise ValueError("q and k/v disagree in N or D, or H is not a multiple of Hkv")


def _threshold(factor: float, n: int) -> torch.Tensor:
    """factor / N in float32, as the kernel divides (float by int)."""
    return torch.tensor(factor, dtype=torch.float32) / n


def _scan(tile_max: torch.Tensor, ranges: torch.Tensor, lam: torch.Tensor, scale_log2: torch.Tensor,
          enabled: bool) -> torch.Tensor:
    """The vote of every step's tile, in order. tile_max [T, 64, J] float32 (-inf where a row sees
    nothing), ranges [T] tiles walked per step; returns kept [T, J] bool."""
    steps, _, tiles = tile_max.shape
    col = torch.arange(tiles, device=tile_max.device)
    active = col[None, :] < ranges[:, None]
    kept = active.clone()
    run = tile_max[:, :, 0].clone()
    for j in range(1, tiles):
        cur = tile_max[:, :, j]
        if enabled:
            ratio = torch.exp2((cur - run) * scale_log2)
            skip = (ratio < lam).all(dim=1) & active[:, j]
        else:
            skip = torch.zeros(steps, dtype=torch.bool, device=tile_max.device)
        kept[:, j] = active[:, j] & ~skip
        run = torch.where(kept[:, j, None], torch.maximum(run, cur), run)
    return kept


def _head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, step_q: int, step_kv: int,
          groups: int, lam: torch.Tensor, scale: float, enabled: bool, need_out: bool):
    """One head: q [Np, D] float32 (rows >= n zero), k, v [Kp, D] float32 (rows >= n zero).
    Returns (out [n, D] or None, kept [T, J])."""
    rows, d = q.shape
    steps = rows // step_q
    tiles = k.shape[0] // step_kv
    cta_rows = step_q * groups
    cta_end = (torch.arange(steps, device=q.device) // groups + 1) * cta_rows - 1
    ranges = cta_end // step_kv + 1
    row = torch.arange(rows, device=q.device)
    colk = torch.arange(k.shape[0], device=q.device)
    s = q @ k.T
    visible = colk[None, :] <= row[:, None]
    s = s.masked_fill(~visible, -math.inf)
    tile_max = s.view(steps, step_q, tiles, step_kv).amax(dim=-1)
    scale_log2 = torch.tensor(scale, dtype=torch.float32) * torch.tensor(LOG2E, dtype=torch.float32)
    kept = _scan(tile_max, ranges, lam.to(q.device), scale_log2.to(q.device), enabled)
    if not need_out:
        return None, kept
    keep_keys = kept.repeat_interleave(step_q, dim=0).repeat_interleave(step_kv, dim=1)
    logits = (s * scale).masked_fill(~keep_keys, -math.inf)[:n]
    out = torch.softmax(logits, dim=-1) @ v
    return out, kept


def simulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, factor: float, scale: float | None = None,
             step_q: int = 64, step_kv: int | None = None, groups: int = 2, need_out: bool = True) -> SkipResult:
    """FlashInfer fmha_v2's causal skip-softmax prefill of one sequence.

    q [H, N, D], k and v [Hkv, N, D] (any float dtype; computed in float32 from their values);
    ``factor`` the exported skip_softmax_threshold_scale_factor (lambda = factor / N; <= 0 runs
    dense); ``scale`` the softmax scale (default 1/sqrt(D)); ``step_q`` x ``step_kv`` the tile
    (default FlashInfer's for D), ``groups`` the 64-row steps per CTA; ``need_out=False`` leaves
    ``out`` empty (counts only). Returns a SkipResult."""
    _check(q, k, v)
    heads, n, d = q.shape
    step_kv = step_kv or step_kv_for(d)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cta_rows = step_q * groups
    rows = -(-n // cta_rows) * cta_rows
    keys = ((rows - 1) // step_kv + 1) * step_kv
    lam = _threshold(factor, n)
    per_kv = heads // k.shape[0]
    outs, kept_all = [], []
    for h in range(heads):
        qp = q.new_zeros((rows, d), dtype=torch.float32)
        qp[:n] = q[h].float()
        kp = k.new_zeros((keys, d), dtype=torch.float32)
        vp = torch.zeros_like(kp)
        kp[:n] = k[h // per_kv].float()
        vp[:n] = v[h // per_kv].float()
        out, kept = _head(qp, kp, vp, n, step_q, step_kv, groups, lam, scale, factor > 0, need_out)
        if out is not None:
            outs.append(out)
        kept_all.append(kept)
    kept = torch.stack(kept_all)
    steps = rows // step_q
    cta_end = (torch.arange(steps) // groups + 1) * cta_rows - 1
    total = int((cta_end // step_kv + 1).sum()) * heads
    skipped = total - int(kept.sum())
    out = torch.stack(outs) if outs else q.new_zeros((0,), dtype=torch.float32)
    return SkipResult(out=out, skipped=skipped, total=total, kept=kept)


def factor_for_share(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, target: float, lo: float = 1e-3,
                     hi: float | None = None, iters: int = 24, **kw) -> tuple[float, SkipResult]:
    """The factor whose simulated skipped share is closest to ``target`` (0..1), by bisection in
    log(factor) between ``lo`` and ``hi`` (default N); returns (factor, its SkipResult). The share
    grows with the factor, in steps, so the target is met only as closely as the tiles allow."""
    n = q.shape[1]
    a, b = math.log(lo), math.log(hi if hi is not None else float(n))
    best: tuple[float, SkipResult] | None = None
    for _ in range(iters):
        mid = 0.5 * (a + b)
        res = simulate(q, k, v, math.exp(mid), need_out=False, **kw)
        if best is None or abs(res.share - target) < abs(best[1].share - target):
            best = (math.exp(mid), res)
        if res.share == target:
            break
        if res.share < target:
            a = mid
        else:
            b = mid
    assert best is not None
    return best
