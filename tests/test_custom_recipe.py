"""The reference current-scaling custom recipe against the built-in quantizer, and the helpers of
te_compile.tensor.utils that custom recipes and distributed optimizers use."""

from __future__ import annotations

import pytest
import torch

from te_compile.custom_recipes.quantization_current_scaling import (
    CurrentScalingQuantizerRef,
    CurrentScalingTensorRef,
    current_scaling_ref_quantizer_factory,
)
from te_compile.recipe import ROLES, CustomRecipe, Format
from te_compile.tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8TensorStorage
from te_compile.tensor.utils import is_custom, replace_raw_data
from utils import FLT_MAX, FP8_DTYPES, assert_bitwise_equal, assert_sqnr_at_least, fp8_id, seed

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2



def _assert_same_quantization(ref, built, msg):
    """A CurrentScalingTensorRef and a Float8Tensor hold the same bytes, scale_inv and transpose."""
    assert_bitwise_equal(ref.data.view(torch.uint8), built._data, f"{msg}: bytes")
    assert_bitwise_equal(ref.scale_inv, built._scale_inv, f"{msg}: scale_inv")
    if ref.data_t is not None or built._transpose is not None:
        assert_bitwise_equal(ref.data_t.view(torch.uint8), built._transpose, f"{msg}: transpose")
    assert_bitwise_equal(ref.dequantize(), built.dequantize(), f"{msg}: values")


@pytest.mark.parametrize("role", ROLES)
def test_factory_roles_follow_hybrid(role):
    q = current_scaling_ref_quantizer_factory(role)
    assert isinstance(q, CurrentScalingQuantizerRef)
    assert q.dtype is Format.HYBRID.dtype_for(role)


def test_factory_rejects_unknown_role():
    with pytest.raises(ValueError, match=r"role must be one of .*'grad_output'.*got 'bias'"):
        current_scaling_ref_quantizer_factory("bias")


def test_custom_recipe_accepts_the_factory():
    recipe = CustomRecipe(qfactory=current_scaling_ref_quantizer_factory)
    assert recipe.custom() and recipe.qfactory("weight").dtype is E4M3


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("shape", [(37, 53), (5, 3, 16), (11,)], ids=str)
def test_matches_builtin_across_magnitudes(role, shape):
    ref_q = current_scaling_ref_quantizer_factory(role)
    g = seed(len(role) + len(shape))
    base = torch.randn(shape, generator=g)
    for k in range(-30, 31):
        x = base * 10.0**k
        built = Float8CurrentScalingQuantizer(ref_q.dtype)(x)
        _assert_same_quantization(ref_q(x), built, f"{role} x 1e{k}")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("pow2, eps", [(True, 0.0), (False, 1e-2), (True, 1e-2)])
def test_matches_builtin_with_options(fp8_dtype, pow2, eps):
    g = seed(3)
    for magnitude in (1e-5, 1e-3, 0.37, 1.0, 123.0, 1e20):
        x = torch.randn(23, 31, generator=g) * magnitude
        ref = CurrentScalingQuantizerRef(fp8_dtype, force_pow_2_scales=pow2, amax_epsilon=eps)(x)
        built = Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=pow2, amax_epsilon=eps)(x)
        _assert_same_quantization(ref, built, f"pow2={pow2} eps={eps} magnitude {magnitude}")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("case", ["zeros", "inf", "nan", "tiny", "flt_max"])
def test_matches_builtin_on_edge_inputs(fp8_dtype, case):
    x = torch.randn(6, 7, generator=seed(4))
    if case == "zeros":
        x = torch.zeros(6, 7)
    elif case == "inf":
        x[2, 3] = -float("inf")
    elif case == "nan":
        x[1, 1] = float("nan")
    elif case == "tiny":
        x = x * 1e-41
    elif case == "flt_max":
        x[0, 0] = FLT_MAX
    ref = CurrentScalingQuantizerRef(fp8_dtype)(x)
    built = Float8CurrentScalingQuantizer(fp8_dtype)(x)
    _assert_same_quantization(ref, built, case)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_qgemm_is_dequantize_matmul(bias):
    g = seed(5)
    x = torch.randn(5, 3, 48, generator=g)
    w = torch.randn(24, 48, generator=g) * 0.1
    b = torch.randn(24, generator=g) if bias else None
    qa = current_scaling_ref_quantizer_factory("input")
    qw = current_scaling_ref_quantizer_factory("weight")
    a_q, w_q = qa(x), qw(w)
    out = qa.qgemm(a_q, w_q, bias=b)
    want = a_q.dequantize() @ w_q.dequantize().t()
    if bias:
        want = want + b
    assert out.shape == (5, 3, 24) and out.dtype is torch.float32
    assert_bitwise_equal(out, want, "qgemm")
    high = x @ w.t() + (b if bias else 0)
    assert_sqnr_at_least(high, out, 25.0, "E4M3 x E4M3 GEMM against fp32")
    assert qa.qgemm(a_q, w_q, out_dtype=torch.bfloat16).dtype is torch.bfloat16


