"""MXFP8 quantize: the Triton kernel equals the plain-torch reference bit for bit (in the interpreter on
CPU, on the GPU when there is one), the reference follows the E8M0 rule (codes checked against values
built by hand), and the independent custom-recipe reference agrees with both copies of its buffers."""

import math

import pytest
import torch

from te_compile.custom_recipes.quantization_mxfp8 import (
    MXFP8QuantizerRef,
    MXFP8TensorRef,
    mxfp8_ref_quantizer_factory,
)
from te_compile.kernels import mxfp8_quantize as mx_module
from te_compile.kernels._fp_bits import HAS_TRITON
from te_compile.kernels.mxfp8_quantize import (
    MXFP8_BLOCK,
    mxfp8_quantize,
    mxfp8_quantize_reference,
    mxfp8_quantize_triton,
)
from utils import FLT_MAX, FP8_DTYPES, FP8_MAX, assert_bitwise_equal, fp8_id, seed, sqnr, on_kernel_device

# The interpreter evaluates both branches of tl.where in numpy (NaN * 0, NaN -> int casts) and warns.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# 1 row, one exact block, ragged last blocks (K % 32 != 0, K < 32), primes, several tiles of the kernel
SHAPES = [(1, 32), (7, 96), (33, 200), (128, 256), (5, 1), (3, 37)]
FP8_MAX_EXP = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}  # fp8_max = 1.75 * 2^this
NAN_BYTE = 0x7F


def _random(shape, generator, dtype=torch.float32):
    """Normal values with a per-row magnitude 2^-40 .. 2^40."""
    x = torch.randn(shape, generator=generator)
    x = x * torch.exp2(torch.randint(-40, 41, (shape[0], 1), generator=generator).float())
    return x.to(dtype)


def _specials() -> torch.Tensor:
    """[9, 100] (blocks of 32, 32, 32 and a ragged 4): one special pattern per row, the rest normal."""
    gen = seed(3)
    x = _random((9, 100), gen)
    x[0] = 0.0                                     # all-zero row
    x[1, 40] = float("inf")                        # block 1 -> NaN block
    x[2, 97] = float("nan")                        # ragged block 3 -> NaN block
    x[3, 5] = -float("inf")
    x[4, 64] = FLT_MAX                             # largest finite amax
    x[4, 65] = -FLT_MAX
    x[5, :32] = torch.randn(32, generator=gen) * 1e-40  # fp32 subnormals
    x[6, 32:64] = -0.0
    x[7, 96:] = torch.tensor([1e-45, -1e-45, 0.0, 1e-45])  # ragged block of the smallest subnormal
    x[8, :] = 448.0 * 2.0 ** torch.randint(-20, 20, (100,), generator=gen).float()
    return x


def _block_amax64(x: torch.Tensor) -> torch.Tensor:
    """float64 [M, ceil(K/32)] max|x| per block, computed block by block (NaN propagates)."""
    x64 = x.to(torch.float64)
    k = x.shape[1]
    cols = [x64[:, j:j + MXFP8_BLOCK].abs().amax(dim=1) for j in range(0, k, MXFP8_BLOCK)]
    return torch.stack(cols, dim=1)


# ---------------------------------------------------------------- Triton kernel == reference


@needs_triton
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference(shape, fp8_dtype):
    x = _random(shape, seed(sum(shape)))
    data, scale = mxfp8_quantize_triton(x, fp8_dtype)
    ref_data, ref_scale = mxfp8_quantize_reference(x, fp8_dtype)
    assert data.shape == shape and scale.shape == (shape[0], math.ceil(shape[1] / 32))
    assert_bitwise_equal(scale, ref_scale, "scale")
    assert_bitwise_equal(data, ref_data, "data")


@needs_triton
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_triton_matches_reference_special_values(fp8_dtype):
    x = _specials()
    data, scale = mxfp8_quantize_triton(x, fp8_dtype)
    ref_data, ref_scale = mxfp8_quantize_reference(x, fp8_dtype)
    assert_bitwise_equal(scale, ref_scale, "scale")
    assert_bitwise_equal(data, ref_data, "data")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_matches_reference_low_precision_input(dtype):
    x = _random((17, 160), seed(5)).clamp(-60000, 60000).to(dtype)
    for fp8_dtype in FP8_DTYPES:
        data, scale = mxfp8_quantize_triton(x, fp8_dtype)
        ref_data, ref_scale = mxfp8_quantize_reference(x, fp8_dtype)
        assert_bitwise_equal(scale, ref_scale, f"scale {fp8_id(fp8_dtype)}")
        assert_bitwise_equal(data, ref_data, f"data {fp8_id(fp8_dtype)}")


