"""Replace a linear site by a call to its lowering, with its recipe state as graph buffers."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource

from ..lowerings.fp8_linear import LinearLowering
from .sites import LinearSite

__all__ = ["rewrite_linear", "add_state_buffers"]


def add_state_buffers(gm: fx.GraphModule, prefix: str, tensors: Sequence[torch.Tensor],
                      before: fx.Node) -> list[fx.Node]:
    """Register ``tensors`` as buffers of ``gm`` (the very objects: in-place updates by the
    compiled graph land in them) and return get_attr nodes inserted before ``before``."""
    if getattr(gm, "_param_name_to_source", None) is None:
        gm._param_name_to_source = {}
    nodes = []
    for i, t in enumerate(tensors):
        name = f"{prefix}_{i}"
        gm.register_buffer(name, t)
        # aot_autograd asserts that every lifted buffer has a source.
        gm._param_name_to_source[name] = ConstantSource(name)
        with gm.graph.inserting_before(before):
            node = gm.graph.get_attr(name)
        node.meta["example_value"] = t
        nodes.append(node)
    return nodes


def rewrite_linear(gm: fx.GraphModule, site: LinearSite, lowering: LinearLowering,
                   state: Sequence[fx.Node] = ()) -> int:
    """Replace ``site.node`` by ``lowering(x, weight, bias, *state)``; returns 1."""
    with gm.graph.inserting_before(site.node):
        new = gm.graph.call_function(lowering, (site.x, site.weight, site.bias, *state))
    new.meta.update(site.node.meta)
    site.node.replace_all_uses_with(new)
    gm.graph.erase_node(site.node)
    return 1
