"""Linears that read cached FP8 weights: a linear site's weight operand becomes an extra graph input.

Inference. A graph Dynamo compiles with grad disabled (``torch.no_grad()``,
``torch.inference_mode()``: Dynamo guards on the grad mode, so training calls get their own graph)
serves calls that do not move the weights. For each FP8 linear site on a per-tensor recipe whose
weight is a parameter the graph receives, the weight argument of its lowering becomes a placeholder
fed, at every call, with ``te_compile.weight_cache.cached_fp8_weight(parameter)``: a ``Float8Tensor``
quantized the first time and again only when the parameter changes. The lowering then takes its bytes
as they are, as it does for FSDP2's FP8 all-gather, and the graph never reads the high-precision
weight. One input per parameter and recipe, shared by every site that reads it (a tied or reused
weight).

A weight stored [K, N] and read as ``x @ W`` (GPT-2's Conv1D) is cached transposed, [N, K], and its
site's lowering then reads it as an [N, K] weight. Under autocast (entered before the call) the copy
is made from the weight cast to autocast's dtype, as the linear casts it. Left out: graphs that enter
an autocast region themselves, weights on the left (``W @ x``), per-expert loops, DTensor and already
quantized weights, block-scaled recipes, sites whose amax is reduced across ranks.

Training, under ``cache_fp8_weights = true``: the same input, fed with
``te_compile.weight_cache.linked_fp8_weight(parameter)``, the cached copy linked to the parameter by
autograd, so that micro-batches of gradient accumulation between two optimizer steps quantize each
weight once. Left out besides the above: DelayedScaling sites, whose weight scale the graph itself
keeps and may move at every micro-batch (its amax history takes the weight's amax each time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..recipe import Recipe
from ..weight_cache import cached_fp8_weight, linked_fp8_weight
from ..fx.graphs import GraphScope
from ..fx.gemm_operands import LinearSite
from .context import PassContext

__all__ = ["CachedWeightInput", "cached_weight"]


@dataclass(frozen=True)
class CachedWeightInput:
    """The cached FP8 copy of the parameter at Dynamo input ``weight_index``, looked up per call
    (``linked``: a training graph's, linked to the parameter by autograd)."""

    weight_index: int
    recipe: Recipe
    where: str
    transposed: bool = False   # the parameter is stored [K, N] (read as x @ W): the copy is [N, K]
    dtype: Optional[torch.dtype] = None   # autocast's dtype at compile: the weight is cast to it first
    linked: bool = False

    def tensors(self, args: Sequence) -> list[torch.Tensor]:
        fetch = linked_fp8_weight if self.linked else cached_fp8_weight
        return [fetch(args[self.weight_index], self.recipe, self.where, self.transposed, self.dtype)]


def _autocast_inside(scope: GraphScope) -> bool:
    """Does the graph enter an autocast region itself (``_enter_autocast`` nodes, or the HOP that wraps
    one)? Its dtype at a site is not worked out here: every site of such a graph quantizes its
    weight at every call, as in training."""
    while scope is not None:
        if any(getattr(n.target, "__name__", "") == "_enter_autocast" or "autocast" in str(n.target)
               for n in scope.graph.nodes if n.op == "call_function"):
            return True
        scope = scope.parent
    return False


def _caches_weights(ctx: PassContext, recipe: Recipe) -> bool:
    """Do the sites of this graph under ``recipe`` read cached weights: an inference graph's, or a
    training graph's under ``cache_fp8_weights`` without DelayedScaling's state?"""
    if not recipe.per_tensor:
        return False
    return ctx.inference or (ctx.config.cache_fp8_weights and not recipe.delayed())


def cached_weight(ctx: PassContext, scope: GraphScope, site: LinearSite, recipe: Recipe) -> Optional[fx.Node]:
    """The node of ``scope`` carrying the cached FP8 copy of ``site``'s weight, always [N, K] (the
    lowering then reads it as stored [N, K]), or None when the graph caches no weights or the site
    does not qualify (module docstring)."""
    if not _caches_weights(ctx, recipe) or site.param is None:
        return None
    if site.weight_first or site.expert is not None or _autocast_inside(scope):
        return None
    value = site.param.value
    # DTensor and quantized weights are wrapper subclasses; DDPOptimizer's split graphs see fake parameters
    if is_traceable_wrapper_subclass(value) or not value.is_floating_point() or value.dim() != 2:
        return None
    ref = scope.params.get(site.weight)
    if ref is None or ref.index != site.param.index:
        return None   # the site reads a view or a copy of the parameter, not the parameter itself
    device = value.device.type
    dtype = (torch.get_autocast_dtype(device) if device in ("cpu", "cuda") and torch.is_autocast_enabled(device)
             else None)   # Dynamo guards on the autocast state: it holds at every call of this graph
    key = (site.param.index, recipe, site.weight_in_out, dtype)
    node = ctx.cached_weights.get(key)
    if node is None:
        where = f"{site.fqn or '<root>'} ({'inference' if ctx.inference else 'training'} weight cache)"
        source = CachedWeightInput(site.param.index, recipe, where, site.weight_in_out, dtype,
                                   linked=not ctx.inference)
        # an inference copy is rewritten in place when the weight changes (one address: CUDA graphs
        # replay it), a training copy gets new buffers (weight_cache.linked_fp8_weight says why)
        [node] = ctx.delayed.extra_input(source, f"te_fp8_weight_{len(ctx.cached_weights)}",
                                         static=ctx.inference)
        ctx.cached_weights[key] = node
    return scope.lift(node, node.name)
