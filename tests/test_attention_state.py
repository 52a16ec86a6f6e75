"""DelayedScaling at SDPA sites: Q, K, V (and dO in the "fp8" backward) quantized per tensor with
scales from state kept like the linears' (te_compile/state.py, passes/delayed_state.py).

One aot_eager compile runs three steps; each step's outputs and gradients are checked bit for bit
against the kernels' references fed the scales the state held before the step, and the state after
it against the scale rule. The state dict names the sites after their modules and resumes a fresh
model bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from te_compile.kernels.fp8_attention import (
    E4M3,
    fp8_attention_backward_reference,
    fp8_attention_forward_reference,
    quantize_heads,
)
from utils import assert_bitwise_equal

B, H, HKV, T, D = 2, 4, 2, 24, 16
HISTORY = 3
ROLES = ("query", "key", "value", "grad_output")
OPTIONS = {"recipe": "DelayedScaling", "compiler": "aot_eager",
           "recipe_options": {"fp8_dpa": True, "fp8_dpa_backward": "fp8", "amax_history_len": HISTORY}}
FP8_MAX = {"query": 448.0, "key": 448.0, "value": 448.0, "grad_output": 57344.0}   # HYBRID: dO in E5M2


class Direct(nn.Module):
    """Calls SDPA itself (causal, grouped-query); its parameter (a gain of 1) keys the state."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q * self.gain, k, v, is_causal=True, enable_gqa=True)


class Core(nn.Module):
    """No parameters: its SDPA state hangs off its parent's."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class Outer(nn.Module):
    """Parameters the graph receives and one it does not (``bias``, first by name, unused): the pass
    keys the state on the first the graph has ("gain"), so state loaded before the first compile
    must be found under that one too."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(()))
        self.k_gain = nn.Parameter(torch.ones(()))
        self.gain = nn.Parameter(torch.ones(()))
        self.core = Core()

    def forward(self, q, k, v):
        return self.core(q * self.gain, k * self.k_gain, v)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Direct(), Outer()

    def forward(self, inputs):
        return self.a(*inputs["a"]), self.b(*inputs["b"])


# site: (state name, causal, kv heads)
SITES = {"a": ("a.sdpa", True, HKV), "b": ("b.core.sdpa", False, H)}


