"""Recipes: which low-precision format each tensor of a GEMM uses and how it is scaled.

The names, fields and defaults follow TransformerEngine's ``transformer_engine.common.recipe`` so that
a user can move a config over unchanged. Recipes are frozen dataclasses validated on construction: a
bad value raises ``ValueError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Callable, ClassVar, Optional, Union

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
    "GEMM_ROLES",
    "GRADIENT_ROLES",
    "ATTENTION_ROLES",
]

# The tensors a linear layer quantizes, by role. "input"/"weight" feed fprop, "grad_output" feeds
# dgrad and wgrad; "output"/"grad_input" are quantized only by fused consumers (attention, next layer).
ROLES = ("input", "weight", "output", "grad_output", "grad_input")
GRADIENT_ROLES = ("grad_output", "grad_input")
# The operands of a linear's three GEMMs. Every per-role tuple of a linear site (delayed-scaling state,
# amax carriers, amax all-reduce groups) is in this order.
GEMM_ROLES = ("input", "weight", "grad_output")
# An SDPA site's tensors: Q, K, V in the forward format, dO (FP8 backward) in the gradient format.
ATTENTION_ROLES = ("query", "key", "value", "grad_output")
_FORWARD_ROLES = ("input", "weight", "output", "query", "key", "value")


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
        """The torch fp8 dtype used for a tensor of ``role`` (``ROLES`` or ``ATTENTION_ROLES``)."""
        if role not in ROLES and role not in ATTENTION_ROLES:
            raise ValueError(f"role must be one of {ROLES + ATTENTION_ROLES[:3]}, got {role!r}")
        dtype = self.value.fwd_dtype if role in _FORWARD_ROLES else self.value.bwd_dtype
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


def _check_epsilon(recipe: str, value) -> None:
    _check_type(recipe, "amax_epsilon", value, (int, float), "a non-negative float")
    if not value >= 0.0 or math.isinf(value):
        raise ValueError(f"{recipe}.amax_epsilon must be a finite non-negative float, got {value!r}")


@dataclass(frozen=True, repr=False)
class Recipe:
    """Base class of all recipes: the attention options every recipe has, the facts the backend asks
    a recipe for, and TransformerEngine's predicates.

    The facts are class attributes, so that code asks the recipe (``recipe.per_tensor``,
    ``recipe.gemm_alignment``) instead of keeping tables keyed by recipe name; a new recipe states
    them once, here in its class (docs/adding-a-recipe.md).
    """

    # One scale per tensor (current or delayed scaling): lowered by Fp8LinearFunction, and the only
    # kind norms, activations and FP8 attention hand-offs fuse with. Otherwise quantizer objects.
    per_tensor: ClassVar[bool] = False
    # The block format of its native block-scaled GEMMs ("mxfp8", "float8_block", "nvfp4"), or None.
    block_format: ClassVar[Optional[str]] = None
    # Its GEMM format as the report names it ("FP8", "MXFP8", ...).
    format_label: ClassVar[str] = "FP8"
    # K and N of a linear must be multiples of this, and why (cuBLASLt FP8 GEMMs need 16).
    gemm_alignment: ClassVar[int] = 16
    gemm_alignment_reason: ClassVar[str] = "FP8 GEMMs need K and N % 16 == 0"
    # Every scale comes from a block's own amax: a shard split across ranks needs no amax all-reduce.
    per_block_scales: ClassVar[bool] = False
    # FSDP2 gathers the weight in its block format when each rank's rows are whole blocks of this
    # many rows (None: no block-format all-gather).
    weight_gather_block_rows: ClassVar[Optional[int]] = None
    # Weights can be held only in its weight format (FP8 primary weights, quantized_model_init).
    primary_weights: ClassVar[bool] = False
    # The fewest dims a linear's input may have.
    min_input_dims: ClassVar[int] = 1
    # Rows of one block along the token dim in the columnwise copies the weight gradient reads (None:
    # no blocks along it). MoE grouped GEMMs pad each expert's tokens to it, so no block spans two.
    token_block_rows: ClassVar[Optional[int]] = None
    # MoE experts' grouped GEMMs run under it, one set of quantizers per expert.
    grouped_gemms: ClassVar[bool] = False

    # Keyword-only and declared once: every recipe has them, after its own fields.
    fp8_dpa: bool = field(default=False, kw_only=True)
    fp8_mha: bool = field(default=False, kw_only=True)
    # FP8 attention's backward: "high_precision" (FP8-saved Q, K, V dequantized) or "fp8"
    fp8_dpa_backward: str = field(default="high_precision", kw_only=True)

    def __post_init__(self):
        _check_flags(self.name, self, "fp8_dpa", "fp8_mha")
        _check_choice(self.name, "fp8_dpa_backward", self.fp8_dpa_backward, FP8_DPA_BACKWARDS)

    def primary_weight_problem(self) -> Optional[str]:
        """Why weights cannot be held only in this recipe's weight format (FP8 primary weights), or
        None when they can."""
        return None if self.primary_weights else f"{self.name} has no primary-weight format"

    def grouped_gemm_problem(self) -> Optional[str]:
        """Why MoE experts' grouped GEMMs cannot run under this recipe, or None when they can."""
        return None if self.grouped_gemms else f"{self.name} per expert is not built"

    def fast_accumulation(self, gemm: str) -> bool:
        """Does the FP8 GEMM ``gemm`` ("fprop", "dgrad" or "wgrad") accumulate without the periodic
        promotion to fp32 (torch._scaled_mm's ``use_fast_accum``)? Only a per-tensor recipe's forward
        GEMM may (``fprop_fast_accum``)."""
        return False

    # TransformerEngine's Recipe predicates, by the same names, so that code written against TE's
    # recipes runs unchanged; te_compile itself asks the facts above, and calls delayed() and
    # float8_current_scaling() only. tests/test_recipe.py checks that exactly one kind is true.
    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self) -> bool:
        return self.per_tensor

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

    @classmethod
    def option_names(cls) -> list[str]:
        """The fields a config may set, in constructor order: the recipe's own, then the attention
        options."""
        return [f.name for f in sorted(fields(cls), key=lambda f: f.kw_only)]

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.option_names())})"

    def options(self) -> dict:
        """The recipe's fields as a plain dict (formats by name), e.g. for reports and configs."""
        out = {}
        for name in self.option_names():
            value = getattr(self, name)
            out[name] = value.name if isinstance(value, Format) else value
        return out


