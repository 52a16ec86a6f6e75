"""Per-tensor FP8 scaling rules in plain torch (DESIGN.md §5), and the per-tensor quantize of a
tensor of a role under a recipe (current and delayed scaling) built from them.

These functions are the single source of the per-tensor numerics: the eager quantizers, the
compiled lowerings and the delayed-scaling state all call them, so eager and compiled results agree
bit for bit. They are written with traceable torch ops only (no ``.item()``, no Python branches on
values) so that inductor can fuse them into neighbouring kernels and no host sync happens.

- ``tensor_amax`` / ``group_amax``, ``compute_scale``, ``cast_to_fp8``: the arithmetic;
- ``update_amax_history``, ``delayed_scale_from_history``, ``update_role_state``: delayed scaling's
  step;
- ``current_scale``, ``quantize_per_tensor``, ``quantize_rows_per_group``, ``quantize_per_expert``:
  one tensor (or each expert's part of it) quantized as a tensor of a role under a recipe, which the
  per-tensor lowerings trace and the eager features (FSDP2's FP8 all-gather, FP8 primary weights,
  the weight cache) call, so both make the same bytes.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from .recipe import Recipe

__all__ = [
    "FLT_MAX",
    "fp8_max",
    "tensor_amax",
    "group_amax",
    "scale_for_limit",
    "compute_scale",
    "cast_to_fp8",
    "update_amax_history",
    "delayed_scale_from_history",
    "update_role_state",
    "current_scale",
    "scale_invs",
    "quantize_per_tensor",
    "quantize_rows_per_group",
    "quantize_per_expert",
]

FLT_MAX = torch.finfo(torch.float32).max

_FP8_MAX = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype."""
    try:
        return _FP8_MAX[fp8_dtype]
    except KeyError:
        raise ValueError(
            f"fp8_dtype must be one of {list(_FP8_MAX)}, got {fp8_dtype!r}"
        ) from None


def tensor_amax(x: torch.Tensor, by_rows: bool = False) -> torch.Tensor:
    """max|x| as an fp32 tensor of shape [1] (0 for an empty tensor).

    ``by_rows``: the maxima of x's rows first, then theirs (the same value). Where the cast does not
    wait for the amax (delayed scaling's, whose scale is known before x is read), inductor then computes
    the row maxima in the cast's own pass over x, [N, K] read once for both; a whole-tensor amax is a
    reduction kernel of its own, one more read of x."""
    numel = x.numel()
    if guard_or_false(numel == 0):
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    if by_rows and x.dim() >= 2 and statically_known_true(numel != 0):
        return x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=-1).amax().to(torch.float32).reshape(1)
    if statically_known_true(numel != 0) or x.dim() == 0:
        return x.detach().abs().amax().to(torch.float32).reshape(1)
    # A data-dependent row count (the tokens routed to one expert in a per-expert loop), which may be 0
    # at run time, where amax has no identity: reduce each row, then those maxima with a 0.
    rows = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=-1).to(torch.float32)
    return torch.cat([rows, rows.new_zeros(1)]).amax().reshape(1)


