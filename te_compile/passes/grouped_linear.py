"""The grouped linear pass: every grouped GEMM of an MoE layer's experts becomes a call to
``GroupedLinearLowering``, or a report row saying why not.

Its finder (``find_grouped_sites``) takes one call of an MoE layer's experts: tokens sorted by expert
[M, K] times a 3-D parameter [E, K, N] (or [E, N, K] read through ``.transpose(-2, -1)``), groups given
by ``offs``, or every expert's equal share of a batch [E, T, K] (Llama 4's experts):

    torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)   F.grouped_mm(x, W, offs=offs)
    torch.ops.transformers.grouped_mm_fallback(x, W, offs)  (transformers' op for fp32 / fp16 weights)
    torch.bmm(x.view(E, T, K), W)                           (no offs: T rows per expert)

W may be read through ``W.to_local()``: a DTensor parameter's shard (torchtitan's experts under
expert parallelism hold ``Shard(0)`` weights and compute on this rank's experts). A grouped GEMM
whose operands say it cannot be lowered is returned with ``unsupported`` saying why, for the report.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..distributed import is_dtensor
from ..gemm.grouped import GROUP_ALIGN, grouped_gemm_kind, uses_bf16_grouped_gemm, uses_native_grouped_gemm
from ..lowerings.grouped_linear import GroupedLinearLowering, GroupedLinearSpec
from ..gemm.operands import FLOAT_DTYPES
from ..recipe import Recipe
from ..tensor.grouped_float8_tensor import GroupedFloat8Tensor
from ..tensor.quantized_tensor import QuantizedTensor
from ..fx.editing import insert_call, replace_node, replace_with_call
from ..fx.gemm_operands import (BMM_FNS, GroupedSite, argument, batched_experts, grouped_op, param_behind, rank,
                                reaches_param)
from ..fx.graphs import GraphScope, module_fqn
from ..fx.matching import shape_text, value_of
from .cached_weights import cached_expert_weight
from .context import PassContext
from .eligibility import divisible

__all__ = ["rewrite_grouped_linears", "find_grouped_sites"]


# ---- finding the sites ------------------------------------------------------------------------------


def _grouped_site(node: fx.Node, op_name: str, params, fqn: str) -> Optional[GroupedSite]:
    fallback = op_name == "grouped_mm_fallback"
    x = argument(node, 0, "input" if fallback else "mat_a")
    w = argument(node, 1, "weight" if fallback else "mat_b")
    offs = argument(node, 2, "offs")
    if not any(reaches_param(a, params) for a in (x, w)):
        return None   # activations times activations (attention-like): not a weight GEMM
    param, flipped, _ = param_behind(w, params)
    site = GroupedSite(node, x, w, offs, param, not flipped, fqn, op_name)
    if param is None:
        site.unsupported = (f"{op_name} whose weight operand is not a parameter read as it is or "
                            f"transposed (a computed or sliced weight)")
    elif rank(x) != 2 or rank(w) != 3:
        site.unsupported = f"{op_name} of a {rank(x)}-D input and a {rank(w)}-D weight (lowered: 2-D tokens x 3-D)"
    elif not isinstance(offs, fx.Node):
        site.unsupported = f"{op_name} without offs"
    elif argument(node, 3, "bias") is not None:
        site.unsupported = f"{op_name} with a bias argument"
    elif argument(node, 4, "out_dtype") not in (None, getattr(value_of(x), "dtype", None)):
        site.unsupported = f"{op_name} with out_dtype={argument(node, 4, 'out_dtype')}, not its input's dtype"
    return site


def _batched_site(node: fx.Node, params, fqn: str) -> Optional[GroupedSite]:
    x, w = node.args[0], node.args[1]
    if len(node.args) != 2 or node.kwargs or not batched_experts(x, w, params):
        return None
    param, flipped, _ = param_behind(w, params)
    site = GroupedSite(node, x, w, None, param, not flipped, fqn, "bmm", batched=True)
    if value_of(x).shape[0] != value_of(w).shape[0]:
        site.unsupported = f"bmm of {value_of(x).shape[0]} batches against {value_of(w).shape[0]} experts"
    return site


def find_grouped_sites(scope: GraphScope) -> list[GroupedSite]:
    """Every grouped GEMM call of ``scope``'s graph with a parameter operand, in graph order."""
    sites = []
    for node in scope.graph.nodes:
        op_name = grouped_op(node)
        fqn = scope.fqn(module_fqn(node)) if node.op in ("call_function", "call_method") else ""
        if op_name is not None:
            site = _grouped_site(node, op_name, scope.params, fqn)
        elif (node.op == "call_function" and node.target in BMM_FNS) or (node.op == "call_method"
                                                                           and node.target == "bmm"):
            site = _batched_site(node, scope.params, fqn)
        else:
            site = None
        if site is not None:
            sites.append(site)
    return sites


