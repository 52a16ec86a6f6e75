"""Linear layers on quantizer objects: the block-scaled recipes (MXFP8, Float8 block, NVFP4) and
CustomRecipe. x2d: [M, K], w_nk: [N, K].

Every GEMM gets each operand in the copy whose blocks run along that GEMM's contraction dim:
- fprop  y  = x @ w.T  : x rowwise (blocks along K), w rowwise (along K)
- dgrad  dx = g @ w    : g rowwise (along N),        w columnwise (along N)
- wgrad  dw = g.T @ x  : g columnwise (along M),     x columnwise (along M)
The forward quantizes the columnwise copies of x and w and saves only those (the quantized bytes,
not the high-precision tensors). Columnwise operands get their token dim M padded with zero rows to
a multiple of 16 (NVFP4's block): zero rows change no block amax and add nothing to dw.

GEMMs: with ``native`` (the backend sets it where gemm/block_probe.py found the device runs the format
natively) each GEMM goes to F.scaled_mm through gemm.block.native_block_gemm; otherwise, and for the
pairs scaled_mm lacks (E5M2 operands, two 128x128-tiled Float8 operands), both operands are
dequantized to fp32 and multiplied (gemm.block.dequantized_gemm), which the report calls "emulated".
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ...distributed import NO_GROUPS
from ...gemm.block import dequantized_gemm, native_block_gemm, native_pair_supported
from ...quantization import quantize_copies
from ...recipe import GEMM_ROLES
from ...tensor.quantized_tensor import QuantizedTensor, Quantizer, prepare_for_saving, restore_from_saved

__all__ = ["QuantizedLinearFunction", "COLUMNWISE_ROW_MULTIPLE"]

# NVFP4's columnwise blocks run along M in groups of 16; the other formats accept any M.
COLUMNWISE_ROW_MULTIPLE = 16


def _quantize(factory: Callable[[str], Quantizer], role: str, t: torch.Tensor, *, rowwise: bool = True,
              columnwise: bool = False, groups=NO_GROUPS):
    """``quantize_copies`` with the groups of ``role`` among the per-role ``groups`` (GEMM_ROLES)."""
    return quantize_copies(factory, role, t, rowwise=rowwise, columnwise=columnwise,
                           amax_groups=groups[GEMM_ROLES.index(role)])


def _weight_operand(factory: Callable[[str], Quantizer], w_nk: torch.Tensor, *, columnwise: bool, groups):
    """The weight's quantized copies for this call, as a storage object.

    A weight that already is a tensor of the weight quantizer's format (an FP8 primary weight,
    te_compile/primary_weights.py) is used as it is: a new storage over its buffers (so that dropping
    a copy for saving leaves the parameter whole), the columnwise copy derived where the format
    allows. Anything else is quantized here; another quantized format is dequantized first.
    """
    quantizer = factory("weight")
    if isinstance(w_nk, QuantizedTensor) and getattr(quantizer, "matches", lambda t: False)(w_nk):
        storage = quantizer._storage_cls(shape=w_nk.shape, dtype=w_nk.dtype, **w_nk._fields())
        storage.update_usage(rowwise_usage=True, columnwise_usage=columnwise or None)
        return storage
    if isinstance(w_nk, QuantizedTensor):
        w_nk = w_nk.dequantize()
    return _quantize(factory, "weight", w_nk, columnwise=columnwise, groups=groups)


def _gemm(native: bool, a, b, *, transpose_a: bool = False, transpose_b: bool = False,
          out_dtype: torch.dtype) -> torch.Tensor:
    """op(a) @ op(b): natively where allowed, else the exact emulation."""
    if native and native_pair_supported(a, b):
        return native_block_gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)
    return dequantized_gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = (-t.shape[0]) % COLUMNWISE_ROW_MULTIPLE
    return F.pad(t, (0, 0, 0, pad)) if pad else t


class QuantizedLinearFunction(torch.autograd.Function):
    """y = x2d @ w_nk.T with every GEMM operand quantized by ``factory(role)``; ``native``: run the
    GEMMs through F.scaled_mm (only where gemm/block_probe.py says the device can); ``groups``: per role,
    where the tensor-level amax is all-reduced on shards (sharded.py)."""

    @staticmethod
    def forward(ctx, x2d, w_nk, factory, native=False, groups=NO_GROUPS):
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        qx = _quantize(factory, "input", x2d, groups=groups)
        # Both weight copies in one call: formats with 2-D weight tiles (Float8 block 128x128, NVFP4
        # 16x16) then transpose the rowwise copy instead of quantizing w twice.
        qw = _weight_operand(factory, w_nk, columnwise=needs_dx, groups=groups)
        x_quantizer = factory("input")
        if hasattr(x_quantizer, "qgemm"):  # a custom recipe may bring its own GEMM
            y = x_quantizer.qgemm(qx, qw, out_dtype=x2d.dtype)
        else:
            y = _gemm(native, qx, qw, transpose_b=True, out_dtype=x2d.dtype)
        # Backward operands: x along M for wgrad, w along N for dgrad; None when not needed.
        qx_col = (_quantize(factory, "input", _pad_rows(x2d), rowwise=False, columnwise=True, groups=groups)
                  if needs_dw else None)
        qw_col = None
        if needs_dx:
            qw.update_usage(rowwise_usage=False)  # save only the copy dgrad reads
            qw_col = qw
        tensors, ctx.objects = prepare_for_saving(qx_col, qw_col)
        ctx.save_for_backward(*tensors)
        ctx.factory = factory
        ctx.native = native
        ctx.groups = groups
        ctx.dtypes = (x2d.dtype, w_nk.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        qx_col, qw_col = restore_from_saved(ctx.objects, ctx.saved_tensors)
        x_dtype, w_dtype = ctx.dtypes
        factory = ctx.factory
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qg = _quantize(factory, "grad_output", grad_y, groups=ctx.groups)
            dx = _gemm(ctx.native, qg, qw_col, out_dtype=x_dtype)
        if ctx.needs_input_grad[1]:
            qg_col = _quantize(factory, "grad_output", _pad_rows(grad_y), rowwise=False, columnwise=True,
                               groups=ctx.groups)
            dw = _gemm(ctx.native, qg_col, qx_col, transpose_a=True, out_dtype=w_dtype)
        return dx, dw, None, None, None
