"""The Triton capture of one attention layer: the path that fits the configured scan orders.

One order: ``single_order`` (one single-pass forward that also yields that order's statistics,
plus the mass pass). Two or three orders: the two-pass ``instrumented`` capture, which computes
all three at once. Both return what ``reduce_reference.reduce_tiles`` makes of the reference's
TileStats (same keys, shapes, dtypes). ``softcap`` (Gemma 2's c * tanh(s / c) on every scaled
score) reaches every kernel of both paths.

Shape legend
    H query heads   Hkv KV heads   N length   D head dim
"""
from __future__ import annotations

from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.instrumented import instrumented_capture_triton
from sparsecal.kernels.capture.single_order import single_order_capture_triton


def capture_triton(q, k, v, scale: float, cfg: StatsConfig, scratch_bytes: int | None = None,
                   launch: dict | None = None, single_pass: bool | None = None, *, softcap: float = 0.0,
                   mark=None):
    """(out [1, H, N, D] in q.dtype, the per-sample reductions of one call) from q [1, H, N, D],
    k/v [1, Hkv, N, D]. ``single_pass`` (default: exactly one order in cfg.orders) picks the
    single-order path; ``launch`` overrides (num_warps, num_stages) per kernel; ``softcap`` is the
    cap c of c * tanh(s / c) on every scaled score (0 or None: off), as in
    reference.instrumented_attention. ``mark()``, when given, is called once the attention kernels
    are launched and before the reductions (capture --profile stamps the boundary there)."""
    if single_pass is None:
        single_pass = len(cfg.orders) == 1
    if single_pass:
        return single_order_capture_triton(q, k, v, scale, cfg, launch, softcap=softcap, mark=mark)
    return instrumented_capture_triton(q, k, v, scale, cfg, scratch_bytes, launch, softcap=softcap, mark=mark)