# ---- the pass ---------------------------------------------------------------------------------------


def _shapes(site: GroupedSite) -> str:
    parts = [shape_text("x", site.x) or "x[?]", shape_text("w", site.weight) or "w[?]"]
    if site.param is not None:
        parts[-1] += f"={site.param.name}"
    if isinstance(site.offs, type(site.x)):
        parts.append(shape_text("offs", site.offs) or "offs[?]")
    return " ".join(parts)


def _why_not_grouped_linear(site: GroupedSite, recipe: Recipe) -> Optional[str]:
    """Why the site cannot run under ``recipe``, or None."""
    problem = recipe.grouped_gemm_problem()
    if problem is not None:
        return f"{problem} (left in high precision)"
    x, w = value_of(site.x), value_of(site.weight)
    if x is None or w is None:
        return "operand shapes unknown (no example value)"
    if site.batched:
        x = x.flatten(0, 1)   # E groups of T rows
    if is_dtensor(x) or is_dtensor(w):
        return "DTensor operands (experts sharded by tensor parallelism) are not lowered yet"
    if isinstance(w, QuantizedTensor) and not (isinstance(w, GroupedFloat8Tensor) and recipe.per_tensor):
        return (f"weight is a {type(w).__name__} (FP8 experts are lowered as GroupedFloat8Tensors under a per-tensor "
                f"recipe: FSDP2's FP8 all-gather and quantized_model_init make them)")
    if x.dtype not in FLOAT_DTYPES or w.dtype not in FLOAT_DTYPES:
        return f"dtype {x.dtype}/{w.dtype} is not one of {[str(d) for d in FLOAT_DTYPES]}"
    if x.device.type not in ("cpu", "cuda"):
        return f"device {x.device.type!r} is not supported (supported: ['cpu', 'cuda'])"
    k, n = w.shape[1], w.shape[2]
    for name, dim in (("in_features (K)", k), ("out_features (N)", n)):
        if not divisible(dim, recipe.gemm_alignment):
            return f"{name}={dim} is not divisible by {recipe.gemm_alignment} ({recipe.gemm_alignment_reason})"
    if any(statically_known_true(d == 0) for d in x.shape):
        return f"input {list(x.shape)} is empty: nothing to quantize"
    return None


def _align(site: GroupedSite, recipe: Recipe) -> int:
    """Rows per group the GEMMs need: 16 where a CUTLASS grouped GEMM runs them (torch's scaled one, or
    its bf16 one for FP8 operands the scaled one does not take), else 1."""
    if not recipe.per_tensor:
        return 1   # no native grouped GEMM of the block formats is wired
    x = value_of(site.x)
    fp8 = recipe.fp8_format.dtype_for("input")
    probe = x.new_empty((), dtype=fp8) if x.device.type == "cuda" else None
    native = probe is not None and (uses_native_grouped_gemm(probe, probe, x.dtype)
                                    or uses_bf16_grouped_gemm(probe, probe, x.dtype))
    return GROUP_ALIGN if native else 1


# Casts that give the same tokens the same bytes wherever they are written (torchtitan casts x with
# .bfloat16() once per GEMM): tokens reached through the same chain of them are one tensor.
_SAME_VALUE_METHODS = ("bfloat16", "float", "half", "contiguous")


def _tokens_key(x) -> tuple:
    """(the node ``x`` is a cast copy of, the casts on the way): equal keys hold equal values."""
    chain = []
    while (getattr(x, "op", None) == "call_method" and len(x.args) == 1 and not x.kwargs
           and x.target in _SAME_VALUE_METHODS):
        chain.append(x.target)
        x = x.args[0]
    return x, tuple(chain)


