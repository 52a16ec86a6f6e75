"""Per-tensor FP8 numerics (DESIGN.md §5): te_compile.scaling and the two per-tensor
quantizers, checked bit for bit against the plain-torch reference in tests/utils.py (fp64 division
rounded once to fp32 for the scale, clamp then cast for the data)."""

from __future__ import annotations

import math

import pytest
import torch

from te_compile.tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from te_compile.scaling import (
    cast_to_fp8,
    compute_scale,
    delayed_scale_from_history,
    fp8_max,
    tensor_amax,
    update_amax_history,
)
from utils import (
    FLT_MAX,
    FP8_DTYPES,
    FP8_MAX,
    assert_bitwise_equal,
    fp8_id,
    ref_amax,
    ref_cast,
    ref_dequantize,
    ref_scale,
    ref_scale_inv,
    seed,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(1,), (7,), (1, 13), (33, 1), (611, 782), (2, 3, 5, 7)]


def _amax32(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


def _check_current_scaling(x, fp8_dtype, *, pow2=False, eps=0.0):
    """Quantize with Float8CurrentScalingQuantizer and compare every buffer with the reference."""
    q = Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=pow2, amax_epsilon=eps)
    t = q(x)
    scale = ref_scale(ref_amax(x), fp8_dtype, force_pow_2=pow2, amax_epsilon=eps)
    assert_bitwise_equal(q.scale, scale, "scale")
    assert_bitwise_equal(t._scale_inv, ref_scale_inv(scale), "scale_inv")
    assert_bitwise_equal(t._data, ref_cast(x, scale, fp8_dtype), "fp8 bytes")
    assert t._fp8_dtype is fp8_dtype
    assert_bitwise_equal(t.dequantize(), ref_dequantize(t._data, t._scale_inv, fp8_dtype, x.dtype),
                         "dequantized")
    return t, scale


# ---- current scaling: quantizer against the reference --------------------------------------------

@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_current_scaling_bit_exact(fp8_dtype, shape, pow2):
    g = seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3.7
    x.view(-1)[0] = 11.3  # an outlier sets the amax: most elements use only part of the range
    t, scale = _check_current_scaling(x, fp8_dtype, pow2=pow2)
    assert t.shape == x.shape and t._data.dtype is torch.uint8


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_current_scaling_low_precision_input(fp8_dtype, dtype):
    x = (torch.randn(37, 129, generator=seed(1)) * 100).to(dtype)
    t, _ = _check_current_scaling(x, fp8_dtype)
    assert t.dtype is dtype and t.dequantize().dtype is dtype


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_pow2_scale_rounds_down(fp8_dtype):
    g = seed(2)
    for _ in range(50):
        amax = float(torch.rand(1, generator=g)) * 10.0 ** float(torch.randint(-20, 20, (1,), generator=g))
        exact = compute_scale(_amax32(amax), fp8_dtype)
        pow2 = compute_scale(_amax32(amax), fp8_dtype, force_pow_2_scales=True)
        mantissa, _ = math.frexp(pow2.item())
        assert mantissa == 0.5, f"pow2 scale {pow2.item()!r} is not a power of two (amax {amax!r})"
        assert pow2.item() <= exact.item() < 2 * pow2.item(), (
            f"amax {amax!r}: pow2 scale {pow2.item()!r} is not the largest power of two <= {exact.item()!r}")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("eps", [1e-3, 0.7])
def test_amax_epsilon_clamps_amax_up(fp8_dtype, eps):
    x = torch.randn(19, 23, generator=seed(3)) * 1e-4  # amax ~4e-4 < eps
    t, scale = _check_current_scaling(x, fp8_dtype, eps=eps)
    eps32 = torch.tensor(eps, dtype=torch.float32).item()
    assert_bitwise_equal(scale, ref_scale(eps32, fp8_dtype), "scale from the epsilon, not the amax")
    no_eps = Float8CurrentScalingQuantizer(fp8_dtype)(x)
    assert not torch.equal(no_eps._scale_inv, t._scale_inv), "epsilon had no effect"
    # an epsilon below the amax changes nothing
    y = torch.randn(19, 23, generator=seed(3)) * 10
    big = Float8CurrentScalingQuantizer(fp8_dtype, amax_epsilon=1e-3)(y)
    plain = Float8CurrentScalingQuantizer(fp8_dtype)(y)
    assert_bitwise_equal(big._data, plain._data, "bytes with a small epsilon")
    assert_bitwise_equal(big._scale_inv, plain._scale_inv, "scale_inv with a small epsilon")


