"""Float8 block-scaling quantize: one fp32 scale per 1x128 or 128x128 tile (DESIGN.md §5).

DeepSeek-style blocks as in TransformerEngine's ``Float8BlockQuantizer``: activations and
gradients use 1x128 blocks (``tile_rows=1``), weights 128x128 tiles (``tile_rows=128``). Each tile
gets the per-tensor current-scaling rule of ``te_compile.scaling.compute_scale`` applied to
its own amax, and its elements are cast with ``cast_to_fp8``; a ragged last tile along either dim
takes the amax of the elements present. Only the rowwise copy is produced here: callers that need
the columnwise copy quantize ``x.t().contiguous()`` (from high precision, as TE does).

Three functions with one signature: ``float8_block_quantize_reference`` (plain torch, traceable by
torch.compile), ``float8_block_quantize_triton`` (launcher of ``_float8_block_quantize_kernel``),
and ``float8_block_quantize`` (the kernel for CUDA tensors when Triton is present, else the
reference). All three return ``(data, scale_inv)``: data uint8 [M, K] holding the fp8 bytes, and
scale_inv fp32 [ceil(M / tile_rows), ceil(K / 128)].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._fp_bits import HAS_TRITON, use_triton
from ._launch import check_input, launch_row_tiles, require_triton
from ..scaling import FLT_MAX, cast_to_fp8, compute_scale, fp8_max

__all__ = [
    "FLOAT8_BLOCK",
    "float8_block_quantize",
    "float8_block_quantize_reference",
    "float8_block_quantize_triton",
]

# Block length along the contiguous (last) dim; 2-D tiles are FLOAT8_BLOCK x FLOAT8_BLOCK.
FLOAT8_BLOCK = 128

_TILE_ROWS = (1, FLOAT8_BLOCK)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Rows per program, for both tile shapes: one 128 x 128 fp32 block (64 KiB over 8 warps). Fewer,
# larger programs also keep the Triton interpreter (CPU tests) fast: its cost is per program.
_BLOCK_M = 128


def _check_args(x: torch.Tensor, fp8_dtype: torch.dtype, tile_rows: int, amax_epsilon: float) -> None:
    check_input(x)
    if fp8_dtype not in _FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {list(_FP8_DTYPES)}, got {fp8_dtype!r}")
    if isinstance(tile_rows, bool) or tile_rows not in _TILE_ROWS:
        raise ValueError(f"tile_rows must be one of {_TILE_ROWS}, got {tile_rows!r}")
    if (isinstance(amax_epsilon, bool) or not isinstance(amax_epsilon, (int, float))
            or not math.isfinite(amax_epsilon) or amax_epsilon < 0):
        raise ValueError(f"amax_epsilon must be a finite number >= 0, got {amax_epsilon!r}")


def _scale_inv_shape(m: int, k: int, tile_rows: int) -> tuple[int, int]:
    return (-(-m // tile_rows), -(-k // FLOAT8_BLOCK))


def float8_block_quantize_reference(x: torch.Tensor, fp8_dtype: torch.dtype, *, tile_rows: int,
                                    force_pow_2_scales: bool, amax_epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch block quantize. x: [M, K] -> (data uint8 [M, K], scale_inv fp32 [Mt, Kt]).

    Pads x with zeros to whole tiles (zeros never raise an amax), takes one amax per tile, applies
    ``compute_scale`` to the [Mt, Kt] amax grid (it is elementwise), casts, and slices the padding
    off. Pure tensor ops, no host syncs: torch.compile can trace it.
    """
    _check_args(x, fp8_dtype, tile_rows, amax_epsilon)
    m, k = x.shape
    pad_m = (-m) % tile_rows
    pad_k = (-k) % FLOAT8_BLOCK
    # xp: [Mt * tile_rows, Kt * 128] -> tiles: [Mt, tile_rows, Kt, 128]
    xp = F.pad(x.detach().to(torch.float32), (0, pad_k, 0, pad_m))
    mt, kt = (m + pad_m) // tile_rows, (k + pad_k) // FLOAT8_BLOCK
    tiles = xp.reshape(mt, tile_rows, kt, FLOAT8_BLOCK)
    # amax: [Mt, Kt]; NaN propagates through amax, and compute_scale maps a NaN amax to scale 1
    amax = tiles.abs().amax(dim=(1, 3))
    scale = compute_scale(amax, fp8_dtype, force_pow_2_scales=force_pow_2_scales,
                          amax_epsilon=amax_epsilon)
    data = cast_to_fp8(tiles, scale[:, None, :, None], fp8_dtype).view(torch.uint8)
    data = data.reshape(mt * tile_rows, kt * FLOAT8_BLOCK)[:m, :k]
    scale_inv = torch.div(torch.ones_like(scale), scale)
    return data, scale_inv


