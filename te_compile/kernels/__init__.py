"""Triton kernels, each beside its launcher and a plain-torch reference of the same signature.

The public function of each module dispatches: the Triton kernel for CUDA tensors (when triton is
installed), the reference everywhere else (CPU, and inside CPU-compiled graphs). Tests run the kernels
on CPU in Triton's interpreter (tests/conftest.py) and compare them with the references bit for bit.
"""
