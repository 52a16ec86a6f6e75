"""Find LayerNorm / RMSNorm sites in one graph, by structure rather than by module names.

Forms, as they look after Dynamo:

    F.layer_norm(x, shape, w, b, eps)             nn.LayerNorm (bias or not, affine or not), nanoGPT
    F.rms_norm(x, shape, w, eps)                  nn.RMSNorm
    hand-written RMSNorm: v * rsqrt(mean(v * v or v ** 2, -1, keepdim) + eps), then optional casts
    and a product with a parameter (w, or 1 + w as Gemma's zero-centred gamma), then optional casts
                                                  HF Llama / Mistral / Qwen2 / Gemma / T5, gpt-fast
    hand-written LayerNorm: the same around c = v - mean(v, -1, keepdim), i.e.
    c * rsqrt(mean(c ** 2, -1, keepdim) + eps), with an optional bias added to the weight product
                                                  HF Cohere / Cohere2 (Command R)

A site is the node whose value is the norm's output (the last cast, or the weight product), which
is what the linears after it read. Each site is also read as a ``NormSpec`` (te_compile/norm_spec.py)
plus its tensor operands, which is what the fusion pass (norm_fusion.py) lowers; a site that does not
fit one (a norm over several dims, an eps that is a tensor, low-precision arithmetic) carries the
reason instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.fx as fx

from ..norm_spec import NormSpec
from ..fx.graphs import GraphScope, module_fqn
from ..fx.matching import ADD, CASTS, MUL, SUB, calls, dtype_of, erased, method_or_name, squared, strip_casts

__all__ = ["NormSite", "find_norm_sites"]

_LAYER_NORM = (torch.nn.functional.layer_norm, torch.layer_norm)
_RMS_NORM = tuple(f for f in (getattr(torch.nn.functional, "rms_norm", None), getattr(torch, "rms_norm", None))
                  if f is not None)


@dataclass
class NormSite:
    node: fx.Node     # the norm's output
    op: str           # "layer_norm" | "rms_norm"
    fqn: str          # the norm module's path
    form: str         # "layer_norm", "rms_norm", "hand-written RMSNorm", "hand-written LayerNorm"
    x: Optional[fx.Node] = None         # the norm's input
    weight: Optional[fx.Node] = None    # the parameter (not 1 + w: spec.zero_centered says so)
    bias: Optional[fx.Node] = None
    spec: Optional[NormSpec] = None     # None: not fusable, see why
    why: Optional[str] = None


def _centered(v) -> Optional[tuple[fx.Node, fx.Node]]:
    """(h, m) when ``v`` is h - m with m = mean(h, ...) (h up to casts); else None."""
    if not calls(v, SUB, "sub") or len(v.args) != 2 or v.kwargs:
        return None
    h, m = v.args
    if isinstance(h, fx.Node) and method_or_name(m) == "mean" and m.args and strip_casts(m.args[0]) is strip_casts(h):
        return h, m
    return None


def _norm_base(rsqrt: fx.Node) -> Optional[tuple[str, fx.Node, Optional[fx.Node]]]:
    """What ``rsqrt`` normalizes: ("rms_norm", v, None) for rsqrt(mean(v², -1, keepdim) + eps),
    ("layer_norm", h, m) when that v is h - m with m = mean(h) (a variance); else None."""
    arg = rsqrt.args[0] if rsqrt.args else None
    if not calls(arg, ADD, "add"):
        return None
    for mean in arg.args:
        if method_or_name(mean) == "mean" and mean.args:
            v = squared(mean.args[0])
            if v is not None:
                centered = _centered(v)
                return ("rms_norm", v, None) if centered is None else ("layer_norm", *centered)
    return None


def _has_param(node, params) -> bool:
    node = strip_casts(node)
    if node in params:
        return True
    # Gemma: 1 + w (zero-centred gamma)
    return calls(node, ADD, "add") and any(strip_casts(a) in params for a in node.args)


@dataclass
class _HandNorm:
    kind: str                       # "rms_norm" | "layer_norm"
    out: fx.Node                    # the norm's output
    x: fx.Node                      # its input (casts stripped)
    normed: fx.Node                 # x * rstd, or (x - mean) * rstd
    center: Optional[fx.Node]       # LayerNorm: the mean that is subtracted
    product: Optional[fx.Node]      # the weight product
    bias: Optional[fx.Node]         # LayerNorm: the bias add after the product


def _hand_norm(rsqrt: fx.Node, params) -> Optional[_HandNorm]:
    """The hand-written RMSNorm or LayerNorm built around ``rsqrt``, or None."""
    found = _norm_base(rsqrt)
    if found is None:
        return None
    kind, v, center = found
    # T5 squares a cast copy and multiplies the uncast input: compare with casts stripped
    base = strip_casts(v)

    def centered_input(a) -> bool:
        if kind == "rms_norm":
            return strip_casts(a) is base
        # the variance's own h - mean, or (Cohere) a second one of the same mean
        c = _centered(a)
        return c is not None and c[1] is center and strip_casts(c[0]) is base

    normed = next((u for u in rsqrt.users
                   if calls(u, MUL, "mul") and any(centered_input(a) for a in u.args if a is not rsqrt)), None)
    if normed is None:
        return None
    # casts, at most one product with the weight (LayerNorm: and a bias added to it), casts
    out = _after_casts(normed)
    users = list(out.users)
    product = bias = None
    if len(users) == 1 and calls(users[0], MUL, "mul") and any(
            _has_param(a, params) for a in users[0].args if a is not out):
        product = out = users[0]
        users = list(out.users)
        if kind == "layer_norm" and len(users) == 1 and calls(users[0], ADD, "add") and any(
                strip_casts(a) in params for a in users[0].args if a is not out):
            bias = out = users[0]
        out = _after_casts(out)
    return _HandNorm(kind, out, base, normed, center, product, bias)


def _after_casts(node: fx.Node) -> fx.Node:
    """The last of the dtype casts that follow ``node`` as its only user, one after another."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if method_or_name(user) not in CASTS or not user.args or user.args[0] is not node:
            break
        node = user
    return node


