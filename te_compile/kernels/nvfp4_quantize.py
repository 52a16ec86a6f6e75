"""NVFP4 quantize: E2M1 elements with one e4m3 scale per 1x16 block or 16x16 tile (DESIGN.md §5).

TransformerEngine's two-level scaling. With the tensor amax A (computed by the caller):

    S  = 448 * 6 / A                       global encode scale, fp32 true division; A = 0, inf or
                                           NaN -> 1; an infinite S -> FLT_MAX
    bs = e4m3((block_amax / 6) * S)        per block, saturating round-to-nearest-even
    f  = S / bs                            per block encode factor; 0 where bs == 0; inf -> FLT_MAX
    q  = e2m1(clamp(x * f, -6, 6))         round-to-nearest-even (ties to the even code), or
                                           stochastic rounding with ``rand``
    x ~= e2m1_value(q) * bs / S            (``nvfp4_dequantize``)

Blocks are 1x16 along K (``tile_rows=1``: activations, gradients) or 16x16 tiles (``tile_rows=16``:
weights, so that the transposed copy has the same scales); a ragged last row-tile covers the rows
that exist.

A is one amax for the whole tensor (fp32 [1]) or, for a tensor holding several groups quantized as
if alone (an MoE layer's experts: each expert's tokens, weight and gradient rows), one amax per row
tile ([ceil(M / tile_rows), 1]) or per column of blocks ([1, K // 16]); S then varies alike. The Triton
kernel takes the single amax; the reference takes all three. Two codes per byte, element 2j in the low nibble. Conventions where TE leaves a choice:

- The sign bit of every code is the sign bit of x: -0.0 and negatives that round to zero encode as
  code 8 (-0).
- NaN elements do not take part in the block amax (GPU max-reductions drop NaNs anyway) and encode
  as code 7 (|6|) with x's sign, like the saturating E2M1 conversion; a block of only NaNs gets
  scale 0. A NaN tensor amax gives S = 1 (the rule above).
- Stochastic rounding: with lo <= |v| <= hi the neighbouring grid magnitudes, the code of hi is taken
  iff rand < (|v| - lo) / (hi - lo); grid points (and |v| = 6) never move.

Three functions with one signature: ``nvfp4_quantize_reference`` (plain torch, traceable by
torch.compile), ``nvfp4_quantize_triton`` (launcher of ``_nvfp4_quantize_kernel``) and
``nvfp4_quantize`` (the kernel for CUDA tensors when Triton is present, else the reference). All
return (data uint8 [M, K // 2] packed codes, scale uint8 [M, K // 16] e4m3 bytes of bs); with 16x16
tiles every row of a tile holds the tile's scale.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._fp_bits import HAS_TRITON, use_triton
from ._launch import check_input, launch_row_tiles, require_triton
from ..scaling import FLT_MAX, scale_for_limit

__all__ = [
    "NVFP4_BLOCK",
    "E2M1_MAX",
    "nvfp4_global_scale",
    "nvfp4_quantize",
    "nvfp4_quantize_reference",
    "nvfp4_quantize_triton",
    "nvfp4_dequantize",
    "nvfp4_dequantize_reference",
    "unpack_e2m1",
]

# Elements per block along the contiguous (last) dim; 2-D tiles are NVFP4_BLOCK x NVFP4_BLOCK.
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

_TILE_ROWS = (1, NVFP4_BLOCK)
# Kernel tile: 32 rows x 128 columns (8 blocks of 16); 32 is a multiple of the 16-row weight tiles.
_BLOCK_M = 32
_BLOCK_K = 128

# E2M1 value of each code 0..15 (bit 3 is the sign).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _check_args(x: torch.Tensor, global_amax: torch.Tensor, tile_rows: int,
                rand: Optional[torch.Tensor]) -> None:
    check_input(x)
    if x.shape[1] % NVFP4_BLOCK != 0:
        raise ValueError(f"x: K must be a multiple of {NVFP4_BLOCK}, got shape {tuple(x.shape)}")
    if isinstance(tile_rows, bool) or tile_rows not in _TILE_ROWS:
        raise ValueError(f"tile_rows must be one of {_TILE_ROWS}, got {tile_rows!r}")
    grid = (-(-x.shape[0] // tile_rows), x.shape[1] // NVFP4_BLOCK)
    allowed = ((1,), (grid[0], 1), (1, grid[1]))
    if not isinstance(global_amax, torch.Tensor) or not (global_amax.numel() == 1
                                                         or tuple(global_amax.shape) in allowed[1:]):
        shape = (tuple(global_amax.shape) if isinstance(global_amax, torch.Tensor)
                 else type(global_amax).__name__)
        raise ValueError(f"global_amax must be fp32 [1] (the tensor's amax), {list(allowed[1])} (one per row tile) "
                         f"or {list(allowed[2])} (one per column of blocks), got {shape}")
    if global_amax.device != x.device:
        raise ValueError(f"global_amax is on {global_amax.device}, x on {x.device}")
    if rand is not None:
        if not isinstance(rand, torch.Tensor) or rand.dtype != torch.float32 or rand.shape != x.shape:
            desc = (f"{rand.dtype} {tuple(rand.shape)}" if isinstance(rand, torch.Tensor)
                    else type(rand).__name__)
            raise ValueError(f"rand must be None or fp32 of x's shape {tuple(x.shape)}, got {desc}")
        if rand.device != x.device:
            raise ValueError(f"rand is on {rand.device}, x on {x.device}")


def nvfp4_global_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """S = 448 * 6 / amax (fp32 [1], or the amaxes' shape when there are several); amax 0, inf or NaN
    -> 1; an infinite S -> FLT_MAX."""
    amax = global_amax.to(torch.float32)
    return scale_for_limit(amax.reshape(1) if amax.numel() == 1 else amax, E4M3_MAX * E2M1_MAX)


def _e2m1_magnitude_rne(a: torch.Tensor) -> torch.Tensor:
    """Code 0..7 of |v| (fp32, in [0, 6]) rounded to nearest; a tie goes to the even code.

    Counts the midpoints passed: ``>`` where the lower neighbour's code is even (the tie stays
    down), ``>=`` where the upper one's is."""
    code = ((a > 0.25).to(torch.int32) + (a >= 0.75).to(torch.int32) + (a > 1.25).to(torch.int32)
            + (a >= 1.75).to(torch.int32) + (a > 2.5).to(torch.int32) + (a >= 3.5).to(torch.int32)
            + (a > 5.0).to(torch.int32))
    return code


