"""AOTAutograd's cache keeps te graphs (passes/cache_names.py).

Pass level: a lowering's published name is a function of its type, its spec and te_compile's
source, importable from cache_names; one without a stable encoding stays unnamed. End to end: a
second compile of the same model in inductor finds the traced forward and backward in the cache, and
the cached graph trains bit for bit like the one traced.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.fx as fx
from torch._dynamo.utils import counters

import te_compile
from te_compile.gemm import per_tensor as gemm
from te_compile.lowerings import LinearLowering, LinearSpec
from te_compile.models import GPT
from te_compile.passes import cache_names
from te_compile.recipe import CustomRecipe, DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _graph_calling(*lowerings) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    for lowering in lowerings:
        x = g.call_function(lowering, (x,))
    g.output(x)
    return fx.GraphModule(torch.nn.Module(), g)


def _linear(fqn="fc", **recipe) -> LinearLowering:
    return LinearLowering(LinearSpec(fqn, DelayedScaling(**recipe)))


def _published_name(lowering) -> str:
    gm = _graph_calling(lowering)
    names = cache_names.publish_lowerings([gm])
    (target,) = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert names == {f"{cache_names.__name__}.{target.__name__}": target.__name__.rsplit("_", 1)[1]}
    return target.__name__


def test_equal_lowerings_share_one_published_object():
    a, b = _linear(margin=3), _linear(margin=3)
    gm = _graph_calling(a, b)
    names = cache_names.publish_lowerings([gm])
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert len(names) == 1 and targets[0] is targets[1]
    name = targets[0].__name__
    assert name.startswith("te_linear_DelayedScaling_"), name
    # what AOTAutograd's import statement for the global does: module + name -> the object
    assert getattr(sys.modules[targets[0].__module__], name) is targets[0]
    assert _published_name(_linear(margin=3)) == name   # again later, in another graph


@pytest.mark.parametrize("change", ["margin", "history", "fqn", "format", "source", "cpu_gemm"])
def test_any_input_of_the_trace_changes_the_name(change, monkeypatch):
    base = _published_name(_linear(margin=0, amax_history_len=16))
    if change == "source":   # an edit to any te_compile file
        monkeypatch.setattr(cache_names, "source_digest", lambda: "edited")
    if change == "cpu_gemm":   # the CPU FP8 GEMM path the lowering picks (test_hardening forces each)
        monkeypatch.setattr(gemm, "cpu_emulates_scaled_mm", lambda: not gemm._check_cpu_emulation())
    kwargs = {"margin": 1 if change == "margin" else 0, "amax_history_len": 8 if change == "history" else 16}
    if change == "format":
        kwargs["fp8_format"] = DelayedScaling().fp8_format.__class__["E4M3"]
    other = _published_name(_linear("fc2" if change == "fqn" else "fc", **kwargs))
    assert other != base


def test_a_lowering_without_a_stable_encoding_is_left_unnamed():
    from te_compile.custom_recipes.quantization_current_scaling import current_scaling_ref_quantizer_factory

    def factory(role):   # the user's code: its name says nothing of what it does
        return current_scaling_ref_quantizer_factory(role)

    lowering = LinearLowering(LinearSpec("fc", CustomRecipe(qfactory=factory)))
    gm = _graph_calling(lowering)
    assert cache_names.publish_lowerings([gm]) == {}
    assert next(n for n in gm.graph.nodes if n.op == "call_function").target is lowering
    # te_compile's own factory: its name (its code is in the source digest)
    ours = LinearLowering(LinearSpec("fc", CustomRecipe(qfactory=current_scaling_ref_quantizer_factory)))
    assert cache_names.publish_lowerings([_graph_calling(ours)])
    # the user's, once its author vouches for it with a cache_hash; a new hash is a new name
    factory.cache_hash = "v1"
    first = _published_name(LinearLowering(LinearSpec("fc", CustomRecipe(qfactory=factory))))
    factory.cache_hash = "v2"
    assert _published_name(LinearLowering(LinearSpec("fc", CustomRecipe(qfactory=factory)))) != first


def test_recipe_fields_all_reach_the_encoding():
    """A field added to a recipe later is encoded too (dataclass fields, not a hand-kept list)."""
    for recipe in (DelayedScaling(amax_history_len=4), Float8CurrentScaling()):
        text = cache_names._encode(recipe)
        for f in dataclasses.fields(recipe):
            assert f"{f.name}=" in text, (f.name, text)


def _train(steps=2):
    torch.manual_seed(0)
    model = GPT(vocab_size=64, n_layer=1, n_head=2, n_embd=32, block_size=8)
    compiled = torch.compile(model, backend=te_compile.backend(
        recipe="DelayedScaling", amax_history_len=4, recipe_options={"fp8_mha": True}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen)
        _, loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()], te_compile.recipe_state_dict(model)


def test_second_compile_hits_the_cache_and_trains_identically():
    torch._dynamo.reset()
    te_compile.reset()
    counters.clear()
    first = _train()
    assert not counters["aot_autograd"]["autograd_cache_bypass"], dict(counters["aot_autograd"])
    torch._dynamo.reset()
    te_compile.reset()
    counters.clear()
    second = _train()
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
    ops = {s.op for s in te_compile.report().rewritten}
    assert {"linear", "layer_norm", "gelu", "fp8_mha"} <= ops, ops   # every kind of lowering was cached
    for a, b in zip(first[0] + first[1], second[0] + second[1]):
        assert torch.equal(a, b)
    assert first[2].keys() == second[2].keys() and first[2]
    for key in first[2]:
        assert torch.equal(first[2][key], second[2][key]), key