@dataclass(frozen=True, repr=False)
class DelayedScaling(Recipe):
    """Per-tensor FP8 whose scale comes from a history of past amaxes (one step of delay)."""

    per_tensor: ClassVar[bool] = True
    primary_weights: ClassVar[bool] = True
    grouped_gemms: ClassVar[bool] = True

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
    fp8_activation_input: bool = field(default=False, kw_only=True)   # see Float8CurrentScaling
    fprop_fast_accum: bool = field(default=True, kw_only=True)        # see Float8CurrentScaling
    # when the histories and scales advance: "backward", at the end of each compiled graph's backward
    # (one step = one backward); "optimizer_step", once per torch.optim step, with the max of every
    # backward since the last one (micro-batches of gradient accumulation and pipeline schedules,
    # whose backwards interleave with other micro-batches' forwards and must all see one scale);
    # "auto" (not set): "optimizer_step" in a pipeline stage whose schedule keeps several micro-batches
    # in flight, where "backward" cannot work, else "backward" (te_compile/pipeline.py)
    update_on: str = field(default="auto", kw_only=True)

    def __post_init__(self):
        n = self.name
        _check_choice(n, "update_on", self.update_on, ("auto", "backward", "optimizer_step"))
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
        _check_flags(n, self, "reduce_amax", "fp8_activation_input", "fprop_fast_accum")
        super().__post_init__()

    def fast_accumulation(self, gemm: str) -> bool:
        return gemm == "fprop" and self.fprop_fast_accum

    def current_scaling(self) -> "Float8CurrentScaling":
        """Float8CurrentScaling in this recipe's formats and attention flags: each tensor scaled from its
        own amax instead of a history (inference graphs under ``[inference] scaling = "current"``)."""
        return Float8CurrentScaling(fp8_format=self.fp8_format, fp8_dpa=self.fp8_dpa, fp8_mha=self.fp8_mha,
                                    fp8_dpa_backward=self.fp8_dpa_backward,
                                    fp8_activation_input=self.fp8_activation_input,
                                    fprop_fast_accum=self.fprop_fast_accum)


