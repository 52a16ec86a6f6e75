"""Rowwise-scaled FP8 GEMM: one scale per row of A (a token) and per column of B (an output channel).

torch._scaled_mm's rowwise form on CUDA (sm89+): ``scale_a`` fp32 [M, 1], ``scale_b`` fp32 [1, N], the
product accumulated in fp32 and each output element scaled by its row's and column's scales in the
epilogue; cuBLAS takes it with a bf16 output only, so other output dtypes are cast from bf16. Where
there is no native FP8 GEMM (CPU) the same arithmetic runs as torch ops: the fp32 product of the FP8
values, then the two scales.
"""

from __future__ import annotations

import torch

from .per_tensor import CUDA_ALIGN, uses_native_fp8_gemm

__all__ = ["fp8_gemm_rowwise", "fp8_gemm_rowwise_reference"]


def fp8_gemm_rowwise_reference(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                               b_scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(a @ b) * a_scale_inv * b_scale_inv in fp32, then ``out_dtype``. a: fp8 [M, K]; b: fp8 [K, N];
    a_scale_inv: fp32 [M, 1]; b_scale_inv: fp32 [1, N]."""
    return ((a.to(torch.float32) @ b.to(torch.float32)) * a_scale_inv * b_scale_inv).to(out_dtype)


def fp8_gemm_rowwise(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``fp8_gemm_rowwise_reference``'s product: a row-major [M, K], b column-major [K, N] (the
    transpose of a row-major [N, K]), as torch._scaled_mm needs them."""
    if a.device.type != "cuda" or not uses_native_fp8_gemm(a.device) or a.shape[1] % CUDA_ALIGN:
        return fp8_gemm_rowwise_reference(a, b, a_scale_inv, b_scale_inv, out_dtype)
    y = torch._scaled_mm(a, b, scale_a=a_scale_inv.contiguous(), scale_b=b_scale_inv.contiguous(),
                         out_dtype=torch.bfloat16)
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)
