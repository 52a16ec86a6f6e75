"""MoE experts: the grouped GEMM ops, the per-expert FP8 lowering against a per-expert reference of
the same quantization, and the pass that finds grouped GEMMs in unchanged model code (aot_eager)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from te_compile.gemm import grouped
from te_compile.gemm.grouped import (group_index, grouped_mm_f32, grouped_mm_f32_reference, pad_groups,
                                     scaled_grouped_mm)
from te_compile.lowerings.grouped_linear import GroupedLinearLowering, GroupedLinearSpec
from te_compile.gemm.block import quantize_copies, quantizer_factory
from te_compile.lowerings.linear import LinearLowering, LinearSpec
from te_compile.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
                               NVFP4BlockScaling)
from te_compile.scaling import quantize_per_tensor
from utils import assert_bitwise_equal, assert_sqnr_at_least, seed, sqnr

E, K, N = 4, 32, 48
OPTIONS = {"compiler": "aot_eager"}
# tokens per expert: an empty expert, a one-row expert, prime counts; 3 rows past the last expert
COUNTS = [5, 0, 17, 1]
TAIL = 3


def _offs(counts) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _reference(x, w_enk, g, counts, recipe):
    """Per expert, the dense per-tensor quantization of its rows / weight / gradient rows, fp32
    products of the FP8 values, the scales applied to the product: (y, dx, dw)."""
    y = torch.zeros(x.shape[0], w_enk.shape[1], dtype=x.dtype)
    dx, dw = torch.zeros_like(x), torch.zeros_like(w_enk)
    start = 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        start += count
        if count == 0:
            continue
        xq, xs, _ = quantize_per_tensor(x[rows], "input", recipe)
        wq, ws, _ = quantize_per_tensor(w_enk[e], "weight", recipe)
        gq, gs, _ = quantize_per_tensor(g[rows], "grad_output", recipe)
        f32 = lambda t: t.float().contiguous()   # noqa: E731
        y[rows] = ((f32(xq) @ f32(wq.t())) * xs * ws).to(x.dtype)
        dx[rows] = ((f32(gq) @ f32(wq)) * gs * ws).to(x.dtype)
        dw[e] = ((f32(gq.t()) @ f32(xq)) * gs * xs).to(w_enk.dtype)
    return y, dx, dw


def _run(lowering, x, w_enk, g, offs):
    """The lowering's (y, dx, dw [E, N, K]) for weights stored [E, N, K] (read transposed)."""
    x, w_enk = x.clone().requires_grad_(), w_enk.clone().requires_grad_()
    y = lowering(x, w_enk.transpose(1, 2), offs)
    dx, dw = torch.autograd.grad(y, (x, w_enk), g)
    return y, dx, dw


# ---- the ops ---------------------------------------------------------------------------------------


def test_grouped_mm_f32_forms_match_per_group_matmuls_and_zero_what_no_group_reads():
    gen = seed(0)
    offs = _offs(COUNTS)
    m = sum(COUNTS) + TAIL
    a, b3 = torch.randn(m, K, generator=gen), torch.randn(E, K, N, generator=gen)
    out = grouped_mm_f32(a, b3, offs)
    assert_bitwise_equal(out[:5], a[:5] @ b3[0], "group 0")
    assert_bitwise_equal(out[22:23], a[22:23] @ b3[3], "one-row group")
    assert torch.equal(out[-TAIL:], torch.zeros(TAIL, N)), "rows past offs[-1] must be 0"
    at, b2 = torch.randn(N, m, generator=gen), torch.randn(m, K, generator=gen)
    dw = grouped_mm_f32(at, b2, offs)
    assert dw.shape == (E, N, K)
    assert_bitwise_equal(dw[2], at[:, 5:22].contiguous() @ b2[5:22], "wgrad group 2")
    assert torch.equal(dw[1], torch.zeros(N, K)), "an empty group's wgrad must be 0"


