"""Sparse kernels: BSFA, BLASST and sliding-window attention with in-kernel skip counts.

    reference.py   plain-torch sparse prefill and decode: the semantics and the CPU backend
    prefill.py     Triton sparse prefill (BSFA, BLASST in three scan orders, window, count_only)
    decode.py      Triton split-K sparse decode (gather and inline schedules)
    decode_group.py  Triton group decode: one pass per KV group, head/group decision, ragged and paged
"""
