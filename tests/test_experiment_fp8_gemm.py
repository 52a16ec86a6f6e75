"""The FP8 GEMM with an amax epilogue and an optional FP8 output (experiments/fp8_gemm.py): on
operands whose products sum exactly in fp32 (any order) the Triton kernel equals the reference bit for
bit in Triton's interpreter (on the GPU when there is one); on random operands it agrees with the
unfused path of the linears (te_compile.gemm.fp8_gemm, then tensor_amax and cast_to_fp8) to fp32
rounding, and its amax and FP8 bytes are exactly those of its own output."""

from __future__ import annotations

import pytest
import torch

from experiments.fp8_gemm import fp8_gemm_amax, fp8_gemm_amax_reference, fp8_gemm_amax_triton
from te_compile.gemm import fp8_gemm
from te_compile.gemm.per_tensor import cpu_emulates_scaled_mm
from te_compile.kernels._fp_bits import HAS_TRITON
from te_compile.scaling import cast_to_fp8, tensor_amax
from utils import assert_bitwise_equal, seed, on_kernel_device

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (M, K, N): ragged tiles on every side, one row / column, several K steps of the kernel's loop
SHAPES = [(33, 64, 40), (1, 32, 1), (70, 96, 65), (64, 17, 32)]


def _exact(shape, dtype, s):
    """Multiples of 1/4 in [-4, 4]: exact in E4M3 and E5M2; products are multiples of 1/16 and any
    sum of K <= 256 of them is exact in fp32, so the order of summation cannot change a bit."""
    return (torch.randint(-16, 17, shape, generator=seed(s)).float() / 4).to(dtype)


def _operands(m, k, n, a_dtype=E4M3, b_dtype=E4M3, s=0, exact=True):
    if exact:
        a = _exact((m, k), a_dtype, s)
        b = _exact((n, k), b_dtype, s + 1).t()   # the transpose of a row-major [N, K], as the linears pass it
    else:
        gen = seed(s)
        a = (torch.randn(m, k, generator=gen) * 20).to(a_dtype)
        b = (torch.randn(n, k, generator=gen) * 20).to(b_dtype).t()
    return a, b, torch.tensor([0.375]), torch.tensor([2.0 ** -7 * 3])


@needs_triton
@pytest.mark.parametrize("out", ["fp32", "bf16", "e4m3", "e5m2"])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3xe4m3", "e5m2xe4m3"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_equals_reference_on_exact_sums(shape, dtypes, out):
    a, b, sa, sb = _operands(*shape, *dtypes, s=sum(shape))
    if out in ("fp32", "bf16"):
        kwargs = dict(out_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[out])
    else:   # y in bf16, written as FP8 with a scale that saturates some values
        kwargs = dict(out_dtype=torch.bfloat16, out_scale=torch.tensor([300.0]),
                      out_fp8_dtype={"e4m3": E4M3, "e5m2": E5M2}[out])
    got = fp8_gemm_amax_triton(a, b, sa, sb, **kwargs)
    ref = fp8_gemm_amax_reference(a, b, sa, sb, **kwargs)
    for g, r, what in zip(got, ref, ("out", "amax")):
        assert_bitwise_equal(g, r, f"{shape} {dtypes} {out}: {what}")
    assert ref[1].item() > 0


@needs_triton
@pytest.mark.skipif(not cpu_emulates_scaled_mm(), reason="fp8_gemm keeps this torch's CPU _scaled_mm, whose bits "
                    "differ from the emulation (torch 2.11, below the supported 2.13)")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kernel_agrees_with_the_unfused_linear_path(out_dtype):
    """Random FP8 operands (inexact sums): y within fp32 rounding of te_compile.gemm.fp8_gemm, which
    the linears run today; the amax and the FP8 bytes are those of the kernel's own y, bit for bit."""
    a, b, sa, sb = _operands(77, 200, 90, E5M2, E4M3, exact=False)
    y, amax = fp8_gemm_amax_triton(a, b, sa, sb, out_dtype)
    unfused = fp8_gemm(a, b, sa, sb, out_dtype=out_dtype)
    tol = dict(rtol=1e-5, atol=1e-4) if out_dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-2)
    torch.testing.assert_close(y, unfused, **tol)
    assert_bitwise_equal(amax, tensor_amax(y))
    scale = torch.tensor([448.0]) / tensor_amax(unfused) * 2   # some values saturate
    q, amax_q = fp8_gemm_amax_triton(a, b, sa, sb, out_dtype, scale, E4M3)
    assert_bitwise_equal(q, cast_to_fp8(y, scale, E4M3).view(torch.uint8))
    assert_bitwise_equal(amax_q, amax)
    # and against the unfused bytes: equal but where y's last bit sits on a rounding boundary
    same = q == cast_to_fp8(unfused, scale, E4M3).view(torch.uint8)
    assert same.float().mean() > 0.99


