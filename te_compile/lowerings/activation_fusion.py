"""An activation and the FP8 linear reading its output, as one operation (the second half of TE's
LayerNormMLP): ``ActivationLinearLowering(spec)(h, u, shape, weight, bias, *delayed) -> y``.

    gelu:   a = F.gelu(h)            (erf, or approximate="tanh")
    relu:   a = F.relu(h)
    relu2:  a = F.relu(h) ** 2
    silu:   a = F.silu(h)
    swiglu: a = F.silu(h) * u        (Llama's gate: h = gate_proj(x), u = up_proj(x))
    geglu:  a = F.gelu(h) * u        (Gemma's; erf or tanh)
    custom: a = spec.fn(h)           a hand-written elementwise activation (HF GPT-2's gelu_new),
                                     the model's own ops copied out of its graph; backward
                                     differentiates them with autograd

The same fusion in front of an MoE layer's second grouped GEMM (the SwiGLU between the experts'
GEMMs): ``ActivationGroupedLinearLowering(spec, grouped)(h, u, shape, w, offs, *delayed)``, per-expert
scales as grouped_linear.py's.

Forward computes a, its amax and its FP8 bytes and runs the GEMM: the same ops, hence the same bytes,
as te's unfused path. What is saved differs: the activation's input (which its backward needs
anyway) and the FP8 scale, not the FP8 copy of a: backward recomputes a's bytes for the wgrad GEMM
from the saved input (one elementwise pass) instead of keeping [M, K] bytes alive from forward to
backward. Under the recipe's ``fp8_activation_input`` that input is itself saved in FP8 (E4M3, a scale
from its own amax; per expert between MoE GEMMs), and backward reads the activation and the wgrad
operand from the dequantized values. Per-tensor recipes (current and delayed scaling); the GEMMs are
gemm/per_tensor.py's and the scale handling that of linear.py's Fp8LinearFunction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .. import hardware
from ..autocast import autocast_dtype
from ..fx.cache_names import name_lowering
from ..gemm.grouped import group_index
from ..gemm.per_tensor import add_bias, column_major, fp8_dgrad_wgrad, fp8_fprop, split_bias
from ..recipe import Recipe
from ..scaling import (cast_to_fp8, compute_scale, current_scale, group_amax, quantize_per_tensor,
                       quantize_rows_per_group, scale_invs, tensor_amax)
from .grouped_linear import GroupedLinearLowering, grouped_dgrad_wgrad, grouped_fprop
from .linear import LinearLowering

__all__ = ["ACTIVATIONS", "ActivationLinearSpec", "ActivationLinearLowering", "ActFp8LinearFunction",
           "ActivationGroupedLinearLowering", "ActFp8GroupedLinearFunction", "activation"]

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "relu2", "silu", "swiglu", "geglu", "geglu_tanh", "custom")


def activation(kind: str, h: torch.Tensor, u: Optional[torch.Tensor], fn: Optional[Callable] = None) -> torch.Tensor:
    """The activation's output, by the ops the model's code calls (so the bytes match)."""
    if kind == "custom":
        return fn(h)
    if kind == "gelu":
        return F.gelu(h)
    if kind == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if kind == "relu":
        return F.relu(h)
    if kind == "relu2":
        return F.relu(h).square()
    if kind == "silu":
        return F.silu(h)
    if kind == "swiglu":
        return F.silu(h) * u
    if kind in ("geglu", "geglu_tanh"):
        return F.gelu(h, approximate="tanh" if kind == "geglu_tanh" else "none") * u
    raise ValueError(f"activation kind must be one of {ACTIVATIONS}, got {kind!r}")


def _activation_backward(kind: str, da: torch.Tensor, h: torch.Tensor, u: Optional[torch.Tensor],
                         fn: Optional[Callable] = None):
    """(dh, du) for the gradient ``da`` of the activation's output (autograd's own formulas)."""
    if kind == "custom":
        with torch.enable_grad():   # aot_autograd traces this into the backward graph
            leaf = h.detach().requires_grad_()
            (dh,) = torch.autograd.grad(fn(leaf), leaf, da)
        return dh, None
    if kind in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(da, h, approximate="tanh" if kind == "gelu_tanh" else "none"), None
    if kind == "relu":
        return torch.where(h > 0, da, torch.zeros_like(da)), None
    if kind == "relu2":
        return da * 2 * F.relu(h), None
    if kind == "silu":
        return torch.ops.aten.silu_backward(da, h), None
    if kind in ("geglu", "geglu_tanh"):
        approximate = "tanh" if kind == "geglu_tanh" else "none"
        return torch.ops.aten.gelu_backward(da * u, h, approximate=approximate), da * F.gelu(h, approximate=approximate)
    return torch.ops.aten.silu_backward(da * u, h), da * F.silu(h)


def _stash(t: Optional[torch.Tensor], recipe: Recipe, groups: Optional[torch.Tensor] = None,
           experts: int = 0) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """What forward saves of the activation's input ``t`` [M, K]: (t, None), or under
    ``recipe.fp8_activation_input`` (E4M3 bytes, fp32 scale_inv [1] or per expert [E] with ``groups``),
    the scale from t's own amax (no recipe state: nothing else reads it)."""
    if t is None or not recipe.fp8_activation_input:
        return t, None
    fp8 = recipe.fp8_format.dtype_for("input")
    amax = tensor_amax(t) if groups is None else group_amax(t, groups, experts)
    scale = compute_scale(amax, fp8)
    rows = scale if groups is None else scale[groups.clamp(max=experts - 1)][:, None]
    return cast_to_fp8(t, rows, fp8), torch.div(torch.ones_like(scale), scale)


