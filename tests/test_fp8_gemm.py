"""Per-tensor FP8 GEMMs (te_compile/gemm/per_tensor.py): on CPU the torch-op emulation must give
torch._scaled_mm's bits, eagerly and compiled by inductor, for the layouts the lowerings pass."""

from __future__ import annotations

import pytest
import torch

from te_compile.gemm import per_tensor as gemm
from utils import assert_bitwise_equal

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# (M, K, N), a's format, b's format (fprop: E4M3 x E4M3; dgrad / wgrad: E5M2 gradients), output dtype
CASES = [
    ((8, 256, 8), E4M3, E4M3, torch.float32),      # a small GEMM: BLAS rounds a transposed b differently
    ((1, 64, 64), E4M3, E4M3, torch.float32),      # one token
    ((33, 65, 17), E5M2, E4M3, torch.float32),
    ((128, 64, 192), E4M3, E4M3, torch.bfloat16),
    ((64, 96, 1), E5M2, E4M3, torch.bfloat16),
]


def _operands(case, b_row_major: bool):
    (m, k, n), a_dtype, b_dtype, _ = case
    gen = torch.Generator().manual_seed(m * 7 + n)
    a = (torch.randn(m, k, generator=gen) * 16).to(a_dtype)
    b = (torch.randn(n, k, generator=gen) * 16).to(b_dtype).t()       # column-major [K, N], as callers pass
    if b_row_major:
        b = b.contiguous()
    sa, sb = torch.rand(1, generator=gen) + 0.1, torch.rand(1, generator=gen) * 3 + 0.1
    return a, b, sa, sb


def _scaled_mm(a, b, sa, sb, out_dtype):
    return torch._scaled_mm(a, b, scale_a=sa.reshape(()), scale_b=sb.reshape(()), out_dtype=out_dtype)


# torch 2.11's CPU _scaled_mm (on the lent GPU machine's image, 2026-11-26; below the supported 2.13) gives
# other bits than the emulation, so fp8_gemm keeps _scaled_mm there and these tests have nothing to check
needs_emulation = pytest.mark.skipif(not gemm.cpu_emulates_scaled_mm(),
                                     reason="this torch's CPU _scaled_mm differs from the emulation; it is kept")


@needs_emulation
def test_the_emulation_is_chosen_here():
    assert gemm.cpu_emulates_scaled_mm()
    assert gemm.fp8_gemm_kind("cpu").startswith("FP8 GEMMs (CPU: fp32 matmul")


@needs_emulation
@pytest.mark.parametrize("b_row_major", [False, True], ids=["b_col_major", "b_row_major"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0])) if isinstance(c, tuple) else None)
def test_emulation_gives_scaled_mm_bits_eager_and_compiled(case, b_row_major):
    a, b, sa, sb = _operands(case, b_row_major)
    out_dtype = case[3]
    expect = _scaled_mm(a, b, sa, sb, out_dtype)
    assert_bitwise_equal(gemm.fp8_gemm(a, b, sa, sb, out_dtype), expect, "eager")
    torch._dynamo.reset()
    compiled = torch.compile(gemm.fp8_gemm, dynamic=False)
    assert_bitwise_equal(compiled(a, b, sa, sb, out_dtype), expect, "inductor")


