"""Attention kernels (torch and triton only): plain-torch references and, later, Triton kernels."""