def _edge_input(name: str) -> torch.Tensor:
    x = torch.randn(5, 9, generator=seed(4))
    if name == "zeros":
        return torch.zeros(5, 9)
    if name == "near_flt_max":
        x[0, 0], x[1, 1], x[2, 2] = FLT_MAX, -FLT_MAX / 3, 3e37
        return x
    if name == "tiny":  # amax subnormal: 448 / amax overflows fp32
        return torch.tensor([[1e-40, -3e-41, 0.0], [5e-39, -2e-39, 1e-45]])
    if name == "pos_inf":
        x[1, 2] = math.inf
        return x
    if name == "neg_inf":
        x[3, 4] = -math.inf
        return x
    if name == "nan":
        x[0, 3] = math.nan
        return x
    if name == "single":
        return torch.tensor([-0.3])
    raise AssertionError(name)


EDGE_SCALE = {"zeros": 1.0, "tiny": FLT_MAX, "pos_inf": 1.0, "neg_inf": 1.0, "nan": 1.0}


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("case", ["zeros", "near_flt_max", "tiny", "pos_inf", "neg_inf", "nan", "single"])
def test_current_scaling_edge_cases(fp8_dtype, case):
    x = _edge_input(case)
    t, scale = _check_current_scaling(x, fp8_dtype)
    if case in EDGE_SCALE:
        assert scale.item() == EDGE_SCALE[case], f"{case}: scale {scale.item()!r}"
    fp8 = t._data.view(fp8_dtype).float()
    assert not torch.isinf(fp8).any(), f"{case}: inf in the fp8 bytes"
    if case in ("pos_inf", "neg_inf"):
        # the infinite element saturates, the rest are cast with scale 1
        sign = 1.0 if case == "pos_inf" else -1.0
        assert (fp8 == sign * FP8_MAX[fp8_dtype]).sum() >= 1
    if case == "nan":
        assert torch.isnan(fp8[0, 3]) and torch.isnan(fp8).sum() == 1
    if case == "zeros":
        assert int(t._data.count_nonzero()) == 0
    if case == "tiny":
        assert int(t._data.count_nonzero()) > 0, "the tiny values should be representable after scaling"


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_saturation_clamps_to_max(fp8_dtype):
    fmax = FP8_MAX[fp8_dtype]
    x = torch.tensor([fmax * 1.01, -fmax * 4, fmax * (1 + 2**-5), 1e30, -1e30, fmax, -fmax, 1.0])
    # torch's own cast of these values: e5m2 overflows to inf on CPU (the reason for the clamp)
    if fp8_dtype is E5M2:
        assert torch.isinf(x.to(fp8_dtype).float()).any()
    for scale in (1.0, 3.5):
        q = Float8Quantizer(torch.tensor([scale]), torch.zeros(1), fp8_dtype)
        values = q(x / scale * scale)._data.view(fp8_dtype).float()
        direct = cast_to_fp8(x, torch.tensor([scale]), fp8_dtype).float()
        for got in (values, direct):
            assert not torch.isinf(got).any(), f"inf in {got}"
            assert got[:7].abs().eq(fmax).all(), f"not saturated to ±{fmax}: {got}"
            assert torch.equal(torch.sign(got[:7]), torch.sign(x[:7]))


# ---- compute_scale directly -----------------------------------------------------------------------

AMAXES = [1.0, 3.0, 448.0, 57344.0, 0.1, 4.9725661277771, 1e-30, 1e-40, FLT_MAX, 3e38, 0.0,
          math.inf, math.nan]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("amax", AMAXES, ids=repr)
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_compute_scale(fp8_dtype, amax, pow2):
    got = compute_scale(_amax32(amax), fp8_dtype, force_pow_2_scales=pow2)
    assert got.dtype is torch.float32 and got.shape == (1,)
    want = ref_scale(_amax32(amax).item(), fp8_dtype, force_pow_2=pow2)
    assert_bitwise_equal(got, want, f"scale for amax {amax!r}")


@pytest.mark.parametrize("amax, eps", [(1e-6, 1e-3), (2.0, 1e-3), (0.0, 0.5), (math.nan, 0.5),
                                       (math.inf, 0.5), (1e-40, 1e-30)])
