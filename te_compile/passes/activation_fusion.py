"""The activation pass: GELU / ReLU / squared ReLU / SwiGLU feeding an FP8 linear becomes one
operation with it (lowerings/activation_linear.py). Runs after the linear pass, on its calls.

    a = F.gelu(h); y = fc2(a)                      -> y = te_gelu_linear(h, None, h, fc2.w, fc2.b)
    a = F.silu(g) * u; y = down_proj(a)            -> y = te_swiglu_linear(g, u, g, down.w, None)

An activation is fused when one linear under a per-tensor recipe is its only reader (through casts,
views keeping the last dim, dropout(p=0)); otherwise the report row says why not. One row per
activation site; ``fqn`` is the module whose forward applies it.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..lowerings.activation_linear import ActivationLinearLowering, ActivationLinearSpec
from ..lowerings.sharded_linear import is_dtensor
from ..report import SiteRecord
from .graphs import GraphScope
from .readers import dying, find_readers, linear_fusable, linear_name, method_or_name, shape_of, view_inputs
from .sites import module_fqn

if TYPE_CHECKING:
    from . import PassContext

__all__ = ["fuse_activations"]

_GELU = (F.gelu, torch._C._nn.gelu)
_RELU = (F.relu, torch.relu)
_SILU = (F.silu, torch._C._nn.silu)
_MUL = (operator.mul, torch.mul, torch.Tensor.mul)
_OPS = {"gelu": "gelu", "gelu_tanh": "gelu", "relu": "relu", "relu2": "relu2", "swiglu": "swiglu"}


def _calls(node: fx.Node, fns: tuple, method: str) -> bool:
    return (node.op == "call_function" and node.target in fns) or (node.op == "call_method" and node.target == method)


def _squares(node: fx.Node, r: fx.Node) -> bool:
    """``node`` is r ** 2 / r.pow(2) / r.square() / r * r."""
    name = method_or_name(node)
    if name in ("pow", "__pow__") and len(node.args) == 2 and node.args[0] is r and node.args[1] == 2:
        return True
    if name == "square" and node.args and node.args[0] is r:
        return True
    return _calls(node, _MUL, "mul") and len(node.args) == 2 and node.args[0] is r and node.args[1] is r


def _site(node: fx.Node) -> Optional[tuple[str, fx.Node, Optional[fx.Node], fx.Node]]:
    """(kind, h, u, output node) when ``node`` applies an activation of ACTIVATIONS, else None."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    h = node.args[0]
    if _calls(node, _GELU, "gelu"):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return ("gelu_tanh" if approximate == "tanh" else "gelu"), h, None, node
    if _calls(node, _RELU, "relu") and not node.kwargs.get("inplace", False):
        users = list(node.users)
        if len(users) == 1 and _squares(users[0], node):
            return "relu2", h, None, users[0]
        return "relu", h, None, node
    if _calls(node, _SILU, "silu") and not node.kwargs.get("inplace", False):
        users = list(node.users)
        if len(users) == 1 and _calls(users[0], _MUL, "mul") and len(users[0].args) == 2:
            mul = users[0]
            u = mul.args[1] if mul.args[0] is node else mul.args[0]
            if isinstance(u, fx.Node) and u is not node and shape_of(u) == shape_of(h):
                return "swiglu", h, u, mul
    return None


def fuse_activations(ctx: "PassContext", scope: GraphScope) -> int:
    """Fuse each activation of ``scope`` with the FP8 linear reading it; one report row per site."""
    count = 0
    for node in list(scope.graph.nodes):
        if getattr(node, "_erased", False):   # a linear (or a view before it) fused away below
            continue
        found = _site(node) if node.op in ("call_function", "call_method") else None
        if found is None:
            continue
        kind, h, u, out = found
        fqn = scope.fqn(module_fqn(node))

        def record(fused: bool, reason: str, recipe: Optional[str] = None) -> None:
            shape = shape_of(h)
            where = f"; in a {scope.region}" if scope.region and scope.unsupported is None else ""
            ctx.record(scope, node, SiteRecord(
                fqn=fqn, op=_OPS[kind], recipe=recipe, rewritten=fused, reason=reason + where,
                shapes=f"x[{', '.join(str(d) for d in shape)}]" if shape is not None else "", graph=ctx.graph_id))

        if not ctx.config.rewrite.activation:
            record(False, "[rewrite] activation = false")
            continue
        if scope.unsupported is not None:
            record(False, scope.unsupported)
            continue
        readers = find_readers(out)
        if not readers.linears:
            record(False, "no FP8 linear reads its output")
            continue
        reader = readers.linears[0]
        linear = reader.node.target
        why = linear_fusable(reader, "activation")
        if why is None and (len(readers.linears) > 1 or readers.others):
            why = "its output has other readers"
        if why is None and (is_dtensor(h.meta.get("example_value"))
                            or (u is not None and is_dtensor(u.meta.get("example_value")))):
            why = "DTensor input"
        if why is not None:
            record(False, f"{linear_name(reader)}: {why}", linear.spec.recipe.name)
            continue
        spec = ActivationLinearSpec(fqn, kind, linear.spec.fqn, linear.spec.recipe, linear.spec.weight_in_out,
                                    reader.casts)
        record(True, f"fused into {linear_name(reader)}" + (" (tanh GELU)" if kind == "gelu_tanh" else ""),
               linear.spec.recipe.name)
        graph = scope.graph
        going = dying([reader])
        with graph.inserting_before(reader.node):
            shape = view_inputs(reader, h, graph)
            new = graph.call_function(ActivationLinearLowering(spec, linear), (h, u, shape, *reader.node.args[1:]))
        new.meta.update(reader.node.meta)
        reader.node.replace_all_uses_with(new)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for gone in sorted(going, key=order.__getitem__, reverse=True):
            graph.erase_node(gone)   # the linear, and the casts and views only it read
        count += 1
    return count