def _unstash(saved: Optional[torch.Tensor], scale_inv: Optional[torch.Tensor], dtype: torch.dtype,
             groups: Optional[torch.Tensor] = None, experts: int = 0) -> Optional[torch.Tensor]:
    """The activation's input as backward reads it: as saved, or dequantized from ``_stash``'s FP8."""
    if scale_inv is None:
        return saved
    rows = scale_inv if groups is None else scale_inv[groups.clamp(max=experts - 1)][:, None]
    return (saved.to(torch.float32) * rows).to(dtype)


@dataclass(frozen=True)
class ActivationLinearSpec:
    fqn: str                                 # the module applying the activation
    kind: str                                # one of ACTIVATIONS
    linear: str                              # the linear's module path
    recipe: Recipe                           # DelayedScaling or Float8CurrentScaling
    weight_in_out: bool = False
    casts: tuple[torch.dtype, ...] = ()      # dtype casts between the activation and the linear
    fn: Optional[Callable] = None            # kind "custom": h -> a, the model's ops (an fx.GraphModule)
    inductor: bool = True                    # the graph compiles with inductor (see _computed_once)


class ActFp8LinearFunction(torch.autograd.Function):
    """h [M, K] (u [M, K] for swiglu) -> y [M, N] = quantize(act(h, u)) @ quantize(w_nk).T.

    carrier, x_scale, w_scale, g_scale: DelayedScaling's (see linear.py's Fp8LinearFunction), None
    under current scaling. bias [N]: added in the GEMM's epilogue (``adds_bias``), else None."""

    @staticmethod
    def forward(ctx, spec: ActivationLinearSpec, h, u, w_nk, carrier, x_scale, w_scale, g_scale, bias=None):
        recipe = spec.recipe
        a = _cast(activation(spec.kind, h, u, spec.fn), spec.casts)
        if x_scale is None and spec.inductor:
            a = _computed_once(a)
        x_amax = tensor_amax(a, by_rows=x_scale is not None)   # delayed scaling: in the cast's pass
        # delayed scaling: both inverses in one op (None, None under current scaling)
        x_sinv, w_sinv = scale_invs(x_scale, w_scale)
        if x_scale is None:
            x_scale = current_scale(x_amax, "input", recipe)   # kept: backward re-quantizes with it
        xq, x_sinv, x_amax = quantize_per_tensor(a, "input", recipe, x_scale, x_amax, scale_inv=x_sinv)
        y, wq, w_sinv, w_amax = fp8_fprop(xq, x_sinv, w_nk, recipe, w_scale, out_dtype=a.dtype, w_sinv=w_sinv,
                                          bias=bias)
        ctx.spec = spec
        ctx.dtypes = (h.dtype, a.dtype, w_nk.dtype)
        ctx.save_for_backward(*_stash(h, recipe), *_stash(u, recipe), x_scale, x_sinv, wq, w_sinv,
                              torch.cat([x_amax, w_amax]), *((g_scale,) if g_scale is not None else ()))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        spec = ctx.spec
        h, h_sinv, u, u_sinv, x_scale, x_sinv, wq, w_sinv, xw_amax, *g_scale = ctx.saved_tensors
        h_dtype, a_dtype, w_dtype = ctx.dtypes
        h, u = _unstash(h, h_sinv, h_dtype), _unstash(u, u_sinv, h_dtype)

        def xq_colmajor():
            # the forward's FP8 operand, recomputed from the saved activation input and scale (from
            # its FP8 copy under fp8_activation_input: near the forward's bytes, not equal to them)
            a = _cast(activation(spec.kind, h, u, spec.fn), spec.casts)
            return column_major(cast_to_fp8(a, x_scale, spec.recipe.fp8_format.dtype_for("input")))

        need_da = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        da, dw, g_amax = fp8_dgrad_wgrad(grad_y, spec.recipe, wq, w_sinv, x_sinv,
                                         xq_colmajor if ctx.needs_input_grad[3] else None,
                                         dx_dtype=a_dtype if need_da else None, dw_dtype=w_dtype,
                                         g_scale=g_scale[0] if g_scale else None)
        dh = du = carrier_grad = None
        if need_da:
            dh, du = _activation_backward(spec.kind, da.to(h_dtype), h, u, spec.fn)
        if ctx.needs_input_grad[4]:
            carrier_grad = torch.cat([xw_amax, g_amax])
        # bias is optional: a call without it has 8 inputs
        db = grad_y.sum(0) if len(ctx.needs_input_grad) > 8 and ctx.needs_input_grad[8] else None
        return (None, dh, du, dw, carrier_grad, None, None, None, db)[:len(ctx.needs_input_grad)]


