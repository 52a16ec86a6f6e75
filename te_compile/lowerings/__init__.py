"""What each rewritten site becomes: autograd functions around quantized GEMMs, per recipe and device."""

from .gemm import dequantized_gemm, fp8_gemm, uses_native_fp8_gemm
from .linear import SUPPORTED_RECIPES, LinearLowering, LinearSpec, gemm_kind
from .quantizers import quantizer_factory
from .block_gemm import native_block_gemm  # noqa: I001 (after .linear, which loads te_compile.tensor first)
from .block_gemm_probe import native_block_gemm_support
from .scaled_mm_op import block_scaled_mm

__all__ = ["LinearLowering", "LinearSpec", "SUPPORTED_RECIPES", "gemm_kind", "quantizer_factory",
           "fp8_gemm", "dequantized_gemm", "uses_native_fp8_gemm",
           "native_block_gemm", "native_block_gemm_support", "block_scaled_mm"]
