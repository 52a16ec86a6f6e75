"""``fp8_mha``'s output hand-off: FP8 attention and the output projection reading it, as one site.

    o = sdpa(q, k, v)                    [B, H, T, D]
    x = o.transpose(1, 2).reshape(...)   [B, T, H*D] (or [B*T, H*D])
    y = out_proj(x)                      an FP8 linear under a per-tensor recipe

becomes ``AttentionProjectionLowering(attention spec, linear)(q, k, v, mask, *attention state,
weight, bias, *linear state)``. The forward is what the two sites compute apart, bit for bit: the
attention op's output in q's dtype, quantized once as the projection's FP8 input with the
projection's scale (current, or its delayed-scaling input state). What changes is the backward's
O: the attention backward reads D = rowsum(dO * O) from that same FP8 tensor (its per-tensor
descale standing in for the per-head ones) instead of keeping an FP8 copy of its own, so O is saved
once, in the projection's layout, where apart it is saved twice (the attention's E4M3 copy per head
and the projection's input). TransformerEngine's fp8_mha hands the projection an FP8 O the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..autocast import autocast_dtype
from ..fx.cache_names import name_lowering
from ..gemm.per_tensor import add_bias, column_major, fp8_dgrad_wgrad, fp8_fprop, split_bias
from ..scaling import quantize_per_tensor, scale_invs, tensor_amax
from .attention import (
    AttentionLowering,
    AttentionSpec,
    attention_forward,
    split_fp8_inputs,
)
from .linear import LinearLowering

__all__ = ["AttentionProjectionSpec", "AttentionProjectionLowering", "AttentionProjectionFunction"]


@dataclass(frozen=True)
class AttentionProjectionSpec:
    attention: AttentionSpec
    linear_fqn: str
    recipe: object                # the projection's recipe (Float8CurrentScaling or DelayedScaling)
    flat: bool = False            # the projection reads [B*T, H*D], not [B, T, H*D]


class AttentionProjectionFunction(torch.autograd.Function):
    """q [B, H, T, D], k and v [B, Hkv, Tk, D], mask, w_nk [N, H*D] -> y [B*T, N].

    ``a_*``: the attention's DelayedScaling carrier and query / key / value / grad_output scales,
    ``l_*``: the projection's carrier and input / weight / grad_output scales (None under current
    scaling), as fp8_attention.Fp8AttentionFunction and linear.Fp8LinearFunction take them; ``bias``
    [N]: added in the projection GEMM's epilogue (``adds_bias``), else None."""

    @staticmethod
    def forward(ctx, spec: AttentionProjectionSpec, q, k, v, mask, a_carrier, a_q, a_k, a_v, a_do,
                w_nk, l_carrier, x_scale, w_scale, g_scale, bias=None, q8_bits=None, k8_bits=None, v8_bits=None,
                in_amaxes=None):
        att, recipe = spec.attention, spec.recipe
        scales = torch.cat([a_q, a_k, a_v]) if a_q is not None else None
        fp8_inputs = (q8_bits, k8_bits, v8_bits, in_amaxes) if in_amaxes is not None else None
        # no per-head FP8 copy of O: the projection's FP8 input stands in for it in the backward
        o, lse, q8, k8, v8, _, qd, kd, vd, _, amaxes = attention_forward(q, k, v, mask, att, scales, False,
                                                                        fp8_inputs)
        b, h, t, d = o.shape
        x = o.transpose(1, 2).reshape(b * t, h * d)
        # delayed scaling: both inverses in one op (None, None under current scaling)
        x_sinv, w_sinv = scale_invs(x_scale, w_scale)
        x_amax = tensor_amax(x, by_rows=x_scale is not None)   # delayed scaling: in the cast's pass
        xq, x_sinv, x_amax = quantize_per_tensor(x, "input", recipe, x_scale, x_amax, scale_inv=x_sinv)
        xq = xq.contiguous()
        y, wq, w_sinv, w_amax = fp8_fprop(xq, x_sinv, w_nk, recipe, w_scale, out_dtype=o.dtype, w_sinv=w_sinv,
                                          bias=bias)
        ctx.spec = spec
        ctx.dtypes = (o.dtype, w_nk.dtype)
        ctx.shape = (b, h, t, d)
        ctx.optional = (a_do is not None, g_scale is not None)
        ctx.save_for_backward(q8, k8, v8, qd, kd, vd, lse, mask, amaxes, xq, x_sinv, wq, w_sinv,
                              torch.cat([x_amax, w_amax]), *(s for s in (a_do, g_scale) if s is not None))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        spec = ctx.spec
        att = spec.attention
        q8, k8, v8, qd, kd, vd, lse, mask, amaxes, xq, x_sinv, wq, w_sinv, xw_amax, *optional = ctx.saved_tensors
        a_do = optional.pop(0) if ctx.optional[0] else None
        g_scale = optional.pop(0) if ctx.optional[1] else None
        o_dtype, w_dtype = ctx.dtypes
        b, h, t, d = ctx.shape
        dx, dw, g_amax = fp8_dgrad_wgrad(grad_y, spec.recipe, wq, w_sinv, x_sinv,
                                         (lambda: column_major(xq)) if ctx.needs_input_grad[10] else None,
                                         dx_dtype=o_dtype, dw_dtype=w_dtype, g_scale=g_scale)
        do = dx.reshape(b, t, h, d).transpose(1, 2).contiguous()
        # O for the attention backward: the projection's FP8 input seen as [B, H, T, D], one descale
        o8 = xq.view(b, t, h, d).transpose(1, 2)
        dq, dk, dv, do_amax = torch.ops.te_compile.fp8_attention_backward(
            do, q8, k8, v8, o8, qd, kd, vd, x_sinv.expand(b, h).contiguous(), lse, mask, att.sm_scale,
            att.causal, att.fp8_backward, att.grad_dtype, a_do)
        a_grad = torch.cat([amaxes, do_amax]) if ctx.needs_input_grad[5] else None
        l_grad = torch.cat([xw_amax, g_amax]) if ctx.needs_input_grad[11] else None
        db = grad_y.sum(0) if len(ctx.needs_input_grad) > 15 and ctx.needs_input_grad[15] else None
        return (None, dq, dk, dv, None, a_grad, None, None, None, None, dw, l_grad, None, None, None,
                db, None, None, None, None)


