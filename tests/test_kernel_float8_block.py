"""Float8 block-scaling quantize: Triton kernel == plain-torch reference == an independent per-tile
loop == the custom-recipe reference, bit for bit; plus the scale rules, layouts and errors."""

import math

import pytest
import torch

from te_compile.custom_recipes.quantization_float8_block import (
    Float8BlockQuantizerRef,
    Float8BlockTensorRef,
    float8_block_ref_quantizer_factory,
)
from te_compile.kernels import float8_block_quantize as fbq
from te_compile.kernels._fp_bits import HAS_TRITON
from te_compile.kernels.float8_block_quantize import (
    FLOAT8_BLOCK,
    float8_block_quantize,
    float8_block_quantize_reference,
    float8_block_quantize_triton,
)
from utils import (
    FLT_MAX,
    FP8_DTYPES,
    FP8_MAX,
    assert_bitwise_equal,
    fp8_id,
    ref_amax,
    ref_cast,
    ref_scale,
    ref_scale_inv,
    seed,
    sqnr,
    on_kernel_device,
)

# CPU-built operands run on the GPU where there is one (tests/utils.py)
float8_block_quantize_triton = on_kernel_device(float8_block_quantize_triton)


# numpy in the Triton interpreter warns on the inf/NaN lanes the kernel then masks with tl.where
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [(1, 128), (3, 200), (130, 257), (256, 384)]
TILE_ROWS = [1, 128]
EPSILONS = [0.0, 1e-3]
# (force_pow_2_scales, amax_epsilon) for the wide sweeps; the edge-value tests take the full cross
SCALE_RULES = [(False, 0.0), (True, 0.0), (False, 1e-3)]


def _magnitudes(shape, gen, dtype=torch.float32):
    """randn scaled by 2**randint(-40, 40) per row: tiles whose amaxes differ by up to 2**80."""
    x = torch.randn(shape, generator=gen)
    x = x * torch.exp2(torch.randint(-40, 41, (shape[0], 1), generator=gen).float())
    return x.to(dtype)


def _with_specials(gen):
    """[256, 384] with each 128x128 tile (and the 1x128 blocks inside it) a different edge case:
    all zeros; one +inf; one NaN; one -FLT_MAX; all subnormal (scale overflows to FLT_MAX); a tiny
    amax whose scale 448/amax overflows although amax is normal; the rest random magnitudes."""
    x = _magnitudes((256, 384), gen)
    x[:128, :128] = 0.0
    x[5, 130] = math.inf
    x[7:9, 300] = math.nan  # two rows of 1x128 blocks and one 128x128 tile
    x[200, 10] = -FLT_MAX
    x[128:256, 128:256] = torch.randn(128, 128, generator=gen) * 1e-40
    x[130, 256:384] = torch.randn(128, generator=gen) * 2e-39
    x[131, 256:384] = -math.inf
    x[132, 256:260] = torch.tensor([-0.0, 0.0, -1e-45, 1e-45])
    x[132, 260:384] = 0.0
    return x


def _quantize_both(x, fp8_dtype, tile_rows, pow2, eps):
    kwargs = dict(tile_rows=tile_rows, force_pow_2_scales=pow2, amax_epsilon=eps)
    return (float8_block_quantize_triton(x, fp8_dtype, **kwargs),
            float8_block_quantize_reference(x, fp8_dtype, **kwargs))


def _assert_same(got, want, msg):
    assert_bitwise_equal(got[0], want[0], f"{msg} data")
    assert_bitwise_equal(got[1], want[1], f"{msg} scale_inv")


