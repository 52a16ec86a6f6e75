"""FP8 attention over a sequence split across ranks (context parallel), K and V exchanged in FP8.

Each rank of the context-parallel group holds rows of Q, K, V [B, H, t, D] and their global
positions [t] (torch's load-balanced causal split gives rank r the chunks r and 2R-1-r of 2R, so that
causal work is even). Forward:

1. the amaxes of Q, K and V per (batch, head) are all-reduced (MAX) over the group, so every rank
   scales as one process scaling the whole sequence would and its FP8 bytes are that process's (O,
   saved in FP8 for the backward, likewise);
2. K and V are all-gathered as FP8 bytes (1 byte per element, half of bf16's), with the positions;
3. te's FP8 attention runs the local queries against every key, masked by position (causal: a key
   at or before the query).

Backward: dQ stays local; dK and dV, computed for every key, are reduce-scattered (summed) back to the
ranks that hold those keys. One all-gather forward and one reduce-scatter backward per tensor: the
simplest exchange to schedule, at T/R x T scores per rank; a ring that overlaps the exchange with the
blocks' compute is the long-sequence GPU refinement (not built).

``ContextParallelAttention.apply(q, k, v, positions, group, causal, sm_scale, grad_dtype=None, *delayed)``
with ``group`` an AmaxGroup (te_compile.distributed) of the context-parallel ranks. Per-(batch, head)
current scaling, or DelayedScaling's per-tensor scales (``delayed``: the class docstring), either
backward: ``grad_dtype`` (the recipe's gradient format) selects the "fp8" one, whose dO scale (under
current scaling) and dS bound per (batch, head) come from the whole sequence's dO (one more MAX
all-reduce), so its bytes too are one process's.
``[distributed] context_parallel`` routes every SDPA site of a graph here (passes/attention.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from ..autocast import autocast_dtype
from ..context_parallel import load_balanced_positions
from ..distributed import AmaxGroup, all_reduce
from ..fx.cache_names import name_lowering
from ..kernels.fp8_attention import (E4M3, dequantize_heads, fp8_attention_backward, fp8_attention_forward,
                                     quantize_heads)
from ..scaling import cast_to_fp8, compute_scale

__all__ = ["ContextParallelAttention", "ContextParallelLowering", "ContextParallelSpec"]


def _gather_seq(x: torch.Tensor, group: AmaxGroup) -> torch.Tensor:
    """[..., t, D] on each rank -> [..., R * t, D], the ranks' rows in rank order (dim -2)."""
    moved = x.movedim(-2, 0).contiguous()
    out = torch.ops._c10d_functional.all_gather_into_tensor.default(moved, group.size, group.name)
    return torch.ops._c10d_functional.wait_tensor.default(out).movedim(0, -2)


def _reduce_scatter_seq(x: torch.Tensor, group: AmaxGroup) -> torch.Tensor:
    """[..., R * t, D] on each rank -> this rank's [..., t, D] of the sum over ranks."""
    moved = x.movedim(-2, 0).contiguous()
    out = torch.ops._c10d_functional.reduce_scatter_tensor.default(moved, "sum", group.size, group.name)
    return torch.ops._c10d_functional.wait_tensor.default(out).movedim(0, -2)


