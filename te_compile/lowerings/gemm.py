"""GEMMs on quantized operands: per-tensor FP8 through torch._scaled_mm where the device has it (exact
emulation elsewhere), and the dequantize-then-matmul emulation for the block-scaled formats."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..hardware import is_fp8_available

__all__ = ["fp8_gemm", "uses_native_fp8_gemm", "dequantized_gemm"]

# cuBLASLt FP8 GEMMs need the contraction dim and the output columns in multiples of 16.
_CUDA_ALIGN = 16


def uses_native_fp8_gemm(device: torch.device) -> bool:
    """True where torch._scaled_mm runs per-tensor FP8 (CPU, CUDA sm89+)."""
    return bool(is_fp8_available(device=device))


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous [R, C]) with the strides (C, 1) literally.

    torch calls a tensor with a size-1 dim contiguous whatever that dim's stride, so ``.contiguous()``
    keeps e.g. stride (1, 16) for a [16, 1] transpose of one token's gradient; inductor's _scaled_mm
    lowering checks ``stride[-1] == 1`` as written and refuses it. A view with the canonical strides
    reads the same elements.
    """
    if any(statically_known_true(d == 1) for d in t.shape):
        return t.as_strided(t.shape, (t.shape[1], 1))
    return t


def fp8_gemm(
    a: torch.Tensor,          # fp8 [M, K], row-major
    b: torch.Tensor,          # fp8 [K, N], column-major (the transpose of a row-major [N, K])
    a_scale_inv: torch.Tensor,  # fp32 [1]
    b_scale_inv: torch.Tensor,  # fp32 [1]
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(a * a_scale_inv) @ (b * b_scale_inv) with fp32 accumulation, as ``out_dtype`` [M, N].

    Inductor's _scaled_mm lowering needs exactly these layouts (a row-major, b column-major), on CPU
    too, so callers must produce them; eager would accept any layout and hide the mistake.
    """
    a, b = _row_major(a), _row_major(b.t()).t()
    sa = a_scale_inv.reshape(())
    sb = b_scale_inv.reshape(())
    if not uses_native_fp8_gemm(a.device):
        # Exact dequantize-then-matmul: equal to CPU _scaled_mm bit for bit.
        return ((a.to(torch.float32) @ b.to(torch.float32)) * (sa * sb)).to(out_dtype)
    if a.device.type == "cuda":
        # Zero rows/columns along K change nothing; pad K (e.g. the token count in wgrad) to 16.
        k = a.shape[1]
        pad = (-k) % _CUDA_ALIGN
        if pad:
            a = F.pad(a.view(torch.uint8), (0, pad)).view(a.dtype)
            b = F.pad(b.t().view(torch.uint8), (0, pad)).view(b.dtype).t()
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def dequantized_gemm(a, b, *, transpose_a: bool = False, transpose_b: bool = False,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """op(a) @ op(b) of two quantized tensors (any format) by dequantizing both to fp32.

    a, b: QuantizedTensorStorage (2-D); op transposes when asked. This is the emulation used where
    a format has no native GEMM wired in: exact dequantization, one fp32 matmul, one final cast.
    """
    a32 = a.dequantize(dtype=torch.float32)
    b32 = b.dequantize(dtype=torch.float32)
    return ((a32.t() if transpose_a else a32) @ (b32.t() if transpose_b else b32)).to(out_dtype)
