"""Norm + FP8 quantize kernels: the quantize kernel equals its reference bit for bit given the same
stats; the stats and backward kernels agree with their references to fp32 rounding (they sum in
another order); the references match float64 math (rstd within 5e-5 relative, dx / dw within 5e-4)."""

import pytest
import torch

from te_compile.kernels import norm_quantize as nq
from te_compile.kernels._fp_bits import HAS_TRITON
from te_compile.kernels.norm_quantize import (
    norm_backward,
    norm_backward_reference,
    norm_forward_reference,
    norm_quantize,
    norm_quantize_reference,
    norm_stats,
    norm_stats_reference,
)
from te_compile.norm_spec import NormSpec
from utils import FP8_DTYPES, KERNEL_DEVICE, assert_bitwise_equal, fp8_id, on_kernel_device, seed

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

BF16 = torch.bfloat16
# the forms norm_sites.py reads: F.layer_norm / F.rms_norm, Llama (round before the weight), Gemma
# (1 + w, then cast), a reader's cast to fp16 after the norm
SPECS = {
    "ln": (NormSpec("layer_norm", 1e-5), True, True),
    "ln_noaffine": (NormSpec("layer_norm", 1e-5), False, False),
    "rms": (NormSpec("rms_norm", 1e-6), True, False),
    "llama": (NormSpec("rms_norm", 1e-6, pre_dtype=BF16, prod_dtype=BF16), True, False),
    "gemma": (NormSpec("rms_norm", 1e-6, zero_centered=True, casts=(BF16,)), True, False),
    "ln_fp16": (NormSpec("layer_norm", 1e-5, casts=(torch.float16,)), True, True),
}
SHAPES = [(1, 16), (37, 300), (64, 256), (5, 1)]


def _operands(name, shape, dtype, g):
    spec, has_w, has_b = SPECS[name]
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
    w = (torch.randn(shape[1], generator=g) * 0.5 + 1).to(dtype) if has_w else None
    b = torch.randn(shape[1], generator=g).to(dtype) if has_b else None
    return spec, x, w, b


def _norm64(x, w, b, spec):
    """The norm in float64 with autograd (no rounding steps)."""
    x64 = x.double()
    if spec.kind == "layer_norm":
        xhat = (x64 - x64.mean(-1, keepdim=True)) * torch.rsqrt(x64.var(-1, unbiased=False, keepdim=True) + spec.eps)
    else:
        xhat = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + spec.eps)
    if w is not None:
        xhat = xhat * (w + 1 if spec.zero_centered else w)
    return xhat + b if b is not None else xhat


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_matches_float64(name):
    g = seed(1)
    spec, x, w, b = _operands(name, (33, 96), torch.float32, g)
    h, mean, rstd = norm_forward_reference(x, w, b, spec)
    x64 = x.double()
    var = x64.var(-1, unbiased=False) if spec.kind == "layer_norm" else x64.pow(2).mean(-1)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(var + spec.eps), rtol=5e-5, atol=0)
    # forward: to the rounding of the spec's dtypes
    tol = 1e-2 if spec.prod_dtype != torch.float32 or spec.casts else 1e-5
    torch.testing.assert_close(h.double(), _norm64(x, None if w is None else w.double(),
                                                   None if b is None else b.double(), spec), rtol=tol, atol=tol)
    # backward vs float64 autograd
    xr = x64.clone().requires_grad_()
    wr = w.double().requires_grad_() if w is not None else None
    br = b.double().requires_grad_() if b is not None else None
    dy = torch.randn(h.shape, generator=g)
    _norm64(xr, wr, br, spec).backward(dy.double())
    dx, dw, db = norm_backward_reference(dy, x, w, mean, rstd, spec)
    torch.testing.assert_close(dx.double(), xr.grad, rtol=5e-4, atol=5e-4)
    if w is not None:
        # the Llama form multiplies the bf16-rounded xhat: dw sees the rounding
        wtol = 2e-2 if spec.pre_dtype is not None else 5e-4
        torch.testing.assert_close(dw.double(), wr.grad, rtol=wtol, atol=wtol)
    if b is not None:
        torch.testing.assert_close(db.double(), br.grad, rtol=5e-4, atol=5e-4)


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SPECS))
def test_stats_kernel_matches_reference(name, dtype, shape):
    spec, x, w, b = _operands(name, shape, dtype, seed(2))
    mean_r, rstd_r, amax_r = norm_stats_reference(x, w, b, spec)
    mean_t, rstd_t, amax_t = _norm_stats_triton(x, w, b, spec)
    torch.testing.assert_close(mean_t, mean_r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rstd_t, rstd_r, rtol=5e-6, atol=0)
    # the amax is of outputs rounded to the spec's dtypes: one rounding step at most
    torch.testing.assert_close(amax_t, amax_r, rtol=1e-2 if spec.out_dtype != torch.float32 else 1e-5, atol=0)