def test_compute_scale_epsilon(amax, eps):
    got = compute_scale(_amax32(amax), E4M3, amax_epsilon=eps)
    assert_bitwise_equal(got, ref_scale(_amax32(amax).item(), E4M3, amax_epsilon=eps),
                         f"amax {amax!r} eps {eps!r}")


@pytest.mark.parametrize("amax", [-2.0, -1e-40, -math.inf], ids=repr)
def test_compute_scale_negative_amax_gives_one(amax):
    # an amax is a magnitude: a negative one is as unusable as NaN, whatever the recipe
    assert compute_scale(_amax32(amax), E4M3).item() == 1.0
    history = torch.tensor([amax, amax, amax])
    assert delayed_scale_from_history(history, torch.tensor([7.0]), E4M3).item() == 7.0


@pytest.mark.parametrize("margin", [1, 3])
def test_compute_scale_margin(margin):
    got = compute_scale(_amax32(4.9725661277771), E5M2, margin=margin)
    assert_bitwise_equal(got, ref_scale(_amax32(4.9725661277771).item(), E5M2, margin=margin))


# An amax where 448.0 / amax (a Python scalar over a tensor: reciprocal then multiply in torch) is one
# ulp off the correctly rounded quotient (DESIGN.md §6).
_SCALAR_DIV_AMAX_BITS = 1084170051  # 4.9725661277771


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_compute_scale_uses_true_division(fp8_dtype):
    fmax = FP8_MAX[fp8_dtype]
    g = seed(5)
    amaxes = torch.rand(4096, generator=g) * 10 + 0.01
    amaxes[0] = torch.tensor(_SCALAR_DIV_AMAX_BITS, dtype=torch.int32).view(torch.float32)
    correct = (fmax / amaxes.to(torch.float64)).to(torch.float32)
    scalar_div = fmax / amaxes
    differ = (scalar_div != correct).nonzero().flatten()
    # precondition: the pitfall exists on this build, otherwise the test would prove nothing
    assert len(differ) > 100, f"only {len(differ)} of 4096 amaxes show the scalar-division error"
    for i in differ[:40].tolist():
        a = amaxes[i : i + 1].clone()
        assert (fmax / a).item() != correct[i].item()  # the [1]-shaped case differs as well
        assert_bitwise_equal(compute_scale(a, fp8_dtype), correct[i : i + 1], f"amax {a.item()!r}")
        t = Float8CurrentScalingQuantizer(fp8_dtype)(torch.tensor([a.item(), -0.5 * a.item()]))
        assert_bitwise_equal(t._scale_inv, ref_scale_inv(correct[i : i + 1]), f"scale_inv, amax {a.item()!r}")


# ---- small helpers -----------------------------------------------------------------------------------

def test_fp8_max_and_bad_dtype():
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0
    with pytest.raises(ValueError, match=r"fp8_dtype must be one of .*float8_e4m3fn.*float8_e5m2.*bfloat16"):
        fp8_max(torch.bfloat16)


def test_tensor_amax():
    x = torch.tensor([[1.0, -7.5], [3.0, 2.0]], dtype=torch.bfloat16)
    amax = tensor_amax(x)
    assert amax.dtype is torch.float32 and amax.shape == (1,) and amax.item() == 7.5
    empty = tensor_amax(torch.empty(0, 4))
    assert empty.shape == (1,) and empty.item() == 0.0
    assert math.isnan(tensor_amax(torch.tensor([1.0, math.nan])).item())


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_tensor_amax_of_a_data_dependent_row_count_compiles_and_may_be_empty():
    """One expert's tokens (torch.where): the row count is unknown when traced, and 0 at run time must
    give 0, not amax's error on an empty tensor."""
    torch._dynamo.reset()
    pick = torch.compile(lambda x, e: tensor_amax(x[torch.where(x[:, 0] > e)[0]]), fullgraph=True, dynamic=False)
    x = torch.tensor([[1.0, -7.5], [3.0, 2.0], [-2.0, 9.0]])
    assert pick(x, 0.0).item() == 7.5 and pick(x, 2.0).item() == 3.0
    assert pick(x, 5.0).item() == 0.0


# ---- delayed scaling: Float8Quantizer with a given scale -----------------------------------------