def test_grouped_mm_f32_compiles_without_graph_breaks_and_keeps_its_bits():
    gen = seed(1)
    offs = _offs(COUNTS)
    a = torch.randn(sum(COUNTS), K, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(E, K, N, generator=gen).to(torch.float8_e4m3fn)
    compiled = torch.compile(lambda a, b, o: grouped_mm_f32(a, b, o) * 2, fullgraph=True)
    assert_bitwise_equal(compiled(a, b, offs), grouped_mm_f32_reference(a, b, offs) * 2)


@pytest.mark.parametrize("counts", [COUNTS, [0, 0, 0, 23], [16, 32, 1, 15]], ids=["mixed", "one", "aligned"])
def test_pad_groups_places_each_group_at_an_aligned_start_without_overlap(counts):
    offs = _offs(counts)
    rows = sum(counts) + TAIL
    dest, padded_offs, padded_rows = pad_groups(offs, rows, 16)
    assert padded_rows % 16 == 0 and rows + E * 15 <= padded_rows < rows + E * 15 + 16
    assert all(int(o) % 16 == 0 for o in padded_offs), padded_offs
    assert len(set(dest.tolist())) == rows and int(dest.max()) < padded_rows
    starts = [0, *padded_offs[:-1].tolist()]
    for e, (start, count) in enumerate(zip([0, *offs[:-1].tolist()], counts)):
        assert dest[start:start + count].tolist() == list(range(starts[e], starts[e] + count)), e
    assert int(dest[sum(counts)]) >= int(padded_offs[-1]), "rows past the end stay past the padded end"


def test_scaled_grouped_mm_applies_row_and_column_scales_to_the_fp32_product():
    gen = seed(2)
    offs = _offs(COUNTS)
    m = sum(COUNTS)
    a = torch.randn(m, K, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(E, K, N, generator=gen).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(m, generator=gen) + 0.5, torch.rand(E, N, generator=gen) + 0.5
    out = scaled_grouped_mm(a, b, sa, sb, offs, torch.bfloat16)
    rows = slice(5, 22)
    expected = ((a[rows].float() @ b[2].float()) * sa[rows, None] * sb[2]).to(torch.bfloat16)
    assert_bitwise_equal(out[rows], expected)


@pytest.mark.parametrize("form", ["2d x 3d", "2d x 2d"])
def test_scaled_grouped_mm_of_e5m2_through_the_bf16_grouped_gemm_rounds_once_more(monkeypatch, form):
    """CUDA's route for E5M2 operands (torch._grouped_mm of the FP8 values in bf16, scales after), run
    on the CPU's torch._grouped_mm: the accumulator rounded to bf16, then the scaled product."""
    gen = seed(4)
    offs = _offs([16, 0, 32, 16])
    m = int(offs[-1])
    if form == "2d x 3d":
        a = torch.randn(m, K, generator=gen).to(torch.float8_e5m2)
        b = torch.randn(len(offs), K, N, generator=gen).to(torch.float8_e4m3fn)
        sa, sb = torch.rand(m, generator=gen) + 0.5, torch.rand(len(offs), N, generator=gen) + 0.5
        scale = lambda acc: acc * sa[:, None] * sb[group_index(offs, m).clamp(max=len(offs) - 1)]
    else:
        a = torch.randn(N, m, generator=gen).to(torch.float8_e5m2)
        b = torch.randn(m, K, generator=gen).to(torch.float8_e4m3fn)
        sa, sb = torch.rand(len(offs) * N, generator=gen) + 0.5, torch.rand(len(offs) * K, generator=gen) + 0.5
        scale = lambda acc: acc * sa.view(len(offs), -1, 1) * sb.view(len(offs), 1, -1)
    exact = scaled_grouped_mm(a, b, sa, sb, offs, torch.bfloat16)
    monkeypatch.setattr(grouped, "uses_bf16_grouped_gemm", lambda *args: True)
    out = scaled_grouped_mm(a, b, sa, sb, offs, torch.bfloat16)
    acc16 = grouped_mm_f32_reference(a, b, offs).to(torch.bfloat16).float()
    assert_bitwise_equal(out, scale(acc16).to(torch.bfloat16))
    assert sqnr(out, exact) > 45   # one bf16 rounding more than the scaled op's


# ---- the lowering ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", [Format.HYBRID, Format.E4M3], ids=["hybrid", "e4m3"])
def test_forward_dgrad_wgrad_are_bit_exact_against_a_per_expert_reference(dtype, fmt):
    gen = seed(3)
    recipe = Float8CurrentScaling(fp8_format=fmt)
    offs = _offs(COUNTS)
    m = sum(COUNTS) + TAIL
    x, w = torch.randn(m, K, generator=gen).to(dtype), torch.randn(E, N, K, generator=gen).to(dtype)
    g = torch.randn(m, N, generator=gen).to(dtype)
    g[-TAIL:] = float("nan")   # gradients of rows no expert reads must not reach any scale
    y, dx, dw = _run(GroupedLinearLowering(GroupedLinearSpec("experts", recipe)), x, w, g, offs)
    y_ref, dx_ref, dw_ref = _reference(x, w, g, COUNTS, recipe)
    assert_bitwise_equal(y, y_ref, "forward")
    assert_bitwise_equal(dx, dx_ref, "dgrad")
    assert_bitwise_equal(dw, dw_ref, "wgrad")
    assert torch.equal(dw[1], torch.zeros(N, K, dtype=dtype)), "the expert without tokens gets a zero gradient"
    assert not dw.isnan().any() and not dx.isnan().any()


def test_padding_to_the_native_alignment_gives_the_same_bits():
    gen = seed(4)
    recipe = Float8CurrentScaling()
    offs = _offs(COUNTS)
    m = sum(COUNTS) + TAIL
    x, w, g = torch.randn(m, K, generator=gen), torch.randn(E, N, K, generator=gen), torch.randn(m, N, generator=gen)
    plain = _run(GroupedLinearLowering(GroupedLinearSpec("experts", recipe)), x, w, g, offs)
    padded = _run(GroupedLinearLowering(GroupedLinearSpec("experts", recipe, align=16)), x, w, g, offs)
    for name, a, b in zip(("forward", "dgrad", "wgrad"), plain, padded):
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize("factor", [1e3, 1e5], ids=["1000x", "100000x"])
def test_sqnr_against_high_precision_and_a_small_expert_keeps_its_own(factor):
    gen = seed(5)
    recipe = Float8CurrentScaling()
    counts = [64, 48, 80, 64]
    offs = _offs(counts)
    bounds = list(zip([0, *offs[:-1].tolist()], offs.tolist()))
    x, g = torch.randn(sum(counts), K, generator=gen), torch.randn(sum(counts), N, generator=gen)
    w = torch.randn(E, N, K, generator=gen)
    w[2] /= factor   # one expert's weights much smaller than the others'
    y, dx, dw = _run(GroupedLinearLowering(GroupedLinearSpec("experts", recipe)), x, w, g, offs)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_hp = torch.cat([xr[s:e] @ wr[i].t() for i, (s, e) in enumerate(bounds)])
    dx_hp, dw_hp = torch.autograd.grad(y_hp, (xr, wr), g)
    assert_sqnr_at_least(y_hp, y, 25.0, "forward")
    assert_sqnr_at_least(dx_hp, dx, 20.0, "dgrad")
    assert_sqnr_at_least(dw_hp, dw, 20.0, "wgrad")
    per_expert = [sqnr(y_hp[s:e], y[s:e]) for s, e in bounds]
    assert per_expert[2] >= min(per_expert[i] for i in (0, 1, 3)) - 1.0, per_expert
    assert_sqnr_at_least(dw_hp[2], dw[2], 20.0, "the small expert's weight gradient")
    if factor > 1e4:   # the test can tell: one scale for every expert would crush the small one
        wq, ws, _ = quantize_per_tensor(w, "weight", recipe)
        assert sqnr(w[2], wq[2].float() * ws) < 10.0


# NVFP4 without stochastic rounding where bits are compared (its random draws differ when the
# experts are quantized one by one)
BLOCK_RECIPES = [MXFP8BlockScaling(), Float8BlockScaling(), NVFP4BlockScaling(disable_stochastic_rounding=True)]
# SQNR floors against high precision (forward, gradients): 4-bit elements sit far lower
BLOCK_SQNR = {"MXFP8BlockScaling": (25.0, 20.0), "Float8BlockScaling": (25.0, 20.0), "NVFP4BlockScaling": (15.0, 13.0)}


def _block_reference(x, w_enk, g, counts, recipe):
    """Per expert, the block quantization the dense block linear makes of its rows, weight and
    gradient rows alone (its columnwise copies from those rows padded with zero rows to whole token
    blocks), each GEMM an fp32 product of contiguous dequantized operands: (y, dx, dw)."""
    factory = quantizer_factory(recipe)
    rows_per_block = recipe.token_block_rows
    f32 = lambda q: q.dequantize(dtype=torch.float32).contiguous()   # noqa: E731
    y = torch.zeros(x.shape[0], w_enk.shape[1])
    dx, dw = torch.zeros_like(x), torch.zeros_like(w_enk)
    start = 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        start += count
        if count == 0:
            continue
        pad = lambda t: F.pad(t, (0, 0, 0, (-count) % rows_per_block))   # noqa: E731
        qw = quantize_copies(factory, "weight", w_enk[e], columnwise=True)
        y[rows] = f32(quantize_copies(factory, "input", x[rows])) @ f32(qw).t().contiguous()
        qw.update_usage(rowwise_usage=False)
        dx[rows] = f32(quantize_copies(factory, "grad_output", g[rows])) @ f32(qw)
        g_col = quantize_copies(factory, "grad_output", pad(g[rows]), rowwise=False, columnwise=True)
        x_col = quantize_copies(factory, "input", pad(x[rows]), rowwise=False, columnwise=True)
        dw[e] = f32(g_col).t().contiguous() @ f32(x_col)
    return y, dx, dw


@pytest.mark.parametrize("recipe", BLOCK_RECIPES, ids=lambda r: r.name)
def test_block_formats_per_expert_are_bit_exact_against_a_per_expert_reference(recipe):
    """COUNTS puts expert boundaries inside the token blocks (16, 32 or 128 rows) of the wgrad operands:
    the same bits as quantizing each expert alone means no block spans two experts, and for NVFP4 that
    each expert's tokens get their own tensor-level scale. The dense block linear on each expert alone
    agrees to fp32 rounding (its GEMMs read transposed views)."""
    gen = seed(30)
    k, n = 64, 96   # MXFP8 needs K, N % 32 == 0
    offs = _offs(COUNTS)
    m = sum(COUNTS) + TAIL
    x, w = torch.randn(m, k, generator=gen), torch.randn(E, n, k, generator=gen)
    g = torch.randn(m, n, generator=gen)
    g[-TAIL:] = float("nan")   # rows no expert reads must reach no block
    y, dx, dw = _run(GroupedLinearLowering(GroupedLinearSpec("experts", recipe)), x, w, g, offs)
    y_ref, dx_ref, dw_ref = _block_reference(x, w, g, COUNTS, recipe)
    assert_bitwise_equal(y, y_ref, "forward")
    assert_bitwise_equal(dx, dx_ref, "dgrad")
    assert_bitwise_equal(dw, dw_ref, "wgrad")
    assert torch.equal(dw[1], torch.zeros(n, k)) and not dw.isnan().any() and not dx.isnan().any()
    dense = LinearLowering(LinearSpec("", recipe))
    xe, we = x[5:22].clone().requires_grad_(), w[2].clone().requires_grad_()
    ye = dense(xe, we, None)
    for ours, theirs, what in zip((y[5:22], dx[5:22], dw[2]), (ye, *torch.autograd.grad(ye, (xe, we), g[5:22])),
                                  ("forward", "dgrad", "wgrad")):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=f"dense block linear, {what}")


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8BlockScaling(), NVFP4BlockScaling()],
                         ids=lambda r: r.name)