@dataclass(frozen=True, repr=False)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 whose scale comes from the amax of the tensor being quantized."""

    per_tensor: ClassVar[bool] = True
    primary_weights: ClassVar[bool] = True
    grouped_gemms: ClassVar[bool] = True

    fp8_format: Format = Format.HYBRID
    # round scales down to powers of two: exact scaling (no mantissa error) at up to 2x less range
    use_power_2_scales: bool = False
    # amax is clamped up to this, so near-zero tensors do not get huge scales
    amax_epsilon: float = 0.0
    # A fused activation's input (SwiGLU's gate and up, GELU's h) saved for backward in FP8 with a
    # scale from its own amax, per expert between MoE GEMMs, instead of in high precision: half the
    # bytes of bf16, its backward computed from the FP8-rounded values (DeepSeek-V3's trade for the
    # SwiGLU inputs of its experts). Only the per-tensor recipes have it: activations fuse under them.
    fp8_activation_input: bool = field(default=False, kw_only=True)
    # The forward GEMM accumulates without cuBLAS's periodic promotion to fp32 (torch._scaled_mm's
    # use_fast_accum), the gradient GEMMs with it: TransformerEngine's split-accumulator defaults and
    # torchao's. Measured on an H100, 3-18% faster at Llama 3 8B's and Mixtral's forward shapes. The
    # cost is precision over long K: Hopper's FP8 tensor cores accumulate in fewer bits than fp32, and
    # without promotion the error grows with K; the gradient GEMMs, whose wgrad K is the token count,
    # keep the promotion. No effect on CPU, whose FP8 GEMM accumulates in fp32.
    fprop_fast_accum: bool = field(default=True, kw_only=True)

    def __post_init__(self):
        _check_format(self.name, "fp8_format", self.fp8_format, (Format.E4M3, Format.HYBRID))
        _check_flags(self.name, self, "use_power_2_scales", "fp8_activation_input", "fprop_fast_accum")
        _check_epsilon(self.name, self.amax_epsilon)
        super().__post_init__()

    def fast_accumulation(self, gemm: str) -> bool:
        return gemm == "fprop" and self.fprop_fast_accum


@dataclass(frozen=True, repr=False)
class _Fp8BlockFormats(Recipe):
    """What the two FP8 block formats (MXFP8, Float8 block) hold alike: every scale is a block's own,
    and weights in the format serve as primary weights and as the experts' grouped GEMM operands."""

    per_block_scales: ClassVar[bool] = True
    primary_weights: ClassVar[bool] = True
    grouped_gemms: ClassVar[bool] = True