@needs_emulation
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_the_emulation_adds_a_bias_as_scaled_mm_does(out_dtype):
    # _scaled_mm adds the bias to the fp32 product before its one rounding: not the rounded product
    # plus the bias, which rounds twice
    a, b, sa, sb = _operands(CASES[3], False)
    bias = (torch.randn(b.shape[1], generator=torch.Generator().manual_seed(1)) * 5).to(out_dtype)
    expect = torch._scaled_mm(a, b, scale_a=sa.reshape(()), scale_b=sb.reshape(()), bias=bias, out_dtype=out_dtype)
    assert not torch.equal(expect, _scaled_mm(a, b, sa, sb, out_dtype) + bias)   # the case tells them apart
    assert_bitwise_equal(gemm.fp8_gemm(a, b, sa, sb, out_dtype, bias=bias), expect, "eager")
    torch._dynamo.reset()
    compiled = torch.compile(gemm.fp8_gemm, dynamic=False)
    assert_bitwise_equal(compiled(a, b, sa, sb, out_dtype, bias=bias), expect, "inductor")
    n = b.shape[1]
    assert gemm.adds_bias(bias, out_dtype, n) and not gemm.adds_bias(bias.float(), torch.float32, n)
    assert not gemm.adds_bias(bias, torch.float32, n) and not gemm.adds_bias(bias[None], out_dtype, n)
    assert not gemm.adds_bias(bias[:1], out_dtype, n)   # an addend that broadcasts: added after the GEMM
    # split_bias gives each bias to exactly one of the two places
    addend = bias[:1]
    for args, expect in [((bias, out_dtype, n), (bias, None)),
                         ((bias, out_dtype, n, False), (None, bias)),   # a GEMM without an epilogue
                         ((addend, out_dtype, n), (None, addend)),
                         ((None, out_dtype, n), (None, None))]:
        got = gemm.split_bias(*args)
        assert got[0] is expect[0] and got[1] is expect[1], args


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_linear_adds_its_bias_in_the_forward_gemm_where_the_output_is_bf16(monkeypatch, dtype):
    # torch._scaled_mm as a GPU runs it: a bf16 linear's bias goes into the forward GEMM's epilogue
    # (no pass over the output to add it), its gradient the rows of grad_y summed; an fp32 output
    # keeps the separate add (_scaled_mm takes no fp32 bias)
    import te_compile

    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(kwargs.get("bias"))
        return real(*args, **kwargs)

    monkeypatch.setattr(gemm, "cpu_emulates_scaled_mm", lambda: False)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    torch._dynamo.reset()
    layer = torch.nn.Linear(64, 32).to(dtype)
    x = torch.randn(2, 8, 64, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 8, 32, dtype=dtype)
    compiled = torch.compile(layer, backend=te_compile.backend(recipe="Float8CurrentScaling", compiler="aot_eager"))
    y = compiled(x)
    y.backward(grad)
    torch._dynamo.reset()
    fprop = calls[0]
    if dtype == torch.bfloat16:
        assert fprop is not None and fprop.shape == (32,) and fprop.dtype == dtype, fprop
    else:
        assert fprop is None
    assert all(b is None for b in calls[-2:]), calls   # dgrad and wgrad take none
    assert_bitwise_equal(layer.bias.grad, grad.reshape(-1, 32).sum(0), "bias grad")
    # the output is the FP8 product plus the bias, rounded once (bf16) as _scaled_mm rounds it
    layer.bias.grad = None
    monkeypatch.undo()
    plain = te_compile.recipe.Float8CurrentScaling()
    from te_compile.distributed import NO_GROUPS
    from te_compile.lowerings.linear import Fp8LinearFunction

    x2d = x.detach().reshape(-1, 64)
    with_bias = Fp8LinearFunction.apply(x2d, layer.weight.detach(), plain, NO_GROUPS, None, None, None, None,
                                        layer.bias.detach() if dtype == torch.bfloat16 else None)
    if dtype == torch.float32:
        with_bias = with_bias + layer.bias.detach()
    assert_bitwise_equal(y.detach().reshape(-1, 32), with_bias, "output")


def test_an_addend_that_only_broadcasts_is_added_after_the_gemm(monkeypatch):
    # addmm's addend may be any tensor that broadcasts to y: _scaled_mm takes only an [N] bias, so a
    # [1] addend stays a separate add (a GPU's _scaled_mm would refuse it)
    import te_compile

    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(kwargs.get("bias"))
        return real(*args, **kwargs)

    class Conv1D(torch.nn.Module):   # HF's Conv1D: weight [in, out], addmm
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(64, 32, dtype=torch.bfloat16))
            self.addend = torch.nn.Parameter(torch.randn(1, dtype=torch.bfloat16))

        def forward(self, x):
            return torch.addmm(self.addend, x, self.weight)

    monkeypatch.setattr(gemm, "cpu_emulates_scaled_mm", lambda: False)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    torch._dynamo.reset()
    layer = Conv1D()
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(layer, backend=te_compile.backend(recipe="Float8CurrentScaling", compiler="aot_eager"))
    y = compiled(x)
    y.float().sum().backward()
    torch._dynamo.reset()
    assert calls and all(b is None for b in calls), calls
    assert layer.addend.grad is not None and layer.addend.grad.shape == (1,)


