"""Quantized tensors and quantizers, usable eagerly (CPU and CUDA) and under torch.compile."""

from .block_scaled_tensor import BlockScaledQuantizer, BlockScaledTensor, BlockScaledTensorStorage
from .float8_blockwise_tensor import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensor,
    Float8BlockwiseQTensorStorage,
)
from .float8_tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    Float8TensorStorage,
)
from .grouped_float8_tensor import GroupedFloat8Quantizer, GroupedFloat8Tensor
from .mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage
from .nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor, NVFP4TensorStorage
from .quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorStorage,
    Quantizer,
    prepare_for_saving,
    restore_from_saved,
)

# Public helpers for custom recipes and distributed optimizers (README: ``te_compile.tensor.utils``);
# imported here so that ``import te_compile`` is enough to reach them.
from . import utils

__all__ = [
    # abstract interface
    "Quantizer", "QuantizedTensorStorage", "QuantizedTensor", "prepare_for_saving", "restore_from_saved",
    # per-tensor FP8
    "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8Tensor", "Float8TensorStorage",
    # per-tensor FP8 per expert (MoE expert weights)
    "GroupedFloat8Tensor", "GroupedFloat8Quantizer",
    # block-scaled formats
    "BlockScaledQuantizer", "BlockScaledTensor", "BlockScaledTensorStorage",
    "MXFP8Quantizer", "MXFP8Tensor", "MXFP8TensorStorage",
    "Float8BlockQuantizer", "Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage",
    "NVFP4Quantizer", "NVFP4Tensor", "NVFP4TensorStorage",
    # helpers on quantized tensors (is_custom, replace_raw_data)
    "utils",
]
