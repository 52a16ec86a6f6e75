"""From a recipe to the quantizer objects of its tensors (the role of TransformerEngine's RecipeState).

The place that turns a recipe into quantizers and judges weights against it, below both the
lowerings (compiled graphs) and the eager features (FSDP2's FP8 all-gather, FP8 primary weights),
so that a weight quantized before any graph exists has the bytes the graph would make:

- ``quantizer_factory(recipe)(role)``: a fresh quantizer object for a tensor of ``role``
  (te_compile.recipe.ROLES) under a block-scaled recipe or a CustomRecipe, and ``quantize_copies``
  to quantize with it;
- ``quantize_tokens_per_group``: an MoE layer's tokens quantized with such a quantizer, each
  expert's rows as if alone;
- ``weight_quantizer(recipe)``: the quantizer of a linear's weight operand under any recipe;
- ``weight_ineligibility`` / ``weight_is_operand``: whether a weight can be, or already is, the
  recipe's GEMM operand.

The per-tensor FP8 quantize (current and delayed scaling) is plain tensor ops with no quantizer
object, so it lives beside its arithmetic in te_compile.scaling (``quantize_per_tensor``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .kernels.nvfp4_quantize import NVFP4_BLOCK
from .recipe import GRADIENT_ROLES, ROLES, DelayedScaling, Float8CurrentScaling, Recipe
from .state import state_for
from .tensor.float8_blockwise_tensor import Float8BlockQuantizer
from .tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from .tensor.grouped_float8_tensor import GroupedFloat8Quantizer
from .tensor.mxfp8_tensor import MXFP8Quantizer
from .tensor.nvfp4_tensor import NVFP4Quantizer
from .tensor.quantized_tensor import Quantizer

__all__ = [
    "quantizer_factory",
    "quantize_copies",
    "weight_quantizer",
    "quantize_tokens_per_group",
    "weight_ineligibility",
    "weight_is_operand",
    "FLOAT_DTYPES",
]

# The high-precision dtypes a GEMM operand may come in.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- quantizer objects (block-scaled recipes, CustomRecipe) ---------------------------------------


def _block_quantizer(recipe: Recipe, role: str) -> Quantizer:
    """``recipe``'s quantizer for ``role``, for the built-in block-scaled recipes."""
    if recipe.mxfp8():
        return MXFP8Quantizer(recipe.fp8_format.dtype_for(role))
    if recipe.float8_block_scaling():
        dim = (recipe.w_block_scaling_dim if role == "weight" else
               recipe.grad_block_scaling_dim if role in GRADIENT_ROLES else recipe.x_block_scaling_dim)
        return Float8BlockQuantizer(recipe.fp8_format.dtype_for(role), rowwise=True, columnwise=True,
                                    block_scaling_dim=dim, force_pow_2_scales=recipe.use_power_2_scales,
                                    amax_epsilon=recipe.amax_epsilon)
    # NVFP4's training recipe: 16x16 blocks for weights (so W and W.T share scales), stochastic
    # rounding for gradients, the Hadamard transform on the wgrad operands (input and grad_output).
    return NVFP4Quantizer(
        with_2d_quantization=role == "weight" and not recipe.disable_2d_quantization,
        stochastic_rounding=role in GRADIENT_ROLES and not recipe.disable_stochastic_rounding,
        with_rht=role in ("input", *GRADIENT_ROLES) and not recipe.disable_rht,
    )


def quantizer_factory(recipe: Recipe) -> Callable[[str], Quantizer]:
    """``role -> Quantizer`` for a block-scaled recipe, or a CustomRecipe's own ``qfactory``.

    The per-tensor recipes have none: their lowerings quantize with ``scaling.quantize_per_tensor``.
    """
    if recipe.custom():
        return recipe.qfactory
    if recipe.block_format is None:
        raise ValueError(f"no quantizer factory for {recipe.name}: per-tensor recipes quantize with "
                         f"quantize_per_tensor; factories exist for the block-scaled recipes and CustomRecipe")

    def factory(role: str) -> Quantizer:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return _block_quantizer(recipe, role)

    return factory