def test_block_formats_per_expert_against_high_precision(recipe):
    forward_db, gradient_db = BLOCK_SQNR[recipe.name]
    gen = seed(31)
    counts = [64, 48, 80, 64]
    offs = _offs(counts)
    bounds = list(zip([0, *offs[:-1].tolist()], offs.tolist()))
    x, g = torch.randn(sum(counts), 64, generator=gen), torch.randn(sum(counts), 96, generator=gen)
    w = torch.randn(E, 96, 64, generator=gen)
    w[2] /= 1e3
    y, dx, dw = _run(GroupedLinearLowering(GroupedLinearSpec("experts", recipe)), x, w, g, offs)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_hp = torch.cat([xr[s:e] @ wr[i].t() for i, (s, e) in enumerate(bounds)])
    dx_hp, dw_hp = torch.autograd.grad(y_hp, (xr, wr), g)
    assert_sqnr_at_least(y_hp, y, forward_db, "forward")
    assert_sqnr_at_least(dx_hp, dx, gradient_db, "dgrad")
    assert_sqnr_at_least(dw_hp, dw, gradient_db, "wgrad")
    small = slice(*bounds[2])
    assert_sqnr_at_least(y_hp[small], y[small], forward_db, "the small expert")


def test_an_expert_without_tokens_anywhere_gives_zeros_not_nan():
    recipe = Float8CurrentScaling()
    offs = _offs([0, 0, 0, 0])
    x, w, g = torch.randn(TAIL, K), torch.randn(E, N, K), torch.randn(TAIL, N)
    y, dx, dw = _run(GroupedLinearLowering(GroupedLinearSpec("experts", recipe)), x, w, g, offs)
    assert torch.equal(y, torch.zeros(TAIL, N)) and torch.equal(dx, torch.zeros(TAIL, K))
    assert torch.equal(dw, torch.zeros(E, N, K))


