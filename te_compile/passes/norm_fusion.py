"""The norm pass: a LayerNorm / RMSNorm whose output feeds FP8 linears becomes one operation with them.

Runs after the linear pass, on its ``LinearLowering`` calls. For each norm site (norm_sites.py) it
follows the output through the ops that do not change the values' layout (dtype casts, dropout that
drops nothing, views keeping the last dim) to the linears reading it. The readers under one
per-tensor recipe with the same casts on the way are fused (lowerings/norm_linear.py); every other
reader keeps reading a high-precision output, which the fused operation also returns (or, where the
graph's order does not allow that, the original norm nodes keep computing). One report row per norm
site: "fused into <the linears' paths>", or why not.

    h = ln(x); q = q_proj(h); k = k_proj(h.view(...)); r = h + 1
 -> q, k, h = te_norm_linears(x, ln.w, ln.b, (x, x.view(...)), ((q.w, q.b), (k.w, k.b))); r = h + 1
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.fx as fx

from ..lowerings.fp8_linear import NO_GROUPS, PER_TENSOR_RECIPES
from ..lowerings.linear import LinearLowering
from ..lowerings.norm_linear import NormLinearsLowering, NormLinearsSpec
from ..lowerings.sharded_linear import is_dtensor
from ..report import SiteRecord
from .graphs import GraphScope
from .norm_sites import NormSite, find_norm_sites

if TYPE_CHECKING:
    from . import PassContext

__all__ = ["fuse_norms"]

_CASTS = ("to", "type", "type_as", "float", "half", "bfloat16")
_VIEWS = ("view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "contiguous")
_DROPOUT = (torch.nn.functional.dropout, torch.dropout)


@dataclass
class _Reader:
    """A linear reading the norm output through ``chain`` (the casts and views on the way)."""

    node: fx.Node                  # the LinearLowering call
    chain: list[fx.Node]           # from the first op after the norm to the linear's input
    casts: tuple[torch.dtype, ...]


@dataclass
class _Readers:
    linears: list[_Reader] = field(default_factory=list)
    others: list[fx.Node] = field(default_factory=list)   # nodes reading a high-precision value


def _method_or_name(node: fx.Node) -> Optional[str]:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", None)
    return None


def _dtype(node: fx.Node) -> Optional[torch.dtype]:
    value = node.meta.get("example_value")
    return value.dtype if isinstance(value, torch.Tensor) else None


def _shape(node) -> Optional[tuple]:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _passes_through(node: fx.Node, src: fx.Node) -> Optional[str]:
    """"cast" / "view" / "identity" when ``node`` hands ``src``'s values on unchanged in row layout."""
    if not node.args or node.args[0] is not src or any(a is src for a in node.args[1:]) \
            or any(v is src for v in node.kwargs.values()):
        return None
    name = _method_or_name(node)
    if name in _CASTS and _dtype(node) in (torch.float32, torch.bfloat16, torch.float16):
        return "cast"
    if node.op == "call_function" and node.target in _DROPOUT:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
        return "identity" if (p == 0 or training is False) else None
    before, after = _shape(src), _shape(node)
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


def _readers(out: fx.Node) -> _Readers:
    found = _Readers()

    def walk(node: fx.Node, chain: list[fx.Node], casts: tuple) -> None:
        for user in node.users:
            if isinstance(user.target, LinearLowering) and user.args[0] is node and node not in user.args[1:]:
                found.linears.append(_Reader(user, chain, casts))
                continue
            kind = _passes_through(user, node)
            if kind is None:
                found.others.append(user)
            else:
                walk(user, chain + [user], casts + ((_dtype(user),) if kind == "cast" else ()))

    walk(out, [], ())
    return found


def _linear_fusable(reader: _Reader) -> Optional[str]:
    """None when the linear can take its input from the fused norm, else why not."""
    spec = reader.node.target.spec
    if not isinstance(spec.recipe, PER_TENSOR_RECIPES):
        return f"recipe {spec.recipe.name} (norm fusion covers the per-tensor FP8 recipes)"
    if spec.weight_first:
        return "weight-first product"
    if spec.amax_groups != NO_GROUPS:
        return "sharded by hand"
    x = reader.node.args[0].meta.get("example_value")
    w = reader.node.args[1].meta.get("example_value")
    if is_dtensor(x) or is_dtensor(w):
        return "DTensor operands"
    return None


def _view_inputs(reader: _Reader, x: fx.Node, graph: fx.Graph) -> fx.Node:
    """The reader's views replayed on the norm input x (same shape as the norm output), for the
    output's shape: x itself when there are none."""
    node = x
    for op in reader.chain:
        if _passes_through(op, op.args[0]) != "view":
            continue
        new = graph.create_node(op.op, op.target, (node, *op.args[1:]), dict(op.kwargs))
        new.meta.update(op.meta)
        node = new
    return node


def _record(ctx: "PassContext", scope: GraphScope, site: NormSite, fused: bool, reason: str,
            recipe: Optional[str] = None) -> None:
    shapes = " ".join(f"{name}[{', '.join(str(d) for d in shape)}]"
                      for name, node in (("x", site.x or site.node), ("w", site.weight), ("b", site.bias))
                      if (shape := _shape(node)) is not None)
    where = f"; in a {scope.region}" if scope.region and scope.unsupported is None else ""
    ctx.record(scope, site.node, SiteRecord(fqn=site.fqn, op=site.op, recipe=recipe, rewritten=fused,
                                            reason=reason + where, shapes=shapes,
                                            graph=ctx.graph_id))


