"""Can a site run in low precision? Each check returns None (yes) or the reason it cannot."""

from __future__ import annotations

from typing import Optional

from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import hardware
from ..distributed import is_dtensor, local_value
from ..gemm.operands import FLOAT_DTYPES
from ..recipe import Recipe
from ..fx.gemm_operands import LinearSite
from ..fx.matching import shape_text, value_of

__all__ = ["why_not_linear", "why_small_gemm", "shape_str", "divisible", "SMALL_GEMM_DIM"]

_DEVICES = ("cpu", "cuda")

# The largest GEMM at which a per-tensor FP8 linear was measured slower than bf16 on a GPU: forward +
# backward of one bias-free linear on an H100 (BENCHMARKS.md, GPU 2026-11-26, first lease) ran at
# 0.84x bf16 under current scaling and 0.77x under delayed scaling at M = K = N = 4096, and at 1.63x
# and 1.58x at 8192: the casts around three GEMMs cost more than the small GEMMs save. A GPU site no
# larger in any of M, K, N stays in high precision under [rewrite] small_gemms = "auto" (its casts
# weigh more against its GEMMs still); a site larger in one dim (8192 tokens through a 4096 x 1024
# projection) is not judged from this point and keeps FP8 until a lease measures its shape.
SMALL_GEMM_DIM = 4096


def divisible(dim, by: int) -> bool:
    """True when ``dim`` (int or SymInt) is known to be a multiple of ``by`` for every shape the
    graph is compiled for; a symbolic dim is judged by the ShapeEnv's facts, never by the hint."""
    if isinstance(dim, int):
        return dim % by == 0
    return statically_known_true(dim % by == 0)


def shape_str(site: LinearSite) -> str:
    def one(name, node):
        return shape_text(name, node) or f"{name}[?]"

    parts = [one("x", site.x), one("w", site.weight)]
    if site.expert is not None:
        parts[-1] += f"={site.param.name}[{site.expert}]"   # one expert's matrix of a 3-D weight
    elif site.param is not None and site.param.name != ".".join(p for p in (site.fqn, "weight") if p):
        parts[-1] += f"={site.param.name}"   # a weight from elsewhere: tied, shared, a root parameter
    if site.bias is not None:
        parts.append(one("b", site.bias))
    return " ".join(parts)


def why_small_gemm(site: LinearSite, recipe: Recipe, setting: str) -> Optional[str]:
    """Why an otherwise eligible site stays in high precision because its GEMM is too small for FP8 to
    win on its GPU in training (``SMALL_GEMM_DIM``), or None: always None under ``setting`` "fp8", on a
    CPU (whose FP8 GEMMs are an emulation: no speed to win), for block-scaled recipes (not measured),
    experts and ``W @ x`` forms; the caller leaves inference graphs out (the measurement is of forward
    + backward). A symbolic size is judged by what holds for every shape, never by its hint."""
    if setting != "auto" or not recipe.per_tensor or site.expert is not None or site.weight_first:
        return None
    x, w = local_value(value_of(site.x)), local_value(value_of(site.weight))
    if x is None or w is None or hardware.code_device_type(x) != "cuda" or w.dim() != 2:
        return None
    n, k = (w.shape[1], w.shape[0]) if site.weight_in_out else (w.shape[0], w.shape[1])
    m = x.numel() // k
    if not all(statically_known_true(d <= SMALL_GEMM_DIM) for d in (m, k, n)):
        return None
    return (f"GEMM M x K x N = {m} x {k} x {n}, no larger in any dim than 4096 x 4096 x 4096, where an FP8 "
            f"linear ran slower than bf16 on an H100 (0.84x current scaling, 0.77x delayed, forward + "
            f'backward): kept in high precision ([rewrite] small_gemms = "fp8" runs it in FP8)')


def _cut(site: LinearSite, name: str) -> str:
    """For a DTensor weight whose shard is misaligned: which mesh dim cut the whole dim, else ""."""
    w = value_of(site.weight)
    if not is_dtensor(w):
        return ""
    dim = (0 if name.startswith("in") else 1) if site.weight_in_out else (1 if name.startswith("in") else 0)
    cuts = [f"{w.device_mesh.mesh_dim_names[i] if w.device_mesh.mesh_dim_names else f'mesh dim {i}'} "
            f"({w.device_mesh.size(i)} ranks)" for i, p in enumerate(w.placements) if p.is_shard(dim)]
    if not cuts:
        return ""
    return (f"; the whole weight's {name.split()[0]} is {w.shape[dim]}, which the tensor-parallel plan splits "
            f"over {', '.join(cuts)}: each rank holds only its shard, so keep every shard a whole number of blocks")


def why_not_linear(site: LinearSite, recipe: Recipe) -> Optional[str]:
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
    if x.dim() < recipe.min_input_dims:
        return f"{recipe.format_label} needs an input of at least {recipe.min_input_dims} dims, got {x.dim()}-D"
    n, k = (w.shape[1], w.shape[0]) if site.weight_in_out else (w.shape[0], w.shape[1])
    align = recipe.gemm_alignment
    for name, dim in (("in_features (K)", k), ("out_features (N)", n)):
        if not divisible(dim, align):
            return f"{name}={dim} is not divisible by {align} ({recipe.gemm_alignment_reason}){_cut(site, name)}"
    if site.expert is not None and is_dtensor(value_of(site.weight)):
        return (f"one expert's matrix of the sharded (DTensor) parameter {site.param.name} is not lowered yet "
                f"(index its to_local() shard, as torchtitan's experts do)")
    if recipe.delayed() and site.param is None:
        return ("DelayedScaling keeps its state per weight parameter; this weight is computed "
                "in the graph")
    return None