def rewrite_grouped_linears(ctx: PassContext, scope: GraphScope) -> int:
    """Rewrite the eligible grouped GEMM sites of ``scope``; one report row per site found.

    Under DelayedScaling, grouped GEMMs reading the same tokens (torchtitan's w1 and w3) quantize
    them with the first one's input scale, as the readers of a fused norm do: one FP8 copy of the
    tokens, saved once. Each still records the tokens' amax in its own history, so the histories
    (and scales) stay equal."""
    config = ctx.config
    planned = []
    first_reader: dict[tuple, tuple[str, object]] = {}   # (tokens, offs, recipe) -> (weight name, scale node)
    for site in find_grouped_sites(scope):
        recipe, why = config.recipe_for(site.fqn)
        record = ctx.recorder(scope, site.node, site.fqn, "grouped_linear", _shapes(site))
        if not ctx.admit(scope, site, "grouped_linear", recipe, why, record, _why_not_grouped_linear):
            continue
        extra, collectives = [], ""
        if recipe.delayed():
            groups = ctx.expert_groups(site.param) if recipe.reduce_amax else ()
            # a carrier only where autograd will run this call's backward
            backward = bool(getattr(site.node.meta.get("example_value"), "requires_grad", False))
            extra = ctx.delayed.site_inputs(scope, site.param, recipe, site.fqn, backward, groups)
            if isinstance(extra, str):
                record(False, extra, recipe.name)
                continue
            collectives = ctx.history_reduction(groups, recipe)
            key = (*_tokens_key(site.x), site.offs, recipe)
            if key in first_reader:
                name, extra[1] = first_reader[key]
                why += f"; tokens quantized with {name}'s input scale (the same tokens)"
            else:
                first_reader[key] = (site.param.name, extra[1])
        spec = GroupedLinearSpec(site.fqn, recipe, _align(site, recipe))
        cached = cached_expert_weight(ctx, scope, site, recipe)
        planned.append((site, GroupedLinearLowering(spec), extra, cached))
        x = value_of(site.x)
        layout = "[E, in, out]" if site.weight_in_out else "[E, out, in]"
        if recipe.per_tensor:
            scales = "per-expert amax histories" if recipe.delayed() else "per-expert scales"
            kind = f"{grouped_gemm_kind(x.dtype, x.device)}; {scales}"
        else:
            kind = (f"{recipe.format_label} per expert, emulated GEMMs (dequantize-then-matmul, expert by "
                    f"expert; no block spans two experts)")
        why += ctx.local_shard_note(site.param)
        if isinstance(value_of(site.weight), GroupedFloat8Tensor):
            why += "; weight already FP8 per expert (FSDP2's all-gather or an FP8 primary weight), used as is"
        if cached is not None and ctx.inference:
            why += "; expert weights quantized once, cached across calls until they change (inference graph)"
        elif cached is not None:
            why += ("; expert weights quantized once per optimizer step, their FP8 copy reused by every "
                    "micro-batch until they change (cache_fp8_weights)")
        record(True, f"{site.op_name} -> {kind}, weight {layout} ({why})", recipe.name, collectives)
    for site, lowering, extra, cached in reversed(planned):   # consumers first, as in the linear pass
        _replace(site, lowering, extra, site.weight if cached is None else cached)
    return len(planned)


def _replace(site: GroupedSite, lowering: GroupedLinearLowering, extra: list, weight: fx.Node) -> None:
    """The site's call replaced by the lowering's, reading ``weight`` (the site's, or its cached FP8
    copy); a batched bmm [E, T, K] runs as E groups of T rows (x flattened to [E * T, K], offs None)
    and its output is unflattened back to [E, T, N]."""
    if not site.batched:
        replace_with_call(site.node, lowering, (site.x, weight, site.offs, *extra))
        return
    # offs None: the lowering cuts the rows into E equal groups
    x = insert_call(site.node, "flatten", (site.x, 0, 1), method=True)
    new = insert_call(site.node, lowering, (x, weight, site.offs, *extra), like=site.node)
    with value_of(site.node).fake_mode:
        new.meta["example_value"] = value_of(site.node).flatten(0, 1)
    out = insert_call(site.node, "unflatten", (new, 0, (value_of(site.x).shape[0], -1)), method=True)
    out.meta.update({k: v for k, v in site.node.meta.items() if k != "example_value"})
    replace_node(site.node, out)
