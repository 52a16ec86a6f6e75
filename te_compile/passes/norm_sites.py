"""Find LayerNorm / RMSNorm sites in one graph, by structure rather than by module names.

Forms, as they look after Dynamo:

    F.layer_norm(x, shape, w, b, eps)             nn.LayerNorm (bias or not, affine or not), nanoGPT
    F.rms_norm(x, shape, w, eps)                  nn.RMSNorm
    hand-written RMSNorm: v * rsqrt(mean(v * v or v ** 2, -1, keepdim) + eps), then optional casts
    and a product with a parameter (w, or 1 + w as Gemma's zero-centred gamma), then optional casts
                                                  HF Llama / Mistral / Qwen2 / Gemma / T5, gpt-fast

A site is the node whose value is the norm's output (the last cast, or the weight product), which
is what the linears after it read. This is the finder the norm→quantize fusion pass builds on; it is
not wired into the passes or the report yet.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from .graphs import GraphScope
from .sites import module_fqn

__all__ = ["NormSite", "find_norm_sites"]

_LAYER_NORM = (torch.nn.functional.layer_norm, torch.layer_norm)
_RMS_NORM = tuple(f for f in (getattr(torch.nn.functional, "rms_norm", None), getattr(torch, "rms_norm", None))
                  if f is not None)
_CASTS = ("to", "type", "type_as", "float", "half", "bfloat16")
_MUL = (operator.mul, torch.mul, torch.Tensor.mul)
_ADD = (operator.add, torch.add, torch.Tensor.add)


@dataclass
class NormSite:
    node: fx.Node     # the norm's output
    op: str           # "layer_norm" | "rms_norm"
    fqn: str          # the norm module's path
    form: str         # for the report: "layer_norm", "rms_norm", "hand-written RMSNorm"


def _name(node) -> Optional[str]:
    """A call's op name: the method name, or the function's __name__."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", None)
    return None


def _is(node, fns: tuple, method: str) -> bool:
    return isinstance(node, fx.Node) and ((node.op == "call_function" and node.target in fns)
                                          or (node.op == "call_method" and node.target == method))


def _strip_casts(node):
    while isinstance(node, fx.Node) and _name(node) in _CASTS and node.args:
        node = node.args[0]
    return node


def _squared(node) -> Optional[fx.Node]:
    """v for ``v ** 2``, ``v * v`` or ``v.square()``; else None."""
    if _name(node) in ("pow", "__pow__") and len(node.args) == 2 and node.args[1] == 2:
        return node.args[0]
    if (_is(node, _MUL, "mul") and len(node.args) == 2 and isinstance(node.args[0], fx.Node)
            and _strip_casts(node.args[0]) is _strip_casts(node.args[1])):   # x.float() * x.float()
        return node.args[0]
    if _name(node) == "square" and node.args:
        return node.args[0]
    return None


def _rms_base(rsqrt: fx.Node) -> Optional[fx.Node]:
    """v when ``rsqrt`` computes rsqrt(mean(v², -1, keepdim) + eps), else None."""
    arg = rsqrt.args[0] if rsqrt.args else None
    if not _is(arg, _ADD, "add"):
        return None
    for mean in arg.args:
        if _name(mean) == "mean" and mean.args:
            v = _squared(mean.args[0])
            if v is not None:
                return v
    return None


def _has_param(node, params) -> bool:
    node = _strip_casts(node)
    if node in params:
        return True
    # Gemma: 1 + w (zero-centred gamma)
    return _is(node, _ADD, "add") and any(_strip_casts(a) in params for a in node.args)


def _hand_rms_output(rsqrt: fx.Node, params) -> Optional[fx.Node]:
    """The output node of a hand-written RMSNorm built around ``rsqrt``, or None."""
    v = _rms_base(rsqrt)
    if v is None:
        return None
    # T5 squares a cast copy and multiplies the uncast input: compare with casts stripped
    base = _strip_casts(v)
    normed = next((u for u in rsqrt.users
                   if _is(u, _MUL, "mul") and any(_strip_casts(a) is base for a in u.args if a is not rsqrt)),
                  None)
    if normed is None:
        return None
    # casts, at most one product with the weight, casts
    out = _after_casts(normed)
    users = list(out.users)
    if len(users) == 1 and _is(users[0], _MUL, "mul") and any(
            _has_param(a, params) for a in users[0].args if a is not out):
        out = _after_casts(users[0])
    return out


def _after_casts(node: fx.Node) -> fx.Node:
    """The last of the dtype casts that follow ``node`` as its only user, one after another."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if _name(user) not in _CASTS or not user.args or user.args[0] is not node:
            break
        node = user
    return node


def find_norm_sites(scope: GraphScope) -> list[NormSite]:
    sites = []
    for node in scope.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if node.op == "call_function" and node.target in _LAYER_NORM:
            sites.append(NormSite(node, "layer_norm", scope.fqn(module_fqn(node)), "layer_norm"))
        elif node.op == "call_function" and node.target in _RMS_NORM:
            sites.append(NormSite(node, "rms_norm", scope.fqn(module_fqn(node)), "rms_norm"))
        elif _name(node) == "rsqrt":
            out = _hand_rms_output(node, scope.params)
            if out is not None:
                sites.append(NormSite(out, "rms_norm", scope.fqn(module_fqn(node)), "hand-written RMSNorm"))
    return sites
