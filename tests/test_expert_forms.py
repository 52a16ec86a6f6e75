"""MoE experts written without a grouped GEMM op: a per-expert loop (one expert's matrix of a 3-D
weight per linear, tokens chosen by a data-dependent ``torch.where``) and one batched ``bmm`` over
every expert (Llama 4). Each GEMM is rewritten with that expert's own scales (aot_eager)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from te_compile.gemm.grouped import equal_group_offsets
from te_compile.lowerings.grouped_linear import GroupedLinearLowering, GroupedLinearSpec
from te_compile.lowerings.linear import LinearLowering, LinearSpec
from te_compile.recipe import DelayedScaling, Float8CurrentScaling
from utils import assert_bitwise_equal, assert_sqnr_at_least, seed

E, K, N = 4, 32, 48
OPTIONS = {"compiler": "aot_eager"}
# the routing's torch.where has a data-dependent size: Dynamo captures it only when told it may
CAPTURE = {"capture_dynamic_output_shape_ops": True}


class LoopExperts(nn.Module):
    """Per-expert code as people write it: top-1 routing, then each expert's tokens through
    F.linear(x_e, w1[e]) ([E, out, in]), SiLU, and h @ w2[e] (stored [E, in, out])."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(K, E, bias=False)   # N = 4: stays in high precision
        self.w1 = nn.Parameter(torch.randn(E, N, K) / K**0.5)
        self.w2 = nn.Parameter(torch.randn(E, N, K) / N**0.5)

    def route(self, x):
        return self.router(x).argmax(-1)

    def forward(self, x):   # x: [T, K]
        top = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            idx = torch.where(top == e)[0]
            h = F.silu(F.linear(x[idx], self.w1[e]))
            out = out.index_add(0, idx, h @ self.w2[e])
        return out


def _loop_reference(model, x, recipe):
    """The loop in eager with every GEMM called through the dense linear lowering on that expert's
    matrix: per-tensor FP8 of its tokens and of its weight alone."""
    lin = LinearLowering(LinearSpec("", recipe))
    lin_in_out = LinearLowering(LinearSpec("", recipe, weight_in_out=True))
    top = model.route(x)
    out = torch.zeros_like(x)
    for e in range(E):
        idx = torch.where(top == e)[0]
        h = F.silu(lin(x[idx], model.w1[e], None))
        out = out.index_add(0, idx, lin_in_out(h, model.w2[e], None))
    return out


def _unused_expert(model, e=3):
    """No token ever picks expert ``e``: its router row copies expert 0's, and argmax takes the first
    of equal maxima."""
    with torch.no_grad():
        model.router.weight[e] = model.router.weight[0]
    return model


def _compile(model, config=None):
    torch._dynamo.reset()
    te_compile.reset()
    return torch.compile(model, backend="te", fullgraph=True, options={**OPTIONS, **(config or {})})


