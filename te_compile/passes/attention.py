"""The attention pass: ``F.scaled_dot_product_attention`` calls become FP8 attention, or a report row
saying why not.

A site is enabled by ``[rewrite] sdpa = true`` or its recipe's ``fp8_dpa = true`` (or ``fp8_mha``,
which implies it as in TransformerEngine and also hands O to the output projection in FP8:
attention_projection.py). The recipe is that of the module whose
forward calls SDPA, overrides included. The forms lowered (lowerings/attention.py):

    sdpa(q, k, v)  sdpa(q, k, v, is_causal=True)  sdpa(q, k, v, attn_mask=bool or additive float mask)
    sdpa(q, k, v, enable_gqa=True) with k, v of fewer heads   sdpa(q, k, v, scale=s)
    sdpa(q, k, v) with k, v of one head (broadcast: multi-query attention)

with q, k, v dense [B, H, T, D] (D <= 256, the same D for all three), dropout_p = 0. Everything else
(dropout in training, nested / jagged or DTensor inputs, a mask that needs a gradient) stays
SDPA, with the reason in the report.

Under DelayedScaling a site quantizes Q, K, V (and dO in the "fp8" backward) per tensor with scales
from state kept like the linears' (delayed_state.py). SDPA has no weight to key it on, so the state
hangs off a parameter of the calling module ("owner"), or of its nearest ancestor that has one:
the first of its parameters in sorted name order (state.attention_key_param); a capture without any
parameter there current-scales per (batch, head) and says so.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx as fx

from ..config import ConfigError
from ..distributed import is_dtensor, minimal_groups
from ..lowerings.attention import AttentionLowering, AttentionSpec, attention_grad_dtype
from ..lowerings.context_parallel_attention import ContextParallelLowering, ContextParallelSpec
from ..lowerings.kv_cache_attention import KvCacheAttentionLowering, KvCacheAttentionSpec
from ..state import attention_key_param
from ..fx.editing import replace_with_call
from ..fx.graphs import GraphScope, ParamRef, module_fqn
from ..fx.matching import shape_text, value_of
from .context import PassContext
from .kv_cache_attention import kv_cache_operands, kv_cache_sources

__all__ = ["rewrite_attention", "MAX_HEAD_DIM"]

_SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256   # FlashAttention's limit: a [BLOCK_M, D] tile of q and o stays in registers


def _args(node: fx.Node) -> dict[str, Any]:
    """SDPA's arguments by name, defaults filled in."""
    args = dict(_DEFAULTS)
    args.update(zip(_PARAMS, node.args))
    args.update(node.kwargs)
    return args


def _why_not_attention(args: dict) -> Optional[str]:
    """Why this call stays SDPA, or None when FP8 attention computes it."""
    for name in ("dropout_p", "is_causal", "scale", "enable_gqa"):
        if isinstance(args[name], fx.Node):
            return f"{name} is computed in the graph, not a constant"
    if args["dropout_p"] != 0:
        return f"dropout_p={args['dropout_p']} (FP8 attention has no dropout)"
    q, k, v = (value_of(args[n]) for n in ("query", "key", "value"))
    if q is None or k is None or v is None:
        return "q, k or v is not a tensor the graph describes"
    if any(t.is_nested for t in (q, k, v)):
        return "nested (jagged) inputs"
    if any(is_dtensor(t) for t in (q, k, v)):
        if any(p.is_shard() and p.dim % t.dim() == 2 for t in (q, k, v) if is_dtensor(t) for p in t.placements):
            return ("DTensor inputs split along the sequence: torch's context_parallel runs this call (te's FP8 "
                    "context parallelism is [distributed] context_parallel)")
        return "DTensor inputs"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"q, k, v must be 4-D [B, H, T, D], got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D"
    if q.dtype not in _DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (FP8 attention takes one of fp32, bf16, fp16)"
    d = q.shape[-1]
    if not isinstance(d, int):
        return "the head dim is symbolic"
    if not (k.shape[-1] == v.shape[-1] == d):
        return f"head dims differ (q {d}, k {k.shape[-1]}, v {v.shape[-1]})"
    if d > MAX_HEAD_DIM:
        return f"head dim {d} > {MAX_HEAD_DIM}"
    b, h, hkv = q.shape[0], q.shape[1], k.shape[1]
    if not (k.shape[0] == v.shape[0] == b) or v.shape[1] != hkv or k.shape[2] != v.shape[2]:
        return f"k, v shapes {list(k.shape)}, {list(v.shape)} do not match q {list(q.shape)}"
    if hkv != h:
        # one key/value head broadcasts over the query heads (Falcon's multi-query attention relies on
        # it); any other count needs enable_gqa, as in SDPA itself
        if not args["enable_gqa"] and hkv != 1:
            return f"k, v have {hkv} heads for {h} query heads without enable_gqa"
        if not isinstance(h, int) or not isinstance(hkv, int) or h % hkv:
            return f"query heads ({h}) are not a multiple of key/value heads ({hkv})"
    mask_node = args["attn_mask"]
    if mask_node is not None:
        mask = value_of(mask_node)
        if mask is None:
            return "attn_mask is not a tensor the graph describes"
        if mask.dtype != torch.bool and mask.dtype != q.dtype:
            return f"attn_mask dtype {mask.dtype} (bool or q's dtype {q.dtype} supported)"
        if mask.dim() > 4:
            return f"attn_mask has {mask.dim()} dims"
        if is_dtensor(mask) or mask.is_nested:
            return "attn_mask is a DTensor or nested tensor"
    return None


