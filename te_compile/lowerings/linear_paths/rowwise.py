"""An inference linear with one scale per token: ``[inference] activation_scaling = "row"``.

Small decode batches mix tokens of very different magnitudes; one scale for the whole input spends
FP8's range on the largest. Scaling each row (token) on its own is the usual inference choice
(torchao's float8 rowwise). The input x [M, K] gets current scaling per row (scale [M, 1], the
recipe's format for inputs; a DelayedScaling site scales its inputs this way too); the weight keeps
its per-tensor scale (the cached copy of an inference graph, or its delayed-scaling scale), spread
over its N output channels for the rowwise GEMM (gemm/rowwise.py). Forward only: the linear pass
chooses it for graphs compiled with grad disabled.
"""

from __future__ import annotations

import torch

from ...gemm.per_tensor import quantize_weight
from ...gemm.rowwise import fp8_gemm_rowwise
from ...recipe import Recipe
from ...scaling import cast_to_fp8, current_scale

__all__ = ["rowwise_fp8_linear"]


def rowwise_fp8_linear(x2d: torch.Tensor, w_nk: torch.Tensor, recipe: Recipe,
                       w_scale: torch.Tensor = None) -> torch.Tensor:
    """y [M, N] = x2d [M, K] @ w_nk [N, K].T with x quantized per row and w per tensor, in x's dtype."""
    x_recipe = recipe.current_scaling() if recipe.delayed() else recipe
    amax = x2d.abs().amax(dim=1, keepdim=True).to(torch.float32)        # [M, 1]
    scale = current_scale(amax, "input", x_recipe)
    xq = cast_to_fp8(x2d, scale, recipe.fp8_format.dtype_for("input"))
    x_sinv = torch.div(torch.ones_like(scale), scale)
    wq, w_sinv, _ = quantize_weight(w_nk, recipe, w_scale)
    wq = wq.contiguous()
    return fp8_gemm_rowwise(xq.contiguous(), wq.t(), x_sinv, w_sinv.reshape(1, 1).expand(1, wq.shape[0]),
                            out_dtype=x2d.dtype)
