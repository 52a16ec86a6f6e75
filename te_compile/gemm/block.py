"""Operands and GEMMs of the recipes that quantize with quantizer objects: the block-scaled ones
(MXFP8, Float8 block, NVFP4) and CustomRecipe.

The operands: ``quantizer_factory(recipe)(role)`` is the quantizer a role's tensor gets (the one place
where such a recipe becomes quantizer objects, for the lowerings and the eager features alike),
``quantize_copies`` quantizes the copies a GEMM needs with it, ``quantize_tokens_per_group`` an MoE
layer's tokens, each expert's rows as if alone. The per-tensor recipes have no quantizer objects:
their operands are plain tensor ops (te_compile.scaling, gemm/per_tensor.py).

The GEMMs: natively through F.scaled_mm, or by dequantizing both (``dequantized_gemm``, the
emulation used where a format has no native GEMM, and CustomRecipe's GEMM).


``native_block_gemm(a, b, ...)`` computes the same op(a) @ op(b) as ``dequantized_gemm`` but hands
the quantized bytes and their block scales to ``te_compile::block_scaled_mm`` (scaled_mm_op.py:
``torch.nn.functional.scaled_mm``, i.e. cuBLASLt, behind an op inductor does not lower) instead of
dequantizing. Whether a device runs it at all is decided once per recipe, device and dtype by
``block_probe.native_block_gemm_support``; this module only builds the arguments.

scaled_mm computes mat_a [M, K] (row-major) @ mat_b [K, N] (column-major, i.e. the transpose of a
row-major [N, K]) with each operand's scales describing blocks along K. So every operand is first
brought to "rows x K, row-major" form: ``data`` [R, K] plus a block-scale matrix over it
(``_KMajor``). Which stored copy that is follows the linear lowerings: the operand whose GEMM
contracts its last dim uses the rowwise copy (blocks along the last dim), the one contracting dim 0 the
columnwise copy (Float8 block and NVFP4 store it transposed already; MXFP8 keeps [M, K], so its data is
transposed here).

Scale layouts scaled_mm expects (torch 2.13, ``_check_scaled_mm_sizes_v2`` and cuBLASLt's block
scaling modes):
- MXFP8 (BlockWise1x32, E8M0) and NVFP4 (BlockWise1x16, E4M3 + a TensorWise fp32 decode scale): the
  [R, K/block] scale matrix padded to [128·⌈R/128⌉, 4·⌈(K/block)/4⌉] and swizzled (SWIZZLE_32_4_4,
  ``swizzle_32_4_4``).
- Float8 block, 1x128 blocks (BlockWise1x128, fp32): [R, K/128] column-major (stride [1, R]).
- Float8 block, 128x128 tiles (BlockWise128x128, fp32): the tile scales [R/128, K/128] with the K-tile
  dim padded to a multiple of 4 (L4), passed transposed: shape [L4, R/128], stride [1, L4].
  Supported pairs are 1x128 x 1x128, 1x128 x 128x128 and 128x128 x 1x128 (not 128x128 x 128x128).

Padding (exact: zeros add nothing to any dot product and change no block's scale): K is padded with
zeros to the format's K multiple (``K_MULTIPLE``) with the new blocks' scales set to 1; mat_b's rows
(N) are padded to 16, a Float8 block mat_a's rows (M) to 4, 128x128-tiled operands' rows to 128, and
the output is cut back to [M, N].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..kernels.float8_block_quantize import FLOAT8_BLOCK
from ..kernels.mxfp8_quantize import MXFP8_BLOCK
from ..kernels.nvfp4_quantize import NVFP4_BLOCK, nvfp4_global_scale
from ..recipe import GRADIENT_ROLES, ROLES, Recipe
from ..tensor.float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensorStorage
from ..tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8TensorStorage
from ..tensor.nvfp4_tensor import NVFP4Quantizer, NVFP4TensorStorage
from ..tensor.quantized_tensor import Quantizer
from .scaled_mm_op import block_scaled_mm, round_up, swizzle_32_4_4

__all__ = ["quantizer_factory", "quantize_copies", "quantize_tokens_per_group", "native_block_gemm",
           "native_pair_supported", "dequantized_gemm", "block_format"]


# ---- the operands: quantizer objects -------------------------------------------------------------


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


# ---- the GEMMs ---------------------------------------------------------------------------------------

# Multiple the contraction dim is zero-padded to, per format, in elements: whole blocks, and scaled_mm's
# K % 16 on the stored dim (NVFP4 stores two elements per byte, so 32 elements).
K_MULTIPLE = {"mxfp8": MXFP8_BLOCK, "float8_block": FLOAT8_BLOCK, "nvfp4": 2 * NVFP4_BLOCK}

# scaled_mm wants mat_b's dims (K and N) in multiples of 16; cuBLASLt's 1x128 / 128x128 modes want
# mat_a's M in multiples of 4 (vLLM pads it so).
_ROW_MULTIPLE_B = 16
_ROW_MULTIPLE_A = {"mxfp8": 1, "float8_block": 4, "nvfp4": 1}

# Scale bytes that decode to 1.0: E8M0 code 127 (2^0), E4M3 0x38.
_ONE_CODE = {"mxfp8": 127, "nvfp4": 0x38}

# L4: the K-tile count of 128x128 tile scales is padded to a multiple of 4.
_TILE_COLS = 4


def block_format(t) -> Optional[str]:
    """"mxfp8", "float8_block" or "nvfp4" for a block-scaled storage; None for anything else."""
    if isinstance(t, MXFP8TensorStorage):
        return "mxfp8"
    if isinstance(t, Float8BlockwiseQTensorStorage):
        return "float8_block"
    if isinstance(t, NVFP4TensorStorage):
        return "nvfp4"
    return None


def _pad_2d(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """t [R, C] padded at the end to [rows, cols] (fp8 / fp4 through their bytes)."""
    r, c = t.shape
    if (r, c) == (rows, cols):
        return t
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return F.pad(t.view(torch.uint8), (0, cols - c, 0, rows - r), value=value).view(t.dtype)
    return F.pad(t, (0, cols - c, 0, rows - r), value=value)


@dataclass
class _KMajor:
    """One GEMM operand as rows x K, row-major.

    data: [R, K] fp8 (NVFP4: [R, K/2] packed E2M1 bytes); scale: [R, K/block] block scales (uint8
    E8M0 / E4M3 bytes for MXFP8 / NVFP4, fp32 for Float8 block), or [⌈R/128⌉, K/128] fp32 tile scales
    for Float8 128x128; decode: NVFP4's fp32 tensor-level decode scale [1], else None.
    """

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    k: int                  # contraction length in elements
    tiles_2d: bool = False  # Float8 block 128x128 tiles
    decode: Optional[torch.Tensor] = None

    @property
    def rows(self) -> int:
        return self.data.shape[0]


def _k_major(t, contract_dim: int) -> _KMajor:
    """The copy of storage ``t`` (2-D logical [R0, C0]) whose blocks run along ``contract_dim``."""
    fmt = block_format(t)
    copy = "rowwise" if contract_dim == 1 else "columnwise"
    data, scale = getattr(t, f"_{copy}_data"), getattr(t, f"_{copy}_scale_inv")
    if data is None:
        raise ValueError(f"native_block_gemm: the operand contracts dim {contract_dim} and needs its {copy} "
                         f"copy, which this {type(t).__name__} does not hold")
    r0, c0 = t.shape
    k = c0 if contract_dim == 1 else r0
    if fmt == "mxfp8":
        data = data.view(t._fp8_dtype)
        if contract_dim == 0:
            # MXFP8 keeps the columnwise copy as [M, K] with scales [M/32, K]: transpose both.
            data, scale = data.t().contiguous(), scale.t()
        return _KMajor(fmt, data, scale, k)
    if fmt == "float8_block":
        return _KMajor(fmt, data.view(t._fp8_dtype), scale, k, tiles_2d=t._is_2D_scaled)
    amax = t._amax_rowwise if contract_dim == 1 else t._amax_columnwise
    decode = torch.reciprocal(nvfp4_global_scale(amax))
    return _KMajor(fmt, data, scale, k, decode=decode)


def _pad_operand(op: _KMajor, row_multiple: int) -> _KMajor:
    """``op`` with K zero-padded to the format's multiple and rows padded to ``row_multiple``."""
    kp = round_up(op.k, K_MULTIPLE[op.fmt])
    rows = round_up(op.rows, FLOAT8_BLOCK if op.tiles_2d else row_multiple)
    per_byte = 2 if op.fmt == "nvfp4" else 1
    data = _pad_2d(op.data, rows, kp // per_byte)
    if op.fmt == "float8_block":
        block, scale_rows = FLOAT8_BLOCK, (rows // FLOAT8_BLOCK if op.tiles_2d else rows)
        scale = _pad_2d(op.scale, scale_rows, kp // block, value=1.0)
    else:
        block = MXFP8_BLOCK if op.fmt == "mxfp8" else NVFP4_BLOCK
        scale = _pad_2d(op.scale, rows, kp // block, value=_ONE_CODE[op.fmt])
    return _KMajor(op.fmt, data, scale, kp, op.tiles_2d, op.decode)


def _scale_args(op: _KMajor):
    """(scales, scaling types, swizzles) of one operand for block_scaled_mm (see scaled_mm_op.py)."""
    no_swizzle, swizzle = F.SwizzleType.NO_SWIZZLE.value, F.SwizzleType.SWIZZLE_32_4_4.value
    if op.fmt == "float8_block":
        if op.tiles_2d:
            l4 = round_up(op.scale.shape[1], _TILE_COLS)
            scale = _pad_2d(op.scale, op.scale.shape[0], l4).contiguous().t()  # [L4, R/128], stride [1, L4]
            return [scale], [F.ScalingType.BlockWise128x128.value], [no_swizzle]
        scale = op.scale.t().contiguous().t()  # [R, K/128], stride [1, R]
        return [scale], [F.ScalingType.BlockWise1x128.value], [no_swizzle]
    swizzled = swizzle_32_4_4(op.scale)
    if op.fmt == "mxfp8":
        return [swizzled], [F.ScalingType.BlockWise1x32.value], [swizzle]
    return ([swizzled, op.decode.reshape(()).to(torch.float32)],
            [F.ScalingType.BlockWise1x16.value, F.ScalingType.TensorWise.value], [swizzle, no_swizzle])


def _tiles_2d(t) -> bool:
    return block_format(t) == "float8_block" and t._is_2D_scaled


def native_pair_supported(a, b) -> bool:
    """Whether scaled_mm has this pair of operands. It lacks two: E5M2 FP8 data (its MXFP8 and
    Float8 block modes take E4M3 only, so HYBRID's gradients stay emulated) and two Float8 block
    operands in 128x128 tiles (it has 1x128·1x128, 1x128·128x128 and 128x128·1x128)."""
    if any(getattr(t, "_fp8_dtype", torch.float8_e4m3fn) != torch.float8_e4m3fn for t in (a, b)):
        return False
    return not (_tiles_2d(a) and _tiles_2d(b))


def native_block_gemm(a, b, *, transpose_a: bool = False, transpose_b: bool = False,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """op(a) @ op(b) [M, N] in ``out_dtype`` for two block-scaled storages of one format.

    a: logical [M, K] (or [K, M] with transpose_a) holding the copy with blocks along K, likewise b:
    [K, N] (or [N, K] with transpose_b). Same contract as ``dequantized_gemm``; the caller checks
    ``block_probe.native_block_gemm_support`` first.
    """
    fmt = block_format(a)
    if fmt is None or block_format(b) != fmt:
        raise TypeError(f"native_block_gemm needs two storages of one block format, got "
                        f"{type(a).__name__} and {type(b).__name__}")
    op_a = _k_major(a, 0 if transpose_a else 1)   # [M, K]
    op_b = _k_major(b, 1 if transpose_b else 0)   # [N, K]
    if op_a.k != op_b.k:
        raise ValueError(f"native_block_gemm: contraction lengths differ ({op_a.k} vs {op_b.k})")
    if not native_pair_supported(a, b):
        raise ValueError("native_block_gemm: scaled_mm has no GEMM for this pair (E5M2 data, or "
                         "128x128 tiles on both sides); use the emulated GEMM")
    m, n = op_a.rows, op_b.rows
    op_a = _pad_operand(op_a, _ROW_MULTIPLE_A[fmt])
    op_b = _pad_operand(op_b, _ROW_MULTIPLE_B)
    scale_a, recipe_a, swizzle_a = _scale_args(op_a)
    scale_b, recipe_b, swizzle_b = _scale_args(op_b)
    out = block_scaled_mm(op_a.data, op_b.data.t(), scale_a, recipe_a, swizzle_a,
                          scale_b, recipe_b, swizzle_b, out_dtype)
    if out.shape != (m, n):
        out = out[:m, :n]
    return out


def dequantized_gemm(a, b, *, transpose_a: bool = False, transpose_b: bool = False,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """op(a) @ op(b) of two quantized tensors (any format) by dequantizing both to fp32.

    a, b: QuantizedTensorStorage (2-D); op transposes when asked. This is the emulation used where
    a format has no native GEMM wired in: exact dequantization, one fp32 matmul, one final cast.
    """
    a32 = a.dequantize(dtype=torch.float32)
    b32 = b.dequantize(dtype=torch.float32)
    return ((a32.t() if transpose_a else a32) @ (b32.t() if transpose_b else b32)).to(out_dtype)
