"""MXFP8 quantization: blocks of 32 along the last dim, one shared E8M0 exponent per block (DESIGN.md §5).

Per block of 32 consecutive elements of a row (the last block of a row may be partial):
    amax  = max|x| in fp32 (NaN counts as inf)
    val   = amax / fp8_max (fp32 true division)
    code  = the biased fp32 exponent of val, rounded UP unless val is an exact power of two, so that
            |x| * 2^(127 - code) <= fp8_max and nothing clips (TransformerEngine's float_to_e8m0 rule);
            amax 0 -> code 0; amax inf/NaN -> code 255 (E8M0 NaN) and the whole block becomes fp8 NaN
    data  = saturating round-to-nearest-even fp8 cast of x * 2^(127 - code)
Code c stands for scale_inv = 2^(c - 127): dequantize is ``fp8 value * 2^(c - 127)``.

The exponent comes from bit operations on val: torch's ``.to(torch.float8_e8m0fnu)`` rounds to the
nearest power of two, which would clip blocks whose amax sits just above a power of two times fp8_max.
Only rowwise blocks live here; a columnwise copy is ``mxfp8_quantize(x.t().contiguous())`` transposed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._fp_bits import HAS_TRITON, use_triton
from ._launch import INPUT_DTYPES, check_input, launch_row_tiles, require_triton
from ..scaling import fp8_max

__all__ = ["MXFP8_BLOCK", "mxfp8_quantize", "mxfp8_quantize_reference", "mxfp8_quantize_triton",
           "mxfp8_block_amax", "mxfp8_codes", "mxfp8_cast"]

MXFP8_BLOCK = 32

# Byte of a block whose amax is inf or NaN: the positive NaN of e4m3fn (0x7F) and of e5m2 (0x7F, a
# quiet NaN), what torch and the GPU's saturating cast give for a positive NaN.
_FP8_NAN = 0x7F

# Tile of the Triton kernel: [_BLOCK_M rows, _BLOCK_K columns] = _BLOCK_K // 32 scale blocks per row.
_BLOCK_M = 32
_BLOCK_K = 128

# x's dtypes: the kernels' three, and float64, which this quantizer has always accepted; both paths
# narrow x to fp32 before anything else
_X_DTYPES = (*INPUT_DTYPES, torch.float64)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from te_compile.kernels._fp_bits import fp8_bits_no_nan, nan_max

    @triton.jit
    def _mxfp8_quantize_kernel(
        x_ptr,  # [M, K] fp32 / bf16 / fp16, row stride stride_xm, unit column stride
        data_ptr,  # [M, K] uint8 out: fp8 bytes, contiguous
        scale_ptr,  # [M, n_blocks] uint8 out: E8M0 codes, contiguous
        M,  # rows of x
        K,  # columns of x
        stride_xm,  # elements between rows of x
        n_blocks,  # ceil(K / 32)
        FP8_MAX: tl.constexpr,
        FP8_NAN: tl.constexpr,
        IS_E4M3: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        MX_BLOCK: tl.constexpr,
    ):
        BLOCKS_PER_TILE: tl.constexpr = BLOCK_K // MX_BLOCK
        # int64: row * stride reaches past 2^31 for large activations
        pid_m = tl.program_id(0).to(tl.int64)
        pid_k = tl.program_id(1).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask = (rows[:, None] < M) & (cols[None, :] < K)  # [BLOCK_M, BLOCK_K]
        # zeros outside the tensor leave a ragged last block's amax unchanged
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        x = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCKS_PER_TILE, MX_BLOCK))

        # a NaN amax (nan_max keeps it, where tl.max would drop it) gives code 255, as an inf one does
        amax = tl.reduce(tl.abs(x), 2, nan_max)  # [BLOCK_M, BLOCKS_PER_TILE]
        # IEEE round-to-nearest division: plain `/` on fp32 compiles to an approximate divide on GPUs
        val = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
        bits = val.to(tl.int32, bitcast=True)
        exp = (bits >> 23) & 0xFF
        man = bits & 0x7FFFFF
        # round the exponent up unless val is a power of two; 254 never rounds into 255 (NaN);
        # a subnormal val <= 2^-127 keeps code 0 (the smallest scale).
        round_up = (man > 0) & (exp != 0xFE) & ~((exp == 0) & (man <= 0x400000))
        code = tl.where(exp == 0xFF, 255, exp + round_up.to(tl.int32))  # [BLOCK_M, BLOCKS_PER_TILE]

        # 2^(127 - code) from its exponent bits: exact for codes 0..253 (finite amaxes give <= 247);
        # code 255 gives -inf and its bytes are replaced below
        inv_scale = ((254 - code) << 23).to(tl.float32, bitcast=True)
        q = fp8_bits_no_nan(x * inv_scale[:, :, None], IS_E4M3)  # [BLOCK_M, BLOCKS_PER_TILE, MX_BLOCK]
        data_ptrs = data_ptr + rows[:, None] * K + cols[None, :]
        tl.store(data_ptrs, tl.reshape(q, (BLOCK_M, BLOCK_K)).to(tl.uint8), mask=mask)
        if tl.max(tl.max(code, axis=1), axis=0) == 255:
            # rare: a tile with an inf or NaN block stores that block's bytes again as NaN. A select on
            # every tile's bytes instead would unpack the conversion's byte pairs (+40% instructions).
            nan_block = tl.reshape(tl.broadcast_to((code == 255)[:, :, None], (BLOCK_M, BLOCKS_PER_TILE, MX_BLOCK)),
                                   (BLOCK_M, BLOCK_K))
            tl.store(data_ptrs, tl.full((BLOCK_M, BLOCK_K), FP8_NAN, tl.uint8), mask=mask & nan_block)

        sblocks = pid_k * BLOCKS_PER_TILE + tl.arange(0, BLOCKS_PER_TILE)  # [BLOCKS_PER_TILE]
        smask = (rows[:, None] < M) & (sblocks[None, :] < n_blocks)
        tl.store(scale_ptr + rows[:, None] * n_blocks + sblocks[None, :], code.to(tl.uint8), mask=smask)


def _validate(x: torch.Tensor, fp8_dtype: torch.dtype) -> float:
    """fp8_max of ``fp8_dtype`` after checking the arguments."""
    limit = fp8_max(fp8_dtype)  # validates the dtype, naming the allowed ones
    check_input(x, _X_DTYPES)
    return limit


def mxfp8_block_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 [M, ceil(K/32)] amax of each 1x32 block of x: [M, K] (NaN counts as inf)."""
    m, k = x.shape
    n_blocks = -(-k // MXFP8_BLOCK)
    # padded: [M, n_blocks, 32]; the zero padding of a ragged last block does not change its amax
    padded = F.pad(x.to(torch.float32), (0, n_blocks * MXFP8_BLOCK - k)).reshape(m, n_blocks, MXFP8_BLOCK)
    mag = padded.abs()
    return torch.where(torch.isnan(mag), torch.full_like(mag, float("inf")), mag).amax(dim=-1)


def mxfp8_codes(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """int32 E8M0 codes (the module docstring's rule) of blocks with fp32 ``amax`` (any shape)."""
    limit = fp8_max(fp8_dtype)
    # true IEEE division (a Python scalar divisor may become a reciprocal multiply, DESIGN.md §6)
    val = torch.div(amax, torch.full_like(amax, limit))
    bits = val.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    round_up = (man > 0) & (exp != 0xFE) & ~((exp == 0) & (man <= 0x400000))
    return torch.where(exp == 0xFF, torch.full_like(exp, 255), exp + round_up.to(torch.int32))


def mxfp8_cast(x: torch.Tensor, code: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """uint8 fp8 bytes [M, K] of x: [M, K] scaled by the int32 codes [M, ceil(K/32)] of its blocks."""
    limit = fp8_max(fp8_dtype)
    k = x.shape[1]
    inv_scale = ((254 - code) << 23).view(torch.float32)  # 2^(127 - code); garbage for code 255
    # per-element [M, K] block values by gather. Expanding to [M, n_blocks * 32] and slicing to K
    # instead miscompiles in inductor (torch 2.13 CPU leaves the ragged tail of the output unwritten).
    block_of_col = torch.arange(k, device=x.device) // MXFP8_BLOCK  # [K]
    inv_scale = inv_scale[:, block_of_col]
    nan_block = (code == 255)[:, block_of_col]
    data = (x.to(torch.float32) * inv_scale).clamp(-limit, limit).to(fp8_dtype).view(torch.uint8)
    # NaN blocks get the positive NaN byte directly: a NaN's sign does not survive inductor's clamp+cast
    return torch.where(nan_block, torch.full_like(data, _FP8_NAN), data)


def mxfp8_quantize_reference(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch MXFP8 quantize of x: [M, K] -> (data: uint8 [M, K] fp8 bytes, scale: uint8
    [M, ceil(K/32)] E8M0 codes). Traceable (no host sync, no branches on values): compiled graphs run
    it. Its three steps are public so that a ZeRO shard can be cast with block amaxes all-reduced
    across ranks (te_compile.tensor.utils.cast_master_weights_to_fp8)."""
    _validate(x, fp8_dtype)
    code = mxfp8_codes(mxfp8_block_amax(x), fp8_dtype)
    return mxfp8_cast(x, code, fp8_dtype), code.to(torch.uint8)


def mxfp8_quantize_triton(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher with the reference's signature; CPU tensors work under TRITON_INTERPRET=1."""
    require_triton("mxfp8_quantize_triton")
    limit = _validate(x, fp8_dtype)
    m, k = x.shape
    n_blocks = -(-k // MXFP8_BLOCK)
    data, scale = launch_row_tiles(
        _mxfp8_quantize_kernel,
        x,
        [((m, k), torch.uint8),          # data: fp8 bytes
         ((m, n_blocks), torch.uint8)],  # scale: E8M0 codes
        [n_blocks],
        block_m=_BLOCK_M,
        block_k=_BLOCK_K,
        FP8_MAX=limit,
        FP8_NAN=_FP8_NAN,
        IS_E4M3=fp8_dtype == torch.float8_e4m3fn,
        MX_BLOCK=MXFP8_BLOCK,
    )
    return data, scale


def mxfp8_quantize(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantize x: [M, K] -> (uint8 fp8 bytes [M, K], uint8 E8M0 codes [M, ceil(K/32)]):
    the Triton kernel for CUDA tensors when triton is installed, the reference otherwise (on CPU as
    one opaque op, for compile time: see ``nvfp4_quantize``)."""
    if use_triton(x):
        return mxfp8_quantize_triton(x, fp8_dtype)
    if x.device.type == "cpu":
        _validate(x, fp8_dtype)
        return _mxfp8_quantize_cpu(x.detach(), fp8_dtype)
    return mxfp8_quantize_reference(x, fp8_dtype)


@torch.library.custom_op("te_compile::mxfp8_quantize_cpu", mutates_args=(), device_types="cpu")
def _mxfp8_quantize_cpu(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference as one opaque op on CPU (see ``mxfp8_quantize``), outputs contiguous as its fake says."""
    data, scale = mxfp8_quantize_reference(x, fp8_dtype)
    return data.contiguous(), scale.contiguous()


@_mxfp8_quantize_cpu.register_fake
def _(x, fp8_dtype):
    m, k = x.shape
    return x.new_empty((m, k), dtype=torch.uint8), x.new_empty((m, -(-k // MXFP8_BLOCK)), dtype=torch.uint8)
