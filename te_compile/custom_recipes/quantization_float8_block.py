"""A reference Float8 block-scaling recipe written from scratch in plain torch.

DeepSeek-style blocks as TransformerEngine's ``Float8BlockScaling``: one fp32 scale per 1x128 block
(``block_scaling_dim=1``: activations and gradients) or per 128x128 tile (``block_scaling_dim=2``:
weights), E4M3, power-of-two scales by default. Both the rowwise copy ([M, K], blocks along K) and
the columnwise copy (the transpose [K, M], blocks along M) are quantized from high precision. Use it
with ``te_compile.recipe.CustomRecipe(qfactory=float8_block_ref_quantizer_factory)``.

It deliberately shares no code with ``te_compile.kernels.float8_block_quantize``: tiles are visited
one at a time by slicing, the scale is computed in float64 and rounded once, the power-of-two rounding
uses frexp, and the product is formed in float64 and rounded once. Tests use it as an independent
reference: its buffers must equal the kernel's bit for bit.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from te_compile.recipe import ROLES
from te_compile.tensor.quantized_tensor import QuantizedTensorStorage, Quantizer

__all__ = [
    "float8_block_ref_quantizer_factory",
    "Float8BlockQuantizerRef",
    "Float8BlockTensorRef",
]

_BLOCK = 128
_FLT_MAX = torch.finfo(torch.float32).max


def float8_block_ref_quantizer_factory(role: str) -> "Float8BlockQuantizerRef":
    """E4M3 everywhere; 128x128 tiles for weights, 1x128 blocks for the other roles; pow2 scales."""
    if role == "weight":
        return Float8BlockQuantizerRef(torch.float8_e4m3fn, block_scaling_dim=2)
    if role in ROLES:
        return Float8BlockQuantizerRef(torch.float8_e4m3fn, block_scaling_dim=1)
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def _expand(scale_inv: torch.Tensor, tile_rows: int, shape: torch.Size) -> torch.Tensor:
    """A per-tile [Mt, Kt] tensor repeated over its tiles and cropped to ``shape`` [M, K]."""
    m, k = shape
    return scale_inv.repeat_interleave(tile_rows, dim=0)[:m].repeat_interleave(_BLOCK, dim=1)[:, :k]


def _dequantize_2d(data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: torch.dtype,
                   tile_rows: int) -> torch.Tensor:
    """fp32 values of uint8 fp8 bytes ``data`` [M, K] with per-tile ``scale_inv`` [Mt, Kt]."""
    return data.view(fp8_dtype).to(torch.float32) * _expand(scale_inv, tile_rows, data.shape)


class Float8BlockTensorRef(QuantizedTensorStorage):
    """Block-scaled fp8 buffers of one tensor of logical ``shape`` (rank >= 1), seen as 2-D
    [M = prod(shape[:-1]), K = shape[-1]]; t = 1 (block_scaling_dim 1) or 128 (dim 2):

    rowwise_data uint8 [M, K], rowwise_scale fp32 scale_inv [ceil(M/t), ceil(K/128)];
    columnwise_data uint8 [K, M] (the transpose, quantized from high precision),
    columnwise_scale fp32 scale_inv [ceil(K/t), ceil(M/128)]. An absent copy is None.
    """

    custom = True

    def __init__(self, rowwise_data, rowwise_scale, columnwise_data, columnwise_scale,
                 fp8_dtype: torch.dtype, block_scaling_dim: int, dtype: torch.dtype,
                 shape: Iterable[int]):
        self.rowwise_data = rowwise_data
        self.rowwise_scale = rowwise_scale
        self.columnwise_data = columnwise_data
        self.columnwise_scale = columnwise_scale
        self.fp8_dtype = fp8_dtype
        self.block_scaling_dim = block_scaling_dim
        self.dtype = dtype
        self.shape = torch.Size(shape)

    @property
    def tile_rows(self) -> int:
        return _BLOCK if self.block_scaling_dim == 2 else 1

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Values in the logical shape, from the rowwise copy if present, else the columnwise one."""
        if self.rowwise_data is not None:
            out = _dequantize_2d(self.rowwise_data, self.rowwise_scale, self.fp8_dtype, self.tile_rows)
        elif self.columnwise_data is not None:
            out = _dequantize_2d(self.columnwise_data, self.columnwise_scale, self.fp8_dtype,
                                 self.tile_rows).t()
        else:
            raise RuntimeError("Float8BlockTensorRef.dequantize: neither copy is present")
        return out.reshape(self.shape).to(dtype or self.dtype)

    def update_usage(self, rowwise_usage=None, columnwise_usage=None):
        """Drop copies, or make a missing one. 128x128 tiles of the transpose are the transposed
        tiles, so with block_scaling_dim 2 either copy is the other transposed; 1x128 blocks of the
        transpose cut across the original's blocks and need the high-precision tensor."""
        if rowwise_usage and self.rowwise_data is None:
            self.rowwise_data, self.rowwise_scale = self._transposed_copy(
                self.columnwise_data, self.columnwise_scale, "rowwise")
        if columnwise_usage and self.columnwise_data is None:
            self.columnwise_data, self.columnwise_scale = self._transposed_copy(
                self.rowwise_data, self.rowwise_scale, "columnwise")
        if rowwise_usage is False:
            self.rowwise_data = self.rowwise_scale = None
        if columnwise_usage is False:
            self.columnwise_data = self.columnwise_scale = None
        return self

    def _transposed_copy(self, data, scale_inv, wanted: str):
        if self.block_scaling_dim != 2 or data is None:
            raise RuntimeError(
                f"Float8BlockTensorRef: cannot make the {wanted} copy from the quantized data "
                f"(block_scaling_dim={self.block_scaling_dim}, other copy present: {data is not None}); "
                f"quantize the high-precision tensor with {wanted}=True instead"
            )
        return data.t().contiguous(), scale_inv.t().contiguous()

    def prepare_for_saving(self):
        tensors = [self.rowwise_data, self.rowwise_scale, self.columnwise_data, self.columnwise_scale]
        self.clear()
        return tensors, self

    def restore_from_saved(self, tensors):
        (self.rowwise_data, self.rowwise_scale,
         self.columnwise_data, self.columnwise_scale) = tensors[:4]
        return list(tensors[4:])

    def clear(self) -> None:
        self.rowwise_data = self.rowwise_scale = None
        self.columnwise_data = self.columnwise_scale = None

    def get_metadata(self) -> dict:
        return {"rowwise_data": self.rowwise_data, "rowwise_scale": self.rowwise_scale,
                "columnwise_data": self.columnwise_data, "columnwise_scale": self.columnwise_scale,
                "fp8_dtype": self.fp8_dtype, "block_scaling_dim": self.block_scaling_dim,
                "dtype": self.dtype, "shape": self.shape}