@needs_emulation
def test_the_emulation_copies_no_operand_it_lays_out_itself():
    """A per-tensor linear's graphs on the CPU: the emulated GEMM makes its fp32 upcasts row-major, so
    dgrad's weight operand gets no column-major FP8 copy first, and only an upcast that is not already
    row-major gets its layout forced (forward: the weight's transpose; backward: wgrad's two
    transposed operands). Every node here is traced, partitioned and lowered at every compile."""
    import collections

    import torch._inductor.config as inductor_config

    import te_compile

    graphs = []

    def grab(graph):
        graphs.append(collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function"))

    torch._dynamo.reset()
    layer = torch.nn.Linear(64, 32, bias=False)
    with inductor_config.patch(post_grad_custom_pre_pass=grab):
        torch.compile(layer, backend="te")(torch.randn(16, 64, requires_grad=True)).sum().backward()
    torch._dynamo.reset()
    forward, backward = graphs
    force = "prims.inductor_force_stride_order.default"
    assert (forward["aten.mm.default"], forward[force]) == (1, 1), forward
    assert (backward["aten.mm.default"], backward[force], backward["aten.clone.default"]) == (2, 2, 0), backward


@needs_emulation
def test_a_mismatch_keeps_scaled_mm(monkeypatch):
    """Where the emulation's bits would differ on some machine, the check says so and fp8_gemm calls
    _scaled_mm."""
    monkeypatch.setattr(gemm, "_emulated",
                        lambda a, b, sa, sb, out_dtype, bias=None: _scaled_mm(a, b, sa, sb, out_dtype) + 1)
    gemm._check_cpu_emulation.cache_clear()
    try:
        assert not gemm.cpu_emulates_scaled_mm()
        assert gemm.fp8_gemm_kind("cpu") == "FP8 GEMMs (torch._scaled_mm)"
        a, b, sa, sb = _operands(CASES[0], False)
        assert_bitwise_equal(gemm.fp8_gemm(a, b, sa, sb, torch.float32), _scaled_mm(a, b, sa, sb, torch.float32))
    finally:
        monkeypatch.undo()
        gemm._check_cpu_emulation.cache_clear()
    assert gemm.cpu_emulates_scaled_mm()


@pytest.mark.parametrize("recipe, fprop_fast", [("Float8CurrentScaling", True), ("DelayedScaling", True),
                                                ("Float8CurrentScaling", False)])
def test_only_the_forward_gemm_accumulates_fast(monkeypatch, recipe, fprop_fast):
    # torch._scaled_mm as a GPU runs it (not the CPU emulation): the forward GEMM with use_fast_accum
    # under fprop_fast_accum, the dgrad and wgrad without, as TransformerEngine and torchao run them
    import te_compile

    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(kwargs.get("use_fast_accum", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(gemm, "cpu_emulates_scaled_mm", lambda: False)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    torch._dynamo.reset()
    layer = torch.nn.Linear(64, 32, bias=False)
    options = {"recipe_options": {"fprop_fast_accum": fprop_fast}}
    compiled = torch.compile(layer, backend=te_compile.backend(recipe=recipe, compiler="aot_eager", **options))
    compiled(torch.randn(16, 64, requires_grad=True)).sum().backward()
    torch._dynamo.reset()
    # the forward is traced twice (Dynamo's fake run, then AOTAutograd's joint trace, whose backward
    # follows): fprop calls first, then dgrad and wgrad
    assert len(calls) >= 3 and set(calls[:-2]) == {fprop_fast} and calls[-2:] == [False, False], calls
    assert te_compile.recipe.Float8CurrentScaling(fprop_fast_accum=fprop_fast).fast_accumulation("fprop") is fprop_fast
    assert not te_compile.recipe.Float8CurrentScaling().fast_accumulation("wgrad")
