"""Plain-torch references of each consumer's skip-softmax decision, read in the consumers' public
source (docs/formats.md "Consumer decision rules" has the table, with repository, path and commit).

Every function takes ``scores`` [B, H, Nq, Nk]: the attention logits softmax sees (softmax_scale *
q.k, natural-log units), one sequence per batch entry, the Nq query rows being the last Nq of the
Nk keys (Nq = 1: a decode step). The causal mask is applied here, with the value the consumer
uses (stated per function), so what sits in the future positions of ``scores`` does not matter.
lambda = factor / kv_len (kv_len defaults to Nk), or ``lam`` given directly. Each returns the
kept/skipped decision per decision unit and the consumer's own (skipped, total) count
(``consumer_vote.Decision``). Kernels comparing in log2 (scores * softmax_scale * log2 e against
log2 lambda) are simulated in ln units: the same decision up to rounding.

Shape legend: B batch, H query heads, G query heads per tile (GQA group), Hg = H / G, Nq query
rows, Nk keys, P query tiles (blocks) of a head or group, T (Kb) key tiles, W voters (warps) per
query tile.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from sparsecal.kernels.sparse.consumer_vote import (
    Decision,
    causal_fill,
    counts,
    log_lambda,
    query_tiles,
    vote,
)

NEG = -math.inf

MODELOPT = "NVIDIA/Model-Optimizer@a2fbac7bad8ab446d3f8783dadb0c3366eb0ad73"
FLASHINFER = "flashinfer-ai/flashinfer@fb28d7242b3506a2348265962041acc1fb56cca4"


def modelopt_hf(scores: torch.Tensor, factor: float | None = None, *, lam: float | None = None,
                kv_len: int | None = None, br: int = 128, bc: int = 128, causal: bool = True) -> Decision:
    """Model-Optimizer 0.47 ``flash_skip_softmax`` (HF eager backend and its PyTorch calibration):
    the block rule on the full logits matrix.

    Source: NVIDIA/Model-Optimizer modelopt/torch/sparsity/attention_sparsity/methods/
    flash_skip_softmax.py (``calc_correction_factor_and_p``), commit a2fbac7b (the nvidia-modelopt
    0.47.0 wheel's file is identical). Future keys are finfo(dtype).min (Hugging Face's eager causal
    mask). Prefill (Nq > 1): logits padded to br x bc blocks with finfo.min; per row, block max
    minus the inclusive cumulative max over key blocks; a block is kept when any of its br rows has
    that difference > ln(lambda). So the first key block is always kept for lambda < 1, the diagonal
    block can be skipped, lambda >= 1 skips every block (diagonal included), and the padded rows of
    a partial last query block (all finfo.min: difference 0) keep every block of that block row for
    lambda < 1. Decode (Nq = 1): the row against bc-key blocks. lambda = factor / Nk (Model-Optimizer
    divides by the logits' key length). Counting: total = B * H * causal blocks
    (nbr * (2 nbc - nbr + 1) / 2, its formula; nbr * nbc without ``causal``), decode B * H * nbc;
    skipped = total - kept blocks (kept counted over every block).

    Returns kept [B, H, P, Kb] (prefill) or [B, H, 1, Kb] (decode)."""
    b, h, nq, nk = scores.shape
    value, _ = log_lambda(factor, lam, kv_len or nk)
    log_t = np.log(value)                  # numpy float64, as Model-Optimizer compares
    neg = torch.finfo(scores.dtype).min
    rows = 1 if nq == 1 else br
    x = causal_fill(scores, neg) if (causal and nq > 1) else scores
    nbr, nbc = -(-nq // rows), -(-nk // bc)
    x = F.pad(x, (0, nbc * bc - nk, 0, nbr * rows - nq), value=neg)
    bmax = x.reshape(b, h, nbr, rows, nbc, bc).amax(-1)      # [B, H, P, rows, Kb]
    diff = bmax - bmax.cummax(dim=-1)[0]
    kept = (diff > log_t).any(dim=-2)                        # [B, H, P, Kb]
    if nq == 1:
        total = b * h * nbc
    else:
        total = b * h * (nbr * (2 * nbc - nbr + 1) // 2 if causal else nbr * nbc)
    return Decision(kept, total - int(kept.sum()), total, f"{rows} x {bc} block per head")


def modelopt_triton(scores: torch.Tensor, factor: float | None = None, *, lam: float | None = None,
                    kv_len: int | None = None, block_m: int = 128, block_n: int = 32,
                    calibration: bool = False) -> Decision:
    """Model-Optimizer's Triton flash-attention kernel with skip-softmax (HF ``modelopt_triton``
    backend and the vLLM plugin), one head per program.

    Source: NVIDIA/Model-Optimizer modelopt/torch/kernels/common/attention/triton_fa.py (forward
    kernel; autotuned BLOCK_M in {16, 64, 128} with BLOCK_N = 32; measurement launches 128 x 128),
    modelopt/torch/kernels/sparsity/attention/skip_softmax_helpers.py (``_skip_softmax_decision``),
    calibrate.py (the calibration kernel, 128 x 128), commit a2fbac7b. Future keys are -inf. A key
    tile is skipped when every valid row has tile row max < running max + ln(lambda) (log2 units
    in the kernel), the running max being the max over tiles already kept (exclusive); padding rows
    of a partial query tile (and of decode's single row) never veto; the first tile (running max
    -inf) is never skipped. No cap at lambda >= 1: skipping is on whenever lambda > 0, and a tile
    less than ln(lambda) above the running max is skipped. ``calibration``: the calibration kernel,
    which skips nothing and keeps the running max over every tile. A query tile visits key tiles
    up to its causal bound. Counting: total = key tiles visited (the first included), skipped = those
    skipped (its MEASURE_SPARSITY and calibration counters).

    Returns kept [B, H, P, T] (False where skipped; True also for tiles beyond the causal bound)."""
    b, nk = scores.shape[0], scores.shape[-1]
    _, log_lam = log_lambda(factor, lam, kv_len or nk)
    tmax, valid, n_iter, (_, hg, p) = query_tiles(causal_fill(scores, NEG), 1, block_m, block_n)
    skip, visited = vote(tmax, valid, n_iter, log_lam, block_m, update="all" if calibration else "kept")
    skipped, total = counts(skip, visited)
    kept = ~skip[:, 0, :].reshape(b, hg, p, -1)
    return Decision(kept, skipped, total, f"{block_m} x {block_n} tile per head")


def modelopt_vllm_threshold(scale_factor: float, max_seq_len: int) -> float | None:
    """Model-Optimizer's vLLM plugin: one lambda per launch, scale_factor / the batch's max KV length
    (``attn_metadata.max_seq_len``, shared by the decode and prefill halves of a mixed batch);
    None (skipping off, vLLM's dense path) when that lambda is >= 1 or the length is not positive.

    Source: NVIDIA/Model-Optimizer modelopt/torch/sparsity/attention_sparsity/plugins/vllm.py
    (``_resolve_skip_softmax_calibration``), commit a2fbac7b. The kernel it launches is
    ``modelopt_triton``."""
    if max_seq_len <= 0:
        return None
    value = scale_factor / max_seq_len
    return None if value >= 1.0 else value


def trtllm_gen(scores: torch.Tensor, factor: float | None = None, *, lam: float | None = None,
               kv_len: int | None = None, group: int = 1, block_m: int = 128, block_n: int = 128,
               warp_rows: int = 16, kv_chunk_tiles: int | None = None) -> dict[str, Decision]:
    """TensorRT-LLM trtllm-gen FMHA (Blackwell; what FlashInfer's trtllm-gen path, and so SGLang's
    ``trtllm_mha`` and vLLM's FlashInfer TRT-LLM kernels, run).

    Source: generated trtllm-gen kernel sources, ``FmhaSm100fKernel_...SkipsSoftmaxQ64Kv128Static
    KeepsAbForGen`` and ``...Q32Kv128StaticSwapsAbForGen`` (their TmemS.h code: threadCanSkip,
    ``__all_sync`` per warp, ``atomicAnd`` of the warp votes into the tile's shared vote read by the
    K/V loader and the P.V MMA; repository and commit not identified by the code index used);
    threshold factor / mSeqLenKv, compared as exp2((tile max - running max) * scale_log2) < lambda.
    Future keys are -FLT_MAX (simulated as -inf: same decisions). Per warp of ``warp_rows`` rows
    (16 in the Q64 generation kernel read; the context (prefill) kernels were not read): a warp
    whose rows all vote skip zeroes its P and keeps its running max; V load and P.V are skipped only
    when every warp of the tile agrees. The running max starts at -FLT_MAX, so a row's first tile
    (of each KV chunk with ``kv_chunk_tiles``: multi-CTA KV mode, chunks of contiguous tiles, one
    running max per CTA) is never skipped. ``group`` = G query heads per tile (decode: the GQA
    group; rows token-major). No cap at lambda >= 1. Padding rows are assumed not to veto (not read).

    Returns {"warps": per-warp P zeroing, kept [B, Hg, P, W, T], counted over visited tiles of warps
    with a real row; "tiles": V-load / P.V skipping, kept [B, Hg, P, T], counted over visited
    tiles}."""
    b, nk = scores.shape[0], scores.shape[-1]
    _, log_lam = log_lambda(factor, lam, kv_len or nk)
    tmax, valid, n_iter, (_, hg, p) = query_tiles(causal_fill(scores, NEG), group, block_m, block_n)
    chunks = None if kv_chunk_tiles is None else torch.arange(tmax.shape[-1]) // kv_chunk_tiles
    skip, visited = vote(tmax, valid, n_iter, log_lam, warp_rows, chunks, update="kept")
    real = valid.reshape(valid.shape[0], -1, warp_rows).any(-1)          # [U, W] warps with a real row
    live = visited.unsqueeze(1) & real.unsqueeze(-1)
    warps = Decision(~skip.reshape(b, hg, p, *skip.shape[1:]), int((skip & live).sum()), int(live.sum()),
                     f"{warp_rows}-row warp x {block_n} keys")
    skipped, total = counts(skip, visited)
    tiles = Decision(~skip.all(1).reshape(b, hg, p, -1), skipped, total, f"{block_m} x {block_n} tile")
    return {"warps": warps, "tiles": tiles}


def split_kv_decode(scores: torch.Tensor, factor: float | None = None, *, chunks: int, lam: float | None = None,
                    kv_len: int | None = None, group: int = 1, block_n: int = 128, layout: str = "contiguous",
                    update: str = "kept") -> Decision:
    """Split-KV (multi-block) decode: the key tiles of a step are divided among ``chunks`` CTAs,
    each with its own running max (restarting at -inf) and its first tile never skipped; the GQA
    group's G heads vote together on each tile. ``layout`` "contiguous": CTA k takes a run of
    ceil(T / chunks) consecutive tiles (trtllm-gen multi-CTA KV mode: tile offset (numLoopSteps *
    ctaIdxKv + step) * 128 in its generated kernels); "interleaved": tile t goes to CTA t % chunks
    (TensorRT-LLM XQA multi-block: idxKTileInit + idxIter * nbSubSeq in cpp/kernels/xqa/mha_sm90.cu,
    idxTile % nbSubSeq in cpp/kernels/xqa/test/refAttention.cpp). FlashInfer's FA2/FA3 decode
    kernels do not skip (its trtllm-gen path does; its CuTe DSL decode was not read). ``update``:
    "kept" (trtllm-gen) or "all" (XQA's reference updates its skip max before deciding). Counting:
    total = tiles, skipped = tiles every head of the group skipped.

    ``scores`` [B, H, 1, Nk]. Returns kept [B, Hg, T]."""
    b, _, nq, nk = scores.shape
    if nq != 1:
        raise ValueError(f"split_kv_decode takes one query row, got {nq}")
    if layout not in ("contiguous", "interleaved"):
        raise ValueError(f"layout must be 'contiguous' or 'interleaved', got {layout!r}")
    _, log_lam = log_lambda(factor, lam, kv_len or nk)
    tmax, valid, n_iter, (_, hg, _) = query_tiles(scores, group, group, block_n)
    t = tmax.shape[-1]
    n = max(1, min(chunks, t))
    tiles = torch.arange(t)
    chunk_of = tiles // -(-t // n) if layout == "contiguous" else tiles % n
    skip, visited = vote(tmax, valid, n_iter, log_lam, group, chunk_of, update=update)
    skipped, total = counts(skip, visited)
    return Decision(~skip[:, 0, :].reshape(b, hg, t), skipped, total, f"{group} heads x {block_n} keys")


def xqa_decode(scores: torch.Tensor, factor: float, *, group: int, tile: int = 64, sub_seqs: int = 1,
               kv_len: int | None = None) -> Decision:
    """TensorRT-LLM XQA (Hopper decode) skip-softmax, after its reference ``refFlashAttention``.

    Source: NVIDIA/TensorRT-LLM cpp/kernels/xqa/test/refAttention.cpp (the skip-softmax version
    read through the code index, which did not show its commit; the stored version 20298e28
    predates skip-softmax) and cpp/kernels/xqa/mha_sm90.cu @ 014dadcd (gemm0CtaTileNbTokens = 64
    whatever the head dim; sub-sequence k takes tiles k, k + nbSubSeq, ...). The GQA group's
    ``group`` heads share a tile of ``tile`` tokens and skip it only when every head has tile max -
    skip max < ln(factor / kv_len), the skip max (per sub-sequence, from -inf, updated with every
    tile before the decision) excluding the tile; each sub-sequence's first tile is kept
    (idxTile - idxTileBeg >= nbSubSeq); nbSubSeq = min(T, ``sub_seqs``) when T >= 2, else 1.
    kv_len < factor (lambda > 1) turns skipping off for the sequence and nothing is counted;
    lambda = 1 exactly stays on. Counting (its SKIP_SOFTMAX_ATTN_BLOCK_STATS): total = tiles,
    skipped = tiles skipped.

    ``scores`` [B, H, 1, Nk]. Returns kept [B, Hg, T]."""
    nk = scores.shape[-1]
    length = kv_len or nk
    t = -(-nk // tile)
    if length < factor:
        return Decision(torch.ones(scores.shape[0], scores.shape[1] // group, t, dtype=torch.bool), 0, 0,
                        f"{group} heads x {tile} tokens")
    n = min(t, sub_seqs) if (sub_seqs > 0 and t >= 2) else 1
    return split_kv_decode(scores, factor, chunks=n, kv_len=length, group=group, block_n=tile,
                           layout="interleaved", update="all")


def hopper_kv_step(dtype: str, head_dim: int) -> int:
    """Key tile (STEP_KV) of the Hopper warp-specialized fmha_v2 kernels: BF16/FP16 256 keys up to
    head_dim 64, 128 up to 128, 64 above; FP8 (e4m3) 256 up to head_dim 128 and 128 above (head_dim
    padded to 256). Source: flashinfer-ai/flashinfer flashinfer/jit/attention/fmha_v2/
    fmha_library.py (``generate_kernel_spec``, kv_loop_step), commit fb28d724 (FlashInfer's port of
    TensorRT-LLM's fmha_v2 setup.py)."""
    if dtype in ("bf16", "fp16"):
        return 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64
    if dtype == "e4m3":
        return 256 if head_dim <= 128 else 128
    raise ValueError(f"dtype must be 'bf16', 'fp16' or 'e4m3', got {dtype!r}")


def hopper_prefill(scores: torch.Tensor, factor: float | None = None, *, head_dim: int, dtype: str = "bf16",
                   lam: float | None = None, kv_len: int | None = None) -> Decision:
    """TensorRT-LLM fmha_v2 warp-specialized prefill (Hopper) skip-softmax.

    Source: flashinfer-ai/flashinfer csrc/fmha_v2/fmha/warpspec/epilogue.h
    (``compute_and_update_scale``: per-row expf(local max - running max) < threshold, ``__all_sync``
    per warp, ``atomicAnd`` across the warpgroup's 4 warps, skip when all agree; never at
    IS_FIRST_COL; the running max is not updated on a skip), compute.h (threshold =
    skip_softmax_threshold_scale_factor / actual_kv_seqlen; V is still waited for on a skip),
    commit fb28d724 (FlashInfer's copy of TensorRT-LLM cpp/kernels/fmha_v2). Scores are compared
    after the softmax scale (unpack multiplies by scale_bmm1, or the exp2f path scales the
    difference). Future keys -FLT_MAX (simulated as -inf). Decision unit: one warpgroup's 64 query
    rows x ``hopper_kv_step(dtype, head_dim)`` keys. Skipping is on when the factor is > 0; no cap
    at lambda >= 1. Counting (SKIP_SOFTMAX_STAT): total = tiles visited, skipped = tiles skipped.

    Returns kept [B, H, P, T]."""
    b, nk = scores.shape[0], scores.shape[-1]
    _, log_lam = log_lambda(factor, lam, kv_len or nk)
    step = hopper_kv_step(dtype, head_dim)
    tmax, valid, n_iter, (_, hg, p) = query_tiles(causal_fill(scores, NEG), 1, 64, step)
    skip, visited = vote(tmax, valid, n_iter, log_lam, 64, update="kept")
    skipped, total = counts(skip, visited)
    return Decision(~skip[:, 0, :].reshape(b, hg, p, -1), skipped, total, f"64 x {step} tile per head")


def fp8_hopper_prefill(scores: torch.Tensor, factor: float | None = None, *, head_dim: int,
                       lam: float | None = None, kv_len: int | None = None) -> Decision:
    """``hopper_prefill`` with the FP8 (e4m3) kernels: 64 rows x 256 keys up to head_dim 128."""
    return hopper_prefill(scores, factor, head_dim=head_dim, dtype="e4m3", lam=lam, kv_len=kv_len)


__all__ = [
    "Decision",
    "fp8_hopper_prefill",
    "hopper_kv_step",
    "hopper_prefill",
    "modelopt_hf",
    "modelopt_triton",
    "modelopt_vllm_threshold",
    "split_kv_decode",
    "trtllm_gen",
    "xqa_decode",
]
