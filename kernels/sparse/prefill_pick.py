"""Which sparse prefill kernel runs a call: ``sparse_prefill``, the one sparsify, the break-even
bench and the model benchmarks call.

Per head dim, the Gluon Hopper kernel measured fastest there (data/bench/NOTES.md, "prefill-gluon"
and "prefill-gluon-ws"; one H100 run each, bf16, causal, 16K-32K, G 1/4):

    D = 128  prefill_gluon (one partition): with nothing skipped 0.95-1.07 of dense, where the
             warp-specialized kernel reached 0.92-0.98; equal within 0.02 at 50%; the
             warp-specialized kernel is ahead by 0.01-0.10 of the ideal only at 75%
    D = 64   prefill_gluon_ws (warp-specialized, TMA producer warp): ahead of the Triton kernel at
             every sparsity (nothing skipped 0.85-0.90 of dense vs 0.75-0.81; 50% 0.83-0.88 of the
             ideal vs 0.78-0.84; 75% 0.82-0.87 vs 0.78-0.87)

Everything else (no Hopper GPU, other head dims, fp32, softcap, BM != 128, BN not 64/128, BLASST
in another scan order, the CPU) runs ``prefill.sparse_attention_triton``, the CPU-testable twin.
Same arguments and results for all: q [B, H, N, D], k/v [B, Hkv, N, D] -> (out [B, H, N, D],
skipped [B, H] int64).
"""
from __future__ import annotations

from sparsecal.kernels.sparse.prefill import method_code, sparse_attention_triton
from sparsecal.kernels.sparse.prefill_gluon import gluon_supported, sparse_attention_gluon
from sparsecal.kernels.sparse.prefill_gluon_ws import sparse_attention_gluon_ws

GLUON_KERNELS = {128: sparse_attention_gluon, 64: sparse_attention_gluon_ws}


def sparse_prefill(q, k, v, scale: float, block_m: int, block_n: int, *, thresholds=None,
                   log_lambda: float | None = None, window: int | None = None, order: str = "forward",
                   dense: bool = False, out=None, softcap: float = 0.0):
    """The fastest sparse prefill kernel for this call (module docstring), with
    ``sparse_attention_triton``'s arguments and results."""
    method = method_code(thresholds, log_lambda, window, dense)
    kw = dict(thresholds=thresholds, log_lambda=log_lambda, window=window, order=order, dense=dense, out=out)
    kernel = GLUON_KERNELS.get(q.shape[-1])
    if kernel is not None and gluon_supported(q, block_m, block_n, method, order, softcap):
        return kernel(q, k, v, scale, block_m, block_n, **kw)
    return sparse_attention_triton(q, k, v, scale, block_m, block_n, softcap=softcap, **kw)