@torch._dynamo.config.patch(CAPTURE)
def test_a_per_expert_loop_is_rewritten_with_each_experts_scales_and_compiles_once():
    gen = seed(20)
    model = _unused_expert(LoopExperts())
    compiled = _compile(model)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for step in range(3):   # other tokens each step, so other counts per expert: no recompile
        x = torch.randn(40, K, generator=gen)
        y = compiled(x)
        assert_bitwise_equal(y, _loop_reference(model, x, Float8CurrentScaling()), f"step {step}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 1, "recompiled for new counts"
    rows = te_compile.report().sites
    experts = [s for s in rows if s.op == "grouped_linear"]
    assert len(experts) == 2 * E and all(s.rewritten for s in experts), te_compile.report()
    assert "linear on expert 2 of w1 (a per-expert loop" in experts[4].reason
    assert "matmul on expert 2 of w2" in experts[5].reason and "=w2[2]" in experts[5].shapes
    assert [s.reason for s in rows if s.op == "silu"] == ["fused into <root>"] * E
    # gradients: the expert without tokens gets zeros, the others their own; all finite
    y.square().mean().backward()
    assert torch.equal(model.w1.grad[3], torch.zeros(N, K)) and torch.equal(model.w2.grad[3], torch.zeros(N, K))
    assert all(model.w1.grad[e].abs().sum() > 0 for e in range(3)) and not model.w1.grad.isnan().any()
    assert_sqnr_at_least(LoopExperts.forward(model, x).detach(), y.detach(), 25.0, "against high precision")


@torch._dynamo.config.patch(CAPTURE)
def test_a_per_expert_loop_under_delayed_scaling_keeps_one_history_per_expert():
    gen = seed(21)
    model = _unused_expert(LoopExperts())
    compiled = _compile(model, {"recipe": "DelayedScaling", "amax_history_len": 4})
    x = torch.randn(40, K, generator=gen)
    compiled(x).square().mean().backward()
    state = te_compile.recipe_state_dict(model)
    # step 2 quantizes each expert with its own scales from step 1: the dense lowering called with
    # that expert's scales gives its bits
    y2 = compiled(x)
    recipe = DelayedScaling(amax_history_len=4)
    lin = LinearLowering(LinearSpec("", recipe))
    lin_in_out = LinearLowering(LinearSpec("", recipe, weight_in_out=True))
    after = te_compile.recipe_state_dict(model)   # no backward since: the scales step 2 used
    scales = {(w, e): [after[f"{w}.{r}.scale"][e:e + 1] for r in ("input", "weight", "grad_output")]
              for w in ("w1", "w2") for e in range(E)}
    expected = torch.zeros_like(x)
    for e in range(E):
        idx = torch.where(model.route(x) == e)[0]
        h = F.silu(lin(x[idx], model.w1[e], None, None, *scales["w1", e]))
        expected = expected.index_add(0, idx, lin_in_out(h, model.w2[e], None, None, *scales["w2", e]))
    assert_bitwise_equal(y2, expected, "step 2")
    assert len({float(after["w1.input.scale"][e]) for e in range(3)}) == 3, "three experts, three scales"
    assert state["w1.input.amax_history"].shape == (E, 4) and state["w2.weight.scale"].shape == (E,)
    top = model.route(x)
    expected = torch.stack([x[top == e].abs().amax() if (top == e).any() else torch.tensor(0.0) for e in range(E)])
    assert_bitwise_equal(state["w1.input.amax_history"][:, 0], expected, "newest input amax per expert")
    assert_bitwise_equal(state["w1.weight.amax_history"][:, 0], model.w1.detach().abs().amax(dim=(1, 2)),
                         "newest weight amax per expert")
    assert state["w1.input.scale"][3] == 1.0 and torch.equal(state["w2.grad_output.amax_history"][3], torch.zeros(4))
    assert (state["w1.input.scale"][:3] != 1.0).all(), "the update ran once for the experts with tokens"


def test_without_capturing_data_dependent_shapes_the_loop_is_not_compiled():
    """Dynamo breaks the graph at the routing's torch.where; the experts then never reach te (the
    README names the setting). Whatever is compiled still runs and gives eager's routing."""
    gen = seed(22)
    model = LoopExperts()
    x = torch.randn(40, K, generator=gen)
    torch._dynamo.reset()
    te_compile.reset()
    y = torch.compile(model, backend="te", options=OPTIONS)(x)
    assert not [s for s in te_compile.report().sites if s.op == "grouped_linear"]
    assert_sqnr_at_least(LoopExperts.forward(model, x).detach(), y.detach(), 40.0, "high precision experts")


# ---- one bmm over every expert (Llama 4) ----------------------------------------------------------


class BatchedExperts(nn.Module):
    """Llama 4's experts: x [E, T, K] (each expert's T tokens), gate_up [E, K, 2N] stored [in, out],
    then up * silu(gate), then down [E, N, K]."""

    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(E, K, 2 * N) / K**0.5)
        self.down = nn.Parameter(torch.randn(E, N, K) / N**0.5)

    def forward(self, x):
        x = x.view(E, -1, K)
        gate, up = torch.bmm(x, self.gate_up).chunk(2, dim=-1)
        return torch.bmm(up * F.silu(gate), self.down).view(-1, K)


@pytest.mark.parametrize("tokens", [7, 16], ids=["T7", "T16"])
def test_a_batched_bmm_runs_as_grouped_gemms_of_equal_groups(tokens):
    gen = seed(23)
    model = BatchedExperts()
    x = torch.randn(E * tokens, K, generator=gen)
    y = _compile(model)(x)
    rows = te_compile.report().sites
    assert [(s.op, s.rewritten) for s in rows] == [("grouped_linear", True), ("swiglu", True),
                                                   ("grouped_linear", True)], te_compile.report()
    assert rows[0].reason.startswith("bmm -> FP8 grouped GEMMs") and "[E, in, out]" in rows[0].reason
    assert rows[1].reason == "fused into <root> (grouped GEMM)"
    low = GroupedLinearLowering(GroupedLinearSpec("", Float8CurrentScaling()))
    offs = equal_group_offsets(E * tokens, E, x.device)
    gate, up = low(x, model.gate_up, offs).chunk(2, dim=-1)
    expected = low(up * F.silu(gate), model.down, offs)
    assert_bitwise_equal(y, expected, "forward")
    y.square().mean().backward()
    assert model.gate_up.grad is not None and not model.gate_up.grad.isnan().any()
    # two FP8 GEMMs in a row (the layer test of test_grouped_linear.py asks the same)
    assert_sqnr_at_least(BatchedExperts.forward(model, x).detach(), y.detach(), 20.0, "against high precision")


def test_a_batched_bmm_under_delayed_scaling_keeps_one_history_per_expert():
    gen = seed(24)
    model = BatchedExperts()
    x = torch.randn(E * 8, K, generator=gen)
    _compile(model, {"recipe": "DelayedScaling", "amax_history_len": 4})(x).square().mean().backward()
    state = te_compile.recipe_state_dict(model)
    assert state["gate_up.input.amax_history"].shape == (E, 4)
    assert_bitwise_equal(state["gate_up.input.amax_history"][:, 0], x.view(E, -1, K).abs().amax(dim=(1, 2)),
                         "each expert's own rows")