class Float8BlockQuantizerRef(Quantizer):
    """Per-tile current scaling: scale = fp8_max / max|tile| with TransformerEngine's edge rules."""

    custom = True

    def __init__(self, fp8_dtype: torch.dtype, *, rowwise: bool = True, columnwise: bool = True,
                 block_scaling_dim: int = 2, force_pow_2_scales: bool = True,
                 amax_epsilon: float = 0.0) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(
                f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
        if isinstance(block_scaling_dim, bool) or block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim must be 1 (1x128) or 2 (128x128), got {block_scaling_dim!r}")
        if (isinstance(amax_epsilon, bool) or not isinstance(amax_epsilon, (int, float))
                or not math.isfinite(amax_epsilon) or amax_epsilon < 0):
            raise ValueError(f"amax_epsilon must be a finite number >= 0, got {amax_epsilon!r}")
        self.dtype = fp8_dtype
        self.fp8_max = torch.finfo(fp8_dtype).max
        self.block_scaling_dim = block_scaling_dim
        self.force_pow_2_scales = force_pow_2_scales
        self.amax_epsilon = amax_epsilon

    @property
    def tile_rows(self) -> int:
        return _BLOCK if self.block_scaling_dim == 2 else 1

    def _tile_amax(self, x64: torch.Tensor) -> torch.Tensor:
        """fp64 [Mt, Kt] max|tile| of x64 [M, K], tile by tile (amax propagates NaN)."""
        m, k = x64.shape
        rows = range(0, m, self.tile_rows)
        cols = range(0, k, _BLOCK)
        amax = torch.zeros(len(rows), len(cols), dtype=torch.float64, device=x64.device)
        for j, c in enumerate(cols):
            block = x64[:, c:c + _BLOCK].abs()  # [M, <=128]
            if self.tile_rows == 1:
                amax[:, j] = block.amax(dim=1)
            else:
                for i, r in enumerate(rows):
                    amax[i, j] = block[r:r + _BLOCK].amax()
        return amax

    def compute_scale(self, amax64: torch.Tensor) -> torch.Tensor:
        """fp32 scales from fp64 amaxes (each an exact fp32 value)."""
        if self.amax_epsilon > 0:
            # the epsilon acts as an fp32 number, as in TransformerEngine's kernels
            eps = float(torch.tensor(self.amax_epsilon, dtype=torch.float32))
            amax64 = torch.where(amax64 < eps, torch.full_like(amax64, eps), amax64)
        # fp64 division rounded once to fp32 equals the correctly rounded fp32 quotient.
        scale = (self.fp8_max / amax64).to(torch.float32)
        scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FLT_MAX), scale)
        bad = (amax64 == 0) | torch.isnan(amax64) | torch.isinf(amax64)
        scale = torch.where(bad, torch.ones_like(scale), scale)
        if self.force_pow_2_scales:
            _, exponent = torch.frexp(scale)  # scale = m * 2**e with m in [0.5, 1)
            scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
        return scale

    def quantize_2d(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x2d [M, K] -> (uint8 fp8 bytes [M, K], fp32 scale_inv [ceil(M/t), ceil(K/128)])."""
        x64 = x2d.detach().to(torch.float64)
        scale = self.compute_scale(self._tile_amax(x64))
        # x * scale is exact in fp64 (two 24-bit mantissas); one rounding to fp32 follows
        scaled = (x64 * _expand(scale, self.tile_rows, x2d.shape).to(torch.float64)).to(torch.float32)
        data = scaled.clamp(-self.fp8_max, self.fp8_max).to(self.dtype).view(torch.uint8)
        scale_inv = (1.0 / scale.to(torch.float64)).to(torch.float32)
        return data, scale_inv

    def _quantize(self, x: torch.Tensor) -> Float8BlockTensorRef:
        if x.dim() < 1:
            raise ValueError(
                f"Float8BlockQuantizerRef needs a tensor of rank >= 1, got shape {tuple(x.shape)}")
        x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # [M, K]; -1 is ambiguous when K = 0
        row = self.quantize_2d(x2d) if self.rowwise_usage else (None, None)
        col = self.quantize_2d(x2d.t()) if self.columnwise_usage else (None, None)
        return Float8BlockTensorRef(*row, *col, self.dtype, self.block_scaling_dim, x.dtype, x.shape)

    def update_quantized(self, src, dst, *, noop_flag=None):
        if noop_flag is not None and bool(noop_flag.item()):
            return dst
        new = self._quantize(src)
        dst.rowwise_data, dst.rowwise_scale = new.rowwise_data, new.rowwise_scale
        dst.columnwise_data, dst.columnwise_scale = new.columnwise_data, new.columnwise_scale
        return dst

    def make_empty(self, shape, *, dtype=torch.float32, device=None, requires_grad=False):
        shape = torch.Size(shape)
        if len(shape) < 1:
            raise ValueError(f"Float8BlockQuantizerRef needs a shape of rank >= 1, got {tuple(shape)}")
        k = shape[-1]
        m = math.prod(shape[:-1])
        t = self.tile_rows

        def buffers(rows: int, cols: int):
            data = torch.empty(rows, cols, dtype=torch.uint8, device=device)
            scale_inv = torch.ones(-(-rows // t), -(-cols // _BLOCK), dtype=torch.float32, device=device)
            return data, scale_inv

        row = buffers(m, k) if self.rowwise_usage else (None, None)
        col = buffers(k, m) if self.columnwise_usage else (None, None)
        return Float8BlockTensorRef(*row, *col, self.dtype, self.block_scaling_dim, dtype, shape)

    def qgemm(self, a: Float8BlockTensorRef, b: Float8BlockTensorRef, *,
              out_dtype: torch.dtype = torch.float32, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """a @ b.T in fp32 from dequantized operands (a: [..., K], b: [N, K]), as in a linear layer."""
        out = a.dequantize(dtype=torch.float32) @ b.dequantize(dtype=torch.float32).t()
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(out_dtype)
