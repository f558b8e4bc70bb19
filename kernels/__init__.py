"""Attention kernels (torch, triton and sparsecal.formats only), in two families.

    jit.py       shared Triton jit helpers and host helpers
    dense.py     the dense causal flash forward (the project's baseline); dense_reference.py
    capture/     instrumented attention: output + tile statistics (reference and Triton paths)
    sparse/      BSFA / BLASST / window sparse prefill and decode (reference and Triton)

Each Triton kernel has a plain-torch reference beside it that defines its semantics; tests
compare them under TRITON_INTERPRET=1 on the CPU.
"""