# ---- the pass -------------------------------------------------------------------------------------


class GroupedExperts(nn.Module):
    """torchtitan-style experts: SwiGLU per expert through torch._grouped_mm in bf16, weights kept in
    fp32. w1, w3: [E, hidden, dim] and w2: [E, dim, hidden] read transposed, or stored [E, in, out]."""

    def __init__(self, dim=K, hidden=N, experts=E, in_out=False):
        super().__init__()
        self.in_out = in_out
        shape_up, shape_down = ((experts, dim, hidden), (experts, hidden, dim)) if in_out else \
            ((experts, hidden, dim), (experts, dim, hidden))
        self.w1 = nn.Parameter(torch.randn(shape_up) / dim**0.5)
        self.w3 = nn.Parameter(torch.randn(shape_up) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(shape_down) / hidden**0.5)

    def _weight(self, w):
        w = w.bfloat16()
        return w if self.in_out else w.transpose(-2, -1)

    def forward(self, x, tokens_per_expert):   # x: [M, dim] sorted by expert
        offs = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        xb = x.bfloat16()
        h = F.silu(torch._grouped_mm(xb, self._weight(self.w1), offs=offs))
        h = h * torch._grouped_mm(xb, self._weight(self.w3), offs=offs)
        return torch._grouped_mm(h, self._weight(self.w2), offs=offs).type_as(x)


