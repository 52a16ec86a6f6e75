"""AOTAutograd's cache keeps te graphs (fx/cache_names.py).

Pass level: a lowering's published name is a function of its type, its spec and te_compile's
source, importable from cache_names; one without a stable encoding stays unnamed. End to end: a
second compile of the same model in inductor finds the traced forward and backward in the cache, and
the cached graph trains bit for bit like the one traced.

Tensor level (tensor/cache_identity.py): te's tensor subclasses hash by class, layout and format, not
by values or identity, the same in another process; a graph reading FP8 weights hits the cache
without torch's warning about a missing ``_stable_hash_for_caching``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

import te_compile
from te_compile.gemm import per_tensor as gemm
from te_compile.lowerings import LinearLowering, LinearSpec
from te_compile.models import GPT
from te_compile.fx import cache_names
from te_compile.recipe import CustomRecipe, DelayedScaling, Float8CurrentScaling
from te_compile.tensor import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Tensor,
                               GroupedFloat8Tensor, MXFP8Quantizer, NVFP4Quantizer, cache_identity)

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


# ---- te's tensor subclasses as graph inputs ----------------------------------------------------------
# AOTAutograd keys a graph reading a Float8Tensor weight (quantize_weights, FP8 primary weights, the
# inference weight cache) by the tensor's _stable_hash_for_caching (tensor/cache_identity.py).

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8(values=None, **kwargs):
    w = torch.randn(32, 64) if values is None else values
    return Float8CurrentScalingQuantizer(kwargs.pop("fp8_dtype", E4M3), columnwise=False)(w)


def _variants() -> dict:
    """One te tensor per thing that changes the traced code; every hash must differ from the others."""
    base = _fp8()
    with_transpose = _fp8().update_usage(columnwise_usage=True)
    grouped_data = torch.zeros(1, 32, 64, dtype=torch.uint8)
    w = torch.randn(64, 64)
    return {
        "float8": base,
        "e5m2": _fp8(fp8_dtype=E5M2),
        "bf16 nominal": base._like(base._data, dtype=torch.bfloat16),
        "shape": _fp8(torch.randn(64, 32)),
        "transpose kept": with_transpose,
        "amax kept": base._like(base._data, amax=torch.ones(1)),
        "requires_grad": base._like(base._data, requires_grad=True),
        # the same flatten names and metadata as a Float8Tensor [1, 32, 64]: only the class tells
        "float8 [1, 32, 64]": Float8Tensor(data=grouped_data, scale_inv=torch.ones(1), fp8_dtype=E4M3),
        "grouped, 1 expert": GroupedFloat8Tensor(data=grouped_data, scale_inv=torch.ones(1), fp8_dtype=E4M3),
        "mxfp8": MXFP8Quantizer(E4M3)(w),
        "mxfp8 rowwise only": MXFP8Quantizer(E4M3, columnwise=False)(w),
        "float8 block 1d": Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=1)(w),
        "float8 block 2d": Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=2)(w),
        "nvfp4": NVFP4Quantizer()(w),
        "nvfp4 rht": NVFP4Quantizer(with_rht=True)(w),
    }


def test_te_tensors_hash_by_layout_and_format_not_by_values(monkeypatch):
    variants = _variants()
    hashes = {name: t._stable_hash_for_caching() for name, t in variants.items()}
    assert len(set(hashes.values())) == len(hashes), hashes
    assert all(len(h) == 32 for h in hashes.values())
    # other values, another object: the same hash (a weight re-quantized after a step, or reloaded)
    assert _fp8(torch.randn(32, 64) * 100)._stable_hash_for_caching() == hashes["float8"]
    assert MXFP8Quantizer(E4M3)(torch.randn(64, 64))._stable_hash_for_caching() == hashes["mxfp8"]
    # the fake tensor AOTAutograd holds while it traces hashes as the real one
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(variants["float8"])
        assert isinstance(fake, Float8Tensor) and fake._stable_hash_for_caching() == hashes["float8"]
    # an edit to te_compile's source (the subclass's dispatch rules are traced into the graph)
    monkeypatch.setattr(cache_identity, "source_digest", lambda: "edited")
    assert variants["float8"]._stable_hash_for_caching() != hashes["float8"]


def test_te_tensor_hash_is_the_same_in_another_process(monkeypatch):
    # the source digest pinned in both: a file saved between the two reads must not fail the test
    code = ("import torch; from te_compile.tensor import Float8CurrentScalingQuantizer as Q, cache_identity; "
            "cache_identity.source_digest = lambda: 'pinned'; "
            "print(Q(torch.float8_e4m3fn, columnwise=False)(torch.randn(32, 64))._stable_hash_for_caching())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "7"})
    monkeypatch.setattr(cache_identity, "source_digest", lambda: "pinned")
    assert other.stdout.strip() == _fp8()._stable_hash_for_caching()


def test_metadata_without_a_stable_encoding_is_refused_by_name():
    t = _fp8()
    with pytest.raises(TypeError, match=r"Float8Tensor: flatten metadata <object object .*> \(a object\) has no "
                                        r"stable cache encoding; expected dtypes"):
        cache_identity.subclass_cache_hash(t, ["_data"], (E4M3, object()))


class _TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _fp8_weight_model(how: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if how == "primary weights":   # trained: the Float8Tensor weights require grad
        with te_compile.quantized_model_init(recipe=Float8CurrentScaling()):
            return _TwoLinears()
    model = _TwoLinears().eval()   # served: quantize_weights after loading
    done = te_compile.quantize_weights(model, Float8CurrentScaling())
    assert set(done.values()) == {"FP8 primary weight (Float8Tensor)"}, done
    return model


@pytest.mark.parametrize("how", ["quantize_weights", "primary weights"])
def test_a_graph_reading_fp8_weights_hits_the_cache_and_does_not_warn(how, tmp_path, monkeypatch):
    """Float8Tensor weights are graph inputs; a second compile (Dynamo reset, the on-disk cache kept)
    finds the graph in AOTAutograd's cache and computes the same bits (and gradients, in training),
    and torch no longer warns that Float8Tensor lacks _stable_hash_for_caching."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())   # torch warns once per process
    model = _fp8_weight_model(how)
    training = how == "primary weights"
    assert isinstance(model.up.weight, Float8Tensor) and isinstance(model.down.weight, Float8Tensor)
    x = torch.randn(8, 32)
    results, seen = [], []
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True), \
            warnings.catch_warnings(record=True) as caught, torch.set_grad_enabled(training):
        warnings.simplefilter("always")
        for _ in range(2):
            torch._dynamo.reset()
            te_compile.reset()
            counters.clear()
            model.zero_grad()
            out = torch.compile(model, backend="te")(x)
            if training:
                out.square().sum().backward()
            results.append([out.detach()] + [p.grad for p in model.parameters() if training])
            seen.append(dict(counters["aot_autograd"]))
    assert seen[0].get("autograd_cache_miss") == 1 and not seen[0].get("autograd_cache_bypass"), seen
    assert seen[1].get("autograd_cache_hit") == 1 and not seen[1].get("autograd_cache_bypass"), seen
    linears = [r for r in te_compile.report().sites if r.op == "linear"]
    assert len(linears) == 2 and all("weight already quantized, used as is" in r.reason for r in linears), linears
    assert len(results[0]) == (5 if training else 1)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    stale = [str(w.message) for w in caught if "_stable_hash_for_caching" in str(w.message)]
    assert not stale, stale
