"""The fp8_mha pass: an FP8 attention site whose output feeds one FP8 linear (the output projection)
becomes one site with it (lowerings/attention_projection.py), so O is quantized and saved once; first
its Q, K, V are handed over in FP8 from their projections where they can be (attention_inputs.py).
Runs after the attention pass, on its calls, for sites whose recipe has ``fp8_mha = true``.

    o = te_fp8_attention(q, k, v, mask)        [B, H, T, D]
    x = o.transpose(1, 2)[.contiguous()].reshape(B, T, H*D)   (or .view, or [B*T, H*D])
    y = te_linear(x, w, b)                      a per-tensor recipe

One report row per fp8_mha site (op "fp8_mha", fqn = the module calling SDPA): "FP8 O handed to
<projection>", or why not.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..lowerings.attention_projection import AttentionProjectionLowering, AttentionProjectionSpec
from ..lowerings.attention import AttentionLowering
from ..report import SiteRecord
from ..fx.editing import erase_nodes, replace_with_call
from ..fx.graphs import GraphScope
from ..fx.matching import method_or_name, shape_text, value_of
from .attention_inputs import hand_off_inputs
from .readers import Reader, dying, find_readers, linear_name, why_not_fused_linear
from .context import PassContext

__all__ = ["hand_off_fp8_mha"]

_RESHAPES = ("reshape", "view", "flatten")


def _dims(node: fx.Node) -> list:
    return [a for a in node.args[1:]] + [v for k, v in node.kwargs.items() if k in ("dim0", "dim1", "dims")]


def _heads_to_tokens(node: fx.Node, src: fx.Node) -> bool:
    """``node`` is ``src.transpose(1, 2)`` or ``src.permute(0, 2, 1, 3)`` (any spelling of the dims)."""
    if not node.args or node.args[0] is not src:
        return False
    name = method_or_name(node)
    dims = _dims(node)
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = list(dims[0])
    if not all(isinstance(d, int) for d in dims):
        return False
    dims = [d % 4 for d in dims]
    if name in ("transpose", "swapaxes", "swapdims"):
        return sorted(dims) == [1, 2]
    return name == "permute" and dims == [0, 2, 1, 3]


def _same_shape(a, b) -> bool:
    return (a is not None and a.dim() == b.dim()
            and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape)))


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _projection(out: fx.Node) -> tuple[Optional[Reader], bool, str]:
    """(the linear reading the attention output ``out`` as [B, T, H*D] or [B*T, H*D], flat?, why
    not: "" when it can take O in FP8)."""
    b, h, t, d = value_of(out).shape
    src, node = out, _only_user(out)
    # views that keep [B, H, T, D] (transformers reshapes the output to its own shape first)
    while (node is not None and method_or_name(node) in (*_RESHAPES, "contiguous") and node.args[0] is src
           and _same_shape(value_of(node), value_of(out))):
        src, node = node, _only_user(node)
    if node is None or not _heads_to_tokens(node, src):
        return None, False, "its output is read other than as transpose(1, 2) into one projection"
    nxt = _only_user(node)
    while nxt is not None and method_or_name(nxt) == "contiguous":
        node, nxt = nxt, _only_user(nxt)
    if nxt is None or method_or_name(nxt) not in _RESHAPES or nxt.args[0] is not node:
        return None, False, "its transposed output is not reshaped to [B, T, H*D] for one reader"
    if value_of(nxt) is None:
        return None, False, "its reshaped output has no recorded shape"
    shape = value_of(nxt).shape
    merged = statically_known_true(shape[-1] == h * d)
    if len(shape) == 3 and merged and statically_known_true(shape[0] == b) and statically_known_true(shape[1] == t):
        flat = False
    elif len(shape) == 2 and merged and statically_known_true(shape[0] == b * t):
        flat = True
    else:
        return None, False, f"its output is reshaped to {list(shape)}, not [B, T, H*D]"
    readers = find_readers(nxt)
    if len(readers.linears) != 1 or readers.others:
        return None, False, "the reshaped output has readers other than one FP8 linear"
    reader = readers.linears[0]
    why = why_not_fused_linear(reader, "attention")
    if why is None and reader.casts:
        why = "a dtype cast between attention and the projection"
    return reader, flat, why or ""


def hand_off_fp8_mha(ctx: PassContext, scope: GraphScope) -> int:
    """Hand each fp8_mha attention site its Q, K, V in FP8 from their projections and its FP8 O to
    the projection reading it; one row per site, counted when either side was handed over."""
    count = 0
    for node in list(scope.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, AttentionLowering):
            continue
        if not getattr(node.target.spec.recipe, "fp8_mha", False):
            continue
        node, inputs_handed, inputs_text = hand_off_inputs(scope, node)
        attention = node.target
        spec = attention.spec
        reader, flat, why = _projection(node)

        def record(fused: bool, reason: str) -> None:
            # sorted after the attention's own row: at the first reader of its output
            ctx.record(scope, next(iter(node.users), node), SiteRecord(
                fqn=spec.fqn, op="fp8_mha", recipe=spec.recipe.name, rewritten=fused or inputs_handed,
                reason=f"{reason}; {inputs_text}{scope.where}", shapes=shape_text("o", node) or "",
                graph=ctx.graph_id))

        if reader is None or why:
            where = f"{linear_name(reader)}: " if reader is not None else ""
            record(False, f"{where}{why}; O goes to the projection in high precision")
            count += inputs_handed
            continue
        linear = reader.node.target
        record(True, f"FP8 O handed to {linear_name(reader)} (quantized and saved once)")
        # the call's arguments: q, k, v, mask, *delayed state, then the FP8 inputs (if handed over)
        n_fp8 = 3 + spec.fp8_inputs if spec.fp8_inputs else 0
        a_delayed = node.args[4:len(node.args) - n_fp8]
        fp8_inputs = node.args[len(node.args) - n_fp8:] if n_fp8 else ()
        fused = AttentionProjectionLowering(
            AttentionProjectionSpec(spec, linear.spec.fqn, linear.spec.recipe, flat), attention, linear,
            len(a_delayed))
        going = dying([reader])
        chain = [n for n in _chain(node, reader) if n not in going]
        replace_with_call(reader.node, fused, (*node.args[:4], *a_delayed, *reader.node.args[1:], *fp8_inputs))
        # the linear's input chain back to the attention call, and the call itself
        erase_nodes({*going, *chain, node} - {reader.node})
        count += 1
    return count


def _chain(out: fx.Node, reader: Reader) -> list[fx.Node]:
    """The nodes between the attention call and the reader's chain (transpose, contiguous, reshape)."""
    nodes, node = [], _only_user(out)
    first = reader.chain[0] if reader.chain else reader.node
    while node is not None and node is not first and node is not reader.node:
        nodes.append(node)
        node = _only_user(node)
    return nodes