def quantize_copies(factory: Callable[[str], Quantizer], role: str, t: torch.Tensor, *, rowwise: bool = True,
                    columnwise: bool = False, amax_groups: tuple = ()):
    """The asked copies of ``t`` (rowwise: blocks along the last dim; columnwise: along dim 0),
    quantized by a fresh copy of ``factory(role)``, as a storage object (no autograd wrapper).
    ``amax_groups``: where the format has a tensor-level amax (NVFP4), it is all-reduced over these
    first (te_compile.distributed.AmaxGroup; shards of a tensor split across ranks)."""
    quantizer = factory(role).copy()
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    if amax_groups and hasattr(quantizer, "amax_reduction_groups"):
        quantizer.amax_reduction_groups = amax_groups
    quantizer.internal = True
    return quantizer.quantize(t)


def weight_quantizer(recipe: Recipe, weight: Optional[torch.Tensor] = None,
                     where: str = "weight_quantizer") -> Quantizer:
    """The quantizer that makes ``recipe``'s weight operand, bit for bit as the te backend would.

    Delayed scaling needs ``weight`` (the parameter): its quantizer reads the scale the compiled
    graph keeps for that parameter (``where`` names the caller in state errors), and links that
    state (``linear_state``) so that copies of the weight find it.
    """
    fp8_dtype = recipe.fp8_format.dtype_for("weight") if recipe.per_tensor else None
    if isinstance(recipe, Float8CurrentScaling):
        # the FP8 GEMMs read only the rowwise bytes (the transpose is made in the GEMM call)
        return Float8CurrentScalingQuantizer(fp8_dtype, columnwise=False,
                                             force_pow_2_scales=recipe.use_power_2_scales,
                                             amax_epsilon=recipe.amax_epsilon)
    if isinstance(recipe, DelayedScaling):
        if weight is None:
            raise ValueError(f"{where}: delayed scaling needs the weight parameter (its scale is the "
                             f"compiled graph's state for that parameter)")
        state = state_for(weight, recipe.amax_history_len, where)
        scale = state.roles["weight"].scale
        if state.experts:   # a 3-D expert weight: one scale per expert
            return GroupedFloat8Quantizer(scale, fp8_dtype, linear_state=state)
        quantizer = Float8Quantizer(scale, torch.zeros(1, device=scale.device), fp8_dtype, columnwise=False)
        # travels with the weight's copies (views, FSDP2 shards and gathers keep the quantizer):
        # te_compile.state finds this state for them
        quantizer.linear_state = state
        return quantizer
    quantizer = quantizer_factory(recipe)("weight")
    if recipe.float8_block_scaling() and recipe.w_block_scaling_dim == 2:
        # 128x128 tiles: the columnwise copy is the transpose of the rowwise one, derived where a
        # GEMM needs it, so the master-weight cast and an all-gather move only the rowwise bytes
        quantizer.set_usage(columnwise=False)
    # MXFP8 keeps both copies: its columnwise blocks cannot be derived from the rowwise ones
    return quantizer


# ---- MoE tokens grouped by expert (quantizer objects) ---------------------------------------------


