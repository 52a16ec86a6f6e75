"""Reading FX nodes as Dynamo records them: shared by the site finders and the fusion passes.

A tensor op appears either as ``call_function`` (``torch.mul``, ``operator.mul``) or as
``call_method`` (``x.mul``); these helpers accept both, and read the example values Dynamo stores
in ``node.meta["example_value"]``.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

__all__ = ["CASTS", "MUL", "ADD", "SUB", "method_or_name", "calls", "strip_casts", "squared", "value_of", "dtype_of",
           "shape_of", "shape_text", "erased", "in_place_writes", "written_between"]

# dtype casts between floating-point dtypes
CASTS = ("to", "type", "type_as", "float", "half", "bfloat16")
MUL = (operator.mul, torch.mul, torch.Tensor.mul)
ADD = (operator.add, torch.add, torch.Tensor.add)
SUB = (operator.sub, torch.sub, torch.Tensor.sub)


def method_or_name(node) -> Optional[str]:
    """A call's op name: the method name, or the function's __name__; None for anything else."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", None)
    return None


def calls(node, fns: tuple, method: str) -> bool:
    """``node`` calls one of ``fns``, or the tensor method ``method``."""
    return isinstance(node, fx.Node) and ((node.op == "call_function" and node.target in fns)
                                          or (node.op == "call_method" and node.target == method))


def strip_casts(node):
    """The value ``node`` is a chain of dtype casts of (``node`` itself when it is none)."""
    while isinstance(node, fx.Node) and method_or_name(node) in CASTS and node.args:
        node = node.args[0]
    return node


def squared(node) -> Optional[fx.Node]:
    """v for ``v ** 2``, ``v * v`` (also ``x.float() * x.float()``) or ``v.square()``; else None."""
    name = method_or_name(node)
    if name in ("pow", "__pow__") and len(node.args) == 2 and node.args[1] == 2:
        return node.args[0]
    if (calls(node, MUL, "mul") and len(node.args) == 2 and isinstance(node.args[0], fx.Node)
            and strip_casts(node.args[0]) is strip_casts(node.args[1])):
        return node.args[0]
    if name == "square" and node.args:
        return node.args[0]
    return None


def erased(node: fx.Node) -> bool:
    """``node`` was removed from its graph: a pass looping over a snapshot of the nodes while it
    fuses skips the ones an earlier rewrite took out (fx marks them in a private flag)."""
    return getattr(node, "_erased", False)


def value_of(node) -> Optional[torch.Tensor]:
    """The (fake) tensor Dynamo recorded for ``node``; None for non-nodes and non-tensor values."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def dtype_of(node) -> Optional[torch.dtype]:
    value = value_of(node)
    return None if value is None else value.dtype


def shape_of(node) -> Optional[tuple]:
    value = value_of(node)
    return None if value is None else tuple(value.shape)


def shape_text(name: str, node) -> Optional[str]:
    """``name[d0, d1, ...]`` of ``node``'s example value, for the report; None when it has none."""
    shape = shape_of(node)
    return None if shape is None else f"{name}[{', '.join(str(d) for d in shape)}]"


# in-place operators on tensors (``x += y`` on a tensor Dynamo could not rebind) and item assignment
_IN_PLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.ipow, operator.iand, operator.ior, operator.ixor)


def _writes_first_argument(node: fx.Node) -> bool:
    """``node`` writes into its first argument: ``x.add_(1)``, ``torch.relu_(x)``, ``x[i] = v``,
    ``x += y``, ``F.relu(x, inplace=True)``."""
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        return True
    name = method_or_name(node)
    if name is not None and name.endswith("_") and not name.endswith("__"):
        return True
    return node.kwargs.get("inplace") is True


def _aliases(value, base: torch.Tensor) -> bool:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, torch.Tensor) and torch._C._is_alias_of(v, base) for v in values)


def in_place_writes(node: fx.Node) -> list[fx.Node]:
    """The in-place ops that write into ``node``'s value or a view of it, in no particular order.

    A pass that moves a computation across the graph (a fused norm placed after its operands, an
    activation recomputed at its linear) must not move it past one of these. Views are followed by
    aliasing, as Dynamo's example values record it: a no-op ``.to()`` or a ``split`` aliases, a
    real cast does not."""
    base = value_of(node)
    if base is None:
        return []
    writes, seen, todo = [], {node}, [node]
    while todo:
        current = todo.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            if _writes_first_argument(user) and user.args and user.args[0] is current:
                writes.append(user)
            if _aliases(user.meta.get("example_value"), base):   # a view, or the in-place op's result
                todo.append(user)
    return writes


def written_between(node: fx.Node, after: fx.Node, before: fx.Node,
                    order: Optional[dict[fx.Node, int]] = None) -> list[str]:
    """The names of the in-place ops writing ``node``'s value (or a view of it) that run after
    ``after`` and before ``before`` in graph order, sorted. ``order``: each node's position, when the
    caller has it (built here only if there are writes)."""
    writes = in_place_writes(node)
    if not writes:
        return []
    if order is None:
        order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted({method_or_name(w) or str(w.target) for w in writes if order[after] < order[w] < order[before]})
