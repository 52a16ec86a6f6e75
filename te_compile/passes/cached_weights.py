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

An MoE layer's expert weights (a grouped GEMM's 3-D parameter, [E, K, N] or [E, N, K] read transposed)
are cached the same way, in both kinds of graph, as a ``GroupedFloat8Tensor`` with one scale per
expert (``cached_fp8_experts`` / ``linked_fp8_experts``), under per-tensor current scaling only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..recipe import Recipe
from ..weight_cache import cached_fp8_experts, cached_fp8_weight, linked_fp8_experts, linked_fp8_weight
from ..fx.graphs import GraphScope
from ..fx.gemm_operands import GroupedSite, LinearSite
from .context import PassContext

__all__ = ["CachedWeightInput", "cached_weight", "cached_expert_weight"]


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
    experts: bool = False      # an MoE layer's [E, K, N] expert weights (transposed: stored [E, N, K])

    def tensors(self, args: Sequence) -> list[torch.Tensor]:
        weight = args[self.weight_index]
        if self.experts:
            fetch = linked_fp8_experts if self.linked else cached_fp8_experts
            return [fetch(weight, self.recipe, self.where, self.transposed, self.dtype)]
        fetch = linked_fp8_weight if self.linked else cached_fp8_weight
        return [fetch(weight, self.recipe, self.where, self.transposed, self.dtype)]


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


def _input_node(ctx: PassContext, source: CachedWeightInput, key: tuple) -> fx.Node:
    """The top-level graph input fed with ``source``'s copy, one per ``key`` (shared by its readers)."""
    node = ctx.cached_weights.get(key)
    if node is None:
        # an inference copy is rewritten in place when the weight changes (one address: CUDA graphs
        # replay it), a training copy gets new buffers (weight_cache.linked_fp8_weight says why)
        [node] = ctx.delayed.extra_input(source, f"te_fp8_weight_{len(ctx.cached_weights)}",
                                         static=ctx.inference)
        ctx.cached_weights[key] = node
    return node


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
    where = f"{site.fqn or '<root>'} ({'inference' if ctx.inference else 'training'} weight cache)"
    source = CachedWeightInput(site.param.index, recipe, where, site.weight_in_out, dtype, linked=not ctx.inference)
    node = _input_node(ctx, source, (site.param.index, recipe, site.weight_in_out, dtype))
    return scope.lift(node, node.name)


_TRANSPOSES = ("transpose", "swapaxes", "swapdims")
_CASTS = ("to", "type", "bfloat16", "half", "float")


def _expert_read(scope: GraphScope, site: GroupedSite) -> Optional[torch.dtype]:
    """The dtype a grouped call reads its parameter in, when it reads the parameter itself through at
    most one transpose of its last two dims and dtype casts (torchtitan's ``w.bfloat16().transpose(-2,
    -1)``), else None: a slice, a copy to another device or any other op makes bytes the cache's would
    not match. Stricter than fx.gemm_operands.param_behind, which found the parameter: that walk also
    passes ``.detach()`` (the cached copy's link would give the parameter a gradient the call cut) and
    more than one transpose."""
    node, transposes = site.weight, 0
    while node not in scope.params:
        name = getattr(node.target, "__name__", node.target)
        if node.op not in ("call_method", "call_function") or len(node.all_input_nodes) != 1:
            return None
        if name in _TRANSPOSES:
            transposes += 1
        elif name not in _CASTS:
            return None
        node = node.all_input_nodes[0]
    param = site.param.value
    value = site.weight.meta.get("example_value")
    expected = tuple(param.shape) if site.weight_in_out else (param.shape[0], param.shape[2], param.shape[1])
    if (scope.params[node].index != site.param.index or transposes > 1 or value is None
            or tuple(value.shape) != expected or value.device != param.device or not value.dtype.is_floating_point):
        return None
    return value.dtype


def cached_expert_weight(ctx: PassContext, scope: GraphScope, site: GroupedSite, recipe: Recipe) -> Optional[fx.Node]:
    """The node of ``scope`` carrying the cached FP8 copy of a grouped site's expert weights, [E, K, N]
    as the call reads them, or None: the copy serves an inference graph, or a training graph under
    ``cache_fp8_weights``, for a plain 3-D parameter under per-tensor current scaling read as it is or
    transposed, cast or not (DelayedScaling keeps per-expert histories the graph updates; DTensor
    shards, FP8 primary weights and FSDP2's FP8 all-gathers bring their own bytes)."""
    if not _caches_weights(ctx, recipe) or recipe.delayed() or site.param is None:
        return None
    value = site.param.value
    if is_traceable_wrapper_subclass(value) or not value.is_floating_point() or value.dim() != 3:
        return None
    dtype = None if _autocast_inside(scope) else _expert_read(scope, site)
    if dtype is None:
        return None
    where = f"{site.fqn or '<root>'} ({'inference' if ctx.inference else 'training'} expert weight cache)"
    transposed = not site.weight_in_out
    source = CachedWeightInput(site.param.index, recipe, where, transposed, dtype, linked=not ctx.inference,
                               experts=True)
    node = _input_node(ctx, source, (site.param.index, recipe, transposed, dtype, "experts"))
    return scope.lift(node, node.name)