def _computed_once(a: torch.Tensor) -> torch.Tensor:
    """``a`` as a buffer of its own in inductor's CPU code, the same values. Current scaling reads the
    activation twice, for its amax and then for its cast, and inductor inlines a pointwise producer into
    each loop that reads it: for gelu a second erf per element, which on a CPU costs more than the
    store and reload it saves (the demo's [512, 512] gelu: 0.46 ms a pass on one core, 5% of its step).
    Inductor keeps exp-, log-, tanh- and sigmoid-based producers as buffers on a CPU itself; erf is not
    on its list. GPU kernels are memory-bound and keep the producer inline. Only for inductor: under
    aot_eager nothing is inlined, and the op would move the partitioner's choice of what to save (it
    then recomputed the next linear's FP8 weight in the backward)."""
    force = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    if force is None or hardware.code_device_type(a) != "cpu":
        return a
    return force.default(a, a.stride())


def _cast(a: torch.Tensor, casts) -> torch.Tensor:
    for dtype in casts:
        a = a.to(dtype)
    return a


class ActivationLinearLowering:
    """Callable inserted into the FX graph for a fused activation site.

    ``(h, u, shape, weight, bias, *delayed) -> y``: h [..., K] the activation's input (u: swiglu's
    up projection, else None); shape: a tensor with the linear's input shape (a view of h), y is
    ``shape[:-1] + [N]``; weight [N, K] ([K, N] when ``spec.weight_in_out``); bias or None; delayed:
    DelayedScaling's carrier and scales, or nothing. Under autocast it runs unfused.
    """

    def __init__(self, spec: ActivationLinearSpec, linear: LinearLowering) -> None:
        self.spec = spec
        self._linear = linear
        name_lowering(self, f"te_{spec.kind}_linear_{spec.recipe.name}", __name__)

    def __call__(self, h, u, shape, weight, bias, *delayed):
        if autocast_dtype(h) is not None:
            a = _cast(activation(self.spec.kind, h, u, self.spec.fn), self.spec.casts)
            return self._linear(a.reshape(shape.shape), weight, bias, *delayed)
        w_nk = weight.t() if self.spec.weight_in_out else weight
        k = h.shape[-1]
        in_gemm, bias = split_bias(bias, self.spec.casts[-1] if self.spec.casts else h.dtype,   # y's dtype
                                   w_nk.shape[0])
        y = ActFp8LinearFunction.apply(self.spec, h.reshape(-1, k), None if u is None else u.reshape(-1, k), w_nk,
                                       *(delayed or (None,) * 4), in_gemm)
        return add_bias(y.reshape(*shape.shape[:-1], y.shape[-1]), bias)

    def __repr__(self) -> str:
        return f"ActivationLinearLowering({self.spec.kind} -> {self.spec.linear!r}, {self.spec.recipe.name})"


