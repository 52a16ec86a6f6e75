"""What each rewritten site becomes: autograd functions around FP8 GEMMs, per recipe and device."""

from .fp8_linear import SUPPORTED_RECIPES, LinearLowering, LinearSpec
from .gemm import fp8_gemm, uses_native_fp8_gemm

__all__ = ["LinearLowering", "LinearSpec", "SUPPORTED_RECIPES", "fp8_gemm", "uses_native_fp8_gemm"]