def _call_args(fp8_inputs: tuple) -> tuple:
    """The trailing arguments of an AttentionLowering call for split ``fp8_inputs``."""
    return (*fp8_inputs[:3], *fp8_inputs[3]) if fp8_inputs else ()


class AttentionProjectionLowering:
    """Callable inserted into the FX graph for an SDPA site and the projection reading it:
    ``(q, k, v, mask, *attention_delayed, weight, bias, *linear_delayed) -> y`` of the shape the
    projection gave ([B, T, N], or [B*T, N] when ``spec.flat``). The delayed tuples are 5 and 4
    tensors (or None) under DelayedScaling, empty otherwise; ``n_attention`` says which. An attention
    taking FP8 inputs (``spec.attention.fp8_inputs``) has them last, as AttentionLowering takes them.

    Under autocast it runs the two sites apart (the attention and the linear lowerings)."""

    def __init__(self, spec: AttentionProjectionSpec, attention: AttentionLowering, linear: LinearLowering,
                 n_attention: int) -> None:
        self.spec = spec
        self._attention, self._linear = attention, linear
        self._n = n_attention
        name_lowering(self, f"te_fp8_attention_projection_{spec.recipe.name}", __name__)

    def __call__(self, q, k, v, mask, *rest):
        rest, fp8_inputs = split_fp8_inputs(self.spec.attention, rest)
        a_delayed, (weight, bias, *l_delayed) = rest[:self._n], rest[self._n:]
        if autocast_dtype(q) is not None:
            o = self._attention(q, k, v, mask, *a_delayed, *_call_args(fp8_inputs))
            b, h, t, d = o.shape
            x = o.transpose(1, 2).reshape(b * t, h * d) if self.spec.flat else o.transpose(1, 2).reshape(b, t, h * d)
            return self._linear(x, weight, bias, *l_delayed)
        w_nk = weight.t() if self._linear.spec.weight_in_out else weight
        # the bias in the GEMM's epilogue where the plain linear would put it there, so that the
        # two sites apart and this one compute the same bits (o is in q's dtype)
        in_gemm, bias = split_bias(bias, q.dtype, w_nk.shape[0], self.spec.recipe.per_tensor)
        y = AttentionProjectionFunction.apply(self.spec, q, k, v, mask, *(a_delayed or (None,) * 5), w_nk,
                                              *(l_delayed or (None,) * 4), in_gemm, *fp8_inputs)
        if not self.spec.flat:
            y = y.reshape(q.shape[0], q.shape[2], y.shape[-1])
        return add_bias(y, bias)

    def __repr__(self) -> str:
        return (f"AttentionProjectionLowering({self.spec.attention.fqn!r} -> {self.spec.linear_fqn!r}, "
                f"{self.spec.recipe.name})")
