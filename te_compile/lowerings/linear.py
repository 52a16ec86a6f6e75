"""What a rewritten linear site calls: ``LinearLowering(spec)(x, weight, bias, *state)``.

The backend replaces ``linear(x, w, b)`` (or ``addmm(b, x, w)`` with ``w: [in, out]``) by a call to
a ``LinearLowering``: plain Python around autograd.Functions, so aot_autograd traces forward and
backward. Per-tensor recipes go to linear_paths/per_tensor.py (torch._scaled_mm), block-scaled recipes and
CustomRecipe to linear_paths/quantizer.py (quantizer objects; native block-scaled GEMMs where the pass found
the device runs them, see gemm/block_probe.py, else dequantize-then-matmul). DTensor operands (tensor
parallelism) run shard by shard through linear_paths/sharded.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..autocast import autocast_dtype
from ..distributed import NO_GROUPS, AmaxGroup
from ..fx.cache_names import name_lowering
from ..gemm.per_tensor import fp8_gemm_kind
from ..quantization import quantizer_factory
from ..recipe import Recipe
from .linear_paths.async_tp import AsyncTp, async_tp_column, async_tp_row
from .linear_paths.per_tensor import Fp8LinearFunction, casts_weight_itself
from .linear_paths.quantizer import QuantizedLinearFunction
from .linear_paths.rowwise import rowwise_fp8_linear
from .linear_paths.sharded import plan_linear_sharding, sharded_linear

__all__ = ["LinearSpec", "LinearLowering", "gemm_kind"]


@dataclass(frozen=True)
class LinearSpec:
    """Everything about a site the lowering needs that is not a tensor."""

    fqn: str
    recipe: Recipe
    weight_in_out: bool = False   # the call reads the weight as [in, out] (x @ W, HF Conv1D addmm)
    native_gemm: bool = False     # block recipes: GEMMs through F.scaled_mm (gemm/block_probe.py said yes)
    weight_first: bool = False    # W @ x: y = (x.mT @ W.T).mT
    # per role (input, weight, grad_output): groups current scaling all-reduces the amax over, for
    # plain tensors sharded by hand ([distributed] sharded_modules); DTensors bring their own
    amax_groups: tuple[tuple[AmaxGroup, ...], ...] = NO_GROUPS
    # inference graphs under [inference] activation_scaling = "row": one input scale per token,
    # forward only (linear_paths/rowwise.py)
    rowwise: bool = False
    # [distributed] async_tp: a sequence-parallel site's collectives on FP8 data next to its _scaled_mm
    # (linear_paths/async_tp.py); x then arrives sequence-sharded (column) or y leaves so (row)
    async_tp: Optional[AsyncTp] = None


def gemm_kind(recipe: Recipe, native: bool = False, why: str = "", device: Optional[torch.device] = None) -> str:
    """How the site's GEMMs run on ``device``, for the report; ``native`` / ``why``: the block-GEMM
    probe's answer."""
    if recipe.per_tensor:
        kind = fp8_gemm_kind(device) if device is not None else "FP8 GEMMs (torch._scaled_mm)"
        on_gpu = device is not None and torch.device(device).type == "cuda"   # CPU accumulates in fp32
        if on_gpu and recipe.fast_accumulation("fprop") and kind.endswith("(torch._scaled_mm)"):
            kind = kind[:-1] + "; forward with fast accumulation)"
        return kind
    if recipe.block_format is None:
        return f"{recipe.format_label}, dequantize-then-matmul GEMMs"
    if native:
        return f"{recipe.format_label}, native GEMMs (F.scaled_mm)"
    return f"{recipe.format_label}, emulated GEMMs (dequantize-then-matmul{'; ' + why if why else ''})"


