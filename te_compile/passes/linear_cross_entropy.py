"""The output-layer pass: a linear whose output reaches ``F.cross_entropy`` becomes one chunked op with
it (lowerings/linear_cross_entropy.py), so that no [tokens, vocab] tensor is saved for backward.

    logits = lm_head(x)                                         # a LinearLowering call, or a plain linear
    loss = F.cross_entropy(logits[..., :-1, :].float().view(-1, V), labels, ignore_index=-100)
      -> loss, _ = te_linear_cross_entropy(x[..., :-1, :], lm_head.w, lm_head.b, labels)

Between the layer and the loss it follows: dtype casts, views and reshapes to [N, V], ``contiguous``,
row slicing that leaves the vocab dim whole (the causal shift; replayed on x, since a linear works
row by row), and Gemma 2's soft-cap ``tanh(z / c) * c``. The loss must be ``cross_entropy`` with class
indices, no class weights, reduction ``mean`` or ``sum`` (Hugging Face's ``num_items_in_batch``
division stays in the graph, after the op). When the model also returns the logits, the op computes
them for that output, without saving them; they do not require grad.

Runs right after the linear passes: the final norm's fusion would otherwise take the output layer
(the norm pass then fuses that norm into this op, norm_fusion.py). One row per loss site, ``op = "linear_cross_entropy"``, named after the output layer's module.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..distributed import is_dtensor
from ..lowerings.linear import LinearLowering
from ..lowerings.linear_cross_entropy import (LinearCrossEntropyLowering, LinearCrossEntropySpec, chunk_rows,
                                              size_hint)
from ..lowerings.vocab_parallel import plan_vocab_parallel
from ..fx.editing import insert_call, replace_node
from ..fx.gemm_operands import LinearSite
from ..fx.graphs import GraphScope, module_fqn
from ..fx.matching import CASTS, MUL, calls, method_or_name, shape_of, value_of, written_between
from .context import PassContext
from .linear import find_linear_sites

__all__ = ["fuse_linear_cross_entropy"]

_CROSS_ENTROPY = (F.cross_entropy, torch._C._nn.cross_entropy_loss)
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_VIEWS = ("view", "reshape", "flatten")
_DIV = (operator.truediv, torch.div, torch.true_divide, torch.Tensor.div)


def _loss_args(node: fx.Node) -> Optional[dict]:
    """F.cross_entropy's arguments by name, or None for another call."""
    if not calls(node, _CROSS_ENTROPY, "__no_method__"):
        return None
    try:
        bound = _CE_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _why_not_loss(args: dict) -> Optional[str]:
    if args["weight"] is not None:
        return "class weights"
    if args["size_average"] is not None or args["reduce"] is not None:
        return "the deprecated size_average / reduce arguments"
    if args["reduction"] not in ("mean", "sum"):
        return f"reduction={args['reduction']!r} (mean and sum are fused)"
    if not isinstance(args["ignore_index"], int) or not isinstance(args["label_smoothing"], (int, float)):
        return "ignore_index or label_smoothing computed in the graph"
    target = value_of(args["target"])
    if target is None or target.is_floating_point():
        return "class probabilities as targets"
    return None


def _softcap(node: fx.Node) -> Optional[tuple[fx.Node, float]]:
    """(z, c) when ``node`` is ``tanh(z / c) * c`` (Gemma 2's logit soft-capping), else None."""
    if not calls(node, MUL, "mul") or len(node.args) != 2:
        return None
    a, b = node.args
    t, c = (a, b) if isinstance(a, fx.Node) else (b, a)
    if not isinstance(c, (int, float)) or method_or_name(t) != "tanh" or len(t.users) != 1:
        return None
    d = t.args[0]
    if not calls(d, _DIV, "div") or len(d.args) != 2 or d.args[1] != c or len(d.users) != 1:
        return None
    return d.args[0], float(c)


@dataclass
class _Path:
    """What lies between the output layer and the loss (``_walk``)."""

    layer: Optional[fx.Node] = None
    steps: list = field(default_factory=list)   # ("cast", dtype) / ("softcap", c), in forward order
    moves: list = field(default_factory=list)   # ("getitem", index) / ("rows", None), in forward order
    chain: list = field(default_factory=list)   # the nodes passed, from the loss's input back
    exposed: Optional[fx.Node] = None           # the one node on the way the graph also returns
    exposed_steps: int = 0                      # how many of ``steps`` the exposed value has had
    why: Optional[str] = None


