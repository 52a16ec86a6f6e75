"""fp8_mha's output hand-off (passes/attention_projection.py): an FP8 attention site and the output
projection reading it become one site that quantizes O once and saves it once.

The forms share one module; the fused compile is checked against the unfused one (fp8_mha off: the
forward must not change by a bit), against the kernels' references (the backward reads O from the
projection's FP8 input), and for what autograd saves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from te_compile.kernels.fp8_attention import (
    fp8_attention_backward_reference,
    fp8_attention_forward_reference,
    quantize_heads,
)
from te_compile.gemm.per_tensor import column_major, fp8_gemm
from te_compile.gemm.per_tensor import quantize_weight
from te_compile.recipe import Float8CurrentScaling
from te_compile.scaling import quantize_per_tensor
from utils import assert_bitwise_equal, assert_sqnr_at_least

B, H, HKV, T, D, N = 2, 4, 2, 32, 16, 64


class Block(nn.Module):
    """Causal GQA attention over given q, k, v, then an output projection, spelled as ``form`` says."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.proj = nn.Linear(H * D, N)

    def forward(self, q, k, v):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        b, h, t, d = o.shape
        if self.form == "nanogpt":
            return self.proj(o.transpose(1, 2).contiguous().view(b, t, h * d))
        if self.form == "hf":           # transformers' sdpa_attention_forward, then LlamaAttention
            return self.proj(o.transpose(1, 2).contiguous().reshape(b, t, -1).contiguous())
        if self.form == "flat":
            return self.proj(o.permute(0, 2, 1, 3).reshape(b * t, h * d)).view(b, t, -1)
        if self.form == "also_read":    # O is needed elsewhere too
            return self.proj(o.transpose(1, 2).reshape(b, t, h * d)) + o.sum()
        if self.form == "cast":
            return self.proj(o.transpose(1, 2).reshape(b, t, h * d).half().float())
        if self.form == "block_recipe":
            return self.proj(o.transpose(1, 2).reshape(b, t, h * d))
        raise AssertionError(self.form)


# form: (fused?, what the fp8_mha row's reason says)
FORMS = {
    "nanogpt": (True, "FP8 O handed to forms.nanogpt.proj (quantized and saved once)"),
    "hf": (True, "FP8 O handed to forms.hf.proj"),
    "flat": (True, "FP8 O handed to forms.flat.proj"),
    "also_read": (False, "its output is read other than as transpose(1, 2) into one projection"),
    "cast": (False, "forms.cast.proj: a dtype cast between attention and the projection"),
    "block_recipe": (False, "forms.block_recipe.proj: recipe MXFP8BlockScaling (attention fusion covers"),
}
FUSED = [name for name, (fused, _) in FORMS.items() if fused]


class Forms(nn.Module):
    def __init__(self):
        super().__init__()
        self.forms = nn.ModuleDict({name: Block(name) for name in FORMS})

    def forward(self, inputs):
        return {name: m(*inputs[name]) for name, m in self.forms.items()}


def _inputs() -> dict:
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    return {name: (rnd(B, H, T, D), rnd(B, HKV, T, D), rnd(B, HKV, T, D)) for name in FORMS}


def _options(mha: bool, **extra) -> dict:
    return {"recipe": "Float8CurrentScaling", "compiler": "aot_eager",
            "recipe_options": {"fp8_dpa": True, "fp8_mha": mha},
            "overrides": [{"modules": "forms.block_recipe.proj", "recipe": "MXFP8BlockScaling"}], **extra}


def _run(model: nn.Module, options: dict):
    torch._dynamo.reset()
    te_compile.reset()
    fn = torch.compile(model, backend="te", options=options)
    inputs = _inputs()
    outs = fn(inputs)
    gen = torch.Generator().manual_seed(1)
    douts = {name: torch.randn(o.shape, generator=gen) for name, o in outs.items()}
    torch.autograd.backward(list(outs.values()), list(douts.values()))
    grads = {name: tuple(t.grad for t in inputs[name]) for name in FORMS}
    weight_grads = {name: model.forms[name].proj.weight.grad.clone() for name in FORMS}
    model.zero_grad()
    return SimpleNamespace(report=te_compile.report(), inputs=inputs, outs=outs, douts=douts, grads=grads,
                           weight_grads=weight_grads)


