"""The linear pass: every linear site of one graph becomes a call to its lowering, or a report row
saying why not.

Its finder (``find_linear_sites``, also the fused loss pass's) takes every matmul-like call with a
weight and names its module. A linear site is ``F.linear(x, w, b)`` with any weight, or a matmul
whose one operand is a 2-D parameter, reached directly or through transposes and dtype casts
(fx/gemm_operands.py), and whose other operand is an activation:

    x @ W.T + b   x @ W.t()   torch.matmul(x, W.transpose(0, 1))   F.linear(x, W.to(x.dtype))
    x @ W (W stored [in, out])   torch.addmm(b, x, W) (HF Conv1D)   torch.mm(x, W)   W @ x
    torch.baddbmm(b, x, W.expand(B, K, N))   torch.bmm(x, W.expand(B, K, N))

The weight may also be one expert's matrix of a 3-D parameter, taken with a constant index inside a
per-expert loop (``expert`` then says which):

    F.linear(x_e, W[e])   x_e @ W[e].T   x_e @ W[e] (W stored [E, in, out])

A matmul-like call with a parameter operand in any other form (einsum, a batched parameter, two
parameters, addmm with alpha/beta) is returned too, with ``unsupported`` saying why, so the report
lists it: a layer the report does not show does not exist.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.fx as fx

from ..distributed import (NO_GROUPS, describe_role_groups, is_dtensor, local_value, merge_role_groups,
                           minimal_groups)
from ..gemm.block_probe import native_block_gemm_support
from ..lowerings.async_tp_group import AsyncTpColumnGroupLowering
from ..lowerings.linear import LinearLowering, LinearSpec, gemm_kind
from ..lowerings.linear_paths.sharded import plan_linear_sharding
from ..gemm.operands import weight_is_operand
from ..recipe import GEMM_ROLES
from ..tensor.quantized_tensor import QuantizedTensor
from ..fx.editing import insert_call, replace_with_call
from ..fx.gemm_operands import (BMM_FNS, LinearSite, batched_experts, grouped_op, param_behind, rank,
                                reaches_param, unbroadcast)
from ..fx.graphs import GraphScope, ParamRef, module_fqn
from .eligibility import shape_str, why_not_linear, why_small_gemm
from .cached_weights import cached_weight
from .async_tp import async_tp_enabled, async_tp_form, column_groups
from .context import PassContext

__all__ = ["rewrite_linears", "find_linear_sites"]


# ---- finding the sites ------------------------------------------------------------------------------

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_MATMUL_FNS = (torch.matmul, operator.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm)
_MATMUL_METHODS = ("matmul", "mm", "__matmul__")
_ADDMM_FNS = (torch.addmm, torch.Tensor.addmm)
_BADDBMM_FNS = (torch.baddbmm, torch.Tensor.baddbmm)
_OTHER_MATMULS = {torch.einsum: "einsum", torch.functional.einsum: "einsum", torch.tensordot: "tensordot",
                  torch.inner: "inner", torch.mv: "mv", torch.addmv: "addmv", torch.outer: "outer",
                  torch.nn.functional.bilinear: "bilinear"}
# Words that make any other op (grouped_mm, a library's custom GEMM op) count as matmul-like for the
# report when one of its operands reaches a parameter.
_MATMUL_WORDS = frozenset({"mm", "bmm", "matmul", "einsum", "linear", "gemm", "addmm", "baddbmm"})


def _matmul_word_name(node: fx.Node) -> Optional[str]:
    """The name of an op not handled above that reads like a matmul ("grouped_mm", a custom op)."""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", None) or str(target)
    words = set(name.lower().replace(".", "_").replace(":", "_").split("_"))
    return name if words & _MATMUL_WORDS else None


def _matmul_site(node, x, w, bias, op_name, fqn, params) -> Optional[LinearSite]:
    """A site for ``x @ w (+ bias)`` where one operand is a parameter; None when neither is."""
    w_param, _, w_expert = param_behind(w, params, experts=True)
    x_param, _, x_expert = param_behind(x, params, experts=True)
    if w_param is None and x_param is None:
        if reaches_param(w, params) or reaches_param(x, params):
            return LinearSite(node, x, w, None, bias, True, fqn, op_name,
                              unsupported=f"{op_name} with a parameter reached through other ops")
        return None
    if w_param is not None and x_param is not None:
        return LinearSite(node, x, w, w_param, bias, True, fqn, op_name,
                          unsupported=f"{op_name} of two parameters ({x_param.name}, {w_param.name}): "
                                      "no activation operand")
    if w_param is not None:
        if rank(w) != 2:
            return LinearSite(node, x, w, w_param, bias, True, fqn, op_name,
                              unsupported=f"parameter operand {w_param.name} is {rank(w)}-D, not 2-D")
        return LinearSite(node, x, w, w_param, bias, True, fqn, op_name, expert=w_expert)
    # W @ x: the weight is [N, K] as read, x [..., K, M]
    if rank(x) != 2:
        return LinearSite(node, w, x, x_param, bias, False, fqn, op_name, weight_first=True,
                          unsupported=f"parameter operand {x_param.name} is {rank(x)}-D, not 2-D")
    if bias is not None:
        return LinearSite(node, w, x, x_param, bias, False, fqn, op_name, weight_first=True,
                          unsupported=f"{op_name} with the parameter as its left operand and an addend")
    return LinearSite(node, w, x, x_param, None, False, fqn, op_name, weight_first=True, expert=x_expert)


def _site(node: fx.Node, params: dict[fx.Node, ParamRef], fqn: str) -> Optional[LinearSite]:
    target = node.target
    if node.op == "call_function" and target in _LINEAR:
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        param, _, expert = param_behind(w, params, experts=True)
        return LinearSite(node, x, w, param, b, False, fqn, "linear", expert=expert)
    is_call = node.op == "call_function"
    if (is_call and target in _MATMUL_FNS) or (node.op == "call_method" and target in _MATMUL_METHODS):
        if len(node.args) != 2 or node.kwargs:
            return None
        return _matmul_site(node, node.args[0], node.args[1], None, "matmul", fqn, params)
    if is_call and target in _ADDMM_FNS:
        b, x, w = node.args[:3]
        site = _matmul_site(node, x, w, b, "addmm", fqn, params)
        if site is not None and (len(node.args) > 3 or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha"))):
            site.unsupported = "addmm with beta or alpha other than 1"
        return site
    if is_call and target in (*BMM_FNS, *_BADDBMM_FNS):
        baddbmm = target in _BADDBMM_FNS
        b, x, w = node.args[:3] if baddbmm else (None, *node.args[:2])
        if not baddbmm and batched_experts(x, w, params):
            return None   # the grouped linear pass's (grouped_linear.py)
        w2 = unbroadcast(w)
        site = None
        if w2 is not None and param_behind(w2, params)[0] is not None and rank(x) == 3:
            site = _matmul_site(node, x, w2, b, target.__name__, fqn, params)
        elif reaches_param(w, params) or reaches_param(x, params):
            site = LinearSite(node, x, w, None, b, True, fqn, target.__name__,
                              unsupported=f"{target.__name__} with a batched parameter operand")
        if site is not None and baddbmm and any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
            site.unsupported = "baddbmm with beta or alpha other than 1"
        return site
    if grouped_op(node) is not None or (node.op == "call_method" and target == "bmm" and len(node.args) == 2
                                         and batched_experts(*node.args, params)):
        return None   # the grouped linear pass's (grouped_linear.py)
    name = _OTHER_MATMULS.get(target) if is_call else None
    name = name or _matmul_word_name(node)
    if name is not None:
        operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
        if operands and any(reaches_param(a, params) for a in operands):
            return LinearSite(node, operands[0], operands[-1], None, None, False, fqn, name,
                              unsupported=f"{name} with a parameter operand is not lowered")
    return None


def find_linear_sites(scope: GraphScope) -> list[LinearSite]:
    """Every linear-like call of ``scope``'s graph, in graph order (see the module docstring)."""
    sites = []
    for node in scope.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        site = _site(node, scope.params, scope.fqn(module_fqn(node)))
        if site is None:
            continue
        if site.fqn == "" and site.param is not None and "." in site.param.name:
            # A root-level call on a submodule's weight (F.linear(h, self.wte.weight)): name the site
            # after the module that owns the weight.
            site.fqn = site.param.name.rsplit(".", 1)[0]
        sites.append(site)
    return sites


