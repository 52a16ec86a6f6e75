"""The activation pass: GELU / ReLU / squared ReLU / SwiGLU feeding an FP8 linear becomes one
operation with it (lowerings/activation_fusion.py). Runs after the linear pass, on its calls.

    a = F.gelu(h); y = fc2(a)                      -> y = te_gelu_linear(h, None, h, fc2.w, fc2.b)
    a = F.silu(g) * u; y = down_proj(a)            -> y = te_swiglu_linear(g, u, g, down.w, None)

The same for the activation between an MoE layer's two expert GEMMs, fused into the second grouped
GEMM (lowerings/grouped_linear.py) with per-expert scales. Where the grouped GEMMs pad every expert's
rows (the native grouped GEMM's 16) and h and u come from grouped GEMMs of one x on the same groups
(or from one, chunked along its last dim), read by nothing else, the expert MLP pads its tokens once
in front of its GEMMs and gathers them back once after the last (``pad_expert_rows``,
``unpad_expert_rows``), instead of a pad and a gather per GEMM ([M, FFN]-sized copies each way).

An activation is fused when one linear under a per-tensor recipe is its only reader (through casts,
views keeping the last dim, dropout(p=0)); otherwise the report row says why not. One row per
activation site; ``fqn`` is the module whose forward applies it.

Hand-written activations (HF's gelu_new / gelu_fast / quick_gelu: elementwise arithmetic of one
tensor around a tanh, erf or sigmoid) are found from the linears they feed: the elementwise region
behind a linear's input is copied out of the graph into a small GraphModule, which the lowering
calls (same ops, same bytes) and differentiates with autograd.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..distributed import is_dtensor
from ..lowerings.activation_fusion import (ActivationGroupedLinearLowering, ActivationLinearLowering,
                                           ActivationLinearSpec)
from ..lowerings.grouped_linear import GroupedLinearLowering, pad_expert_rows, unpad_expert_rows
from ..lowerings.linear import LinearLowering
from ..report import SiteRecord
from ..fx.editing import erase_nodes, replace_with_call
from ..fx.graphs import GraphScope, module_fqn
from ..fx.matching import MUL, calls, erased, method_or_name, shape_of, shape_text, squared, written_between
from .readers import (Reader, Readers, dying, find_readers, linear_name, passes_through, view_inputs,
                      why_not_fused_linear)
from .context import PassContext

__all__ = ["fuse_activations", "fuse_hand_written_activations"]

_GELU = (F.gelu, torch._C._nn.gelu)
_RELU = (F.relu, torch.relu)
_SILU = (F.silu, torch._C._nn.silu)
_OPS = {"gelu": "gelu", "gelu_tanh": "gelu", "relu": "relu", "relu2": "relu2", "swiglu": "swiglu", "silu": "silu",
        "geglu": "geglu", "geglu_tanh": "geglu"}
# elementwise ops a hand-written activation is made of; the transcendental ones mark it as one
_ARITH = {"mul", "add", "sub", "truediv", "div", "neg", "pow", "__pow__", "__mul__", "__add__", "__sub__",
          "__truediv__", "__rmul__", "__radd__", "exp", "square"}
_TRANSCENDENTAL = {"tanh", "sigmoid", "erf"}
# ops that cut a tensor into pieces (read through getitem)
_CUTS = ("chunk", "split", "tensor_split")


def _storage_note(recipe) -> str:
    return "; input saved for backward in FP8 (fp8_activation_input)" if recipe.fp8_activation_input else ""


def _site(node: fx.Node) -> Optional[tuple[str, fx.Node, Optional[fx.Node], fx.Node]]:
    """(kind, h, u, output node) when ``node`` applies an activation of ACTIVATIONS, else None."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    h = node.args[0]
    if calls(node, _GELU, "gelu"):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        kind = "gelu_tanh" if approximate == "tanh" else "gelu"
        u = _gate_partner(node, h)
        if u is not None:   # GeGLU (Gemma): gelu(gate) * up
            return kind.replace("gelu", "geglu"), h, u, next(iter(node.users))
        return kind, h, None, node
    if calls(node, _RELU, "relu") and not node.kwargs.get("inplace", False):
        users = list(node.users)
        if len(users) == 1 and squared(users[0]) is node and all(
                a is node for a in users[0].args if isinstance(a, fx.Node)):   # relu(h) ** 2, not a cast of it
            return "relu2", h, None, users[0]
        return "relu", h, None, node
    if calls(node, _SILU, "silu") and not node.kwargs.get("inplace", False):
        u = _gate_partner(node, h)
        if u is not None:
            return "swiglu", h, u, next(iter(node.users))
        return "silu", h, None, node
    return None