def _shapes(args: dict) -> str:
    names = (("q", "query"), ("k", "key"), ("v", "value"), ("mask", "attn_mask"))
    return " ".join(text for short, name in names if (text := shape_text(short, args[name])) is not None)


def _state_key(ctx: PassContext, fqn: str) -> Optional[tuple[ParamRef, str]]:
    """(key parameter, owner module) for the delayed-scaling state of an SDPA call in module ``fqn``:
    the module itself or its nearest ancestor that has a parameter among the graph's inputs."""
    params = {ref.name: ref for ref in ctx.delayed.top.params.values()}
    parts = fqn.split(".") if fqn else []
    for n in range(len(parts), -1, -1):
        owner = ".".join(parts[:n])
        key = attention_key_param(list(params), owner)
        if key is not None:
            return params[key], owner
    return None


def _amax_groups(ctx: PassContext, recipe) -> tuple:
    """The groups the update node all-reduces the site's amaxes over: the recipe's amax group. Q, K,
    V are plain local tensors (a DTensor input is not rewritten), so nothing else shards them."""
    return (ctx.amax_group,) if recipe.reduce_amax and ctx.amax_group is not None else ()


def _delayed_inputs(ctx: PassContext, scope: GraphScope, node: fx.Node, fqn: str, recipe):
    """DelayedScaling's extra lowering arguments for the site (delayed_state.py), a reason string
    when it cannot have them, or None when no parameter can key its state."""
    found = _state_key(ctx, fqn)
    if found is None:
        return None
    param, owner = found
    backward_follows = bool(getattr(value_of(node), "requires_grad", False))
    return ctx.delayed.attention_inputs(scope, param, owner, recipe, fqn, backward_follows,
                                        _amax_groups(ctx, recipe))


def _context_parallel(ctx: PassContext, scope: GraphScope, node: fx.Node, fqn: str, args: dict, recipe,
                      record) -> None:
    """Route an SDPA call to te's context-parallel FP8 attention, or raise: left as SDPA, it would attend
    to this rank's slice of the keys only."""
    group, rank = ctx.context_parallel
    why = _why_not_attention(args)
    if why is None and args["attn_mask"] is not None:
        why = "an attn_mask (is_causal=True and no mask are supported)"
    if why is None and (recipe is None or not (recipe.float8_current_scaling() or recipe.delayed())):
        why = f"recipe {recipe.name if recipe is not None else 'none'} (Float8CurrentScaling and DelayedScaling are supported)"
    extra, scaling, history = [], "current-scaled per (batch, head) over the whole sequence", ""
    if why is None and recipe.delayed():
        found = _state_key(ctx, fqn)
        if found is None:
            scaling += " (no parameter in this graph to key delayed-scaling state on)"
        else:
            param, owner = found
            # the state's amaxes are reduced over the context-parallel ranks whatever the amax group
            groups = minimal_groups([*_amax_groups(ctx, recipe), group])
            extra = ctx.delayed.attention_inputs(scope, param, owner, recipe, fqn,
                                                 bool(getattr(value_of(node), "requires_grad", False)), groups)
            if isinstance(extra, str):
                why, extra = extra, []
            else:
                scaling, history = "per tensor with delayed scaling", "; " + ctx.history_reduction(groups, recipe)
    if why is not None:
        raise ConfigError(f"{ctx.config.source}: distributed.context_parallel = "
                          f"{ctx.config.distributed.context_parallel!r}, but the SDPA call in {fqn or '<root>'} "
                          f"cannot run context-parallel: {why}; as SDPA it would attend to this rank's keys only")
    d = value_of(args["query"]).shape[-1]
    scale = args["scale"]
    fp8_backward = recipe.fp8_dpa_backward == "fp8"
    spec = ContextParallelSpec(fqn, float(scale) if scale is not None else 1.0 / math.sqrt(d),
                               bool(args["is_causal"]), attention_grad_dtype(recipe) if fp8_backward else None,
                               group, rank, delayed=bool(extra))
    mode = "FP8 forward and backward" if fp8_backward else "FP8 forward, high-precision backward"
    record(True, f"context parallel over {group}: {mode}; Q, K, V{', dO' if fp8_backward else ''} {scaling}",
           recipe.name, f"all-gather over {group}: K, V in FP8; reduce-scatter: dK, dV; amax all-reduce (MAX): "
                        f"{'O' if extra else 'Q, K, V, O'}{history}")
    replace_with_call(node, ContextParallelLowering(spec), (args["query"], args["key"], args["value"], *extra))


