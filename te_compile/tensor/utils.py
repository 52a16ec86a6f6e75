"""Helpers on quantized tensors for custom recipes and distributed optimizers."""

from __future__ import annotations

import torch

from .float8_tensor import Float8TensorStorage
from .quantized_tensor import QuantizedTensorStorage, Quantizer

__all__ = ["is_custom", "replace_raw_data"]


def is_custom(x) -> bool:
    """True for a quantizer, or a quantized tensor made by one, written outside te_compile
    (marked with a class attribute ``custom = True``, as the reference recipes are)."""
    if isinstance(x, Quantizer):
        return bool(getattr(x, "custom", False))
    if isinstance(x, QuantizedTensorStorage):
        if getattr(x, "custom", False):
            return True
        quantizer = getattr(x, "_quantizer", None)
        return quantizer is not None and is_custom(quantizer)
    return False


def replace_raw_data(tensor: Float8TensorStorage, new_raw_data: torch.Tensor) -> None:
    """Move a Float8Tensor's bytes into ``new_raw_data`` (e.g. a slice of one contiguous ZeRO
    buffer) and make it the tensor's ``_data``. The bytes are copied; the old buffer is released."""
    if not isinstance(tensor, Float8TensorStorage):
        raise ValueError(f"replace_raw_data needs a Float8Tensor, got {type(tensor).__name__}")
    old = tensor._data
    if old is None:
        raise ValueError("replace_raw_data: the tensor has no rowwise data to move")
    if new_raw_data.dtype != old.dtype or new_raw_data.shape != old.shape:
        raise ValueError(
            f"replace_raw_data: new buffer must be {old.dtype} of shape {tuple(old.shape)}, "
            f"got {new_raw_data.dtype} of shape {tuple(new_raw_data.shape)}"
        )
    new_raw_data.detach().copy_(old)
    tensor._data = new_raw_data