@needs_triton
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SPECS))
def test_quantize_kernel_is_bit_exact(name, dtype, shape, fp8_dtype):
    spec, x, w, b = _operands(name, shape, dtype, seed(3))
    mean, rstd, amax = norm_stats_reference(x, w, b, spec)
    # a scale that saturates the largest values too (clamping must agree); 1 for amax 0 (one column of
    # LayerNorm), as compute_scale gives: 0 * inf is a NaN whose sign is the hardware's (x86 sets it)
    scale = torch.where(amax > 0, torch.tensor([448.0 if fp8_dtype == torch.float8_e4m3fn else 57344.0]) / amax * 1.5,
                        1.0)
    ref = norm_quantize_reference(x, w, b, mean, rstd, scale, spec, fp8_dtype)
    got = _norm_quantize_triton(x, w, b, mean, rstd, scale, spec, fp8_dtype)
    assert_bitwise_equal(got[0], ref[0], "rowwise")
    assert_bitwise_equal(got[1], ref[1], "transposed")
    assert_bitwise_equal(ref[1], ref[0].t().contiguous(), "the transposed copy is the transpose")


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SPECS))
def test_backward_kernel_matches_reference(name, dtype, shape):
    g = seed(4)
    spec, x, w, b = _operands(name, shape, dtype, g)
    _, mean, rstd = norm_forward_reference(x, w, b, spec)
    dy = torch.randn(shape, generator=g)
    ref = norm_backward_reference(dy, x, w, mean, rstd, spec)
    got = _norm_backward_triton(dy, x, w, mean, rstd, spec)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == BF16 else dict(rtol=1e-5, atol=1e-5)
    for r, t, what in zip(ref, got, ("dx", "dw", "db")):
        if r is None:
            assert t is None, what
        else:
            assert t.dtype == r.dtype, what
            torch.testing.assert_close(t, r, **tol, msg=what)


def test_quantize_reference_is_te_unfused_path():
    """The fused reference's bytes are those of quantizing the norm's output (what te does unfused)."""
    from te_compile.scaling import cast_to_fp8

    spec, x, w, b = _operands("ln", (16, 64), torch.float32, seed(5))
    h, mean, rstd = norm_forward_reference(x, w, b, spec)
    scale = torch.tensor([448.0]) / h.abs().amax()
    data, _ = norm_quantize_reference(x, w, b, mean, rstd, scale.reshape(1), spec, torch.float8_e4m3fn)
    assert_bitwise_equal(data, cast_to_fp8(h, scale, torch.float8_e4m3fn))


def test_dispatchers_take_the_reference_on_cpu():
    spec, x, w, b = _operands("rms", (8, 32), torch.float32, seed(6))
    for fn, ref in ((norm_stats, norm_stats_reference),):
        for a, r in zip(fn(x, w, b, spec), ref(x, w, b, spec)):
            assert_bitwise_equal(a, r)
    mean, rstd, amax = norm_stats(x, w, b, spec)
    assert_bitwise_equal(norm_quantize(x, w, b, mean, rstd, 1 / amax, spec, torch.float8_e5m2)[0],
                         norm_quantize_reference(x, w, b, mean, rstd, 1 / amax, spec, torch.float8_e5m2)[0])
    dy = torch.randn(8, 32)
    assert_bitwise_equal(norm_backward(dy, x, w, mean, rstd, spec)[0],
                         norm_backward_reference(dy, x, w, mean, rstd, spec)[0])


