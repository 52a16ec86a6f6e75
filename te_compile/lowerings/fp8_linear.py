"""FP8 linear layers with autograd: what a rewritten linear site calls.

The backend replaces ``linear(x, w, b)`` (or ``addmm(b, x, w)`` with ``w: [in, out]``) by a call to a
``LinearLowering``. It is plain Python around ``torch.autograd.Function``s, so aot_autograd traces
its forward and backward and inductor fuses the amax / scale / cast ops into neighbouring kernels.

GEMMs (HYBRID: E4M3 forward tensors, E5M2 gradients; all E4M3 for the E4M3 format):
- fprop  y  = x  @ w.T   : x  [M, K] E4M3 (row-major),  w  [N, K] E4M3 (as column-major [K, N])
- dgrad  dx = g  @ w     : g  [M, N] E5M2 (row-major),  w  [N, K] E4M3 (as column-major)
- wgrad  dw = g.T @ x    : g.T [N, M] E5M2 (row-major), x  [M, K] E4M3 (as column-major)
Only the FP8 copies of x and w are saved for backward (1 byte per element instead of 2 or 4).
Bias and its gradient stay in high precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..recipe import CustomRecipe, DelayedScaling, Float8CurrentScaling, Recipe
from ..tensor.quantized_tensor import prepare_for_saving, restore_from_saved
from ..tensor.scaling import (
    cast_to_fp8,
    compute_scale,
    delayed_scale_from_history,
    tensor_amax,
    update_amax_history,
)
from .gemm import fp8_gemm

__all__ = ["LinearSpec", "LinearLowering", "SUPPORTED_RECIPES"]

SUPPORTED_RECIPES = (Float8CurrentScaling, DelayedScaling, CustomRecipe)


@dataclass(frozen=True)
class LinearSpec:
    """Everything about a site the lowering needs that is not a tensor."""

    fqn: str
    recipe: Recipe
    weight_in_out: bool = False   # weight stored [in, out] (GPT-2 Conv1D / addmm) not [out, in]


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


class _Fp8Linear(torch.autograd.Function):
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


class _CustomLinear(torch.autograd.Function):
    """CustomRecipe: quantizers from ``qfactory(role)``; GEMMs on dequantized values in fp32 (or
    the quantizer's own ``qgemm`` for fprop). x2d: [M, K], w_nk: [N, K]."""

    @staticmethod
    def forward(ctx, x2d, w_nk, recipe):
        x_quantizer = recipe.qfactory("input")
        qx = x_quantizer.quantize(x2d)
        qw = recipe.qfactory("weight").quantize(w_nk)
        if hasattr(x_quantizer, "qgemm"):
            y = x_quantizer.qgemm(qx, qw, out_dtype=x2d.dtype)
        else:
            y = (qx.dequantize(dtype=torch.float32) @ qw.dequantize(dtype=torch.float32).t()).to(x2d.dtype)
        tensors, ctx.objects = prepare_for_saving(qx, qw)
        ctx.save_for_backward(*tensors)
        ctx.recipe = recipe
        ctx.dtypes = (x2d.dtype, w_nk.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        qx, qw = restore_from_saved(ctx.objects, ctx.saved_tensors)
        x_dtype, w_dtype = ctx.dtypes
        g = ctx.recipe.qfactory("grad_output").quantize(grad_y).dequantize(dtype=torch.float32)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (g @ qw.dequantize(dtype=torch.float32)).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = (g.t() @ qx.dequantize(dtype=torch.float32)).to(w_dtype)
        return dx, dw, None


class LinearLowering:
    """Callable inserted into the FX graph for one site: ``(x, weight, bias, *state) -> y``.

    x: [..., K]; weight: [N, K] (or [K, N] when ``spec.weight_in_out``); bias: [N] or None;
    state: the delayed-scaling tensors of the site (empty otherwise). Returns [..., N].
    """

    def __init__(self, spec: LinearSpec) -> None:
        if not isinstance(spec.recipe, SUPPORTED_RECIPES):
            raise NotImplementedError(
                f"{spec.fqn}: recipe {spec.recipe.name} is not supported by the te backend yet "
                f"(supported now: {[r.__name__ for r in SUPPORTED_RECIPES]}); keep it in high "
                f"precision with an override (recipe = \"none\") or pick a supported recipe"
            )
        self.spec = spec
        # FX codegen names the call after these.
        self.__name__ = f"te_fp8_linear_{spec.recipe.name}"
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 *state: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        x2d = x.reshape(-1, k)
        w_nk = weight.t() if self.spec.weight_in_out else weight
        recipe = self.spec.recipe
        if isinstance(recipe, CustomRecipe):
            y = _CustomLinear.apply(x2d, w_nk, recipe)
        else:
            # A backward will run (and update the state) only if autograd records this call.
            backward_follows = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            y = _Fp8Linear.apply(x2d, w_nk, recipe, not backward_follows, *state)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], w_nk.shape[0])

    def __repr__(self) -> str:
        return f"LinearLowering({self.spec.fqn!r}, {self.spec.recipe.name})"
