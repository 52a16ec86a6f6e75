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
from ..scaling import (
    cast_to_fp8,
    compute_scale,
    delayed_scale_from_history,
    tensor_amax,
    update_amax_history,
)
from .gemm import fp8_gemm

__all__ = ["Fp8LinearFunction", "PER_TENSOR_RECIPES"]

PER_TENSOR_RECIPES = (Float8CurrentScaling, DelayedScaling)


def _quantize_per_tensor(t, role, recipe, state):
    """(fp8 data, scale_inv [1], amax [1]) of ``t`` for ``role``.

    state: None for current scaling, else (amax_history [L], scale [1]) of this role, read only:
    delayed scaling quantizes with the scale from steps <= t-1 (``_update_state`` folds in step t).
    """
    fp8_dtype = recipe.fp8_format.dtype_for(role)
    amax = tensor_amax(t)
    if state is None:
        scale = compute_scale(amax, fp8_dtype, force_pow_2_scales=recipe.use_power_2_scales,
                              amax_epsilon=recipe.amax_epsilon)
    else:
        scale = state[1]
    data = cast_to_fp8(t, scale, fp8_dtype)
    scale_inv = torch.div(torch.ones_like(scale), scale)
    return data, scale_inv, amax


def _update_state(state, amax, role, recipe) -> None:
    """Delayed scaling: push this step's amax into the history and compute the next scale."""
    history, scale = state
    new_history = update_amax_history(history, amax)
    new_scale = delayed_scale_from_history(
        new_history, scale, recipe.fp8_format.dtype_for(role), margin=recipe.margin,
        amax_compute_algo=recipe.amax_compute_algo,
        scaling_factor_compute_algo=recipe.scaling_factor_compute_algo, recipe=recipe,
    )
    history.copy_(new_history)
    scale.copy_(new_scale)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """Same values, column-major layout (the b operand of _scaled_mm)."""
    return t.t().contiguous().t()


class Fp8LinearFunction(torch.autograd.Function):
    """Per-tensor FP8 (current or delayed scaling). x2d: [M, K], w_nk: [N, K].

    Delayed-scaling state (per role (amax_history, scale) for input, weight, grad_output, in the
    order of te_compile.state.LinearState.tensors()) is updated where no later read can see a
    half-updated value: when a backward will run, the input/weight updates happen in the backward.
    The reason: aot_autograd's partitioner may recompute cheap forward ops (the weight cast) in the
    backward from graph inputs, and a state buffer mutated by the forward would then hand the
    backward the next step's scale. Without autograd (inference) the forward updates them itself.
    """

    @staticmethod
    def forward(ctx, x2d, w_nk, recipe, update_in_forward, *state):
        delayed = bool(state)
        xq, x_sinv, x_amax = _quantize_per_tensor(x2d, "input", recipe, state[0:2] if delayed else None)
        wq, w_sinv, w_amax = _quantize_per_tensor(w_nk, "weight", recipe, state[2:4] if delayed else None)
        xq, wq = xq.contiguous(), wq.contiguous()
        y = fp8_gemm(xq, wq.t(), x_sinv, w_sinv, out_dtype=x2d.dtype)
        if delayed and update_in_forward:
            _update_state(state[0:2], x_amax, "input", recipe)
            _update_state(state[2:4], w_amax, "weight", recipe)
        ctx.recipe = recipe
        ctx.delayed = delayed
        ctx.dtypes = (x2d.dtype, w_nk.dtype)
        ctx.save_for_backward(xq, x_sinv, wq, w_sinv, x_amax, w_amax, *state)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xq, x_sinv, wq, w_sinv, x_amax, w_amax, *state = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        recipe = ctx.recipe
        gq, g_sinv, g_amax = _quantize_per_tensor(grad_y, "grad_output", recipe,
                                                  state[4:6] if ctx.delayed else None)
        gq = gq.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm(gq, _column_major(wq), g_sinv, w_sinv, out_dtype=x_dtype)
        if ctx.needs_input_grad[1]:
            dw = fp8_gemm(gq.t().contiguous(), _column_major(xq), g_sinv, x_sinv, out_dtype=w_dtype)
        if ctx.delayed:
            _update_state(state[0:2], x_amax, "input", recipe)
            _update_state(state[2:4], w_amax, "weight", recipe)
            _update_state(state[4:6], g_amax, "grad_output", recipe)
        return (dx, dw, None, None) + (None,) * len(state)
