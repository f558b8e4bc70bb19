"""Attention kernels (torch, triton and sparsecal.formats only), in two families.

    jit.py       shared Triton jit helpers and host helpers (jit.soft_cap: the kernels' logit cap)
    softcap.py   attention logit soft-capping (Gemma 2) on the torch side: the ``softcap`` keyword
    dense.py     the dense causal flash forward (the project's baseline); dense_reference.py
    capture/     instrumented attention: output + tile statistics (reference and Triton paths)
    sparse/      BSFA / BLASST / window sparse prefill and decode (reference and Triton)

Each Triton kernel has a plain-torch reference beside it that defines its semantics; tests
compare them under TRITON_INTERPRET=1 on the CPU. Every entry point that computes scores takes
``softcap`` (0 or None: off; c > 0: every scaled score s becomes c * tanh(s / c) before any max,
softmax, statistic or skip decision).
"""