@needs_triton
def test_triton_non_contiguous_rows():
    """A row-strided view (a slice of a wider tensor) is read through its stride."""
    wide = _random((9, 300), seed(6))
    x = wide[:, 50:250]
    data, scale = mxfp8_quantize_triton(x, torch.float8_e4m3fn)
    ref_data, ref_scale = mxfp8_quantize_reference(x.contiguous(), torch.float8_e4m3fn)
    assert_bitwise_equal(scale, ref_scale, "scale")
    assert_bitwise_equal(data, ref_data, "data")


@pytest.mark.parametrize("shape", [(0, 64), (3, 0), (0, 0)], ids=str)
def test_empty(shape):
    x = torch.empty(shape)
    fns = [mxfp8_quantize_reference, mxfp8_quantize] + ([mxfp8_quantize_triton] if HAS_TRITON else [])
    for fn in fns:
        data, scale = fn(x, torch.float8_e4m3fn)
        assert data.shape == shape and data.dtype == torch.uint8, fn.__name__
        assert scale.shape == (shape[0], math.ceil(shape[1] / 32)) and scale.dtype == torch.uint8, fn.__name__


# ---------------------------------------------------------------- the E8M0 rule, from hand-built blocks


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_codes_at_and_around_powers_of_two(fp8_dtype):
    """amax = fp8_max * 2^k gives code 127 + k exactly; one ulp above rounds up to 128 + k; one ulp
    below stays at 127 + k. One block (row) per k, the amax element at a varying position."""
    fmax = FP8_MAX[fp8_dtype]
    top = 127 - FP8_MAX_EXP[fp8_dtype] - 1  # largest k with fp8_max * 2^k finite in fp32
    ks = torch.arange(-126, top + 1)
    exact = (fmax * torch.exp2(ks.to(torch.float64))).to(torch.float32)
    assert torch.isfinite(exact).all()
    up = torch.nextafter(exact, torch.full_like(exact, math.inf))
    down = torch.nextafter(exact, torch.zeros_like(exact))
    for amax, expected in ((exact, 127 + ks), (up, 128 + ks), (down, 127 + ks)):
        x = torch.rand(len(ks), MXFP8_BLOCK, generator=seed(1)) * amax[:, None] * 0.99
        x[torch.arange(len(ks)), ks % MXFP8_BLOCK] = amax * torch.where(ks % 2 == 0, 1.0, -1.0)
        data, scale = mxfp8_quantize_reference(x, fp8_dtype)
        assert_bitwise_equal(scale[:, 0], expected.to(torch.uint8), "code")
        custom = MXFP8QuantizerRef(fp8_dtype, columnwise=False)(x)
        assert_bitwise_equal(custom.rowwise_scale[:, 0], expected.to(torch.uint8), "custom code")
        assert_bitwise_equal(custom.rowwise_data, data, "custom data")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_codes_at_the_range_ends(fp8_dtype):
    """Zero -> code 0; the smallest amaxes clamp to code 0 (scale 2^-127), including TE's rule that a
    quotient which rounds to 2^-127 in fp32 keeps code 0; FLT_MAX -> ceil(log2(FLT_MAX / fp8_max))."""
    fmax = FP8_MAX[fp8_dtype]
    threshold = torch.tensor(fmax * 2.0**-127, dtype=torch.float32)  # amax / fp8_max == 2^-127 exactly
    just_above = torch.nextafter(threshold, torch.tensor(math.inf))
    rows = {
        0: 0.0,
        1: 1e-45,
        2: 2.0**-126,
        3: threshold.item(),
        4: just_above.item(),  # quotient rounds to 2^-127 in fp32 -> 0 (an exact ceil would say 1)
        5: (threshold * 2).item(),  # 2^-126 exactly -> code 1
        6: FLT_MAX,
    }
    x = torch.zeros(len(rows), 64)
    for r, amax in rows.items():
        x[r, 7] = amax
        x[r, 40] = -amax
    data, scale = mxfp8_quantize_reference(x, fp8_dtype)
    top = math.ceil(math.log2(FLT_MAX / fmax)) + 127
    expected = torch.tensor([0, 0, 0, 0, 0, 1, top], dtype=torch.uint8)
    assert_bitwise_equal(scale[:, 0], expected, "code block 0")
    assert_bitwise_equal(scale[:, 1], expected, "code block 1")
    custom = MXFP8QuantizerRef(fp8_dtype, columnwise=False)(x)
    assert_bitwise_equal(custom.rowwise_scale, scale, "custom code")
    assert_bitwise_equal(custom.rowwise_data, data, "custom data")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_special_values(fp8_dtype):
    """inf / NaN anywhere in a block make its code 255 and all its bytes NaN; other blocks of the
    row are untouched; zero blocks are all zero bytes with code 0; -0.0 keeps its sign."""
    x = _specials()
    data, scale = mxfp8_quantize_reference(x, fp8_dtype)
    nan_blocks = {(1, 1), (2, 3), (3, 0)}
    for r, b in nan_blocks:
        assert scale[r, b] == 255, (r, b)
        assert (data[r, b * 32:(b + 1) * 32] == NAN_BYTE).all(), (r, b)
    finite = ~torch.isnan(_block_amax64(x)) & ~torch.isinf(_block_amax64(x))
    assert int((scale == 255).sum()) == len(nan_blocks) == int((~finite).sum())
    assert (scale[0] == 0).all() and (data[0] == 0).all()
    assert (data[6, 32:64] == 0x80).all() and scale[6, 1] == 0
    # the rows' other blocks equal a quantization of those blocks alone
    for r, b in nan_blocks:
        other = [c for c in range(4) if c != b]
        for c in other:
            alone_data, alone_scale = mxfp8_quantize_reference(x[r:r + 1, c * 32:(c + 1) * 32], fp8_dtype)
            assert_bitwise_equal(scale[r, c:c + 1], alone_scale[0], f"row {r} block {c}")
            assert_bitwise_equal(data[r:r + 1, c * 32:(c + 1) * 32], alone_data, f"row {r} block {c}")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("shape", [(33, 200), (64, 96)], ids=str)
