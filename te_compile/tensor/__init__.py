"""Quantized tensors and quantizers, usable eagerly (CPU and CUDA) and under torch.compile."""

from .float8_quantizer import Float8CurrentScalingQuantizer, Float8Quantizer
from .float8_tensor import Float8Tensor, Float8TensorStorage
from .quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorStorage,
    Quantizer,
    prepare_for_saving,
    restore_from_saved,
)

__all__ = [
    # abstract interface
    "Quantizer",
    "QuantizedTensorStorage",
    "QuantizedTensor",
    "prepare_for_saving",
    "restore_from_saved",
    # per-tensor FP8
    "Float8Quantizer",
    "Float8CurrentScalingQuantizer",
    "Float8Tensor",
    "Float8TensorStorage",
]