def _loop_reference(x, fp8_dtype, tile_rows, pow2, eps):
    """Tile by tile with the per-tensor fp64 reference of tests/utils.py (frexp pow2)."""
    m, k = x.shape
    data = torch.empty(m, k, dtype=torch.uint8)
    scale_inv = torch.empty(-(-m // tile_rows), -(-k // 128), dtype=torch.float32)
    for i, r in enumerate(range(0, m, tile_rows)):
        for j, c in enumerate(range(0, k, 128)):
            tile = x[r:r + tile_rows, c:c + 128]
            scale = ref_scale(ref_amax(tile), fp8_dtype, force_pow_2=pow2, amax_epsilon=eps)
            data[r:r + tile_rows, c:c + 128] = ref_cast(tile, scale, fp8_dtype)
            scale_inv[i, j] = ref_scale_inv(scale)[0]
    return data, scale_inv


# ---- Triton kernel (interpreter on CPU) == reference ---------------------------------------------

@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("tile_rows", TILE_ROWS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("pow2, eps", SCALE_RULES, ids=str)
def test_kernel_matches_reference(shape, tile_rows, fp8_dtype, pow2, eps):
    gen = seed(sum(shape) + tile_rows)
    x = _magnitudes(shape, gen)
    got, want = _quantize_both(x, fp8_dtype, tile_rows, pow2, eps)
    assert FLOAT8_BLOCK == 128
    assert want[1].shape == (-(-shape[0] // tile_rows), -(-shape[1] // FLOAT8_BLOCK))
    _assert_same(got, want, f"{shape} t={tile_rows}")


@needs_triton
@pytest.mark.parametrize("tile_rows", TILE_ROWS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
@pytest.mark.parametrize("eps", EPSILONS)
def test_kernel_matches_reference_edge_values(tile_rows, fp8_dtype, pow2, eps):
    x = _with_specials(seed(1))
    got, want = _quantize_both(x, fp8_dtype, tile_rows, pow2, eps)
    _assert_same(got, want, f"specials t={tile_rows}")
    # the edge cases really reached the scale rule: scale 1 (zero/inf/NaN tiles) and FLT_MAX
    sinv = want[1]
    assert (sinv == 1.0).any()
    if eps == 0.0:
        overflowed = 2.0**-127 if pow2 else 1.0 / FLT_MAX
        assert (sinv == torch.tensor(overflowed, dtype=torch.float32)).any()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tile_rows", TILE_ROWS)
def test_kernel_matches_reference_half_inputs(dtype, tile_rows):
    x = _magnitudes((130, 257), seed(2)).clamp(-6e4, 6e4).to(dtype)
    got, want = _quantize_both(x, torch.float8_e4m3fn, tile_rows, True, 0.0)
    _assert_same(got, want, str(dtype))


@needs_triton
@pytest.mark.parametrize("tile_rows", TILE_ROWS)
def test_kernel_row_strided_input(tile_rows):
    wide = _magnitudes((130, 300), seed(3))
    x = wide[:, 17:274]  # [130, 257] view, row stride 300
    got, want = _quantize_both(x, torch.float8_e4m3fn, tile_rows, False, 0.0)
    _assert_same(got, want, "strided")
    _assert_same(got, float8_block_quantize_reference(
        x.contiguous(), torch.float8_e4m3fn, tile_rows=tile_rows, force_pow_2_scales=False,
        amax_epsilon=0.0), "strided vs contiguous")


@pytest.mark.parametrize("shape", [(0, 200), (3, 0), (0, 0)], ids=str)
@pytest.mark.parametrize("tile_rows", TILE_ROWS)
def test_empty(shape, tile_rows):
    x = torch.empty(shape)
    fns = [float8_block_quantize_reference] + ([float8_block_quantize_triton] if HAS_TRITON else [])
    for fn in fns:
        data, scale_inv = fn(x, torch.float8_e4m3fn, tile_rows=tile_rows, force_pow_2_scales=True,
                             amax_epsilon=0.0)
        assert data.shape == shape and data.dtype == torch.uint8
        assert scale_inv.shape == (-(-shape[0] // tile_rows), -(-shape[1] // 128))
        assert scale_inv.dtype == torch.float32


# ---- reference == independent per-tile loop; properties ------------------------------------------

@pytest.mark.parametrize("shape", [(1, 128), (3, 200), (130, 257), "specials"], ids=str)
@pytest.mark.parametrize("tile_rows", TILE_ROWS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("pow2, eps", SCALE_RULES, ids=str)
def test_reference_matches_per_tile_loop(shape, tile_rows, fp8_dtype, pow2, eps):
    gen = seed(4)
    x = _with_specials(gen) if shape == "specials" else _magnitudes(shape, gen)
    got = float8_block_quantize_reference(x, fp8_dtype, tile_rows=tile_rows, force_pow_2_scales=pow2,
                                          amax_epsilon=eps)
    _assert_same(got, _loop_reference(x, fp8_dtype, tile_rows, pow2, eps), "reference vs loop")


@pytest.mark.parametrize("tile_rows", TILE_ROWS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_pow2_scales_are_powers_of_two_rounded_down(tile_rows, fp8_dtype):
    x = _magnitudes((130, 257), seed(5))
    kw = dict(tile_rows=tile_rows, amax_epsilon=0.0)
    _, sinv_pow2 = float8_block_quantize_reference(x, fp8_dtype, force_pow_2_scales=True, **kw)
    _, sinv = float8_block_quantize_reference(x, fp8_dtype, force_pow_2_scales=False, **kw)
    mantissa, _ = torch.frexp(sinv_pow2)
    assert (mantissa == 0.5).all(), sinv_pow2[mantissa != 0.5][:5]
    # scale rounded down <=> scale_inv rounded up, by less than a factor of two
    assert (sinv_pow2 >= sinv).all() and (sinv_pow2 < 2 * sinv).all()
    assert not (sinv_pow2 == sinv).all()


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_tile_amax_maps_to_fp8_max(fp8_dtype):
    """Without pow2 each tile's largest element lands on (or one fp8 step below) fp8_max, and the
    dequantized tensor is close to x."""
    x = _magnitudes((130, 257), seed(6))
    data, sinv = float8_block_quantize_reference(x, fp8_dtype, tile_rows=1, force_pow_2_scales=False,
                                                 amax_epsilon=0.0)
    values = data.view(fp8_dtype).float()
    block_max = torch.stack([values[:, c:c + 128].abs().amax(dim=1) for c in range(0, 257, 128)], 1)
    assert (block_max >= FP8_MAX[fp8_dtype] * 0.875).all() and (block_max <= FP8_MAX[fp8_dtype]).all()
    deq = values * sinv.repeat_interleave(128, dim=1)[:, :257]
    threshold = 25.0 if fp8_dtype == torch.float8_e4m3fn else 19.0
    assert sqnr(x, deq) > threshold


@pytest.mark.parametrize("shape", [(130, 257), (256, 384), (3, 200)], ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_2d_tiles_of_transpose_are_transposed_tiles(shape, fp8_dtype):
    x = _magnitudes(shape, seed(7))
    kw = dict(tile_rows=128, force_pow_2_scales=True, amax_epsilon=0.0)
    data, sinv = float8_block_quantize_reference(x, fp8_dtype, **kw)
    data_t, sinv_t = float8_block_quantize_reference(x.t().contiguous(), fp8_dtype, **kw)
    assert_bitwise_equal(data_t, data.t().contiguous(), "data")
    assert_bitwise_equal(sinv_t, sinv.t().contiguous(), "scale_inv")


@pytest.mark.parametrize("tile_rows", TILE_ROWS)
def test_reference_traces_under_torch_compile(tile_rows):
    x = _magnitudes((130, 257), seed(8))

    def fn(t):
        return float8_block_quantize_reference(t, torch.float8_e4m3fn, tile_rows=tile_rows,
                                               force_pow_2_scales=False, amax_epsilon=1e-3)

    torch._dynamo.reset()
    _assert_same(torch.compile(fn, backend="aot_eager", fullgraph=True)(x), fn(x), "compiled")


def test_dispatch_uses_reference_off_cuda(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton launcher must not run for CPU tensors")

    monkeypatch.setattr(fbq, "float8_block_quantize_triton", refuse)
    x = _magnitudes((3, 200), seed(9))
    kw = dict(tile_rows=1, force_pow_2_scales=True, amax_epsilon=0.0)
    _assert_same(float8_block_quantize(x, torch.float8_e5m2, **kw),
                 float8_block_quantize_reference(x, torch.float8_e5m2, **kw), "dispatch")


@pytest.mark.parametrize("kwargs, match", [
    (dict(x=torch.zeros(128)), "2-D"),
    (dict(x=torch.zeros(2, 2, 128)), "2-D"),
    (dict(x=torch.zeros(2, 128, dtype=torch.float64)), "x.dtype"),
    (dict(x=torch.zeros(2, 128, dtype=torch.int32)), "x.dtype"),
    (dict(fp8_dtype=torch.float16), "fp8_dtype"),
    (dict(tile_rows=2), "tile_rows"),
    (dict(tile_rows=True), "tile_rows"),
    (dict(amax_epsilon=-1.0), "amax_epsilon"),
    (dict(amax_epsilon=math.nan), "amax_epsilon"),
    (dict(amax_epsilon=math.inf), "amax_epsilon"),
], ids=lambda v: str(v) if isinstance(v, str) else "")
def test_errors(kwargs, match):
    args = dict(x=torch.zeros(2, 128), fp8_dtype=torch.float8_e4m3fn, tile_rows=1,
                force_pow_2_scales=True, amax_epsilon=0.0)
    args.update(kwargs)
    fns = [float8_block_quantize_reference, float8_block_quantize]
    fns += [float8_block_quantize_triton] if HAS_TRITON else []
    for fn in fns:
        with pytest.raises(ValueError, match=match):
            fn(args["x"], args["fp8_dtype"], tile_rows=args["tile_rows"],
               force_pow_2_scales=args["force_pow_2_scales"], amax_epsilon=args["amax_epsilon"])


# ---- custom-recipe reference ---------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 128), (2, 65, 200), (256, 384)], ids=str)
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("pow2, eps", SCALE_RULES, ids=str)
def test_custom_reference_matches_kernel_reference(shape, dim, fp8_dtype, pow2, eps):
    gen = seed(10)
    x = _with_specials(gen) if shape == (256, 384) else _magnitudes((math.prod(shape[:-1]), shape[-1]), gen)
    x = x.reshape(shape)
    q = Float8BlockQuantizerRef(fp8_dtype, block_scaling_dim=dim, force_pow_2_scales=pow2,
                                amax_epsilon=eps)(x)
    x2d = x.reshape(-1, shape[-1])
    kw = dict(tile_rows=1 if dim == 1 else 128, force_pow_2_scales=pow2, amax_epsilon=eps)
    _assert_same((q.rowwise_data, q.rowwise_scale),
                 float8_block_quantize_reference(x2d, fp8_dtype, **kw), "rowwise")
    _assert_same((q.columnwise_data, q.columnwise_scale),
                 float8_block_quantize_reference(x2d.t().contiguous(), fp8_dtype, **kw), "columnwise")


@pytest.mark.parametrize("dim", [1, 2])
def test_custom_reference_dequantize(dim):
    x = _magnitudes((130, 200), seed(11)).reshape(2, 65, 200).to(torch.bfloat16)
    q = Float8BlockQuantizerRef(torch.float8_e4m3fn, block_scaling_dim=dim)(x)
    row = q.dequantize()
    assert row.shape == x.shape and row.dtype == torch.bfloat16
    assert q.dequantize(dtype=torch.float32).dtype == torch.float32
    assert sqnr(x.float(), row.float()) > 25.0
    # rowwise: data * scale_inv of its 1x128 / 128x128 tile
    x2d_data = q.rowwise_data.view(torch.float8_e4m3fn).float()
    t = 1 if dim == 1 else 128
    want = x2d_data[127, 130] * q.rowwise_scale[127 // t, 1]
    assert row.float().reshape(130, 200)[127, 130] == want.to(torch.bfloat16).float()
    col_only = Float8BlockQuantizerRef(torch.float8_e4m3fn, rowwise=False, block_scaling_dim=dim)(x)
    assert col_only.rowwise_data is None and col_only.rowwise_scale is None
    col = col_only.dequantize(dtype=torch.float32)
    assert col.shape == x.shape and sqnr(x.float(), col) > 25.0
    if dim == 2:  # the same tiles, transposed: identical values
        assert_bitwise_equal(col, q.dequantize(dtype=torch.float32), "columnwise vs rowwise")
    else:  # 128x1 blocks of the original: a different quantization
        assert not torch.equal(col, q.dequantize(dtype=torch.float32))


def test_custom_reference_usage_and_saving():
    x = _magnitudes((130, 257), seed(12))
    full = Float8BlockQuantizerRef(torch.float8_e4m3fn, block_scaling_dim=2)(x)
    quantizer = Float8BlockQuantizerRef(torch.float8_e4m3fn, block_scaling_dim=2)
    quantizer.set_usage(columnwise=False)
    q = quantizer(x)
    assert q.columnwise_data is None and q.columnwise_scale is None
    q.update_usage(columnwise_usage=True)  # 128x128: the transposed tiles are exact
    _assert_same((q.columnwise_data, q.columnwise_scale),
                 (full.columnwise_data, full.columnwise_scale), "derived columnwise")
    q.update_usage(rowwise_usage=False)
    assert q.rowwise_data is None and q.columnwise_data is not None
    q.update_usage(rowwise_usage=True)
    _assert_same((q.rowwise_data, q.rowwise_scale), (full.rowwise_data, full.rowwise_scale), "rowwise")

    q1 = Float8BlockQuantizerRef(torch.float8_e4m3fn, columnwise=False, block_scaling_dim=1)(x)
    with pytest.raises(RuntimeError, match="columnwise"):
        q1.update_usage(columnwise_usage=True)

    values = full.dequantize()
    tensors, obj = full.prepare_for_saving()
    assert obj is full and len(tensors) == 4 and full.rowwise_data is None
    assert obj.restore_from_saved(tensors + [None]) == [None]
    assert_bitwise_equal(obj.dequantize(), values, "restored")
    assert obj.columnwise_data is tensors[2] and obj.columnwise_scale is tensors[3]
    meta = obj.get_metadata()
    assert meta["block_scaling_dim"] == 2 and meta["shape"] == x.shape
    obj.clear()
    assert obj.rowwise_data is None and obj.columnwise_data is None


def test_custom_reference_update_quantized_and_make_empty():
    quantizer = Float8BlockQuantizerRef(torch.float8_e5m2, block_scaling_dim=1, force_pow_2_scales=False)
    dst = quantizer.make_empty((2, 65, 200), dtype=torch.bfloat16)
    assert isinstance(dst, Float8BlockTensorRef) and dst.shape == (2, 65, 200)
    assert dst.rowwise_data.shape == (130, 200) and dst.rowwise_scale.shape == (130, 2)
    assert dst.columnwise_data.shape == (200, 130) and dst.columnwise_scale.shape == (200, 2)
    x = _magnitudes((130, 200), seed(13)).reshape(2, 65, 200)
    before = dst.rowwise_data.clone()
    assert quantizer.update_quantized(x, dst, noop_flag=torch.ones(1)) is dst
    assert_bitwise_equal(dst.rowwise_data, before, "noop")
    quantizer.quantize(x, out=dst)
    fresh = quantizer(x)
    _assert_same((dst.rowwise_data, dst.rowwise_scale), (fresh.rowwise_data, fresh.rowwise_scale), "row")
    _assert_same((dst.columnwise_data, dst.columnwise_scale),
                 (fresh.columnwise_data, fresh.columnwise_scale), "col")
    w = Float8BlockQuantizerRef(torch.float8_e4m3fn, block_scaling_dim=2).make_empty((300, 130))
    assert w.rowwise_scale.shape == (3, 2) and w.columnwise_scale.shape == (2, 3)


def test_factory_roles():
    for role in ("input", "weight", "output", "grad_output", "grad_input"):
        q = float8_block_ref_quantizer_factory(role)
        assert isinstance(q, Float8BlockQuantizerRef) and q.custom
        assert q.dtype == torch.float8_e4m3fn
        assert q.block_scaling_dim == (2 if role == "weight" else 1)
        assert q.force_pow_2_scales is True and q.amax_epsilon == 0.0
        assert q.rowwise_usage and q.columnwise_usage
    with pytest.raises(ValueError, match="role"):
        float8_block_ref_quantizer_factory("bias")


@pytest.mark.parametrize("kwargs, match", [
    (dict(fp8_dtype=torch.bfloat16), "fp8_dtype"),
    (dict(block_scaling_dim=3), "block_scaling_dim"),
    (dict(amax_epsilon=-0.5), "amax_epsilon"),
], ids=["dtype", "dim", "eps"])
def test_custom_reference_errors(kwargs, match):
    args = dict(fp8_dtype=torch.float8_e4m3fn)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Float8BlockQuantizerRef(args.pop("fp8_dtype"), **args)


def test_custom_reference_rejects_scalar():
    with pytest.raises(ValueError, match="rank"):
        Float8BlockQuantizerRef(torch.float8_e4m3fn)(torch.tensor(1.0))


# ---- real GPU ------------------------------------------------------------------------------------

@needs_cuda
@needs_triton
@pytest.mark.parametrize("tile_rows", TILE_ROWS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_gpu_kernel_matches_reference(tile_rows, fp8_dtype, pow2):
    gen = seed(14)
    inputs = [_magnitudes(s, gen) for s in SHAPES] + [_with_specials(gen), _magnitudes((4099, 1000), gen)]
    inputs.append(_magnitudes((300, 515), gen).clamp(-6e4, 6e4).to(torch.bfloat16))
    for x in inputs:
        for eps in EPSILONS:
            kw = dict(tile_rows=tile_rows, force_pow_2_scales=pow2, amax_epsilon=eps)
            got = float8_block_quantize(x.cuda(), fp8_dtype, **kw)
            assert got[0].is_cuda
            want = float8_block_quantize_reference(x, fp8_dtype, **kw)
            _assert_same((got[0].cpu(), got[1].cpu()), want, f"{tuple(x.shape)} eps={eps}")
            cuda_ref = float8_block_quantize_reference(x.cuda(), fp8_dtype, **kw)
            _assert_same((cuda_ref[0].cpu(), cuda_ref[1].cpu()), want, "reference on CUDA")