def test_code_is_the_smallest_that_does_not_clip(shape, fp8_dtype):
    """For every finite block (amaxes far from the fp32 range ends): amax * 2^(127 - c) <= fp8_max
    and amax * 2^(127 - (c - 1)) > fp8_max, in float64; the bytes are the cast of x * 2^(127 - c)."""
    fmax = FP8_MAX[fp8_dtype]
    x = _random(shape, seed(11))
    x[0, :40] = 0.0  # one all-zero block and a zero-padded partial one
    data, scale = mxfp8_quantize_reference(x, fp8_dtype)
    amax = _block_amax64(x)
    c = scale.to(torch.float64)
    nonzero = amax > 0
    assert (amax * torch.exp2(127 - c) <= fmax).all()
    assert (amax * torch.exp2(128 - c) > fmax)[nonzero].all()
    assert (c[~nonzero] == 0).all()
    # element bytes from an independent float64 scaling and torch's saturating cast
    factor = torch.exp2(127 - c).repeat_interleave(32, dim=1)[:, :shape[1]]
    expected = (x.to(torch.float64) * factor).clamp(-fmax, fmax).to(torch.float32).to(fp8_dtype)
    assert_bitwise_equal(data, expected.view(torch.uint8), "data")


@pytest.mark.parametrize("fp8_dtype,min_db", [(torch.float8_e4m3fn, 30.0), (torch.float8_e5m2, 24.0)],
                         ids=["e4m3", "e5m2"])
def test_dequantized_sqnr(fp8_dtype, min_db):
    """Per-block scaling keeps each row's own precision across magnitudes 2^-40 .. 2^40."""
    x = _random((64, 256), seed(12))
    q = MXFP8QuantizerRef(fp8_dtype, columnwise=False)(x)
    data, scale = mxfp8_quantize_reference(x, fp8_dtype)
    assert_bitwise_equal(q.rowwise_data, data, "data")
    deq = q.dequantize(dtype=torch.float32)
    for r in range(x.shape[0]):
        value = sqnr(x[r], deq[r])
        assert value >= min_db, f"row {r}: SQNR {value:.1f} dB < {min_db} dB"


# ---------------------------------------------------------------- dispatch, compile, validation


def test_dispatch_uses_reference_on_cpu(monkeypatch):
    def fail(*args):
        raise AssertionError("the Triton launcher must not run for CPU tensors")

    monkeypatch.setattr(mx_module, "mxfp8_quantize_triton", fail)
    x = _random((4, 70), seed(13))
    want = mxfp8_quantize_reference(x, torch.float8_e5m2)
    for got, want in zip(mxfp8_quantize(x, torch.float8_e5m2), want):
        assert_bitwise_equal(got, want)


def test_reference_compiles_bit_exact():
    """Inductor's code for the reference equals eager (a ragged K once miscompiled: see the reference)."""
    x = _specials()

    def both_formats(x):
        return [mxfp8_quantize_reference(x, fp8_dtype) for fp8_dtype in FP8_DTYPES]

    compiled = torch.compile(both_formats, fullgraph=True, dynamic=False)(x)
    for fp8_dtype, got, want in zip(FP8_DTYPES, compiled, both_formats(x)):
        assert_bitwise_equal(got[1], want[1], f"scale {fp8_id(fp8_dtype)}")
        assert_bitwise_equal(got[0], want[0], f"data {fp8_id(fp8_dtype)}")