class ActFp8GroupedLinearFunction(torch.autograd.Function):
    """h [M, K] (u [M, K] for swiglu) -> y [M, N]: act(h, u) quantized per expert, times each expert's
    quantized weight (grouped_linear.py's GEMMs). w_ekn: [E, K, N]; offs: int32 [E]; carrier and the
    scales [E]: DelayedScaling's, None under current scaling."""

    @staticmethod
    def forward(ctx, spec: ActivationLinearSpec, h, u, w_ekn, offs, carrier, x_scale, w_scale, g_scale):
        recipe, experts = spec.recipe, w_ekn.shape[0]
        groups = group_index(offs, h.shape[0])
        a = _cast(activation(spec.kind, h, u, spec.fn), spec.casts)
        if x_scale is None and spec.inductor:
            a = _computed_once(a)
        x_amax = group_amax(a, groups, experts)
        if x_scale is None:
            x_scale = current_scale(x_amax, "input", recipe)   # kept: backward re-quantizes with it
        xq, x_sinv, _ = quantize_rows_per_group(a, groups, experts, "input", recipe, x_scale, x_amax)
        y, wq, w_sinv, w_amax = grouped_fprop(xq, x_sinv, groups, w_ekn, offs, recipe, w_scale, out_dtype=a.dtype)
        ctx.spec = spec
        ctx.dtypes = (h.dtype, a.dtype, w_ekn.dtype)
        ctx.save_for_backward(*_stash(h, recipe, groups, experts), *_stash(u, recipe, groups, experts), x_scale,
                              x_sinv, wq, w_sinv, offs, groups, torch.cat([x_amax, w_amax]),
                              *((g_scale,) if g_scale is not None else ()))
        ctx.mark_non_differentiable(offs)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        spec = ctx.spec
        h, h_sinv, u, u_sinv, x_scale, x_sinv, wq, w_sinv, offs, groups, xw_amax, *g_scale = ctx.saved_tensors
        h_dtype, a_dtype, w_dtype = ctx.dtypes
        experts = wq.shape[0]
        h, u = _unstash(h, h_sinv, h_dtype, groups, experts), _unstash(u, u_sinv, h_dtype, groups, experts)
        need_da = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        xq = None
        if ctx.needs_input_grad[3]:
            # the forward's FP8 operand, recomputed from the saved activation input and scales (from
            # its FP8 copy under fp8_activation_input: near the forward's bytes, not equal to them)
            a = _cast(activation(spec.kind, h, u, spec.fn), spec.casts)
            xq, _, _ = quantize_rows_per_group(a, groups, wq.shape[0], "input", spec.recipe, x_scale)
        da, dw, g_amax = grouped_dgrad_wgrad(grad_y, groups, offs, spec.recipe, wq, w_sinv, xq, x_sinv,
                                             g_scale[0] if g_scale else None,
                                             dx_dtype=a_dtype if need_da else None,
                                             dw_dtype=w_dtype if ctx.needs_input_grad[3] else None)
        dh = du = carrier_grad = None
        if need_da:
            dh, du = _activation_backward(spec.kind, da.to(h_dtype), h, u, spec.fn)
        if ctx.needs_input_grad[5]:
            carrier_grad = torch.cat([xw_amax, g_amax])
        return None, dh, du, None if dw is None else dw.transpose(1, 2), None, carrier_grad, None, None, None


class ActivationGroupedLinearLowering:
    """Callable inserted into the FX graph for an activation fused into an MoE layer's grouped GEMM.

    ``(h, u, shape, w, offs, *delayed) -> y``: h [M, K] the activation's input (u: swiglu's up half,
    else None); shape: a tensor of the GEMM input's shape; w [E, K, N] and offs as the grouped GEMM
    reads them; delayed: DelayedScaling's carrier and [E] scales, or nothing.
    """

    def __init__(self, spec: ActivationLinearSpec, grouped: GroupedLinearLowering) -> None:
        self.spec = spec
        self._grouped = grouped
        name_lowering(self, f"te_{spec.kind}_grouped_linear_{spec.recipe.name}", __name__)

    def __call__(self, h, u, shape, w_ekn, offs, *delayed):
        state = delayed or (None,) * 4
        k = h.shape[-1]
        h, u = h.reshape(-1, k), None if u is None else u.reshape(-1, k)
        return self._grouped.padded(
            lambda h_, u_, offs_: ActFp8GroupedLinearFunction.apply(self.spec, h_, u_, w_ekn, offs_, *state),
            [h, u], offs, w_ekn.shape[0])

    def __repr__(self) -> str:
        return f"ActivationGroupedLinearLowering({self.spec.kind} -> {self.spec.linear!r}, {self.spec.recipe.name})"
