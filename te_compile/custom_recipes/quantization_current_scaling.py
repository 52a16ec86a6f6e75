"""A reference current-scaling recipe written from scratch in plain torch.

Copy this file to write a recipe of your own: a factory maps each role to a quantizer, the quantizer
returns a ``QuantizedTensorStorage``, and ``qgemm`` multiplies two of them. Use it with
``te_compile.recipe.CustomRecipe(qfactory=current_scaling_ref_quantizer_factory)``.

It deliberately shares no code with the built-in ``Float8CurrentScalingQuantizer`` (the scale is
computed in float64 and rounded once, the power-of-two rounding uses frexp), so tests can use it as
an independent reference: both must agree bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch

from te_compile.recipe import GRADIENT_ROLES, ROLES
from te_compile.tensor.quantized_tensor import QuantizedTensorStorage, Quantizer

__all__ = [
    "current_scaling_ref_quantizer_factory",
    "CurrentScalingQuantizerRef",
    "CurrentScalingTensorRef",
]

_FLT_MAX = torch.finfo(torch.float32).max


def current_scaling_ref_quantizer_factory(role: str) -> "CurrentScalingQuantizerRef":
    """HYBRID: E4M3 for forward tensors (input, weight, output), E5M2 for gradients."""
    if role in GRADIENT_ROLES:
        return CurrentScalingQuantizerRef(torch.float8_e5m2)
    if role in ROLES:
        return CurrentScalingQuantizerRef(torch.float8_e4m3fn)
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


class CurrentScalingTensorRef(QuantizedTensorStorage):
    """fp8 ``data`` ([..., K], torch fp8 dtype), optional ``data_t`` ([K, rows]) and fp32 [1] scales."""

    custom = True

    def __init__(self, data, data_t, scale, scale_inv, dtype: torch.dtype, shape: torch.Size):
        self.data = data
        self.data_t = data_t
        self.scale = scale
        self.scale_inv = scale_inv
        self.dtype = dtype
        self.shape = torch.Size(shape)

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if self.data is not None:
            data = self.data
        else:
            data = self.data_t.t().reshape(self.shape)
        return (data.to(torch.float32) * self.scale_inv).to(dtype or self.dtype)

    def update_usage(self, rowwise_usage=None, columnwise_usage=None):
        if columnwise_usage and self.data_t is None:
            self.data_t = self.data.reshape(-1, self.shape[-1]).t().contiguous()
        if columnwise_usage is False:
            self.data_t = None
        if rowwise_usage is False:
            self.data = None
        return self

    def prepare_for_saving(self):
        tensors = [self.data, self.data_t, self.scale, self.scale_inv]
        self.data = self.data_t = self.scale = self.scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors):
        self.data, self.data_t, self.scale, self.scale_inv = tensors[:4]
        return list(tensors[4:])

    def clear(self) -> None:
        self.data = self.data_t = None

    def get_metadata(self) -> dict:
        return {"data": self.data, "data_t": self.data_t, "scale": self.scale,
                "scale_inv": self.scale_inv, "dtype": self.dtype, "shape": self.shape}


class CurrentScalingQuantizerRef(Quantizer):
    """Per-tensor current scaling: scale = fp8_max / max|x| with TransformerEngine's edge rules."""

    custom = True

    def __init__(self, dtype: torch.dtype, *, rowwise: bool = True, columnwise: bool = True,
                 force_pow_2_scales: bool = False, amax_epsilon: float = 0.0) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = dtype
        self.fp8_max = torch.finfo(dtype).max
        self.force_pow_2_scales = force_pow_2_scales
        self.amax_epsilon = amax_epsilon

    def compute_scale(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.detach().abs().amax().to(torch.float64).reshape(1) if x.numel() else torch.zeros(
            1, dtype=torch.float64, device=x.device)
        amax = torch.clamp(amax, min=self.amax_epsilon)
        # fp64 division rounded once to fp32 equals the correctly rounded fp32 quotient.
        scale = (self.fp8_max / amax).to(torch.float32)
        scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FLT_MAX), scale)
        scale = torch.where((amax == 0) | amax.isnan() | amax.isinf(), torch.ones_like(scale), scale)
        if self.force_pow_2_scales:
            mantissa, exponent = torch.frexp(scale)  # scale = m * 2**e with m in [0.5, 1)
            scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
        return scale

    def _quantize(self, x: torch.Tensor) -> CurrentScalingTensorRef:
        scale = self.compute_scale(x)
        scaled = x.to(torch.float32) * scale
        data = scaled.clamp(-self.fp8_max, self.fp8_max).to(self.dtype)
        data_t = data.reshape(-1, x.shape[-1]).t().contiguous() if self.columnwise_usage else None
        scale_inv = (1.0 / scale.to(torch.float64)).to(torch.float32)
        return CurrentScalingTensorRef(data if self.rowwise_usage else None, data_t, scale,
                                       scale_inv, x.dtype, x.shape)

    def update_quantized(self, src, dst, *, noop_flag=None):
        if noop_flag is not None and bool(noop_flag.item()):
            return dst
        new = self._quantize(src)
        dst.data, dst.data_t, dst.scale, dst.scale_inv = new.data, new.data_t, new.scale, new.scale_inv
        return dst

    def make_empty(self, shape, *, dtype=torch.float32, device=None, requires_grad=False):
        data = torch.empty(shape, dtype=self.dtype, device=device)
        one = torch.ones(1, dtype=torch.float32, device=device)
        return CurrentScalingTensorRef(data, None, one, one.clone(), dtype, data.shape)

    def qgemm(self, a: CurrentScalingTensorRef, b: CurrentScalingTensorRef, *,
              out_dtype: torch.dtype = torch.float32, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """a @ b.T in fp32 from dequantized operands (a: [..., K], b: [N, K]), as in a linear layer."""
        out = a.dequantize(dtype=torch.float32) @ b.dequantize(dtype=torch.float32).t()
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(out_dtype)
