"""Which quantizer each tensor of a linear layer gets under a recipe (TransformerEngine's RecipeState).

Used by the block-scaled and custom lowerings: ``quantizer_factory(recipe)(role)`` returns a fresh
quantizer for ``role`` in te_compile.recipe.ROLES. The per-tensor recipes (current and delayed scaling)
are lowered by fp8_linear.py directly and have no factory here.
"""

from __future__ import annotations

from typing import Callable

from ..recipe import (
    ROLES,
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from ..tensor.float8_blockwise_tensor import Float8BlockQuantizer
from ..tensor.mxfp8_tensor import MXFP8Quantizer
from ..tensor.nvfp4_tensor import NVFP4Quantizer
from ..tensor.float8_tensor import Float8Tensor
from ..tensor.quantized_tensor import Quantizer

__all__ = ["quantizer_factory", "FACTORY_RECIPES", "weight_is_operand"]

GRADIENT_ROLES = ("grad_output", "grad_input")

FACTORY_RECIPES = (MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling, CustomRecipe)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def _mxfp8(recipe: MXFP8BlockScaling, role: str) -> Quantizer:
    return MXFP8Quantizer(recipe.fp8_format.dtype_for(role))


def _float8_block(recipe: Float8BlockScaling, role: str) -> Quantizer:
    if role == "weight":
        dim = recipe.w_block_scaling_dim
    elif role in GRADIENT_ROLES:
        dim = recipe.grad_block_scaling_dim
    else:
        dim = recipe.x_block_scaling_dim
    return Float8BlockQuantizer(recipe.fp8_format.dtype_for(role), rowwise=True, columnwise=True,
                                block_scaling_dim=dim, force_pow_2_scales=recipe.use_power_2_scales,
                                amax_epsilon=recipe.amax_epsilon)


def _nvfp4(recipe: NVFP4BlockScaling, role: str) -> Quantizer:
    # The NVFP4 training recipe: 16x16 blocks for weights (so W and W.T share scales), stochastic
    # rounding for gradients, the Hadamard transform on the wgrad operands (input and grad_output).
    return NVFP4Quantizer(
        with_2d_quantization=role == "weight" and not recipe.disable_2d_quantization,
        stochastic_rounding=role in GRADIENT_ROLES and not recipe.disable_stochastic_rounding,
        with_rht=role in ("input", *GRADIENT_ROLES) and not recipe.disable_rht,
    )


_BUILDERS = {MXFP8BlockScaling: _mxfp8, Float8BlockScaling: _float8_block, NVFP4BlockScaling: _nvfp4}


def quantizer_factory(recipe: Recipe) -> Callable[[str], Quantizer]:
    """``role -> Quantizer`` for a block-scaled recipe or a CustomRecipe (its ``qfactory``)."""
    if isinstance(recipe, CustomRecipe):
        return recipe.qfactory
    try:
        build = _BUILDERS[type(recipe)]
    except KeyError:
        raise ValueError(f"no quantizer factory for {recipe.name}; factories exist for "
                         f"{[r.__name__ for r in FACTORY_RECIPES]}") from None

    def factory(role: str) -> Quantizer:
        _check_role(role)
        return build(recipe, role)

    return factory


def weight_is_operand(weight, recipe: Recipe) -> bool:
    """Whether an already-quantized ``weight`` (FSDP2's FP8 all-gather, an FP8 primary weight) is in
    ``recipe``'s weight format, so that the lowering takes its bytes as they are; a quantized weight
    of another format is dequantized and quantized again."""
    if isinstance(recipe, (MXFP8BlockScaling, Float8BlockScaling)):
        return quantizer_factory(recipe)("weight").matches(weight)
    return (isinstance(recipe, (Float8CurrentScaling, DelayedScaling)) and isinstance(weight, Float8Tensor)
            and weight._data is not None and weight._fp8_dtype == recipe.fp8_format.dtype_for("weight"))