# ---- the pass ---------------------------------------------------------------------------------------


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
    report's text). DTensor operands bring their mesh dims (lowerings/linear_paths/sharded.py)."""
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


def _async_tp_collectives(site: LinearSite, form, history: str = "") -> str:
    """The report's collectives for an async-TP site; ``history``: DelayedScaling's history reduction
    (its amaxes are not all-reduced at the site)."""
    from ..distributed import mesh_dim_group

    group = mesh_dim_group(site.weight.meta["example_value"].device_mesh, form.mesh_dim)
    amaxes = history or f"amax all-reduce (MAX) over {group}: input, weight, grad_output"
    if form.kind == "column":
        return f"{amaxes}; all-gather over {group}: x in FP8; reduce-scatter: dx"
    return f"{amaxes}; reduce-scatter over {group}: y; all-gather over {group}: grad_output in FP8"


@dataclass
class _Plan:
    """One eligible site: its lowering and what the lowering's call reads, and its report row."""

    site: LinearSite
    lowering: LinearLowering
    extra: list                        # DelayedScaling's carrier and scales, after x, w, b
    cached: Optional[fx.Node]          # the inference graph's FP8 copy of the weight, read instead of it
    x: Optional[fx.Node]               # the input read instead of the site's (async TP: the sequence-sharded one)
    absorbed: Optional[fx.Node]        # the redistribute of the output the lowering does itself (async TP)
    reason: str
    collectives: str


