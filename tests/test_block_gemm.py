"""Native block-scaled GEMMs: te_compile.gemm.block, scaled_mm_op and block_probe.

Without a GPU the native path's arguments are checked on CPU in three ways:
- the swizzle against cuBLAS's documented offset formula for 1-D block scaling factors;
- torch's own CUDA contract: every argument tuple the path hands the op is re-made as fake CUDA
  tensors (same shapes, strides and dtypes) and given to torch's meta function of scaled_mm, which
  checks operand layouts, alignment, scale shapes / strides and swizzles as it does for real CUDA
  tensors;
- numerics: on CPU the op runs its reference, which decodes the arguments by the contract; the result
  must match the dequantize-then-matmul emulation of the same quantized operands.
The CUDA tests at the end (skipped without a GPU) run the real kernels against the emulation.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import te_compile
import te_compile.gemm.block as block_gemm
import te_compile.gemm.block_probe as probe
import te_compile.passes as passes
from te_compile.hardware import is_fp8_block_scaling_available, is_mxfp8_available, is_nvfp4_available
from te_compile.gemm import scaled_mm_op
from te_compile.lowerings.linear import QuantizedLinearFunction
from te_compile.gemm.block import quantize_copies, quantizer_factory
from te_compile.gemm.scaled_mm_op import _scaled_mm, swizzle_32_4_4, unswizzle_32_4_4
from te_compile.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from utils import assert_bitwise_equal, sqnr

RECIPES = {
    "mxfp8": MXFP8BlockScaling(),
    "mxfp8_hybrid": MXFP8BlockScaling(fp8_format=Format.HYBRID),
    "float8_block": Float8BlockScaling(),
    "float8_block_1x128_weights": Float8BlockScaling(w_block_scaling_dim=1),
    "nvfp4": NVFP4BlockScaling(),
}
# GEMMs per linear (fprop, dgrad, wgrad) that scaled_mm has: HYBRID's E5M2 gradients are emulated.
NATIVE_GEMMS = {"mxfp8_hybrid": 1}
# (M, K, N): aligned; ragged (K and N not multiples of 128, M of 16); one token row.
SHAPES = [(272, 256, 384), (200, 160, 96), (3, 64, 32)]

# Native (on CPU: the op's reference) against the emulation: only summation order differs.
MIN_AGREEMENT_DB = 120.0


# ---- the swizzle --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 3), (128, 4), (130, 5), (300, 9)])
def test_swizzle_matches_cublas_offsets(rows, cols):
    scales = torch.randint(1, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    flat = swizzle_32_4_4(scales)
    col_tiles = -(-cols // 4)
    assert flat.numel() == 128 * -(-rows // 128) * 4 * col_tiles
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    # cuBLAS "1D block scaling factors layout": 512-byte tiles of 128 rows x 4 columns, row bands first;
    # inside a tile row r, column c at (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4.
    offset = 512 * ((r // 128) * col_tiles + c // 4) + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    assert_bitwise_equal(flat[offset], scales, "scale at its documented offset")
    assert int((flat != 0).sum()) == rows * cols, "padding must be zeros"
    assert_bitwise_equal(unswizzle_32_4_4(flat, rows, cols), scales, "round trip")


def test_unswizzle_rejects_a_wrong_size():
    with pytest.raises(ValueError, match=r"swizzled \[3, 2\] scale matrix has 512 entries, got 100"):
        unswizzle_32_4_4(torch.zeros(100, dtype=torch.uint8), 3, 2)


# ---- native path on CPU: numerics and torch's CUDA contract ---------------------------------------------

def _linear(recipe, shape, native, monkeypatch=None):
    """y, dx, dw of one QuantizedLinearFunction call, and the op calls the native path made."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(1)
    # rows and columns scaled by powers of two: blocks of very different magnitude
    x = torch.randn(m, k, generator=gen) * torch.randint(-6, 7, (m, 1), generator=gen).double().exp2().float()
    w = torch.randn(n, k, generator=gen) * torch.randint(-6, 7, (1, k), generator=gen).double().exp2().float()
    g = torch.randn(m, n, generator=gen)
    calls = []
    if monkeypatch is not None:
        real = block_gemm.block_scaled_mm

        def record(*args):
            calls.append(args)
            return real(*args)

        monkeypatch.setattr(block_gemm, "block_scaled_mm", record)
    torch.manual_seed(0)  # the same stochastic-rounding draws in both runs
    x.requires_grad_()
    w.requires_grad_()
    y = QuantizedLinearFunction.apply(x, w, quantizer_factory(recipe), native)
    y.backward(g)
    return (y.detach(), x.grad, w.grad), calls


