"""Replace a linear site by a call to its lowering; recipe state enters the graph as inputs."""

from __future__ import annotations

import torch.fx as fx

from ..lowerings.linear import LinearLowering
from .sites import LinearSite

__all__ = ["rewrite_linear", "add_state_inputs"]


def add_state_inputs(gm: fx.GraphModule, prefix: str, count: int) -> list[fx.Node]:
    """Append ``count`` placeholders after the existing inputs (the backend's wrapper passes the
    state tensors there at every call)."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    nodes = []
    for i in range(count):
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(f"{prefix}_{i}")
        # aot_autograd reads every placeholder's Dynamo source; None marks an input that does not
        # come from user code (as DDPOptimizer's split graphs do).
        last._dynamo_source = None
        nodes.append(last)
    return nodes


def rewrite_linear(gm: fx.GraphModule, site: LinearSite, lowering: LinearLowering,
                   state: list[fx.Node] = ()) -> int:
    """Replace ``site.node`` by ``lowering(x, weight, bias, *state)``; returns 1."""
    with gm.graph.inserting_before(site.node):
        new = gm.graph.call_function(lowering, (site.x, site.weight, site.bias, *state))
    new.meta.update(site.node.meta)
    site.node.replace_all_uses_with(new)
    gm.graph.erase_node(site.node)
    return 1
