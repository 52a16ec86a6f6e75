"""GEMMs on quantized operands, below the lowerings that call them.

``per_tensor``: FP8 GEMMs with one scale per operand (torch._scaled_mm; on CPU its exact emulation);
``grouped``: the experts' grouped FP8 GEMMs with per-expert scales (torch._scaled_grouped_mm, or
its arithmetic as an fp32 op); ``block``: the quantizer objects of the block-scaled recipes and
CustomRecipe, and their GEMMs, native through F.scaled_mm or dequantize-then-matmul;
``block_probe``: whether a device runs a block format's GEMMs natively (gates and a self-test);
``scaled_mm_op``: the opaque op around F.scaled_mm and its pure-torch reference; ``operands``: the
dtypes an operand may come in, and whether a quantized weight is already a recipe's operand.
"""

from .block import dequantized_gemm, native_block_gemm
from .block_probe import native_block_gemm_support
from .per_tensor import fp8_gemm, uses_native_fp8_gemm
from .scaled_mm_op import block_scaled_mm

__all__ = ["fp8_gemm", "uses_native_fp8_gemm", "dequantized_gemm", "native_block_gemm",
           "native_block_gemm_support", "block_scaled_mm"]
