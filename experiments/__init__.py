"""Triton kernels that te_compile does not call yet: each waits on a GPU measurement (README.md here)."""
