"""A linear's weight under a recipe before any graph exists: the quantizer that makes its GEMM
operand (``weight_quantizer``) and why it cannot be one (``weight_ineligibility``), for what acts on
weights outside the compiled graph (FSDP2's FP8 all-gather, FP8 primary weights, calibration), so
that a weight quantized there has the bytes the graph would make.

The quantizers of the block-scaled recipes and CustomRecipe come from gemm/block.py
(``quantizer_factory``); the per-tensor recipes' weight quantizers are built here from the recipe's
fields and, under delayed scaling, the compiled graph's state for the weight.
"""

from __future__ import annotations

from typing import Optional

import torch

from .gemm.block import quantizer_factory
from .gemm.operands import FLOAT_DTYPES
from .recipe import DelayedScaling, Float8CurrentScaling, Recipe
from .state import state_for
from .tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from .tensor.grouped_float8_tensor import GroupedFloat8Quantizer
from .tensor.quantized_tensor import Quantizer

__all__ = ["weight_quantizer", "weight_ineligibility"]


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


def weight_ineligibility(weight: torch.Tensor, recipe: Recipe) -> Optional[str]:
    """Why an ``nn.Linear`` weight [N, K] cannot be ``recipe``'s GEMM operand (its dtype, its
    alignment), as the linear pass judges it, or None. For what acts on weights before any graph
    exists: FSDP2's FP8 all-gather and FP8 primary weights."""
    if weight.dtype not in FLOAT_DTYPES:
        return f"weight dtype {weight.dtype} is not one of fp32, bf16, fp16"
    if any(d % recipe.gemm_alignment for d in weight.shape):
        return f"weight {list(weight.shape)}: {recipe.gemm_alignment_reason}"
    return None
