"""The input side of the fp8_mha pass: FP8 attention under DelayedScaling takes Q, K and V in FP8
from the projections that make them (lowerings/attention_inputs.py). The fp8_mha pass
(attention_projection.py) calls ``hand_off_inputs`` for each site with ``fp8_mha = true`` before it
hands O over, and writes the site's one report row with both outcomes.

    y = te_linear(x, w, b)                    (or a fused norm's output for one of its linears)
    q, k, v = y.split(C, dim=2) -> view(B, T, H, D) -> transpose(1, 2)    any moves, no arithmetic
    o = te_fp8_attention(q, k, v, mask, *delayed state)

becomes

    y8, amaxes = te_column_quantize(y, q_scale, k_scale, v_scale)     (uint8 bits of E4M3)
    q8, k8, v8 = the same moves replayed on y8
    o = te_fp8_attention(q, k, v, mask, *delayed state, q8, k8, v8, amaxes)   (None for one not handed)

q, k, v stay arguments: the attention's backward returns their gradients, which reach the projection
through the original moves. Which columns of y go to q, k or v is found by replaying the moves on a
tensor of column indices (its rows broadcast: only a move that must copy, such as repeat_kv's
reshape, allocates). A ``cat`` onto statically empty tensors (transformers' DynamicCache appending
the first keys and values) counts as a move.

Each of q, k, v is handed over on its own. One computed from its projection by anything but moves
(rotary embeddings, a scaling multiply, a norm, a cast) is quantized by the attention lowering in
the traced graph once it is computed (attention_forward: inductor fuses the cast with the rotation),
and so is one whose projection output it shares with such a tensor (casting all of an output for a
part of it is not done). A site none of whose q, k, v is handed over stays as it was, attention_forward
quantizing all three, and so does every site under current scaling (Q, K, V are scaled per (batch,
head) from their own amaxes, which exist only once the projection has written them). The report row
says which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..lowerings.activation_fusion import ActivationLinearLowering
from ..lowerings.attention_inputs import ColumnQuantizeLowering, ColumnQuantizeSpec
from ..lowerings.attention import AttentionLowering
from ..lowerings.linear import LinearLowering
from ..lowerings.norm_fusion import NormLinearsLowering
from ..fx.editing import replace_with_call
from ..fx.graphs import GraphScope
from ..fx.matching import method_or_name, value_of

__all__ = ["hand_off_inputs"]

# ops that move elements without changing them: each element once, or (_REPEATS) every element the same
# number of times (transformers' repeat_kv for grouped-query attention), so that a role's amax is the
# amax of its columns exactly when it holds all of their elements
_REPEATS = ("expand", "repeat_interleave")
_MOVES = ("view", "reshape", "transpose", "permute", "contiguous", "split", "chunk", "unbind", "getitem",
          "unflatten", "flatten", "squeeze", "unsqueeze", "narrow", "swapaxes", "swapdims", "movedim",
          "split_with_sizes", *_REPEATS)
_ROLES = ("q", "k", "v")
_CATS = (torch.cat, torch.concat, torch.concatenate)


def _appended_to_nothing(node: fx.Node) -> Optional[fx.Node]:
    """x for ``torch.cat([empty, x])``, a cat whose other operands are statically empty; else None.

    transformers' DynamicCache (5.24) starts each layer's keys and values as ``torch.tensor([])``
    and appends by ``cat``, so a training forward's k and v are ``cat([tensor([]), k])``: the same
    values, a move.
    """
    if node.op != "call_function" or node.target not in _CATS or not node.args:
        return None
    operands = node.args[0]
    if not isinstance(operands, (list, tuple)) or not all(isinstance(t, fx.Node) for t in operands):
        return None
    sizes = [getattr(value_of(t), "numel", lambda: None)() for t in operands]
    if any(not isinstance(n, int) for n in sizes):    # unknown or symbolic
        return None
    full = [t for t, n in zip(operands, sizes) if n]
    if len(full) != 1 or getattr(value_of(node), "dtype", None) != getattr(value_of(full[0]), "dtype", None):
        return None     # an empty operand of another dtype would make the cat a cast too
    return full[0]


def _projection(node: fx.Node) -> Optional[str]:
    """The module path of the per-tensor FP8 linear whose output ``node`` is, else None."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, (LinearLowering, ActivationLinearLowering)):
        if target.spec.recipe.per_tensor and not getattr(target.spec, "weight_first", False):
            return getattr(target.spec, "linear", None) or target.spec.fqn or "<root>"
        return None
    if target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].op == "call_function":
        fused = node.args[0].target
        if isinstance(fused, NormLinearsLowering) and node.args[1] < len(fused.spec.consumers):
            return fused.spec.consumers[node.args[1]] or "<root>"
    return None


