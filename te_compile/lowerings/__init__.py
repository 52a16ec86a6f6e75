"""What each rewritten site becomes: autograd functions around quantized GEMMs, per recipe and device."""

from .gemm import dequantized_gemm, fp8_gemm, uses_native_fp8_gemm
from .linear import SUPPORTED_RECIPES, LinearLowering, LinearSpec, gemm_kind
from .quantizers import quantizer_factory

__all__ = ["LinearLowering", "LinearSpec", "SUPPORTED_RECIPES", "gemm_kind", "quantizer_factory",
           "fp8_gemm", "dequantized_gemm", "uses_native_fp8_gemm"]
