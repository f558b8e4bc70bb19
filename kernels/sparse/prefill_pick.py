"""Which sparse prefill kernel runs a call: ``sparse_prefill``, the one sparsify, the break-even
bench and the model benchmarks call.

The Gluon Hopper kernels measured fastest per head dim, method and sparsity (data/bench/NOTES.md,
"prefill-gluon-ws" and "prefill-pair"; one H100 run per head dim, bf16, causal, 16K-64K, G 1/4/8):

    D = 64   prefill_gluon_pair (two query blocks a program) deciding two tiles in one exchange
             (``gluon_pair_two``) for BSFA where the call is expected to skip at least PAIR_FROM =
             0.25 of its tiles and the key tile is 64 rows: 0.89-0.91 of the ideal at 50% and
             0.92-0.93 at 75% (s46, 16K-64K, G 1 and 8, 3 rounds) against 0.87-0.88 and 0.85-0.86 for
             the warp-specialized kernel, which is 3% faster with nothing skipped. prefill_gluon_ws
             (warp-specialized, TMA producer warp) for everything else, BLASST at every length
             included: with the decision by warp votes (s46) it is 0-4% ahead of the paired kernel at
             BLASST 75% at 32K-64K, where the shuffle-tree forms put the paired kernel 3-5% ahead
             (s44, s45), and 5-10% ahead below.
    D = 128  prefill_gluon_ws with skipping off (1.03-1.06x) and where the call is expected to skip
             at least WS_FROM = 0.25 of its tiles (ahead by 0-6% at 50% in 17 of 18 cells, 4-10% at
             75%); prefill_gluon (one partition) otherwise, which is ahead by 0-9% when nothing is
             skipped, and for the window baseline (not timed against the other)

PAIR_FROM and WS_FROM lie between measured points (0 and 0.5): interpolated, not measured. Every
Gluon kernel decides by warp votes (``prefill_gluon._warp_any``, NOTES.md "the decision by warp
votes", s46).

The expected sparsity is a hint: sparsify passes the layer's calibrated sparsity at the length
bucket from the export's dispatch record (None without one), the break-even bench its operating
point. Everything else (no Hopper GPU, other head dims, fp32, softcap, BM != 128, BN not 64/128,
BLASST in another scan order, the CPU) runs ``prefill.sparse_attention_triton``, the CPU-testable
twin. Same arguments and results for all: q [B, H, N, D], k/v [B, Hkv, N, D] -> (out [B, H, N, D],
skipped [B, H] int64).
"""
from __future__ import annotations

import functools

from sparsecal.kernels.sparse.prefill import method_code, sparse_attention_triton
from sparsecal.kernels.sparse.prefill_gluon import gluon_supported, sparse_attention_gluon
from sparsecal.kernels.sparse.prefill_gluon_pair import BLOCK_N as PAIR_BLOCK_N
from sparsecal.kernels.sparse.prefill_gluon_pair import sparse_attention_gluon_pair
from sparsecal.kernels.sparse.prefill_gluon_ws import sparse_attention_gluon_ws

DENSE, BSFA, WINDOW = 0, 1, 3  # prefill.method_code
WS_FROM = 0.25  # at D = 128: the expected sparsity from which the warp-specialized kernel is faster
PAIR_FROM = 0.25  # at D = 64, BSFA: the expected sparsity from which the paired kernel is faster
GLUON_KERNELS = {"gluon": sparse_attention_gluon, "gluon_ws": sparse_attention_gluon_ws,
                 "gluon_pair_two": functools.partial(sparse_attention_gluon_pair, two=True)}


def pick(head_dim: int, method: int, expected_sparsity: float | None = None, block_n: int = PAIR_BLOCK_N) -> str:
    """The kernel for a call the Gluon kernels support: "gluon", "gluon_ws", "gluon_pair_two", or
    "triton" (a head dim they were not measured at); ``method`` as ``prefill.method_code``."""
    if head_dim == 64:
        skipping = expected_sparsity is not None and expected_sparsity >= PAIR_FROM
        return "gluon_pair_two" if method == BSFA and block_n == PAIR_BLOCK_N and skipping else "gluon_ws"
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
    name = pick(q.shape[-1], method, expected_sparsity, block_n)
    if name != "triton" and not sink and gluon_supported(q, block_m, block_n, method, order, softcap):
        return GLUON_KERNELS[name](q, k, v, scale, block_m, block_n, **kw)
    return sparse_attention_triton(q, k, v, scale, block_m, block_n, softcap=softcap, sink=sink, **kw)