def _walk(loss: fx.Node, loss_input: fx.Node, is_layer) -> _Path:
    """From the loss's input back to the output layer. Every node on the way must be read only by the
    next, except one that the graph also returns (Hugging Face's logits, soft-capped or not): the op
    then returns that value too, so the loss must read all its rows."""
    path, node, successor = _Path(), loss_input, loss
    while True:
        if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
            path.why = ("its logits come from another graph: a graph break lies between the output layer and "
                        "the loss (docs/output-layer.md names a known one)"
                        if isinstance(node, fx.Node) and node.op == "placeholder" else "its input is not computed by a linear")
            return path
        extra = [u for u in node.users if u is not successor]
        if extra:
            if path.exposed is not None or any(u.op != "output" for u in extra):
                path.why = f"{node.name} between the output layer and the loss has other readers"
                return path
            path.exposed, path.exposed_steps = node, len(path.steps)
        if is_layer(node):
            path.layer = node
            break
        path.chain.append(node)
        name = method_or_name(node)
        capped = _softcap(node)
        if capped is not None:
            path.steps.insert(0, ("softcap", capped[1]))
            tanh = node.args[0] if isinstance(node.args[0], fx.Node) else node.args[1]
            path.chain += [tanh, tanh.args[0]]
            successor, node = tanh.args[0], capped[0]
            continue
        src = node.args[0] if node.args else None
        if name in CASTS or (name == "to" and src is not None):
            if value_of(node) is None or value_of(src) is None or value_of(node).device != value_of(src).device:
                path.why = f"{name} moves the logits to another device"
                return path
            if value_of(node).dtype != value_of(src).dtype:
                path.steps.insert(0, ("cast", value_of(node).dtype))
        elif name == "contiguous" or (name == "redistribute" and _same_placements(node, src)):
            pass   # a redistribute to the placements it has (ColwiseParallel's output_layouts=Shard(-1))
        elif name in _VIEWS:
            shape = shape_of(node)
            if shape is None or len(shape) != 2:
                path.why = f"{name} to {shape} (views to [tokens, vocab] are followed)"
                return path
            path.moves.insert(0, ("rows", None))
        elif node.op == "call_function" and node.target is operator.getitem and _keeps_last_dim(node):
            path.moves.insert(0, ("getitem", node.args[1]))
        else:
            path.why = f"{name} between the output layer and the loss"
            return path
        successor, node = node, src
    if path.exposed is not None:
        # the op replays the row slices on x, so it could return only the sliced rows
        if any(kind == "getitem" for kind, _ in path.moves):
            path.why = "the graph returns the logits and the loss reads a slice of their rows"
            return path
        path.exposed_steps = len(path.steps) - path.exposed_steps
    return path


def _same_placements(node: fx.Node, src) -> bool:
    a, b = value_of(node), value_of(src)
    return is_dtensor(a) and is_dtensor(b) and tuple(a.placements) == tuple(b.placements)


def _keeps_last_dim(node: fx.Node) -> bool:
    """A getitem of basic slices / ints over the leading dims that keeps the last (vocab) dim whole."""
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if not index or any(not isinstance(i, (slice, int, type(Ellipsis))) or isinstance(i, bool) for i in index):
        return False
    src, out = shape_of(node.args[0]), shape_of(node)
    if src is None or out is None or not out or out[-1] != src[-1]:
        return False
    last = index[-1]
    if last is Ellipsis:
        return True
    if any(i is Ellipsis for i in index):
        return last == slice(None)
    return len(index) < len(src) or last == slice(None)


def _layer_operands(node: fx.Node, plain: dict[fx.Node, LinearSite]):
    """(x, weight, bias, extra args, spec recipe, weight_in_out, fqn) of the output layer's call."""
    if isinstance(node.target, LinearLowering):
        spec = node.target.spec
        x, weight, bias, *extra = node.args
        return x, weight, bias, extra, spec.recipe, spec.weight_in_out, spec.fqn
    site = plain[node]
    return site.x, site.weight, site.bias, [], None, site.weight_in_out, site.fqn


def _why_not_layer(node: fx.Node, plain: dict[fx.Node, LinearSite]) -> Optional[str]:
    if isinstance(node.target, LinearLowering):
        spec = node.target.spec
        if spec.weight_first:
            return "the output layer reads the weight on the left (W @ x)"
        if not spec.recipe.per_tensor:
            return f"{spec.recipe.name}: the fused output layer takes per-tensor recipes and high precision"
        if spec.amax_groups and any(spec.amax_groups):
            return "the output layer is sharded by hand across ranks"
        return None
    site = plain[node]
    if site.unsupported is not None:
        return site.unsupported
    if site.weight_first or site.expert is not None or site.op_name not in ("linear", "matmul", "mm", "addmm"):
        return f"the output layer is a {site.op_name}"
    bias = value_of(site.bias) if site.bias is not None else None
    if bias is not None and bias.dim() != 1:
        return "the output layer's addend is not a [vocab] bias"
    return None