@needs_triton
def test_kernel_nan_and_empty():
    # NaN through a scale (the interpreter decodes the E4M3 NaN byte 0x7F as a finite value, so an FP8
    # NaN operand cannot be tested here): every y is NaN, so must the amax be, in every tile
    a, b, sa, sb = _operands(40, 64, 36)
    y, amax = fp8_gemm_amax_triton(a, b, torch.tensor([float("nan")]), sb, torch.float32)
    assert torch.isnan(amax).all() and torch.isnan(y).all()
    for m, k, n in ((0, 32, 8), (8, 32, 0), (8, 0, 16)):
        a, b, sa, sb = _operands(m, k, n)
        for got, ref in zip(fp8_gemm_amax_triton(a, b, sa, sb, torch.bfloat16),
                            fp8_gemm_amax_reference(a, b, sa, sb, torch.bfloat16)):
            assert_bitwise_equal(got, ref, f"{m, k, n}")


def test_dispatch_and_errors():
    a, b, sa, sb = _operands(8, 32, 16)
    for got, ref in zip(fp8_gemm_amax(a, b, sa, sb, torch.float32),
                        fp8_gemm_amax_reference(a, b, sa, sb, torch.float32)):
        assert_bitwise_equal(got, ref)
    with pytest.raises(ValueError, match="disagree on K"):
        fp8_gemm_amax(a, b[:16], sa, sb, torch.float32)
    with pytest.raises(ValueError, match=r"a must be a 2-D float8_e4m3fn / float8_e5m2 tensor, got torch.float32"):
        fp8_gemm_amax(a.float(), b, sa, sb, torch.float32)
    with pytest.raises(ValueError, match="out_scale and out_fp8_dtype go together"):
        fp8_gemm_amax(a, b, sa, sb, torch.float32, out_scale=torch.ones(1))


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is off on a CUDA machine; "
                    "the CUDA op test covers the op there")
def test_op_runs_the_kernel_on_cpu_in_the_interpreter():
    a, b, sa, sb = _operands(50, 64, 40)
    args = (a, b, sa, sb, torch.bfloat16, torch.tensor([64.0]), E5M2)
    for got, ref in zip(torch.ops.te_compile.fp8_gemm_amax(*args), fp8_gemm_amax_reference(*args)):
        assert_bitwise_equal(got, ref)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("fp8_out", [False, True])
def test_cuda_op_equals_reference_eager_and_compiled(fp8_out):
    a, b, sa, sb = (t.cuda() for t in _operands(300, 256, 520, E5M2, E4M3))
    args = (a, b, sa, sb, torch.bfloat16) + ((torch.tensor([16.0], device="cuda"), E4M3) if fp8_out else (None, None))
    ref = fp8_gemm_amax_reference(*args)
    # not test_schema: torch 2.11's schema check multiplies the inputs to detect mutation, and CUDA has
    # no e5m2 multiply (seen on an H100, 2026-11-26)
    torch.library.opcheck(torch.ops.te_compile.fp8_gemm_amax.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    for got, r in zip(fp8_gemm_amax(*args), ref):
        assert_bitwise_equal(got, r)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *xs: fp8_gemm_amax(*xs), fullgraph=True)
    for got, r in zip(compiled(*args), ref):
        assert_bitwise_equal(got, r)


# CPU-built operands run on the GPU where there is one (tests/utils.py)
fp8_gemm_amax_triton = on_kernel_device(fp8_gemm_amax_triton)