class LinearLowering:
    """Callable inserted into the FX graph for one site: ``(x, weight, bias, *delayed) -> y``.

    x: [..., K] ([..., K, M] or [K] when ``spec.weight_first``); weight: [N, K] (or [K, N] when
    ``spec.weight_in_out``); bias: added to the product ([N], or any addend that broadcasts to y) or
    None; delayed: DelayedScaling's (carrier or None, input scale, weight scale, grad_output scale),
    see delayed_state.py, else empty. Returns [..., N] ([..., N, M] for ``weight_first``).

    Under autocast the operands are cast to autocast's dtype first and the site computes in it, so
    the output dtype (and every later op) matches eager's ``linear`` under the same autocast.
    """

    def __init__(self, spec: LinearSpec) -> None:
        if not spec.recipe.per_tensor:
            quantizer_factory(spec.recipe)   # a recipe with neither path fails here, naming itself
        self.spec = spec   # all the lowering holds: fx/cache_names.py names it after a digest of it
        # FX codegen names the call after these.
        name_lowering(self, f"te_linear_{spec.recipe.name}", __name__)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 *delayed: Optional[torch.Tensor]) -> torch.Tensor:
        dtype = autocast_dtype(x)
        if dtype is None:
            return self._linear(x, weight, bias, delayed)
        x = x.to(dtype)
        if not self._casts_weight(weight):
            weight = weight.to(dtype)
        if bias is not None and bias.is_floating_point():
            bias = bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            return self._linear(x, weight, bias, delayed)

    def _casts_weight(self, weight: torch.Tensor) -> bool:
        """Does the site's autograd.Function take the weight in its own dtype and cast it to x's
        itself? The per-tensor Function does, for a plain weight: its wgrad GEMM then writes the
        weight's gradient in the weight's dtype (fp32 under autocast over fp32 weights), where a cast
        outside it would have the GEMM write bf16 and a separate kernel read that and write fp32
        (6 bytes an element: 352 MB for one 4096 x 14336 weight). The forward quantizes the same
        bf16 values either way."""
        spec = self.spec
        return spec.recipe.per_tensor and not spec.rowwise and spec.async_tp is None and casts_weight_itself(weight)

    def _linear(self, x, weight, bias, delayed) -> torch.Tensor:
        if self.spec.weight_first and x.dim() > 1:
            # W @ x = (x.mT @ W.T).mT; the site finder gives this form no addend
            return self._x_wt(x.mT, weight, None, delayed).mT
        return self._x_wt(x, weight, bias, delayed)

    def _x_wt(self, x, weight, bias, delayed) -> torch.Tensor:
        """x [..., K] @ w_nk.T (+ bias) -> [..., N]; on DTensors shard by shard, the bias added by
        DTensor (a row-parallel output is a partial sum: the replicated bias must be added once)."""
        w_nk = weight.t() if self.spec.weight_in_out else weight
        plan = plan_linear_sharding(x, w_nk, self.spec.fqn)
        form = self.spec.async_tp
        if plan is not None and form is not None:
            y = (async_tp_column(x, [w_nk], self.spec.recipe, form, delayed)[0] if form.kind == "column"
                 else async_tp_row(x, w_nk, self.spec.recipe, form, delayed))
        elif plan is None:
            y = self._local(x, w_nk, delayed, self.spec.amax_groups)
        else:
            y = sharded_linear(lambda x_, w_, groups: self._local(x_, w_, delayed, groups), x, w_nk, plan,
                               self.spec.amax_groups)
        return y if bias is None else y + bias

    def _local(self, x, w_nk, delayed, groups) -> torch.Tensor:
        """x [..., K] @ w_nk.T -> [..., N] on plain tensors."""
        x2d = x.reshape(-1, x.shape[-1])
        if not self.spec.recipe.per_tensor:
            y = QuantizedLinearFunction.apply(x2d, w_nk, quantizer_factory(self.spec.recipe), self.spec.native_gemm,
                                              groups)
        elif self.spec.rowwise:
            y = rowwise_fp8_linear(x2d, w_nk, self.spec.recipe, delayed[2] if delayed else None)
        else:
            # current scaling: no carrier and no scales
            y = Fp8LinearFunction.apply(x2d, w_nk, self.spec.recipe, groups, *(delayed or (None,) * 4))
        return y.reshape(*x.shape[:-1], w_nk.shape[0])

    def __repr__(self) -> str:
        native = ", native GEMMs" if self.spec.native_gemm else ""
        return f"LinearLowering({self.spec.fqn!r}, {self.spec.recipe.name}{native})"