def _gate_partner(act: fx.Node, h: fx.Node) -> Optional[fx.Node]:
    """u when ``act``'s only reader is ``act * u`` with u a tensor of h's shape (a gated linear unit)."""
    users = list(act.users)
    if len(users) != 1 or not calls(users[0], MUL, "mul") or len(users[0].args) != 2:
        return None
    mul = users[0]
    u = mul.args[1] if mul.args[0] is act else mul.args[0]
    return u if isinstance(u, fx.Node) and u is not act and shape_of(u) == shape_of(h) else None


def _why_not_activation(reader: Reader, readers: Readers, inputs: tuple, act: fx.Node) -> Optional[str]:
    """None when the activation ``act`` and ``reader``, its first FP8 linear, can fuse; else why not."""
    why = why_not_fused_linear(reader, "activation")
    if why is None and (len(readers.linears) > 1 or readers.others):
        why = "its output has other readers"
    if why is None and any(is_dtensor(t.meta.get("example_value")) for t in inputs if t is not None):
        why = "DTensor input"
    if why is None:
        why = _why_not_in_place(act, reader.node, inputs)
    return why


def _why_not_in_place(act: fx.Node, linear: fx.Node, inputs: tuple) -> Optional[str]:
    """The fused call applies the activation where the linear runs: an in-place write into its
    input (or a view of it) between the two would reach the linear, not the activation."""
    names = sorted({name for t in inputs if t is not None for name in written_between(t, act, linear)})
    return f"its input is written in place ({', '.join(names)}) before the linear runs" if names else None


def fuse_activations(ctx: PassContext, scope: GraphScope) -> int:
    """Fuse each activation of ``scope`` with the FP8 linear reading it; one report row per site."""
    count = 0
    for node in list(scope.graph.nodes):
        if erased(node):   # a linear (or a view before it) fused away below
            continue
        found = _site(node) if node.op in ("call_function", "call_method") else None
        if found is None:
            continue
        kind, h, u, out = found
        fqn = scope.fqn(module_fqn(node))

        def record(fused: bool, reason: str, recipe: Optional[str] = None) -> None:
            ctx.record(scope, node, SiteRecord(
                fqn=fqn, op=_OPS[kind], recipe=recipe, rewritten=fused, reason=reason + scope.where,
                shapes=shape_text("x", h) or "", graph=ctx.graph_id))

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
        why = _why_not_activation(reader, readers, (h, u), node)
        if why is not None:
            record(False, f"{linear_name(reader)}: {why}", linear.spec.recipe.name)
            continue
        grouped = isinstance(linear, GroupedLinearLowering)
        padded_by = _padding_producers(reader, kind, linear, h, u) if grouped else []
        spec = ActivationLinearSpec(fqn, kind, linear.spec.fqn, linear.spec.recipe,
                                    False if grouped else linear.spec.weight_in_out, reader.casts,
                                    inductor=ctx.config.compiler == "inductor")
        record(True, f"fused into {linear_name(reader)}" + (" (grouped GEMM)" if grouped else "")
               + (" (tanh GELU)" if kind.endswith("_tanh") else "")
               + (", the expert MLP's tokens padded once for all its GEMMs" if padded_by else "")
               + _storage_note(linear.spec.recipe), linear.spec.recipe.name)
        if padded_by:
            _pad_once(scope.graph, reader, spec, linear, h, u, padded_by)
        else:
            _replace(scope.graph, reader, (ActivationGroupedLinearLowering(spec, linear) if grouped
                                           else ActivationLinearLowering(spec, linear)), h, u)
        count += 1
    return count


def _replace(graph: fx.Graph, reader, lowering, h: fx.Node, u: Optional[fx.Node]) -> None:
    """The linear call becomes ``lowering(h, u, shape, weight, bias, *delayed)`` (grouped: ``weight,
    offs, *delayed``), shape: the reader's views replayed on h."""
    going = dying([reader]) - {reader.node}
    with graph.inserting_before(reader.node):
        shape = view_inputs(reader, h, graph)
    replace_with_call(reader.node, lowering, (h, u, shape, *reader.node.args[1:]))
    erase_nodes(going)   # the casts and views only the linear read


