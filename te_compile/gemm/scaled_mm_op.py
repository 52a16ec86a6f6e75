"""``te_compile::block_scaled_mm``: torch's block-scaled ``F.scaled_mm`` as an op inductor leaves alone,
the cuBLASLt scale swizzle, and a pure-torch reference of the op with the same signature.

Why an opaque custom op: torch 2.13's inductor lowering of ``aten._scaled_mm_v2`` rejects swizzled
(MXFP8 / NVFP4) scales ("does not yet support non-trivial swizzles") and hands the Float8 block
(DeepSeek) scales, laid out for v2, to the v1 ``_scaled_mm`` kernel, which reads them in another
layout. Behind this op, inductor still fuses everything that builds the arguments and calls the
eager v2 kernel for the GEMM itself. The fake implementation runs torch's own meta checks of
``scaled_mm``, so a wrong layout fails at trace time with torch's message.

On CUDA the op calls ``F.scaled_mm``; elsewhere (CPU) it runs ``block_scaled_mm_reference``, which
decodes the arguments exactly as the op's contract describes them (block expansion, the swizzle, the
NVFP4 tensor scale) and multiplies in fp32. The backend only routes GEMMs here where
block_probe.py found the device runs them natively; the CPU kernel lets tests check every argument
the native path builds against the emulation, on any machine.

Scaling types (``F.ScalingType``) and the scales each operand [R, K] takes (decode multipliers: the
value is data · scale):
- BlockWise1x32 (MXFP8): E8M0 [R, K/32], swizzled (SWIZZLE_32_4_4), flat.
- BlockWise1x16 + TensorWise (NVFP4): E4M3 [R, K/16] swizzled, and an fp32 scalar; the data is packed
  E2M1, two elements per byte (element 2j in the low nibble), so K counts elements, not bytes.
The op takes those byte formats as uint8 (E2M1 data, E8M0 / E4M3 scales) and reinterprets them
itself: inductor's CPU code generator has no E8M0 type, and none of the three needs arithmetic
before the GEMM.
- BlockWise1x128: fp32 [R, K/128] with stride [1, R].
- BlockWise128x128: fp32 [L4, R/128] with stride [1, L4], L4 = K/128 rounded up to a multiple of 4
  (the transpose of the tile scales [R/128, L4]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.nvfp4_quantize import unpack_e2m1
from ..tensor.block_scaled_tensor import expand_block_scales
from ..tensor.mxfp8_tensor import e8m0_to_fp32

__all__ = ["block_scaled_mm", "block_scaled_mm_reference", "swizzle_32_4_4", "unswizzle_32_4_4"]

# The swizzled layout's tile: 128 rows (4 groups of 32) x 4 scale columns, stored as 512 bytes.
_TILE_ROWS, _TILE_COLS, _ROW_GROUP = 128, 4, 32

# Elements per scale along K for each block scaling type.
_BLOCK = {F.ScalingType.BlockWise1x16: 16, F.ScalingType.BlockWise1x32: 32,
          F.ScalingType.BlockWise1x128: 128, F.ScalingType.BlockWise128x128: 128}


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m


def swizzle_32_4_4(scales: torch.Tensor) -> torch.Tensor:
    """cuBLASLt's block-scale layout for MXFP8 / NVFP4 (SWIZZLE_32_4_4), flat.

    scales: [R, C] (R rows of the operand, C = K / block scale columns), one byte per scale. Padded with
    zeros to [Rp, Cp] = [128·⌈R/128⌉, 4·⌈C/4⌉] and cut into 128x4 tiles, stored tile after tile (the tiles
    of one 128-row band first). Inside a tile, the scale of row r, column c sits at byte
    (r % 32) · 16 + (r // 32) · 4 + c: the four 32-row groups are interleaved, so one 16-byte load holds
    the 4 columns of 4 rows 32 apart. Returns [Rp · Cp].
    """
    rows, cols = scales.shape
    rp, cp = round_up(rows, _TILE_ROWS), round_up(cols, _TILE_COLS)
    if (rp, cp) != (rows, cols):
        scales = F.pad(scales, (0, cp - cols, 0, rp - rows))
    # row = band·128 + group·32 + r32, column = tile·4 + c  ->  [band, tile, r32, group, c]
    tiles = scales.reshape(rp // _TILE_ROWS, _TILE_ROWS // _ROW_GROUP, _ROW_GROUP, cp // _TILE_COLS,
                           _TILE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)


def unswizzle_32_4_4(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle_32_4_4``: the [rows, cols] scale matrix from the flat swizzled buffer."""
    rp, cp = round_up(rows, _TILE_ROWS), round_up(cols, _TILE_COLS)
    if flat.numel() != rp * cp:
        raise ValueError(f"a swizzled [{rows}, {cols}] scale matrix has {rp * cp} entries, "
                         f"got {flat.numel()}")
    tiles = flat.reshape(rp // _TILE_ROWS, cp // _TILE_COLS, _ROW_GROUP, _TILE_ROWS // _ROW_GROUP, _TILE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(rp, cp)[:rows, :cols]


def _typed(data: torch.Tensor, scales: list[torch.Tensor], recipes: list[int]):
    """The uint8 byte formats the op takes, viewed as the dtypes scaled_mm expects."""
    kind = F.ScalingType(recipes[0])
    if data.dtype == torch.uint8:
        data = data.view(torch.float4_e2m1fn_x2)
    byte_scale = {F.ScalingType.BlockWise1x32: torch.float8_e8m0fnu,
                  F.ScalingType.BlockWise1x16: torch.float8_e4m3fn}.get(kind)
    if byte_scale is not None and scales[0].dtype == torch.uint8:
        scales = [scales[0].view(byte_scale), *scales[1:]]
    return data, scales


def _decode(data: torch.Tensor, scales: list[torch.Tensor], recipes: list[int],
            swizzles: list[int]) -> torch.Tensor:
    """fp32 values [R, K] of one operand given as rows x K (data [R, K] fp8, or [R, K/2] packed E2M1
    bytes), scales as the op takes them."""
    if data.dtype == torch.uint8:
        values = unpack_e2m1(data)
    else:
        values = data.to(torch.float32)
    rows, k = values.shape
    kind = F.ScalingType(recipes[0])
    swizzled = bool(swizzles) and F.SwizzleType(swizzles[0]) == F.SwizzleType.SWIZZLE_32_4_4
    if kind == F.ScalingType.TensorWise:
        return values * scales[0].to(torch.float32).reshape(())
    block = _BLOCK[kind]
    kb = -(-k // block)
    if kind in (F.ScalingType.BlockWise1x32, F.ScalingType.BlockWise1x16):
        raw = scales[0].view(torch.uint8)
        raw = unswizzle_32_4_4(raw.reshape(-1), rows, kb) if swizzled else raw.reshape(rows, kb)
        scale = e8m0_to_fp32(raw) if kind == F.ScalingType.BlockWise1x32 else \
            raw.view(torch.float8_e4m3fn).to(torch.float32)
        out = values * expand_block_scales(scale, 1, k, block)
        if len(scales) > 1:  # NVFP4's second level: the fp32 tensor decode scale
            out = out * scales[1].to(torch.float32).reshape(())
        return out
    if kind == F.ScalingType.BlockWise1x128:
        return values * expand_block_scales(scales[0].reshape(rows, kb), 1, k, block)
    tile_scales = scales[0].t()[:, :kb]  # [L4, R/128] -> [R/128, K/128]
    return values * expand_block_scales(expand_block_scales(tile_scales, 0, rows, block), 1, k, block)


def block_scaled_mm_reference(mat_a: torch.Tensor, mat_b: torch.Tensor,
                              scale_a: list[torch.Tensor], recipe_a: list[int], swizzle_a: list[int],
                              scale_b: list[torch.Tensor], recipe_b: list[int], swizzle_b: list[int],
                              out_dtype: torch.dtype) -> torch.Tensor:
    """What ``block_scaled_mm`` computes, in plain torch: decode both operands, one fp32 matmul.

    mat_a: [M, K] (packed E2M1: [M, K/2]); mat_b: [K, N] ([K/2, N]); the scales as in the module doc.
    """
    a = _decode(mat_a, scale_a, recipe_a, swizzle_a)        # [M, K]
    b = _decode(mat_b.t(), scale_b, recipe_b, swizzle_b)    # [N, K]
    return (a @ b.t()).to(out_dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _laid_out(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b):
    """The layouts cuBLASLt takes (copies only where the caller's differ): mat_a row-major, mat_b
    column-major, 1x128 / 128x128 scales column-major, swizzled scales contiguous."""
    def scales(ss, recipes):
        kind = F.ScalingType(recipes[0])
        if kind in (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128):
            return [_column_major(ss[0])]
        return [s.contiguous() for s in ss]
    return (mat_a.contiguous(), _column_major(mat_b), scales(scale_a, recipe_a), scales(scale_b, recipe_b))


def _scaled_mm(mat_a, mat_b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, out_dtype):
    mat_a, scale_a = _typed(mat_a, scale_a, recipe_a)
    mat_b, scale_b = _typed(mat_b, scale_b, recipe_b)
    return F.scaled_mm(mat_a, mat_b,
                       scale_a, [F.ScalingType(r) for r in recipe_a],
                       scale_b, [F.ScalingType(r) for r in recipe_b],
                       swizzle_a=[F.SwizzleType(s) for s in swizzle_a],
                       swizzle_b=[F.SwizzleType(s) for s in swizzle_b],
                       output_dtype=out_dtype)


# needs_exact_strides: inductor hands the op its arguments with the strides they had when traced (the
# builder in block.py makes the layouts cuBLASLt wants; the op then copies nothing).
@torch.library.custom_op("te_compile::block_scaled_mm", mutates_args=(), tags=(torch.Tag.needs_exact_strides,))
def block_scaled_mm(mat_a: torch.Tensor, mat_b: torch.Tensor,
                    scale_a: list[torch.Tensor], recipe_a: list[int], swizzle_a: list[int],
                    scale_b: list[torch.Tensor], recipe_b: list[int], swizzle_b: list[int],
                    out_dtype: torch.dtype) -> torch.Tensor:
    """mat_a [M, K] (row-major) @ mat_b [K, N] (column-major) with block scales -> [M, N] ``out_dtype``.

    mat_*: fp8, or uint8 packed E2M1 ([M, K/2], [K/2, N]); scale_*: fp32, or uint8 E8M0 / E4M3 bytes;
    recipe_* / swizzle_*: ``F.ScalingType`` / ``F.SwizzleType`` values, one per scale tensor.
    """
    if mat_a.device.type == "cuda":
        mat_a, mat_b, scale_a, scale_b = _laid_out(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b)
        return _scaled_mm(mat_a, mat_b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, out_dtype)
    return block_scaled_mm_reference(mat_a, mat_b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b,
                                     swizzle_b, out_dtype)


@block_scaled_mm.register_fake
def _(mat_a, mat_b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, out_dtype):
    # torch's meta function of scaled_mm: checks dtypes, scale shapes / strides and swizzles
    # (operand layouts too, for CUDA tensors) and gives the output.
    return _scaled_mm(mat_a, mat_b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, out_dtype)
