"""The linear pass: every linear site of one graph becomes a call to its lowering, or a report row
saying why not."""

from __future__ import annotations

import operator
from typing import Optional

import torch.fx as fx

from ..distributed import (NO_GROUPS, describe_role_groups, is_dtensor, local_value, merge_role_groups,
                           minimal_groups)
from ..gemm.block_probe import native_block_gemm_support
from ..lowerings.async_tp_group import AsyncTpColumnGroupLowering
from ..lowerings.linear import LinearLowering, LinearSpec, gemm_kind
from ..lowerings.sharded_linear import plan_linear_sharding
from ..quantization import weight_is_operand
from ..recipe import GEMM_ROLES
from ..tensor.quantized_tensor import QuantizedTensor
from ..fx.graphs import GraphScope, insert_call
from .eligibility import shape_str, why_not_linear
from .inference_weights import cached_weight
from .sites import LinearSite, find_linear_sites
from .async_tp import async_tp_enabled, async_tp_form, column_groups
from .context import PassContext

__all__ = ["rewrite_linears"]


def _gemm_path(site: LinearSite, recipe, config) -> tuple[bool, str]:
    """Block formats: (native GEMMs?, why), asking the device probe (it may run a self-test)."""
    if recipe.block_format is None:
        return False, ""
    if not config.native_block_gemm:
        return False, "native_block_gemm = false"
    x = site.x.meta["example_value"]
    return native_block_gemm_support(recipe, x.device, x.dtype)


def _amax_reductions(ctx: PassContext, site: LinearSite, recipe) -> tuple[tuple, tuple, str]:
    """Across ranks: (per role, the groups the lowering all-reduces amaxes over for plain tensors
    sharded by hand; the groups DelayedScaling's update reduces this weight's amaxes over; the
    report's text). DTensor operands bring their mesh dims (sharded_linear.py)."""
    x, w = site.x.meta.get("example_value"), site.weight.meta.get("example_value")
    plan = plan_linear_sharding(x, w, site.fqn, w_in_out=site.weight_in_out)
    plain = NO_GROUPS
    if ctx.amax_group is not None and ctx.config.distributed.sharded(site.fqn):
        plain = ((ctx.amax_group,),) * 3
    roles = merge_role_groups(plan.groups if plan else NO_GROUPS, plain)
    if recipe.delayed():
        # one expert's matrix in a per-expert loop: the ranks holding the same experts
        if site.expert is None:
            wanted = [ctx.amax_group] if ctx.amax_group is not None else []
        else:
            wanted = list(ctx.expert_groups(site.param))
        wanted = wanted if recipe.reduce_amax else []
        groups = minimal_groups([*wanted, *(g for gs in roles for g in gs)])
        text = ctx.history_reduction(groups, recipe)
        return plain, groups, text
    if w is not None and weight_is_operand(local_value(w), recipe):
        # FSDP2's FP8 all-gather brings the bytes with the whole weight's scale: no reduction here
        roles = (roles[0], (), roles[2])
    if not any(roles):
        return plain, (), ""
    if recipe.per_block_scales:
        return plain, (), "none needed: per-block scales"
    if recipe.custom():
        return plain, (), "none: custom quantizers get no amax reduction"
    return plain, (), describe_role_groups(roles)


def _backward_follows(site: LinearSite) -> bool:
    """Will autograd run this call's backward? Its traced output requires grad exactly when grad
    mode is on there and an operand requires grad."""
    value = site.node.meta.get("example_value")
    return bool(getattr(value, "requires_grad", False))


def _expert_inputs(site: LinearSite, extra: list) -> list:
    """DelayedScaling's (carrier, input, weight, grad_output scales) for expert ``site.expert`` of a
    3-D weight, from its [roles x E] carrier and [E] scales: that expert's [1] scales, and a [roles]
    view of its carrier column (autograd writes the site's amaxes there, zeros elsewhere, and the
    update takes the max over the weight's sites)."""
    carrier, *scales = extra
    e, experts = site.expert, local_value(site.param.value).shape[0]   # a DTensor's: this rank's experts
    if carrier is not None:
        grid = insert_call(site.node, "view", (carrier, len(GEMM_ROLES), experts), method=True)
        carrier = insert_call(site.node, operator.getitem, (grid, (slice(None), e)))
    return [carrier, *(insert_call(site.node, operator.getitem, (scale, slice(e, e + 1))) for scale in scales)]


def _replace(graph: fx.Graph, site: LinearSite, lowering: LinearLowering, extra: list,
             cached: Optional[fx.Node] = None, x: Optional[fx.Node] = None, absorbed: Optional[fx.Node] = None) -> None:
    """``cached``: the inference graph's FP8 copy of the weight, read instead of the weight; ``x``: the
    input read instead of the site's (async TP: the sequence-sharded one); ``absorbed``: the
    redistribute of the output the lowering now does itself (async TP's reduce-scatter)."""
    with graph.inserting_before(site.node):
        new = graph.call_function(lowering, (site.x if x is None else x, site.weight if cached is None else cached,
                                             site.bias, *extra))
    new.meta.update(site.node.meta)
    site.node.replace_all_uses_with(new)
    graph.erase_node(site.node)
    if absorbed is not None:
        new.meta["example_value"] = absorbed.meta["example_value"]
        absorbed.replace_all_uses_with(new)
        graph.erase_node(absorbed)


