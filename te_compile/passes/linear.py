"""The linear pass: every linear site of one graph becomes a call to its lowering, or a report row
saying why not."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from ..lowerings.block_gemm_probe import native_block_gemm_support, recipe_block_format
from ..lowerings.linear import LinearLowering, LinearSpec, gemm_kind
from ..report import SiteRecord
from .eligibility import linear_ineligibility, shape_str
from .graphs import GraphScope
from .sites import LinearSite, find_linear_sites

if TYPE_CHECKING:
    from . import PassContext

__all__ = ["rewrite_linears"]


def _gemm_path(site: LinearSite, recipe, config) -> tuple[bool, str]:
    """Block formats: (native GEMMs?, why), asking the device probe (it may run a self-test)."""
    if recipe_block_format(recipe) is None:
        return False, ""
    if not config.native_block_gemm:
        return False, "native_block_gemm = false"
    x = site.x.meta["example_value"]
    return native_block_gemm_support(recipe, x.device, x.dtype)


def _backward_follows(site: LinearSite) -> bool:
    """Will autograd run this call's backward? Its traced output requires grad exactly when grad
    mode is on there and an operand requires grad."""
    value = site.node.meta.get("example_value")
    return bool(getattr(value, "requires_grad", False))


def _replace(graph: fx.Graph, site: LinearSite, lowering: LinearLowering, extra: list) -> None:
    with graph.inserting_before(site.node):
        new = graph.call_function(lowering, (site.x, site.weight, site.bias, *extra))
    new.meta.update(site.node.meta)
    site.node.replace_all_uses_with(new)
    graph.erase_node(site.node)


def rewrite_linears(ctx: "PassContext", scope: GraphScope) -> int:
    """Rewrite the eligible linear sites of ``scope``; one report row per site found."""
    config = ctx.config
    planned = []
    for site in find_linear_sites(scope):
        recipe, why = config.recipe_for(site.fqn)
        where = f"; in a {scope.region}" if scope.region and scope.unsupported is None else ""

        def record(rewritten: bool, reason: str, recipe_name=None) -> None:
            ctx.record(scope, site.node, SiteRecord(
                fqn=site.fqn, op="linear", recipe=recipe_name, rewritten=rewritten, reason=reason + where,
                shapes=shape_str(site), graph=ctx.graph_id))

        if site.unsupported is not None:
            record(False, f"{site.unsupported} (left in high precision)")
            continue
        if not config.rewrite.linear:
            record(False, "[rewrite] linear = false")
            continue
        if scope.unsupported is not None:
            record(False, scope.unsupported)
            continue
        if recipe is None:
            record(False, f"recipe 'none' ({why})")
            continue
        reason = linear_ineligibility(site, recipe)
        if reason is not None:
            record(False, reason, recipe.name)
            continue
        extra = []
        if recipe.delayed():
            extra = ctx.delayed.site_inputs(scope, site.param, recipe, site.fqn, _backward_follows(site))
            if isinstance(extra, str):
                record(False, extra, recipe.name)
                continue
        native, gemm_why = _gemm_path(site, recipe, config)
        spec = LinearSpec(site.fqn, recipe, site.weight_in_out, native, site.weight_first)
        planned.append((site, LinearLowering(spec), extra))
        record(True, f"{site.op_name} -> {gemm_kind(recipe, native, gemm_why)} ({why})", recipe.name)
    # Consumers first: rewriting a site erases its node, which a later site's x may still name
    # (one linear feeding the next); replace_all_uses_with then updates the consumer's new call.
    for site, lowering, extra in reversed(planned):
        _replace(scope.graph, site, lowering, extra)
    return len(planned)