def fuse_linear_cross_entropy(ctx: PassContext, scope: GraphScope) -> int:
    """Fuse each ``cross_entropy`` of ``scope`` with the output layer it reads; one row per loss."""
    plain = {site.node: site for site in find_linear_sites(scope)}

    def is_layer(n) -> bool:
        return isinstance(n, fx.Node) and (isinstance(n.target, LinearLowering) or n in plain)

    count = 0
    for node in list(scope.graph.nodes):
        args = _loss_args(node) if node.op == "call_function" else None
        if args is None:
            continue
        path = _walk(node, args["input"], is_layer)
        layer = path.layer
        fqn = scope.fqn(module_fqn(layer if layer is not None else node))
        recipe = layer.target.spec.recipe if layer is not None and isinstance(layer.target, LinearLowering) else None
        record = ctx.recorder(scope, node, fqn, "linear_cross_entropy",
                              "" if shape_of(args["input"]) is None else
                              f"logits[{', '.join(str(d) for d in shape_of(args['input']))}]")
        label = recipe.name if recipe is not None else None
        if not ctx.config.rewrite.linear_cross_entropy:
            record(False, "[rewrite] linear_cross_entropy = false", label)
            continue
        if scope.unsupported is not None:
            record(False, scope.unsupported, label)
            continue
        why = path.why or _why_not_loss(args) or _why_not_layer(layer, plain)
        if why is None and len(shape_of(args["input"]) or ()) != 2:
            why = "the loss reads logits that are not [tokens, vocab]"
        x, weight, bias, extra, recipe, weight_in_out, layer_fqn = (_layer_operands(layer, plain) if why is None
                                                                   else (None,) * 7)
        plan = None
        if why is None and any(is_dtensor(value_of(t)) for t in (x, weight) if t is not None):
            try:
                plan = plan_vocab_parallel(value_of(x), value_of(weight), value_of(bias) if bias is not None else None,
                                           value_of(args["target"]), w_in_out=weight_in_out)
            except ValueError as e:
                why = f"vocab parallel: {e}"
        if why is None:
            names = written_between(x, layer, node)
            why = f"its input is written in place ({', '.join(names)}) before the loss" if names else None
        if why is not None:
            record(False, why, label)
            continue
        vocab = value_of(weight).shape[1 if weight_in_out else 0]
        spec = LinearCrossEntropySpec(
            layer_fqn, recipe, tuple(path.steps), args["ignore_index"], args["reduction"],
            float(args["label_smoothing"]), ctx.config.rewrite.linear_cross_entropy_chunk,
            path.exposed_steps if path.exposed is not None else -1, weight_in_out)
        rows = size_hint(math.prod(shape_of(args["input"])[:-1]))   # the lowering's own row count
        local = plan.shard.local if plan is not None else vocab
        chunk = chunk_rows(rows, value_of(x).shape[-1], local, spec.chunk)
        what = f"{recipe.name} FP8 GEMMs" if recipe is not None else "high-precision GEMMs"
        collectives = ""
        if plan is not None:
            what += f", vocab parallel: [tokens, {local}] logits per rank"
            collectives = (f"all-reduce over {plan.shard.group}: per token max (MAX), sum-exp and target logit "
                           f"(SUM){'; weight amax (MAX)' if recipe is not None and not recipe.delayed() else ''}")
        saved = ", both in FP8" if recipe is not None else ""
        note = ("; the logits are still computed for the model's output (they do not require grad)"
                if path.exposed is not None else "")
        record(True, f"fused with {layer_fqn or 'the output layer'} ({what}): {chunk}-row chunks, the logits' gradient "
                     f"made in the forward and saved with x{saved}, no [tokens, {vocab}] logits{note}", label, collectives)
        _replace(scope.graph, node, path, LinearCrossEntropyLowering(spec),
                 (x, weight, bias, args["target"], None, None, *extra))
        count += 1
    return count


def _replace(graph: fx.Graph, loss: fx.Node, path: _Path, lowering: LinearCrossEntropyLowering,
             operands: tuple) -> None:
    """The loss becomes ``lowering(x rows, w, b, labels, *extra, x_full=x)[0]`` (``x_full`` only when
    rows were sliced off); the graph output that read the exposed logits takes ``[1]``; the chain and
    the layer go."""
    x, *rest = operands
    moves = list(path.moves)
    while moves and moves[-1][0] == "rows":   # the lowering flattens the rows itself (and returns the
        moves.pop()                           # logits in the layer's own shape)
    # a row slice drops rows the unfused layer still quantizes: the op takes the whole input for its amax
    kwargs = {"x_full": x} if any(kind == "getitem" for kind, _ in moves) else {}
    with graph.inserting_before(loss):
        for kind, index in moves:   # the logits' row moves, replayed on the layer's input
            if kind == "getitem":
                x = graph.call_function(operator.getitem, (x, index))
            else:
                x = graph.call_method("reshape", (x, -1, value_of(operands[0]).shape[-1]))
        call = graph.call_function(lowering, (x, *rest), kwargs)
    new_loss = insert_call(loss, operator.getitem, (call, 0), like=loss)
    if path.exposed is not None:
        logits = insert_call(loss, operator.getitem, (call, 1), like=path.exposed)
        for user in [u for u in path.exposed.users if u.op == "output"]:
            user.replace_input_with(path.exposed, logits)
    replace_node(loss, new_loss)
    for gone in [*path.chain, path.layer]:   # from the loss's input back to the layer
        if not gone.users:
            graph.erase_node(gone)
