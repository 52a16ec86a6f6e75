"""A norm and the FP8 linears that read its output, as one operation (TE's LayerNormLinear, for any
number of readers): ``NormLinearsLowering(spec)(x, norm_w, norm_b, shapes, consumers) -> ys``.

The norm output is quantized once (kernels/norm_quantize.py: one stats pass, one pass writing the
rowwise FP8 bytes for the forward GEMMs and the transposed bytes for wgrad) and every consumer's
forward GEMM reads the same bytes; the high-precision output exists only when something other than
the fused linears reads it (``spec.emit_hp``). Backward sums the consumers' dgrads in fp32 (plus the
gradient of the high-precision output) and runs the norm's backward on the sum. Saved for backward:
the norm input, mean and rstd [M] (fp32), the norm weight and the transposed FP8 operand; per
consumer what the per-tensor linear (lowerings/linear.py) saves for its weight.

Per-tensor recipes only (current and delayed scaling). The quantized operand is what te's unfused
path would quantize: the norm output, then the dtype casts between it and the linears
(``spec.norm.casts`` holds both). Under delayed scaling every consumer keeps its own state; the shared
operand is quantized with the first consumer's input scale and every consumer's input history records
the operand's amax, so all of them stay equal to the first one (they would be equal unfused too: the
consumers read the same tensor), and recipe_state_dict keeps the same keys whether or not a norm is
fused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from ..autocast import autocast_dtype
from ..fx.cache_names import name_lowering
from ..gemm.per_tensor import add_bias, fp8_dgrad_wgrad, fp8_fprop, split_bias
from ..kernels.norm_quantize import norm_backward, norm_forward_reference, norm_quantize, norm_stats
from ..norm_spec import NormSpec
from ..recipe import Recipe
from ..scaling import current_scale, scale_invs

__all__ = ["NormLinearsSpec", "NormLinearsLowering", "NormFp8LinearsFunction"]

_PER_CONSUMER = 6   # w, carrier, x_scale, w_scale, g_scale, bias


@dataclass(frozen=True)
class NormLinearsSpec:
    """A fused norm site: the norm, its readers' recipe, and the readers (in graph order)."""

    fqn: str                           # the norm module
    norm: NormSpec                     # the norm, with its own output casts
    recipe: Recipe                     # DelayedScaling or Float8CurrentScaling, the same for every reader
    consumers: tuple[str, ...]         # the linears' module paths
    weight_in_out: tuple[bool, ...]    # per consumer: the weight is [in, out] (HF Conv1D)
    in_casts: tuple[torch.dtype, ...] = ()   # casts between the norm output and the linears
    emit_hp: bool = False              # also return the high-precision norm output

    @property
    def quantized(self) -> NormSpec:
        """The norm whose output is the linears' input: its own casts, then theirs."""
        return replace(self.norm, casts=self.norm.casts + self.in_casts)


class NormFp8LinearsFunction(torch.autograd.Function):
    """x2d [M, K] -> (y_i [M, N_i] for each consumer, then the norm output [M, K] if spec.emit_hp).

    ``flat``: per consumer ``_PER_CONSUMER`` entries: weight [N_i, K] (already [out, in]), then
    delayed scaling's carrier and input / weight / grad_output scales (None under current scaling;
    see linear.py's Fp8LinearFunction, whose GEMMs and numerics these are), then the bias [N_i] the
    forward GEMM's epilogue adds (``adds_bias``; None where the lowering adds it after).
    """

    @staticmethod
    def forward(ctx, spec: NormLinearsSpec, x2d, norm_w, norm_b, *flat):
        recipe, qspec = spec.recipe, spec.quantized
        in_dtype = qspec.out_dtype
        fp8 = recipe.fp8_format.dtype_for("input")
        mean, rstd, x_amax = norm_stats(x2d, norm_w, norm_b, qspec)
        x_scale = flat[2]
        consumers = [flat[_PER_CONSUMER * i:_PER_CONSUMER * (i + 1)] for i in range(len(spec.consumers))]
        # delayed scaling: the input's and every weight's inverse in one op
        x_sinv, *w_sinvs = scale_invs(x_scale, *(c[3] for c in consumers))
        if x_scale is None:
            x_scale = current_scale(x_amax, "input", recipe)
            x_sinv = torch.div(torch.ones_like(x_scale), x_scale)
        xq, xq_t = norm_quantize(x2d, norm_w, norm_b, mean, rstd, x_scale, qspec, fp8)
        outputs, saved_w, g_scales = [], [], []
        for (w_nk, _, _, w_scale, g_scale, bias), w_sinv in zip(consumers, w_sinvs):
            y, wq, w_sinv, w_amax = fp8_fprop(xq, x_sinv, w_nk, recipe, w_scale, out_dtype=in_dtype, w_sinv=w_sinv,
                                              bias=bias)
            outputs.append(y)
            saved_w += [wq, w_sinv, w_amax]
            g_scales.append(g_scale)
        if spec.emit_hp:
            # the high-precision output for other readers: plain torch, which inductor fuses
            outputs.append(norm_forward_reference(x2d, norm_w, norm_b, spec.norm)[0])
        ctx.spec = spec
        ctx.dtypes = [flat[_PER_CONSUMER * i].dtype for i in range(len(spec.consumers))]
        ctx.has_g_scale = g_scales[0] is not None
        ctx.has_norm = (norm_w is not None, norm_b is not None)
        ctx.save_for_backward(x2d, norm_w, mean, rstd, xq_t, x_sinv, x_amax, *saved_w,
                              *(g_scales if ctx.has_g_scale else ()))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        spec = ctx.spec
        n = len(spec.consumers)
        x2d, norm_w, mean, rstd, xq_t, x_sinv, x_amax, *rest = ctx.saved_tensors
        saved_w, g_scales = rest[:3 * n], rest[3 * n:]
        need = ctx.needs_input_grad
        dh = grads[n].float() if spec.emit_hp else None
        flat_grads = []
        for i in range(n):
            wq, w_sinv, w_amax = saved_w[3 * i:3 * i + 3]
            g_scale = g_scales[i] if ctx.has_g_scale else None
            base = 4 + _PER_CONSUMER * i
            # dgrads in fp32, summed once: the consumers' contributions to the norm output's gradient;
            # wgrad reads the norm's transposed FP8 copy
            dgrad, dw, g_amax = fp8_dgrad_wgrad(grads[i], spec.recipe, wq, w_sinv, x_sinv,
                                                (lambda: xq_t.t()) if need[base] else None,
                                                dx_dtype=torch.float32, dw_dtype=ctx.dtypes[i], g_scale=g_scale)
            dh = dgrad if dh is None else dh + dgrad
            carrier_grad = torch.cat([x_amax, w_amax, g_amax]) if need[base + 1] else None
            db = grads[i].sum(0) if need[base + 5] else None
            flat_grads += [dw, carrier_grad, None, None, None, db]
        dx, dnw, dnb = norm_backward(dh, x2d, norm_w, mean, rstd, spec.norm)
        has_w, has_b = ctx.has_norm
        return (None, dx if need[1] else None, dnw if has_w and need[2] else None,
                dnb if has_b and need[3] else None, *flat_grads)


