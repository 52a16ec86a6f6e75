"""Editing a graph node by node, keeping ``node.meta`` right: the one way every pass inserts a call and
puts it in the place of the nodes it replaces.

A Dynamo graph's nodes carry their example value (a fake tensor: shape, dtype, device) and the module
stack they were traced in; later passes and AOTAutograd read both. A call inserted here either takes
the meta of the node it stands for (``like``) or has its example value computed on the operands'
fake values, as Dynamo records one.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["insert_call", "replace_node", "replace_with_call", "erase_nodes"]


def insert_call(before: fx.Node, target, args: tuple, kwargs: Optional[dict] = None, method: bool = False,
                like: Optional[fx.Node] = None) -> fx.Node:
    """A ``call_function`` (``call_method`` with ``method``) of ``target`` on ``args``, inserted before
    ``before``. Its meta is ``like``'s where given (the call computes what that node did), else its
    example value is computed on the operands' fake values: the later passes read shapes and dtypes
    from it."""
    graph = before.graph
    with graph.inserting_before(before):
        node = graph.call_method(target, args, kwargs) if method else graph.call_function(target, args, kwargs)
    if like is not None:
        node.meta.update(like.meta)
        return node
    values = tree_map(lambda a: a.meta.get("example_value") if isinstance(a, fx.Node) else a, args)
    # the operands' own mode: the tracing context's may be another one (AOTAutograd's)
    fake_mode = next((v.fake_mode for v in tree_flatten(values)[0] if hasattr(v, "fake_mode")), None)
    if fake_mode is not None:
        with fake_mode:
            node.meta["example_value"] = (getattr(values[0], target)(*values[1:]) if method else target(*values))
    return node


def replace_node(old: fx.Node, new: fx.Node) -> None:
    """Every reader of ``old`` reads ``new`` instead, and ``old`` goes."""
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def replace_with_call(old: fx.Node, target, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
    """A call of ``target`` on ``args``, inserted before ``old`` with its meta, in the place of ``old``
    (the rewrite of one site by its lowering)."""
    new = insert_call(old, target, args, kwargs, like=old)
    replace_node(old, new)
    return new


def erase_nodes(nodes: Iterable[fx.Node]) -> None:
    """Erase ``nodes`` (of one graph), readers before what they read: the casts and views a fused call
    made unread, once nothing outside ``nodes`` reads them."""
    nodes = set(nodes)
    if not nodes:
        return
    graph = next(iter(nodes)).graph
    for node in reversed([n for n in graph.nodes if n in nodes]):
        graph.erase_node(node)