class ContextParallelAttention(torch.autograd.Function):
    """q [B, H, t, D], k and v [B, Hkv, t, D]: this rank's rows at ``positions`` [t] -> o [B, H, t, D].

    DelayedScaling passes ``carrier`` and the query, key, value and grad_output scales (fp32 [1] each,
    read only), as Fp8AttentionFunction takes them: Q, K, V (and dO in the "fp8" backward) are then
    quantized per tensor with those, no amax is all-reduced for them, and the backward returns this
    rank's amaxes [q, k, v, dO] as the carrier's gradient (the graph's update reduces them over the
    context-parallel group with the others). dS keeps its bound from the whole sequence's dO."""

    @staticmethod
    def forward(ctx, q, k, v, positions, group: AmaxGroup, causal: bool, sm_scale: float,
                grad_dtype: Optional[torch.dtype] = None, carrier=None, q_scale=None, k_scale=None, v_scale=None,
                do_scale=None):
        if q_scale is None:
            amaxes = [t.detach().abs().amax(dim=(-2, -1)).to(torch.float32) for t in (q, k, v)]   # [B, H(kv)]
            flat = all_reduce(torch.cat([a.reshape(-1) for a in amaxes]), "max", group)   # one collective
            scales = [part.reshape(a.shape) for part, a in zip(flat.split([a.numel() for a in amaxes]), amaxes)]
            scales = [compute_scale(s, E4M3) for s in scales]
            q8, k8, v8 = (cast_to_fp8(t, s[..., None, None], E4M3) for t, s in zip((q, k, v), scales))
            descales = [torch.div(torch.ones_like(s), s) for s in scales]
            local_amaxes = q.new_zeros(3, dtype=torch.float32)
        else:   # per tensor, the state's scales
            (q8, qd), (k8, kd), (v8, vd) = (quantize_heads(t.detach(), E4M3, s)
                                            for t, s in zip((q, k, v), (q_scale, k_scale, v_scale)))
            descales = [qd, kd, vd]
            local_amaxes = torch.stack([t.detach().abs().amax().to(torch.float32) for t in (q, k, v)])
        # the exchange: FP8 bytes and the positions they sit at
        k8_all = _gather_seq(k8.view(torch.uint8), group).view(E4M3)
        v8_all = _gather_seq(v8.view(torch.uint8), group).view(E4M3)
        key_positions = _gather_seq(positions.reshape(-1, 1), group).reshape(-1)
        mask = (key_positions[None, :] <= positions[:, None]) if causal else None   # [t, R * t]
        o, lse = fp8_attention_forward(q8, k8_all, v8_all, *descales, sm_scale=sm_scale, mask=mask,
                                       out_dtype=q.dtype)
        # saved in FP8 as the one-process op saves it, with the whole sequence's per-head scale
        o_amax = all_reduce(o.detach().abs().amax(dim=(-2, -1)).to(torch.float32), "max", group)
        o_scale = compute_scale(o_amax, E4M3)
        o8, o_descale = cast_to_fp8(o, o_scale[..., None, None], E4M3), torch.div(torch.ones_like(o_scale), o_scale)
        ctx.save_for_backward(q8, k8_all, v8_all, *descales, o8, o_descale, lse, local_amaxes,
                              *((do_scale,) if do_scale is not None else ()), *((mask,) if mask is not None else ()))
        ctx.group, ctx.sm_scale, ctx.grad_dtype = group, sm_scale, grad_dtype
        ctx.delayed = do_scale is not None
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return o

    @staticmethod
    def backward(ctx, do):
        q8, k8_all, v8_all, qd, kd, vd, o8, o_descale, lse, local_amaxes, *rest = ctx.saved_tensors
        do_scale, mask = (rest[0], rest[1:]) if ctx.delayed else (None, rest)
        grad_scales = None
        do_amax = do.new_zeros(1, dtype=torch.float32)
        if ctx.grad_dtype is not None:   # the "fp8" backward: dO's scales from the whole sequence's dO
            do32 = do.to(torch.float32)
            stats = all_reduce(torch.stack([do32.abs().amax(dim=(-2, -1)), do32.norm(dim=-1).amax(dim=-1)]),
                               "max", ctx.group)                                   # [2, B, H]
            group_size = q8.shape[1] // k8_all.shape[1]
            v_rows = dequantize_heads(v8_all, vd).norm(dim=-1).amax(dim=-1).repeat_interleave(group_size, dim=1)
            do_scales = compute_scale(stats[0], ctx.grad_dtype)
            if do_scale is not None:   # delayed scaling: dO per tensor with the state's scale
                do_scales = do_scale.expand(stats[0].shape).contiguous()
                do_amax = do32.abs().amax().reshape(1)
            grad_scales = (do_scales, compute_scale(2 * stats[1] * v_rows, ctx.grad_dtype))
        dq, dk_all, dv_all = fp8_attention_backward(
            do.contiguous(), q8, k8_all, v8_all, qd, kd, vd, dequantize_heads(o8, o_descale), lse,
            sm_scale=ctx.sm_scale, mask=mask[0] if mask else None, fp8_grads=grad_scales is not None,
            grad_dtype=ctx.grad_dtype or torch.float8_e5m2, grad_scales=grad_scales)
        dk = _reduce_scatter_seq(dk_all, ctx.group)
        dv = _reduce_scatter_seq(dv_all, ctx.group)
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        grads = [dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype)] + [None] * (len(ctx.needs_input_grad) - 3)
        if ctx.delayed and ctx.needs_input_grad[8]:   # the carrier
            grads[8] = torch.cat([local_amaxes, do_amax])
        return tuple(grads)


@dataclass(frozen=True)
class ContextParallelSpec:
    """An SDPA site under ``[distributed] context_parallel``: what its lowering needs besides tensors."""

    fqn: str
    sm_scale: float
    causal: bool
    grad_dtype: Optional[torch.dtype]   # the "fp8" backward's gradient format; None: high precision
    group: AmaxGroup    # the context-parallel mesh dim's ranks
    rank: int           # this rank's index along it
    delayed: bool = False   # DelayedScaling state: Q, K, V (and dO) per tensor with its scales


class ContextParallelLowering:
    """Callable inserted into the FX graph for an SDPA site under context parallelism: ``(q, k, v,
    *delayed) -> o`` with q [B, H, t, D] and k, v [B, Hkv, t, D] this rank's load-balanced rows of a
    sequence of t * R tokens; ``delayed``: DelayedScaling's (carrier or None, query, key, value,
    grad_output scales), or nothing. Under autocast q, k, v are cast to autocast's dtype first, as SDPA
    would run."""

    def __init__(self, spec: ContextParallelSpec) -> None:
        self.spec = spec
        name_lowering(self, "te_fp8_attention_context_parallel", __name__)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *delayed) -> torch.Tensor:
        spec = self.spec
        dtype = autocast_dtype(q)
        if dtype is not None:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        positions = load_balanced_positions(q.shape[-2] * spec.group.size, spec.rank, spec.group.size).to(q.device)
        with torch.autocast(q.device.type, enabled=False) if dtype is not None else contextlib.nullcontext():
            return ContextParallelAttention.apply(q, k, v, positions, spec.group, spec.causal, spec.sm_scale,
                                                  spec.grad_dtype, *delayed)

    def __repr__(self) -> str:
        return f"ContextParallelLowering({self.spec.fqn!r}, {self.spec.group})"