class _PerGroupNVFP4Quantizer(NVFP4Quantizer):
    """NVFP4 whose tensor-level amax is one per group of token rows (an MoE layer's experts), each
    group quantized as if alone: per row tile of the rowwise copy (``tokens`` = rows), or per column
    of blocks of the columnwise copy (``tokens`` = columns of x2d.T; groups padded to whole 16-row
    blocks by the caller). groups: int64, the group of each token (``num_groups`` or more: none)."""

    def __init__(self, base: NVFP4Quantizer, groups: torch.Tensor, num_groups: int) -> None:
        super().__init__(rowwise=base.rowwise_usage, columnwise=base.columnwise_usage, with_rht=base.with_rht,
                         stochastic_rounding=base.stochastic_rounding, with_2d_quantization=False)
        self.groups, self.num_groups = groups, num_groups

    def _amax(self, x2d: torch.Tensor) -> torch.Tensor:
        if not self.columnwise_usage:   # the rowwise copy: x2d [M, K], one amax per row's group
            per_token = x2d.detach().abs().amax(dim=1)
            amax = self._group_max(per_token)
            return torch.cat([amax, amax.new_ones(1)])[self.groups.clamp(max=self.num_groups)][:, None]
        # the columnwise copy: x2d = the tokens' transpose [K, M'] (after the Hadamard transform)
        blocks = x2d.detach().abs().reshape(x2d.shape[0], -1, NVFP4_BLOCK).amax(dim=(0, 2))   # [M' / 16]
        block_groups = self.groups[::NVFP4_BLOCK]
        amax = self._group_max(blocks, block_groups)
        return torch.cat([amax, amax.new_ones(1)])[block_groups.clamp(max=self.num_groups)][None, :]

    def _group_max(self, values: torch.Tensor, groups: Optional[torch.Tensor] = None) -> torch.Tensor:
        groups = self.groups if groups is None else groups
        out = torch.zeros(self.num_groups + 1, dtype=torch.float32, device=values.device)
        return out.scatter_reduce(0, groups.clamp(max=self.num_groups), values.to(torch.float32), "amax",
                                  include_self=True)[:self.num_groups]


def quantize_tokens_per_group(factory: Callable[[str], Quantizer], role: str, t: torch.Tensor, groups: torch.Tensor,
                              num_groups: int, *, columnwise: bool = False):
    """``t``'s token rows (an MoE layer's, grouped by expert) quantized as the dense block linear
    quantizes one group's rows alone, as a storage object: rowwise (blocks along the last dim), or
    with ``columnwise`` the copy whose blocks run down the tokens (the caller pads each group to whole
    blocks, ``Recipe.token_block_rows``). Formats whose scales are per block only (MXFP8, Float8
    block) need no grouping; NVFP4's tensor-level amax becomes one per group."""
    quantizer = factory(role).copy()
    quantizer.set_usage(rowwise=not columnwise, columnwise=columnwise)
    if isinstance(quantizer, NVFP4Quantizer):
        quantizer = _PerGroupNVFP4Quantizer(quantizer, groups, num_groups)
    quantizer.internal = True
    return quantizer.quantize(t)


# ---- weights ---------------------------------------------------------------------------------------


def weight_ineligibility(weight: torch.Tensor, recipe: Recipe) -> Optional[str]:
    """Why an ``nn.Linear`` weight [N, K] cannot be ``recipe``'s GEMM operand (its dtype, its
    alignment), as the linear pass judges it, or None. For what acts on weights before any graph
    exists: FSDP2's FP8 all-gather and FP8 primary weights."""
    if weight.dtype not in FLOAT_DTYPES:
        return f"weight dtype {weight.dtype} is not one of fp32, bf16, fp16"
    if any(d % recipe.gemm_alignment for d in weight.shape):
        return f"weight {list(weight.shape)}: {recipe.gemm_alignment_reason}"
    return None


def weight_is_operand(weight: torch.Tensor, recipe: Recipe) -> bool:
    """Whether an already-quantized ``weight`` (FSDP2's FP8 all-gather, an FP8 primary weight) is in
    ``recipe``'s weight format, so that the lowering takes its bytes as they are; a quantized weight
    of another format is dequantized and quantized again."""
    if recipe.per_block_scales:
        return quantizer_factory(recipe)("weight").matches(weight)
    return (recipe.per_tensor and isinstance(weight, Float8Tensor) and weight._data is not None
            and weight._fp8_dtype == recipe.fp8_format.dtype_for("weight"))
