"""``fp8_activation_input``: a fused activation's input (SwiGLU's gate and up, GELU's h) saved for
backward in FP8 instead of high precision, dense and between an MoE layer's grouped GEMMs.

Forward is unchanged (the same bytes as without the option); backward reads the dequantized input,
so gradients move by FP8 rounding only (SQNR >= 20 dB against the option off, an expert 1000x
smaller keeping its own); what the step saves is counted."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import te_compile
from te_compile.config import ConfigError, config_from_dict
from te_compile.models import Experts
from te_compile.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from models import ActivationMLP
from utils import assert_bitwise_equal, assert_sqnr_at_least, sqnr

D, H = 32, 64
RECIPES = ["Float8CurrentScaling", "DelayedScaling"]


def _saved(fn):
    """(fn's result, [(shape, dtype)] of every tensor autograd saved while it ran)."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def _dense(model, x, recipe, fp8_input):
    torch._dynamo.reset()
    te_compile.reset()
    options = {"recipe": recipe, "compiler": "aot_eager", "recipe_options": {"fp8_activation_input": fp8_input}}
    compiled = torch.compile(model, backend="te", options=options)
    x = x.detach().clone().requires_grad_()
    outs = []
    for _ in range(2):   # DelayedScaling: the second step quantizes with the first one's scales
        y, saved = _saved(lambda: compiled(x))
        y.square().mean().backward()
        outs.append(y.detach())
    [row] = [s for s in te_compile.report().sites if s.op in ("swiglu", "gelu")]
    grads = {"x": x.grad, **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
    return outs, grads, saved, row


def test_only_the_per_tensor_recipes_take_the_option_and_configs_name_it():
    assert Float8CurrentScaling(fp8_activation_input=True).fp8_activation_input
    assert DelayedScaling(fp8_activation_input=True).options()["fp8_activation_input"] is True
    for recipe in (MXFP8BlockScaling, Float8BlockScaling):   # block recipes fuse no activation
        with pytest.raises(TypeError, match="fp8_activation_input"):
            recipe(fp8_activation_input=True)
    with pytest.raises(ValueError, match="fp8_activation_input must be a bool"):
        Float8CurrentScaling(fp8_activation_input="yes")
    config = config_from_dict({"recipe": "DelayedScaling", "recipe_options": {"fp8_activation_input": True}}, "t.toml")
    assert config.recipe.fp8_activation_input
    with pytest.raises(ConfigError, match="fp8_activation_input"):
        config_from_dict({"recipe": "MXFP8BlockScaling", "recipe_options": {"fp8_activation_input": True}}, "t.toml")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_dense_forward_keeps_its_bytes_and_backward_reads_the_fp8_input(kind, recipe):
    torch.manual_seed(0)
    base, x = ActivationMLP(kind, D, H), torch.randn(4, 8, D)
    outs, grads, saved, row = _dense(copy.deepcopy(base), x, recipe, True)
    plain_outs, plain_grads, plain_saved, plain_row = _dense(copy.deepcopy(base), x, recipe, False)
    assert row.rewritten and row.reason == "fused into down; input saved for backward in FP8 (fp8_activation_input)"
    assert plain_row.reason == "fused into down"
    for step, (a, b) in enumerate(zip(outs, plain_outs)):
        assert_bitwise_equal(a, b, f"output, step {step + 1}")
    moved = 0
    for name, g in grads.items():   # two steps' gradients, accumulated
        assert_sqnr_at_least(plain_grads[name], g, 20.0, name)
        moved += not torch.equal(g, plain_grads[name])
    assert moved, "no gradient changed: the FP8 input was not what backward read"
    # the activation's inputs [32, 64]: saved as fp8 bytes instead of fp32 (of that shape in fp32,
    # only down's weight is left)
    inputs = 2 if kind == "swiglu" else 1
    assert saved.count(((32, H), torch.float8_e4m3fn)) >= inputs, saved
    assert saved.count(((32, H), torch.float32)) == 1, saved
    assert plain_saved.count(((32, H), torch.float32)) == 1 + inputs, plain_saved


def _experts_step(model, x, counts, recipe, fp8_input):
    torch._dynamo.reset()
    te_compile.reset()
    options = {"recipe": recipe, "compiler": "aot_eager", "recipe_options": {"fp8_activation_input": fp8_input}}
    compiled = torch.compile(model, backend="te", options=options, fullgraph=True)
    x = x.detach().clone().requires_grad_()
    y, saved = _saved(lambda: compiled(x, counts))
    y.float().square().mean().backward()
    [row] = [s for s in te_compile.report().sites if s.op == "swiglu"]
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in model.named_parameters()}}, saved, row


@pytest.mark.parametrize("recipe", RECIPES)
def test_between_expert_gemms_each_expert_saves_its_input_with_its_own_scale(recipe):
    experts, dim, hidden, counts = 4, 32, 48, torch.tensor([24, 0, 17, 23])
    torch.manual_seed(0)
    base = Experts(experts, dim, hidden)
    for p in base.parameters():
        nn.init.normal_(p, std=dim ** -0.5)
    x = torch.randn(int(counts.sum()), dim)
    x[41:] *= 1e-3   # the last expert's tokens: its gate and up are 1000x smaller than the others'
    y, grads, saved, row = _experts_step(copy.deepcopy(base), x, counts, recipe, True)
    plain_y, plain_grads, plain_saved, _ = _experts_step(copy.deepcopy(base), x, counts, recipe, False)
    assert row.reason == "fused into <root> (grouped GEMM); input saved for backward in FP8 (fp8_activation_input)"
    assert_bitwise_equal(y, plain_y, "output")
    for name, g in grads.items():
        assert_sqnr_at_least(plain_grads[name], g, 20.0, name)
        assert sqnr(plain_grads[name], g) < float("inf"), f"{name}: the FP8 input was not what backward read"
    # the small expert's own gradients: a scale shared with the others would flush its inputs to zero
    assert_sqnr_at_least(plain_grads["x"][41:], grads["x"][41:], 20.0, "dx of the small expert")
    assert_sqnr_at_least(plain_grads["w1"][3], grads["w1"][3], 20.0, "dw1 of the small expert")


def test_under_inductor_the_moe_layer_saves_gate_and_up_in_fp8():
    # what is saved is the partitioner's choice: inductor's keeps the FP8 copies (aot_eager's may keep
    # the bf16 inputs and quantize them again in backward: the same gradients, no bytes saved)
    experts, dim, hidden, counts = 4, 32, 48, torch.tensor([24, 0, 17, 23])
    torch.manual_seed(0)
    base, x, rows = Experts(experts, dim, hidden), torch.randn(int(counts.sum()), dim), int(counts.sum())
    for p in base.parameters():
        nn.init.normal_(p, std=dim ** -0.5)
    saved = {}
    for fp8_input in (True, False):
        torch._dynamo.reset()
        te_compile.reset()
        options = {"recipe": "Float8CurrentScaling", "recipe_options": {"fp8_activation_input": fp8_input}}
        compiled = torch.compile(copy.deepcopy(base), backend="te", options=options, fullgraph=True)
        _, saved[fp8_input] = _saved(lambda: compiled(x, counts))
    # gate and up [64, 48]: two fp8 copies instead of two bf16 ones
    assert saved[True].count(((rows, hidden), torch.float8_e4m3fn)) == 2, saved[True]
    assert saved[True].count(((rows, hidden), torch.bfloat16)) == 0, saved[True]
    assert saved[False].count(((rows, hidden), torch.bfloat16)) == 2, saved[False]
