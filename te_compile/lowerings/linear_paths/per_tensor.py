"""Per-tensor FP8 linear (current and delayed scaling) as an autograd.Function.

aot_autograd traces its forward and backward and inductor fuses the amax / scale / cast ops into
neighbouring kernels; the GEMMs are torch._scaled_mm (te_compile.gemm.per_tensor.fp8_gemm). The
quantize itself is te_compile.scaling's, shared with the eager features; this module adds the
GEMMs around it (``fp8_fprop``, ``fp8_dgrad_wgrad``), which the fused lowerings (norm, activation,
attention projection) call with an FP8 input they made themselves.

GEMMs (HYBRID: E4M3 forward tensors, E5M2 gradients; all E4M3 for the E4M3 format):
- fprop  y  = x  @ w.T   : x  [M, K] E4M3 (row-major),  w  [N, K] E4M3 (as column-major [K, N])
- dgrad  dx = g  @ w     : g  [M, N] E5M2 (row-major),  w  [N, K] E4M3 (as column-major)
- wgrad  dw = g.T @ x    : g.T [N, M] E5M2 (row-major), x  [M, K] E4M3 (as column-major)
Only the FP8 copies of x and w are saved for backward (1 byte per element instead of 2 or 4).
Bias and its gradient stay in high precision.

On shards of tensors split across ranks (sharded.py) current scaling all-reduces the amaxes
of the sharded operands (MAX) before computing their scales: x and w in one buffer in forward, g in
backward; ``groups`` names the groups per role and is empty in one process.
"""

from __future__ import annotations

import torch

from ...distributed import is_dtensor, reduce_amaxes
from ...gemm.per_tensor import column_major, fp8_gemm, operand_a, operand_b
from ...quantization import weight_is_operand
from ...scaling import quantize_per_tensor, scale_invs, tensor_amax
from ...tensor.quantized_tensor import QuantizedTensor

__all__ = ["Fp8LinearFunction", "quantize_weight", "fp8_fprop", "fp8_dgrad_wgrad", "casts_weight_itself",
           "weight_in_input_dtype"]


def casts_weight_itself(weight: torch.Tensor) -> bool:
    """Whether a per-tensor Function (this one, the fused output layer's) takes ``weight`` in its own
    dtype under autocast and casts it with ``weight_in_input_dtype``: a plain tensor. A DTensor runs
    shard by shard and a quantized weight keeps its own path; their lowerings cast them first."""
    return not is_dtensor(weight) and not isinstance(weight, QuantizedTensor)


def weight_in_input_dtype(w_nk: torch.Tensor, dtype: torch.dtype, recipe) -> torch.Tensor:
    """``w_nk`` in the input's ``dtype``: autocast's cast of the weight, made inside the Function so that
    its backward returns dw from the wgrad GEMM in the weight's own dtype (fp32 under autocast over
    fp32 weights), with no cast kernel after the GEMM. A weight already in the recipe's FP8 format is
    used as it is."""
    if w_nk.dtype == dtype or weight_is_operand(w_nk, recipe):
        return w_nk
    return w_nk.to(dtype)


def quantize_weight(w_nk, recipe, scale=None, amax=None, scale_inv=None):
    """(fp8 data [N, K], scale_inv [1], amax [1]) of the weight operand.

    A weight that arrives as a Float8Tensor in the recipe's weight format (FSDP2's FP8 all-gather,
    te_compile/fsdp.py; FP8 primary weights, te_compile/primary_weights.py) is used as it is: its
    bytes and scale, no second quantization. Under delayed scaling its amax still goes into the
    history: the one it carries (``_amax``, the amax of the values it was quantized from) or else the
    one its bytes show; its own scale_inv stands (a ``scale_inv`` passed goes unused). Any other
    weight is quantized like every operand (``quantize_per_tensor``; ``scale_inv``: 1 / scale when the
    caller has it).
    """
    if weight_is_operand(w_nk, recipe):
        data = w_nk._data.view(w_nk._fp8_dtype)
        scale_inv = w_nk._scale_inv
        if amax is None and w_nk._amax is not None:
            amax = w_nk._amax
        elif amax is None:
            amax = tensor_amax(data.to(torch.float32)) * scale_inv if scale is not None else torch.zeros_like(scale_inv)
        return data, scale_inv, amax
    if isinstance(w_nk, QuantizedTensor):   # another format: its values, quantized again
        w_nk = w_nk.dequantize()
    return quantize_per_tensor(w_nk, "weight", recipe, scale, amax, scale_inv=scale_inv)


def fp8_fprop(xq, x_sinv, w_nk, recipe, w_scale=None, w_amax=None, *, out_dtype, w_sinv=None):
    """The forward GEMM of a per-tensor site, its FP8 input made by the caller (from x, a norm, an
    activation or an attention output): y [M, N] = xq [M, K] @ quantize(w_nk [N, K]).T.

    Returns (y, wq [N, K] contiguous: saved for dgrad, w's scale_inv [1], w's amax [1]). w_scale /
    w_amax / w_sinv: see ``quantize_weight``."""
    wq, w_sinv, w_amax = quantize_weight(w_nk, recipe, w_scale, w_amax, w_sinv)
    wq = wq.contiguous()
    y = fp8_gemm(operand_a(xq), wq.t(), x_sinv, w_sinv, out_dtype=out_dtype,
                 fast_accum=recipe.fast_accumulation("fprop"))
    return y, wq, w_sinv, w_amax