if HAS_TRITON:
    import triton
    import triton.language as tl

    from te_compile.kernels._fp_bits import fp8_bits_no_nan, fp8_nan_bits, nan_max

    # jit functions may read module globals only when they are constexpr
    _FLT_MAX = tl.constexpr(FLT_MAX)

    @triton.jit
    def _block_scale(
        amax,                       # [BLOCK_M] (1x128 blocks) or scalar (128x128 tiles), fp32, NaN kept
        amax_epsilon,               # fp32 scalar
        FP8_MAX: tl.constexpr,
        FORCE_POW_2_SCALES: tl.constexpr,
        USE_EPSILON: tl.constexpr,
    ):
        """compute_scale's rule elementwise; returns (scale, scale_inv)."""
        if USE_EPSILON:
            amax = tl.maximum(amax, amax_epsilon, propagate_nan=tl.PropagateNan.ALL)   # as torch.clamp
        # div_rn: correctly rounded, as torch.div; plain '/' is an approximate division on GPU.
        scale = tl.div_rn(tl.zeros_like(amax) + FP8_MAX, amax)
        scale = tl.where(scale > _FLT_MAX, _FLT_MAX, scale)
        bad_amax = (amax == 0.0) | (amax > _FLT_MAX) | (amax != amax)
        scale = tl.where(bad_amax, 1.0, scale)
        if FORCE_POW_2_SCALES:
            # keep sign and exponent bits, drop the 23 mantissa bits: largest power of two <= scale
            scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
        scale_inv = tl.div_rn(tl.zeros_like(scale) + 1.0, scale)
        return scale, scale_inv

    @triton.jit
    def _float8_block_quantize_kernel(
        x_ptr,                      # [M, K] fp32/bf16/fp16, row stride stride_xm, unit column stride
        data_ptr,                   # [M, K] uint8 fp8 bytes, contiguous
        scale_inv_ptr,              # [ceil(M / TILE_ROWS), n_kblocks] fp32, contiguous
        M,                          # rows of x
        K,                          # columns of x
        stride_xm,                  # elements between rows of x
        n_kblocks,                  # ceil(K / BLOCK_K)
        amax_epsilon,               # fp32 floor of the tile amax (used when USE_EPSILON)
        FP8_MAX: tl.constexpr,
        IS_E4M3: tl.constexpr,
        TILE_ROWS: tl.constexpr,    # 1 (1x128 blocks) or 128 (128x128 tiles)
        BLOCK_M: tl.constexpr,      # rows per program; must equal TILE_ROWS for 128x128 tiles
        BLOCK_K: tl.constexpr,      # 128
        FORCE_POW_2_SCALES: tl.constexpr,
        USE_EPSILON: tl.constexpr,
    ):
        # One program: rows [pid_m*BLOCK_M, +BLOCK_M) x one 128-column block. int64: M*K may
        # exceed 2**31.
        pid_m = tl.program_id(0).to(tl.int64)
        pid_k = tl.program_id(1).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)      # [BLOCK_M]
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)      # [BLOCK_K]
        row_ok = rows < M
        mask = row_ok[:, None] & (cols[None, :] < K)         # [BLOCK_M, BLOCK_K]
        # elements outside x read as 0: they never raise a tile's amax
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        row_amax = tl.reduce(tl.abs(x), 1, nan_max)          # [BLOCK_M], NaN if the row holds one
        tile_amax = tl.reduce(row_amax, 0, nan_max)          # the program's: NaN if any row holds one
        if TILE_ROWS == 1:
            scale, scale_inv = _block_scale(row_amax, amax_epsilon, FP8_MAX, FORCE_POW_2_SCALES, USE_EPSILON)
            y = x * scale[:, None]
            tl.store(scale_inv_ptr + rows * n_kblocks + pid_k, scale_inv, mask=row_ok)
        else:
            scale, scale_inv = _block_scale(tile_amax, amax_epsilon, FP8_MAX, FORCE_POW_2_SCALES, USE_EPSILON)
            y = x * scale
            tl.store(scale_inv_ptr + pid_m * n_kblocks + pid_k, scale_inv)
        # the hardware conversion (bit operations in the interpreter, whose fp8 casts are wrong)
        codes = fp8_bits_no_nan(y, IS_E4M3)
        data_ptrs = data_ptr + rows[:, None] * K + cols[None, :]
        tl.store(data_ptrs, codes.to(tl.uint8), mask=mask)
        if tile_amax != tile_amax:
            # rare: a tile holding a NaN stores its bytes again with torch's NaN byte, 0x7F|sign. A
            # select on every tile's bytes instead would unpack the conversion's byte pairs.
            tl.store(data_ptrs, fp8_nan_bits(y, codes).to(tl.uint8), mask=mask)


