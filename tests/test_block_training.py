"""Block-scaled recipes through the te backend: training parity with fp32, per-module mixing, the
custom-recipe references equal to the built-ins, and eligibility reasons per format."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import te_compile
from models import TinyGPT
from test_training import _pattern_batches, _train
from utils import assert_bitwise_equal

BLOCK_RECIPES = ["MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling"]
REF_FACTORIES = {
    "MXFP8BlockScaling": "te_compile.custom_recipes.quantization_mxfp8:mxfp8_ref_quantizer_factory",
    "Float8BlockScaling": "te_compile.custom_recipes.quantization_float8_block:float8_block_ref_quantizer_factory",
    "NVFP4BlockScaling": "te_compile.custom_recipes.quantization_nvfp4:nvfp4_ref_quantizer_factory",
}
# The NVFP4 paper's setup: attention in FP8, the MLPs in NVFP4, the head in high precision.
MIXED = {
    "recipe": "Float8CurrentScaling",
    "overrides": [{"modules": "blocks.*.mlp.*", "recipe": "NVFP4BlockScaling"},
                  {"modules": "lm_head", "recipe": "none"}],
}


@pytest.fixture(scope="module")
def fp32_run():
    torch.manual_seed(0)
    base = TinyGPT()
    batches = _pattern_batches(40)
    losses = _train(copy.deepcopy(base), batches)
    assert losses[-1] < 0.6 * losses[0], "the task must be learnable"
    return base, batches, losses


@pytest.mark.parametrize("name", BLOCK_RECIPES + ["mixed"])
def test_40_step_training_within_10_percent_of_fp32(fp32_run, name):
    base, batches, fp32 = fp32_run
    torch._dynamo.reset()
    te_compile.reset()
    options = dict(MIXED) if name == "mixed" else {"recipe": name}
    options["compiler"] = "aot_eager"
    te = _train(torch.compile(copy.deepcopy(base), backend="te", options=options), batches)
    final_fp32, final_te = sum(fp32[-5:]) / 5, sum(te[-5:]) / 5
    gap = abs(final_te - final_fp32) / final_fp32
    assert gap < 0.10, f"{name}: final loss {final_te:.4f} vs fp32 {final_fp32:.4f} ({100 * gap:.1f}% > 10%)"
    assert te != fp32, "identical losses: nothing was quantized"
    sites = {s.fqn: s for s in te_compile.report().sites if s.op != "linear_cross_entropy"}
    if name == "mixed":
        assert sites["blocks.0.attn.qkv"].recipe == "Float8CurrentScaling"
        assert sites["blocks.1.mlp.fc"].recipe == "NVFP4BlockScaling" and sites["blocks.1.mlp.fc"].rewritten
        assert "emulated GEMMs" in sites["blocks.1.mlp.fc"].reason
        assert not sites["lm_head"].rewritten and "override 'lm_head'" in sites["lm_head"].reason
    else:
        linears = [s for s in sites.values() if s.op == "linear"]
        assert all(s.rewritten and s.recipe == name for s in linears), str(te_compile.report())
        # norm fusion covers the per-tensor recipes: these norms stay unfused, saying so
        norms = [s for s in sites.values() if s.op == "layer_norm"]
        assert len(norms) == 5 and not any(s.rewritten for s in norms)
        assert all("norm fusion covers the per-tensor FP8 recipes" in s.reason for s in norms if s.fqn != "ln_f")


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 128)
        self.proj = nn.Linear(128, 64)

    def forward(self, x):
        return self.proj(torch.relu(self.fc(x)))


@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_custom_reference_factory_equals_builtin_bitwise(name):
    """CustomRecipe(qfactory=<reference of the recipe>) computes exactly what the built-in recipe does:
    forward output and every gradient, bit for bit (stochastic rounding draws included)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = _MLP()
    # 40 tokens: not a multiple of 16 or 32, so the columnwise padding and ragged blocks are exercised
    x = torch.randn(40, 64) * torch.logspace(-3, 3, 64)
    results = {}
    for which, options in (("builtin", {"recipe": name}),
                           ("custom", {"recipe": "CustomRecipe", "qfactory": REF_FACTORIES[name]})):
        model = copy.deepcopy(base)
        xi = x.clone().requires_grad_()
        torch.manual_seed(1)
        y = torch.compile(model, backend="te", options={**options, "compiler": "aot_eager"})(xi)
        y.square().sum().backward()
        results[which] = [y.detach(), xi.grad, *(p.grad for p in model.parameters())]
    for i, (a, b) in enumerate(zip(results["builtin"], results["custom"])):
        assert_bitwise_equal(a, b, f"{name}: tensor {i} (output, dx, then parameter grads)")


class _Shapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.k48 = nn.Linear(48, 64)      # K % 32 != 0 (and not a multiple of 128)
        self.n80 = nn.Linear(64, 80)      # N % 32 != 0, N % 16 == 0
        self.ragged = nn.Linear(80, 200)  # K % 32 != 0, N % 16 != 0
        self.ok = nn.Linear(256, 128)

    def forward(self, x):  # x: [B, T, 256]; each layer reads the first in_features channels
        outs = [m(x[..., :m.in_features]) for m in (self.k48, self.n80, self.ragged, self.ok)]
        return sum(o.sum() for o in outs)


@pytest.mark.parametrize("name, expected", [
    ("MXFP8BlockScaling", {"k48": "in_features (K)=48 is not divisible by 32 (MXFP8",
                           "n80": "out_features (N)=80 is not divisible by 32 (MXFP8",
                           "ragged": "in_features (K)=80 is not divisible by 32", "ok": None}),
    ("NVFP4BlockScaling", {"k48": None, "n80": None,
                           "ragged": "out_features (N)=200 is not divisible by 16 (NVFP4", "ok": None}),
    ("Float8BlockScaling", {"k48": None, "n80": None,
                            "ragged": "out_features (N)=200 is not divisible by 16", "ok": None}),
])
def test_eligibility_follows_the_format(name, expected):
    torch._dynamo.reset()
    te_compile.reset()
    compiled = torch.compile(_Shapes(), backend="te", options={"recipe": name, "compiler": "aot_eager"})
    compiled(torch.randn(2, 16, 256)).backward()
    sites = {s.fqn: s for s in te_compile.report().sites}
    for fqn, reason in expected.items():
        if reason is None:
            assert sites[fqn].rewritten, f"{name} {fqn}: {sites[fqn].reason}"
        else:
            assert not sites[fqn].rewritten and reason in sites[fqn].reason, sites[fqn].reason


def test_nvfp4_needs_a_2d_input():
    torch._dynamo.reset()
    te_compile.reset()
    lin = nn.Linear(32, 32)
    torch.compile(lin, backend="te", options={"recipe": "NVFP4BlockScaling", "compiler": "aot_eager"})(
        torch.randn(32))
    (site,) = te_compile.report().sites
    assert not site.rewritten and "at least 2 dims, got 1-D" in site.reason
