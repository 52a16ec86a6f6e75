"""What a rewritten SDPA site calls: ``AttentionLowering(spec)(q, k, v, mask) -> o``.

Two opaque custom ops around kernels/fp8_attention.py, tied together by an autograd.Function:

    te_compile::fp8_attention_forward(q, k, v, mask, sm_scale, causal, scales, quantize_o)
        -> o (q's dtype), lse [B, H, Tq], q8, k8, v8, o8 (E4M3), q/k/v/o descales [B, H or Hkv] (fp32),
           amaxes [3] (q, k, v; zeros without ``scales``); o8 and its descale empty without
           ``quantize_o`` (attention_projection.py keeps O in the projection's FP8 input instead)
    te_compile::fp8_attention_backward(dO, q8, k8, v8, o8, the four descales, lse, mask, sm_scale, causal,
                                       fp8_grads, grad_dtype, do_scale) -> dq, dk, dv (dO's dtype),
                                       dO's amax [1] (zeros without ``do_scale`` or ``fp8_grads``)

``scales`` (fp32 [3]) and ``do_scale`` ([1]) are DelayedScaling's: Q, K, V (and dO in the "fp8"
backward) are then quantized per tensor with the scales the state holds, and the ops return the
amaxes the state update needs (delayed_update.py; the site's carrier gets them as its gradient).
Without them every tensor is current-scaled per (batch, head).

Why opaque (custom ops, not inlined torch as the linears' quantization is): aot_autograd's
partitioner picks what the forward hands to the backward from the traced joint graph, and would be
free to save the high-precision q, k, v and recompute their quantization, or to save the attention
matrix of the emulation. Behind the ops, the only values the backward can read are the forward op's
outputs that ``Fp8AttentionFunction`` saves: FP8 Q, K, V and O, their descales and the logsumexp
[B, H, Tq] (plus the mask, an input). The quantization of Q, K, V runs inside the forward op, so
nothing in high precision outlives it.

On sm89+ GPUs the ops run the Triton kernels of kernels/fp8_attention.py (FP8 tensor cores, no
[Tq, Tk] buffer in either direction), elsewhere their pure-torch references: the CPU numerics are
the kernels' numerics. The quantization of Q, K, V (and dO in "fp8" mode) is torch around the kernels.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels.fp8_attention import (
    E4M3,
    dequantize_heads,
    fp8_attention_backward,
    fp8_attention_forward,
    quantize_heads,
)
from ..recipe import Format, Recipe
from .linear import _autocast_dtype

__all__ = ["AttentionSpec", "AttentionLowering", "Fp8AttentionFunction", "attention_grad_dtype"]


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

def _amaxes(*tensors: torch.Tensor) -> torch.Tensor:
    """fp32 [len(tensors)]: each tensor's amax."""
    return torch.stack([t.abs().amax().to(torch.float32) for t in tensors])