_LAUNCHERS = [mxfp8_quantize_reference, mxfp8_quantize] + ([mxfp8_quantize_triton] if HAS_TRITON else [])


@pytest.mark.parametrize("fn", _LAUNCHERS, ids=lambda f: f.__name__)
def test_errors(fn):
    with pytest.raises(ValueError, match=r"2-D.*\(64,\)"):
        fn(torch.zeros(64), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"2-D.*\(2, 2, 32\)"):
        fn(torch.zeros(2, 2, 32), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="floating-point.*torch.int32"):
        fn(torch.zeros(2, 32, dtype=torch.int32), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_dtype.*torch.float16"):
        fn(torch.zeros(2, 32), torch.float16)


# ---------------------------------------------------------------- the custom-recipe reference


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("shape", [(33, 200), (2, 3, 40), (70,), (64, 32)], ids=str)
def test_custom_reference_matches_kernel_reference(shape, fp8_dtype):
    x = _random((math.prod(shape[:-1]), shape[-1]), seed(len(shape))).reshape(shape)
    if len(shape) == 2:
        x[1, 3] = float("nan")
        x[-1, -1] = -float("inf")
        x[2, :] = 0.0
    x2d = x.reshape(-1, shape[-1])
    q = MXFP8QuantizerRef(fp8_dtype)(x)
    data, scale = mxfp8_quantize_reference(x2d, fp8_dtype)
    assert_bitwise_equal(q.rowwise_data, data, "rowwise data")
    assert_bitwise_equal(q.rowwise_scale, scale, "rowwise scale")
    data_t, scale_t = mxfp8_quantize_reference(x2d.t().contiguous(), fp8_dtype)
    assert q.columnwise_scale.shape == (math.ceil(x2d.shape[0] / 32), x2d.shape[1])
    assert_bitwise_equal(q.columnwise_data, data_t.t(), "columnwise data")
    assert_bitwise_equal(q.columnwise_scale, scale_t.t(), "columnwise scale")


def test_custom_reference_dequantize_and_usage():
    x = _random((40, 70), seed(21)).reshape(2, 20, 70).to(torch.bfloat16)
    both = MXFP8QuantizerRef(torch.float8_e4m3fn)(x)
    deq = both.dequantize()
    assert deq.shape == x.shape and deq.dtype == torch.bfloat16
    # dequantize = fp8 value * 2^(code - 127), checked on one element by hand
    byte, code = int(both.rowwise_data[5, 40]), int(both.rowwise_scale[5, 1])
    value = torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).double().item()
    assert both.dequantize(dtype=torch.float64).reshape(40, 70)[5, 40].item() == value * 2.0 ** (code - 127)
    assert sqnr(x.float(), deq.float()) > 25.0
    # the columnwise copy alone dequantizes to the logical shape with column blocks
    col = MXFP8QuantizerRef(torch.float8_e4m3fn, rowwise=False)(x)
    assert col.rowwise_data is None and col.rowwise_scale is None
    col_deq = col.dequantize(dtype=torch.float32)
    assert col_deq.shape == x.shape
    assert sqnr(x.float(), col_deq) > 25.0
    assert not torch.equal(col_deq, both.dequantize(dtype=torch.float32))  # different blocks
    assert_bitwise_equal(col_deq, both.update_usage(rowwise_usage=False).dequantize(dtype=torch.float32))
    with pytest.raises(RuntimeError, match="rowwise"):
        both.update_usage(rowwise_usage=True)
    row = MXFP8QuantizerRef(torch.float8_e4m3fn, columnwise=False)(x)
    assert row.columnwise_data is None and row.columnwise_scale is None
    with pytest.raises(RuntimeError, match="columnwise"):
        row.update_usage(columnwise_usage=True)


def test_custom_reference_nan_block_dequantizes_to_nan():
    x = torch.ones(2, 64)
    x[0, 33] = float("inf")
    deq = MXFP8QuantizerRef(torch.float8_e5m2, columnwise=False)(x).dequantize()
    assert torch.isnan(deq[0, 32:]).all() and (deq[0, :32] == 1).all() and (deq[1] == 1).all()
    # code 0: the scale is 2^-127 exactly (x * 2^127 is representable for these tiny values)
    tiny = torch.full((1, 32), 2.0**-130)
    q = MXFP8QuantizerRef(torch.float8_e4m3fn, columnwise=False)(tiny)
    assert q.rowwise_scale.item() == 0 and (q.dequantize() == 2.0**-130).all()


