"""Capture kernels: attention output plus the tile statistics, each Triton path with its reference.

    reference.py         plain-torch instrumented attention: the semantics and the CPU backend
    reduce_reference.py  tiles -> the additive per-sample reductions (plain torch)
    pipeline.py          ``capture_triton``: the Triton path for the configured scan orders
    instrumented.py      two-pass capture of all three orders (pass 1 forward + scratch)
    tilestats.py         pass 2 and decode-row statistics kernels, histogram layout
    forward_stats.py     single-pass forward with one order's statistics
    mass.py              block softmax mass from the final log-sum-exp
    single_order.py      the one-order capture (forward_stats + mass + decode rows + reduce)
    decode_rows.py       the last R rows as decode queries
    reduce.py            the device reductions (BSFA kept/skipped, histograms)
    common.py            pieces shared by these paths
"""