def _enabled(ctx: "PassContext", site: NormSite) -> bool:
    return ctx.config.rewrite.layer_norm if site.op == "layer_norm" else ctx.config.rewrite.rms_norm


def _inputs_of(site: NormSite, chosen: list[_Reader]) -> list[fx.Node]:
    nodes = [site.x, site.weight, site.bias]
    for r in chosen:
        nodes += list(r.node.args[1:])
        nodes += [a for op in r.chain for a in (*op.args[1:], *op.kwargs.values())]
    return [n for n in nodes if isinstance(n, fx.Node)]


def fuse_norms(ctx: "PassContext", scope: GraphScope) -> int:
    """Fuse each norm of ``scope`` with the FP8 linears reading it; one report row per norm site."""
    count = 0
    for site in find_norm_sites(scope):
        if not _enabled(ctx, site):
            _record(ctx, scope, site, False, f"[rewrite] {site.op} = false")
            continue
        if scope.unsupported is not None:
            _record(ctx, scope, site, False, scope.unsupported)
            continue
        if site.spec is None:
            _record(ctx, scope, site, False, f"{site.why} (left unfused)")
            continue
        if is_dtensor(site.x.meta.get("example_value")):
            _record(ctx, scope, site, False, "DTensor input (left unfused)")
            continue
        readers = _readers(site.node)
        order = {n: i for i, n in enumerate(scope.graph.nodes)}
        readers.linears.sort(key=lambda r: order[r.node])
        if not readers.linears:
            names = sorted({_method_or_name(n) or n.op for n in readers.others})
            seen = f" (read by {', '.join(names)})" if names else ""
            _record(ctx, scope, site, False, f"no FP8 linear reads its output{seen}")
            continue
        # the first fusable reader picks the recipe and casts; readers that differ stay unfused
        chosen, left = [], []
        for r in readers.linears:
            why = _linear_fusable(r)
            first = chosen[0] if chosen else None
            if why is None and first is not None and (r.node.target.spec.recipe != first.node.target.spec.recipe):
                why = f"recipe differs from {first.node.target.spec.fqn}'s"
            elif why is None and first is not None and r.casts != first.casts:
                why = "casts on the way differ"
            if why is None:
                chosen.append(r)
            else:
                left.append((r, why))
        recipe = chosen[0].node.target.spec.recipe.name if chosen else None
        if not chosen:
            _record(ctx, scope, site, False, "; ".join(f"{r.node.target.spec.fqn}: {why}" for r, why in left),
                    left[0][0].node.target.spec.recipe.name)
            continue
        reason = _fuse(scope, site, chosen, readers, left)
        _record(ctx, scope, site, True, reason, recipe)
        count += 1
    return count


def _dying(chosen: list[_Reader]) -> set[fx.Node]:
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


def _fuse(scope: GraphScope, site: NormSite, chosen: list[_Reader], readers: _Readers,
          left: list[tuple[_Reader, str]]) -> str:
    graph = scope.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    # the fused call goes right after the last of its operands, before any of its linears
    last = max(_inputs_of(site, chosen), key=order.__getitem__)
    first_linear = min((r.node for r in chosen), key=order.__getitem__)
    late = [r for r in chosen if order[max(_inputs_of(site, [r]), key=order.__getitem__)] > order[first_linear]]
    if late:   # an operand of a later linear is computed after the first one runs: leave it unfused
        chosen = [r for r in chosen if r not in late]
        left += [(r, "its operands are computed after the first fused linear runs") for r in late]
        last = max(_inputs_of(site, chosen), key=order.__getitem__)
    # high-precision readers: the fused call returns the output when it runs before all of them
    dying = _dying(chosen)
    hp_users = [u for u in site.node.users if u not in dying]
    emit_hp = bool(hp_users) and all(order[u] > order[last] for u in hp_users)
    lowering = NormLinearsLowering(
        NormLinearsSpec(site.fqn, site.spec, chosen[0].node.target.spec.recipe,
                        tuple(r.node.target.spec.fqn for r in chosen),
                        tuple(r.node.target.spec.weight_in_out for r in chosen), chosen[0].casts, emit_hp),
        [r.node.target for r in chosen])
    # inserting_before(the next node) keeps the new nodes in creation order; after the placeholders
    anchor = last.next
    while anchor.op == "placeholder":
        anchor = anchor.next
    with graph.inserting_before(anchor):
        shapes = [_view_inputs(r, site.x, graph) for r in chosen]
        consumers = [tuple(r.node.args[1:]) for r in chosen]
        fused = graph.call_function(lowering, (site.x, site.weight, site.bias, shapes, consumers))
        outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(chosen) + emit_hp)]
    fused.meta.update({k: v for k, v in site.node.meta.items() if k != "example_value"})
    for r, out in zip(chosen, outs):
        out.meta.update(r.node.meta)
        r.node.replace_all_uses_with(out)
        graph.erase_node(r.node)
    for node in sorted(dying - {r.node for r in chosen}, key=order.__getitem__, reverse=True):
        graph.erase_node(node)   # the casts and views only the fused linears read
    if emit_hp:
        outs[-1].meta.update(site.node.meta)
        site.node.replace_all_uses_with(outs[-1])
    text = "fused into " + ", ".join(lowering.spec.consumers)
    if left:
        text += "; unfused readers: " + ", ".join(f"{r.node.target.spec.fqn} ({why})" for r, why in left)
    if hp_users:
        text += "; the high-precision output is kept for other readers"
    return text
