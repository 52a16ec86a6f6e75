"""The multi-tensor delayed-scaling update (kernels/delayed_update.py): the stacked reference
equals ``update_role_state`` row by row, bit for bit, on the edge amaxes (NaN, inf, 0, subnormal);
the Triton kernel equals the reference in Triton's interpreter (on the GPU when there is one),
including histories longer than one of its chunks; the custom op mutates its list arguments in place,
eagerly and in a compiled graph."""

from __future__ import annotations

import pytest
import torch

from te_compile.kernels._fp_bits import HAS_TRITON
from te_compile.kernels import delayed_update as module
from te_compile.kernels.delayed_update import (
    delayed_update,
    delayed_update_reference,
    delayed_update_triton,
    kernel_self_test,
)
from te_compile.lowerings.delayed_state import update_role_state
from te_compile.recipe import DelayedScaling
from te_compile.scaling import fp8_max
from utils import FLT_MAX, assert_bitwise_equal, seed, KERNEL_DEVICE, on_kernel_device

# numpy's warnings from the interpreter's divisions by 0 / inf / NaN amaxes (the edges under test)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROLES = ("input", "weight", "grad_output")
# this step's amaxes: ordinary, zero, NaN, +-inf, subnormal (scale overflows to inf -> FLT_MAX),
# huge (scale underflows), negative (not from tensor_amax, but the rule must still hold)
EDGE_AMAXES = [3.5, 0.0, float("nan"), float("inf"), float("-inf"), 1e-40, 3e38, -2.0, 1e-3, 7e4]


