"""transformers' ``experts_implementation="eager"`` (a loop over the experts that received tokens) under
te: Dynamo traces the loop over every expert instead (te_compile/eager_experts.py), so each expert's
GEMMs are the per-expert-loop sites te rewrites, and the result is the loop's own."""

from __future__ import annotations

import pytest
import torch

from te_compile.eager_experts import trace_eager_experts
from test_moe_models import STEPS, VOCAB, train_moe
from utils import assert_bitwise_equal, seed

transformers = pytest.importorskip("transformers", reason="needs transformers for HF model code")

# the Dynamo settings docs/linear-sites.md names for per-expert loops: the routing's torch.where has a
# data-dependent size
CAPTURE = {"capture_dynamic_output_shape_ops": True, "capture_scalar_outputs": True}
LAYERS, EXPERTS = 1, 4


def _config():
    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, num_local_experts=EXPERTS, num_experts_per_tok=2,
        experts_implementation="eager")


def _mixtral():
    model = transformers.MixtralForCausalLM(_config())
    assert model.config._experts_implementation == "eager"
    return model


@pytest.mark.slow
@torch._dynamo.config.patch(CAPTURE)
def test_mixtral_eager_experts_train_with_every_expert_gemm_rewritten():
    high, _ = train_moe("mixtral", torch.float32, te=False, build=_mixtral)
    low, report = train_moe("mixtral", torch.float32, te=True, build=_mixtral)
    experts = [s for s in report.sites if s.op == "grouped_linear"]
    # one row per layer, GEMM and expert, over 30 steps of other routings: compiled once
    expected = {f"w[{shape}]=model.layers.{layer}.mlp.experts.{proj}[{e}]" for layer in range(LAYERS)
                for e in range(EXPERTS) for proj, shape in (("gate_up_proj", "96, 32"), ("down_proj", "32, 48"))}
    assert {s.shapes.split("] ", 1)[1] for s in experts} == expected and len(experts) == len(expected), str(report)
    assert all(s.rewritten and "(a per-expert loop; that expert's scales) -> FP8 GEMMs" in s.reason
               for s in experts), str(report)
    swiglus = [s for s in report.sites if s.op == "swiglu"]
    assert len(swiglus) == LAYERS * EXPERTS and all(s.rewritten for s in swiglus), str(report)
    assert high[-1] < 0.85 * high[0], f"the high-precision run did not learn: {high[0]:.3f} -> {high[-1]:.3f}"
    final_high, final_low = sum(high[-5:]) / 5, sum(low[-5:]) / 5
    assert abs(final_low - final_high) <= 0.015 * final_high, \
        f"final loss {final_low:.4f} vs high precision {final_high:.4f} (more than 1.5% apart)"


@torch._dynamo.config.patch(CAPTURE)
def test_the_loop_over_every_expert_is_one_graph_and_the_eager_loop_bit_for_bit():
    gen = seed(3)
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(_config())
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2, generator=gen)
    torch.nn.init.normal_(experts.down_proj, std=0.2, generator=gen)
    trace_eager_experts()   # Mixtral's module may have been imported after te_compile and a Dynamo reset
    assert trace_eager_experts() == 0, "registered twice"
    x = torch.randn(24, 32, generator=gen, requires_grad=True)
    # top-2 of 4 experts, expert 3 never picked: the twin runs it on zero rows
    first = torch.randint(0, 3, (24,), generator=gen)
    index = torch.stack([first, (first + 1) % 3], 1)
    weights = torch.rand(24, 2, generator=gen).softmax(-1)
    torch._dynamo.reset()
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)   # a graph break would raise
    y = compiled(x, index, weights)
    expected = experts(x, index, weights)
    assert_bitwise_equal(y, expected, "forward")
    grads = torch.autograd.grad(y.square().sum(), (x, experts.gate_up_proj, experts.down_proj))
    ref = torch.autograd.grad(expected.square().sum(), (x, experts.gate_up_proj, experts.down_proj))
    for name, g, r in zip(("x", "gate_up_proj", "down_proj"), grads, ref):
        assert_bitwise_equal(g, r, f"grad {name}")
    assert torch.equal(grads[1][3], torch.zeros_like(grads[1][3])), "the unpicked expert got a gradient"
