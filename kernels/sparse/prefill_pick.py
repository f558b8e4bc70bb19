"""Which sparse prefill kernel runs a call: ``sparse_prefill``, the one sparsify, the break-even
bench and the model benchmarks call.

The Gluon Hopper kernels measured fastest per head dim, method and sparsity (data/bench/NOTES.md,
"prefill-gluon-ws" and "prefill-pair"; one H100 run per head dim, bf16, causal, 16K-64K, G 1/4/8):

    D = 64   prefill_gluon_ws (warp-specialized, TMA producer warp, each decision at one barrier
             with an OR) for every call: 5-8% ahead of the paired kernel (``gluon_pair_two``) with
             nothing skipped, 7-16% ahead for BLASST, level for BSFA at 50% and 75% (0.991-1.028 in
             the 18 cells of s47's 5-round runs, 16K-64K, G 1/4/8), where the paired kernel had been
             picked from s44 to s46 (PAIR_FROM); NOTES.md "the prefill targets, s47".
    D = 128  prefill_gluon_ws with skipping off (1.03-1.06x; since s49 with its copies issued under the
             wgmma, ``prefill_gluon_ws.late_for``: 6-15 % faster again, 16K-64K) and where the call is expected to skip
             at least WS_FROM = 0.25 of its tiles (ahead by 0-6% at 50% in 17 of 18 cells, 4-10% at
             75%); prefill_gluon (one partition) otherwise, which is ahead by 0-9% when nothing is
             skipped, and for the window baseline (not timed against the other)

WS_FROM lies between measured points (0 and 0.5): interpolated, not measured. The one-partition kernel
decides by warp votes (``prefill_gluon._warp_any``, NOTES.md "the decision by warp votes", s46), the ws
kernel at a barrier with an OR (``prefill_gluon._bar_any``; D = 64 since s47, D = 128 since s50).

The expected sparsity is a hint: sparsify passes the layer's calibrated sparsity at the length
bucket from the export's dispatch record (None without one), the break-even bench its operating
point. Everything else (no Hopper GPU, other head dims, fp32, softcap, BM != 128, BN not 64/128,
BLASST in another scan order, the CPU) runs ``prefill.sparse_attention_triton``, the CPU-testable
twin. Same arguments and results for all: q [B, H, N, D], k/v [B, Hkv, N, D] -> (out [B, H, N, D],
skipped [B, H] int64).
"""
from __future__ import annotations

from sparsecal.kernels.sparse.prefill import method_code, sparse_attention_triton
from sparsecal.kernels.sparse.prefill_gluon import gluon_supported, sparse_attention_gluon
from sparsecal.kernels.sparse.prefill_gluon_ws import sparse_attention_gluon_ws

DENSE, WINDOW = 0, 3  # prefill.method_code
WS_FROM = 0.25  # at D = 128: the expected sparsity from which the warp-specialized kernel is faster
GLUON_KERNELS = {"gluon": sparse_attention_gluon, "gluon_ws": sparse_attention_gluon_ws}


def pick(head_dim: int, method: int, expected_sparsity: float | None = None) -> str:
    """The kernel for a call the Gluon kernels support: "gluon", "gluon_ws", or "triton" (a head dim
    they were not measured at); ``method`` as ``prefill.method_code``."""
    if head_dim == 64:
        return "gluon_ws"
    if head_dim != 128:
        return "triton"
    if method == DENSE or (method != WINDOW and expected_sparsity is not None and expected_sparsity >= WS_FROM):
        return "gluon_ws"
    return "gluon"


def sparse_prefill(q, k, v, scale: float, block_m: int, block_n: int, *, thresholds=None,
                   log_lambda: float | None = None, window: int | None = None, order: str = "forward",
                   dense: bool = False, out=None, softcap: float = 0.0, expected_sparsity: float | None = None,
                   sink: bool = False):
    """The fastest sparse prefill kernel for this call (module docstring), with
    ``sparse_attention_triton``'s arguments and results; ``expected_sparsity``: the share of
    candidate tiles the call is expected to skip (a hint, None when unknown); ``sink`` (window: key
    block 0 kept) runs the Triton kernel."""
    method = method_code(thresholds, log_lambda, window, dense, sink)
    kw = {"thresholds": thresholds, "log_lambda": log_lambda, "window": window, "order": order, "dense": dense,
          "out": out}
    name = pick(q.shape[-1], method, expected_sparsity)
    if name != "triton" and not sink and gluon_supported(q, block_m, block_n, method, order, softcap):
        return GLUON_KERNELS[name](q, k, v, scale, block_m, block_n, **kw)
    return sparse_attention_triton(q, k, v, scale, block_m, block_n, softcap=softcap, sink=sink, **kw)