def _trace_back(node: fx.Node, role: str) -> Union[str, tuple[fx.Node, list[fx.Node]]]:
    """(projection output, the moves from it to ``node``, in graph order), or why not."""
    chain = []
    while _projection(node) is None:
        appended = _appended_to_nothing(node)
        if appended is not None:
            chain.append(node)
            node = appended
            continue
        name = method_or_name(node)
        if name not in _MOVES or not node.args or not isinstance(node.args[0], fx.Node):
            return f"{role} is made by {name or node.op}, not moved out of a per-tensor FP8 linear's output"
        if name == "getitem" and not _basic_index(node.args[1]):
            return f"{role} is indexed by a tensor"
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def _basic_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


def _value(a: Any, env: dict[fx.Node, Any]) -> Any:
    """An argument of a move with the nodes replaced: moved values from ``env``, sizes by the ints
    Dynamo recorded for them."""
    if isinstance(a, fx.Node):
        if a in env:
            return env[a]
        example = a.meta.get("example_value")
        if isinstance(example, int) and not isinstance(example, bool):
            return example
        raise ValueError(f"{a.name} is not a constant")
    if isinstance(a, (tuple, list)):
        return type(a)(_value(x, env) for x in a)
    if isinstance(a, slice):
        return slice(_value(a.start, env), _value(a.stop, env), _value(a.step, env))
    if isinstance(a, torch.SymInt):
        raise ValueError("a symbolic size")
    return a


