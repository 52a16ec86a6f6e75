"""Where the passes look: the top-level Dynamo graph and the bodies of the higher-order ops in it.

Dynamo puts some regions of a model in subgraphs called through a higher-order op (HOP), e.g. every
activation-checkpointed block (``torch.utils.checkpoint``, Hugging Face gradient checkpointing)::

    wrap_body_0 = self.wrap_body_0                                    # get_attr: a GraphModule
    out = torch.ops.higher_order.tag_activation_checkpoint(wrap_body_0, x, w_fc, b_fc, ...)

The body's placeholders receive the HOP's operands in order, so a parameter used inside arrives as a
body placeholder. ``graph_scopes`` yields one ``GraphScope`` per graph, the top level first, each
knowing which of its placeholders carry parameters (traced back through the operands) and how to bring
a top-level value in (``lift``: one more operand and placeholder per HOP level). Bodies of HOPs that
run their body once, in place (checkpointing, ``wrap``, grad-mode and autocast wrappers), are
rewritten like the top level; bodies of other HOPs (``cond``, ``while_loop``, ``invoke_subgraph``, ...)
are walked too but only reported, with ``unsupported`` saying why, so that no site goes unlisted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
import torch.fx as fx

from .naming import frame_root

__all__ = ["ParamRef", "GraphScope", "graph_scopes", "module_fqn"]

# HOPs that call their body exactly once with the operands that follow it, like an inlined call:
# a rewrite inside the body and extra operands appended after the existing ones are both safe.
_INLINE_HOPS = frozenset({
    "tag_activation_checkpoint",
    "wrap_activation_checkpoint",
    "wrap",
    "wrap_with_set_grad_enabled",
    "wrap_with_autocast",
})
_CHECKPOINT_HOPS = frozenset({"tag_activation_checkpoint", "wrap_activation_checkpoint"})


@dataclass(frozen=True, eq=False)
class ParamRef:
    """A parameter the compiled graph receives: the object, its name in the model, its input position."""

    value: torch.nn.Parameter
    name: str          # e.g. "blocks.0.mlp.fc.weight" (the first name Dynamo reached it by)
    index: int         # its position in the top-level graph's inputs


@dataclass(eq=False)
class GraphScope:
    """One graph the passes rewrite: ``gm.graph``, top-level or the body of ``hop`` in ``parent``."""

    gm: fx.GraphModule
    # placeholder of this graph -> the parameter it receives at every call
    params: dict[fx.Node, ParamRef]
    parent: Optional["GraphScope"] = None
    hop: Optional[fx.Node] = None          # the HOP call in parent.gm.graph
    # why sites in this graph are reported but not rewritten (None: rewritable)
    unsupported: Optional[str] = None
    # module path of the compiled frame's root in the user's model ("blocks.0." when Dynamo compiled
    # one block on its own; naming.py), prepended to every module path Dynamo records
    prefix: str = ""
    # what the frame puts before every module path of the model ("0." when the model is the frame's
    # ``args[0]``: a decorator's wrapper was compiled; naming.frame_root), dropped by fqn()
    root: str = ""
    _lifted: dict[fx.Node, fx.Node] = field(default_factory=dict)
    _positions: dict[fx.Node, int] = field(default_factory=dict)   # node -> index before any pass

    def __post_init__(self) -> None:
        self._positions = {n: i for i, n in enumerate(self.gm.graph.nodes)}

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @property
    def region(self) -> str:
        """Where this graph sits, for reports: "" at top level, else e.g. "checkpointed region"."""
        kinds = []
        scope = self
        while scope.parent is not None:
            name = scope.hop.target.name()
            kinds.append("checkpointed region" if name in _CHECKPOINT_HOPS else f"{name} body")
            scope = scope.parent
        return " in ".join(kinds)

    @property
    def where(self) -> str:
        """What a report reason of a site here ends with: "; in a <region>" inside a HOP body the
        passes rewrite, else "" (an unsupported body's reason already says where it is)."""
        return f"; in a {self.region}" if self.region and self.unsupported is None else ""

    def order_key(self, node: fx.Node) -> tuple[float, ...]:
        """Where ``node`` runs in the whole capture: positions of the HOP calls down to it, then its
        own (a checkpointed block's sites sort where the block is called)."""
        # positions as the graph was before any pass; a node added since sorts after its predecessor
        before = node
        while before not in self._positions and before.op != "root":
            before = before.prev
        own = self._positions.get(before, -1) + (0.0 if before is node else 0.5)
        return (*self.parent.order_key(self.hop), own) if self.parent is not None else (own,)

    def fqn(self, path: str) -> str:
        """The model's name for a module Dynamo calls ``path`` in this frame ("" for the frame root)."""
        if self.root and (path + ".").startswith(self.root):
            path = path[len(self.root):]
        return f"{self.prefix}{path}" if path else self.prefix.rstrip(".")

    def placeholders(self) -> list[fx.Node]:
        return list(self.graph.find_nodes(op="placeholder"))

    def lift(self, top: fx.Node, name: str) -> fx.Node:
        """A node of this graph carrying the value of the top-level node ``top``.

        ``top`` must be defined before every HOP call on the way down (a placeholder, or a node the
        caller put at the start of the top-level graph). Each HOP level gets ``top`` as one more
        operand, after its existing ones, and its body one more placeholder; a value is lifted into
        a scope once, however many sites use it.
        """
        if self.parent is None:
            return top
        if self.unsupported is not None:
            raise RuntimeError(f"cannot bring a value into a graph the passes do not rewrite: {self.unsupported}")
        if top in self._lifted:
            return self._lifted[top]
        outer = self.parent.lift(top, name)
        self.hop.args = (*self.hop.args, outer)
        placeholders = self.placeholders()
        where = (self.graph.inserting_after(placeholders[-1]) if placeholders
                 else self.graph.inserting_before(next(iter(self.graph.nodes))))
        with where:
            node = self.graph.placeholder(name)
        node.meta.update({k: v for k, v in outer.meta.items() if k in ("example_value", "val", "tensor_meta")})
        self._lifted[top] = node
        return node


def _body(node: fx.Node, owner: fx.GraphModule) -> Optional[tuple[int, fx.GraphModule]]:
    """(index in node.args, module) of the first subgraph argument of a HOP call, or None."""
    for i, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = getattr(owner, arg.target, None)
            if isinstance(sub, fx.GraphModule):
                return i, sub
    return None


def _subgraphs(node: fx.Node, owner: fx.GraphModule) -> list[fx.GraphModule]:
    """Every GraphModule a HOP call takes (cond has two branches, while_loop a cond and a body)."""
    subs = []
    stack = [*node.args, *node.kwargs.values()]
    while stack:
        arg = stack.pop(0)
        if isinstance(arg, (list, tuple)):
            stack[:0] = list(arg)
        elif isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = getattr(owner, arg.target, None)
            if isinstance(sub, fx.GraphModule):
                subs.append(sub)
    return subs


def _child_scopes(scope: GraphScope) -> Iterator[GraphScope]:
    for node in list(scope.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        name = node.target.name()
        found = _body(node, scope.gm)
        if name in _INLINE_HOPS and found is not None and scope.unsupported is None:
            index, body = found
            operands = node.args[index + 1:]
            placeholders = list(body.graph.find_nodes(op="placeholder"))
            params = {ph: scope.params[op] for ph, op in zip(placeholders, operands) if op in scope.params}
            yield GraphScope(body, params, parent=scope, hop=node, prefix=scope.prefix, root=scope.root)
            continue
        why = scope.unsupported or f"inside torch.ops.higher_order.{name}, which the te passes do not rewrite"
        for sub in _subgraphs(node, scope.gm):
            # Reported only: their operand conventions differ per HOP, so parameters are not traced
            # in; the report still lists every matmul inside.
            yield GraphScope(sub, {}, parent=scope, hop=node, unsupported=why, prefix=scope.prefix, root=scope.root)


_ROOT = re.compile(r"^L\['[^']*'\]\.?")
_ITEM = re.compile(r"\[\s*'?([^\]']+)'?\s*\]")
_GETATTR = re.compile(r"getattr\((.*), '([^']*)'\)$")


def normalize_path(path: str) -> str:
    """Dynamo's source names -> named_modules() / named_parameters() names.

    "L['self'].blocks.0.mlp.fc" -> "blocks.0.mlp.fc"; "L['self']._modules['h'][0]" -> "h.0";
    "getattr(L['self'].layers, '0')" -> "layers.0";
    "L['self']._modules['wte']._parameters['weight']" -> "wte.weight".
    """
    m = _GETATTR.match(path)
    while m:
        path = f"{m.group(1)}.{m.group(2)}"
        m = _GETATTR.match(path)
    path = _ROOT.sub("", path)
    for container in ("_modules", "_parameters", "_buffers"):
        path = path.replace(f".{container}", "").replace(container, "")
    path = _ITEM.sub(r".\1", path)
    return path.strip(".").replace("..", ".")


def module_fqn(node: fx.Node) -> str:
    """The innermost module a node was traced in, named from the compiled frame's root ("" for the
    root itself; GraphScope.fqn makes it the model's name). A node of AOTAutograd's joint graph that
    computes a gradient has none of its own; its ``fwd_nn_module_stack`` names the module it
    differentiates (the partitioner may move such a node into the forward)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return normalize_path(path)


def _source_path(placeholder: fx.Node) -> str:
    source = getattr(placeholder, "_dynamo_source", None)
    return normalize_path(source.name) if source is not None else placeholder.name


def graph_scopes(gm: fx.GraphModule, example_inputs: Sequence) -> list[GraphScope]:
    """The top-level scope of Dynamo's graph ``gm`` and, depth first, every HOP body inside it."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    # Dynamo passes parameters as graph inputs: placeholder -> the nn.Parameter it receives.
    local = {node: (i, value, _source_path(node)) for i, (node, value) in enumerate(zip(placeholders, example_inputs))
             if isinstance(value, torch.nn.Parameter)}
    root, prefix = frame_root((value, name) for _, value, name in local.values())
    params = {node: ParamRef(value, prefix + name.removeprefix(root), i) for node, (i, value, name) in local.items()}
    scopes, seen = [], set()
    stack = [GraphScope(gm, params, prefix=prefix, root=root)]
    while stack:
        scope = stack.pop()
        if id(scope.gm) in seen:   # a body several calls share (invoke_subgraph): listed once
            continue
        seen.add(id(scope.gm))
        scopes.append(scope)
        stack.extend(reversed(list(_child_scopes(scope))))
    return scopes