@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("scale", [0.375, 1.0, 3.5])
@pytest.mark.parametrize("shape", [(7,), (61, 45), (2, 3, 17)], ids=str)
def test_delayed_quantizer_uses_given_scale(fp8_dtype, scale, shape):
    x = torch.randn(shape, generator=seed(6)) * 90  # with scale 3.5 some E4M3 values saturate
    scale_t = torch.tensor([scale])
    q = Float8Quantizer(scale_t, torch.zeros(1), fp8_dtype)
    t = q(x)
    assert_bitwise_equal(t._data, ref_cast(x, scale_t, fp8_dtype), "fp8 bytes")
    assert_bitwise_equal(t._scale_inv, ref_scale_inv(scale_t), "scale_inv")
    assert t._scale_inv.item() == torch.tensor(1.0 / scale, dtype=torch.float32).item()
    assert_bitwise_equal(t.dequantize(), ref_dequantize(t._data, t._scale_inv, fp8_dtype), "dequantized")


def test_delayed_quantizer_accumulates_amax_in_callers_tensor():
    scale, amax = torch.tensor([2.0]), torch.zeros(1)
    q = Float8Quantizer(scale, amax, E4M3)
    q(torch.tensor([1.0, -5.0, 2.0]))
    assert amax.item() == 5.0, "the caller's amax tensor was not updated in place"
    q(torch.tensor([-3.0, 4.0]))
    assert amax.item() == 5.0, "amax must be a running max, not the last tensor's"
    q(torch.tensor([[0.5, -9.25]]))
    assert amax.item() == 9.25
    assert q.amax is amax
    # the scale is read at quantize time: an update by the recipe applies to the next call
    scale.fill_(0.25)
    t = q(torch.tensor([8.0, -16.0]))
    assert t._scale_inv.item() == 4.0
    assert t.dequantize().tolist() == [8.0, -16.0]


def test_delayed_quantizer_validates_state():
    with pytest.raises(ValueError, match="scale must be an fp32 tensor with one element"):
        Float8Quantizer(torch.ones(1, dtype=torch.float16), torch.zeros(1), E4M3)
    with pytest.raises(ValueError, match="amax must be an fp32 tensor with one element"):
        Float8Quantizer(torch.ones(1), torch.zeros(2), E4M3)
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        Float8Quantizer(torch.ones(1), torch.zeros(1), torch.int8)
    with pytest.raises(ValueError, match="amax_epsilon"):
        Float8CurrentScalingQuantizer(E4M3, amax_epsilon=-1.0)


# ---- delayed scaling: history and next scale ------------------------------------------------------

def test_update_amax_history_order():
    history = torch.tensor([4.0, 3.0, 2.0, 1.0])  # most recent first
    new = update_amax_history(history, torch.tensor([9.0]))
    assert new.tolist() == [9.0, 4.0, 3.0, 2.0], "newest first, the oldest falls off"
    assert history.tolist() == [4.0, 3.0, 2.0, 1.0], "the input history must not change"
    newer = update_amax_history(new, torch.tensor([0.5]))
    assert newer.tolist() == [0.5, 9.0, 4.0, 3.0]
    assert update_amax_history(torch.tensor([7.0]), torch.tensor([2.0])).tolist() == [2.0]


HISTORY = [3.3, 0.7, 5.1, 1.9]  # most recent first; max 5.1


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("algo, amax_index", [("max", 2), ("most_recent", 0)])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_scale_from_history(fp8_dtype, algo, amax_index, margin):
    history = torch.tensor(HISTORY)
    got = delayed_scale_from_history(history, torch.tensor([7.0]), fp8_dtype, margin=margin,
                                     amax_compute_algo=algo)
    want = ref_scale(history[amax_index].item(), fp8_dtype, margin=margin)
    assert_bitwise_equal(got, want, f"{algo} margin={margin}")


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("bad", [0.0, math.inf, math.nan])
def test_delayed_scale_keeps_previous_on_bad_amax(algo, bad):
    prev = torch.tensor([7.0])
    history = torch.tensor([bad, 0.0, 0.0]) if bad == 0.0 else torch.tensor([bad, 2.0, 1.0])
    got = delayed_scale_from_history(history, prev, E4M3, amax_compute_algo=algo)
    assert got.item() == 7.0, f"{algo}: amax {bad} must keep the previous scale, got {got.item()}"