class MoE(nn.Module):
    """Router (top-2), sort by expert, the grouped experts, weighted scatter back; a shared expert."""

    def __init__(self, in_out=False):
        super().__init__()
        self.router = nn.Linear(K, E, bias=False)   # N = 4: stays in high precision
        self.experts = GroupedExperts(in_out=in_out)
        self.shared = nn.Linear(K, K)

    def forward(self, x):   # x: [T, K]
        scores = self.router(x).softmax(-1)
        weights, chosen = scores.topk(2, dim=-1)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=E, min=0, max=E - 1).to(torch.int32)
        out = self.experts(x[order // 2], counts) * weights.reshape(-1)[order, None]
        routed = torch.zeros_like(x).index_add(0, order // 2, out)
        return routed + self.shared(x)


def _compile_report(model, *args, config=None, **kwargs):
    torch._dynamo.reset()
    te_compile.reset()
    compiled = torch.compile(model, backend="te", fullgraph=True, options={**OPTIONS, **(config or {})})
    return compiled(*args, **kwargs), te_compile.report()


@pytest.mark.parametrize("in_out", [False, True], ids=["out_in", "in_out"])
def test_torchtitan_style_experts_are_rewritten_and_match_the_lowering_bit_for_bit(in_out):
    gen = seed(6)
    experts = GroupedExperts(in_out=in_out)
    x = torch.randn(sum(COUNTS), K, generator=gen)
    counts = torch.tensor(COUNTS)
    y, report = _compile_report(experts, x, counts)
    rows = [s for s in report.sites if s.op == "grouped_linear"]
    assert [(s.fqn, s.rewritten) for s in rows] == [("", True)] * 3, str(report)
    assert ("[E, in, out]" if in_out else "[E, out, in]") in rows[0].reason
    # eager, with each grouped GEMM called through the lowering
    low = GroupedLinearLowering(GroupedLinearSpec("", Float8CurrentScaling()))
    offs = _offs(COUNTS)
    xb = x.bfloat16()
    h = F.silu(low(xb, experts._weight(experts.w1), offs)) * low(xb, experts._weight(experts.w3), offs)
    assert_bitwise_equal(y, low(h, experts._weight(experts.w2), offs).float())


def test_a_routed_layer_trains_its_experts_and_keeps_the_router_in_high_precision():
    gen = seed(7)
    model = MoE()
    x = torch.randn(24, K, generator=gen)
    y, report = _compile_report(model, x)
    by_fqn = {(s.fqn, s.op): s for s in report.sites}
    assert sum(s.rewritten for s in report.sites if s.op == "grouped_linear") == 3, str(report)
    assert not by_fqn[("router", "linear")].rewritten
    assert "out_features (N)=4" in by_fqn[("router", "linear")].reason
    assert by_fqn[("shared", "linear")].rewritten
    y.square().mean().backward()
    for name in ("w1", "w2", "w3"):
        grad = getattr(model.experts, name).grad
        assert grad is not None and grad.abs().sum() > 0 and not grad.isnan().any(), name
    assert_sqnr_at_least(MoE.forward(model, x).detach(), y.detach(), 20.0, "layer output")


def test_sites_the_pass_leaves_alone_say_why():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(E, K, N))
            self.w_odd = nn.Parameter(torch.randn(E, N, 24))

        def forward(self, x, offs):
            y = torch._grouped_mm(x, self.w.bfloat16(), offs=offs)
            return torch._grouped_mm(y, self.w_odd.bfloat16(), offs=offs)

    x = torch.randn(sum(COUNTS), K).bfloat16()
    offs = _offs(COUNTS)
    _, report = _compile_report(Odd(), x, offs)
    assert [s.rewritten for s in report.sites] == [True, False], str(report)
    assert "out_features (N)=24 is not divisible by 16" in report.sites[1].reason
    _, report = _compile_report(Odd(), x, offs, config={"recipe": "CustomRecipe", "recipe_options": {
        "qfactory": "te_compile.custom_recipes.quantization_current_scaling:current_scaling_ref_quantizer_factory"}})
    assert not any(s.rewritten for s in report.sites) and "CustomRecipe per expert is not built" in report.sites[0].reason
    _, report = _compile_report(Odd(), x, offs, config={"rewrite": {"grouped_linear": False}})
    assert [s.reason for s in report.sites] == ["[rewrite] grouped_linear = false"] * 2, str(report)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_transformers_mixtral_experts_are_rewritten(dtype):
    transformers = pytest.importorskip("transformers", reason="needs transformers for HF model code")
    seed(8)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32)
    model = transformers.MixtralForCausalLM(config).to(dtype)
    ids = torch.randint(0, 64, (2, 8))
    out, report = _compile_report(model, ids, labels=ids)
    rows = [s for s in report.sites if s.op == "grouped_linear"]
    op = "grouped_mm ->" if dtype == torch.bfloat16 else "grouped_mm_fallback ->"
    assert [(s.fqn, s.rewritten) for s in rows] == [("model.layers.0.mlp.experts", True)] * 2, str(report)
    assert all(op in s.reason for s in rows)
    [act] = [s for s in report.sites if s.op == "swiglu"]
    assert act.rewritten and act.reason == "fused into model.layers.0.mlp.experts (grouped GEMM)", str(report)
    out.loss.backward()
    grad = model.model.layers[0].mlp.experts.gate_up_proj.grad
    assert grad is not None and grad.float().abs().sum() > 0



# ---- DelayedScaling: an amax history per expert and role ----------------------------------------

DELAYED = {"recipe": "DelayedScaling", "amax_history_len": 4}


def _delayed_steps(model, x, counts, steps):
    compiled = torch.compile(model, backend="te", fullgraph=True, options={**OPTIONS, **DELAYED})
    outs = []
    for _ in range(steps):
        y = compiled(x, counts)
        y.float().square().mean().backward()
        outs.append(y.detach())
    return outs


def test_delayed_scaling_keeps_a_history_per_expert_and_quantizes_with_the_previous_steps_scales():
    gen = seed(9)
    torch._dynamo.reset()
    te_compile.reset()
    model = GroupedExperts()
    x, counts = torch.randn(sum(COUNTS), K, generator=gen), torch.tensor(COUNTS)
    y1, y2 = _delayed_steps(model, x, counts, 2)
    state = te_compile.recipe_state_dict(model)
    assert state["w1.input.amax_history"].shape == (E, 4) and state["w1.weight.scale"].shape == (E,)
    bounds = list(zip([0, *_offs(COUNTS)[:-1].tolist()], _offs(COUNTS).tolist()))
    xb = x.bfloat16()
    expected = torch.stack([xb[s:e].abs().amax().float() if e > s else torch.tensor(0.0) for s, e in bounds])
    assert_bitwise_equal(state["w1.input.amax_history"][:, 0], expected, "newest input amax per expert")
    assert_bitwise_equal(state["w1.input.amax_history"][:, 1], expected, "the step before (same x)")
    assert state["w1.input.scale"][1] == 1.0, "an expert without tokens keeps scale 1"
    assert torch.equal(state["w1.grad_output.amax_history"][1], torch.zeros(4))
    # step 2 quantized with the scales step 1 left: the lowering with those scales gives its bits
    # (recomputed here from step 1's histories, the weights as they were: no optimizer step)
    from te_compile.lowerings.delayed_state import update_role_state
    recipe = DelayedScaling(amax_history_len=4)
    scales = {}
    for name in ("w1", "w3", "w2"):
        for role in ("input", "weight", "grad_output"):
            history = state[f"{name}.{role}.amax_history"].clone()
            history[:, 0], history[:, 1:] = history[:, 1], 0.0   # the history after step 1 alone
            scale = torch.ones(E)
            update_role_state(torch.zeros(E, 4), scale, history[:, 0].clone(), role, recipe)
            scales[name, role] = scale
    low = GroupedLinearLowering(GroupedLinearSpec("", recipe))
    offs = _offs(COUNTS)

    def call(name, inp):
        return low(inp, model._weight(getattr(model, name)), offs, None,
                   *(scales[name, r] for r in ("input", "weight", "grad_output")))

    h = F.silu(call("w1", xb)) * call("w3", xb)
    assert_bitwise_equal(y2, call("w2", h).float(), "step 2")
    assert not torch.equal(y1, y2), "step 1 ran with scale 1, step 2 with the amaxes of step 1"


def test_delayed_expert_state_resumes_bitwise_from_a_saved_state_dict(tmp_path):
    gen = seed(10)
    x, counts = torch.randn(sum(COUNTS), K, generator=gen), torch.tensor(COUNTS)
    torch._dynamo.reset()
    te_compile.reset()
    model = GroupedExperts()
    resumed = GroupedExperts()
    resumed.load_state_dict(model.state_dict())
    _delayed_steps(model, x, counts, 2)
    torch.save(te_compile.recipe_state_dict(model), tmp_path / "recipe.pt")
    te_compile.load_recipe_state_dict(resumed, torch.load(tmp_path / "recipe.pt", weights_only=True))
    resumed.load_state_dict(model.state_dict())   # the same weights and gradients-to-be
    [y_model] = _delayed_steps(model, x, counts, 1)
    [y_resumed] = _delayed_steps(resumed, x, counts, 1)
    assert_bitwise_equal(y_resumed, y_model, "step 3 after the resume")
    a, b = te_compile.recipe_state_dict(model), te_compile.recipe_state_dict(resumed)
    assert a.keys() == b.keys()
    for key in a:
        assert_bitwise_equal(b[key], a[key], key)


def test_delayed_scaling_quantizes_tokens_two_gemms_share_with_the_first_ones_input_scale():
    gen = seed(12)
    x, counts = torch.randn(sum(COUNTS), K, generator=gen), torch.tensor(COUNTS)
    torch._dynamo.reset()
    te_compile.reset()
    model = GroupedExperts()
    _delayed_steps(model, x, counts, 1)
    [w1_row, w3_row] = [s for s in te_compile.report().sites if s.op == "grouped_linear"][:2]
    assert "tokens quantized" not in w1_row.reason
    assert w3_row.reason.endswith("; tokens quantized with w1's input scale (the same tokens))"), w3_row.reason
    state = te_compile.recipe_state_dict(model)
    # w3's own input scale does not reach its GEMM: halving it changes nothing
    outputs = []
    for factor in (1.0, 0.5):
        changed = {**state, "w3.input.scale": state["w3.input.scale"] * factor}
        te_compile.load_recipe_state_dict(model, changed)
        with torch.no_grad():
            outputs.append(torch.compile(model, backend="te", fullgraph=True, options={**OPTIONS, **DELAYED})(x, counts))
    assert_bitwise_equal(outputs[1], outputs[0], "w3 with half its input scale")
    # each history still records the tokens' amax: the two stay equal
    state = te_compile.recipe_state_dict(model)
    assert_bitwise_equal(state["w3.input.amax_history"], state["w1.input.amax_history"], "w3's input history")


def test_loading_expert_state_of_the_wrong_shape_names_the_key_and_the_shape():
    with pytest.raises(RuntimeError, match=r"w1.input.scale has shape \(1,\), expected \(4,\)"):
        te_compile.load_recipe_state_dict(GroupedExperts(), {
            "w1.input.scale": torch.ones(1), "w1.input.amax_history": torch.zeros(E, 4)}, strict=False)


# ---- the activation between the expert GEMMs ----------------------------------------------------


def _two_steps(experts, recipe: str, fuse: bool, x, counts, tokens: int):
    """A fresh ``experts()`` compiled by te (activation fusion on or off), two steps on x: the first
    ``tokens`` output rows of each step, and the parameters' summed gradients. Two, because
    DelayedScaling's second step reads the state the first one left."""
    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    model = experts()
    compiled = torch.compile(model, backend="te", fullgraph=True,
                             options={**OPTIONS, "recipe": recipe, "rewrite": {"activation": fuse}})
    outs = []
    for _ in range(2):
        y = compiled(x, counts)[:tokens]
        y.float().square().mean().backward()
        outs.append(y.detach())
    return outs, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
def test_swiglu_fused_into_the_second_grouped_gemm_gives_the_unfused_bits(recipe):
    gen = seed(11)
    x, counts = torch.randn(sum(COUNTS), K, generator=gen), torch.tensor(COUNTS)
    results = []
    for fuse in (True, False):
        results.append(_two_steps(GroupedExperts, recipe, fuse, x, counts, sum(COUNTS)))
        [row] = [s for s in te_compile.report().sites if s.op == "swiglu"]
        assert row.rewritten == fuse and (not fuse or row.reason == "fused into <root> (grouped GEMM)"), row
    (fused, fused_grads), (plain, plain_grads) = results
    for step, (a, b) in enumerate(zip(fused, plain)):
        assert_bitwise_equal(a, b, f"output, step {step + 1}")
    for name in fused_grads:
        assert_bitwise_equal(fused_grads[name], plain_grads[name], f"{name}.grad")


class GateUpExperts(nn.Module):
    """HF Mixtral's form: one gate_up GEMM [E, 2 * hidden, dim], its output chunked into gate and up."""

    def __init__(self, dim=K, hidden=N, experts=E):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * hidden, dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)

    def forward(self, x, tokens_per_expert):
        offs = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        gate_up = torch._grouped_mm(x.bfloat16(), self.gate_up.bfloat16().transpose(-2, -1), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.down.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
@pytest.mark.parametrize("experts,gemms", [(GroupedExperts, 3), (GateUpExperts, 2)], ids=["w1-w3", "gate-up-chunked"])
def test_an_expert_mlp_padded_for_the_native_gemms_pads_its_rows_once_with_the_same_bits(monkeypatch, recipe, experts,
                                                                                         gemms):
    # where the grouped GEMMs pad every expert's rows (16 for an sm90 GPU's grouped GEMMs; the CPU
    # needs none, so the test asks for it), the expert MLP's tokens are padded once before the gate
    # and up GEMMs and gathered back once after the fused SwiGLU + down GEMM: one gather instead of
    # one per GEMM (three GEMMs, or two with HF's chunked gate_up GEMM), and padding rows that stay
    # zero change no scale and no gradient
    from te_compile.lowerings.grouped_linear import GatherRows
    from te_compile.passes import grouped_linear as grouped_pass

    gather = GatherRows.apply
    gathers = []
    monkeypatch.setattr(GatherRows, "apply", lambda *args: gathers.append(1) or gather(*args))
    gen = seed(12)
    x, counts = torch.randn(sum(COUNTS) + TAIL, K, generator=gen), torch.tensor(COUNTS)
    results = {}
    for align, fuse in ((16, True), (16, False), (1, True)):
        monkeypatch.setattr(grouped_pass, "_align", lambda site, recipe_, align=align: align)
        gathers.clear()
        outs, grads = _two_steps(experts, recipe, fuse, x, counts, sum(COUNTS))
        rows = {s.op: s for s in te_compile.report().sites}
        results[align, fuse] = (outs, grads, len(gathers), rows["swiglu"].reason)
    (kept, kept_grads, kept_gathers, kept_reason), (apart, apart_grads, apart_gathers, _), (plain, plain_grads, _, reason) = \
        results.values()
    assert kept_reason == "fused into <root> (grouped GEMM), the expert MLP's tokens padded once for all its GEMMs"
    assert reason == "fused into <root> (grouped GEMM)"   # nothing to keep without padding
    assert apart_gathers > 0 and kept_gathers * gemms == apart_gathers, (kept_gathers, apart_gathers)
    for other, other_grads in ((apart, apart_grads), (plain, plain_grads)):
        for step, (a, b) in enumerate(zip(kept, other)):
            assert_bitwise_equal(a, b, f"output, step {step + 1}")
        for name in kept_grads:
            assert_bitwise_equal(kept_grads[name], other_grads[name], f"{name}.grad")


def test_gather_rows_backward_copies_rows_back_without_index_add():
    # the padded GEMM output's rows gathered back: each row at most once, so the gradient is gathered
    # back to where the rows came from, zeros between, the same bits as autograd's index_add into
    # zeros, without atomic adds and without a zero-filled buffer written first
    from torch.fx.experimental.proxy_tensor import make_fx

    from te_compile.lowerings.grouped_linear import GatherRows

    padded = torch.randn(10, 4, dtype=torch.bfloat16, requires_grad=True)
    dest = torch.tensor([0, 2, 3, 7, 9])
    grad = torch.randn(5, 4, dtype=torch.bfloat16)
    ref = padded.index_select(0, dest)
    (ref_grad,) = torch.autograd.grad(ref, padded, grad)
    out = GatherRows.apply(padded, dest)
    (got,) = torch.autograd.grad(out, padded, grad)
    assert torch.equal(out, ref) and torch.equal(got, ref_grad)

    def step(p, g):
        return torch.autograd.grad(GatherRows.apply(p, dest), p, g)

    traced = make_fx(step)(padded.detach().requires_grad_(), grad)
    targets = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert not any("index_add" in t for t in targets), targets
    filled = [n for n in traced.graph.nodes if n.op == "call_function" and "zeros" in str(n.target)
              and n.meta["val"].numel() > 1]
    assert not filled, filled   # the padded gradient [10, 4] is written once, by the gather


def test_pad_rows_writes_token_rows_and_zeros_in_one_gather_and_reads_the_gradient_back():
    from te_compile.lowerings.grouped_linear import PadRows, padding_sources

    offs = _offs(COUNTS)
    m = sum(COUNTS) + TAIL
    dest, _, rows = pad_groups(offs, m, 16)
    src = padding_sources(dest, m, rows)
    x = torch.randn(m, K, dtype=torch.bfloat16, requires_grad=True)
    ref = x.new_zeros(rows, K).index_copy(0, dest, x)
    out = PadRows.apply(x, src, dest)
    assert_bitwise_equal(out, ref, "padded rows")
    g = torch.randn(rows, K, dtype=torch.bfloat16)
    (got,) = torch.autograd.grad(out, x, g)
    (ref_grad,) = torch.autograd.grad(ref, x, g)
    assert_bitwise_equal(got, ref_grad, "gradient")