def _rows(n, length, s=0, device="cpu"):
    """n rows: histories of noise (some with zero tails), then from row len(EDGE_AMAXES) on zeros (a
    fresh state); this step's amaxes the edges in turn; scales not 1."""
    gen = seed(s)
    histories, scales = [], []
    for r in range(n):
        h = torch.rand(length, generator=gen) * torch.exp2(torch.randint(-10, 10, (1,), generator=gen).float())
        if r % 3 == 0:
            h[length // 2:] = 0.0
        if r >= len(EDGE_AMAXES):   # the edges again, on a fresh state: the new amax is the window
            h.zero_()
        histories.append(h.to(device))
        scales.append((torch.rand(1, generator=gen) * 100 + 0.5).to(device))
    amaxes = torch.tensor([EDGE_AMAXES[r % len(EDGE_AMAXES)] for r in range(n)], dtype=torch.float32, device=device)
    return histories, scales, amaxes


def _recipes():
    return [DelayedScaling(amax_history_len=16, margin=m, amax_compute_algo=a)
            for m in (0, 2) for a in ("max", "most_recent")]


@pytest.mark.parametrize("recipe", _recipes(), ids=lambda r: f"margin{r.margin}-{r.amax_compute_algo}")
def test_reference_equals_update_role_state(recipe):
    n = 2 * len(EDGE_AMAXES)
    histories, scales, amaxes = _rows(n, recipe.amax_history_len)
    roles = [ROLES[r % 3] for r in range(n)]
    before = [s.clone() for s in scales]
    expect_h, expect_s = [h.clone() for h in histories], [s.clone() for s in scales]
    for h, s, a, role in zip(expect_h, expect_s, amaxes, roles):
        update_role_state(h, s, a.reshape(1), role, recipe)
    limits = [fp8_max(recipe.fp8_format.dtype_for(role)) for role in roles]
    delayed_update_reference(histories, scales, amaxes, limits, [2.0 ** recipe.margin] * n,
                             recipe.amax_compute_algo == "most_recent")
    for r in range(n):
        assert_bitwise_equal(histories[r], expect_h[r])
        assert_bitwise_equal(scales[r], expect_s[r])
    # the rules the edges exercise did happen: kept scales, new scales, FLT_MAX, a zero pushed for NaN
    kept = [torch.equal(s, b) for s, b in zip(scales, before)]
    assert any(kept) and not all(kept)
    assert any(s.item() == FLT_MAX for s in scales)
    assert histories[2][0] == 0.0


def _limits(n):
    return [(448.0, 57344.0)[r % 2] for r in range(n)], [(1.0, 4.0, 1.0)[r % 3] for r in range(n)]


@needs_triton
@pytest.mark.parametrize("most_recent", [False, True])
@pytest.mark.parametrize("length", [1, 7, 1024, 2500])
def test_kernel_equals_reference(length, most_recent):
    n = len(EDGE_AMAXES) + 3
    got_h, got_s, amaxes = _rows(n, length, s=length)
    ref_h, ref_s = [h.clone() for h in got_h], [s.clone() for s in got_s]
    before = [h.clone() for h in got_h]
    limits, divisors = _limits(n)
    delayed_update_reference(ref_h, ref_s, amaxes, limits, divisors, most_recent)
    delayed_update_triton(got_h, got_s, amaxes, limits, divisors, most_recent)
    for r in range(n):
        assert_bitwise_equal(got_h[r], ref_h[r])
        assert_bitwise_equal(got_s[r], ref_s[r])
        # the roll itself, across chunk boundaries (the kernel works in chunks of 1024)
        assert_bitwise_equal(got_h[r][1:], before[r][:-1])


@needs_triton
def test_kernel_twice_uses_its_cached_tables_and_rolls_again():
    histories, scales, amaxes = _rows(4, 5)
    ref_h, ref_s = [h.clone() for h in histories], [s.clone() for s in scales]
    limits, divisors = _limits(4)
    for step in range(2):
        a = amaxes + step
        delayed_update_reference(ref_h, ref_s, a, limits, divisors, False)
        delayed_update_triton(histories, scales, a, limits, divisors, False)
    for r in range(4):
        assert_bitwise_equal(histories[r], ref_h[r])
        assert_bitwise_equal(scales[r], ref_s[r])


def test_rejects_mismatched_rows():
    histories, scales, amaxes = _rows(3, 4)
    with pytest.raises(ValueError, match="one scale tensor, limit and divisor per history tensor and one amax per row"):
        delayed_update_reference(histories, scales[:2], amaxes, [448.0] * 3, [1.0] * 3, False)
    with pytest.raises(ValueError, match="one length"):
        delayed_update_reference(histories[:2] + [torch.zeros(5)], scales, amaxes, [448.0] * 3, [1.0] * 3, False)
    with pytest.raises(ValueError, match=r"one element per history row, got torch.float32 \(1,\) on cpu for a history \(2, 4\)"):
        delayed_update_reference(histories[:2] + [torch.zeros(2, 4)], scales, torch.ones(4), [448.0] * 3, [1.0] * 3,
                                 False)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_tensor_of_rows_updates_each_row_as_its_own_history(impl):
    """An expert weight's role: histories [E, L] and scales [E], one row per expert, beside 1-D rows;
    each row gets the bits it gets alone (the kernel reads the rows' addresses from its table)."""
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    update = delayed_update_reference if impl == "reference" else delayed_update_triton
    gen = seed(70)
    experts = torch.rand(5, 6, generator=gen) * 10
    expert_scales = torch.rand(5, generator=gen) + 0.5
    single, single_scale = torch.rand(6, generator=gen), torch.rand(1, generator=gen) + 0.5
    amaxes = torch.tensor([3.0, 0.0, float("nan"), 7e4, 1e-40, 2.5])   # 5 expert rows, then the single one
    want_h = [experts[e].clone() for e in range(5)] + [single.clone()]
    want_s = [expert_scales[e:e + 1].clone() for e in range(5)] + [single_scale.clone()]
    delayed_update_reference(want_h, want_s, amaxes, [57344.0] * 5 + [448.0], [2.0] * 5 + [1.0], False)
    update([experts, single], [expert_scales, single_scale], amaxes, [57344.0, 448.0], [2.0, 1.0], False)
    for e in range(5):
        assert_bitwise_equal(experts[e], want_h[e], f"expert {e} history")
        assert_bitwise_equal(expert_scales[e:e + 1], want_s[e], f"expert {e} scale")
    assert_bitwise_equal(single, want_h[5], "the 1-D row")


def test_op_mutates_in_place_eager_and_compiled():
    histories, scales, amaxes = _rows(6, 8)
    ref_h, ref_s = [h.clone() for h in histories], [s.clone() for s in scales]
    limits, divisors = _limits(6)

    def step(hs, ss, a):
        torch.ops.te_compile.delayed_scaling_update(hs, ss, a * 1.0, limits, divisors, False)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for a in (amaxes, amaxes.flip(0)):
        delayed_update_reference(ref_h, ref_s, a, limits, divisors, False)
        delayed_update_reference(ref_h, ref_s, a, limits, divisors, False)
        step(histories, scales, a)
        compiled(histories, scales, a)
    for r in range(6):
        assert_bitwise_equal(histories[r], ref_h[r])
        assert_bitwise_equal(scales[r], ref_s[r])


@needs_cuda
def test_dispatcher_on_cuda_equals_reference():
    # the dispatcher falls back to the reference when the self-test fails: assert it passed, or this
    # test would compare the reference with itself
    assert kernel_self_test(torch.device("cuda")) == (True, "bit for bit equal to the reference")
    got_h, got_s, amaxes = _rows(12, 1024, device="cuda")
    ref_h, ref_s = [h.cpu() for h in got_h], [s.cpu() for s in got_s]
    limits, divisors = _limits(12)
    delayed_update(got_h, got_s, amaxes, limits, divisors, False)
    delayed_update_reference(ref_h, ref_s, amaxes.cpu(), limits, divisors, False)
    for r in range(12):
        assert_bitwise_equal(got_h[r].cpu(), ref_h[r])
        assert_bitwise_equal(got_s[r].cpu(), ref_s[r])


@needs_triton
def test_self_test_passes_in_the_interpreter_and_fails_closed(monkeypatch, caplog):
    """The guard in front of the CUDA launch: the kernel passes it (here in the interpreter); a kernel
    that raises or returns other bits fails it with a warning, and the dispatcher then uses the
    reference."""
    monkeypatch.setattr(module, "_SELF_TESTS", {})
    assert kernel_self_test(KERNEL_DEVICE) == (True, "bit for bit equal to the reference")

    def raises(*args):
        raise RuntimeError("PTX assembly failed")

    def off_by_one_ulp(histories, scales, *args):
        delayed_update_reference(histories, scales, *args)
        scales[3].copy_(torch.nextafter(scales[3], torch.full_like(scales[3], float("inf"))))

    for broken, why in ((raises, "RuntimeError: PTX assembly failed"), (off_by_one_ulp, "state tensor 3")):
        monkeypatch.setattr(module, "_SELF_TESTS", {})
        monkeypatch.setattr(module, "delayed_update_triton", broken)
        caplog.clear()
        ok, reason = kernel_self_test(KERNEL_DEVICE)
        assert not ok and why in reason
        assert f"update kernel is off on {KERNEL_DEVICE.type}" in caplog.text and why in caplog.text


# CPU-built operands run on the GPU where there is one (tests/utils.py)
delayed_update_triton = on_kernel_device(delayed_update_triton)
