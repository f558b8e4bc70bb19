"""Single-order Triton capture: one scan order's statistics in two passes over the key blocks.

pass 1  forward_stats._fwd_stats_kernel: output, log-sum-exp, bmax, the order's gap, t*
        (step, where), running-max rescales and shortfalls, the q-init error and VFA's joint
        statistic (q-init against the sink + diagonal max), all in registers during the flash
        forward;
pass 2  mass._mass_kernel: the block mass from the final log-sum-exp (QK^T only);
decode  decode_rows.decode_forward: the last rows' gaps and their histograms, and their row block
        maxima, reduced by reduce_reference.decode_bsfa_reduce (torch.topk) and, over each KV
        group's max gap, reduce_reference.group_gap_hist;
reduce  reduce._capture_reduce_kernel: BSFA kept/skipped, the order's gap histograms (candidate
        and diagonal tiles) and the row histograms (t* where, normalized t*, q-init, joint,
        rescales, shortfalls), after reduce.bsfa_thresholds' torch.topk.

No host sync and no per-row scratch. ``single_order_capture_triton`` returns what
kernels/capture/reduce_reference.py's ``reduce_tiles`` makes of the reference's TileStats for a StatsConfig with one
order (same keys, shapes, dtypes), like instrumented.instrumented_capture_triton, which
calls it when the config has exactly one order (the two-pass path computes all three orders at
once and stays the choice for two or three).
"""
from __future__ import annotations

import torch

from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.common import edge_args, hist_keys, pick, tile_offsets
from sparsecal.kernels.capture.decode_rows import decode_forward
from sparsecal.kernels.capture.forward_stats import instrumented_forward_triton
from sparsecal.kernels.capture.mass import block_mass_triton
from sparsecal.kernels.capture.reduce import capture_reduce
from sparsecal.kernels.capture.reduce_reference import decode_bsfa_reduce, group_gap_hist
from sparsecal.kernels.capture.tilestats import HistLayout


def single_order_capture_triton(q, k, v, scale: float, cfg: StatsConfig, launch: dict | None = None, *,
                                softcap: float = 0.0, mark=None):
    """(out [1, H, N, D] in q.dtype, the per-sample reductions of one call) for cfg.orders of
    length one. q [1, H, N, D], k/v [1, Hkv, N, D]. ``launch`` may hold (num_warps, num_stages)
    under "forward_stats", "mass" and "decode". softcap: the cap c of c * tanh(s / c) on every
    scaled score (0 or None: off). ``mark()`` (optional) is called between the passes and the reductions."""
    if len(cfg.orders) != 1:
        raise ValueError(f"the single-order capture takes one scan order, got {list(cfg.orders)}")
    order = cfg.orders[0]
    launch = launch or {}
    out, *fwd = instrumented_forward_triton(q, k, v, scale, cfg, order, launch.get("forward_stats"), softcap=softcap)
    mass = block_mass_triton(q, k, fwd[0], scale, cfg, launch.get("mass"), softcap=softcap)
    if mark is not None:
        mark()
    return out, single_order_reductions(q, k, tuple(fwd), mass, scale, cfg, launch,
                                        softcap=softcap)


def single_order_reductions(q, k, fwd: tuple, mass: torch.Tensor, scale: float, cfg: StatsConfig,
                            launch: dict | None = None, *, softcap: float = 0.0) -> dict:
    """Decode rows and the device reductions after the two passes. fwd = (lse, bmax, gap, tstep,
    twhere, qerr, resc, short, jerr) of instrumented_forward_triton for cfg.orders[0] (with the
    same softcap); mass [H, P, Kb]."""
    lse, bmax, gap, tstep, twhere, qerr, resc, short, jerr = fwd
    dev, h, n = q.device, q.shape[1], q.shape[2]
    cand = tile_offsets(n, cfg.block_m, cfg.block_n, dev)[2]
    part = torch.zeros((h, HistLayout.of(cfg).offsets["width"]), dtype=torch.float32, device=dev)
    red = capture_reduce(bmax, mass, cand, cfg, edge_args(cfg, dev), cfg.orders[0], gap, tstep, twhere, qerr, part,
                         resc, short, jerr)
    decode = decode_forward(q, k, lse, scale, cfg, launch, fused=True, softcap=softcap)
    red.update(decode_bsfa_reduce(decode[4], decode[2], n, cfg))
    red.update(hist_keys(part, decode[3], cfg))
    red.update(group_gap_hist(pick(decode[1], cfg), decode[2], decode[0], h // k.shape[1], edge_args(cfg, dev)[0],
                              cfg.block_n))
    if cfg.raw:
        red["raw_bmax"] = bmax.half()
        red["raw_gap"] = gap.unsqueeze(1).half()
        red["raw_mass"] = mass.half()
    return red
