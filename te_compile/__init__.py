"""te_compile: a torch.compile backend for TransformerEngine-style FP8/FP4 training.

``torch.compile(model, backend="te")`` rewrites the linear layers of an unchanged model into FP8 / FP4
GEMMs under the recipe chosen in ``te_compile.toml``. The quantizers and quantized tensors it is
built on are usable eagerly on their own (``te_compile.tensor``).
"""

from . import recipe
from .backend import backend
from .config import ConfigError, TeConfig, load_config
from .report import Report, SiteRecord, report, reset
from .state import load_recipe_state_dict, recipe_state_dict
from .lowerings.delayed_state import advance_delayed_state
from .fsdp import enable_fp8_all_gather
from .context_parallel import context_parallel_shard, context_parallel_unshard, load_balanced_positions
from .calibration import calibrate
from .kv_cache import fp8_static_cache
from .primary_weights import quantize_weights, quantized_model_init
from .hardware import (
    get_device_compute_capability,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from .tensor import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensor,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    MXFP8Quantizer,
    MXFP8Tensor,
    NVFP4Quantizer,
    NVFP4Tensor,
    QuantizedTensor,
    QuantizedTensorStorage,
    Quantizer,
    prepare_for_saving,
    restore_from_saved,
)

__version__ = "0.1.0"

__all__ = [
    # the backend ("te" is also registered as a torch.compile backend name by entry point)
    "backend",
    "load_config",
    "TeConfig",
    "ConfigError",
    "report",
    "reset",
    "Report",
    "SiteRecord",
    "recipe_state_dict",
    "load_recipe_state_dict",
    # DelayedScaling with update_on = "optimizer_step": runs after every torch.optim step by itself
    "advance_delayed_state",
    # FSDP2: all-gather the weights of FP8 linears as FP8 (call before fully_shard)
    "enable_fp8_all_gather",
    # context parallelism: each rank's load-balanced slice of the batch's sequence, and back
    "context_parallel_shard",
    "context_parallel_unshard",
    "load_balanced_positions",
    # inference: delayed-scaling scales from high-precision forwards; an E4M3 static KV cache
    "calibrate",
    "fp8_static_cache",
    # FP8 primary weights: nn.Linear weights built quantized, or quantized in place after loading for
    # serving (te_compile.tensor.utils has the master-weight cast for the optimizer)
    "quantized_model_init",
    "quantize_weights",
    # recipes (te_compile.recipe holds the classes)
    "recipe",
    # quantization core, usable eagerly (te_compile.tensor has the storage classes too)
    "Quantizer", "QuantizedTensorStorage", "QuantizedTensor", "prepare_for_saving", "restore_from_saved",
    "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8Tensor",
    "MXFP8Quantizer", "MXFP8Tensor",
    "Float8BlockQuantizer", "Float8BlockwiseQTensor",
    "NVFP4Quantizer", "NVFP4Tensor",
    # hardware probes
    "get_device_compute_capability", "is_bf16_available", "is_fp8_available", "is_mxfp8_available",
    "is_fp8_block_scaling_available", "is_nvfp4_available",
]