def _casts_between(start: fx.Node, end: fx.Node) -> tuple[torch.dtype, ...]:
    """The dtypes of the cast nodes after ``start`` up to ``end`` (a chain from _after_casts)."""
    dtypes, node = [], end
    while node is not start:
        dtypes.append(dtype_of(node))
        node = node.args[0]
    return tuple(reversed(dtypes))


# A float attribute (a norm's eps) is a constant in the first graph of a frame; when Dynamo compiles
# the same code again with another value (a second model whose norms share the class's forward), it
# makes the float a graph input, whose value the fused kernels cannot bake in.
_NOT_CONSTANT = ("eps is not a constant (a graph input: Dynamo makes a float one when it recompiles the same "
                 "code for another value; torch._dynamo.config.specialize_float = True keeps it constant)")


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _last_dim_only(shape, x: fx.Node) -> bool:
    """normalized_shape names the last dim alone."""
    if isinstance(shape, (int, torch.SymInt)) or isinstance(shape, fx.Node):
        return True
    return isinstance(shape, (list, tuple, torch.Size)) and len(shape) == 1


def _parse_library(site: NormSite, node: fx.Node) -> None:
    """F.layer_norm(x, shape, w, b, eps) / F.rms_norm(x, shape, w, eps): computed in fp32, rounded
    once to the input's dtype."""
    is_ln = site.op == "layer_norm"
    site.x = _arg(node, 0, "input")
    shape = _arg(node, 1, "normalized_shape")
    site.weight = _arg(node, 2, "weight")
    site.bias = _arg(node, 3, "bias") if is_ln else None
    eps = _arg(node, 4 if is_ln else 3, "eps", 1e-5 if is_ln else None)
    dtype = dtype_of(node)
    if eps is None:   # F.rms_norm's default: the eps of its compute dtype (fp32 for fp32/bf16/fp16)
        eps = torch.finfo(torch.float32).eps
    if not _last_dim_only(shape, site.x):
        site.why = "normalizes over several dims (fusion covers the last dim)"
    elif not isinstance(eps, (int, float)):
        site.why = _NOT_CONSTANT
    elif dtype not in (torch.float32, torch.bfloat16, torch.float16):
        site.why = f"output dtype {dtype}"
    else:
        _set_spec(site, site.op, float(eps), prod_dtype=dtype)


