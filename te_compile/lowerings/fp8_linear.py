"""Per-tensor FP8 linear (current and delayed scaling) as an autograd.Function.

aot_autograd traces its forward and backward and inductor fuses the amax / scale / cast ops into
neighbouring kernels; the GEMMs are torch._scaled_mm (te_compile.lowerings.gemm.fp8_gemm).

GEMMs (HYBRID: E4M3 forward tensors, E5M2 gradients; all E4M3 for the E4M3 format):
- fprop  y  = x  @ w.T   : x  [M, K] E4M3 (row-major),  w  [N, K] E4M3 (as column-major [K, N])
- dgrad  dx = g  @ w     : g  [M, N] E5M2 (row-major),  w  [N, K] E4M3 (as column-major)
- wgrad  dw = g.T @ x    : g.T [N, M] E5M2 (row-major), x  [M, K] E4M3 (as column-major)
Only the FP8 copies of x and w are saved for backward (1 byte per element instead of 2 or 4).
Bias and its gradient stay in high precision.
"""

from __future__ import annotations

import torch

from ..recipe import DelayedScaling, Float8CurrentScaling
from ..scaling import cast_to_fp8, compute_scale, tensor_amax
from .gemm import fp8_gemm

__all__ = ["Fp8LinearFunction", "PER_TENSOR_RECIPES"]

PER_TENSOR_RECIPES = (Float8CurrentScaling, DelayedScaling)


def _quantize_per_tensor(t, role, recipe, scale=None):
    """(fp8 data, scale_inv [1], amax [1]) of ``t`` for ``role``.

    scale: None for current scaling (the scale comes from this tensor's amax), else the role's
    delayed-scaling scale [1] from steps <= t-1, read only (delayed_update.py folds in step t).
    """
    fp8_dtype = recipe.fp8_format.dtype_for(role)
    amax = tensor_amax(t)
    if scale is None:
        scale = compute_scale(amax, fp8_dtype, force_pow_2_scales=recipe.use_power_2_scales,
                              amax_epsilon=recipe.amax_epsilon)
    data = cast_to_fp8(t, scale, fp8_dtype)
    scale_inv = torch.div(torch.ones_like(scale), scale)
    return data, scale_inv, amax


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """Same values, column-major layout (the b operand of _scaled_mm)."""
    return t.t().contiguous().t()


class Fp8LinearFunction(torch.autograd.Function):
    """Per-tensor FP8 (current or delayed scaling). x2d: [M, K], w_nk: [N, K].

    Delayed scaling passes the three roles' scales (fp32 [1] each: input, weight, grad_output), read
    only, and, when a backward follows, ``carrier``: the backward returns this call's amaxes
    [input, weight, grad_output] as the carrier's gradient, and delayed_update.py folds them into the
    state once every site's backward has run. Current scaling passes None for all four.
    """

    @staticmethod
    def forward(ctx, x2d, w_nk, recipe, carrier, x_scale, w_scale, g_scale):
        xq, x_sinv, x_amax = _quantize_per_tensor(x2d, "input", recipe, x_scale)
        wq, w_sinv, w_amax = _quantize_per_tensor(w_nk, "weight", recipe, w_scale)
        xq, wq = xq.contiguous(), wq.contiguous()
        y = fp8_gemm(xq, wq.t(), x_sinv, w_sinv, out_dtype=x2d.dtype)
        ctx.recipe = recipe
        ctx.dtypes = (x2d.dtype, w_nk.dtype)
        ctx.has_g_scale = g_scale is not None
        ctx.save_for_backward(xq, x_sinv, wq, w_sinv, torch.cat([x_amax, w_amax]),
                              *((g_scale,) if g_scale is not None else ()))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xq, x_sinv, wq, w_sinv, xw_amax, *g_scale = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        gq, g_sinv, g_amax = _quantize_per_tensor(grad_y, "grad_output", ctx.recipe,
                                                  g_scale[0] if g_scale else None)
        gq = gq.contiguous()
        dx = dw = carrier_grad = None
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm(gq, _column_major(wq), g_sinv, w_sinv, out_dtype=x_dtype)
        if ctx.needs_input_grad[1]:
            dw = fp8_gemm(gq.t().contiguous(), _column_major(xq), g_sinv, x_sinv, out_dtype=w_dtype)
        if ctx.needs_input_grad[3]:
            carrier_grad = torch.cat([xw_amax, g_amax])
        return dx, dw, None, carrier_grad, None, None, None
