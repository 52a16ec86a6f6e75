"""A reference NVFP4 recipe written from scratch in plain torch.

NVFP4 (DESIGN.md §5): E2M1 elements (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) with one e4m3 scale per
16 elements (1x16 blocks, or 16x16 tiles for weights) under a global fp32 scale S = 448 * 6 / amax.
Use it with ``te_compile.recipe.CustomRecipe(qfactory=nvfp4_ref_quantizer_factory)``.

It deliberately shares no numerics with the built-in ``te_compile.kernels.nvfp4_quantize``: every
fp32 operation is done in float64 and rounded once to fp32 (for +, *, / of fp32 operands that equals
the correctly rounded fp32 result), and both roundings - to e4m3 and to E2M1 - are nearest-neighbour
searches over an explicit table of the representable values with ties to the even code. Only the
random Hadamard transform is shared (``te_compile.tensor.rht.apply_rht``): the wgrad copy must use
the same signs and the same fp32 matmul for the two to agree bit for bit. Conventions (as the
built-in): sign bits copy x's sign bit (-0 -> code 8); NaN elements are left out of block amaxes and
encode as code 7 with x's sign; a NaN/0/inf tensor amax gives S = 1.

Buffers of ``NVFP4TensorRef`` for a logical tensor flattened to x2d [M, K]:
    rowwise_data uint8 [M, K // 2] (element 2j in the low nibble), rowwise_scale uint8 [M, K // 16]
    (e4m3 bytes; with 16x16 tiles every row of a tile holds the tile's scale), amax_rowwise fp32 [1];
    columnwise_*: the same for xt = x2d.t() [K, M] (RHT'd along M when ``with_rht``), amax_columnwise
    = max|xt|.
Stochastic rounding draws ``torch.rand`` from torch's default generator: [M, K] for the rowwise copy
first, then [K, M] for the columnwise copy (only for the copies that are made).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from te_compile.recipe import GRADIENT_ROLES, ROLES
from te_compile.tensor.quantized_tensor import QuantizedTensorStorage, Quantizer
from te_compile.tensor.rht import apply_rht, undo_rht

__all__ = [
    "nvfp4_ref_quantizer_factory",
    "NVFP4QuantizerRef",
    "NVFP4TensorRef",
]

_FLT_MAX = torch.finfo(torch.float32).max
_BLOCK = 16
# E2M1 magnitudes, index = code & 7
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3_values() -> tuple[float, ...]:
    """The 127 non-negative finite e4m3fn values, index = byte (0x00..0x7E), ascending."""
    values = []
    for code in range(127):
        exponent, mantissa = code >> 3, code & 7
        if exponent == 0:
            values.append(math.ldexp(mantissa, -9))  # subnormal: m * 2^-6 / 8
        else:
            values.append(math.ldexp(1.0 + mantissa / 8.0, exponent - 7))
    return tuple(values)


# Python floats, made into a tensor where used: a module-level tensor would be a real tensor inside
# torch.compile's fake-tensor tracing, which refuses to mix the two.
_E4M3_VALUES = _e4m3_values()


def _f32(t: torch.Tensor) -> torch.Tensor:
    """Round a float64 tensor once to fp32 and come back to float64 (exact)."""
    return t.to(torch.float32).to(torch.float64)


def _nearest_even(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the value of ``grid`` (ascending, float64) nearest to ``a`` (float64 >= 0, no NaN);
    a tie goes to the even index (= the even code); beyond the last value, the last index."""
    hi = torch.searchsorted(grid, a.contiguous()).clamp(max=grid.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo = a - grid[lo]
    d_hi = grid[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(take_hi, hi, lo)


def _global_scale(amax32: torch.Tensor) -> torch.Tensor:
    """S = 2688 / amax as float64 holding an fp32 value; amax 0, inf, NaN -> 1; inf -> FLT_MAX."""
    amax = amax32.to(torch.float64)
    scale = _f32(2688.0 / amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FLT_MAX), scale)
    return torch.where((amax == 0) | amax.isnan() | amax.isinf(), torch.ones_like(scale), scale)


def _quantize_2d(x2d: torch.Tensor, amax32: torch.Tensor, tile_rows: int,
                 rand: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """x2d [M, K] -> (packed codes uint8 [M, K // 2], e4m3 scale bytes uint8 [M, K // 16])."""
    m, k = x2d.shape
    device = x2d.device
    x64 = x2d.detach().to(torch.float64)
    s = _global_scale(amax32.to(device))
    # block amax over 1x16 blocks [M, K/16], NaNs left out
    block_amax = torch.where(x64.isnan(), torch.zeros_like(x64), x64.abs())
    block_amax = block_amax.reshape(m, k // _BLOCK, _BLOCK).max(dim=2).values
    if tile_rows > 1:
        pad = (-m) % tile_rows
        padded = torch.cat([block_amax, block_amax.new_zeros(pad, k // _BLOCK)])
        tiles = padded.reshape(-1, tile_rows, k // _BLOCK).max(dim=1).values
        block_amax = tiles.repeat_interleave(tile_rows, dim=0)[:m]
    # bs = e4m3((amax / 6) * S), each step rounded to fp32, saturating at 448
    target = _f32(_f32(block_amax / 6.0) * s).clamp(max=448.0)
    e4m3 = torch.tensor(_E4M3_VALUES, dtype=torch.float64, device=device)
    bs_code = _nearest_even(target, e4m3)
    bs = e4m3[bs_code]
    factor = _f32(s / bs)
    factor = torch.where(torch.isinf(factor), torch.full_like(factor, _FLT_MAX), factor)
    factor = torch.where(bs == 0, torch.zeros_like(factor), factor)
    v = _f32(x64.reshape(m, k // _BLOCK, _BLOCK) * factor[:, :, None]).reshape(m, k)
    a = v.abs().clamp(max=6.0)
    a = torch.where(a.isnan(), torch.zeros_like(a), a).contiguous()
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float64, device=device)
    if rand is None:
        mag = _nearest_even(a, grid)
    else:
        lo = torch.searchsorted(grid, a, right=True) - 1
        hi = (lo + 1).clamp(max=grid.numel() - 1)
        gap = grid[hi] - grid[lo]
        p = torch.where(gap > 0, (a - grid[lo]) / torch.where(gap > 0, gap, torch.ones_like(gap)),
                        torch.zeros_like(a))
        mag = torch.where(rand.to(device=device, dtype=torch.float64) < p, hi, lo)
    mag = torch.where(v.isnan(), torch.full_like(mag, 7), mag)
    codes = mag + 8 * torch.signbit(x64).to(mag.dtype)
    data = (codes[:, 0::2] + 16 * codes[:, 1::2]).to(torch.uint8)
    return data, bs_code.to(torch.uint8)


def _dequantize_2d(data: torch.Tensor, scale: torch.Tensor, amax32: torch.Tensor) -> torch.Tensor:
    """(e2m1(code) * bs) / S as fp32 [M, K] (the product is exact; one rounding of the quotient)."""
    m = data.shape[0]
    codes = torch.empty(m, data.shape[1] * 2, dtype=torch.int64, device=data.device)
    codes[:, 0::2] = (data % 16).to(torch.int64)
    codes[:, 1::2] = (data // 16).to(torch.int64)
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float64, device=data.device)
    values = grid[codes % 8] * torch.where(codes >= 8, -1.0, 1.0).to(torch.float64)
    e4m3 = torch.tensor(_E4M3_VALUES, dtype=torch.float64, device=data.device)
    bs = e4m3[scale.to(torch.int64)].repeat_interleave(_BLOCK, dim=1)
    return (values * bs / _global_scale(amax32.to(data.device))).to(torch.float32)


def nvfp4_ref_quantizer_factory(role: str) -> "NVFP4QuantizerRef":
    """TE's NVFP4BlockScaling defaults: weights 16x16 tiles; inputs and gradients RHT on the wgrad
    (columnwise) copy; gradients stochastic rounding; outputs plain 1x16."""
    if role == "input":
        return NVFP4QuantizerRef(with_rht=True)
    if role == "weight":
        return NVFP4QuantizerRef(with_2d_quantization=True)
    if role in GRADIENT_ROLES:
        return NVFP4QuantizerRef(with_rht=True, stochastic_rounding=True)
    if role == "output":
        return NVFP4QuantizerRef()
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


class NVFP4TensorRef(QuantizedTensorStorage):
    """Packed E2M1 codes with e4m3 block scales and fp32 [1] tensor amaxes, rowwise and/or
    columnwise (see the module docstring for the layouts)."""

    custom = True

    def __init__(self, rowwise_data, rowwise_scale, amax_rowwise, columnwise_data, columnwise_scale,
                 amax_columnwise, dtype: torch.dtype, shape: torch.Size, *, with_rht: bool = False):
        self.rowwise_data = rowwise_data
        self.rowwise_scale = rowwise_scale
        self.amax_rowwise = amax_rowwise
        self.columnwise_data = columnwise_data
        self.columnwise_scale = columnwise_scale
        self.amax_columnwise = amax_columnwise
        self.dtype = dtype
        self.shape = torch.Size(shape)
        # the columnwise copy holds RHT'd values (undone by dequantize)
        self.with_rht = bool(with_rht)

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if self.rowwise_data is not None:
            out = _dequantize_2d(self.rowwise_data, self.rowwise_scale, self.amax_rowwise)
        elif self.columnwise_data is not None:
            out_t = _dequantize_2d(self.columnwise_data, self.columnwise_scale, self.amax_columnwise)
            if self.with_rht:
                out_t = undo_rht(out_t)
            out = out_t.t()
        else:
            raise RuntimeError("NVFP4TensorRef.dequantize: neither the rowwise nor the columnwise "
                               "copy exists")
        return out.reshape(self.shape).to(dtype or self.dtype)

    def update_usage(self, rowwise_usage=None, columnwise_usage=None):
        # A copy cannot be rebuilt from the other one (different blocks, RHT): re-quantize instead.
        if rowwise_usage and self.rowwise_data is None:
            raise RuntimeError("NVFP4TensorRef: rowwise usage requested but the rowwise copy is absent")
        if columnwise_usage and self.columnwise_data is None:
            raise RuntimeError("NVFP4TensorRef: columnwise usage requested but the columnwise copy "
                               "is absent")
        if rowwise_usage is False:
            self.rowwise_data = self.rowwise_scale = None
        if columnwise_usage is False:
            self.columnwise_data = self.columnwise_scale = None
        return self

    def prepare_for_saving(self):
        tensors = [self.rowwise_data, self.rowwise_scale, self.amax_rowwise,
                   self.columnwise_data, self.columnwise_scale, self.amax_columnwise]
        self.clear()
        self.amax_rowwise = self.amax_columnwise = None
        return tensors, self

    def restore_from_saved(self, tensors):
        (self.rowwise_data, self.rowwise_scale, self.amax_rowwise,
         self.columnwise_data, self.columnwise_scale, self.amax_columnwise) = tensors[:6]
        return list(tensors[6:])

    def clear(self) -> None:
        self.rowwise_data = self.rowwise_scale = None
        self.columnwise_data = self.columnwise_scale = None

    def get_metadata(self) -> dict:
        return {"rowwise_data": self.rowwise_data, "rowwise_scale": self.rowwise_scale,
                "amax_rowwise": self.amax_rowwise, "columnwise_data": self.columnwise_data,
                "columnwise_scale": self.columnwise_scale, "amax_columnwise": self.amax_columnwise,
                "dtype": self.dtype, "shape": self.shape, "with_rht": self.with_rht}


class NVFP4QuantizerRef(Quantizer):
    """NVFP4 with the tensor's own amax (current scaling): 1x16 blocks or 16x16 tiles
    (``with_2d_quantization``), optional RHT of the columnwise copy and stochastic rounding."""

    custom = True

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True, with_rht: bool = False,
                 stochastic_rounding: bool = False, with_2d_quantization: bool = False) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        flags = {"with_rht": with_rht, "stochastic_rounding": stochastic_rounding,
                 "with_2d_quantization": with_2d_quantization}
        for name, value in flags.items():
            if not isinstance(value, bool):   # a typo'd option value must not pass as truthy
                raise ValueError(f"NVFP4QuantizerRef: {name} must be a bool, got {value!r}")
            setattr(self, name, value)

    def _check_shape(self, shape) -> tuple[int, int]:
        shape = tuple(shape)
        if len(shape) < 1 or shape[-1] % _BLOCK != 0:
            raise ValueError(f"NVFP4: the last dim must be a multiple of {_BLOCK}, got shape {shape}")
        m = math.prod(shape[:-1])
        if self.columnwise_usage and m % _BLOCK != 0:
            raise ValueError(f"NVFP4 columnwise copy: the flattened leading dims ({m}) must be a "
                             f"multiple of {_BLOCK}, got shape {shape}")
        return m, shape[-1]

    @staticmethod
    def _amax(t: torch.Tensor) -> torch.Tensor:
        """max|t| as fp32 [1] (NaN if t holds one; 0 when empty), computed in float64."""
        if t.numel() == 0:
            return torch.zeros(1, dtype=torch.float32, device=t.device)
        return t.detach().to(torch.float64).abs().max().reshape(1).to(torch.float32)

    def _quantize(self, x: torch.Tensor) -> NVFP4TensorRef:
        m, k = self._check_shape(x.shape)
        x2d = x.reshape(m, k)
        tile_rows = _BLOCK if self.with_2d_quantization else 1
        sr = self.stochastic_rounding
        row_data = row_scale = col_data = col_scale = None
        amax_row = self._amax(x2d)
        amax_col = None
        if self.rowwise_usage:
            rand = torch.rand((m, k), device=x.device, dtype=torch.float32) if sr else None
            row_data, row_scale = _quantize_2d(x2d, amax_row, tile_rows, rand)
        if self.columnwise_usage:
            xt = apply_rht(x2d.t()) if self.with_rht else x2d.t()
            amax_col = self._amax(xt)
            rand = torch.rand((k, m), device=x.device, dtype=torch.float32) if sr else None
            col_data, col_scale = _quantize_2d(xt, amax_col, tile_rows, rand)
        return NVFP4TensorRef(row_data, row_scale, amax_row, col_data, col_scale, amax_col,
                              x.dtype, x.shape, with_rht=self.with_rht)

    def update_quantized(self, src, dst, *, noop_flag=None):
        if noop_flag is not None and bool(noop_flag.item()):
            return dst
        new = self._quantize(src)
        for name in ("rowwise_data", "rowwise_scale", "amax_rowwise", "columnwise_data",
                     "columnwise_scale", "amax_columnwise", "with_rht"):
            setattr(dst, name, getattr(new, name))
        return dst

    def make_empty(self, shape, *, dtype=torch.float32, device=None, requires_grad=False):
        m, k = self._check_shape(shape)
        row_data = row_scale = col_data = col_scale = None
        if self.rowwise_usage:
            row_data = torch.empty((m, k // 2), dtype=torch.uint8, device=device)
            row_scale = torch.empty((m, k // _BLOCK), dtype=torch.uint8, device=device)
        if self.columnwise_usage:
            col_data = torch.empty((k, m // 2), dtype=torch.uint8, device=device)
            col_scale = torch.empty((k, m // _BLOCK), dtype=torch.uint8, device=device)
        zero = torch.zeros(1, dtype=torch.float32, device=device)
        return NVFP4TensorRef(row_data, row_scale, zero, col_data, col_scale, zero.clone(), dtype,
                              torch.Size(shape), with_rht=self.with_rht)

    def qgemm(self, a: NVFP4TensorRef, b: NVFP4TensorRef, *, out_dtype: torch.dtype = torch.float32,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """a @ b.T in fp32 from dequantized operands (a: [..., K], b: [N, K]), as in a linear layer."""
        out = a.dequantize(dtype=torch.float32) @ b.dequantize(dtype=torch.float32).t()
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(out_dtype)
