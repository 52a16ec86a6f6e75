"""Per-tensor FP8 quantizers: delayed scaling (given scale) and current scaling (scale from amax)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from .float8_tensor import Float8Tensor, Float8TensorStorage, _transpose_2d
from .quantized_tensor import Quantizer
from ..scaling import cast_to_fp8, compute_scale, fp8_max, tensor_amax

__all__ = ["Float8Quantizer", "Float8CurrentScalingQuantizer"]


class _Float8QuantizerBase(Quantizer):
    """What both per-tensor quantizers share: the cast, the buffers and the in-place update."""

    def __init__(self, fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        fp8_max(fp8_dtype)  # validates the dtype, naming the allowed ones
        self.dtype = fp8_dtype

    def _scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        """The fp32 [1] scale used to quantize ``tensor`` (updates the quantizer's state)."""
        raise NotImplementedError

    def _buffers(self, tensor: torch.Tensor):
        """(rowwise uint8 data or None, columnwise uint8 data or None, scale_inv [1])."""
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__}: both rowwise and columnwise usage are off")
        scale = self._scale_for(tensor)
        data = cast_to_fp8(tensor, scale, self.dtype).view(torch.uint8)
        # True division, as the scale itself: 1/scale correctly rounded.
        scale_inv = torch.div(torch.ones_like(scale), scale)
        transpose = _transpose_2d(data) if self.columnwise_usage else None
        return (data if self.rowwise_usage else None), transpose, scale_inv

    def _quantize(self, tensor: torch.Tensor):
        data, transpose, scale_inv = self._buffers(tensor)
        cls = Float8TensorStorage if self.internal else Float8Tensor
        return cls(
            data=data, scale_inv=scale_inv, fp8_dtype=self.dtype, data_transpose=transpose,
            quantizer=self, shape=tensor.shape, dtype=tensor.dtype,
        )

    def update_quantized(self, src, dst, *, noop_flag: Optional[torch.Tensor] = None):
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"update_quantized: src shape {tuple(src.shape)} != dst shape {tuple(dst.shape)}")
        if noop_flag is not None:
            # Evaluate without touching state, then keep the old values where the flag is set.
            skip = noop_flag.reshape(1) != 0
            saved_state = self._save_state()
            data, transpose, scale_inv = self._buffers(src)
            self._restore_state(saved_state, keep_old=skip)
            old = dst._rowwise_data()
            data = torch.where(skip, old, data)
            scale_inv = torch.where(skip, dst._scale_inv, scale_inv)
            transpose = None if transpose is None else _transpose_2d(data)
        else:
            data, transpose, scale_inv = self._buffers(src)
        if dst._data is None or data is None:
            dst._data = data
        else:
            dst._data.copy_(data)
        dst._scale_inv.copy_(scale_inv)
        dst._transpose = transpose
        dst._fp8_dtype = self.dtype
        return dst

    def make_empty(self, shape: Iterable[int], *, dtype=torch.float32, device=None, requires_grad=False):
        shape = torch.Size(shape)
        device = torch.device(device) if device is not None else self._default_device()
        data = torch.empty(shape, dtype=torch.uint8, device=device)
        transpose = _transpose_2d(data) if self.columnwise_usage else None
        scale_inv = self._initial_scale_inv(device)
        if self.internal:
            return Float8TensorStorage(data, scale_inv, self.dtype, data_transpose=transpose,
                                       quantizer=self, dtype=dtype)
        return Float8Tensor(data=data, scale_inv=scale_inv, fp8_dtype=self.dtype, dtype=dtype,
                            data_transpose=transpose, quantizer=self, requires_grad=requires_grad)

    # State hooks for noop_flag: subclasses with state tensors save and restore them.
    def _save_state(self):
        return None

    def _restore_state(self, saved, keep_old: torch.Tensor) -> None:
        pass


class Float8Quantizer(_Float8QuantizerBase):
    """Delayed scaling: quantize with the given ``scale`` ([1] fp32, owned by the recipe state) and
    max-accumulate |x| into the given ``amax`` ([1] fp32). The recipe turns amaxes into the next
    scale (te_compile.scaling.delayed_scale_from_history)."""

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype, *,
                 rowwise: bool = True, columnwise: bool = True) -> None:
        super().__init__(fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        for name, t in (("scale", scale), ("amax", amax)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
                raise ValueError(f"Float8Quantizer: {name} must be an fp32 tensor with one element, got {t!r}")
        self.scale = scale
        self.amax = amax

    def _scale_for(self, tensor):
        self.amax.copy_(torch.maximum(self.amax, tensor_amax(tensor).to(self.amax.device).reshape(self.amax.shape)))
        return self.scale.reshape(1).to(tensor.device)

    def _default_device(self):
        return self.scale.device

    def _initial_scale_inv(self, device):
        return torch.div(torch.ones(1, device=device), self.scale.reshape(1).to(device))

    def _save_state(self):
        return self.amax.clone()

    def _restore_state(self, saved, keep_old):
        self.amax.copy_(torch.where(keep_old.to(self.amax.device).reshape(self.amax.shape), saved, self.amax))


class Float8CurrentScalingQuantizer(_Float8QuantizerBase):
    """Current scaling: scale = fp8_max / max|x| computed from the tensor being quantized.

    After each quantize, ``self.amax`` and ``self.scale`` ([1] fp32) hold the values used.
    """

    def __init__(self, fp8_dtype: torch.dtype, device=None, *, rowwise: bool = True,
                 columnwise: bool = True, force_pow_2_scales: bool = False,
                 amax_epsilon: float = 0.0) -> None:
        super().__init__(fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        if not amax_epsilon >= 0.0:
            raise ValueError(f"amax_epsilon must be a non-negative float, got {amax_epsilon!r}")
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = float(amax_epsilon)
        self.device = torch.device(device) if device is not None else None
        self.amax = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.scale = torch.ones(1, dtype=torch.float32, device=self.device)

    def _scale_for(self, tensor):
        amax = tensor_amax(tensor)
        scale = compute_scale(amax, self.dtype, force_pow_2_scales=self.force_pow_2_scales,
                              amax_epsilon=self.amax_epsilon)
        self.amax, self.scale = amax, scale
        return scale

    def _default_device(self):
        return self.device if self.device is not None else torch.device("cpu")

    def _initial_scale_inv(self, device):
        return torch.ones(1, dtype=torch.float32, device=device)

    def _save_state(self):
        return self.amax, self.scale

    def _restore_state(self, saved, keep_old):
        old_amax, old_scale = saved
        self.amax = torch.where(keep_old, old_amax.to(self.amax.device), self.amax)
        self.scale = torch.where(keep_old, old_scale.to(self.scale.device), self.scale)
