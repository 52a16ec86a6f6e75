"""Per-tensor FP8 cast + transpose + amax in one read (experiments/fp8_cast_transpose.py): the
Triton kernel equals the plain-torch reference bit for bit (in Triton's interpreter on CPU, on the GPU
when there is one), the reference equals what the linear lowerings compute today, and the op traces
as one node with a correct fake."""

from __future__ import annotations

import pytest
import torch

from experiments.fp8_cast_transpose import (
    fp8_cast_transpose,
    fp8_cast_transpose_reference,
    fp8_cast_transpose_triton,
)
from te_compile.kernels._fp_bits import HAS_TRITON
from te_compile.scaling import cast_to_fp8, compute_scale, tensor_amax
from utils import FP8_DTYPES, assert_bitwise_equal, fp8_id, seed, on_kernel_device

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# one row, one tile, ragged tiles both ways, primes, several tiles; (0, K) and (M, 0) are empty
SHAPES = [(1, 64), (64, 64), (7, 200), (130, 67), (5, 1), (0, 16), (16, 0)]


def _x(shape, s=0, dtype=torch.float32):
    """Normal values, rows 2^-20 .. 2^20 apart, so that some saturate and some underflow."""
    gen = seed(s)
    x = torch.randn(shape, generator=gen)
    if x.numel():
        x = x * torch.exp2(torch.randint(-20, 21, (shape[0], 1), generator=gen).float())
    return x.to(dtype)


def _scale(x, fp8_dtype):
    return compute_scale(tensor_amax(x), fp8_dtype) * 4   # some values saturate


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_is_the_lowerings_cast_and_its_transpose(shape, fp8_dtype):
    x = _x(shape)
    scale = _scale(x, fp8_dtype)
    data, data_t, amax = fp8_cast_transpose_reference(x, scale, fp8_dtype)
    expect = cast_to_fp8(x, scale, fp8_dtype).view(torch.uint8)
    assert_bitwise_equal(data, expect)
    assert_bitwise_equal(data_t, expect.t().contiguous())
    assert data_t.is_contiguous() and data_t.shape == (shape[1], shape[0])
    assert_bitwise_equal(amax, tensor_amax(x))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_reference(shape, fp8_dtype, dtype):
    x = _x(shape, 1, dtype)
    scale = _scale(x, fp8_dtype)
    for a, b in zip(fp8_cast_transpose_triton(x, scale, fp8_dtype), fp8_cast_transpose_reference(x, scale, fp8_dtype)):
        assert_bitwise_equal(a, b, f"{shape} {fp8_dtype} {dtype}")


@needs_triton
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_kernel_specials_and_strided_rows(fp8_dtype):
    """±inf saturate, -0.0 keeps its sign, subnormals round, a NaN makes the amax NaN (and its byte a
    NaN); rows with a stride larger than K are read in place."""
    wide = _x((70, 160), 2)
    x = wide[:, :130]                  # row stride 160
    x[0, 3], x[1, 5], x[2, 7] = float("inf"), -float("inf"), -0.0
    x[3, :10] = torch.randn(10, generator=seed(4)) * 1e-42
    scale = torch.tensor([2.0 ** 10])
    data, data_t, amax = fp8_cast_transpose_triton(x, scale, fp8_dtype)
    ref = fp8_cast_transpose_reference(x, scale, fp8_dtype)
    for a, b in zip((data, data_t, amax), ref):
        assert_bitwise_equal(a, b)
    x[69, 129] = float("nan")          # the last, ragged tile
    data, data_t, amax = fp8_cast_transpose_triton(x, scale, fp8_dtype)
    ref_data, ref_t, ref_amax = fp8_cast_transpose_reference(x, scale, fp8_dtype)
    assert torch.isnan(amax).all() and torch.isnan(ref_amax).all()
    assert torch.isnan(data.view(fp8_dtype)[69, 129].float()) and torch.isnan(data_t.view(fp8_dtype)[129, 69].float())
    finite = ~torch.isnan(x)
    assert_bitwise_equal(data[finite], ref_data[finite])
    assert_bitwise_equal(data_t[finite.t()], ref_t[finite.t()])


def test_dispatch_and_errors():
    x = _x((8, 32))
    scale = torch.tensor([3.0])
    for a, b in zip(fp8_cast_transpose(x, scale, torch.float8_e4m3fn),
                    fp8_cast_transpose_reference(x, scale, torch.float8_e4m3fn)):
        assert_bitwise_equal(a, b)
    with pytest.raises(ValueError, match=r"x must be 2-D \[M, K\], got shape \(32,\)"):
        fp8_cast_transpose(x[0], scale, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale must be a one-element tensor, got \(2,\)"):
        fp8_cast_transpose(x, torch.ones(2), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        fp8_cast_transpose(x, scale, torch.int8)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_cuda_op_equals_reference_eager_and_compiled(fp8_dtype):
    x = _x((1000, 520), 5, torch.bfloat16).cuda()
    scale = _scale(x, fp8_dtype)
    ref = fp8_cast_transpose_reference(x, scale, fp8_dtype)
    torch.library.opcheck(torch.ops.te_compile.fp8_cast_transpose.default, (x, scale, fp8_dtype))
    for a, b in zip(fp8_cast_transpose(x, scale, fp8_dtype), ref):
        assert_bitwise_equal(a, b)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t, s: fp8_cast_transpose(t, s, fp8_dtype), fullgraph=True)
    for a, b in zip(compiled(x, scale), ref):
        assert_bitwise_equal(a, b)



@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is off on a CUDA machine; "
                    "the CUDA op test covers the op there")
def test_op_runs_the_kernel_on_cpu_in_the_interpreter():
    """The triton_op launches through wrap_triton (its fake and AOT dispatch are checked on CUDA by
    opcheck above; the interpreter cannot run them under fake tensors)."""
    x = _x((100, 72), 6)
    scale = _scale(x, torch.float8_e4m3fn)
    for a, b in zip(torch.ops.te_compile.fp8_cast_transpose(x, scale, torch.float8_e4m3fn),
                    fp8_cast_transpose_reference(x, scale, torch.float8_e4m3fn)):
        assert_bitwise_equal(a, b)


# CPU-built operands run on the GPU where there is one (tests/utils.py)
fp8_cast_transpose_triton = on_kernel_device(fp8_cast_transpose_triton)