def float8_block_quantize_triton(x: torch.Tensor, fp8_dtype: torch.dtype, *, tile_rows: int,
                                 force_pow_2_scales: bool, amax_epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``_float8_block_quantize_kernel``; same contract as the reference. Takes CPU tensors
    too under ``TRITON_INTERPRET=1`` (the tests run it that way)."""
    require_triton("float8_block_quantize_triton")
    _check_args(x, fp8_dtype, tile_rows, amax_epsilon)
    m, k = x.shape
    scale_inv_shape = _scale_inv_shape(m, k, tile_rows)
    data, scale_inv = launch_row_tiles(
        _float8_block_quantize_kernel,
        x,
        [((m, k), torch.uint8),                         # data: fp8 bytes
         (scale_inv_shape, torch.float32)],             # scale_inv: [Mt, Kt]
        [scale_inv_shape[1], float(amax_epsilon)],      # n_kblocks, amax_epsilon
        block_m=_BLOCK_M,
        block_k=FLOAT8_BLOCK,
        num_warps=8,
        FP8_MAX=fp8_max(fp8_dtype),
        IS_E4M3=fp8_dtype == torch.float8_e4m3fn,
        TILE_ROWS=tile_rows,
        FORCE_POW_2_SCALES=bool(force_pow_2_scales),
        USE_EPSILON=amax_epsilon > 0,
    )
    return data, scale_inv


def float8_block_quantize(x: torch.Tensor, fp8_dtype: torch.dtype, *, tile_rows: int,
                          force_pow_2_scales: bool, amax_epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantize x [M, K]: the Triton kernel for CUDA tensors when Triton is present, the
    plain-torch reference otherwise (on CPU as one opaque op, for compile time: see
    ``nvfp4_quantize``). Returns (data uint8 [M, K], scale_inv fp32 [Mt, Kt])."""
    if use_triton(x):
        fn = float8_block_quantize_triton
    elif x.device.type == "cpu":
        _check_args(x, fp8_dtype, tile_rows, amax_epsilon)
        return _float8_block_quantize_cpu(x.detach(), fp8_dtype, tile_rows, bool(force_pow_2_scales),
                                          float(amax_epsilon))
    else:
        fn = float8_block_quantize_reference
    return fn(x, fp8_dtype, tile_rows=tile_rows, force_pow_2_scales=force_pow_2_scales,
              amax_epsilon=amax_epsilon)


@torch.library.custom_op("te_compile::float8_block_quantize_cpu", mutates_args=(), device_types="cpu")
def _float8_block_quantize_cpu(x: torch.Tensor, fp8_dtype: torch.dtype, tile_rows: int, force_pow_2_scales: bool,
                               amax_epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference as one opaque op on CPU (see ``float8_block_quantize``), outputs contiguous as its
    fake says (the reference slices the padding off)."""
    data, scale_inv = float8_block_quantize_reference(x, fp8_dtype, tile_rows=tile_rows,
                                                      force_pow_2_scales=force_pow_2_scales, amax_epsilon=amax_epsilon)
    return data.contiguous(), scale_inv.contiguous()


@_float8_block_quantize_cpu.register_fake
def _(x, fp8_dtype, tile_rows, force_pow_2_scales, amax_epsilon):
    m, k = x.shape
    return (x.new_empty((m, k), dtype=torch.uint8),
            x.new_empty(_scale_inv_shape(m, k, tile_rows), dtype=torch.float32))
