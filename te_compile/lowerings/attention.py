"""What a rewritten SDPA site calls: ``AttentionLowering(spec)(q, k, v, mask) -> o``.

Two opaque custom ops around kernels/fp8_attention.py, tied together by an autograd.Function, with
the quantization of Q, K, V traced in front of the forward op (``attention_forward``):

    q8, k8, v8 (E4M3) and their descales [B, H or Hkv] (fp32): quantize_heads, per (batch, head)
        with current scaling, per tensor with DelayedScaling's ``scales`` [3] (then also the amaxes)
    te_compile::fp8_attention_forward(q8, k8, v8, q/k/v descales, mask, sm_scale, causal, out_dtype,
                                      quantize_o)
        -> o (out_dtype), lse [B, H, Tq], contiguous copies of q8, k8, v8, o8 (E4M3), q/k/v/o
           descales; o8 and its descale empty without ``quantize_o`` (attention_projection.py keeps O
           in the projection's FP8 input instead)
    te_compile::fp8_attention_backward(dO, q8, k8, v8, o8, the four descales, lse, mask, sm_scale, causal,
                                       fp8_grads, grad_dtype, do_scale) -> dq, dk, dv (dO's dtype),
                                       dO's amax [1] (zeros without ``do_scale`` or ``fp8_grads``)

``scales`` (fp32 [3]) and ``do_scale`` ([1]) are DelayedScaling's: Q, K, V (and dO in the "fp8"
backward) are then quantized per tensor with the scales the state holds, and the amaxes the state
update needs go back as the site's carrier gradient (delayed_state.py). Without them every tensor is
current-scaled per (batch, head). Under fp8_mha the projections making Q, K, V may hand them over
already quantized (attention_inputs.py).

Why the attention is opaque (custom ops, not inlined torch): aot_autograd's partitioner picks what the
forward hands to the backward from the traced joint graph, and would be free to save the attention
matrix of the emulation, or high-precision tensors to recompute from. The backward reads only the
forward op's outputs that ``Fp8AttentionFunction`` saves: FP8 Q, K, V and O, their descales and the
logsumexp [B, H, Tq] (plus the mask, an input); the op returns its own copies of the FP8 inputs for
that, so that nothing in high precision is needed after it. Why the quantization is not: in the
traced graph inductor fuses each amax and cast with what produced q, k, v (a rotary embedding, a bias
add) instead of running them as separate eager passes over q, k, v inside the op.

On sm89+ GPUs the ops run the Triton kernels of kernels/fp8_attention.py (FP8 tensor cores, no
[Tq, Tk] buffer in either direction), elsewhere their pure-torch references: the CPU numerics are
the kernels' numerics. The quantization of dO in "fp8" mode is torch inside the backward op.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from ..autocast import autocast_dtype
from ..fx.cache_names import name_lowering
from ..kernels.fp8_attention import (
    E4M3,
    dequantize_heads,
    fp8_attention_backward,
    fp8_attention_backward_reference,
    fp8_attention_forward,
    quantize_heads,
)
from ..recipe import Format, Recipe

__all__ = ["AttentionSpec", "AttentionLowering", "Fp8AttentionFunction", "attention_grad_dtype", "attention_forward",
           "split_fp8_inputs"]


def attention_grad_dtype(recipe: Recipe) -> torch.dtype:
    """The format of dO and dS in the "fp8" backward: the recipe's gradient format (E5M2 under
    HYBRID, E4M3 under E4M3); recipes without one (CustomRecipe) use HYBRID's."""
    fmt = getattr(recipe, "fp8_format", Format.HYBRID)
    return fmt.dtype_for("grad_output")


@dataclass(frozen=True)
class AttentionSpec:
    """Everything about an SDPA site the lowering needs that is not a tensor."""

    fqn: str                        # the module whose forward calls SDPA
    recipe: Recipe
    sm_scale: float                 # SDPA's ``scale=``, else 1 / sqrt(head dim)
    causal: bool = False
    fp8_backward: bool = False      # recipe.fp8_dpa_backward == "fp8"
    delayed: bool = False           # DelayedScaling state: Q, K, V (and dO) per tensor
    # fp8_mha's input hand-off (attention_inputs.py): the call also takes FP8 Q, K, V (as uint8 bits)
    # and the amaxes [3] of this many projection outputs, quantized where the projections wrote them
    fp8_inputs: int = 0

    def scaling(self) -> str:
        """How Q, K, V (and dO) are scaled, for the report."""
        tensors = "Q, K, V, dO" if self.fp8_backward else "Q, K, V"
        if self.delayed:
            return f"{tensors} per tensor with delayed scaling"
        return f"{tensors} current-scaled per (batch, head)"

    @property
    def grad_dtype(self) -> torch.dtype:
        return attention_grad_dtype(self.recipe)

    def mode(self) -> str:
        """How the site runs, for the report."""
        if self.fp8_backward:
            return f"FP8 forward and backward (dO, dS in {_fmt(self.grad_dtype)})"
        return "FP8 forward, high-precision backward"


