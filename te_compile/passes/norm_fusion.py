"""The norm pass: a LayerNorm / RMSNorm whose output feeds FP8 linears becomes one operation with them.

Runs after the linear pass, on its ``LinearLowering`` calls. For each norm site (norm_sites.py) it
follows the output through the ops that do not change the values' layout (dtype casts, dropout that
drops nothing, views keeping the last dim) to the linears reading it. The readers under one
per-tensor recipe with the same casts on the way are fused (lowerings/norm_fusion.py); every other
reader keeps reading a high-precision output, which the fused operation also returns (or, where the
graph's order does not allow that, the original norm nodes keep computing). One report row per norm
site: "fused into <the linears' paths>", or why not.

    h = ln(x); q = q_proj(h); k = k_proj(h.view(...)); r = h + 1
 -> q, k, h = te_norm_linears(x, ln.w, ln.b, (x, x.view(...)), ((q.w, q.b), (k.w, k.b))); r = h + 1

A final norm whose only reader is the FP8 output-layer-and-loss op (linear_cross_entropy.py) goes into
that op instead: it then takes the norm's input and parameters, and its norm spec.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Optional

import torch.fx as fx

from ..distributed import is_dtensor
from ..autocast import autocast_dtype
from ..lowerings.linear_cross_entropy import LinearCrossEntropyLowering
from ..lowerings.norm_fusion import NormLinearsLowering, NormLinearsSpec
from ..report import SiteRecord
from ..fx.editing import erase_nodes, insert_call, replace_node
from ..fx.graphs import GraphScope
from ..fx.matching import dtype_of, method_or_name, shape_text, value_of, written_between
from .norm_sites import NormSite, find_norm_sites
from .readers import Reader, dying, find_readers, linear_name, passes_through, view_inputs, why_not_fused_linear
from .context import PassContext

__all__ = ["fuse_norms"]


def _record(ctx: PassContext, scope: GraphScope, site: NormSite, fused: bool, reason: str,
            recipe: Optional[str] = None) -> None:
    shapes = " ".join(text for name, node in (("x", site.x or site.node), ("w", site.weight), ("b", site.bias))
                      if (text := shape_text(name, node)) is not None)
    ctx.record(scope, site.node, SiteRecord(fqn=site.fqn, op=site.op, recipe=recipe, rewritten=fused,
                                            reason=reason + scope.where, shapes=shapes,
                                            graph=ctx.graph_id))


def _enabled(ctx: PassContext, site: NormSite) -> bool:
    return ctx.config.rewrite.layer_norm if site.op == "layer_norm" else ctx.config.rewrite.rms_norm


def _inputs_of(site: NormSite, chosen: list[Reader]) -> list[fx.Node]:
    nodes = [site.x, site.weight, site.bias]
    for r in chosen:
        nodes += list(r.node.args[1:])
        nodes += [a for op in r.chain for a in (*op.args[1:], *op.kwargs.values())]
    return [n for n in nodes if isinstance(n, fx.Node)]


def fuse_norms(ctx: PassContext, scope: GraphScope) -> int:
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
        readers = find_readers(site.node)
        order = {n: i for i, n in enumerate(scope.graph.nodes)}
        readers.linears.sort(key=lambda r: order[r.node])
        losses = [n for n in readers.others if isinstance(n.target, LinearCrossEntropyLowering)]
        if not readers.linears and len(losses) == 1 and len(readers.others) == 1:
            loss = losses[0]
            casts = _loss_casts(site, loss)
            why = _loss_unfusable(site, loss, casts, order)
            recipe = loss.target.spec.recipe
            if why is not None:
                _record(ctx, scope, site, False, f"read by the fused output layer and loss of {loss.target.spec.fqn}: "
                                                 f"{why}", recipe.name if recipe is not None else None)
                continue
            _fuse_into_loss(scope, site, loss, casts)
            _record(ctx, scope, site, True, f"fused into {loss.target.spec.fqn}'s output layer and loss"
                                            f"{_autocast_note(site)}", recipe.name)
            count += 1
            continue
        if not readers.linears:
            names = sorted({method_or_name(n) or n.op for n in readers.others})
            seen = f" (read by {', '.join(names)})" if names else ""
            _record(ctx, scope, site, False, f"no FP8 linear reads its output{seen}")
            continue
        # the first fusable reader picks the recipe and casts; readers that differ stay unfused
        chosen, left = [], []
        for r in readers.linears:
            why = why_not_fused_linear(r, "norm")
            first = chosen[0] if chosen else None
            if why is None and first is not None and (r.node.target.spec.recipe != first.node.target.spec.recipe):
                why = f"recipe differs from {linear_name(first)}'s"
            elif why is None and first is not None and r.casts != first.casts:
                why = "casts on the way differ"
            if why is None:
                chosen.append(r)
            else:
                left.append((r, why))
        if not chosen:
            _record(ctx, scope, site, False, "; ".join(f"{linear_name(r)}: {why}" for r, why in left),
                    left[0][0].node.target.spec.recipe.name)
            continue
        recipe = chosen[0].node.target.spec.recipe.name
        written = _why_not_in_place(site, chosen, order)
        if written is not None:
            _record(ctx, scope, site, False, written, recipe)
            continue
        reason = _fuse(scope, site, chosen, left, order)
        _record(ctx, scope, site, True, reason + _autocast_note(site), recipe)
        count += 1
    return count


def _autocast_note(site: NormSite) -> str:
    """What the report adds when the graph is compiled under autocast (Dynamo guards on its state, so
    the graph runs under it): the fused lowerings then compute the norm in plain torch ahead of the
    FP8 GEMMs, since autocast changes the dtypes the norm kernels were specialised for."""
    dtype = autocast_dtype(value_of(site.x)) if value_of(site.x) is not None else None
    if dtype is None:
        return ""
    return f"; under autocast ({str(dtype).removeprefix('torch.')}) the norm runs in plain torch ahead of them"


def _loss_casts(site: NormSite, loss: fx.Node) -> Optional[tuple]:
    """The casts on the way when the fused loss reads the norm's output as its layer input, through
    ops that hand the values on unchanged, each read only by the next; else None."""
    node, casts = site.node, ()
    while True:
        users = list(node.users)
        if len(users) != 1:
            return None
        if users[0] is loss:
            return casts if loss.args[0] is node and node not in loss.args[1:] else None
        kind = passes_through(users[0], node)
        if kind is None:
            return None
        casts += (dtype_of(users[0]),) if kind == "cast" else ()
        node = users[0]


def _loss_unfusable(site: NormSite, loss: fx.Node, casts: Optional[tuple], order: dict[fx.Node, int]
                    ) -> Optional[str]:
    """Why the norm cannot go into the fused output layer and loss ``loss`` reads it as, or None;
    ``casts``: ``_loss_casts`` of the two."""
    spec = loss.target.spec
    if spec.recipe is None:
        return "it runs in high precision (norms fuse into FP8 GEMMs)"
    if spec.norm is not None:
        return "a norm is fused there already"
    if casts is None:
        return "its output reaches the op through a row slice or other ops (not fused)"
    for what, node in (("input", site.x), ("output", site.node)):
        names = written_between(node, node, loss, order)
        if names:
            return f"its {what} is written in place ({', '.join(names)}) before the loss (not fused)"
    return None


def _fuse_into_loss(scope: GraphScope, site: NormSite, loss: fx.Node, casts: tuple) -> None:
    """The loss op takes the norm's input and parameters instead of its output (``casts`` on the way)."""
    spec = loss.target.spec
    norm = replace(site.spec, casts=site.spec.casts + casts)
    lowering = LinearCrossEntropyLowering(replace(spec, norm=norm))
    x, w, b, labels, _, _, *extra = loss.args
    chain, node = [], x
    while node is not site.node:
        chain.append(node)
        node = node.args[0]
    loss.target = lowering
    loss.args = (site.x, w, b, labels, site.weight, site.bias, *extra)
    for gone in [*chain, site.node]:   # the casts and views on the way, then the norm itself
        if not gone.users:
            scope.graph.erase_node(gone)