def _padding_producers(reader: Reader, kind: str, grouped: GroupedLinearLowering, h: fx.Node,
                       u: Optional[fx.Node]) -> list[fx.Node]:
    """The grouped calls making h (and u) when the expert MLP can run on rows padded once, else []:
    the GEMMs pad (align > 1), the calls read one x node on the fused GEMM's groups (its offs node)
    and experts, and nothing but the activation on its way to ``reader`` reads them. act(0) = 0 for
    every built-in kind, so padding rows stay zero; a hand-written (custom) activation is not
    assumed to keep them."""
    if grouped.spec.align == 1 or kind == "custom":
        return []
    producers = [_grouped_call_behind(t) for t in (h, u) if t is not None]
    if None in producers:
        return []
    producers = list(dict.fromkeys(producers))
    x, offs = producers[0].args[0], reader.node.args[2]   # grouped calls: (x, w, offs, *delayed)
    experts = [(shape_of(p.args[1]) or (None,))[0] for p in (*producers, reader.node)]
    if None in experts or len(set(experts)) != 1:
        return []
    for p in producers:
        if not (p.args[0] is x and p.args[2] is offs and p.target.spec.align == grouped.spec.align
                and _read_only_on_the_way_to(p, reader.node)):
            return []
    return producers


def _pad_once(graph: fx.Graph, reader: Reader, spec: ActivationLinearSpec, grouped: GroupedLinearLowering,
              h: fx.Node, u: Optional[fx.Node], producers: list[fx.Node]) -> None:
    """The expert MLP on rows padded once: ``pad_expert_rows`` before the grouped calls making h and
    u, those and the fused call on the padded rows without padding of their own (align 1 on the
    padded offs), and one ``unpad_expert_rows`` after the fused call."""
    x, experts = producers[0].args[0], shape_of(producers[0].args[1])[0]   # w: [E, *, *]
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(min(producers, key=order.__getitem__)):
        pad = graph.call_function(pad_expert_rows, (x, reader.node.args[2], experts, grouped.spec.align))
        padded_x, padded_offs, dest, src = (graph.call_function(operator.getitem, (pad, i)) for i in range(4))
    for p in producers:
        p.target = GroupedLinearLowering(replace(p.target.spec, align=1))
        p.args = (padded_x, p.args[1], padded_offs, *p.args[3:])
        _forget_value(p)   # [P, N] rows now, not the [M, N] traced
    going = dying([reader]) - {reader.node}
    _x, w, _offs, *delayed = reader.node.args
    lowering = ActivationGroupedLinearLowering(spec, GroupedLinearLowering(replace(grouped.spec, align=1)))
    # shape: h itself, since the reader's views would reshape [M, K] rows (the grouped form reads none)
    fused = replace_with_call(reader.node, lowering, (h, u, h, w, padded_offs, *delayed))
    erase_nodes(going)
    with graph.inserting_after(fused):
        out = graph.call_function(unpad_expert_rows, (fused, dest, src))
    out.meta.update(fused.meta)
    fused.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
    _forget_value(fused)


def _forget_value(node: fx.Node) -> None:
    """Drop a node's traced value, whose shape it no longer has."""
    for key in ("example_value", "val", "tensor_meta"):
        node.meta.pop(key, None)


def _grouped_call_behind(t: fx.Node) -> Optional[fx.Node]:
    """The grouped call whose output ``t`` is, itself or a piece of it cut along the last dim (HF's
    ``gate_up(x).chunk(2, dim=-1)``: rows stay rows, padded or not), else None."""
    if t.op == "call_function" and t.target is operator.getitem and method_or_name(t.args[0]) in _CUTS:
        cut = t.args[0]
        dim = cut.kwargs.get("dim", cut.args[2] if len(cut.args) > 2 else 0)
        rank = len(shape_of(cut.args[0]) or ())
        t = cut.args[0] if rank and dim in (-1, rank - 1) else None
    if isinstance(t, fx.Node) and t.op == "call_function" and isinstance(t.target, GroupedLinearLowering):
        return t
    return None