def _fmt(dtype: torch.dtype) -> str:
    return "E4M3" if dtype == E4M3 else "E5M2"


# ---------------------------------------------------------------------------------------------------
# the ops

def _empty_heads(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's (o8, o descale) when O is not quantized: empty E4M3 and fp32 tensors."""
    return q.new_empty(0, dtype=E4M3), q.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("te_compile::fp8_attention_forward", mutates_args=())
def _forward_op(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_descale: torch.Tensor,
                k_descale: torch.Tensor, v_descale: torch.Tensor, mask: Optional[torch.Tensor], sm_scale: float,
                causal: bool, out_dtype: torch.dtype, quantize_o: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    o, lse = fp8_attention_forward(q8, k8, v8, q_descale, k_descale, v_descale, sm_scale=sm_scale,
                                   causal=causal, mask=mask, out_dtype=out_dtype)
    # O is saved for the backward's D = rowsum(dO * O); in FP8 like Q, K, V. Without ``quantize_o``
    # (fp8_mha: the projection's FP8 input serves) o8 and its descale come back empty.
    o8, o_descale = quantize_heads(o) if quantize_o else _empty_heads(o)
    # what the backward reads, as outputs of this op (so that it is what autograd saves): contiguous
    # copies, never the inputs themselves (a custom op's output must not alias an input)
    q8, k8, v8, q_descale, k_descale, v_descale = (
        t.clone(memory_format=torch.contiguous_format) for t in (q8, k8, v8, q_descale, k_descale, v_descale))
    return o.contiguous(), lse.contiguous(), q8, k8, v8, o8.contiguous(), q_descale, k_descale, v_descale, o_descale


@_forward_op.register_fake
def _(q8, k8, v8, q_descale, k_descale, v_descale, mask, sm_scale, causal, out_dtype, quantize_o=True):
    b, h, tq, d = q8.shape
    o = q8.new_empty(q8.shape, dtype=out_dtype)
    o8, o_descale = (q8.new_empty(q8.shape), q_descale.new_empty(q_descale.shape)) if quantize_o else _empty_heads(o)
    return (o, q8.new_empty((b, h, tq), dtype=torch.float32), q8.new_empty(q8.shape), k8.new_empty(k8.shape),
            v8.new_empty(v8.shape), o8, q_descale.new_empty(q_descale.shape), k_descale.new_empty(k_descale.shape),
            v_descale.new_empty(v_descale.shape), o_descale)


def attention_forward(q, k, v, mask, spec: AttentionSpec, scales: Optional[torch.Tensor], quantize_o: bool,
                      fp8_inputs: Optional[tuple] = None) -> tuple:
    """(o, lse, q8, k8, v8, o8, q/k/v/o descales, amaxes [3]) of an attention call.

    Q, K, V are quantized here, in the traced graph (inductor fuses the amax and the cast with what
    made q, k, v): per (batch, head) with current scaling, per tensor with DelayedScaling's
    ``scales`` [3], whose amaxes it returns (zeros without). ``fp8_inputs`` (split_fp8_inputs): Q, K,
    V that the projections making them already quantized with ``scales`` (attention_inputs.py), as
    uint8 bits or None for one they did not, and the projections' amaxes [3] each."""
    per_tensor = (None, None, None) if scales is None else (scales[0:1], scales[1:2], scales[2:3])
    bits, handed_amaxes = (fp8_inputs[:3], list(fp8_inputs[3])) if fp8_inputs else ((None,) * 3, [])
    fp8, descales, amax = [], [], {}
    for role, (t, b, scale) in enumerate(zip((q, k, v), bits, per_tensor)):
        if b is None:
            t8, descale = quantize_heads(t.detach(), E4M3, scale)
            if scale is not None:
                amax[role] = t.detach().abs().amax().to(torch.float32)
        else:   # quantized by the projection with the role's scale
            t8 = b.view(E4M3)
            descale = torch.div(torch.ones_like(scale), scale).expand(t8.shape[:2]).contiguous()
        fp8.append(t8)
        descales.append(descale)
    if scales is None:
        amaxes = q.new_zeros(3, dtype=torch.float32)
    else:   # each role's amax comes from one place, the others give it 0
        zero = q.new_zeros((), dtype=torch.float32)
        parts = handed_amaxes + ([torch.stack([amax.get(r, zero) for r in range(3)])] if amax else [])
        amaxes = parts[0] if len(parts) == 1 else torch.stack(parts).amax(dim=0)
    outs = torch.ops.te_compile.fp8_attention_forward(*fp8, *descales, mask, spec.sm_scale, spec.causal, q.dtype,
                                                      quantize_o)
    return (*outs, amaxes)


@torch.library.custom_op("te_compile::fp8_attention_backward", mutates_args=())
def _backward_op(do: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, o8: torch.Tensor,
                 q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor,
                 o_descale: torch.Tensor, lse: torch.Tensor, mask: Optional[torch.Tensor], sm_scale: float,
                 causal: bool, fp8_grads: bool, grad_dtype: torch.dtype, do_scale: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    o = dequantize_heads(o8, o_descale)
    grads = fp8_attention_backward(do, q8, k8, v8, q_descale, k_descale, v_descale, o, lse,
                                   sm_scale=sm_scale, causal=causal, mask=mask, fp8_grads=fp8_grads,
                                   grad_dtype=grad_dtype, do_scale=do_scale)
    return _backward_outputs(do, grads, fp8_grads, do_scale)


def _backward_outputs(do, grads, fp8_grads: bool, do_scale) -> tuple:
    """The backward ops' (dq, dk, dv in dO's dtype, dO's amax [1]): the state's dO amax is used only by
    the "fp8" backward; the high-precision one leaves it at its start."""
    do_amax = (do.abs().amax().to(torch.float32).reshape(1) if fp8_grads and do_scale is not None
               else do.new_zeros(1, dtype=torch.float32))
    return (*(g.to(do.dtype).contiguous() for g in grads), do_amax)


@_backward_op.register_fake
def _(do, q8, k8, v8, o8, q_descale, k_descale, v_descale, o_descale, lse, mask, sm_scale, causal, fp8_grads,
      grad_dtype, do_scale=None):
    return (do.new_empty(q8.shape), do.new_empty(k8.shape), do.new_empty(v8.shape),
            do.new_empty(1, dtype=torch.float32))


@torch.library.custom_op("te_compile::fp8_attention_backward_bias", mutates_args=())
def _backward_bias_op(do: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, o8: torch.Tensor,
                      q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor,
                      o_descale: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor, sm_scale: float,
                      causal: bool, fp8_grads: bool, grad_dtype: torch.dtype, do_scale: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp8_attention_backward`` for a learned additive mask (T5's position bias): also dMask, dS
    [B, H, Tq, Tk] in fp32 summed over the dims the mask was broadcast along. It runs the torch
    reference (dS as large as the mask's broadcast, as the scores are), on GPUs too."""
    o = dequantize_heads(o8, o_descale)
    *grads, ds = fp8_attention_backward_reference(
        do, q8, k8, v8, q_descale, k_descale, v_descale, o, lse, sm_scale=sm_scale, causal=causal, mask=mask,
        fp8_grads=fp8_grads, grad_dtype=grad_dtype, do_scale=do_scale, return_ds=True)
    return (*_backward_outputs(do, grads, fp8_grads, do_scale), ds.sum_to_size(mask.shape).to(mask.dtype).contiguous())


@_backward_bias_op.register_fake
def _(do, q8, k8, v8, o8, q_descale, k_descale, v_descale, o_descale, lse, mask, sm_scale, causal, fp8_grads,
      grad_dtype, do_scale=None):
    return (do.new_empty(q8.shape), do.new_empty(k8.shape), do.new_empty(v8.shape),
            do.new_empty(1, dtype=torch.float32), mask.new_empty(mask.shape))


class Fp8AttentionFunction(torch.autograd.Function):
    """q [B, H, Tq, D], k and v [B, Hkv, Tk, D], mask (broadcastable to [B, H, Tq, Tk]; a float mask
    may require grad: a learned bias, whose gradient is dS summed to its shape) or None -> o
    [B, H, Tq, D] in q's dtype.

    Delayed scaling passes the query, key, value and grad_output scales (fp32 [1] each, read only)
    and, when a backward follows, ``carrier``: the backward returns this call's amaxes [q, k, v, dO]
    as the carrier's gradient (delayed_state.py). Current scaling passes None for all five."""

    @staticmethod
    def forward(ctx, q, k, v, mask, spec: AttentionSpec, carrier, q_scale, k_scale, v_scale, do_scale,
                q8_bits=None, k8_bits=None, v8_bits=None, in_amaxes=None):
        scales = torch.cat([q_scale, k_scale, v_scale]) if q_scale is not None else None
        fp8_inputs = (q8_bits, k8_bits, v8_bits, in_amaxes) if in_amaxes is not None else None
        o, lse, q8, k8, v8, o8, *descales, amaxes = attention_forward(q, k, v, mask, spec, scales, True, fp8_inputs)
        ctx.spec = spec
        ctx.delayed = do_scale is not None
        ctx.save_for_backward(q8, k8, v8, o8, *descales, lse, mask, amaxes,
                              *((do_scale,) if do_scale is not None else ()))
        return o

    @staticmethod
    def backward(ctx, do):
        q8, k8, v8, o8, qd, kd, vd, od, lse, mask, amaxes, *do_scale = ctx.saved_tensors
        spec = ctx.spec
        args = (do.contiguous(), q8, k8, v8, o8, qd, kd, vd, od, lse, mask, spec.sm_scale, spec.causal,
                spec.fp8_backward, spec.grad_dtype, do_scale[0] if do_scale else None)
        dmask = None
        if ctx.needs_input_grad[3]:   # a learned additive mask
            dq, dk, dv, do_amax, dmask = torch.ops.te_compile.fp8_attention_backward_bias(*args)
        else:
            dq, dk, dv, do_amax = torch.ops.te_compile.fp8_attention_backward(*args)
        carrier_grad = torch.cat([amaxes, do_amax]) if ctx.needs_input_grad[5] else None
        return dq, dk, dv, dmask, None, carrier_grad, None, None, None, None, None, None, None, None


def split_fp8_inputs(spec: AttentionSpec, rest: tuple) -> tuple[tuple, tuple]:
    """A call's trailing arguments, ``(*delayed, *fp8 inputs)``, as (delayed, (q8, k8, v8, amaxes)),
    or (rest, ()) for a site without ``spec.fp8_inputs``. q8, k8, v8: uint8 bits of E4M3, or None for
    a tensor no projection handed over; amaxes: one [3] per projection output handing some over
    (zero for the tensors it does not make)."""
    if not spec.fp8_inputs:
        return rest, ()
    n = 3 + spec.fp8_inputs
    delayed, (q8, k8, v8, *amaxes) = rest[:-n], rest[-n:]
    return delayed, (q8, k8, v8, amaxes)


class AttentionLowering:
    """Callable inserted into the FX graph for one SDPA site: ``(q, k, v, mask, *delayed) -> o``,
    SDPA's contract for the forms the pass accepts (no dropout; k, v with H or a divisor of H heads).
    ``delayed``: DelayedScaling's (carrier or None, query, key, value, grad_output scales), or nothing.
    With ``spec.fp8_inputs`` the call also takes ``q8, k8, v8`` (uint8 bits of E4M3, quantized with the
    query, key and value scales) and one amaxes [3] per projection output they come from; the forward
    then reads those and q, k, v only carry the gradient back (split_fp8_inputs).

    Under autocast q, k, v are cast to autocast's dtype first, as SDPA itself would run."""

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        name_lowering(self, f"te_fp8_attention_{spec.recipe.name}", __name__)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: Optional[torch.Tensor], *rest: Optional[torch.Tensor]) -> torch.Tensor:
        delayed, fp8_inputs = split_fp8_inputs(self.spec, rest)
        dtype = autocast_dtype(q)
        if dtype is not None:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        delayed = delayed or (None,) * 5
        with torch.autocast(q.device.type, enabled=False) if dtype is not None else contextlib.nullcontext():
            return Fp8AttentionFunction.apply(q, k, v, mask, self.spec, *delayed, *fp8_inputs)

    def __repr__(self) -> str:
        return f"AttentionLowering({self.spec.fqn!r}, {self.spec.recipe.name}, {self.spec.mode()})"