def fp8_dgrad_wgrad(grad_y, recipe, wq, w_sinv, x_sinv, x_colmajor, *, dx_dtype, dw_dtype, g_scale=None,
                    g_amax=None):
    """The backward GEMMs of a per-tensor site from its saved FP8 operands; grad_y [M, N] is quantized
    here (E5M2 under HYBRID) with ``g_scale`` (delayed scaling) or its own amax (``g_amax`` when the
    caller all-reduced it).

    dgrad dx [M, K] = gq @ wq in ``dx_dtype`` (None: not needed); wgrad dw [N, K] = gq.T @ xq in
    ``dw_dtype``, where ``x_colmajor()`` gives the forward's FP8 input [M, K] column-major (saved,
    saved transposed or recomputed: the caller's choice; None: no wgrad). Returns (dx, dw, g_amax [1]).
    """
    gq, g_sinv, g_amax = quantize_per_tensor(grad_y, "grad_output", recipe, g_scale, g_amax)
    gq = gq.contiguous()
    dx = None if dx_dtype is None else fp8_gemm(gq, operand_b(wq), g_sinv, w_sinv, out_dtype=dx_dtype)
    dw = None
    if x_colmajor is not None:
        dw = fp8_gemm(operand_a(gq.t()), x_colmajor(), g_sinv, x_sinv, out_dtype=dw_dtype)
    return dx, dw, g_amax


class Fp8LinearFunction(torch.autograd.Function):
    """Per-tensor FP8 (current or delayed scaling). x2d: [M, K], w_nk: [N, K].

    ``groups``: per role (input, weight, grad_output) the groups whose amax all-reduce current scaling
    needs (sharded.py); NO_GROUPS in one process and for delayed scaling, whose update node
    reduces the amaxes.

    Delayed scaling passes the three roles' scales (fp32 [1] each: input, weight, grad_output), read
    only, and, when a backward follows, ``carrier``: the backward returns this call's amaxes
    [input, weight, grad_output] as the carrier's gradient, and delayed_state.py folds them into the
    state once every site's backward has run. Current scaling passes None for all four.
    """

    @staticmethod
    def forward(ctx, x2d, w_nk, recipe, groups, carrier, x_scale, w_scale, g_scale):
        w_dtype = w_nk.dtype
        w_nk = weight_in_input_dtype(w_nk, x2d.dtype, recipe)
        x_amax = tensor_amax(x2d)
        w_amax = None if weight_is_operand(w_nk, recipe) else tensor_amax(w_nk)
        if x_scale is None and (groups[0] or groups[1]):
            if w_amax is None:   # a pre-quantized weight brings its (whole-weight) scale
                [x_amax] = reduce_amaxes([x_amax], groups[:1])
            else:
                x_amax, w_amax = reduce_amaxes([x_amax, w_amax], groups[:2])
        # delayed scaling: both inverses in one op (None, None under current scaling)
        x_sinv, w_sinv = scale_invs(x_scale, w_scale)
        xq, x_sinv, x_amax = quantize_per_tensor(x2d, "input", recipe, x_scale, x_amax, scale_inv=x_sinv)
        xq = xq.contiguous()
        y, wq, w_sinv, w_amax = fp8_fprop(xq, x_sinv, w_nk, recipe, w_scale, w_amax, out_dtype=x2d.dtype,
                                          w_sinv=w_sinv)
        ctx.recipe = recipe
        ctx.g_groups = groups[2]
        ctx.dtypes = (x2d.dtype, w_dtype)
        ctx.has_g_scale = g_scale is not None
        ctx.save_for_backward(xq, x_sinv, wq, w_sinv, torch.cat([x_amax, w_amax]),
                              *((g_scale,) if g_scale is not None else ()))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xq, x_sinv, wq, w_sinv, xw_amax, *g_scale = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g_amax = tensor_amax(grad_y)
        if not g_scale and ctx.g_groups:
            [g_amax] = reduce_amaxes([g_amax], [ctx.g_groups])
        dx, dw, g_amax = fp8_dgrad_wgrad(
            # column_major, not operand_b, on the CPU too, as every site keeps it for x: without the copy
            # the partitioner saves other tensors for backward than on a GPU (seen under fp8_mha and in
            # the fused loss, whose tests count what is saved)
            grad_y, ctx.recipe, wq, w_sinv, x_sinv, (lambda: column_major(xq)) if ctx.needs_input_grad[1] else None,
            dx_dtype=x_dtype if ctx.needs_input_grad[0] else None, dw_dtype=w_dtype,
            g_scale=g_scale[0] if g_scale else None, g_amax=g_amax)
        carrier_grad = None
        if ctx.needs_input_grad[4]:
            carrier_grad = torch.cat([xw_amax, g_amax])
        return dx, dw, None, None, carrier_grad, None, None, None