@pytest.fixture(scope="module")
def runs():
    torch.manual_seed(0)
    model = Forms()
    return _run(model, _options(True)), _run(model, _options(False)), model


def test_one_fp8_mha_row_per_site_with_the_reason(runs):
    fused, unfused, _ = runs
    rows = {s.fqn.split(".")[1]: s for s in fused.report.sites if s.op == "fp8_mha"}
    assert sorted(rows) == sorted(FORMS), str(fused.report)
    for name, (ok, reason) in FORMS.items():
        assert rows[name].rewritten == ok and reason in rows[name].reason, (name, rows[name])
    assert not [s for s in unfused.report.sites if s.op == "fp8_mha"]
    # the attention and linear rows are there as before
    assert sum(s.op == "sdpa" and s.rewritten for s in fused.report.sites) == len(FORMS)


def test_the_forward_is_the_unfused_forward_bit_for_bit(runs):
    fused, unfused, _ = runs
    for name in FORMS:
        assert_bitwise_equal(fused.outs[name], unfused.outs[name], name)
    for name in FUSED:   # and the weight gradient: the same FP8 O, the same dy
        assert_bitwise_equal(fused.weight_grads[name], unfused.weight_grads[name], f"{name} dW")


@pytest.mark.parametrize("name", FUSED)
def test_the_backward_reads_o_from_the_projections_fp8_input(runs, name):
    fused, unfused, model = runs
    q, k, v = (t.detach() for t in fused.inputs[name])
    recipe = Float8CurrentScaling()
    (q8, qd), (k8, kd), (v8, vd) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
    kwargs = dict(sm_scale=D ** -0.5, causal=True)
    o, lse = fp8_attention_forward_reference(q8, k8, v8, qd, kd, vd, **kwargs)
    xq, x_sinv, _ = quantize_per_tensor(o.transpose(1, 2).reshape(B * T, H * D), "input", recipe)
    wq, w_sinv, _ = quantize_weight(model.forms[name].proj.weight.detach(), recipe)
    gq, g_sinv, _ = quantize_per_tensor(fused.douts[name].reshape(B * T, N), "grad_output", recipe)
    dx = fp8_gemm(gq.contiguous(), column_major(wq.contiguous()), g_sinv, w_sinv, out_dtype=torch.float32)
    do = dx.reshape(B, T, H, D).transpose(1, 2).contiguous()
    o_fp8 = xq.view(B, T, H, D).transpose(1, 2).float() * x_sinv
    expect = fp8_attention_backward_reference(do, q8, k8, v8, qd, kd, vd, o_fp8, lse, **kwargs)
    for g, e, which in zip(fused.grads[name], expect, "qkv"):
        assert_bitwise_equal(g, e, f"{name} d{which}")
        # as close to the unfused site's gradients as FP8 O allows
        assert_sqnr_at_least(unfused.grads[name]["qkv".index(which)], g, 25.0, f"{name} d{which}")


