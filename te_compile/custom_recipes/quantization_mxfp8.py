"""A reference MXFP8 recipe written from scratch in plain torch.

MXFP8 (OCP MX, as TransformerEngine implements it): blocks of 32 consecutive elements share one E8M0
exponent code c (scale_inv = 2^(c - 127)), chosen as ceil(log2(amax / fp8_max)) so that nothing clips;
elements are the saturating fp8 cast of x * 2^(127 - c). Use it with
``te_compile.recipe.CustomRecipe(qfactory=mxfp8_ref_quantizer_factory)``.

It deliberately shares no code with ``te_compile.kernels.mxfp8_quantize``: the exponent comes from
``torch.frexp`` of the fp32 quotient (obtained by a float64 division rounded once, which is the correctly
rounded fp32 quotient) with an explicit "round up unless an exact power of two" rule and a clamp to the
code range, and elements are scaled in float64. Tests use it as an independent reference: both must
agree bit for bit.

Buffers are uint8 and the logical tensor (any rank >= 1) is seen as 2-D [M, K] = [prod(shape[:-1]),
shape[-1]]:
    rowwise_data     [M, K]              fp8 bytes, blocks of 32 along dim 1
    rowwise_scale    [M, ceil(K/32)]     E8M0 codes
    columnwise_data  [M, K]              fp8 bytes (same layout, not transposed), blocks of 32 along dim 0
    columnwise_scale [ceil(M/32), K]     E8M0 codes of each 32x1 column block
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from te_compile.recipe import ROLES
from te_compile.tensor.quantized_tensor import QuantizedTensorStorage, Quantizer

__all__ = [
    "mxfp8_ref_quantizer_factory",
    "MXFP8QuantizerRef",
    "MXFP8TensorRef",
]

_BLOCK = 32


def mxfp8_ref_quantizer_factory(role: str) -> "MXFP8QuantizerRef":
    """The default MXFP8BlockScaling recipe: E4M3 for every role, forward tensors and gradients alike."""
    if role in ROLES:
        return MXFP8QuantizerRef(torch.float8_e4m3fn)
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [prod(shape[:-1]), K]."""
    if x.dim() < 1:
        raise ValueError(f"MXFP8 needs a tensor of rank >= 1, got shape {tuple(x.shape)}")
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _block_codes(x64: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """E8M0 codes (int64 [M, ceil(K/32)]) of the 32-element blocks along dim 1 of x64 (float64 [M, K])."""
    m, k = x64.shape
    n_blocks = math.ceil(k / _BLOCK)
    codes = torch.empty((m, n_blocks), dtype=torch.int64, device=x64.device)
    for b in range(n_blocks):
        amax = x64[:, b * _BLOCK:(b + 1) * _BLOCK].abs().amax(dim=1)  # [M]; NaN propagates
        # amax / fp8_max in fp32: the float64 quotient rounded once is the correctly rounded fp32 one
        ratio = (amax / fp8_max).to(torch.float32).to(torch.float64)
        mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
        # ceil(log2(ratio)): exponent - 1 for an exact power of two (mantissa 0.5), exponent otherwise
        ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int64)
        # code 0 (2^-127) is the smallest scale; 254 is the largest finite one (255 means NaN)
        code = (ceil_log2 + 127).clamp(0, 254)
        code = torch.where(ratio == 0, torch.zeros_like(code), code)
        codes[:, b] = torch.where(torch.isfinite(ratio), code, torch.full_like(code, 255))
    return codes


def _powers_of_two(sign: int, device) -> torch.Tensor:
    """float64 [256]: entry c is 2^(sign * (c - 127)) for c in 0..254 (all exact), NaN for c = 255."""
    return torch.tensor([2.0 ** (sign * (c - 127)) for c in range(255)] + [math.nan],
                        dtype=torch.float64, device=device)


