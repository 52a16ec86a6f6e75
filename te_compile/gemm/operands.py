"""What a linear's GEMM operands may be, under any recipe: the high-precision dtypes
(``FLOAT_DTYPES``), and whether an already-quantized weight is the recipe's operand as it is
(``weight_is_operand``: FSDP2's FP8 all-gather and FP8 primary weights hand the lowerings such
weights)."""

from __future__ import annotations

import torch

from ..recipe import Recipe
from ..tensor.float8_tensor import Float8Tensor
from .block import quantizer_factory

__all__ = ["FLOAT_DTYPES", "weight_is_operand"]

# The high-precision dtypes a GEMM operand may come in.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def weight_is_operand(weight: torch.Tensor, recipe: Recipe) -> bool:
    """Whether an already-quantized ``weight`` (FSDP2's FP8 all-gather, an FP8 primary weight) is in
    ``recipe``'s weight format, so that the lowering takes its bytes as they are; a quantized weight
    of another format is dequantized and quantized again."""
    if recipe.per_block_scales:
        return quantizer_factory(recipe)("weight").matches(weight)
    return (recipe.per_tensor and isinstance(weight, Float8Tensor) and weight._data is not None
            and weight._fp8_dtype == recipe.fp8_format.dtype_for("weight"))
