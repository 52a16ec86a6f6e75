"""What a rewritten linear site calls: ``LinearLowering(spec)(x, weight, bias, *state)``.

The backend replaces ``linear(x, w, b)`` (or ``addmm(b, x, w)`` with ``w: [in, out]``) by a call to
a ``LinearLowering``: plain Python around autograd.Functions, so aot_autograd traces forward and
backward. Per-tensor recipes go to fp8_linear.py (torch._scaled_mm), block-scaled recipes and
CustomRecipe to quantized_linear.py (quantizer objects; native block-scaled GEMMs where the pass found
the device runs them, see block_gemm_probe.py, else dequantize-then-matmul).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..recipe import Recipe
from .fp8_linear import PER_TENSOR_RECIPES, Fp8LinearFunction
from .quantizers import FACTORY_RECIPES, quantizer_factory
from .quantized_linear import QuantizedLinearFunction

__all__ = ["LinearSpec", "LinearLowering", "SUPPORTED_RECIPES", "gemm_kind"]

SUPPORTED_RECIPES = PER_TENSOR_RECIPES + FACTORY_RECIPES


@dataclass(frozen=True)
class LinearSpec:
    """Everything about a site the lowering needs that is not a tensor."""

    fqn: str
    recipe: Recipe
    weight_in_out: bool = False   # weight stored [in, out] (GPT-2 Conv1D / addmm) not [out, in]
    native_gemm: bool = False     # block recipes: GEMMs through F.scaled_mm (block_gemm_probe said yes)


def gemm_kind(recipe: Recipe, native: bool = False, why: str = "") -> str:
    """How the site's GEMMs run, for the report; ``native`` / ``why``: the block-GEMM probe's answer."""
    if isinstance(recipe, PER_TENSOR_RECIPES):
        return "FP8 GEMMs (torch._scaled_mm)"
    if recipe.custom():
        return "custom quantizers, dequantize-then-matmul GEMMs"
    fmt = {"MXFP8BlockScaling": "MXFP8", "Float8BlockScaling": "FP8 block",
           "NVFP4BlockScaling": "NVFP4"}[recipe.name]
    if native:
        return f"{fmt}, native GEMMs (F.scaled_mm)"
    return f"{fmt}, emulated GEMMs (dequantize-then-matmul{'; ' + why if why else ''})"


class LinearLowering:
    """Callable inserted into the FX graph for one site: ``(x, weight, bias, *state) -> y``.

    x: [..., K]; weight: [N, K] (or [K, N] when ``spec.weight_in_out``); bias: [N] or None;
    state: the delayed-scaling tensors of the site (empty otherwise). Returns [..., N].
    """

    def __init__(self, spec: LinearSpec) -> None:
        if not isinstance(spec.recipe, SUPPORTED_RECIPES):
            raise NotImplementedError(
                f"{spec.fqn}: recipe {spec.recipe.name} is not supported by the te backend "
                f"(supported: {[r.__name__ for r in SUPPORTED_RECIPES]})"
            )
        self.spec = spec
        per_tensor = isinstance(spec.recipe, PER_TENSOR_RECIPES)
        self._factory = None if per_tensor else quantizer_factory(spec.recipe)
        # FX codegen names the call after these.
        self.__name__ = f"te_linear_{spec.recipe.name}"
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 *state: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        x2d = x.reshape(-1, k)
        w_nk = weight.t() if self.spec.weight_in_out else weight
        if self._factory is not None:
            y = QuantizedLinearFunction.apply(x2d, w_nk, self._factory, self.spec.native_gemm)
        else:
            # A backward will run (and update the state) only if autograd records this call.
            backward_follows = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            y = Fp8LinearFunction.apply(x2d, w_nk, self.spec.recipe, not backward_follows, *state)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], w_nk.shape[0])

    def __repr__(self) -> str:
        native = ", native GEMMs" if self.spec.native_gemm else ""
        return f"LinearLowering({self.spec.fqn!r}, {self.spec.recipe.name}{native})"