def _last_dim_mean(mean: fx.Node) -> bool:
    """``mean`` is over the last dim alone, with keepdim."""
    dim = _arg(mean, 1, "dim")
    rank = getattr(mean.args[0].meta.get("example_value"), "ndim", None)
    return (dim in (-1, [-1], (-1,)) or (rank is not None and dim in (rank - 1, [rank - 1], (rank - 1,)))) \
        and bool(_arg(mean, 2, "keepdim", False))


def _parse_hand_norm(site: NormSite, rsqrt: fx.Node, found: _HandNorm, params) -> None:
    site.x = found.x
    add = rsqrt.args[0]
    eps = next((a for a in add.args if not isinstance(a, fx.Node)), None)
    mean = next(a for a in add.args if isinstance(a, fx.Node))
    if not all(_last_dim_mean(m) for m in (mean, found.center) if m is not None):
        site.why = "the mean is not over the last dim with keepdim"
        return
    if not isinstance(eps, (int, float)):
        site.why = _NOT_CONSTANT
        return
    if dtype_of(rsqrt) != torch.float32:
        site.why = f"computes in {dtype_of(rsqrt)} (fusion computes norms in float32)"
        return
    pre_end = _after_casts(found.normed)
    product = found.product
    if product is None:
        _set_spec(site, found.kind, float(eps), casts=_casts_between(found.normed, site.node))
        return
    w_expr = next(a for a in product.args if a is not pre_end)
    inner = strip_casts(w_expr)
    zero_centered = inner not in params
    if zero_centered:   # 1 + w
        others = [a for a in inner.args if strip_casts(a) not in params]
        if len(inner.args) != 2 or len(others) != 1 or others[0] != 1:
            site.why = "the weight term is neither w nor 1 + w"
            return
        inner = next(strip_casts(a) for a in inner.args if strip_casts(a) in params)
    if any(dtype_of(n) not in (torch.float32, dtype_of(inner)) for n in _chain(w_expr, inner)):
        site.why = "the weight is cast to a lower precision before the product"
        return
    last = product
    if found.bias is not None:
        b_expr = next(a for a in found.bias.args if a is not product)
        site.bias = strip_casts(b_expr)
        # the kernels add the bias to the fp32 product and round once
        if dtype_of(product) != torch.float32 or dtype_of(found.bias) != torch.float32:
            site.why = "the bias is added in low precision"
            return
        last = found.bias
    site.weight = inner
    pre = dtype_of(pre_end)
    _set_spec(site, found.kind, float(eps), zero_centered=zero_centered,
              pre_dtype=None if pre == torch.float32 else pre, prod_dtype=dtype_of(last),
              casts=_casts_between(last, site.node))


def _set_spec(site: NormSite, *args, **kwargs) -> None:
    """site.spec, or site.why when the dtypes are ones the fused kernels do not handle (float64)."""
    try:
        site.spec = NormSpec(*args, **kwargs)
    except ValueError as e:
        site.why = str(e)


def _chain(node, stop) -> list[fx.Node]:
    """The nodes from ``node`` back to ``stop`` through first arguments (casts, 1 + w)."""
    out = []
    while isinstance(node, fx.Node) and node is not stop and node.args:
        out.append(node)
        node = node.args[0] if isinstance(node.args[0], fx.Node) else node.args[-1]
    return out


def find_norm_sites(scope: GraphScope) -> Iterator[NormSite]:
    """The norm sites of ``scope`` in graph order, each found when the caller's loop reaches it: a norm
    reading a linear that fusing an earlier norm replaced (DeepSeek's MLA: input_layernorm fused into
    q_a_proj, whose output q_a_layernorm normalizes) then names the replacement, not a node that is
    gone from the graph."""
    for node in list(scope.graph.nodes):
        if erased(node) or node.op not in ("call_function", "call_method"):
            continue
        if node.op == "call_function" and node.target in _LAYER_NORM + _RMS_NORM:
            op = "layer_norm" if node.target in _LAYER_NORM else "rms_norm"
            site = NormSite(node, op, scope.fqn(module_fqn(node)), op)
            _parse_library(site, node)
            yield site
        elif method_or_name(node) == "rsqrt":
            found = _hand_norm(node, scope.params)
            if found is not None:
                form = "hand-written RMSNorm" if found.kind == "rms_norm" else "hand-written LayerNorm"
                site = NormSite(found.out, found.kind, scope.fqn(module_fqn(node)), form)
                _parse_hand_norm(site, node, found, scope.params)
                yield site