def _e2m1_magnitude_sr(a: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """Code 0..7 of |v| (fp32, in [0, 6]) rounded up to the next grid point iff rand < p, with p the
    fraction of the way from the lower to the upper neighbour (exact: the steps are powers of two)."""
    lo_code = ((a >= 0.5).to(torch.int32) + (a >= 1.0).to(torch.int32) + (a >= 1.5).to(torch.int32)
               + (a >= 2.0).to(torch.int32) + (a >= 3.0).to(torch.int32) + (a >= 4.0).to(torch.int32)
               + (a >= 6.0).to(torch.int32))
    table = torch.tensor(_E2M1_VALUES[:8], dtype=torch.float32, device=a.device)
    lo = table[lo_code]
    # 1 / (hi - lo): steps 0.5 below 2, 1 below 4, 2 from 4 (code 7 = 6 has p = 0 whatever the step)
    inv_step = torch.where(lo_code < 4, 2.0, torch.where(lo_code < 6, 1.0, 0.5))
    p = (a - lo) * inv_step
    return lo_code + (rand < p).to(torch.int32)


def nvfp4_quantize_reference(x: torch.Tensor, global_amax: torch.Tensor, *, tile_rows: int,
                             rand: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch NVFP4 quantize. x: [M, K] -> (data uint8 [M, K // 2], scale uint8 [M, K // 16]).

    Pads the rows with zeros to whole tiles (zeros never raise an amax), takes one amax per tile,
    computes the scales on the [Mt, K // 16] grid, encodes, and slices the padding off. Pure tensor
    ops, no host syncs: torch.compile can trace it.
    """
    _check_args(x, global_amax, tile_rows, rand)
    m, k = x.shape
    kb = k // NVFP4_BLOCK
    mt = -(-m // tile_rows)
    s = nvfp4_global_scale(global_amax)
    x32 = x.detach().to(torch.float32)
    # absx: [Mt * tile_rows, K], NaNs as 0 so they do not take part in the amax
    absx = torch.where(torch.isnan(x32), torch.zeros_like(x32), x32.abs())
    absx = F.pad(absx, (0, 0, 0, mt * tile_rows - m))
    block_amax = absx.reshape(mt, tile_rows, kb, NVFP4_BLOCK).amax(dim=(1, 3))  # [Mt, Kb]
    # tensor / tensor: true division on every device (a Python 6.0 becomes a reciprocal on CUDA)
    target = torch.div(block_amax, torch.full_like(block_amax, E2M1_MAX)) * s
    bs8 = target.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)              # [Mt, Kb]
    bs = bs8.to(torch.float32)
    f = torch.div(s.expand_as(bs), bs)
    f = torch.where(torch.isinf(f), torch.full_like(f, FLT_MAX), f)
    f = torch.where(bs == 0, torch.zeros_like(f), f)
    # per-row copies of the tile values: [M, Kb], by a gather (repeat-then-slice miscompiles in
    # inductor when the last row tile is partial)
    tile_of_row = torch.arange(m, device=x.device) // tile_rows
    f_rows = f[tile_of_row]
    scale = bs8.view(torch.uint8)[tile_of_row]
    v = x32.reshape(m, kb, NVFP4_BLOCK) * f_rows[:, :, None]                     # [M, Kb, 16]
    a = v.abs().clamp(max=E2M1_MAX)
    if rand is None:
        mag = _e2m1_magnitude_rne(a)
    else:
        mag = _e2m1_magnitude_sr(a, rand.reshape(m, kb, NVFP4_BLOCK))
    mag = torch.where(torch.isnan(v), torch.full_like(mag, 7), mag)
    codes = (mag | (torch.signbit(x32).reshape(m, kb, NVFP4_BLOCK).to(torch.int32) << 3))
    codes = codes.reshape(m, k // 2, 2)
    data = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return data, scale


def unpack_e2m1(data: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes uint8 [M, K // 2] -> their fp32 values [M, K] (low nibble first)."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 2:
        desc = (f"{data.dtype} {tuple(data.shape)}" if isinstance(data, torch.Tensor)
                else type(data).__name__)
        raise ValueError(f"data must be a 2-D uint8 tensor [M, K // 2], got {desc}")
    codes = torch.stack([data & 15, data >> 4], dim=-1).reshape(data.shape[0], -1).to(torch.int64)
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=data.device)
    return table[codes]


def nvfp4_dequantize(data: torch.Tensor, scale: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """(e2m1_value(code) * bs) / S in fp32 (one division). data: uint8 [M, K // 2], scale: uint8
    [M, K // 16] e4m3 bytes, global_amax: the amax(es) the data was quantized with, fp32 [1], [M, 1]
    (per row) or [1, K // 16] (per column of blocks) -> [M, K]. On CPU one opaque op, like
    ``nvfp4_quantize``."""
    if data.device.type == "cpu" and isinstance(data, torch.Tensor) and isinstance(scale, torch.Tensor):
        _check_dequantize_args(data, scale)
        return _nvfp4_dequantize_cpu(data, scale, global_amax.detach())
    return nvfp4_dequantize_reference(data, scale, global_amax)


def _check_dequantize_args(data: torch.Tensor, scale: torch.Tensor) -> None:
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise ValueError(f"data must be a 2-D uint8 tensor [M, K // 2], got {data.dtype} {tuple(data.shape)}")
    m, k = data.shape[0], data.shape[1] * 2
    if scale.dtype != torch.uint8 or tuple(scale.shape) != (m, k // NVFP4_BLOCK):
        raise ValueError(f"scale must be uint8 {(m, k // NVFP4_BLOCK)} for data {tuple(data.shape)}, "
                         f"got {scale.dtype} {tuple(scale.shape)}")


def nvfp4_dequantize_reference(data: torch.Tensor, scale: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """``nvfp4_dequantize`` in plain torch."""
    values = unpack_e2m1(data)
    m, k = values.shape
    if scale.dtype != torch.uint8 or tuple(scale.shape) != (m, k // NVFP4_BLOCK):
        raise ValueError(f"scale must be uint8 {(m, k // NVFP4_BLOCK)} for data {tuple(data.shape)}, "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    bs = scale.view(torch.float8_e4m3fn).to(torch.float32).repeat_interleave(NVFP4_BLOCK, dim=1)
    s = nvfp4_global_scale(global_amax)
    if s.dim() == 2 and s.shape[1] > 1:   # per column of blocks: one S for 16 columns
        s = s.repeat_interleave(NVFP4_BLOCK, dim=1)
    return torch.div(values * bs, s)


@torch.library.custom_op("te_compile::nvfp4_dequantize_cpu", mutates_args=(), device_types="cpu")
def _nvfp4_dequantize_cpu(data: torch.Tensor, scale: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """The reference as one opaque op on CPU (see ``nvfp4_dequantize``)."""
    return nvfp4_dequantize_reference(data, scale, global_amax).contiguous()


@_nvfp4_dequantize_cpu.register_fake
def _(data, scale, global_amax):
    return data.new_empty((data.shape[0], data.shape[1] * 2), dtype=torch.float32)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from te_compile.kernels._fp_bits import (
        e2m1_bits_to_fp32,
        e2m1_magnitude_code,
        fp32_to_fp8_bits,
        max_drop_nan,
        min_drop_nan,
        round_to_e4m3,
    )

    # jit functions may read module globals only when they are constexpr
    _FLT_MAX = tl.constexpr(FLT_MAX)

    @triton.jit
    def _e2m1_codes(
        x,                          # [BLOCK_M, BLOCK_K // 2] fp32, one element of each pair
        f,                          # same shape, fp32 encode factor of the element's block
        r,                          # same shape, fp32 uniform [0, 1) (read only when STOCHASTIC)
        STOCHASTIC: tl.constexpr,
    ):
        """int32 E2M1 codes 0..15 of x * f (see the module docstring for the rules)."""
        v = x * f
        a = min_drop_nan(tl.abs(v), 6.0)          # NaN -> 6: code 7, the saturating conversion's
        if STOCHASTIC:
            lo_code = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
                       + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
                       + (a >= 6.0).to(tl.int32))
            lo = e2m1_bits_to_fp32(lo_code)
            inv_step = tl.where(lo_code < 4, 2.0, tl.where(lo_code < 6, 1.0, 0.5))
            mag = lo_code + (r < (a - lo) * inv_step).to(tl.int32)
        else:
            mag = e2m1_magnitude_code(a)
        sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
        return mag | (sign << 3)

    @triton.jit
    def _nvfp4_quantize_kernel(
        x_ptr,                      # [M, K] fp32/bf16/fp16, row stride stride_xm, unit column stride
        data_ptr,                   # [M, K // 2] uint8 packed codes, contiguous
        scale_ptr,                  # [M, K // 16] uint8 e4m3 block scales, contiguous
        M,                          # rows of x
        K,                          # columns of x (a multiple of 16)
        stride_xm,                  # elements between rows of x
        amax_ptr,                   # [1] fp32 tensor amax
        rand_ptr,                   # [M, K] fp32 contiguous (read only when STOCHASTIC)
        TILE_ROWS: tl.constexpr,    # 1 (1x16 blocks) or 16 (16x16 tiles)
        BLOCK_M: tl.constexpr,      # rows per program, a multiple of TILE_ROWS
        BLOCK_K: tl.constexpr,      # columns per program, a multiple of 16
        STOCHASTIC: tl.constexpr,
    ):
        HALF: tl.constexpr = BLOCK_K // 2
        NB: tl.constexpr = BLOCK_K // 16              # blocks per program row
        MT: tl.constexpr = BLOCK_M // TILE_ROWS       # row-tiles per program
        # int64: M * K may exceed 2**31
        pid_m = tl.program_id(0).to(tl.int64)
        pid_k = tl.program_id(1).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                 # [BLOCK_M]
        pairs = pid_k * HALF + tl.arange(0, HALF)                      # [HALF] byte columns
        row_ok = rows < M
        mask = row_ok[:, None] & (pairs[None, :] < K // 2)             # [BLOCK_M, HALF]
        # the tile in one contiguous load (16-byte vectors; two loads at stride 2 would be scalar),
        # split into the even / odd elements of each byte; outside x read as 0 (never raises an amax)
        all_cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)             # [BLOCK_K]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + all_cols[None, :],
                    mask=row_ok[:, None] & (all_cols[None, :] < K), other=0.0).to(tl.float32)
        x0, x1 = tl.split(tl.reshape(x, (BLOCK_M, HALF, 2)))           # [BLOCK_M, HALF] each

        # S: 448 * 6 / amax; div_rn is the correctly rounded division ('/' is approximate on GPU)
        amax = tl.load(amax_ptr)
        s = tl.div_rn(tl.zeros_like(amax) + 2688.0, amax)
        s = tl.where(s > _FLT_MAX, _FLT_MAX, s)
        s = tl.where((amax == 0.0) | ~(tl.abs(amax) <= _FLT_MAX), 1.0, s)

        # tile amax without NaNs: [BLOCK_M, HALF] -> [MT, TILE_ROWS, NB, 8] -> [MT, NB]; a block of
        # only NaNs gets 0 from the last max
        pair_amax = tl.reshape(max_drop_nan(tl.abs(x0), tl.abs(x1)), (MT, TILE_ROWS, NB, 8))
        tile_amax = tl.reduce(tl.reduce(pair_amax, 3, max_drop_nan), 1, max_drop_nan)
        tile_amax = max_drop_nan(tile_amax, tl.zeros_like(tile_amax))  # [MT, NB]
        target = tl.div_rn(tile_amax, tl.full(tile_amax.shape, 6.0, tl.float32)) * s
        bs = round_to_e4m3(target)                                     # [MT, NB] fp32
        bs_byte = fp32_to_fp8_bits(target, True)                       # [MT, NB]
        f = tl.div_rn(tl.zeros_like(bs) + s, bs)
        f = tl.where(f > _FLT_MAX, _FLT_MAX, f)
        f = tl.where(bs == 0.0, 0.0, f)

        # every row of a tile gets the tile's scale; every element of a block its factor
        scale_rows = tl.reshape(tl.broadcast_to(bs_byte[:, None, :], (MT, TILE_ROWS, NB)),
                                (BLOCK_M, NB))
        kblocks = pid_k * NB + tl.arange(0, NB)                        # [NB]
        tl.store(scale_ptr + rows[:, None] * (K // 16) + kblocks[None, :], scale_rows.to(tl.uint8),
                 mask=row_ok[:, None] & (kblocks[None, :] < K // 16))
        f_elems = tl.reshape(tl.broadcast_to(f[:, None, :, None], (MT, TILE_ROWS, NB, 8)),
                             (BLOCK_M, HALF))

        if STOCHASTIC:
            r = tl.load(rand_ptr + rows[:, None] * K + all_cols[None, :],
                        mask=row_ok[:, None] & (all_cols[None, :] < K), other=0.0)
            r0, r1 = tl.split(tl.reshape(r, (BLOCK_M, HALF, 2)))
        else:
            r0 = x0
            r1 = x1
        c0 = _e2m1_codes(x0, f_elems, r0, STOCHASTIC)
        c1 = _e2m1_codes(x1, f_elems, r1, STOCHASTIC)
        byte = (c0 | (c1 << 4)).to(tl.uint8)
        tl.store(data_ptr + rows[:, None] * (K // 2) + pairs[None, :], byte, mask=mask)


def nvfp4_quantize_triton(x: torch.Tensor, global_amax: torch.Tensor, *, tile_rows: int,
                          rand: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``_nvfp4_quantize_kernel``; same contract as the reference. Takes CPU tensors too
    under ``TRITON_INTERPRET=1`` (the tests run it that way)."""
    require_triton("nvfp4_quantize_triton")
    _check_args(x, global_amax, tile_rows, rand)
    if global_amax.numel() != 1:
        raise ValueError(f"nvfp4_quantize_triton takes one tensor amax (fp32 [1]), got {tuple(global_amax.shape)}; "
                         f"nvfp4_quantize runs the reference for several")
    m, k = x.shape
    amax = global_amax.detach().to(torch.float32).reshape(1).contiguous()
    # without stochastic rounding the kernel never reads rand_ptr; any tensor fills the slot
    rand_arg = rand.contiguous() if rand is not None else amax
    data, scale = launch_row_tiles(
        _nvfp4_quantize_kernel,
        x,
        [((m, k // 2), torch.uint8),               # data: packed E2M1 codes
         ((m, k // NVFP4_BLOCK), torch.uint8)],    # scale: e4m3 bytes of the block scales
        [amax, rand_arg],
        block_m=_BLOCK_M,
        block_k=_BLOCK_K,
        TILE_ROWS=tile_rows,
        STOCHASTIC=rand is not None,
    )
    return data, scale


@torch.library.custom_op("te_compile::nvfp4_quantize_cpu", mutates_args=(), device_types="cpu")
def _nvfp4_quantize_cpu(x: torch.Tensor, global_amax: torch.Tensor, tile_rows: int,
                        rand: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference as one opaque op on CPU (see ``nvfp4_quantize``), outputs contiguous as its fake says."""
    data, scale = nvfp4_quantize_reference(x, global_amax, tile_rows=tile_rows, rand=rand)
    return data.contiguous(), scale.contiguous()


@_nvfp4_quantize_cpu.register_fake
def _(x, global_amax, tile_rows, rand):
    m, k = x.shape
    return x.new_empty((m, k // 2), dtype=torch.uint8), x.new_empty((m, k // NVFP4_BLOCK), dtype=torch.uint8)


def nvfp4_quantize(x: torch.Tensor, global_amax: torch.Tensor, *, tile_rows: int,
                   rand: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize x [M, K] with the tensor amax ``global_amax`` ([1], or one per row tile or
    column of blocks: the module docstring): the Triton kernel for CUDA tensors when Triton is
    present and the amax is one, the plain-torch reference otherwise. ``rand`` (fp32 [M, K]
    uniform [0, 1)) selects stochastic rounding. Returns (data uint8 [M, K // 2], scale uint8
    [M, K // 16]).

    On CPU the reference runs as one opaque op (``te_compile::nvfp4_quantize_cpu``): a compiled graph
    calls it rather than have inductor generate and compile C++ for its ~40 ops at every call site,
    which made most of an NVFP4 model's compile time. Elsewhere torch.compile traces the
    reference and inductor fuses it."""
    if use_triton(x) and global_amax.numel() == 1:
        return nvfp4_quantize_triton(x, global_amax, tile_rows=tile_rows, rand=rand)
    if x.device.type == "cpu":
        _check_args(x, global_amax, tile_rows, rand)   # the op's errors would name the op, not the argument
        return _nvfp4_quantize_cpu(x.detach(), global_amax.detach(), tile_rows, rand)
    return nvfp4_quantize_reference(x, global_amax, tile_rows=tile_rows, rand=rand)