def _async_tp_collectives(site: LinearSite, form, history: str = "") -> str:
    """The report's collectives for an async-TP site; ``history``: DelayedScaling's history reduction
    (its amaxes are not all-reduced at the site)."""
    from ..distributed import mesh_dim_group

    group = mesh_dim_group(site.weight.meta["example_value"].device_mesh, form.mesh_dim)
    amaxes = history or f"amax all-reduce (MAX) over {group}: input, weight, grad_output"
    if form.kind == "column":
        return f"{amaxes}; all-gather over {group}: x in FP8; reduce-scatter: dx"
    return f"{amaxes}; reduce-scatter over {group}: y; all-gather over {group}: grad_output in FP8"


def rewrite_linears(ctx: PassContext, scope: GraphScope) -> int:
    """Rewrite the eligible linear sites of ``scope``; one report row per site found."""
    config = ctx.config
    planned = []
    for site in find_linear_sites(scope):
        recipe, why = config.recipe_for(site.fqn)
        # one expert's matrix of a 3-D weight in a per-expert loop: an MoE experts site
        op = "linear" if site.expert is None else "grouped_linear"
        record = ctx.recorder(scope, site.node, site.fqn, op, shape_str(site))
        if site.unsupported is not None:
            record(False, f"{site.unsupported} (left in high precision)")
            continue
        if not config.rewrite.linear:
            record(False, "[rewrite] linear = false")
            continue
        if (alone := ctx.why_not_any_site(scope, recipe, why)) is not None:
            record(False, alone)
            continue
        reason = why_not_linear(site, recipe)
        if reason is not None:
            record(False, reason, recipe.name)
            continue
        plain_groups, delayed_groups, collectives = _amax_reductions(ctx, site, recipe)
        extra = []
        if recipe.delayed():
            extra = ctx.delayed.site_inputs(scope, site.param, recipe, site.fqn, _backward_follows(site),
                                            delayed_groups)
            if isinstance(extra, str):
                record(False, extra, recipe.name)
                continue
            if site.expert is not None:
                extra = _expert_inputs(site, extra)
        why += ctx.local_shard_note(site.param)
        weight_value = local_value(site.weight.meta.get("example_value"))   # a DTensor's: its TP shard
        if isinstance(weight_value, QuantizedTensor):
            # FSDP2's FP8 all-gather (te_compile.fsdp) or an FP8 primary weight (primary_weights.py)
            why += ("; weight already quantized, used as is" if weight_is_operand(weight_value, recipe)
                    else f"; weight is a {type(weight_value).__name__} of another format: dequantized first")
        native, gemm_why = _gemm_path(site, recipe, config)
        cached = None if plain_groups != NO_GROUPS else cached_weight(ctx, scope, site, recipe)
        if cached is not None:
            why += "; weight quantized once, cached across calls until it changes (inference graph)"
        # the cached copy is [N, K] whatever the parameter's layout
        in_out = site.weight_in_out and cached is None
        rowwise = (ctx.inference and recipe.per_tensor and config.inference.activation_scaling == "row"
                   and plain_groups == NO_GROUPS and not is_dtensor(site.weight.meta.get("example_value")))
        if rowwise:
            why += "; one input scale per token (inference, activation_scaling = row)"
        form = x_node = absorbed = None
        if async_tp_enabled(config) and is_dtensor(site.weight.meta.get("example_value")):
            form, x_node, absorbed, note = async_tp_form(site, recipe)
            why += f"; {note}" if note else ""
            if form is not None:
                collectives = _async_tp_collectives(site, form, collectives if recipe.delayed() else "")
        spec = LinearSpec(site.fqn, recipe, in_out, native, site.weight_first, plain_groups, rowwise, form)
        planned.append((site, LinearLowering(spec), extra, cached, x_node, absorbed))
        device = getattr(site.weight.meta.get("example_value"), "device", None)
        what = site.op_name if site.expert is None else \
            f"{site.op_name} on expert {site.expert} of {site.param.name} (a per-expert loop; that expert's scales)"
        record(True, f"{what} -> {gemm_kind(recipe, native, gemm_why, device)} ({why})", recipe.name, collectives)
    grouped = column_groups(planned)
    for members in grouped:
        _replace_group(scope.graph, [planned[i] for i in members])
    done = {i for members in grouped for i in members}
    # Consumers first: rewriting a site erases its node, which a later site's x may still name
    # (one linear feeding the next); replace_all_uses_with then updates the consumer's new call.
    for i, (site, lowering, extra, cached, x_node, absorbed) in reversed(list(enumerate(planned))):
        if i not in done:
            _replace(scope.graph, site, lowering, extra, cached, x_node, absorbed)
    return len(planned)


def _replace_group(graph: fx.Graph, entries: list) -> None:
    """Column-parallel async-TP sites reading one x become one call, before the first of them, each
    site's node a getitem of it (async_tp.column_groups says which)."""
    sites = [entry[0] for entry in entries]
    lowering = AsyncTpColumnGroupLowering(tuple(entry[1].spec for entry in entries))
    with graph.inserting_before(sites[0].node):
        call = graph.call_function(lowering, (entries[0][4], *(s.weight for s in sites), *(s.bias for s in sites)))
    call.meta["example_value"] = tuple(s.node.meta.get("example_value") for s in sites)
    for i, site in enumerate(sites):
        with graph.inserting_before(site.node):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta.update(site.node.meta)
        site.node.replace_all_uses_with(item)
        graph.erase_node(site.node)
