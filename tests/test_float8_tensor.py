"""Float8Tensor: its op rules (views and copies keep the subclass; everything else computes on the
dequantized values), usage copies, saving for backward, serialization, and torch.compile."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from te_compile.custom_recipes.quantization_current_scaling import current_scaling_ref_quantizer_factory
from te_compile.tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    Float8TensorStorage,
    QuantizedTensorStorage,
    prepare_for_saving,
    restore_from_saved,
)
from utils import FP8_DTYPES, assert_bitwise_equal, fp8_id, ref_cast, seed

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2



def _quantize(x, fp8_dtype=E4M3, **kwargs) -> Float8Tensor:
    return Float8CurrentScalingQuantizer(fp8_dtype, **kwargs)(x)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.fixture
def t3() -> Float8Tensor:
    """A [4, 6, 10] Float8Tensor (E4M3, current scaling, with its columnwise copy)."""
    return _quantize(torch.randn(4, 6, 10, generator=seed(0)) * 3)


# ---- ops that keep the subclass ------------------------------------------------------------------

# (id, op, shares the bytes of the original)
VIEW_OPS = [
    ("view_flat", lambda t: t.view(-1), True),
    ("view_2d", lambda t: t.view(24, 10), True),
    ("reshape", lambda t: t.reshape(10, 24), True),
    ("reshape_of_transposed", lambda t: t.transpose(0, 2).reshape(-1), False),
    ("reshape_of_last_dim_slice", lambda t: t[..., 1:4].reshape(4, -1), False),
    ("slice_dim0", lambda t: t[1:3], True),
    ("slice_last_step", lambda t: t[..., 2:9:3], True),
    ("select_dim0", lambda t: t[2], True),
    ("select_last", lambda t: t.select(2, 7), True),
    ("select_to_0d", lambda t: t[1, 2, 3], True),
    ("as_strided", lambda t: t.as_strided((5, 7), (10, 3), 4), True),
    ("transpose", lambda t: t.transpose(0, 1), True),
    ("permute", lambda t: t.permute(2, 0, 1), True),
    ("unsqueeze", lambda t: t.unsqueeze(1), True),
    ("squeeze", lambda t: t[:, :1].squeeze(1), True),
    ("expand", lambda t: t[:, :1].expand(4, 6, 10), True),
    ("contiguous_of_transposed", lambda t: t.transpose(1, 2).contiguous(), False),
    ("detach", lambda t: t.detach(), True),
]


@pytest.mark.parametrize("name, op, shares", VIEW_OPS, ids=[c[0] for c in VIEW_OPS])
def test_view_ops_keep_float8(t3, name, op, shares):
    plain = t3.dequantize()
    expected = op(plain)
    out = op(t3)
    assert type(out) is Float8Tensor, f"{name} returned {type(out).__name__}"
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert out.stride() == expected.stride(), f"{name}: wrapper strides {out.stride()} != {expected.stride()}"
    assert out._fp8_dtype is t3._fp8_dtype
    assert_bitwise_equal(out._scale_inv, t3._scale_inv, f"{name} scale_inv")
    assert_bitwise_equal(out.dequantize(), expected, f"{name} values")
    assert _same_storage(out._data, t3._data) is shares, f"{name}: shares bytes should be {shares}"
    if name != "detach":
        assert out._transpose is None, f"{name}: the columnwise copy describes the old layout"


@pytest.mark.parametrize(
    "name, op",
    [("split_size", lambda t: t.split(4, dim=2)), ("split_sizes", lambda t: t.split([1, 3], dim=0)),
     ("unbind", lambda t: t.unbind(1))],
    ids=["split_size", "split_sizes", "unbind"],
)
def test_split_ops_keep_float8(t3, name, op):
    expected = op(t3.dequantize())
    parts = op(t3)
    assert len(parts) == len(expected)
    for i, (part, want) in enumerate(zip(parts, expected, strict=True)):
        assert type(part) is Float8Tensor, f"{name}[{i}] is {type(part).__name__}"
        assert_bitwise_equal(part.dequantize(), want, f"{name}[{i}]")
        assert _same_storage(part._data, t3._data)


def test_clone_copies_everything(t3):
    c = t3.clone()
    assert type(c) is Float8Tensor
    assert_bitwise_equal(c._data, t3._data, "bytes")
    assert_bitwise_equal(c._scale_inv, t3._scale_inv, "scale_inv")
    assert_bitwise_equal(c._transpose, t3._transpose, "transpose")
    for field in ("_data", "_scale_inv", "_transpose"):
        assert not _same_storage(getattr(c, field), getattr(t3, field)), f"clone shares {field}"
    before = t3.dequantize()
    c.mul_(3.0)
    assert_bitwise_equal(t3.dequantize(), before, "the original changed with its clone")


def test_new_zeros_and_empty_like(t3):
    z = t3.new_zeros((3, 5))
    assert type(z) is Float8Tensor and z.shape == (3, 5) and z.dtype == t3.dtype
    assert z._fp8_dtype is t3._fp8_dtype
    assert_bitwise_equal(z.dequantize(), torch.zeros(3, 5), "new_zeros values")
    zb = t3.new_zeros((2,), dtype=torch.bfloat16)
    assert type(zb) is Float8Tensor and zb.dtype == torch.bfloat16
    for e in (torch.empty_like(t3), t3.new_empty((4, 6, 10))):
        assert type(e) is Float8Tensor and e.shape == t3.shape and e.dtype == t3.dtype
        assert e._fp8_dtype is t3._fp8_dtype and not _same_storage(e._data, t3._data)
    assert torch.empty_like(t3, dtype=torch.bfloat16).dtype == torch.bfloat16
    zl = torch.zeros_like(t3)
    assert type(zl) is Float8Tensor and int(zl._data.count_nonzero()) == 0


# ---- copy_ ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_copy_quantized_to_quantized_copies_bytes_and_scale(fp8_dtype):
    # a delayed-scaling source whose bytes do not reach fp8_max: re-quantizing its values with
    # current scaling would give other bytes, so only a true byte copy passes
    src = Float8Quantizer(torch.tensor([0.375]), torch.zeros(1), fp8_dtype)(
        torch.randn(9, 14, generator=seed(1)) * 40)
    dst = _quantize(torch.randn(9, 14, generator=seed(2)) * 0.01, fp8_dtype)
    src_bytes, dst_ptr = src._data.clone(), dst._data.data_ptr()
    assert not torch.equal(src._scale_inv, dst._scale_inv)  # precondition: different scales
    out = dst.copy_(src)
    assert out is dst and type(dst) is Float8Tensor
    assert dst._data.data_ptr() == dst_ptr, "copy_ must write into the existing buffer"
    assert_bitwise_equal(dst._data, src._data, "bytes")
    assert_bitwise_equal(dst._scale_inv, src._scale_inv, "scale_inv")
    assert_bitwise_equal(src._data, src_bytes, "the source changed")
    assert_bitwise_equal(dst.dequantize(), src.dequantize(), "values")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_copy_plain_to_quantized_requantizes(fp8_dtype):
    dst = _quantize(torch.randn(9, 14, generator=seed(3)), fp8_dtype)
    y = torch.randn(9, 14, generator=seed(4)) * 250
    dst.copy_(y)
    want = _quantize(y, fp8_dtype)
    assert type(dst) is Float8Tensor
    assert_bitwise_equal(dst._data, want._data, "bytes")
    assert_bitwise_equal(dst._scale_inv, want._scale_inv, "scale_inv")
    assert_bitwise_equal(dst._transpose, want._transpose, "the columnwise copy is refreshed")


def test_copy_plain_to_delayed_quantized_uses_its_scale():
    scale, amax = torch.tensor([0.375]), torch.zeros(1)
    dst = Float8Quantizer(scale, amax, E5M2)(torch.ones(3, 8))
    y = torch.randn(3, 8, generator=seed(5)) * 1000
    dst.copy_(y)
    assert_bitwise_equal(dst._data, ref_cast(y, scale, E5M2), "bytes")
    assert amax.item() == y.abs().max().item()


def test_copy_between_formats_requantizes():
    src = _quantize(torch.randn(5, 6, generator=seed(6)), E4M3)
    dst = _quantize(torch.zeros(5, 6), E5M2)
    dst.copy_(src)
    assert dst._fp8_dtype is E5M2
    assert_bitwise_equal(dst._data, _quantize(src.dequantize(), E5M2)._data, "E4M3 -> E5M2 bytes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_copy_quantized_to_plain_copies_values(t3, dtype):
    plain = torch.full(t3.shape, 7.0, dtype=dtype)
    plain.copy_(t3)
    assert type(plain) is torch.Tensor
    assert_bitwise_equal(plain, t3.dequantize(dtype=dtype), "values")


# ---- device / dtype moves and serialization ------------------------------------------------------

def test_to_copy_and_to_dtype(t3):
    moved = t3.to("cpu", copy=True)
    assert type(moved) is Float8Tensor and moved.dtype == t3.dtype
    assert_bitwise_equal(moved._data, t3._data, "bytes")
    assert_bitwise_equal(moved._scale_inv, t3._scale_inv, "scale_inv")
    assert not _same_storage(moved._data, t3._data)
    assert t3.to(torch.device("cpu")) is t3  # no move, no copy
    half = t3.to(torch.bfloat16)
    assert type(half) is Float8Tensor and half.dtype == torch.bfloat16
    assert_bitwise_equal(half._data, t3._data, "to(dtype) keeps the fp8 bytes")
    assert_bitwise_equal(half.dequantize(), t3.dequantize(dtype=torch.bfloat16), "bf16 values")
    back = half.float()
    assert type(back) is Float8Tensor and back.dtype == torch.float32
    assert_bitwise_equal(back.dequantize(), t3.dequantize(), "round trip of the nominal dtype")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning host memory needs CUDA")
def test_pin_memory(t3):
    pinned = t3.pin_memory()
    assert type(pinned) is Float8Tensor and pinned.is_pinned()
    assert pinned._data.is_pinned() and pinned._scale_inv.is_pinned()
    assert_bitwise_equal(pinned.dequantize(), t3.dequantize(), "values")


@pytest.mark.parametrize("weights_only", [True, False], ids=["weights_only", "full_pickle"])
@pytest.mark.parametrize("columnwise", [True, False], ids=["with_transpose", "rowwise_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_save_load_round_trip(weights_only, columnwise, dtype):
    x = (torch.randn(7, 12, generator=seed(7)) * 5).to(dtype)
    t = _quantize(x, E5M2, columnwise=columnwise)
    buffer = io.BytesIO()
    torch.save({"w": t, "view": t[2:5]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=weights_only)
    w = loaded["w"]
    assert type(w) is Float8Tensor and w.dtype == dtype and w._fp8_dtype is E5M2
    assert_bitwise_equal(w._data, t._data, "bytes")
    assert_bitwise_equal(w._scale_inv, t._scale_inv, "scale_inv")
    if columnwise:
        assert_bitwise_equal(w._transpose, t._transpose, "transpose")
    else:
        assert w._transpose is None
    assert_bitwise_equal(loaded["view"].dequantize(), t.dequantize()[2:5], "a saved view")
    w.add_(1.0)  # no quantizer travelled with it: in-place ops fall back to current scaling
    assert_bitwise_equal(w._data, _quantize(t.dequantize() + 1.0, E5M2)._data, "re-quantized")


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32], ids=str)
def test_dequantize_dtype(dtype):
    x = torch.randn(5, 3, generator=seed(8)).to(torch.bfloat16)
    t = _quantize(x)
    out = t.dequantize(dtype=dtype)
    want_dtype = dtype or torch.bfloat16
    assert type(out) is torch.Tensor and out.dtype == want_dtype
    values = t._data.view(E4M3).to(torch.float32) * t._scale_inv.item()
    assert_bitwise_equal(out, values.to(want_dtype), "fp8 * scale_inv in fp32, then cast")


# ---- everything else: plain results on dequantized values; in-place ops re-quantize -------------

def test_arithmetic_returns_plain_tensors():
    g = seed(9)
    t = _quantize(torch.randn(5, 16, generator=g))
    w = torch.randn(16, 3, generator=g)
    lin_w = torch.randn(7, 16, generator=g)
    bias = torch.randn(7, generator=g)
    deq = t.dequantize()
    cases = {
        "add": (t + 1, deq + 1),
        "matmul": (t @ w, deq @ w),
        "linear_input": (F.linear(t, lin_w, bias), F.linear(deq, lin_w, bias)),
        "linear_weight_view": (F.linear(lin_w, t[:3]), F.linear(lin_w, deq[:3])),
        "sum": (t.sum(), deq.sum()),
    }
    x = torch.randn(4, 16, generator=g)
    wt = _quantize(lin_w)
    cases["linear_fp8_weight"] = (F.linear(x, wt, bias), F.linear(x, wt.dequantize(), bias))
    for name, (got, want) in cases.items():
        assert type(got) is torch.Tensor, f"{name} returned {type(got).__name__}"
        assert_bitwise_equal(got, want, name)


@pytest.mark.parametrize("op, value", [("add_", 0.75), ("mul_", -3.0)])
def test_inplace_requantizes_current_scaling(op, value):
    t = _quantize(torch.randn(6, 11, generator=seed(10)))
    deq = t.dequantize()
    out = getattr(t, op)(value)
    assert out is t and type(t) is Float8Tensor
    want = _quantize(getattr(deq.clone(), op)(value))
    assert_bitwise_equal(t._data, want._data, f"{op} bytes")
    assert_bitwise_equal(t._scale_inv, want._scale_inv, f"{op} scale_inv")
    assert_bitwise_equal(t._transpose, want._transpose, f"{op} transpose")


@pytest.mark.parametrize("op, value", [("add_", 0.75), ("mul_", -3.0)])
def test_inplace_requantizes_delayed_scaling(op, value):
    scale, amax = torch.tensor([3.5]), torch.zeros(1)
    t = Float8Quantizer(scale, amax, E4M3)(torch.randn(6, 11, generator=seed(11)) * 20)
    deq = t.dequantize()
    getattr(t, op)(value)
    new_values = getattr(deq.clone(), op)(value)
    assert_bitwise_equal(t._data, ref_cast(new_values, scale, E4M3), f"{op} bytes")
    assert amax.item() == max(deq.abs().max().item(), new_values.abs().max().item())


# ---- usage: rowwise / columnwise copies, make_empty, internal storage ----------------------------

@pytest.mark.parametrize("shape", [(6, 10), (3, 5, 7), (11,)], ids=str)
def test_update_usage_creates_transpose(shape):
    t = _quantize(torch.randn(shape, generator=seed(12)), columnwise=False)
    assert t._transpose is None
    t.update_usage(columnwise_usage=True)
    last = shape[-1]
    assert t._transpose.shape == (last, t.numel() // last)
    assert t._transpose.is_contiguous()
    assert_bitwise_equal(t._transpose, t._data.reshape(-1, last).t(), "transposed bytes")
    # the quantizer's columnwise copy is the same thing
    assert_bitwise_equal(_quantize(t.dequantize())._transpose, t._transpose, "quantizer transpose")
    for view in (t.view(-1), t[:1], t.reshape(-1, last)):
        assert view._transpose is None


def test_rowwise_off_keeps_only_transpose():
    x = torch.randn(6, 10, generator=seed(13))
    q = Float8CurrentScalingQuantizer(E5M2)
    q.set_usage(rowwise=False)
    t = q(x)
    full = _quantize(x, E5M2)
    assert t._data is None and t._transpose is not None and t.shape == x.shape
    assert_bitwise_equal(t._transpose, full._transpose, "transpose")
    assert_bitwise_equal(t.dequantize(), full.dequantize(), "values from the transpose alone")
    assert_bitwise_equal(t[1:3].dequantize(), full.dequantize()[1:3], "a view of a transpose-only tensor")
    t.update_usage(rowwise_usage=True)
    assert_bitwise_equal(t._data, full._data, "rowwise bytes rebuilt from the transpose")
    t.update_usage(columnwise_usage=False)
    assert t._transpose is None
    with pytest.raises(ValueError, match="no columnwise copy"):
        t.update_usage(rowwise_usage=False)


def test_columnwise_off_and_both_off():
    q = Float8CurrentScalingQuantizer(E4M3)
    q.set_usage(columnwise=False)
    t = q(torch.randn(4, 4))
    assert t._data is not None and t._transpose is None
    q.set_usage(rowwise=False)
    with pytest.raises(ValueError, match="both rowwise and columnwise usage are off"):
        q(torch.randn(4, 4))


@pytest.mark.parametrize("kind", ["current", "delayed"])
@pytest.mark.parametrize("internal", [False, True], ids=["tensor", "internal"])
def test_make_empty(kind, internal):
    if kind == "current":
        q = Float8CurrentScalingQuantizer(E5M2)
    else:
        q = Float8Quantizer(torch.tensor([4.0]), torch.zeros(1), E5M2)
    q.internal = internal
    e = q.make_empty((3, 5, 7), dtype=torch.bfloat16)
    if internal:
        assert type(e) is Float8TensorStorage and not isinstance(e, torch.Tensor)
    else:
        assert type(e) is Float8Tensor and e.dtype == torch.bfloat16
    assert tuple(e.shape) == (3, 5, 7) and e._data.dtype is torch.uint8 and e._data.shape == (3, 5, 7)
    assert e._transpose.shape == (7, 15)
    assert e._scale_inv.item() == (0.25 if kind == "delayed" else 1.0)
    x = torch.randn(3, 5, 7, generator=seed(14))
    q.update_quantized(x, e)
    want = Float8CurrentScalingQuantizer(E5M2)(x) if kind == "current" else \
        Float8Quantizer(torch.tensor([4.0]), torch.zeros(1), E5M2)(x)
    assert_bitwise_equal(e._data, want._data, "make_empty then update_quantized")


def test_internal_quantize_returns_storage():
    x = torch.randn(6, 9, generator=seed(15))
    q = Float8CurrentScalingQuantizer(E4M3)
    q.internal = True
    s = q(x)
    assert type(s) is Float8TensorStorage and isinstance(s, QuantizedTensorStorage)
    assert not isinstance(s, torch.Tensor)
    full = _quantize(x)
    assert_bitwise_equal(s._data, full._data, "bytes")
    assert_bitwise_equal(s.dequantize(), full.dequantize(), "values")
    assert s.shape == x.shape


@pytest.mark.parametrize("kind", ["current", "delayed"])
def test_noop_flag(kind):
    g = seed(16)
    x1, x2 = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g) * 30
    if kind == "current":
        q = Float8CurrentScalingQuantizer(E4M3)
        state = lambda: (q.amax.clone(), q.scale.clone())  # noqa: E731
    else:
        q = Float8Quantizer(torch.tensor([2.0]), torch.zeros(1), E4M3)
        state = lambda: (q.amax.clone(),)  # noqa: E731
    dst = q(x1)
    before = (dst._data.clone(), dst._scale_inv.clone(), dst._transpose.clone())
    state_before = state()
    q.update_quantized(x2, dst, noop_flag=torch.tensor([1.0]))
    for name, old, new in zip(("bytes", "scale_inv", "transpose"), before,
                              (dst._data, dst._scale_inv, dst._transpose), strict=True):
        assert_bitwise_equal(new, old, f"noop: {name} changed")
    for old, new in zip(state_before, state(), strict=True):
        assert_bitwise_equal(new, old, "noop: quantizer state changed")
    q.update_quantized(x2, dst, noop_flag=torch.tensor([0.0]))
    want = Float8CurrentScalingQuantizer(E4M3)(x2) if kind == "current" else \
        Float8Quantizer(torch.tensor([2.0]), torch.zeros(1), E4M3)(x2)
    assert_bitwise_equal(dst._data, want._data, "flag 0: bytes updated")
    assert_bitwise_equal(dst._scale_inv, want._scale_inv, "flag 0: scale_inv updated")
    assert_bitwise_equal(dst._transpose, want._transpose, "flag 0: transpose updated")


def test_update_quantized_rejects_shape_mismatch():
    q = Float8CurrentScalingQuantizer(E4M3)
    with pytest.raises(ValueError, match=r"src shape \(4, 5\) != dst shape \(5, 4\)"):
        q.update_quantized(torch.randn(4, 5), q(torch.randn(5, 4)))


# ---- saving for backward -------------------------------------------------------------------------

class _QuantizedLinear(torch.autograd.Function):
    """y = (ref_quantize(x) @ w^T) * gain, saving (gain, None, w: Float8Tensor, xq: a custom-recipe
    storage) through prepare_for_saving; backward uses every one of them."""

    @staticmethod
    def forward(ctx, x, w, gain, log):
        xq = current_scaling_ref_quantizer_factory("input")(x)  # CurrentScalingTensorRef
        y = (xq.dequantize() @ w.dequantize().t()) * gain
        tensors, objects = prepare_for_saving(gain, None, w, xq)
        ctx.save_for_backward(*tensors)
        ctx.objects, ctx.log = objects, log
        log.append(("forward", len(tensors), [type(o).__name__ for o in objects], xq.data is None))
        return y

    @staticmethod
    def backward(ctx, gy):
        gain, nothing, w, xq = restore_from_saved(ctx.objects, ctx.saved_tensors)
        ctx.log.append(("backward", nothing, type(w).__name__, type(xq).__name__))
        grad_x = (gy * gain) @ w.dequantize()  # straight-through for the quantization of x
        grad_gain = (gy * (xq.dequantize() @ w.dequantize().t())).sum().reshape(gain.shape)
        return grad_x, None, grad_gain, None


def test_prepare_for_saving_through_autograd():
    g = seed(17)
    x = torch.randn(5, 12, generator=g, requires_grad=True)
    w = _quantize(torch.randn(7, 12, generator=g), E4M3)
    w_values = w.dequantize()
    gain = torch.tensor([1.5], requires_grad=True)
    gy = torch.randn(5, 7, generator=g)
    log = []

    y1 = _QuantizedLinear.apply(x, w, gain, log)
    # the caller's Float8Tensor is untouched by saving: it can be used again before backward
    assert w._data is not None and w._scale_inv is not None
    y2 = _QuantizedLinear.apply(x, w, gain, log)
    ((y1 + y2) * gy).sum().backward()

    # 7 saved tensors: gain, None, the Float8Tensor whole, and the 4 buffers of the storage
    slots = ["NoneType", "NoneType", "NoneType", "CurrentScalingTensorRef"]
    assert log[0] == ("forward", 7, slots, True), log
    assert [entry[1:] for entry in log[2:]] == [(None, "Float8Tensor", "CurrentScalingTensorRef")] * 2
    assert_bitwise_equal(w.dequantize(), w_values, "w after backward")

    xq_values = current_scaling_ref_quantizer_factory("input")(x.detach()).dequantize()
    assert_bitwise_equal(y1.detach(), (xq_values @ w_values.t()) * gain.detach(), "forward output")
    # grad_x: the same computation on plain tensors, through autograd
    x_plain = x.detach().clone().requires_grad_(True)
    ((x_plain @ w_values.t()) * gain.detach() * gy * 2).sum().backward()
    assert_bitwise_equal(x.grad, x_plain.grad, "grad of x")
    # grad_gain: the loss is linear in gain, so a central difference is exact up to rounding
    def loss(gv):
        with torch.no_grad():
            return 2 * (((xq_values @ w_values.t()) * gv) * gy).to(torch.float64).sum().item()
    h = 0.25
    numeric = (loss(1.5 + h) - loss(1.5 - h)) / (2 * h)
    torch.testing.assert_close(gain.grad.item(), numeric, rtol=1e-5, atol=1e-5)


def test_storage_prepare_and_restore_round_trip():
    q = Float8CurrentScalingQuantizer(E5M2)
    q.internal = True
    s = q(torch.randn(4, 6, generator=seed(18)))
    values = s.dequantize()
    plain = torch.ones(3)
    tensors, objects = prepare_for_saving(plain, s, None)
    assert objects == [None, s, None]
    assert len(tensors) == 1 + 3 + 1 and tensors[0] is plain and tensors[-1] is None
    assert s._data is None and s._scale_inv is None, "the storage hands its buffers over"
    restored = restore_from_saved(objects, tensors)
    assert restored[0] is plain and restored[1] is s and restored[2] is None
    assert_bitwise_equal(s.dequantize(), values, "restored values")
    with pytest.raises(ValueError, match="not consumed"):
        restore_from_saved([None], [plain, plain])


# ---- repr ------------------------------------------------------------------------------------------

def test_repr_real_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    t = _quantize(torch.tensor([[1.0, -2.0], [0.5, 4.0]]))
    text = repr(t)
    assert "float8_e4m3fn" in text and "scale_inv=" in text and "4." in text, text
    # torch.compile's trace logging reprs traced inputs, whose buffers are fake (no values)
    fake = FakeTensorMode(shape_env=ShapeEnv()).from_tensor(t)
    assert type(fake) is Float8Tensor
    text = repr(fake)
    assert text.startswith("Float8Tensor(fp8_dtype=torch.float8_e4m3fn") and "scale_inv" not in text


# ---- torch.compile -------------------------------------------------------------------------------
# Compiled and eager results are compared bit for bit: dequantization is one fp32 multiply per
# element in both, the GEMMs are the same extern aten kernels, and relu / *2 are exact, so any
# difference would mean the compiled graph computes something else (e.g. a stale scale). Only the
# bias gradient, a reduction whose summation order inductor chooses, is compared with a tolerance.

class _TinyBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 12)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2.0


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def compiled_with_fp8_input():
    torch.manual_seed(19)
    model = _TinyBlock()
    return model, torch.compile(model, backend="inductor", fullgraph=True)


@pytest.fixture(scope="module")
def compiled_with_fp8_weight():
    torch.manual_seed(20)
    model = _TinyBlock()
    weight = _quantize(model.lin.weight.detach(), E4M3)
    model.lin.weight = torch.nn.Parameter(weight, requires_grad=False)
    return model, torch.compile(model, backend="inductor", fullgraph=True)


def test_compile_float8_tensor_as_input(compiled_with_fp8_input):
    model, compiled = compiled_with_fp8_input
    g = seed(21)
    graphs = _graphs()
    for magnitude in (1.0, 300.0):  # a new scale must not need a recompile nor be baked in
        xq = _quantize(torch.randn(8, 16, generator=g) * magnitude, E4M3)
        with torch.no_grad():
            got, want = compiled(xq), model(xq)
        assert type(got) is torch.Tensor
        assert_bitwise_equal(got, want, f"compiled vs eager, magnitude {magnitude}")
    assert _graphs() - graphs <= 1, "a second Float8Tensor input recompiled"


def test_compile_float8_tensor_as_frozen_parameter(compiled_with_fp8_weight):
    model, compiled = compiled_with_fp8_weight
    assert type(model.lin.weight) is Float8Tensor and not model.lin.weight.requires_grad
    g = seed(22)
    x = torch.randn(8, 16, generator=g, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_(True)
    gy = torch.randn(8, 12, generator=g)
    graphs = _graphs()
    got, want = compiled(x), model(x_eager)
    assert_bitwise_equal(got.detach(), want.detach(), "forward")
    got.backward(gy)
    bias_grad_compiled = model.lin.bias.grad.clone()
    model.lin.bias.grad = None
    want.backward(gy)
    assert_bitwise_equal(x.grad, x_eager.grad, "grad of the input")
    # the bias gradient is a sum over the batch: inductor's reduction adds in another order
    torch.testing.assert_close(bias_grad_compiled, model.lin.bias.grad, rtol=1e-6, atol=1e-6)
    assert model.lin.weight.grad is None
    # new weights written in place (as an optimizer or a checkpoint load would) are picked up
    # (same grad mode as the first call: a change of grad mode is a guard and would recompile)
    with torch.no_grad():
        model.lin.weight.copy_(_quantize(torch.randn(12, 16, generator=g) * 7, E4M3))
    assert_bitwise_equal(compiled(x).detach(), model(x).detach(), "after an in-place weight update")
    assert _graphs() - graphs <= 1, "the weight update recompiled"