def _quantize_rows(x2d: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 bytes uint8 [M, K], codes uint8 [M, ceil(K/32)]) with blocks along dim 1."""
    fp8_max = torch.finfo(fp8_dtype).max
    x64 = x2d.detach().to(torch.float32).to(torch.float64)
    codes = _block_codes(x64, fp8_max)
    k = x64.shape[1]
    codes_per_col = codes.repeat_interleave(_BLOCK, dim=1)[:, :k]  # [M, K]
    # x * 2^(127 - c) is exact in float64 (24-bit mantissas, no overflow); NaN blocks stay NaN
    scaled = x64 * _powers_of_two(-1, x64.device)[codes_per_col]
    scaled = scaled.clamp(-fp8_max, fp8_max)
    scaled = torch.where(codes_per_col == 255, torch.full_like(scaled, math.nan), scaled)
    data = scaled.to(torch.float32).to(fp8_dtype).view(torch.uint8)
    return data, codes.to(torch.uint8)


def _dequantize_rows(data: torch.Tensor, codes: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """float64 [M, K] values of fp8 bytes [M, K] with codes [M, ceil(K/32)] along dim 1."""
    k = data.shape[1]
    codes_per_col = codes.to(torch.int64).repeat_interleave(_BLOCK, dim=1)[:, :k]
    return data.view(fp8_dtype).to(torch.float64) * _powers_of_two(1, data.device)[codes_per_col]


class MXFP8TensorRef(QuantizedTensorStorage):
    """uint8 fp8 bytes and E8M0 codes of an MXFP8 tensor (layouts in the module docstring)."""

    custom = True

    def __init__(self, rowwise_data, rowwise_scale, columnwise_data, columnwise_scale,
                 fp8_dtype: torch.dtype, dtype: torch.dtype, shape: torch.Size):
        self.rowwise_data = rowwise_data
        self.rowwise_scale = rowwise_scale
        self.columnwise_data = columnwise_data
        self.columnwise_scale = columnwise_scale
        self.fp8_dtype = fp8_dtype
        self.dtype = dtype
        self.shape = torch.Size(shape)

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if self.rowwise_data is not None:
            values = _dequantize_rows(self.rowwise_data, self.rowwise_scale, self.fp8_dtype)
        elif self.columnwise_data is not None:
            values = _dequantize_rows(self.columnwise_data.t(), self.columnwise_scale.t(), self.fp8_dtype).t()
        else:
            raise RuntimeError("MXFP8TensorRef.dequantize: neither the rowwise nor the columnwise copy "
                               "exists")
        return values.reshape(self.shape).to(dtype or self.dtype)

    def update_usage(self, rowwise_usage=None, columnwise_usage=None):
        # A copy can be dropped but not rebuilt: each is quantized from the high-precision values.
        for usage, name in ((rowwise_usage, "rowwise"), (columnwise_usage, "columnwise")):
            if usage and getattr(self, f"{name}_data") is None:
                raise RuntimeError(f"MXFP8TensorRef: the {name} copy was not quantized and cannot be "
                                   f"made from the other one; quantize with {name}=True")
        if rowwise_usage is False:
            self.rowwise_data = self.rowwise_scale = None
        if columnwise_usage is False:
            self.columnwise_data = self.columnwise_scale = None
        return self

    def prepare_for_saving(self):
        tensors = [self.rowwise_data, self.rowwise_scale, self.columnwise_data, self.columnwise_scale]
        self.rowwise_data = self.rowwise_scale = self.columnwise_data = self.columnwise_scale = None
        return tensors, self

    def restore_from_saved(self, tensors):
        self.rowwise_data, self.rowwise_scale, self.columnwise_data, self.columnwise_scale = tensors[:4]
        return list(tensors[4:])

    def clear(self) -> None:
        self.rowwise_data = self.rowwise_scale = self.columnwise_data = self.columnwise_scale = None

    def get_metadata(self) -> dict:
        return {"rowwise_data": self.rowwise_data, "rowwise_scale": self.rowwise_scale,
                "columnwise_data": self.columnwise_data, "columnwise_scale": self.columnwise_scale,
                "fp8_dtype": self.fp8_dtype, "dtype": self.dtype, "shape": self.shape}


class MXFP8QuantizerRef(Quantizer):
    """MXFP8 with 32-element blocks: rowwise blocks along the last dim, columnwise along the first."""

    custom = True

    def __init__(self, fp8_dtype: torch.dtype, *, rowwise: bool = True, columnwise: bool = True) -> None:
        if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.fp8_dtype = fp8_dtype

    def _quantize(self, x: torch.Tensor) -> MXFP8TensorRef:
        if not x.is_floating_point():
            raise ValueError(f"MXFP8 quantizes floating-point tensors, got {x.dtype}")
        x2d = _as_2d(x)
        rowwise_data = rowwise_scale = columnwise_data = columnwise_scale = None
        if self.rowwise_usage:
            rowwise_data, rowwise_scale = _quantize_rows(x2d, self.fp8_dtype)
        if self.columnwise_usage:
            data_t, scale_t = _quantize_rows(x2d.t(), self.fp8_dtype)
            columnwise_data, columnwise_scale = data_t.t().contiguous(), scale_t.t().contiguous()
        return MXFP8TensorRef(rowwise_data, rowwise_scale, columnwise_data, columnwise_scale,
                              self.fp8_dtype, x.dtype, x.shape)

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
            raise ValueError(f"MXFP8 needs a shape of rank >= 1, got {tuple(shape)}")
        k = shape[-1]
        m = math.prod(shape[:-1])
        rowwise_data = rowwise_scale = columnwise_data = columnwise_scale = None
        if self.rowwise_usage:
            rowwise_data = torch.empty((m, k), dtype=torch.uint8, device=device)
            rowwise_scale = torch.empty((m, math.ceil(k / _BLOCK)), dtype=torch.uint8, device=device)
        if self.columnwise_usage:
            columnwise_data = torch.empty((m, k), dtype=torch.uint8, device=device)
            columnwise_scale = torch.empty((math.ceil(m / _BLOCK), k), dtype=torch.uint8, device=device)
        return MXFP8TensorRef(rowwise_data, rowwise_scale, columnwise_data, columnwise_scale,
                              self.fp8_dtype, dtype, shape)