def test_delayed_scale_most_recent_ignores_older_nan():
    got = delayed_scale_from_history(torch.tensor([2.0, math.nan]), torch.tensor([7.0]), E4M3,
                                     amax_compute_algo="most_recent")
    assert got.item() == 224.0


def test_delayed_scale_tiny_amax_gives_flt_max():
    got = delayed_scale_from_history(torch.tensor([1e-40, 0.0]), torch.tensor([7.0]), E4M3)
    assert got.item() == FLT_MAX


def test_delayed_scale_callable_algos():
    history = torch.tensor(HISTORY)
    mean = delayed_scale_from_history(history, torch.tensor([1.0]), E4M3,
                                      amax_compute_algo=lambda h: h.mean())
    assert_bitwise_equal(mean, ref_scale(history.mean().item(), E4M3), "callable amax_compute_algo")
    seen = {}

    def doubling(amax, scale, fmax, recipe):
        seen.update(amax=amax.item(), scale=scale.item(), fmax=fmax, recipe=recipe)
        return scale * 2

    marker = object()
    got = delayed_scale_from_history(history, torch.tensor([3.0]), E5M2,
                                     scaling_factor_compute_algo=doubling, recipe=marker)
    assert got.tolist() == [6.0]
    assert seen == {"amax": history.max().item(), "scale": 3.0, "fmax": 57344.0, "recipe": marker}
    with pytest.raises(ValueError, match="amax_compute_algo must be 'max', 'most_recent' or a callable"):
        delayed_scale_from_history(history, torch.tensor([1.0]), E4M3, amax_compute_algo="mean")


def test_scale_invs_is_one_op_with_the_bits_of_one_division_per_scale():
    # DelayedScaling's scales are graph inputs: a division each is a one-element kernel on a GPU, so a
    # site divides all of its scales in one foreach op (one kernel), with the bits of torch.div each.
    from torch.fx.experimental.proxy_tensor import make_fx

    from te_compile.scaling import scale_invs

    scales = [torch.tensor([448.0 / 3.1]), None, torch.tensor([3.0e-39]), torch.tensor([FLT_MAX]),
              torch.rand(4, generator=torch.Generator().manual_seed(0)) * 1e4]
    invs = scale_invs(*scales)
    for s, inv in zip(scales, invs):
        if s is None:
            assert inv is None
        else:
            assert inv.shape == s.shape and torch.equal(inv, torch.div(torch.ones_like(s), s)), (s, inv)
    assert scale_invs(None, None) == [None, None]
    graph = make_fx(lambda a, b, c: scale_invs(a, b, c))(scales[0], scales[2], scales[4]).graph
    ops = [n.target for n in graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.aten._foreach_div.List) == 1 and torch.ops.aten.div.Tensor not in ops, ops


def test_delayed_linear_forward_divides_its_scales_once():
    # the input's and the weight's inverse in one op: before, two one-element divisions per linear
    from torch.fx.experimental.proxy_tensor import make_fx

    from te_compile.distributed import NO_GROUPS
    from te_compile.lowerings.linear import Fp8LinearFunction
    from te_compile.recipe import DelayedScaling

    recipe = DelayedScaling()
    x, w = torch.randn(32, 64), torch.randn(48, 64)
    xs, ws, gs = torch.tensor([2.0]), torch.tensor([3.0]), torch.tensor([0.5])

    def fwd(x, w, xs, ws, gs):
        return Fp8LinearFunction.apply(x, w, recipe, NO_GROUPS, None, xs, ws, gs)

    graph = make_fx(fwd)(x, w, xs, ws, gs).graph
    ops = [n.target for n in graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.aten._foreach_div.List) == 1 and torch.ops.aten.div.Tensor not in ops, ops
    # and the bits the per-scale divisions gave: the CPU GEMM's own operations on the reference's FP8
    # values, each scaled by torch.div's inverse (fp32, row-major operands)
    y = fwd(x, w, xs, ws, gs)
    x8 = torch.clamp(x * xs, -448, 448).to(torch.float8_e4m3fn).float()
    w8 = torch.clamp(w * ws, -448, 448).to(torch.float8_e4m3fn).float()
    ref = (x8 * torch.div(torch.ones(1), xs)) @ (w8.t() * torch.div(torch.ones(1), ws)).contiguous()
    assert_bitwise_equal(y, ref)
