"""Recipes: which low-precision format each tensor of a GEMM uses and how it is scaled.

The names, fields and defaults follow TransformerEngine's ``transformer_engine.common.recipe`` so that
a user can move a config over unchanged. Recipes are frozen dataclasses validated on construction: a
bad value raises ``ValueError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Union

import torch

__all__ = [
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
    "RECIPES",
    "ROLES",
]

# The tensors a linear layer quantizes, by role. "input"/"weight" feed fprop, "grad_output" feeds
# dgrad and wgrad; "output"/"grad_input" are quantized only by fused consumers (attention, next layer).
ROLES = ("input", "weight", "output", "grad_output", "grad_input")
FORWARD_ROLES = ("input", "weight", "output")


@dataclass(frozen=True)
class _FormatInfo:
    # dtype and largest finite value for forward tensors and for gradients
    fwd_dtype: Optional[torch.dtype]
    bwd_dtype: Optional[torch.dtype]
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """FP8/FP4 formats. HYBRID uses E4M3 for forward tensors and E5M2 for gradients."""

    E4M3 = _FormatInfo(torch.float8_e4m3fn, torch.float8_e4m3fn, 448.0, 448.0)
    E5M2 = _FormatInfo(torch.float8_e5m2, torch.float8_e5m2, 57344.0, 57344.0)
    HYBRID = _FormatInfo(torch.float8_e4m3fn, torch.float8_e5m2, 448.0, 57344.0)
    # E2M1 is storage-only in torch (float4_e2m1fn_x2 packs two codes); there is no element dtype.
    E2M1 = _FormatInfo(None, None, 6.0, 6.0)

    def __repr__(self) -> str:
        return f"Format.{self.name}"

    @property
    def max_fwd(self) -> float:
        return self.value.max_fwd

    @property
    def max_bwd(self) -> float:
        return self.value.max_bwd

    def dtype_for(self, role: str) -> torch.dtype:
        """The torch fp8 dtype used for a tensor of ``role`` (see ``ROLES``)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        dtype = self.value.fwd_dtype if role in FORWARD_ROLES else self.value.bwd_dtype
        if dtype is None:
            raise ValueError(f"Format.{self.name} has no element dtype in torch (it is packed storage)")
        return dtype

    @classmethod
    def from_name(cls, name: Union[str, "Format"]) -> "Format":
        if isinstance(name, Format):
            return name
        try:
            return cls[str(name).upper()]
        except KeyError:
            raise ValueError(f"unknown format {name!r}; allowed: {[f.name for f in cls]}") from None


def _check_choice(recipe: str, name: str, value, allowed) -> None:
    # True == 1 in Python: a flag given where a choice is expected is a mistake, not the value 1.
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{recipe}.{name} must be one of {list(allowed)}, got {value!r}")


def _check_type(recipe: str, name: str, value, types, what: str) -> None:
    # bool is an int in Python; a flag given for a number (or a number for a flag) is a mistake.
    if isinstance(value, bool) and bool not in types:
        raise ValueError(f"{recipe}.{name} must be {what}, got {value!r}")
    if not isinstance(value, types):
        raise ValueError(f"{recipe}.{name} must be {what}, got {value!r}")


def _check_format(recipe: str, name: str, value, allowed: tuple[Format, ...]) -> None:
    if not isinstance(value, Format) or value not in allowed:
        raise ValueError(
            f"{recipe}.{name} must be one of {[f'Format.{f.name}' for f in allowed]}, got {value!r}"
        )


def _check_flags(recipe: str, obj, *names: str) -> None:
    for name in names:
        _check_type(recipe, name, getattr(obj, name), (bool,), "a bool")


FP8_DPA_BACKWARDS = ("high_precision", "fp8")


def _check_attention(recipe: str, obj) -> None:
    """The attention fields every recipe has: fp8_dpa, fp8_mha, fp8_dpa_backward."""
    _check_flags(recipe, obj, "fp8_dpa", "fp8_mha")
    _check_choice(recipe, "fp8_dpa_backward", obj.fp8_dpa_backward, FP8_DPA_BACKWARDS)


def _check_epsilon(recipe: str, value) -> None:
    _check_type(recipe, "amax_epsilon", value, (int, float), "a non-negative float")
    if not value >= 0.0 or math.isinf(value):
        raise ValueError(f"{recipe}.amax_epsilon must be a finite non-negative float, got {value!r}")