def _sm_scale(args: dict) -> float:
    scale = args["scale"]
    return float(scale) if scale is not None else 1.0 / math.sqrt(value_of(args["query"]).shape[-1])


def _kv_cache(ctx: PassContext, scope: GraphScope, node: fx.Node, fqn: str, args: dict, sources, recipe, why,
              record) -> bool:
    """Route an SDPA call whose K and V come from te's FP8 cache to the attention that reads its bytes
    (lowerings/kv_cache_attention.py); False, with the row written, when it stays SDPA."""
    reason = ctx.why_not_any_site(scope, recipe, why) or _why_not_attention(args)
    if reason is None and getattr(value_of(args["query"]), "requires_grad", False):
        reason = "the query needs a gradient (the FP8-cache attention is for inference)"
    if reason is not None:
        record(False, f"{reason}; K, V read dequantized from the FP8 cache", recipe.name if recipe else None)
        return False
    dtype = value_of(args["query"]).dtype
    record(True, f"K, V read as E4M3 bytes from the FP8 cache, one scale per token; Q and P in "
                 f"{str(dtype).removeprefix('torch.')} ({why})", recipe.name)
    spec = KvCacheAttentionSpec(fqn, _sm_scale(args), bool(args["is_causal"]))
    operands = kv_cache_operands(scope.graph, node, sources)
    replace_with_call(node, KvCacheAttentionLowering(spec), (args["query"], *operands, args["attn_mask"]))
    return True


def rewrite_attention(ctx: PassContext, scope: GraphScope) -> int:
    """Rewrite the eligible SDPA calls of ``scope``; one report row per call."""
    config = ctx.config
    count = 0
    for node in list(scope.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        fqn = scope.fqn(module_fqn(node))
        args = _args(node)
        recipe, why = config.recipe_for(fqn)
        record = ctx.recorder(scope, node, fqn, "sdpa", _shapes(args))
        if (sources := kv_cache_sources(args["key"], args["value"])) is not None:
            count += _kv_cache(ctx, scope, node, fqn, args, sources, recipe, why, record)
            continue
        if ctx.context_parallel is not None:   # every site, or the call would see this rank's keys only
            _context_parallel(ctx, scope, node, fqn, args, recipe, record)
            count += 1
            continue
        if (alone := ctx.why_not_any_site(scope, recipe, why)) is not None:
            record(False, alone)
            continue
        if not (config.rewrite.sdpa or recipe.fp8_dpa or recipe.fp8_mha):
            record(False, f"[rewrite] sdpa = false and {recipe.name}.fp8_dpa = false")
            continue
        reason = _why_not_attention(args)
        if reason is not None:
            record(False, f"{reason} (left in high precision)", recipe.name)
            continue
        extra, unkeyed, collectives = [], "", ""
        if recipe.delayed():
            extra = _delayed_inputs(ctx, scope, node, fqn, recipe)
            if isinstance(extra, str):
                record(False, extra, recipe.name)
                continue
            if extra is None:
                extra, unkeyed = [], " (no parameter in this graph to key delayed-scaling state on)"
            else:
                collectives = ctx.history_reduction(_amax_groups(ctx, recipe), recipe)
        d = value_of(args["query"]).shape[-1]
        scale = args["scale"]
        spec = AttentionSpec(fqn, recipe, float(scale) if scale is not None else 1.0 / math.sqrt(d),
                             bool(args["is_causal"]), recipe.fp8_dpa_backward == "fp8", delayed=bool(extra))
        mha = "; fp8_mha: see its own row" if recipe.fp8_mha else ""
        record(True, f"{spec.mode()}; Q, K, V, P in E4M3, {spec.scaling()}{unkeyed}{mha} ({why})", recipe.name,
               collectives)
        replace_with_call(node, AttentionLowering(spec),
                          (args["query"], args["key"], args["value"], args["attn_mask"], *extra))
        count += 1
    return count
