"""Can a site run in low precision? Each check returns None (yes) or the reason it cannot."""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..recipe import Recipe
from .sites import LinearSite

__all__ = ["linear_ineligibility", "shape_str"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEVICES = ("cpu", "cuda")
# Per-tensor FP8 GEMMs (cuBLASLt) need K and N in multiples of 16.
_PER_TENSOR_ALIGN = 16


def _value(node) -> Optional[torch.Tensor]:
    value = node.meta.get("example_value") if node is not None else None
    return value if isinstance(value, torch.Tensor) else None


def _divisible(dim, by: int) -> bool:
    """True when ``dim`` (int or SymInt) is known to be a multiple of ``by`` for every shape the
    graph is compiled for; a symbolic dim is judged by the ShapeEnv's facts, never by the hint."""
    if isinstance(dim, int):
        return dim % by == 0
    return statically_known_true(dim % by == 0)


def shape_str(site: LinearSite) -> str:
    def one(name, node):
        v = _value(node)
        return f"{name}[{', '.join(str(d) for d in v.shape)}]" if v is not None else f"{name}[?]"

    parts = [one("x", site.x), one("w", site.weight)]
    if site.bias is not None:
        parts.append(one("b", site.bias))
    return " ".join(parts)


def linear_ineligibility(site: LinearSite, recipe: Recipe, weight_is_param: bool) -> Optional[str]:
    x, w = _value(site.x), _value(site.weight)
    if x is None or w is None:
        return "operand shapes unknown (no example value)"
    if w.dim() != 2:
        return f"weight must be 2-D, got {w.dim()}-D"
    if x.dim() < 1:
        return "input is a scalar"
    if x.dtype not in _FLOAT_DTYPES or w.dtype not in _FLOAT_DTYPES:
        return f"dtype {x.dtype}/{w.dtype} is not one of {[str(d) for d in _FLOAT_DTYPES]}"
    if x.device.type not in _DEVICES:
        return f"device {x.device.type!r} is not supported (supported: {list(_DEVICES)})"
    n, k = (w.shape[1], w.shape[0]) if site.weight_in_out else (w.shape[0], w.shape[1])
    for name, dim in (("in_features (K)", k), ("out_features (N)", n)):
        if not _divisible(dim, _PER_TENSOR_ALIGN):
            return (f"{name}={dim} is not divisible by {_PER_TENSOR_ALIGN} "
                    f"(per-tensor FP8 GEMMs need K and N % {_PER_TENSOR_ALIGN} == 0)")
    if recipe.delayed() and not weight_is_param:
        return ("DelayedScaling keeps its state per weight parameter; this weight is computed "
                "in the graph")
    return None