def rewrite_linears(ctx: PassContext, scope: GraphScope) -> int:
    """Rewrite the eligible linear sites of ``scope``; one report row per site found."""
    planned = []
    for site in find_linear_sites(scope):
        recipe, why = ctx.config.recipe_for(site.fqn)
        # one expert's matrix of a 3-D weight in a per-expert loop: an MoE experts site
        op = "linear" if site.expert is None else "grouped_linear"
        record = ctx.recorder(scope, site.node, site.fqn, op, shape_str(site))
        if not ctx.admit(scope, site, "linear", recipe, why, record, why_not_linear):
            continue
        # the line was measured on training's forward + backward: inference graphs keep FP8 weights
        small = None if ctx.inference else why_small_gemm(site, recipe, ctx.config.rewrite.small_gemms)
        if small is not None:
            record(False, small, recipe.name)
            continue
        plan = _plan(ctx, scope, site, recipe, why)
        if isinstance(plan, str):   # DelayedScaling's state refused the site
            record(False, plan, recipe.name)
            continue
        planned.append(plan)
        record(True, plan.reason, recipe.name, plan.collectives)
    _rewrite(scope, planned)
    return len(planned)


def _plan(ctx: PassContext, scope: GraphScope, site: LinearSite, recipe, why: str) -> Union[_Plan, str]:
    """The lowering of an eligible site and its report row, in steps: amax reductions across ranks,
    DelayedScaling's state, the weight as it arrives, the GEMM path, the inference forms, async TP.
    A str: why DelayedScaling's state cannot be kept for it."""
    plain_groups, delayed_groups, collectives = _amax_reductions(ctx, site, recipe)
    extra = _delayed_inputs(ctx, scope, site, recipe, delayed_groups)
    if isinstance(extra, str):
        return extra
    why += ctx.local_shard_note(site.param) + _weight_note(site, recipe)
    native, gemm_why = _gemm_path(site, recipe, ctx.config)
    cached, rowwise, note = _cached_forms(ctx, scope, site, recipe, plain_groups)
    why += note
    form = x = absorbed = None
    if async_tp_enabled(ctx.config) and is_dtensor(site.weight.meta.get("example_value")):
        form, x, absorbed, note = async_tp_form(site, recipe)
        why += f"; {note}" if note else ""
        if form is not None:
            collectives = _async_tp_collectives(site, form, collectives if recipe.delayed() else "")
    # the cached copy is [N, K] whatever the parameter's layout
    in_out = site.weight_in_out and cached is None
    spec = LinearSpec(site.fqn, recipe, in_out, native, site.weight_first, plain_groups, rowwise, form)
    device = getattr(site.weight.meta.get("example_value"), "device", None)
    what = site.op_name if site.expert is None else \
        f"{site.op_name} on expert {site.expert} of {site.param.name} (a per-expert loop; that expert's scales)"
    reason = f"{what} -> {gemm_kind(recipe, native, gemm_why, device)} ({why})"
    return _Plan(site, LinearLowering(spec), extra, cached, x, absorbed, reason, collectives)