def test_ref_tensor_usage_and_saving():
    q = current_scaling_ref_quantizer_factory("grad_output")
    x = torch.randn(9, 4, generator=seed(6))
    t = q(x)
    values = t.dequantize()
    t.update_usage(rowwise_usage=False)
    assert t.data is None
    assert_bitwise_equal(t.dequantize(), values, "values from the transpose")
    tensors, same = t.prepare_for_saving()
    assert same is t and t.data_t is None and len(tensors) == 4
    assert t.restore_from_saved(tensors + ["rest"]) == ["rest"]
    assert_bitwise_equal(t.dequantize(), values, "restored")


# ---- is_custom ----------------------------------------------------------------------------------

def test_is_custom():
    x = torch.randn(4, 8, generator=seed(7))
    ref_q = current_scaling_ref_quantizer_factory("input")
    assert is_custom(ref_q) and is_custom(ref_q(x))
    assert isinstance(ref_q(x), CurrentScalingTensorRef)
    current = Float8CurrentScalingQuantizer(E4M3)
    delayed = Float8Quantizer(torch.ones(1), torch.zeros(1), E4M3)
    for q in (current, delayed):
        assert not is_custom(q) and not is_custom(q(x))
    current.internal = True
    assert not is_custom(current(x))
    assert not is_custom(x) and not is_custom(None)

    class MyQuantizer(Float8CurrentScalingQuantizer):
        custom = True

    mine = MyQuantizer(E4M3)
    assert is_custom(mine) and is_custom(mine(x)), "a tensor made by a custom quantizer is custom"


# ---- replace_raw_data ------------------------------------------------------------------------------

@pytest.mark.parametrize("internal", [False, True], ids=["tensor", "internal"])
def test_replace_raw_data_moves_bytes_into_caller_buffer(internal):
    q = Float8CurrentScalingQuantizer(E5M2)
    q.internal = internal
    t = q(torch.randn(6, 10, generator=seed(8)) * 9)
    old_bytes, values = t._data.clone(), t.dequantize()
    flat = torch.zeros(100 + 60, dtype=torch.uint8)  # e.g. one contiguous ZeRO shard
    target = flat[100:].view(6, 10)
    replace_raw_data(t, target)
    assert t._data is target
    assert t._data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert_bitwise_equal(flat[100:].view(6, 10), old_bytes, "bytes in the caller's buffer")
    assert_bitwise_equal(t.dequantize(), values, "values unchanged")
    assert int(flat[:100].count_nonzero()) == 0, "bytes written outside the target"
    flat[100] = 0  # the tensor now reads from the caller's buffer
    assert t._data[0, 0].item() == 0


def test_replace_raw_data_rejects_bad_buffers():
    t = Float8CurrentScalingQuantizer(E4M3)(torch.randn(6, 10))
    with pytest.raises(ValueError, match=r"torch.uint8 of shape \(6, 10\), got torch.uint8 of shape \(60,\)"):
        replace_raw_data(t, torch.empty(60, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"got torch.int8 of shape \(6, 10\)"):
        replace_raw_data(t, torch.empty(6, 10, dtype=torch.int8))
    with pytest.raises(ValueError, match="needs a Float8Tensor"):
        replace_raw_data(current_scaling_ref_quantizer_factory("input")(torch.randn(6, 10)),
                         torch.empty(6, 10, dtype=torch.uint8))
    q = Float8CurrentScalingQuantizer(E4M3)
    q.set_usage(rowwise=False)
    with pytest.raises(ValueError, match="no rowwise data"):
        replace_raw_data(q(torch.randn(6, 10)), torch.empty(6, 10, dtype=torch.uint8))
    assert isinstance(t, Float8TensorStorage)