def test_custom_reference_storage_protocol():
    quantizer = MXFP8QuantizerRef(torch.float8_e4m3fn)
    x = _random((33, 40), seed(22))
    q = quantizer(x)
    buffers = [q.rowwise_data, q.rowwise_scale, q.columnwise_data, q.columnwise_scale]
    tensors, obj = q.prepare_for_saving()
    assert obj is q and q.rowwise_data is None and q.columnwise_scale is None
    assert all(a is b for a, b in zip(tensors, buffers))
    assert obj.restore_from_saved(tensors + ["rest"]) == ["rest"]
    assert all(a is b for a, b in zip([q.rowwise_data, q.rowwise_scale, q.columnwise_data,
                                       q.columnwise_scale], buffers))
    meta = q.get_metadata()
    assert_bitwise_equal(MXFP8TensorRef(**meta).dequantize(), q.dequantize())
    # update_quantized: a set noop flag leaves dst alone, otherwise dst gets the new buffers
    y = _random((33, 40), seed(23))
    quantizer.update_quantized(y, q, noop_flag=torch.ones(1))
    assert all(a is b for a, b in zip([q.rowwise_data, q.columnwise_scale], [buffers[0], buffers[3]]))
    quantizer.update_quantized(y, q, noop_flag=torch.zeros(1))
    assert_bitwise_equal(q.dequantize(), quantizer(y).dequantize())
    q.clear()
    assert q.rowwise_data is None and q.columnwise_data is None
    # make_empty: buffer shapes of each usage
    quantizer = MXFP8QuantizerRef(torch.float8_e4m3fn, rowwise=False)
    empty = quantizer.make_empty((2, 33, 40), dtype=torch.bfloat16)
    assert empty.rowwise_data is None and empty.dtype == torch.bfloat16
    assert empty.columnwise_data.shape == (66, 40) and empty.columnwise_scale.shape == (3, 40)
    empty = MXFP8QuantizerRef(torch.float8_e4m3fn, columnwise=False).make_empty((66, 40))
    assert empty.rowwise_data.shape == (66, 40) and empty.rowwise_scale.shape == (66, 2)


def test_custom_reference_factory_and_errors():
    for role in ("input", "weight", "output", "grad_output", "grad_input"):
        quantizer = mxfp8_ref_quantizer_factory(role)
        assert isinstance(quantizer, MXFP8QuantizerRef) and quantizer.custom
        assert quantizer.fp8_dtype == torch.float8_e4m3fn
        assert quantizer.rowwise_usage and quantizer.columnwise_usage
    with pytest.raises(ValueError, match="'bias'"):
        mxfp8_ref_quantizer_factory("bias")
    with pytest.raises(ValueError, match="torch.float16"):
        MXFP8QuantizerRef(torch.float16)
    with pytest.raises(ValueError, match="rank >= 1"):
        MXFP8QuantizerRef(torch.float8_e4m3fn)(torch.tensor(1.0))
    with pytest.raises(ValueError, match="torch.int64"):
        MXFP8QuantizerRef(torch.float8_e4m3fn)(torch.ones(4, 32, dtype=torch.int64))


# ---------------------------------------------------------------- real GPU


@needs_cuda
@needs_triton
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("shape", SHAPES + [(1000, 4096 + 17)], ids=str)
def test_cuda_triton_matches_reference(shape, fp8_dtype):
    x = _random(shape, seed(31)).cuda()
    if shape[1] > 40:
        x[0, 0] = float("nan")  # one NaN block
    data, scale = mxfp8_quantize(x, fp8_dtype)  # dispatches to the kernel on CUDA
    ref_data, ref_scale = mxfp8_quantize_reference(x, fp8_dtype)
    assert data.is_cuda and scale.is_cuda
    assert_bitwise_equal(scale.cpu(), ref_scale.cpu(), "scale")
    assert_bitwise_equal(data.cpu(), ref_data.cpu(), "data")
    special = _specials().cuda()
    data, scale = mxfp8_quantize_triton(special, fp8_dtype)
    ref_data, ref_scale = mxfp8_quantize_reference(special.cpu(), fp8_dtype)
    assert_bitwise_equal(scale.cpu(), ref_scale, "special scale")
    assert_bitwise_equal(data.cpu(), ref_data, "special data")


# CPU-built operands run on the GPU where there is one (tests/utils.py)
mxfp8_quantize_triton = on_kernel_device(mxfp8_quantize_triton)