def _delayed_inputs(ctx: PassContext, scope: GraphScope, site: LinearSite, recipe, groups: tuple) -> Union[list, str]:
    """DelayedScaling's extra operands of the site (none for other recipes), or why it has none."""
    if not recipe.delayed():
        return []
    extra = ctx.delayed.site_inputs(scope, site.param, recipe, site.fqn, _backward_follows(site), groups)
    if isinstance(extra, str) or site.expert is None:
        return extra
    return _expert_inputs(site, extra)


def _weight_note(site: LinearSite, recipe) -> str:
    """For the report, when the weight arrives quantized: FSDP2's FP8 all-gather (te_compile.fsdp) or an
    FP8 primary weight (primary_weights.py); else ""."""
    weight_value = local_value(site.weight.meta.get("example_value"))   # a DTensor's: its TP shard
    if not isinstance(weight_value, QuantizedTensor):
        return ""
    if weight_is_operand(weight_value, recipe):
        return "; weight already quantized, used as is"
    return f"; weight is a {type(weight_value).__name__} of another format: dequantized first"


def _cached_forms(ctx: PassContext, scope: GraphScope, site: LinearSite, recipe,
                  plain_groups: tuple) -> tuple[Optional[fx.Node], bool, str]:
    """(the cached FP8 weight read instead of the weight, or None; one input scale per token?; the
    report's note): what an inference graph, or a training graph under ``cache_fp8_weights``, does
    differently (cached_weights.py)."""
    note = ""
    cached = None if plain_groups != NO_GROUPS else cached_weight(ctx, scope, site, recipe)
    if cached is not None and ctx.inference:
        note += "; weight quantized once, cached across calls until it changes (inference graph)"
    elif cached is not None:
        note += ("; weight quantized once per optimizer step, its FP8 copy reused by every micro-batch "
                 "until the weight changes (cache_fp8_weights)")
    rowwise = (ctx.inference and recipe.per_tensor and ctx.config.inference.activation_scaling == "row"
               and plain_groups == NO_GROUPS and not is_dtensor(site.weight.meta.get("example_value")))
    if rowwise:
        note += "; one input scale per token (inference, activation_scaling = row)"
    return cached, rowwise, note


def _rewrite(scope: GraphScope, planned: list[_Plan]) -> None:
    """Replace the planned sites by their lowerings' calls: the async-TP column groups first, each as
    one call (async_tp.column_groups says which), then every other site on its own."""
    grouped = column_groups([(p.site, p.lowering, p.extra, p.cached, p.x, p.absorbed) for p in planned])
    for members in grouped:
        _replace_group([planned[i] for i in members])
    done = {i for members in grouped for i in members}
    # Consumers first: rewriting a site erases its node, which a later site's x may still name
    # (one linear feeding the next); replace_all_uses_with then updates the consumer's new call.
    for i, plan in reversed(list(enumerate(planned))):
        if i not in done:
            _replace(plan)


def _replace(plan: _Plan) -> None:
    """The site's call replaced by its lowering's, reading the cached weight and async TP's x where the
    plan has them."""
    site = plan.site
    x = site.x if plan.x is None else plan.x
    new = replace_with_call(site.node, plan.lowering,
                            (x, site.weight if plan.cached is None else plan.cached, site.bias, *plan.extra))
    if plan.absorbed is not None:   # the lowering's output takes the redistributed placement itself
        new.meta["example_value"] = plan.absorbed.meta["example_value"]
        plan.absorbed.replace_all_uses_with(new)
        plan.absorbed.graph.erase_node(plan.absorbed)


def _replace_group(plans: list[_Plan]) -> None:
    """Column-parallel async-TP sites reading one x become one call, before the first of them, each
    site's node a getitem of it."""
    sites = [plan.site for plan in plans]
    lowering = AsyncTpColumnGroupLowering(tuple(plan.lowering.spec for plan in plans))
    graph = sites[0].node.graph
    with graph.inserting_before(sites[0].node):
        call = graph.call_function(lowering, (plans[0].x, *(s.weight for s in sites), *(s.bias for s in sites)))
    call.meta["example_value"] = tuple(s.node.meta.get("example_value") for s in sites)
    for i, site in enumerate(sites):
        replace_with_call(site.node, operator.getitem, (call, i))