def group_amax(t: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """max|t| over the rows of each group, fp32 [num_groups] (0 for a group with no rows; NaN stays).

    t: [R, C]; groups: int64 [R], each row's group, rows with ``num_groups`` or more belonging to none
    (tokens past the last expert's end, which the grouped GEMM does not read).
    """
    rows = t.detach().abs().amax(dim=-1).to(torch.float32)   # C > 0: grouped sites have K, N >= 16
    out = torch.zeros(num_groups + 1, dtype=torch.float32, device=t.device)
    return out.scatter_reduce(0, groups.clamp(max=num_groups), rows, "amax", include_self=True)[:num_groups]


def _scale_from_amax(amax: torch.Tensor, limit: float, margin: int) -> torch.Tensor:
    """limit / amax / 2**margin in fp32, an infinite result replaced by FLT_MAX (for amax > 0)."""
    # True IEEE division: a Python scalar over a tensor becomes reciprocal-then-multiply in torch,
    # which is one ulp off in about a quarter of cases (DESIGN.md §6).
    scale = torch.div(torch.full_like(amax, limit), amax)
    if margin:
        scale = scale / float(2**margin)
    # One clamp rather than isinf + select: these ops are inlined into every quantize kernel, and
    # their count is a good part of te's extra compile time. NaN passes; callers replace it.
    return torch.clamp(scale, max=FLT_MAX)


def _valid_amax(amax: torch.Tensor) -> torch.Tensor:
    """0 < amax < inf (False for NaN): the amaxes a scale is computed from."""
    return (amax > 0) & (amax < math.inf)


def scale_for_limit(amax: torch.Tensor, limit: float, *, margin: int = 0) -> torch.Tensor:
    """limit / amax / 2**margin (fp32, true division): the scale that maps ``amax`` onto ``limit``.
    An amax of 0, inf or NaN gives 1 (so does a negative one: an amax is a magnitude); an infinite
    scale (amax tiny) becomes FLT_MAX. Shared by the per-tensor and per-block FP8 scales and NVFP4's
    tensor scale (limit 448 * 6)."""
    return torch.where(_valid_amax(amax), _scale_from_amax(amax, limit, margin), 1.0)


def compute_scale(
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    force_pow_2_scales: bool = False,
    amax_epsilon: float = 0.0,
    margin: int = 0,
) -> torch.Tensor:
    """scale = fp8_max / amax / 2**margin, with TransformerEngine's edge rules.

    amax: fp32 [1]. amax is first clamped up to ``amax_epsilon``; an amax of 0, inf or NaN gives
    scale 1; an infinite scale (amax tiny) becomes FLT_MAX; ``force_pow_2_scales`` rounds the scale
    down to a power of two by clearing its mantissa bits.
    """
    amax = amax.to(torch.float32)
    if amax_epsilon > 0.0:
        amax = torch.clamp(amax, min=amax_epsilon)
    scale = scale_for_limit(amax, fp8_max(fp8_dtype), margin=margin)
    if force_pow_2_scales:
        # keep sign and exponent bits, drop the mantissa: the largest power of two <= scale
        bits = scale.view(torch.int32) & torch.tensor(-8388608, dtype=torch.int32, device=scale.device)
        scale = bits.view(torch.float32)
    return scale


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast of ``x * scale`` (computed in fp32) to ``fp8_dtype``.

    torch's e4m3fn cast saturates on CPU but e5m2 overflows to inf, and CUDA behaviour differs, so
    clamp explicitly. NaN stays NaN.
    """
    limit = fp8_max(fp8_dtype)
    scaled = x.to(torch.float32) * scale.to(torch.float32)
    return torch.clamp(scaled, min=-limit, max=limit).to(fp8_dtype)


def update_amax_history(amax_history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """New history with ``amax`` at index 0, the most recent first; the oldest falls off.

    amax_history: fp32 [L] with amax [1], or one history per expert, [E, L] with amax [E]. Returns a
    new tensor; callers copy it into their state buffer.
    """
    newest = amax.reshape(*amax_history.shape[:-1], 1).to(amax_history.dtype)
    return torch.cat([newest, amax_history[..., :-1]], dim=-1)


def delayed_scale_from_history(
    amax_history: torch.Tensor,
    prev_scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    margin: int = 0,
    amax_compute_algo: Union[str, Callable] = "max",
    scaling_factor_compute_algo: Optional[Callable] = None,
    recipe=None,
) -> torch.Tensor:
    """The delayed-scaling scale for the next step from an amax history ([L], most recent first;
    [E, L] with ``prev_scale`` [E]: one per expert, each row on its own).

    "max" takes the window's max, "most_recent" its first entry, a callable gets the history. The
    scale is fp8_max / amax / 2**margin when amax is finite and > 0; otherwise the previous scale is
    kept; an infinite scale becomes FLT_MAX. ``scaling_factor_compute_algo(amax, scale, fp8_max,
    recipe)`` replaces that rule when given, as in TransformerEngine.
    """
    if callable(amax_compute_algo):
        rows = amax_history.reshape(-1, amax_history.shape[-1])
        amax = torch.stack([amax_compute_algo(row).reshape(()) for row in rows]).to(torch.float32)
    elif amax_compute_algo == "max":
        amax = amax_history.amax(dim=-1)
    elif amax_compute_algo == "most_recent":
        amax = amax_history[..., 0]
    else:
        raise ValueError(
            f"amax_compute_algo must be 'max', 'most_recent' or a callable, got {amax_compute_algo!r}"
        )
    amax = amax.reshape(prev_scale.shape)
    if scaling_factor_compute_algo is not None:
        return scaling_factor_compute_algo(amax, prev_scale, fp8_max(fp8_dtype), recipe).reshape(prev_scale.shape)
    return torch.where(_valid_amax(amax), _scale_from_amax(amax, fp8_max(fp8_dtype), margin),
                       prev_scale.to(torch.float32))


def update_role_state(history: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, role: str, recipe) -> None:
    """Push one step's ``amax`` ([1]) into ``history`` ([L]) and compute the next ``scale`` ([1]), in place
    (or per expert: amax [E], history [E, L], scale [E]). ``role``: a state role (recipe.GEMM_ROLES or
    ATTENTION_ROLES), which picks the FP8 format; ``recipe``: a DelayedScaling.

    A non-finite amax (NaN or inf in the data) keeps the previous scale and enters the history as 0,
    so the history stays finite and scaling follows the data again from the next finite step.
    """
    finite = torch.isfinite(amax)
    new_history = update_amax_history(history, torch.where(finite, amax, torch.zeros_like(amax)))
    new_scale = delayed_scale_from_history(
        new_history, scale, recipe.fp8_format.dtype_for(role), margin=recipe.margin,
        amax_compute_algo=recipe.amax_compute_algo,
        scaling_factor_compute_algo=recipe.scaling_factor_compute_algo, recipe=recipe,
    )
    new_scale = torch.where(finite, new_scale, scale)
    history.copy_(new_history)
    scale.copy_(new_scale)


# ---- per-tensor FP8 (current and delayed scaling) --------------------------------------------------


def current_scale(amax: torch.Tensor, role: str, recipe: Recipe) -> torch.Tensor:
    """Current scaling's scale [1] for ``role`` from ``amax`` [1], with the recipe's options."""
    return compute_scale(amax, recipe.fp8_format.dtype_for(role), force_pow_2_scales=recipe.use_power_2_scales,
                         amax_epsilon=recipe.amax_epsilon)


def scale_invs(*scales: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    """1 / scale of each given scale (true division: the bits ``quantize_per_tensor`` computes), None
    for a None, as one foreach op.

    For DelayedScaling's scales, which are graph inputs: each division alone is a one-element kernel
    (a launch per scale on a GPU, two per linear in forward); inductor makes one kernel of a foreach op.
    Each result is a buffer of its own: ``_scaled_mm``'s lowering does not take a scale sliced out of
    a larger buffer.
    """
    given = [s for s in scales if s is not None]
    invs = iter(torch._foreach_div([torch.ones_like(s) for s in given], given) if given else [])
    return [None if s is None else next(invs) for s in scales]


def quantize_per_tensor(t: torch.Tensor, role: str, recipe: Recipe, scale: Optional[torch.Tensor] = None,
                        amax: Optional[torch.Tensor] = None, *, scale_inv: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 data of ``t``'s shape, scale_inv [1], amax [1]) of ``t`` as a tensor of ``role``.

    scale: None for current scaling (the scale comes from the amax), else the role's delayed-scaling
    scale [1] from steps <= t-1, read only (the graph's update node folds in step t). amax: ``t``'s
    amax when the caller has it (all-reduced across ranks, or of the whole weight), else computed here.
    scale_inv: 1 / scale when the caller computed it with its other scales' (``scale_invs``).
    """
    fp8_dtype = recipe.fp8_format.dtype_for(role)
    amax = tensor_amax(t, by_rows=scale is not None) if amax is None else amax
    if scale is None:
        scale = current_scale(amax, role, recipe)
    data = cast_to_fp8(t, scale, fp8_dtype)
    if scale_inv is None:
        scale_inv = torch.div(torch.ones_like(scale), scale)
    return data, scale_inv, amax


def quantize_rows_per_group(t: torch.Tensor, groups: torch.Tensor, num_groups: int, role: str, recipe: Recipe,
                            scale: Optional[torch.Tensor] = None, amax: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 of each group of rows, a group being one expert's tokens: (fp8 data [R, C],
    scale_inv [num_groups], amax [num_groups]).

    t: [R, C]; groups: int64 [R] (te_compile.gemm.grouped.group_index; rows of no group take no part in
    the amaxes, are cast with the last group's scale and are read by no GEMM). scale: None for current
    scaling, else delayed scaling's [num_groups]; amax: the groups' amaxes [num_groups] when the caller
    has them, else computed here.
    """
    amax = group_amax(t, groups, num_groups) if amax is None else amax
    if scale is None:
        scale = current_scale(amax, role, recipe)
    # the same clamped index as the GEMMs' per-row scales (gemm/grouped.py), so the graph keeps one
    row_scale = scale[groups.clamp(max=num_groups - 1)]
    data = cast_to_fp8(t, row_scale[:, None], recipe.fp8_format.dtype_for(role))
    return data, torch.div(torch.ones_like(scale), scale), amax


def quantize_per_expert(w: torch.Tensor, role: str, recipe: Recipe, scale: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 of each expert's matrix of ``w`` [E, R, C]: (fp8 data [E, R, C], scale_inv [E],
    amax [E]). scale: None for current scaling, else delayed scaling's [E]."""
    amax = w.detach().abs().amax(dim=(1, 2)).to(torch.float32)
    if scale is None:
        scale = current_scale(amax, role, recipe)
    data = cast_to_fp8(w, scale[:, None, None], recipe.fp8_format.dtype_for(role))
    return data, torch.div(torch.ones_like(scale), scale), amax