class NormLinearsLowering:
    """Callable inserted into the FX graph for a fused norm site.

    ``(x, norm_w, norm_b, shapes, consumers) -> tuple``: x [..., K] the norm input; shapes: per
    consumer a tensor whose shape is that consumer's input shape (a view of x, cheap to pass: the
    outputs are reshaped to ``shape[:-1] + [N_i]``); consumers: per consumer (weight, bias or None,
    then DelayedScaling's carrier, input, weight and grad_output scales, or nothing). Returns each
    consumer's output, then the norm output when ``spec.emit_hp``.

    Under autocast (which changes what the norm and the linears compute in) the operation runs
    unfused: the norm, then each linear quantizing its own input.
    """

    def __init__(self, spec: NormLinearsSpec, linears: Sequence) -> None:
        self.spec = spec
        self._linears = tuple(linears)   # the consumers' LinearLowering, for the unfused autocast path
        name_lowering(self, f"te_norm_linears_{spec.norm.kind}_{spec.recipe.name}", __name__)

    def __call__(self, x: torch.Tensor, norm_w: Optional[torch.Tensor], norm_b: Optional[torch.Tensor],
                 shapes: Sequence[torch.Tensor], consumers: Sequence[Sequence]) -> tuple:
        if autocast_dtype(x) is not None:
            return self._unfused(x, norm_w, norm_b, shapes, consumers)
        spec = self.spec
        x2d = x.reshape(-1, x.shape[-1])
        flat, after = [], []   # after: the biases the GEMMs' epilogues do not take (``split_bias``)
        for (w, bias, *delayed), in_out in zip(consumers, spec.weight_in_out):
            w_nk = w.t() if in_out else w
            in_gemm, rest = split_bias(bias, spec.quantized.out_dtype, w_nk.shape[0])
            flat += [w_nk, *(delayed or (None,) * 4), in_gemm]
            after.append(rest)
        outs = NormFp8LinearsFunction.apply(spec, x2d, norm_w, norm_b, *flat)
        ys = [add_bias(y.reshape(*shape.shape[:-1], y.shape[-1]), bias)
              for y, shape, bias in zip(outs, shapes, after)]
        if spec.emit_hp:
            ys.append(outs[-1].reshape(x.shape))
        return tuple(ys)

    def _unfused(self, x, norm_w, norm_b, shapes, consumers) -> tuple:
        spec = self.spec
        # the reference is plain differentiable torch
        h = norm_forward_reference(x.reshape(-1, x.shape[-1]), norm_w, norm_b, spec.norm)[0].reshape(x.shape)
        v = h
        for dtype in spec.in_casts:
            v = v.to(dtype)
        ys = [linear(v.reshape(shape.shape), w, bias, *delayed)
              for linear, shape, (w, bias, *delayed) in zip(self._linears, shapes, consumers)]
        return (*ys, h) if spec.emit_hp else tuple(ys)

    def __repr__(self) -> str:
        return f"NormLinearsLowering({self.spec.fqn!r} -> {', '.join(self.spec.consumers)}, {self.spec.recipe.name})"