def _run(node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """``node`` (a move) applied to the values in ``env``; ``contiguous`` and a cat onto nothing are
    skipped (they would copy the broadcast probe, and they move nothing)."""
    appended = _appended_to_nothing(node)
    if appended is not None:
        return env[appended]
    args, kwargs = _value(node.args, env), _value(dict(node.kwargs), env)
    if node.op == "call_method":
        if node.target == "contiguous":
            return args[0]
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def _columns(source: fx.Node, moves: list[fx.Node], chains: list[list[fx.Node]],
             names: list[str]) -> Union[str, list[tuple[int, int]]]:
    """Per chain of moves from ``source`` (its last node the end: q, k or v, named in ``names``;
    empty for ``source`` itself), the range of ``source``'s last-dim columns the end holds, (first,
    end), when it holds all elements of those columns and nothing else; else why not."""
    y = value_of(source)
    if y is None or not all(isinstance(d, int) for d in y.shape):
        return "the projection's output has no static shape"
    n = y.shape[-1]
    probe = torch.arange(n, dtype=torch.int32).expand(y.shape)   # column indices, rows broadcast
    env: dict[fx.Node, Any] = {source: probe}
    try:
        for node in moves:
            env[node] = _run(node, env)
    except (ValueError, RuntimeError, TypeError, IndexError) as e:
        return f"could not follow the moves from the projection ({e})"
    rows = y.numel() // n if n else 0
    found = []
    for chain, name in zip(chains, names):
        cols = env[chain[-1]] if chain else probe
        # how many times the repeats hold each element (expand, repeat_interleave by an int: all alike)
        copies = 1
        for move in chain:
            if method_or_name(move) in _REPEATS:
                copies *= env[move].numel() // max(1, env[move.args[0]].numel())
        lo, hi = int(cols.min()), int(cols.max()) + 1
        if cols.numel() != rows * (hi - lo) * copies:   # otherwise some element of the range is missing
            # e.g. GPT-NeoX: [B, T, H, 3 * D] chunked per head, so v's columns interleave with q's and k's
            return f"{name} is not one whole range of its projection's columns"
        found.append((lo, hi))
    return found


def _plan(node: fx.Node) -> tuple[list[tuple[fx.Node, list[fx.Node], tuple[tuple[int, int, int], ...], str]],
                                   dict[int, str]]:
    """Which of q, k, v (roles 0, 1, 2) the attention call ``node`` can take in FP8 from their
    projections: per projection output handing some over, (output, its moves, its segments (role,
    first, end column), the projection's name); and per role left out, why."""
    why: dict[int, str] = {}
    traced: dict[int, tuple[fx.Node, list[fx.Node]]] = {}
    for role, (arg, name) in enumerate(zip(node.args[:3], _ROLES)):
        found = _trace_back(arg, name)
        if isinstance(found, str):
            why[role] = found
        else:
            traced[role] = found
    sources: dict[fx.Node, list[int]] = {}
    for role, (source, _) in traced.items():
        sources.setdefault(source, []).append(role)
    position = {n: i for i, n in enumerate(node.graph.nodes)}.__getitem__
    plans = []
    for source, roles in sources.items():
        moves = sorted({m for r in roles for m in traced[r][1]}, key=position)
        columns = _columns(source, moves, [traced[r][1] for r in roles], [_ROLES[r] for r in roles])
        if isinstance(columns, str):
            why.update({r: columns for r in roles})
            continue
        spans = sorted(columns)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            why.update({r: "q, k and v share columns of one projection" for r in roles})
            continue
        if sum(hi - lo for lo, hi in spans) != value_of(source).shape[-1]:
            # the others' columns are in the same output: casting all of it for a part is not done
            why.update({r: f"{_ROLES[r]} is cut from a projection output whose other columns are not handed over"
                        for r in roles})
            continue
        segments = tuple((role, *cols) for role, cols in zip(roles, columns))
        plans.append((source, moves, segments, _projection(source)))
    return plans, why


def _like(example: Any, dtype: torch.dtype, shape: Optional[tuple] = None) -> Any:
    """A fake tensor (or tuple of them) like ``example`` in ``dtype`` (and ``shape``, contiguous), made
    in its fake mode: the example value Dynamo would have recorded for a new node."""
    if isinstance(example, (tuple, list)):
        return type(example)(_like(e, dtype) for e in example)
    if not isinstance(example, torch.Tensor):
        return example
    mode = getattr(example, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        if shape is not None:
            return torch.empty(shape, dtype=dtype, device=example.device)
        return torch.empty_strided(example.shape, example.stride(), dtype=dtype, device=example.device)


def _reasons(why: dict[int, str]) -> str:
    """Why the roles left out were, each reason once: "q and k are made by add, ...; v is ..."."""
    groups: dict[str, list[str]] = {}     # "made by add, ..." -> ["q", "k"]; a whole sentence -> []
    for role in sorted(why):
        name, text = _ROLES[role], why[role]
        if text.startswith(f"{name} is "):
            groups.setdefault(text[len(name) + 4:], []).append(name)
        else:   # a reason about another role, or all of them
            groups.setdefault(text, [])
    parts = (f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'} {rest}" if names else rest
             for rest, names in groups.items())
    return "; ".join(dict.fromkeys(parts))


def _handed_text(plans, why: dict[int, str]) -> str:
    """The report's words: "FP8 Q, K, V from attn.qkv (...)", and what became of the others."""
    def names(roles):
        return ", ".join(_ROLES[r].upper() for r in sorted(roles))

    handed = {role for _, _, segments, _ in plans for role, _, _ in segments}
    projections = ", ".join(dict.fromkeys(name for *_, name in plans))
    text = f"FP8 {names(handed)} from {projections} (quantized once, at the projection's output)"
    if why:
        verb = "it is" if len(why) == 1 else "they are"
        text += f"; {names(why)} quantized in the graph once {verb} computed ({_reasons(why)})"
    return text


def hand_off_inputs(scope: GraphScope, node: fx.Node) -> tuple[fx.Node, bool, str]:
    """Hand the fp8_mha attention call ``node`` its Q, K, V in FP8 from their projections where it
    can: (the attention call, which replaces ``node`` when anything was handed over; whether
    anything was; the report's words for it)."""
    spec = node.target.spec
    if not spec.delayed:
        why = ("current scaling scales them per (batch, head) from amaxes known only after the projections"
               if not spec.recipe.delayed() else "no delayed-scaling state here to quantize them with")
        return node, False, f"Q, K, V arrive in high precision: {why}"
    plans, why = _plan(node)
    if not plans:
        return node, False, f"Q, K, V arrive in high precision: {_reasons(why)}"
    _, q_scale, k_scale, v_scale, _ = node.args[4:9]
    graph = scope.graph
    bits: dict[int, fx.Node] = {}
    amaxes = []
    with graph.inserting_before(node):
        for source, moves, segments, name in plans:
            y = value_of(source)
            quantize = ColumnQuantizeLowering(ColumnQuantizeSpec(name, segments, y.shape[-1]))
            pair = graph.call_function(quantize, (source, q_scale, k_scale, v_scale))
            env = {source: graph.call_function(operator.getitem, (pair, 0))}
            amaxes.append(graph.call_function(operator.getitem, (pair, 1)))
            env[source].meta["example_value"] = _like(y, torch.uint8)
            amaxes[-1].meta["example_value"] = _like(y, torch.float32, (3,))
            for move in moves:
                appended = _appended_to_nothing(move)
                if appended is not None:     # the empty operand is in y's dtype: cat would promote
                    env[move] = env[appended]
                    continue
                env[move] = graph.node_copy(move, lambda n: env.get(n, n))
                # as the moved y's, in uint8: AOTAutograd's cache reads methods' targets from them
                env[move].meta["example_value"] = _like(move.meta.get("example_value"), torch.uint8)
            bits.update({role: env[node.args[role]] for role, _, _ in segments})
    new = replace_with_call(node, AttentionLowering(dataclasses.replace(spec, fp8_inputs=len(plans))),
                            (*node.args, *(bits.get(role) for role in range(3)), *amaxes))
    return new, True, _handed_text(plans, why)