def test_o_is_saved_once():
    """What autograd keeps for the backward, under inductor (whose partitioner picks it): with fp8_mha
    no per-head FP8 copy of O and no per-head descales of it beside the projection's FP8 input."""
    saved = {}
    for mha in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        fn = torch.compile(Block("nanogpt"), backend="te", options=_options(mha, compiler="inductor"))
        tensors = []

        def pack(t):
            if not isinstance(t, nn.Parameter):
                tensors.append(t)
            return t

        q, k, v = _inputs()["nanogpt"]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(q, k, v).sum().backward()
        saved[mha] = tensors

    def count(mha, shape, dtype):
        return sum(tuple(t.shape) == shape and t.dtype == dtype for t in saved[mha])

    e4m3 = torch.float8_e4m3fn
    # FP8 [B, H, T, D]: Q and O apart, Q alone fused (O is the projection's [B*T, H*D] input)
    assert (count(False, (B, H, T, D), e4m3), count(True, (B, H, T, D), e4m3)) == (2, 1)
    # per-head descales [B, H]: Q's and O's apart, Q's alone fused
    assert (count(False, (B, H), torch.float32), count(True, (B, H), torch.float32)) == (2, 1)
    nbytes = {mha: sum(t.numel() * t.element_size() for t in saved[mha]) for mha in saved}
    assert nbytes[False] - nbytes[True] >= B * H * T * D + 4 * B * H, nbytes


def test_delayed_scaling_keeps_both_states_and_the_forward():
    torch.manual_seed(0)
    model = nn.ModuleDict({"forms": nn.ModuleDict({"nanogpt": Block("nanogpt")})})

    def run(mha):
        torch._dynamo.reset()
        te_compile.reset()
        block = model["forms"]["nanogpt"]
        state_before = te_compile.recipe_state_dict(block)
        te_compile.load_recipe_state_dict(block, {k: torch.ones_like(v) if k.endswith("scale") else
                                                  torch.zeros_like(v) for k, v in state_before.items()})
        fn = torch.compile(block, backend="te", options={
            "recipe": "DelayedScaling", "compiler": "aot_eager",
            "recipe_options": {"fp8_dpa": True, "fp8_mha": mha, "amax_history_len": 2}})
        outs = []
        for step in range(2):
            q, k, v = (t * (1 + step) for t in _inputs()["nanogpt"])
            y = fn(q, k, v)
            y.sum().backward()
            outs.append(y.detach())
        return outs, te_compile.recipe_state_dict(block), te_compile.report()

    fused, fused_state, report = run(True)
    assert any(s.op == "fp8_mha" and s.rewritten for s in report.sites), str(report)
    unfused, unfused_state, _ = run(False)
    assert sorted(fused_state) == sorted(unfused_state) and any(k.startswith("sdpa.") for k in fused_state)
    for a, b in zip(fused, unfused):
        assert_bitwise_equal(a, b)
    # the forward amaxes (query, key, value; the projection's input and weight) are the same
    for key in fused_state:
        if "grad_output" not in key:
            assert_bitwise_equal(fused_state[key], unfused_state[key], key)


def test_a_bf16_projection_adds_its_bias_as_the_plain_linear_does():
    # a bf16 output projection takes its bias into the FP8 GEMM's epilogue (one rounding); the fused
    # site must too, or its forward would no longer be the two sites' apart, bit for bit
    def run(mha: bool):
        torch.manual_seed(0)
        block = Block("nanogpt").to(torch.bfloat16)
        torch._dynamo.reset()
        te_compile.reset()
        options = {"recipe": "Float8CurrentScaling", "compiler": "aot_eager",
                   "recipe_options": {"fp8_dpa": True, "fp8_mha": mha}}
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(*shape, generator=gen).to(torch.bfloat16).requires_grad_()
                   for shape in ((B, H, T, D), (B, HKV, T, D), (B, HKV, T, D)))
        y = torch.compile(block, backend="te", options=options)(q, k, v)
        y.backward(torch.randn(y.shape, generator=gen).to(torch.bfloat16))
        fused = [s for s in te_compile.report().sites if s.op == "fp8_mha" and s.rewritten]
        return y.detach(), block.proj.bias.grad, fused

    y_fused, db_fused, rows = run(True)
    y_apart, db_apart, no_rows = run(False)
    assert len(rows) == 1 and not no_rows, (rows, no_rows)
    assert_bitwise_equal(y_fused, y_apart, "output")
    assert_bitwise_equal(db_fused, db_apart, "bias grad")