def _inputs(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    # the magnitudes move between steps, so a stale scale and a current one differ
    s = 1.0 + step
    return {site: (rnd(B, H, T, D, scale=s), rnd(B, hkv, T, D, scale=2 * s), rnd(B, hkv, T, D, scale=0.5 * s))
            for site, (_, _, hkv) in SITES.items()}


def _grad_outputs(step: int) -> dict:
    gen = torch.Generator().manual_seed(100 + step)
    return {site: torch.randn(B, H, T, D, generator=gen) * 10.0 ** -step for site in SITES}


def _run(fn, step: int) -> dict:
    inputs, douts = _inputs(step), _grad_outputs(step)
    outs = dict(zip(SITES, fn(inputs)))
    torch.autograd.backward([outs[s] for s in SITES], [douts[s] for s in SITES])
    return dict(inputs=inputs, douts=douts, outs={s: o.detach() for s, o in outs.items()},
                grads={s: tuple(t.grad for t in inputs[s]) for s in SITES})


@pytest.fixture(scope="module")
def steps():
    torch._dynamo.reset()
    te_compile.reset()
    model = Model()
    fn = torch.compile(model, backend="te", options=OPTIONS)
    log = []
    for step in range(3):
        log.append(_run(fn, step))
        log[-1]["state"] = te_compile.recipe_state_dict(model)
    return log, te_compile.report()


def _scales(state: dict, name: str) -> dict:
    """The site's scales (fp32 [1]) in ``state``; the initial state's are 1."""
    return {role: state[f"{name}.{role}.scale"] if state else torch.ones(1) for role in ROLES}


def _reference(site: str, record: dict, scales: dict):
    """The site's output and (dq, dk, dv) from the references, quantizing per tensor with ``scales``."""
    _, causal, _ = SITES[site]
    q, k, v = (t.detach() for t in record["inputs"][site])
    (q8, qd), (k8, kd), (v8, vd) = (quantize_heads(t, E4M3, scales[role])
                                    for t, role in zip((q, k, v), ROLES))
    kwargs = dict(sm_scale=D ** -0.5, causal=causal)
    o, lse = fp8_attention_forward_reference(q8, k8, v8, qd, kd, vd, out_dtype=q.dtype, **kwargs)
    o8, od = quantize_heads(o)   # the backward reads O from its FP8 copy
    grads = fp8_attention_backward_reference(record["douts"][site], q8, k8, v8, qd, kd, vd,
                                             o8.float() * od[..., None, None], lse, fp8_grads=True,
                                             do_scale=scales["grad_output"], **kwargs)
    return o, grads


def test_the_report_says_per_tensor_delayed_scaling(steps):
    _, report = steps
    rows = {s.fqn: s for s in report.sites}
    assert sorted(rows) == ["a", "b.core"], str(report)
    for row in rows.values():
        assert row.rewritten and row.recipe == "DelayedScaling", row
        assert "Q, K, V, dO per tensor with delayed scaling" in row.reason, row


def test_state_is_named_after_the_calling_module(steps):
    log, _ = steps
    assert sorted(log[0]["state"]) == sorted(
        f"{name}.{role}.{field}" for name, _, _ in SITES.values() for role in ROLES
        for field in ("scale", "amax_history"))


@pytest.mark.parametrize("step", range(3))
@pytest.mark.parametrize("site", SITES)
def test_each_step_quantizes_with_the_scales_of_the_step_before(steps, site, step):
    log, _ = steps
    name = SITES[site][0]
    before = log[step - 1]["state"] if step else {}
    o, grads = _reference(site, log[step], _scales(before, name))
    assert_bitwise_equal(log[step]["outs"][site], o, f"{site} step {step} output")
    for g, e, which in zip(log[step]["grads"][site], grads, "qkv"):
        assert_bitwise_equal(g, e, f"{site} step {step} d{which}")
    if step:
        # the scales did move: with the current step's own amaxes the result would differ
        own = {role: torch.tensor([FP8_MAX[role]]) / a for role, a in zip(ROLES, _amaxes(log[step], site))}
        assert not torch.equal(_reference(site, log[step], own)[0], o)


def _amaxes(record: dict, site: str) -> list[torch.Tensor]:
    q, k, v = record["inputs"][site]
    return [t.detach().abs().amax().reshape(1) for t in (q, k, v, record["douts"][site])]


@pytest.mark.parametrize("site", SITES)
def test_state_records_each_steps_amaxes_and_the_scale_rule(steps, site):
    log, _ = steps
    name = SITES[site][0]
    for step, record in enumerate(log):
        for role, amax in zip(ROLES, _amaxes(record, site)):
            history = record["state"][f"{name}.{role}.amax_history"]
            assert_bitwise_equal(history[:1], amax, f"{name}.{role} step {step}")
            window = torch.stack([log[s]["state"][f"{name}.{role}.amax_history"][0]
                                  for s in range(max(0, step - HISTORY + 1), step + 1)]).amax()
            assert_bitwise_equal(record["state"][f"{name}.{role}.scale"],
                                 torch.tensor([FP8_MAX[role]]) / window, f"{name}.{role} scale, step {step}")


def test_loaded_state_resumes_a_fresh_model_bit_for_bit(steps):
    log, _ = steps
    torch._dynamo.reset()
    model = Model()
    # loaded before the first compile: the loader picks the key parameter the pass will pick
    assert te_compile.load_recipe_state_dict(model, log[1]["state"]) == ([], [])
    fn = torch.compile(model, backend="te", options=OPTIONS)
    resumed = _run(fn, 2)
    for site in SITES:
        assert_bitwise_equal(resumed["outs"][site], log[2]["outs"][site], site)
    assert all(torch.equal(v, log[2]["state"][k]) for k, v in te_compile.recipe_state_dict(model).items())


def test_an_inference_graph_reads_attention_state_without_creating_it(steps):
    """Compiled with grad disabled, an SDPA site quantizes with the initial scales (1) and adds no keys;
    state loaded afterwards (registered under every parameter of the owner, while the graph keys on
    one) is what the same graph reads from then on, without a recompile: the training step's output
    on those scales, bit for bit."""
    from torch._dynamo.utils import counters

    log, _ = steps
    torch._dynamo.reset()
    model = Model()
    fn = torch.compile(model, backend="te", options=OPTIONS)
    record = log[2]
    inputs = {site: tuple(t.detach() for t in tensors) for site, tensors in record["inputs"].items()}
    counters.clear()
    with torch.no_grad():
        initial = dict(zip(SITES, fn(inputs)))
    assert te_compile.recipe_state_dict(model) == {}
    te_compile.load_recipe_state_dict(model, log[1]["state"])
    with torch.no_grad():
        loaded = dict(zip(SITES, fn(inputs)))
    assert counters["stats"]["unique_graphs"] == 1
    for site, (name, _, _) in SITES.items():
        assert_bitwise_equal(initial[site], _reference(site, record, _scales({}, name))[0], f"{site}, scales 1")
        assert_bitwise_equal(loaded[site], record["outs"][site], f"{site}, loaded scales")
    assert all(torch.equal(v, log[1]["state"][k]) for k, v in te_compile.recipe_state_dict(model).items())


def test_load_names_unexpected_and_missing_attention_keys(steps):
    log, _ = steps
    model = Model()
    good = log[0]["state"]
    with pytest.raises(RuntimeError, match=r"unexpected keys \['a.sdpa.weight.scale', 'zz.sdpa.query.scale'\]"):
        te_compile.load_recipe_state_dict(model, {**good, "a.sdpa.weight.scale": torch.ones(1),
                                                  "zz.sdpa.query.scale": torch.ones(1)})
    partial = {k: v for k, v in good.items() if k != "b.core.sdpa.grad_output.scale"}
    with pytest.raises(RuntimeError, match=r"missing keys \['b.core.sdpa.grad_output.scale'\]"):
        te_compile.load_recipe_state_dict(model, partial)
    assert te_compile.recipe_state_dict(model) == {}


def test_a_capture_without_parameters_current_scales_and_says_why():
    torch._dynamo.reset()
    te_compile.reset()
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend="te", options=OPTIONS)
    q, k, v = _inputs(0)["b"]
    o = fn(q, k, v)
    (row,) = te_compile.report().sites
    assert row.rewritten and "current-scaled per (batch, head) (no parameter in this graph" in row.reason, row
    (q8, qd), (k8, kd), (v8, vd) = (quantize_heads(t.detach()) for t in (q, k, v))
    expect, _ = fp8_attention_forward_reference(q8, k8, v8, qd, kd, vd, sm_scale=D ** -0.5)
    assert_bitwise_equal(o, expect)


class Both(nn.Module):
    """Calls SDPA itself and through a parameter-less child: one owner, two sites."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))
        self.core = Core()

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q * self.gain, k, v) + self.core(2 * q, k, v)


def test_a_module_and_its_parameterless_child_keep_separate_states():
    torch._dynamo.reset()
    te_compile.reset()
    model = Both()
    q, k, v = _inputs(0)["b"]
    torch.compile(model, backend="te", options=OPTIONS)(q, k, v).sum().backward()
    state = te_compile.recipe_state_dict(model)
    assert sorted({key.rsplit(".", 2)[0] for key in state}) == ["core.sdpa", "sdpa"], sorted(state)
    # the child reads 2q: its own history says so
    assert_bitwise_equal(state["core.sdpa.query.amax_history"][:1], 2 * state["sdpa.query.amax_history"][:1])
