"""Does this device run a block recipe's GEMMs natively? Answered once per (recipe, device, dtype).

Two steps, so that nothing reaches a model on faith:
1. the static gates: a CUDA device, the compute capability the format needs (te_compile.hardware:
   Float8 block sm90 only, MXFP8 and NVFP4 sm100+), a torch with ``F.scaled_mm``;
2. a self-test: the three GEMMs of one small linear (fprop, dgrad and wgrad, each operand in the copy
   the linear lowering gives it) natively and through the dequantize-then-matmul emulation on the same
   quantized operands, whose outputs must agree to ``MIN_SQNR_DB``. The operands' blocks span 2^-8..2^8 in magnitude, so a scale
   read from the wrong place (a layout mistake) costs tens of dB; native and emulated GEMMs differ only
   in summation order and the final rounding.
Any failure (a torch error for this dtype or architecture, a mismatch) leaves the format emulated and
the answer says why; the backend puts that reason in its report and logs it once.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from ..hardware import (
    get_device_compute_capability,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from ..numerics import sqnr_db
from ..recipe import Recipe
from .block import dequantized_gemm, native_block_gemm, native_pair_supported, quantize_copies, quantizer_factory

__all__ = ["native_block_gemm_support", "MIN_SQNR_DB"]

log = logging.getLogger(__name__)

# Native vs emulated outputs of the self-test (bf16 output rounding alone leaves ~50 dB).
MIN_SQNR_DB = 35.0

# Self-test shape: M not a multiple of 128 or 32 (padding paths), K and N spanning several blocks.
_M, _K, _N = 272, 256, 384

# per block format (Recipe.block_format): does the device's architecture have its GEMMs
_ARCH_PROBE = {"mxfp8": is_mxfp8_available, "float8_block": is_fp8_block_scaling_available,
               "nvfp4": is_nvfp4_available}

_answers: dict[tuple, tuple[bool, str]] = {}


def _spread(shape, device, dtype, generator) -> torch.Tensor:
    """Gaussian values with rows and columns scaled by random powers of two in 2^-4..2^4 each."""
    x = torch.randn(shape, generator=generator, device="cpu")
    rows = torch.randint(-4, 5, (shape[0], 1), generator=generator).double().exp2()
    cols = torch.randint(-4, 5, (1, shape[1]), generator=generator).double().exp2()
    return (x * rows * cols).to(device=device, dtype=dtype)


def _self_test(recipe: Recipe, device: torch.device, dtype: torch.dtype) -> float:
    """Lowest SQNR (dB) of y, dx, dw: native GEMMs against the emulation, same quantized operands."""
    factory = quantizer_factory(recipe)
    gen = torch.Generator().manual_seed(0)
    x = _spread((_M, _K), device, dtype, gen)   # [M, K]
    w = _spread((_N, _K), device, dtype, gen)   # [N, K]
    g = _spread((_M, _N), device, dtype, gen)   # [M, N]
    # stochastic rounding draws from the global generator: leave the caller's untouched
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        qx, qg = quantize_copies(factory, "input", x), quantize_copies(factory, "grad_output", g)
        qw = quantize_copies(factory, "weight", w, columnwise=True)
        qx_col = quantize_copies(factory, "input", x, rowwise=False, columnwise=True)
        qg_col = quantize_copies(factory, "grad_output", g, rowwise=False, columnwise=True)
    gemms = [(qx, qw, dict(transpose_b=True)),        # fprop  y  = x @ w.T
             (qg, qw, {}),                            # dgrad  dx = g @ w
             (qg_col, qx_col, dict(transpose_a=True))]  # wgrad dw = g.T @ x
    sqnrs = []
    for a, b, how in gemms:
        if native_pair_supported(a, b):   # else the lowering emulates this pair too
            ref = dequantized_gemm(a, b, out_dtype=dtype, **how)
            sqnrs.append(sqnr_db(ref, native_block_gemm(a, b, out_dtype=dtype, **how)))
    return min(sqnrs, default=math.inf)


def native_block_gemm_support(recipe: Recipe, device, dtype: torch.dtype) -> tuple[bool, str]:
    """(True, how) where ``recipe``'s GEMMs run natively on ``device`` with ``dtype`` activations,
    else (False, why not), both short enough for a report row. The self-test runs on the first
    question per (recipe, device, dtype)."""
    fmt = recipe.block_format
    if fmt is None:
        return False, f"{recipe.name} has no native block-scaled GEMM"
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"no native block-scaled GEMMs on {device.type}"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not _ARCH_PROBE[fmt](device=device):
        major, minor = get_device_compute_capability(device)
        return False, f"compute capability {major}.{minor} has no native {fmt} GEMMs"
    if not hasattr(F, "scaled_mm"):
        return False, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    key = (recipe, str(device), dtype)  # the recipe's flags choose the quantizers the test runs
    if key not in _answers:
        try:
            sqnr = _self_test(recipe, device, dtype)
        except Exception as e:  # a torch / cuBLAS refusal for this architecture, dtype or layout
            answer = (False, f"native self-test failed ({dtype}): {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]}")
        else:
            if sqnr >= MIN_SQNR_DB:
                answer = (True, f"self-test {sqnr:.1f} dB against the emulation ({dtype})")
            else:
                answer = (False, f"native self-test disagrees with the emulation ({dtype}): "
                                 f"{sqnr:.1f} dB < {MIN_SQNR_DB} dB")
        if not answer[0]:
            log.warning("te_compile: %s GEMMs on %s stay emulated: %s", fmt, device, answer[1])
        _answers[key] = answer
    return _answers[key]
