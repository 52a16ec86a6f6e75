"""GroupedFloat8Tensor: an expert weight as E per-tensor FP8 matrices, one scale each."""

from __future__ import annotations

import io

import pytest
import torch

from te_compile.recipe import Float8CurrentScaling
from te_compile.scaling import quantize_per_expert
from te_compile.tensor import Float8Tensor
from te_compile.tensor.grouped_float8_tensor import GroupedFloat8Tensor, GroupedFsdpMeta, fsdp_grouped_post_all_gather
from utils import assert_bitwise_equal, seed

E, N, K = 4, 48, 32


def _weight(dtype=torch.bfloat16):
    w = torch.randn(E, N, K, generator=seed(40)) * torch.tensor([1.0, 10.0, 0.01, 3.0]).view(E, 1, 1)
    data, scale_inv, amax = quantize_per_expert(w, "weight", Float8CurrentScaling())
    return w, GroupedFloat8Tensor(data=data.view(torch.uint8), scale_inv=scale_inv, fp8_dtype=data.dtype, dtype=dtype,
                                  amax=amax)


def test_dequantize_uses_each_experts_own_scale():
    w, g = _weight()
    assert g.dtype == torch.bfloat16 and g.shape == (E, N, K)
    values = g.dequantize(dtype=torch.float32)
    for e in range(E):
        scale_inv = g._scale_inv[e]
        assert_bitwise_equal(values[e], g._data[e].view(torch.float8_e4m3fn).float() * scale_inv, f"expert {e}")
        assert (values[e] - w[e]).abs().max() <= w[e].abs().max() / 8, "within E4M3's relative step"


def test_views_keep_the_experts_and_w_e_is_that_experts_float8_tensor():
    _, g = _weight()
    t = g.transpose(-2, -1)
    assert isinstance(t, GroupedFloat8Tensor) and t.shape == (E, K, N) and t._scale_inv is not None
    assert_bitwise_equal(t.dequantize(), g.dequantize().transpose(-2, -1))
    cast = g.float()
    assert isinstance(cast, GroupedFloat8Tensor) and cast.dtype == torch.float32 and torch.equal(cast._data, g._data)
    one = g[2]
    assert isinstance(one, Float8Tensor) and one.shape == (N, K)
    assert_bitwise_equal(one.dequantize(), g.dequantize()[2])
    # a view that mixes experts (dim 0 moved) falls back to the values
    mixed = g.transpose(0, 1)
    assert type(mixed) is torch.Tensor and torch.equal(mixed, g.dequantize().transpose(0, 1))
    assert type(g + 1) is torch.Tensor


def test_fsdp_post_all_gather_pads_then_trims_the_padding_experts():
    _, g = _weight(torch.float32)
    padded = torch.cat([g._data, torch.zeros(2, N, K, dtype=torch.uint8)])   # FSDP's padded shards
    meta = GroupedFsdpMeta(g._scale_inv, g._fp8_dtype, g._amax, None)
    gathered, (buffer,) = fsdp_grouped_post_all_gather((padded,), meta, torch.float32)
    assert gathered.shape == (E + 2, N, K) and torch.equal(gathered._scale_inv[E:], torch.ones(2))
    trimmed = torch.as_strided(gathered, (E, N, K), (N * K, K, 1))
    assert isinstance(trimmed, GroupedFloat8Tensor)
    assert_bitwise_equal(trimmed.dequantize(), g.dequantize())
    # a re-gather into the same buffer refreshes the scales in place
    new_meta = GroupedFsdpMeta(g._scale_inv * 2, g._fp8_dtype, g._amax, None)
    assert fsdp_grouped_post_all_gather((padded,), new_meta, torch.float32, out=trimmed) is None
    assert torch.equal(trimmed._scale_inv, g._scale_inv * 2)
    with pytest.raises(RuntimeError, match="new buffer"):
        fsdp_grouped_post_all_gather((padded.clone(),), new_meta, torch.float32, out=trimmed)


def test_in_place_updates_requantize_each_expert_and_checkpoints_hold_values():
    _, g = _weight(torch.float32)
    doubled = g.dequantize() * 2
    g.mul_(2.0)   # runs on the values, then each expert is quantized back with its own new scale
    data, scale_inv, _ = quantize_per_expert(doubled, "weight", Float8CurrentScaling())
    assert_bitwise_equal(g._data, data.view(torch.uint8), "bytes")
    assert_bitwise_equal(g._scale_inv, scale_inv, "scales")
    buffer = io.BytesIO()
    torch.save(g, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, g.dequantize())


def test_bad_buffers_are_named():
    data = torch.zeros(E, N, K, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"_scale_inv must be fp32 \[4\] \(one per expert\), got torch.float32 "
                                         r"of shape \(1,\)"):
        GroupedFloat8Tensor(data=data, scale_inv=torch.ones(1), fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="uint8 view"):
        GroupedFloat8Tensor(data=data.float(), scale_inv=torch.ones(E), fp8_dtype=torch.float8_e4m3fn)
