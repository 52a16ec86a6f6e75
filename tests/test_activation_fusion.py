"""Activation fusion: GELU (erf, tanh), ReLU, squared ReLU and SwiGLU feeding an FP8 linear become
one operation computing the same bytes as the unfused te path (outputs and gradients bit for bit),
with report rows and reasons where they stay unfused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from models import ACTIVATIONS, ActivationMLP
from utils import assert_bitwise_equal

D, H = 32, 64
OPS = {"gelu": "gelu", "gelu_tanh": "gelu", "relu": "relu", "relu2": "relu2", "swiglu": "swiglu"}


def _run(model, x, **options):
    torch._dynamo.reset()
    te_compile.reset()
    compiled = torch.compile(model, backend=te_compile.backend(**options))
    x = x.detach().clone().requires_grad_()
    y = compiled(x)
    y.square().mean().backward()
    rows = [s for s in te_compile.report().sites if s.op != "linear"]
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, rows


def _assert_same(a, b):
    assert_bitwise_equal(a[0], b[0], "y")
    assert_bitwise_equal(a[1], b[1], "dx")
    assert a[2].keys() == b[2].keys()
    for n in a[2]:
        assert_bitwise_equal(a[2][n], b[2][n], n)


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
@pytest.mark.parametrize("kind", list(ACTIVATIONS))
def test_fused_activation_is_bit_exact_with_the_unfused_path(kind, recipe):
    torch.manual_seed(0)
    base = ActivationMLP(kind, D, H)
    x = torch.randn(2, 8, D)
    fused = _run(copy.deepcopy(base), x, recipe=recipe, compiler="aot_eager")
    [row] = fused[3]
    assert (row.fqn, row.op, row.rewritten, row.recipe) == ("", OPS[kind], True, recipe)
    assert row.reason == "fused into down" + (" (tanh GELU)" if kind == "gelu_tanh" else "")
    plain = _run(copy.deepcopy(base), x, recipe=recipe, compiler="aot_eager", rewrite={"activation": False})
    [off] = plain[3]
    assert not off.rewritten and off.reason == "[rewrite] activation = false"
    _assert_same(fused, plain)


def test_fused_swiglu_under_inductor_is_bit_exact():
    torch.manual_seed(0)
    base = ActivationMLP("swiglu", D, H)
    x = torch.randn(4, 16, D)
    _assert_same(_run(copy.deepcopy(base), x, recipe="Float8CurrentScaling"),
                 _run(copy.deepcopy(base), x, recipe="Float8CurrentScaling", rewrite={"activation": False}))


def test_activation_with_other_readers_or_another_recipe_stays_unfused():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down, self.up2, self.down2 = nn.Linear(D, H), nn.Linear(H, D), nn.Linear(D, H), nn.Linear(H, D)

        def forward(self, x):
            a = F.gelu(self.up(x))
            b = F.relu(self.up2(x))
            return self.down(a) + a[..., :D] + self.down2(b)

    torch.manual_seed(0)
    rows = _run(Two(), torch.randn(2, D), recipe="Float8CurrentScaling", compiler="aot_eager",
                overrides=[{"modules": "down2", "recipe": "MXFP8BlockScaling"}])[3]
    assert [(r.op, r.rewritten, r.reason) for r in rows] == [
        ("gelu", False, "down: its output has other readers"),
        ("relu", False, "down2: recipe MXFP8BlockScaling (activation fusion covers the per-tensor FP8 recipes)")]


def test_an_activation_input_written_in_place_before_the_linear_stays_unfused():
    """The fused call applies the activation where the linear runs; a write into its input between the
    two (allowed by autograd under no_grad) would reach the activation's output only when fused, so
    it stays unfused (11 dB from the unfused path before the check)."""
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

        def forward(self, x):
            h = self.up(x)
            a = F.gelu(h)
            h.mul_(3.0)
            return self.down(a) + h[..., :D]

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(2, 8, D)
    outs = []
    for fuse in (True, False):
        torch._dynamo.reset()
        te_compile.reset()
        compiled = torch.compile(model, backend=te_compile.backend(recipe="Float8CurrentScaling", compiler="aot_eager",
                                                                  rewrite={"activation": fuse}))
        with torch.no_grad():
            outs.append(compiled(x))
        if fuse:
            [row] = [s for s in te_compile.report().sites if s.op == "gelu"]
            assert not row.rewritten and row.reason == "down: its input is written in place (mul_) before the linear runs"
    assert_bitwise_equal(outs[0], outs[1], "y")


@pytest.mark.parametrize("arch, op", [("llama", "swiglu"), ("gemma", "geglu")])
def test_hugging_face_gated_mlps_fuse_with_bit_exact_loss(arch, op):
    transformers = pytest.importorskip("transformers", reason="needs transformers for HF model code")
    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    if arch == "llama":
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    else:
        base = transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=16, **kwargs))
    ids = torch.randint(0, 128, (2, 16))
    losses = {}
    for fused in (True, False):
        model = copy.deepcopy(base)
        torch._dynamo.reset()
        te_compile.reset()
        compiled = torch.compile(model, backend=te_compile.backend(compiler="aot_eager", rewrite={"activation": fused}))
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[fused] = loss.detach()
        if fused:
            [row] = [s for s in te_compile.report().sites if s.op == op]
            tanh = " (tanh GELU)" if arch == "gemma" else ""   # Gemma's default hidden_act is gelu_pytorch_tanh
            assert row.rewritten and row.reason == f"fused into model.layers.0.mlp.down_proj{tanh}"
    assert_bitwise_equal(losses[True], losses[False])


@pytest.mark.parametrize("name", ["gelu_new", "gelu_fast", "quick_gelu", "silu"])
def test_hugging_face_activation_modules_fuse_bit_exact(name):
    """HF's hand-written GELUs (copied out of the graph) and nn.SiLU, under both per-tensor recipes."""
    activations = pytest.importorskip("transformers.activations", reason="needs transformers")

    class HFMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.act, self.down = nn.Linear(D, H), activations.ACT2FN[name], nn.Linear(H, D)

        def forward(self, x):
            return self.down(self.act(self.up(x)))

    torch.manual_seed(0)
    base = HFMLP()
    x = torch.randn(2, 8, D)
    for recipe in ("Float8CurrentScaling", "DelayedScaling"):
        fused = _run(copy.deepcopy(base), x, recipe=recipe, compiler="aot_eager")
        [row] = fused[3]
        op = "silu" if name == "silu" else "gelu"
        hand = "" if name == "silu" else " (hand-written GELU)"
        assert (row.fqn, row.op, row.rewritten, row.reason) == ("act", op, True, f"fused into down{hand}")
        _assert_same(fused, _run(copy.deepcopy(base), x, recipe=recipe, compiler="aot_eager",
                                 rewrite={"activation": False}))


def test_elementwise_math_without_a_transcendental_is_not_an_activation():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

        def forward(self, x):
            h = self.up(x)
            return self.down(0.5 * h * (h + 1.0))

    rows = _run(Scale(), torch.randn(2, D), recipe="Float8CurrentScaling", compiler="aot_eager")[3]
    assert rows == []


def _erfs_per_graph(backend) -> list[int]:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    compiled = torch.compile(ActivationMLP("gelu", D, H), backend=backend)
    x = torch.randn(4, 16, D, requires_grad=True)
    _, code = run_and_get_code(lambda: compiled(x).square().mean().backward())
    return [c.count(".erf()") + c.count("std::erf(") for c in code]


def test_gelu_under_current_scaling_evaluates_erf_once_per_element_on_cpu():
    # current scaling reads the activation for its amax and for its cast: inlined into both loops,
    # inductor's C++ would evaluate the erf twice in the forward (the backward's gelu_backward once)
    hp = _erfs_per_graph("inductor")
    assert hp == [1, 1]
    assert _erfs_per_graph(te_compile.backend(recipe="Float8CurrentScaling")) == hp