class Recipe:
    """Base class of all recipes; the predicates mirror TransformerEngine's."""

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self) -> bool:
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def custom(self) -> bool:
        return isinstance(self, CustomRecipe)

    @property
    def name(self) -> str:
        return type(self).__name__

    def options(self) -> dict:
        """The recipe's fields as a plain dict (formats by name), e.g. for reports and configs."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.name if isinstance(value, Format) else value
        return out


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor FP8 whose scale comes from a history of past amaxes (one step of delay)."""

    # scale = fp8_max / amax / 2**margin: a larger margin leaves headroom for growth between steps
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    # how many past amaxes the scale looks at: longer is steadier but slower to react
    amax_history_len: int = 1024
    # "max" over the window, "most_recent", or a callable(amax_history: [L]) -> amax: [1]
    amax_compute_algo: Union[str, Callable] = "max"
    # callable(amax, scale, fp8_max, recipe) -> new scale; None uses the rule of DESIGN.md §5
    scaling_factor_compute_algo: Optional[Callable] = None
    # all-reduce (MAX) the amaxes over the data-parallel group once per step
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    # FP8 attention's backward: "high_precision" (FP8-saved Q, K, V dequantized) or "fp8"
    fp8_dpa_backward: str = "high_precision"

    def __post_init__(self):
        n = "DelayedScaling"
        _check_type(n, "margin", self.margin, (int,), "a non-negative int")
        if self.margin < 0:
            raise ValueError(f"{n}.margin must be a non-negative int, got {self.margin!r}")
        _check_format(n, "fp8_format", self.fp8_format, (Format.E4M3, Format.HYBRID))
        _check_type(n, "amax_history_len", self.amax_history_len, (int,), "a positive int")
        if self.amax_history_len < 1:
            raise ValueError(f"{n}.amax_history_len must be a positive int, got {self.amax_history_len!r}")
        if not callable(self.amax_compute_algo):
            _check_choice(n, "amax_compute_algo", self.amax_compute_algo, ("max", "most_recent"))
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            raise ValueError(
                f"{n}.scaling_factor_compute_algo must be None or a callable, "
                f"got {self.scaling_factor_compute_algo!r}"
            )
        _check_flags(n, self, "reduce_amax")
        _check_attention(n, self)


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 whose scale comes from the amax of the tensor being quantized."""

    fp8_format: Format = Format.HYBRID
    # round scales down to powers of two: exact scaling (no mantissa error) at up to 2x less range
    use_power_2_scales: bool = False
    # amax is clamped up to this, so near-zero tensors do not get huge scales
    amax_epsilon: float = 0.0
    fp8_dpa: bool = False
    fp8_mha: bool = False
    # FP8 attention's backward: "high_precision" (FP8-saved Q, K, V dequantized) or "fp8"
    fp8_dpa_backward: str = "high_precision"

    def __post_init__(self):
        n = "Float8CurrentScaling"
        _check_format(n, "fp8_format", self.fp8_format, (Format.E4M3, Format.HYBRID))
        _check_flags(n, self, "use_power_2_scales")
        _check_epsilon(n, self.amax_epsilon)
        _check_attention(n, self)


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: 32-element blocks along the contiguous dim sharing an E8M0 (power of two) scale."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    # FP8 attention's backward: "high_precision" (FP8-saved Q, K, V dequantized) or "fp8"
    fp8_dpa_backward: str = "high_precision"

    def __post_init__(self):
        n = "MXFP8BlockScaling"
        _check_format(n, "fp8_format", self.fp8_format, (Format.E4M3, Format.HYBRID))
        _check_attention(n, self)


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """DeepSeek-style FP8: 1x128 blocks (dim 1) or 128x128 tiles (dim 2) with their own scales."""

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    # power-of-two block scales: exact rescaling, the DeepSeek-V3 choice
    use_power_2_scales: bool = True
    amax_epsilon: float = 0.0
    fp8_dpa: bool = False
    fp8_mha: bool = False
    # FP8 attention's backward: "high_precision" (FP8-saved Q, K, V dequantized) or "fp8"
    fp8_dpa_backward: str = "high_precision"

    def __post_init__(self):
        n = "Float8BlockScaling"
        _check_format(n, "fp8_format", self.fp8_format, (Format.E4M3,))
        for dim in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            _check_choice(n, dim, getattr(self, dim), (1, 2))
        _check_flags(n, self, "use_power_2_scales")
        _check_epsilon(n, self.amax_epsilon)
        # TransformerEngine's kernels support 2-D blocks only for weights.
        if self.x_block_scaling_dim == 2 or self.grad_block_scaling_dim == 2:
            raise ValueError(
                f"{n}: x_block_scaling_dim and grad_block_scaling_dim must be 1 (only weights use "
                f"2-D blocks), got {self.x_block_scaling_dim} and {self.grad_block_scaling_dim}"
            )
        _check_attention(n, self)


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 elements in 16-element blocks with E4M3 block scales and an fp32 tensor scale."""

    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    # random Hadamard transform on the wgrad operands: spreads outliers before 4-bit rounding
    disable_rht: bool = False
    # stochastic rounding of gradients: unbiased at the cost of noise
    disable_stochastic_rounding: bool = False
    # 16x16 blocks for weights, so the transposed weight reuses the same scales
    disable_2d_quantization: bool = False
    fp8_dpa: bool = False
    fp8_mha: bool = False
    # FP8 attention's backward: "high_precision" (FP8-saved Q, K, V dequantized) or "fp8"
    fp8_dpa_backward: str = "high_precision"

    def __post_init__(self):
        n = "NVFP4BlockScaling"
        _check_format(n, "fp4_format", self.fp4_format, (Format.E2M1,))
        _check_format(n, "fp8_format", self.fp8_format, (Format.E4M3,))
        _check_flags(n, self, "disable_rht", "disable_stochastic_rounding", "disable_2d_quantization")
        _check_attention(n, self)


@dataclass(frozen=True)
class CustomRecipe(Recipe):
    """A recipe whose quantizers come from ``qfactory(role) -> Quantizer`` (role in ``ROLES``)."""

    qfactory: Callable = field(default=None)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    # FP8 attention's backward: "high_precision" (FP8-saved Q, K, V dequantized) or "fp8"
    fp8_dpa_backward: str = "high_precision"

    def __post_init__(self):
        if not callable(self.qfactory):
            raise ValueError(
                f"CustomRecipe.qfactory must be a callable role -> Quantizer, got {self.qfactory!r}"
            )
        _check_attention("CustomRecipe", self)


# Recipe classes by the name a config file uses.
RECIPES: dict[str, type[Recipe]] = {
    cls.__name__: cls
    for cls in (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling,
                NVFP4BlockScaling, CustomRecipe)
}