def _read_only_on_the_way_to(node: fx.Node, reader: fx.Node) -> bool:
    """Whether every read of ``node`` leads to ``reader`` through pure ops (the activation's own,
    which the fused call replaces) or ends in one nothing reads."""
    todo, seen = list(node.users), set()
    while todo:
        user = todo.pop()
        if user is reader or user in seen:
            continue
        seen.add(user)
        if user.op not in ("call_function", "call_method") or user.is_impure():
            return False
        todo += list(user.users)
    return True


def _elementwise_region(out: fx.Node) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """(h, nodes) when ``out`` is elementwise arithmetic of the single tensor h with scalar constants
    around a tanh / erf / sigmoid, every intermediate read only inside the region; else None."""
    region, leaves, todo = set(), set(), [out]
    while todo:
        node = todo.pop()
        if node in region:
            continue
        name = method_or_name(node) if node.op in ("call_function", "call_method") else None
        if name not in _ARITH | _TRANSCENDENTAL or node.kwargs:
            leaves.add(node)
            continue
        if any(not isinstance(a, (fx.Node, int, float)) for a in node.args):
            return None
        region.add(node)
        todo += [a for a in node.args if isinstance(a, fx.Node)]
    if len(leaves) != 1 or not any(method_or_name(n) in _TRANSCENDENTAL for n in region):
        return None
    if any(u not in region for n in region - {out} for u in n.users):
        return None
    h = leaves.pop()
    if shape_of(h) != shape_of(out):
        return None
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    return h, sorted(region, key=order.__getitem__)


def _as_module(h: fx.Node, nodes: list[fx.Node]) -> fx.GraphModule:
    """The region as ``h -> out``, the model's own nodes copied (same ops and constants)."""
    graph = fx.Graph()
    env = {h: graph.placeholder("h")}
    for node in nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(env[nodes[-1]])
    return fx.GraphModule(torch.nn.Module(), graph, class_name="HandWrittenActivation")


def _hand_written_name(nodes: list[fx.Node]) -> str:
    """"gelu" for tanh / erf forms and x * sigmoid(1.702 x); "silu" for x * sigmoid(x)."""
    names = {method_or_name(n) for n in nodes}
    if names & {"tanh", "erf"}:
        return "gelu"
    constants = [a for n in nodes for a in n.args if isinstance(a, float)]
    return "gelu" if any(abs(c - 1.702) < 1e-3 for c in constants) else "silu"


def _source(reader_input: fx.Node) -> fx.Node:
    """The value a linear's input is a cast / view / dropout(p=0) of (itself when none)."""
    node = reader_input
    while node.args and isinstance(node.args[0], fx.Node) and passes_through(node, node.args[0]) is not None:
        node = node.args[0]
    return node


def fuse_hand_written_activations(ctx: PassContext, scope: GraphScope) -> int:
    """Fuse hand-written elementwise activations into the FP8 linear reading them (see above)."""
    if not ctx.config.rewrite.activation or scope.unsupported is not None:
        return 0
    count = 0
    for node in list(scope.graph.nodes):
        if erased(node) or not isinstance(node.target, LinearLowering):
            continue
        out = _source(node.args[0])
        found = _elementwise_region(out)
        if found is None:
            continue
        h, nodes = found
        readers = find_readers(out)
        reader = next(r for r in readers.linears if r.node is node)
        op = _hand_written_name(nodes)
        fqn = scope.fqn(module_fqn(out))
        why = _why_not_activation(reader, readers, (h,), nodes[0])
        linear = node.target
        record = SiteRecord(fqn=fqn, op=op, recipe=linear.spec.recipe.name, rewritten=why is None,
                            reason=(f"{linear_name(reader)}: {why}" if why else
                                    f"fused into {linear_name(reader)} (hand-written {op.upper()})"
                                    + _storage_note(linear.spec.recipe)) + scope.where,
                            shapes=shape_text("x", h), graph=ctx.graph_id)
        ctx.record(scope, nodes[0], record)
        if why is not None:
            continue
        spec = ActivationLinearSpec(fqn, "custom", linear.spec.fqn, linear.spec.recipe, linear.spec.weight_in_out,
                                    reader.casts, _as_module(h, nodes), inductor=ctx.config.compiler == "inductor")
        _replace(scope.graph, reader, ActivationLinearLowering(spec, linear), h, None)
        count += 1
    return count
