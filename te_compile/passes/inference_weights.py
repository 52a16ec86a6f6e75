"""Inference graphs read cached FP8 weights: a linear site's weight operand becomes an extra graph input.

A graph Dynamo compiles with grad disabled (``torch.no_grad()``, ``torch.inference_mode()``: Dynamo
guards on the grad mode, so training calls get their own graph) serves calls that do not move the
weights. For each FP8 linear site on a per-tensor recipe whose weight is a parameter the graph
receives, the weight argument of its lowering becomes a placeholder fed, at every call, with
``te_compile.weight_cache.cached_fp8_weight(parameter)``: a ``Float8Tensor`` quantized the first time
and again only when the parameter changes. The lowering then takes its bytes as they are, as it does
for FSDP2's FP8 all-gather, and the graph never reads the high-precision weight. One input per
parameter and recipe, shared by every site that reads it (a tied or reused weight).

A weight stored [K, N] and read as ``x @ W`` (GPT-2's Conv1D) is cached transposed, [N, K], and its
site's lowering then reads it as an [N, K] weight. Under autocast (entered before the call) the copy
is made from the weight cast to autocast's dtype, as the linear casts it. Left out: graphs that enter an
autocast region themselves, weights on the left (``W @ x``),
per-expert loops, DTensor and already quantized weights, block-scaled recipes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.fx as fx

from ..recipe import Recipe
from ..weight_cache import cached_fp8_weight
from ..fx.graphs import GraphScope
from ..fx.gemm_operands import LinearSite
from .context import PassContext

__all__ = ["CachedWeightInput", "cached_weight"]


@dataclass(frozen=True)
class CachedWeightInput:
    """The cached FP8 copy of the parameter at Dynamo input ``weight_index``, looked up per call."""

    weight_index: int
    recipe: Recipe
    where: str
    transposed: bool = False   # the parameter is stored [K, N] (read as x @ W): the copy is [N, K]
    dtype: Optional[torch.dtype] = None   # autocast's dtype at compile: the weight is cast to it first

    def tensors(self, args: Sequence) -> list[torch.Tensor]:
        return [cached_fp8_weight(args[self.weight_index], self.recipe, self.where, self.transposed, self.dtype)]


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


def cached_weight(ctx: PassContext, scope: GraphScope, site: LinearSite, recipe: Recipe) -> Optional[fx.Node]:
    """The node of ``scope`` carrying the cached FP8 copy of ``site``'s weight, always [N, K] (the
    lowering then reads it as stored [N, K]), or None when the graph is not an inference graph or the
    site does not qualify (module docstring)."""
    if not ctx.inference or not recipe.per_tensor or site.param is None:
        return None
    if site.weight_first or site.expert is not None or _autocast_inside(scope):
        return None
    value = site.param.value
    if type(value) not in (torch.Tensor, torch.nn.Parameter) or not value.is_floating_point() or value.dim() != 2:
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
        where = f"{site.fqn or '<root>'} (inference weight cache)"
        source = CachedWeightInput(site.param.index, recipe, where, site.weight_in_out, dtype)
        [node] = ctx.delayed.extra_input(source, f"te_fp8_weight_{len(ctx.cached_weights)}")
        ctx.cached_weights[key] = node
    return scope.lift(node, node.name)
