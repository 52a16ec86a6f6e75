"""Who reads a value: the FP8 linears (and MoE grouped GEMMs) reading it through ops that hand its
values on unchanged in row layout (dtype casts, dropout that drops nothing, views keeping the last
dim, whole-tensor slices), and everything else. The fusion passes (norm_fusion.py,
activation_fusion.py) fuse a producer with the linears found here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from ..distributed import NO_GROUPS, is_dtensor
from ..lowerings.grouped_linear import GroupedLinearLowering
from ..lowerings.linear import LinearLowering
from ..fx.matching import CASTS, dtype_of, method_or_name, shape_of

__all__ = ["Reader", "Readers", "find_readers", "passes_through", "view_inputs", "dying", "why_not_fused_linear",
           "linear_name"]

_VIEWS = ("view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "contiguous")
_DROPOUT = (torch.nn.functional.dropout, torch.dropout)


@dataclass
class Reader:
    """A linear reading a value through ``chain`` (the casts and views on the way)."""

    node: fx.Node                  # the LinearLowering call
    chain: list[fx.Node]           # from the first op after the value to the linear's input
    casts: tuple[torch.dtype, ...]


@dataclass
class Readers:
    linears: list[Reader] = field(default_factory=list)
    others: list[fx.Node] = field(default_factory=list)   # nodes reading a high-precision value


def passes_through(node: fx.Node, src: fx.Node) -> Optional[str]:
    """"cast" / "view" / "identity" when ``node`` hands ``src``'s values on unchanged in row layout."""
    if not node.args or node.args[0] is not src or any(a is src for a in node.args[1:]) \
            or any(v is src for v in node.kwargs.values()):
        return None
    name = method_or_name(node)
    if name in CASTS and dtype_of(node) in (torch.float32, torch.bfloat16, torch.float16):
        return "cast"
    if node.op == "call_function" and node.target in _DROPOUT:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
        return "identity" if (p == 0 or training is False) else None
    before, after = shape_of(src), shape_of(node)
    if name in _VIEWS and before and after and before[-1] == after[-1]:
        return "view"
    if name in ("getitem", "__getitem__") and _whole(node.args[1]) and before == after:
        return "identity"   # x[:, 0:], HF's hidden_states[:, slice(-0, None), :] before lm_head
    return None


def _whole(index) -> bool:
    """An index that selects everything: ':' / '0:' / '...' in every position."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is Ellipsis or (isinstance(p, slice) and p.start in (None, 0) and p.stop is None
                                 and p.step in (None, 1)) for p in parts)


def find_readers(out: fx.Node) -> Readers:
    found = Readers()

    def walk(node: fx.Node, chain: list[fx.Node], casts: tuple) -> None:
        for user in node.users:
            if isinstance(user.target, (LinearLowering, GroupedLinearLowering)) and user.args[0] is node \
                    and node not in user.args[1:]:
                found.linears.append(Reader(user, chain, casts))
                continue
            kind = passes_through(user, node)
            if kind is None:
                found.others.append(user)
            else:
                walk(user, chain + [user], casts + ((dtype_of(user),) if kind == "cast" else ()))

    walk(out, [], ())
    return found


def why_not_fused_linear(reader: Reader, what: str) -> Optional[str]:
    """None when the linear can take its input from the fused ``what`` ("norm", "activation"), else
    why not."""
    spec = reader.node.target.spec
    if isinstance(reader.node.target, GroupedLinearLowering) and spec.recipe.per_tensor:
        # the experts' GEMMs take activations only: norms and attention outputs reach them through
        # the routing's gather, never directly
        return None if what == "activation" else f"an MoE grouped GEMM ({what} fusion covers linears)"
    if not spec.recipe.per_tensor:
        return f"recipe {spec.recipe.name} ({what} fusion covers the per-tensor FP8 recipes)"
    if spec.weight_first:
        return "weight-first product"
    if spec.amax_groups != NO_GROUPS:
        return "sharded by hand"
    x = reader.node.args[0].meta.get("example_value")
    w = reader.node.args[1].meta.get("example_value")
    if is_dtensor(x) or is_dtensor(w):
        return "DTensor operands"
    return None


def view_inputs(reader: Reader, x: fx.Node, graph: fx.Graph) -> fx.Node:
    """The reader's views replayed on x, a tensor of the read value's shape (the producer's input),
    for the linear output's shape: x itself when there are none."""
    node = x
    for op in reader.chain:
        if passes_through(op, op.args[0]) != "view":
            continue
        new = graph.create_node(op.op, op.target, (node, *op.args[1:]), dict(op.kwargs))
        new.meta.update(op.meta)
        node = new
    return node



def dying(chosen: list[Reader]) -> set[fx.Node]:
    """The fused linears and the chain nodes read by nothing else (they go with the linears)."""
    dying = {r.node for r in chosen}
    chain = [op for r in chosen for op in r.chain]
    changed = True
    while changed:
        changed = False
        for op in chain:
            if op not in dying and all(u in dying for u in op.users):
                dying.add(op)
                changed = True
    return dying


def linear_name(reader: Reader) -> str:
    """The linear's module path for report texts ("<root>" for the model itself, as the table shows)."""
    return reader.node.target.spec.fqn or "<root>"