@torch.library.custom_op("te_compile::fp8_attention_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                sm_scale: float, causal: bool, scales: Optional[torch.Tensor] = None, quantize_o: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    per_tensor = (None, None, None) if scales is None else (scales[0:1], scales[1:2], scales[2:3])
    q8, q_descale = quantize_heads(q, E4M3, per_tensor[0])
    k8, k_descale = quantize_heads(k, E4M3, per_tensor[1])
    v8, v_descale = quantize_heads(v, E4M3, per_tensor[2])
    amaxes = _amaxes(q, k, v) if scales is not None else q.new_zeros(3, dtype=torch.float32)
    o, lse = fp8_attention_forward(q8, k8, v8, q_descale, k_descale, v_descale, sm_scale=sm_scale,
                                   causal=causal, mask=mask, out_dtype=q.dtype)
    # O is saved for the backward's D = rowsum(dO * O); in FP8 like Q, K, V. Without ``quantize_o``
    # (fp8_mha: the projection's FP8 input serves) o8 and its descale come back empty.
    o8, o_descale = quantize_heads(o) if quantize_o else _empty_heads(q)
    # contiguous, as the fake outputs are: q, k, v often arrive as transposed views ([B, T, H, D] data)
    # and the casts keep their strides
    return (o.contiguous(), lse.contiguous(), q8.contiguous(), k8.contiguous(), v8.contiguous(), o8.contiguous(),
            q_descale, k_descale, v_descale, o_descale, amaxes)


@_forward_op.register_fake
def _(q, k, v, mask, sm_scale, causal, scales=None, quantize_o=True):
    b, h, tq, d = q.shape
    hkv = k.shape[1]
    heads = q.new_empty((b, h), dtype=torch.float32)
    kv_heads = q.new_empty((b, hkv), dtype=torch.float32)
    o8, o_descale = (q.new_empty(q.shape, dtype=E4M3), heads.clone()) if quantize_o else _empty_heads(q)
    return (q.new_empty(q.shape), q.new_empty((b, h, tq), dtype=torch.float32),
            q.new_empty(q.shape, dtype=E4M3), k.new_empty(k.shape, dtype=E4M3), v.new_empty(v.shape, dtype=E4M3),
            o8, heads, kv_heads, kv_heads.clone(), o_descale, q.new_empty(3, dtype=torch.float32))


def _empty_heads(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's (o8, o descale) when O is not quantized: empty E4M3 and fp32 tensors."""
    return q.new_empty(0, dtype=E4M3), q.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("te_compile::fp8_attention_backward", mutates_args=())
def _backward_op(do: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, o8: torch.Tensor,
                 q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor,
                 o_descale: torch.Tensor, lse: torch.Tensor, mask: Optional[torch.Tensor], sm_scale: float,
                 causal: bool, fp8_grads: bool, grad_dtype: torch.dtype, do_scale: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    o = dequantize_heads(o8, o_descale)
    dq, dk, dv = fp8_attention_backward(do, q8, k8, v8, q_descale, k_descale, v_descale, o, lse,
                                        sm_scale=sm_scale, causal=causal, mask=mask, fp8_grads=fp8_grads,
                                        grad_dtype=grad_dtype, do_scale=do_scale)
    # dO's state is used only by the "fp8" backward; the high-precision one leaves it at its start
    do_amax = _amaxes(do) if fp8_grads and do_scale is not None else do.new_zeros(1, dtype=torch.float32)
    return dq.to(do.dtype).contiguous(), dk.to(do.dtype).contiguous(), dv.to(do.dtype).contiguous(), do_amax


@_backward_op.register_fake
def _(do, q8, k8, v8, o8, q_descale, k_descale, v_descale, o_descale, lse, mask, sm_scale, causal, fp8_grads,
      grad_dtype, do_scale=None):
    return (do.new_empty(q8.shape), do.new_empty(k8.shape), do.new_empty(v8.shape),
            do.new_empty(1, dtype=torch.float32))


class Fp8AttentionFunction(torch.autograd.Function):
    """q [B, H, Tq, D], k and v [B, Hkv, Tk, D], mask (broadcastable to [B, H, Tq, Tk], no grad) or
    None -> o [B, H, Tq, D] in q's dtype.

    Delayed scaling passes the query, key, value and grad_output scales (fp32 [1] each, read only)
    and, when a backward follows, ``carrier``: the backward returns this call's amaxes [q, k, v, dO]
    as the carrier's gradient (delayed_update.py). Current scaling passes None for all five."""

    @staticmethod
    def forward(ctx, q, k, v, mask, spec: AttentionSpec, carrier, q_scale, k_scale, v_scale, do_scale):
        scales = torch.cat([q_scale, k_scale, v_scale]) if q_scale is not None else None
        o, lse, q8, k8, v8, o8, *descales, amaxes = torch.ops.te_compile.fp8_attention_forward(
            q, k, v, mask, spec.sm_scale, spec.causal, scales)
        ctx.spec = spec
        ctx.delayed = do_scale is not None
        ctx.save_for_backward(q8, k8, v8, o8, *descales, lse, mask, amaxes,
                              *((do_scale,) if do_scale is not None else ()))
        return o

    @staticmethod
    def backward(ctx, do):
        q8, k8, v8, o8, qd, kd, vd, od, lse, mask, amaxes, *do_scale = ctx.saved_tensors
        spec = ctx.spec
        dq, dk, dv, do_amax = torch.ops.te_compile.fp8_attention_backward(
            do.contiguous(), q8, k8, v8, o8, qd, kd, vd, od, lse, mask, spec.sm_scale, spec.causal,
            spec.fp8_backward, spec.grad_dtype, do_scale[0] if do_scale else None)
        carrier_grad = torch.cat([amaxes, do_amax]) if ctx.needs_input_grad[5] else None
        return dq, dk, dv, None, None, carrier_grad, None, None, None, None


class AttentionLowering:
    """Callable inserted into the FX graph for one SDPA site: ``(q, k, v, mask, *delayed) -> o``,
    SDPA's contract for the forms the pass accepts (no dropout; k, v with H or a divisor of H heads).
    ``delayed``: DelayedScaling's (carrier or None, query, key, value, grad_output scales), or nothing.

    Under autocast q, k, v are cast to autocast's dtype first, as SDPA itself would run."""

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self.__name__ = f"te_fp8_attention_{spec.recipe.name}"
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: Optional[torch.Tensor], *delayed: Optional[torch.Tensor]) -> torch.Tensor:
        dtype = _autocast_dtype(q)
        if dtype is not None:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        delayed = delayed or (None,) * 5
        with torch.autocast(q.device.type, enabled=False) if dtype is not None else contextlib.nullcontext():
            return Fp8AttentionFunction.apply(q, k, v, mask, self.spec, *delayed)

    def __repr__(self) -> str:
        return f"AttentionLowering({self.spec.fqn!r}, {self.spec.recipe.name}, {self.spec.mode()})"

