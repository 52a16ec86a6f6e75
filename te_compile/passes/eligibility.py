"""Can a site run in low precision? Each check returns None (yes) or the reason it cannot."""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..lowerings.sharded_linear import local_value
from ..recipe import Recipe
from .matching import shape_text, value_of
from .sites import LinearSite

__all__ = ["linear_ineligibility", "weight_ineligibility", "shape_str", "FLOAT_DTYPES", "gemm_alignment"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEVICES = ("cpu", "cuda")
# Multiple that K and N must be of, per recipe, and why. FP8 GEMMs (cuBLASLt) need 16; MXFP8's
# blocks are 32 long in both directions of the weight (rowwise for fprop, columnwise for dgrad);
# NVFP4's are 16. Float8 block scaling quantizes ragged 128-blocks as partial blocks, so it needs
# only the GEMM alignment.
_ALIGN = {
    "MXFP8BlockScaling": (32, "MXFP8 scales blocks of 32 along K and N"),
    "NVFP4BlockScaling": (16, "NVFP4 scales blocks of 16 along K and N"),
}
_DEFAULT_ALIGN = (16, "FP8 GEMMs need K and N % 16 == 0")


def gemm_alignment(recipe: Recipe) -> tuple[int, str]:
    """(the multiple K and N must be of under ``recipe``, why)."""
    return _ALIGN.get(recipe.name, _DEFAULT_ALIGN)


def weight_ineligibility(weight: torch.Tensor, recipe: Recipe) -> Optional[str]:
    """Why an ``nn.Linear`` weight [N, K] cannot be ``recipe``'s GEMM operand (its dtype, its
    alignment), as the linear pass judges it, or None. For what acts on weights before any graph
    exists: FSDP2's FP8 all-gather and FP8 primary weights."""
    if weight.dtype not in FLOAT_DTYPES:
        return f"weight dtype {weight.dtype} is not one of fp32, bf16, fp16"
    align, why = gemm_alignment(recipe)
    if any(d % align for d in weight.shape):
        return f"weight {list(weight.shape)}: {why}"
    return None


def _divisible(dim, by: int) -> bool:
    """True when ``dim`` (int or SymInt) is known to be a multiple of ``by`` for every shape the
    graph is compiled for; a symbolic dim is judged by the ShapeEnv's facts, never by the hint."""
    if isinstance(dim, int):
        return dim % by == 0
    return statically_known_true(dim % by == 0)


def shape_str(site: LinearSite) -> str:
    def one(name, node):
        return shape_text(name, node) or f"{name}[?]"

    parts = [one("x", site.x), one("w", site.weight)]
    if site.param is not None and site.param.name != ".".join(p for p in (site.fqn, "weight") if p):
        parts[-1] += f"={site.param.name}"   # a weight from elsewhere: tied, shared, a root parameter
    if site.bias is not None:
        parts.append(one("b", site.bias))
    return " ".join(parts)


def linear_ineligibility(site: LinearSite, recipe: Recipe) -> Optional[str]:
    # DTensor operands run shard by shard: judge the local shards (a column-parallel N is N / tp)
    x, w = local_value(value_of(site.x)), local_value(value_of(site.weight))
    if x is None or w is None:
        return "operand shapes unknown (no example value)"
    if w.dim() != 2:
        return f"weight must be 2-D, got {w.dim()}-D"
    if x.dim() < 1:
        return "input is a scalar"
    if any(statically_known_true(d == 0) for d in x.shape):
        return f"input {list(x.shape)} is empty: nothing to quantize (eager's result, exactly)"
    if x.dtype not in FLOAT_DTYPES or w.dtype not in FLOAT_DTYPES:
        return f"dtype {x.dtype}/{w.dtype} is not one of {[str(d) for d in FLOAT_DTYPES]}"
    if x.device.type not in _DEVICES:
        return f"device {x.device.type!r} is not supported (supported: {list(_DEVICES)})"
    if recipe.nvfp4() and x.dim() < 2:
        return f"NVFP4 needs an input of at least 2 dims, got {x.dim()}-D"
    n, k = (w.shape[1], w.shape[0]) if site.weight_in_out else (w.shape[0], w.shape[1])
    align, why = gemm_alignment(recipe)
    for name, dim in (("in_features (K)", k), ("out_features (N)", n)):
        if not _divisible(dim, align):
            return f"{name}={dim} is not divisible by {align} ({why})"
    if recipe.delayed() and site.param is None:
        return ("DelayedScaling keeps its state per weight parameter; this weight is computed "
                "in the graph")
    return None