def _skip_ineligible(name, shape):
    if name.startswith("mxfp8") and (shape[1] % 32 or shape[2] % 32):
        pytest.skip("MXFP8 sites need K and N % 32")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", RECIPES)
def test_native_path_matches_the_emulation(monkeypatch, name, shape):
    _skip_ineligible(name, shape)
    emulated, _ = _linear(RECIPES[name], shape, native=False)
    native, calls = _linear(RECIPES[name], shape, native=True, monkeypatch=monkeypatch)
    assert len(calls) == NATIVE_GEMMS.get(name, 3), "GEMMs routed to the native op"
    for what, ref, got in zip(("y", "dx", "dw"), emulated, native):
        value = sqnr(ref, got)
        assert value >= MIN_AGREEMENT_DB, f"{name} {shape} {what}: {value:.1f} dB < {MIN_AGREEMENT_DB} dB"


def _fake_cuda(mode, t):
    meta = t.to("meta")
    assert meta.stride() == t.stride()
    return FakeTensor(mode, meta, torch.device("cuda", 0))


def _check_cuda_contract(args):
    """Run torch's meta function of scaled_mm on fake CUDA copies of one call's arguments."""
    mode = FakeTensorMode()
    mat_a, mat_b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, out_dtype = args
    fake = (_fake_cuda(mode, mat_a), _fake_cuda(mode, mat_b), [_fake_cuda(mode, s) for s in scale_a],
            recipe_a, swizzle_a, [_fake_cuda(mode, s) for s in scale_b], recipe_b, swizzle_b, out_dtype)
    with mode:
        return _scaled_mm(*fake)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", RECIPES)
def test_native_arguments_meet_the_scaled_mm_cuda_contract(monkeypatch, name, shape):
    _skip_ineligible(name, shape)
    _, calls = _linear(RECIPES[name], shape, native=True, monkeypatch=monkeypatch)
    assert calls
    for args in calls:
        out = _check_cuda_contract(args)
        assert out.device.type == "cuda" and out.shape == (args[0].shape[0], args[1].shape[1])


def test_the_cuda_contract_check_can_fail(monkeypatch):
    """The fake-CUDA check is not vacuous: a row-major mat_b or a row-major 1x128 scale is refused;
    the op's own re-layout repairs both."""
    _, calls = _linear(RECIPES["float8_block_1x128_weights"], SHAPES[0], native=True, monkeypatch=monkeypatch)
    mat_a, mat_b, scale_a, *rest = calls[0]
    with pytest.raises(RuntimeError, match="mat2 must be col_major"):
        _check_cuda_contract((mat_a, mat_b.contiguous(), scale_a, *rest))
    with pytest.raises(RuntimeError, match="1x128 x 1x128 blockwise scaling"):
        _check_cuda_contract((mat_a, mat_b, [scale_a[0].contiguous()], *rest))
    # the op's CUDA branch puts such arguments back into the layouts cuBLASLt takes
    recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, out_dtype = rest
    a, b, sa, sb = scaled_mm_op._laid_out(mat_a, mat_b.contiguous(), [scale_a[0].contiguous()], recipe_a,
                                          [scale_b[0].contiguous()], recipe_b)
    _check_cuda_contract((a, b, sa, recipe_a, swizzle_a, sb, recipe_b, swizzle_b, out_dtype))


def test_pairs_scaled_mm_lacks_are_refused():
    x = torch.randn(128, 256)
    e5m2 = quantize_copies(quantizer_factory(RECIPES["mxfp8_hybrid"]), "grad_output", x)
    e4m3 = quantize_copies(quantizer_factory(RECIPES["mxfp8"]), "input", x)
    tiled = quantize_copies(quantizer_factory(RECIPES["float8_block"]), "weight", x)
    assert block_gemm.native_pair_supported(e4m3, e4m3)
    assert not block_gemm.native_pair_supported(e5m2, e4m3)
    assert not block_gemm.native_pair_supported(tiled, tiled)
    with pytest.raises(ValueError, match="no GEMM for this pair"):
        block_gemm.native_block_gemm(tiled, tiled, transpose_b=True, out_dtype=torch.float32)
    with pytest.raises(TypeError, match="two storages of one block format"):
        block_gemm.native_block_gemm(e4m3, tiled, transpose_b=True, out_dtype=torch.float32)


# ---- the probe ------------------------------------------------------------------------------------------