def _why_not_in_place(site: NormSite, chosen: list[Reader], order: dict[fx.Node, int]) -> Optional[str]:
    """Why the norm must stay unfused when an in-place op writes into its input or output (or a view
    of them) while the fused call would be in flight: the call computes the norm from x where its
    operands are ready and hands the linears its FP8 operand, so it would miss that write."""
    last = max((r.node for r in chosen), key=order.__getitem__)
    for what, node in (("input", site.x), ("output", site.node)):
        names = written_between(node, node, last, order)
        if names:
            return f"its {what} is written in place ({', '.join(names)}) before its FP8 readers run (left unfused)"
    return None


def _fuse(scope: GraphScope, site: NormSite, chosen: list[Reader], left: list[tuple[Reader, str]],
          order: dict[fx.Node, int]) -> str:
    """Replace ``chosen``'s linears by one fused call; the report text. ``order``: each node's
    position in the graph as it is now."""
    graph = scope.graph
    # the fused call goes right after the last of its operands, before any of its linears
    last = max(_inputs_of(site, chosen), key=order.__getitem__)
    first_linear = min((r.node for r in chosen), key=order.__getitem__)
    late = [r for r in chosen if order[max(_inputs_of(site, [r]), key=order.__getitem__)] > order[first_linear]]
    if late:   # an operand of a later linear is computed after the first one runs: leave it unfused
        chosen = [r for r in chosen if r not in late]
        left += [(r, "its operands are computed after the first fused linear runs") for r in late]
        last = max(_inputs_of(site, chosen), key=order.__getitem__)
    # high-precision readers: the fused call returns the output when it runs before all of them
    going = dying(chosen)
    hp_users = [u for u in site.node.users if u not in going]
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
        shapes = [view_inputs(r, site.x, graph) for r in chosen]
        consumers = [tuple(r.node.args[1:]) for r in chosen]
        fused = graph.call_function(lowering, (site.x, site.weight, site.bias, shapes, consumers))
    fused.meta.update({k: v for k, v in site.node.meta.items() if k != "example_value"})
    # one output per fused linear, then the norm's own output where high-precision readers need it
    stands_for = [r.node for r in chosen] + ([site.node] if emit_hp else [])
    outs = [insert_call(anchor, operator.getitem, (fused, i), like=node) for i, node in enumerate(stands_for)]
    for r, out in zip(chosen, outs):
        replace_node(r.node, out)
    erase_nodes(going - {r.node for r in chosen})   # the casts and views only the fused linears read
    if emit_hp:
        site.node.replace_all_uses_with(outs[-1])
    text = "fused into " + ", ".join(linear_name(r) for r in chosen)
    if left:
        text += "; unfused readers: " + ", ".join(f"{linear_name(r)} ({why})" for r, why in left)
    if hp_users:
        text += "; the high-precision output is kept for other readers"
    return text