@dataclass(frozen=True, repr=False)
class MXFP8BlockScaling(_Fp8BlockFormats):
    """MXFP8: 32-element blocks along the contiguous dim sharing an E8M0 (power of two) scale."""

    block_format: ClassVar[Optional[str]] = "mxfp8"
    format_label: ClassVar[str] = "MXFP8"
    # blocks of 32 in both directions of the weight (rowwise for fprop, columnwise for dgrad)
    gemm_alignment: ClassVar[int] = 32
    gemm_alignment_reason: ClassVar[str] = "MXFP8 scales blocks of 32 along K and N"
    # the columnwise copy's blocks run 32 rows down
    weight_gather_block_rows: ClassVar[Optional[int]] = 32
    token_block_rows: ClassVar[Optional[int]] = 32

    fp8_format: Format = Format.E4M3

    def __post_init__(self):
        _check_format(self.name, "fp8_format", self.fp8_format, (Format.E4M3, Format.HYBRID))
        super().__post_init__()


@dataclass(frozen=True, repr=False)
class Float8BlockScaling(_Fp8BlockFormats):
    """DeepSeek-style FP8: 1x128 blocks (dim 1) or 128x128 tiles (dim 2) with their own scales."""

    block_format: ClassVar[Optional[str]] = "float8_block"
    format_label: ClassVar[str] = "FP8 block"
    # ragged 128-blocks are quantized as partial blocks: only the GEMM alignment applies
    weight_gather_block_rows: ClassVar[Optional[int]] = 128
    # wgrad's columnwise copies of x and grad_output: 128 rows down (128x1 blocks, or 128x128 tiles)
    token_block_rows: ClassVar[Optional[int]] = 128

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    # power-of-two block scales: exact rescaling, the DeepSeek-V3 choice
    use_power_2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        n = self.name
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
        super().__post_init__()

    def primary_weight_problem(self) -> Optional[str]:
        # the master-weight cast and the all-gather rebuild the columnwise copy from the rowwise one,
        # which only 128x128 tiles allow
        if self.w_block_scaling_dim != 2:
            return (f"{self.name} primary weights need w_block_scaling_dim=2 (128x128 tiles), "
                    f"got {self.w_block_scaling_dim}")
        return None


@dataclass(frozen=True, repr=False)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 elements in 16-element blocks with E4M3 block scales and an fp32 tensor scale."""

    block_format: ClassVar[Optional[str]] = "nvfp4"
    format_label: ClassVar[str] = "NVFP4"
    # its blocks are 16 long, the GEMM alignment itself
    gemm_alignment_reason: ClassVar[str] = "NVFP4 scales blocks of 16 along K and N"
    # its lowering takes inputs of at least 2 dims ([..., tokens, K]); a 1-D one stays in high precision
    min_input_dims: ClassVar[int] = 2
    token_block_rows: ClassVar[Optional[int]] = 16
    grouped_gemms: ClassVar[bool] = True

    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    # random Hadamard transform on the wgrad operands: spreads outliers before 4-bit rounding
    disable_rht: bool = False
    # stochastic rounding of gradients: unbiased at the cost of noise
    disable_stochastic_rounding: bool = False
    # 16x16 blocks for weights, so the transposed weight reuses the same scales
    disable_2d_quantization: bool = False

    def __post_init__(self):
        n = self.name
        _check_format(n, "fp4_format", self.fp4_format, (Format.E2M1,))
        _check_format(n, "fp8_format", self.fp8_format, (Format.E4M3,))
        _check_flags(n, self, "disable_rht", "disable_stochastic_rounding", "disable_2d_quantization")
        super().__post_init__()


@dataclass(frozen=True, repr=False)
class CustomRecipe(Recipe):
    """A recipe whose quantizers come from ``qfactory(role) -> Quantizer`` (role in ``ROLES``)."""

    format_label: ClassVar[str] = "custom quantizers"

    qfactory: Callable = field(default=None)

    def __post_init__(self):
        if not callable(self.qfactory):
            raise ValueError(
                f"CustomRecipe.qfactory must be a callable role -> Quantizer, got {self.qfactory!r}"
            )
        super().__post_init__()


# Recipe classes by the name a config file uses.
RECIPES: dict[str, type[Recipe]] = {
    cls.__name__: cls
    for cls in (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling,
                NVFP4BlockScaling, CustomRecipe)
}