def test_spec_round_trips_through_its_op_string_and_rejects_bad_values():
    for spec, _, _ in SPECS.values():
        assert NormSpec.decode(spec.encode()) == spec
    with pytest.raises(ValueError, match="kind must be one of"):
        NormSpec("batch_norm", 1e-5)
    with pytest.raises(ValueError, match="dtypes must be among"):
        NormSpec("rms_norm", 1e-5, casts=(torch.float64,))
    with pytest.raises(ValueError, match=r"weight must have shape \[K\] = \[8\]"):
        norm_stats_reference(torch.randn(2, 8), torch.ones(4), None, NormSpec("rms_norm", 1e-5))


@pytest.mark.filterwarnings("ignore:var_mean")
def test_empty_rows():
    spec, x, w, b = _operands("ln", (0, 32), torch.float32, seed(7))
    mean, rstd, amax = norm_stats_reference(x, w, b, spec)
    assert mean.shape == (0,) and amax.item() == 0.0
    if HAS_TRITON:
        m, r, a = _norm_stats_triton(x, w, b, spec)
        assert m.shape == (0,) and a.item() == 0.0
        d, dt = _norm_quantize_triton(x, w, b, m, r, torch.ones(1), spec, torch.float8_e4m3fn)
        assert d.shape == (0, 32) and dt.shape == (32, 0)


def test_a_nan_counts_as_inf_in_the_amax():
    """A NaN in the normalised output gives amax inf (scale 1), eagerly, under inductor (whose max
    reduction propagates the NaN to the one value mapped) and in the Triton kernel (which maps each
    element: its max may drop NaNs)."""
    spec, x, w, b = _operands("ln", (37, 300), torch.float32, seed(8))
    w = w.clone()
    w[5] = float("nan")   # column 5 of every row
    eager = norm_stats_reference(x, w, b, spec)[2]
    compiled = torch.compile(norm_stats_reference, backend="inductor", fullgraph=True)(x, w, b, spec)[2]
    assert eager.item() == float("inf") and compiled.item() == float("inf")
    w[5] = 1.0
    finite = norm_stats_reference(x, w, b, spec)[2]
    assert torch.isfinite(finite).all() and finite.item() > 0
    if HAS_TRITON:
        w[5] = float("nan")
        assert _norm_stats_triton(x, w, b, spec)[2].item() == float("inf")


@needs_triton
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
def test_custom_ops_launch_the_kernels(with_weight):
    """The triton_ops compiled CUDA graphs call: the same results as the launchers (here in the
    interpreter), outputs that alias nothing (schema check), and no weight -> no dw / db."""
    spec, x, w, b = _operands("ln", (16, 64), torch.float32, seed(8))
    w, b = (w, b) if with_weight else (None, None)
    x, w, b = (None if t is None else t.to(KERNEL_DEVICE) for t in (x, w, b))
    ops = torch.ops.te_compile
    stats = ops.norm_stats(x, w, b, spec.encode())
    for got, ref in zip(stats, _norm_stats_triton(x, w, b, spec)):
        assert_bitwise_equal(got.cpu(), ref)
    mean, rstd, amax = stats
    data, data_t = ops.norm_quantize(x, w, b, mean, rstd, 448.0 / amax, spec.encode(), torch.float8_e4m3fn)
    ref = _norm_quantize_triton(x, w, b, mean, rstd, 448.0 / amax, spec, torch.float8_e4m3fn)
    assert_bitwise_equal(data.cpu(), ref[0].view(torch.uint8))
    assert_bitwise_equal(data_t.cpu(), ref[1].view(torch.uint8))
    dy = torch.randn(16, 64, generator=seed(9)).to(KERNEL_DEVICE)
    dx, dw, db = ops.norm_backward(dy, x, w, mean, rstd, spec.encode())
    ref = _norm_backward_triton(dy, x, w, mean, rstd, spec)
    assert_bitwise_equal(dx.cpu(), ref[0])
    if with_weight:
        assert_bitwise_equal(dw.cpu(), ref[1])
        assert_bitwise_equal(db.cpu(), ref[2])
    else:
        assert dw.numel() == 0 and db.numel() == 0 and dw is not db
    for op, args in ((ops.norm_stats, (x, w, b, spec.encode())),
                     (ops.norm_backward, (dy, x, w, mean, rstd, spec.encode()))):
        torch.library.opcheck(op.default, args, test_utils=("test_schema",))