def test_probe_answers_no_on_cpu_and_for_other_recipes():
    assert probe.native_block_gemm_support(MXFP8BlockScaling(), "cpu", torch.float32) == (
        False, "no native block-scaled GEMMs on cpu")
    ok, why = probe.native_block_gemm_support(DelayedScaling(), "cpu", torch.float32)
    assert not ok and "DelayedScaling has no native block-scaled GEMM" in why


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen compute capability (no GPU needed); a fresh probe cache."""
    def use(cc):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    monkeypatch.setattr(probe, "_answers", {})
    return use


@pytest.mark.parametrize("recipe, cc", [(MXFP8BlockScaling(), (9, 0)), (NVFP4BlockScaling(), (9, 0)),
                                        (Float8BlockScaling(), (10, 0)), (Float8BlockScaling(), (8, 9))])
def test_probe_refuses_architectures_without_the_gemm(fake_gpu, monkeypatch, recipe, cc):
    fake_gpu(cc)
    monkeypatch.setattr(probe, "_self_test", lambda *a: pytest.fail("no self-test without the architecture"))
    ok, why = probe.native_block_gemm_support(recipe, "cuda", torch.bfloat16)
    fmt = recipe.block_format
    assert not ok and why == f"compute capability {cc[0]}.{cc[1]} has no native {fmt} GEMMs"


def test_probe_self_test_decides_and_is_cached(fake_gpu, monkeypatch, caplog):
    fake_gpu((9, 0))
    results = iter([60.0, 10.0])
    runs = []

    def self_test(recipe, device, dtype):
        runs.append((recipe.name, str(device), dtype))
        return next(results)

    monkeypatch.setattr(probe, "_self_test", self_test)
    recipe = Float8BlockScaling()
    for _ in range(2):
        ok, why = probe.native_block_gemm_support(recipe, "cuda", torch.bfloat16)
        assert ok and why == "self-test 60.0 dB against the emulation (torch.bfloat16)"
    assert runs == [("Float8BlockScaling", "cuda:0", torch.bfloat16)], "one self-test per key"
    with caplog.at_level(logging.WARNING, logger=probe.__name__):
        ok, why = probe.native_block_gemm_support(recipe, "cuda", torch.float32)
    assert not ok and "disagrees with the emulation (torch.float32): 10.0 dB < 35.0 dB" in why
    assert "float8_block GEMMs on cuda:0 stay emulated" in caplog.text


def test_probe_reports_a_refusal_by_torch(fake_gpu, monkeypatch):
    fake_gpu((10, 0))

    def refuse(*args):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED\nmore lines")

    monkeypatch.setattr(probe, "_self_test", refuse)
    ok, why = probe.native_block_gemm_support(NVFP4BlockScaling(), "cuda", torch.bfloat16)
    assert not ok
    assert why == "native self-test failed (torch.bfloat16): RuntimeError: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED"


@pytest.mark.parametrize("name", ["mxfp8", "float8_block", "nvfp4"])
def test_self_test_passes_a_correct_path_and_catches_a_misplaced_scale(monkeypatch, name):
    cpu = torch.device("cpu")
    assert probe._self_test(RECIPES[name], cpu, torch.float32) >= probe.MIN_SQNR_DB
    if name == "float8_block":
        # shift the 1x128 scales by one row: each row decoded with its neighbour's scale
        real = block_gemm._scale_args

        def shifted(op):
            scales, recipes, swizzles = real(op)
            return [scales[0].roll(1, dims=0)] + scales[1:], recipes, swizzles

        monkeypatch.setattr(block_gemm, "_scale_args", shifted)
    else:
        # every scale one byte off its documented place
        monkeypatch.setattr(block_gemm, "swizzle_32_4_4", lambda s: swizzle_32_4_4(s).roll(1))
    assert probe._self_test(RECIPES[name], cpu, torch.float32) < probe.MIN_SQNR_DB


# ---- through the backend --------------------------------------------------------------------------------

@pytest.fixture
def native_forced(monkeypatch):
    """The pass told that the device runs the format natively (on CPU the op runs its reference)."""
    monkeypatch.setattr(passes.linear, "native_block_gemm_support", lambda recipe, device, dtype: (True, "forced"))


def _compiled_step(model, x, options):
    torch._dynamo.reset()
    te_compile.reset()
    model = copy.deepcopy(model)
    torch.manual_seed(0)  # the same stochastic-rounding draws in both runs
    y = torch.compile(model, backend="te", options=options)(x)
    y.square().mean().backward()
    return y.detach(), [p.grad for p in model.parameters()], te_compile.report()


@pytest.mark.parametrize("name, compiler", [("Float8BlockScaling", "inductor"),
                                            ("MXFP8BlockScaling", "aot_eager"),
                                            ("NVFP4BlockScaling", "aot_eager")])
def test_backend_routes_gemms_to_the_native_op(monkeypatch, native_forced, name, compiler):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    x = torch.randn(4, 50, 64)
    # the arguments the op receives when the compiled graph runs (inductor must keep their strides)
    run_args = []
    real = scaled_mm_op.block_scaled_mm_reference
    monkeypatch.setattr(scaled_mm_op, "block_scaled_mm_reference", lambda *a: run_args.append(a) or real(*a))
    y, grads, report = _compiled_step(model, x, {"recipe": name, "compiler": compiler})
    linears = [s for s in report.sites if s.op == "linear"]
    assert linears and all(s.rewritten and "native GEMMs (F.scaled_mm)" in s.reason for s in linears)
    # fprop, dgrad and wgrad of every site, less the first site's dgrad (x needs no gradient)
    assert len(run_args) == 3 * len(linears) - 1, "every GEMM ran natively"
    for args in run_args:
        _check_cuda_contract(args)
    monkeypatch.setattr(passes.linear, "native_block_gemm_support", lambda recipe, device, dtype: (False, ""))
    y_ref, grads_ref, report_ref = _compiled_step(model, x, {"recipe": name, "compiler": "aot_eager"})
    assert all("emulated GEMMs" in s.reason for s in report_ref.sites if s.op == "linear")
    for what, ref, got in [("y", y_ref, y)] + [(f"grad {i}", a, b) for i, (a, b) in enumerate(zip(grads_ref, grads))]:
        value = sqnr(ref, got)
        assert value >= MIN_AGREEMENT_DB, f"{name} {what}: {value:.1f} dB < {MIN_AGREEMENT_DB} dB"


def test_self_test_runs_inside_the_backend_pass(monkeypatch):
    """The probe's self-test runs real forward/backward work while Dynamo is compiling: no fake
    tensors or tracing modes may leak into it (here on CPU, where the op runs its reference)."""
    results = []

    def support(recipe, device, dtype):
        results.append(probe._self_test(recipe, torch.device(device), dtype))
        return results[-1] >= probe.MIN_SQNR_DB, ""

    monkeypatch.setattr(passes.linear, "native_block_gemm_support", support)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    _, _, report = _compiled_step(model, torch.randn(4, 50, 64),
                                  {"recipe": "Float8BlockScaling", "compiler": "aot_eager"})
    assert len(results) == 2 and min(results) >= probe.MIN_SQNR_DB, results
    assert all("native GEMMs" in s.reason for s in report.sites if s.op == "linear")


def test_native_block_gemm_false_keeps_the_emulation(native_forced):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96))
    _, _, report = _compiled_step(model, torch.randn(8, 64), {"recipe": "MXFP8BlockScaling", "compiler": "aot_eager",
                                                           "native_block_gemm": False})
    assert [s.reason for s in report.sites] == [
        "linear -> MXFP8, emulated GEMMs (dequantize-then-matmul; native_block_gemm = false) (global)"]


# ---- on a GPU -------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="native block-scaled GEMMs need a CUDA GPU")
ARCH = {"mxfp8": is_mxfp8_available, "float8_block": is_fp8_block_scaling_available, "nvfp4": is_nvfp4_available}


@needs_cuda
@pytest.mark.parametrize("name", ["mxfp8", "float8_block", "nvfp4"])
def test_cuda_probe_matches_the_architecture(name):
    ok, why = probe.native_block_gemm_support(RECIPES[name], "cuda", torch.bfloat16)
    assert ok == ARCH[name](device="cuda"), why


@needs_cuda
@pytest.mark.parametrize("shape", [(4096, 1024, 2048), (1000, 768, 384)], ids=str)
@pytest.mark.parametrize("name", RECIPES)
def test_cuda_native_gemms_match_the_emulation(name, shape):
    recipe = RECIPES[name]
    if not probe.native_block_gemm_support(recipe, "cuda", torch.bfloat16)[0]:
        pytest.skip(f"{name}: no native GEMMs on this GPU")
    m, k, n = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    outs = []
    for native in (False, True):
        torch.manual_seed(0)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = QuantizedLinearFunction.apply(xr, wr, quantizer_factory(recipe), native)
        y.backward(g)
        outs.append((y.detach(), xr.grad, wr.grad))
    for what, ref, got in zip(("y", "dx", "dw"), *outs):
        value = sqnr(ref.float(), got.float())
        assert value >= probe.MIN_SQNR_DB, f"{name} {shape} {what}: {value:.1f} dB"