# Run in a fresh process without TRITON_INTERPRET (conftest sets it on CPU): the analysis lowers
# the real JIT functions to Triton IR, for an sm90 target since there is no GPU to ask.
_WRITES = r"""
import json, sys, types
from unittest import mock
import torch, triton
from triton.backends.compiler import GPUTarget
from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors
from te_compile.kernels import norm_quantize as nq
from te_compile.norm_spec import NormSpec

launches = []
def wrap(kernel):
    class Grid:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((kernel, {**dict(zip(kernel.arg_names, a)), **kw}))
    return Grid()

x, dy, m = torch.randn(64, 256), torch.randn(64, 256), torch.zeros(64)
out = {}
for name, affine in (("ln", True), ("rms", True), ("ln_noaffine", False)):
    spec = NormSpec("layer_norm" if name != "rms" else "rms_norm", 1e-5)
    w = torch.randn(256) if affine else None
    b = torch.randn(256) if affine and name == "ln" else None
    launches.clear()
    nq._launch_stats(x, w, b, spec, wrap)
    nq._launch_quantize(x, w, b, m, m + 1, torch.ones(1), spec, torch.float8_e4m3fn, wrap)
    nq._launch_backward(dy, x, w, m, m + 1, spec, wrap)
    sm90 = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32))
    with mock.patch.object(triton.runtime.driver, "_active", sm90):
        for kernel, args in launches:
            acc = identify_accessed_tensors(kernel, args, {})
            out[f"{name} {kernel.fn.__name__}"] = sorted(
                d.name for d in acc.read_writes.writes if isinstance(args.get(d.name), torch.Tensor))
print(json.dumps(out))
"""


@needs_triton
def test_inductor_sees_each_kernel_write_only_its_outputs():
    """Inside the triton_ops inductor asks torch's analysis of the Triton IR which arguments a kernel
    writes, and copies each of them before the launch (a write it cannot rule out). So the analysis
    must find exactly the outputs: a store through an index that a helper call returned once made it
    list dy, x and w as written too (three extra [M, K] copies per norm backward on a GPU)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from torch._higher_order_ops import triton_kernel_wrap
    if not hasattr(triton_kernel_wrap, "identify_accessed_tensors"):
        pytest.skip("this torch has no identify_accessed_tensors (torch 2.11 lacks it; CI's 2.13 has it)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _WRITES], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = {}
    for name in ("ln", "rms", "ln_noaffine"):
        expected[f"{name} _norm_stats_kernel"] = ["amax_ptr", "mean_ptr", "rstd_ptr"]
        expected[f"{name} _norm_quantize_kernel"] = ["data_ptr", "data_t_ptr"]
        expected[f"{name} _norm_backward_kernel"] = (["db_part_ptr", "dw_part_ptr", "dx_ptr"] if name != "ln_noaffine"
                                                     else ["dx_ptr"])
    assert written == expected


# CPU-built operands run on the GPU where there is one (tests/utils.py)
_norm_stats_triton = on_kernel_device(nq.norm_stats_triton)
_norm_quantize_triton = on_kernel_device(nq.norm_quantize_triton)
_norm_backward_triton = on_kernel_device(nq.norm_backward_triton)
