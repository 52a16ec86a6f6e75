"""Activation offload (``[memory] offload_activations``): the config, the graph rewrite, the numerics.

On a CPU the transfers are host copies, so training with offload on must give the bits of training
with it off; the graphs must carry one offload in the forward and one reload in the backward per
tensor the report says moved.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.backends.debugging as debugging

import te_compile
from te_compile.config import ConfigError, config_from_dict
from te_compile.fx.offload import OFFLOAD_PREFIX, RELOAD_PREFIX, moved_bytes

from models import TinyGPT


def test_memory_table_and_override_keys():
    config = config_from_dict({"memory": {"offload_activations": True},
                               "overrides": [{"modules": "blocks.1.*", "offload_activations": False},
                                             {"modules": "lm_head", "recipe": "none"}]}, "t")
    assert config.offload_for("blocks.0.mlp.fc") and not config.offload_for("blocks.1.mlp.fc")
    # an override setting only offload leaves the recipe to the others and to the global one
    assert config.recipe_for("blocks.1.mlp.fc")[1] == "global"
    assert config.recipe_for("lm_head") == (None, "override 'lm_head'")
    assert config.offload_key() == "memory.offload_activations"
    assert config_from_dict({}, "t").offload_key() is None
    only = config_from_dict({"overrides": [{"modules": "blocks.0.*", "offload_activations": True}]}, "t")
    assert only.offload_key() == "overrides[0].offload_activations" and not only.offload_for("blocks.1")


@pytest.mark.parametrize("table, message", [
    ({"memory": {"offload_activations": "yes"}}, "t: memory.offload_activations: expected a bool"),
    ({"memory": {"offload": True}}, "t: memory.offload: unknown key; allowed keys: ['offload_activations']"),
    ({"overrides": [{"modules": "x", "recipe_options": {}, "offload_activations": True}]},
     "t: overrides[0].recipe_options: given without a recipe"),
    ({"overrides": [{"modules": "x"}]}, "t: overrides[0].recipe: missing required key"),
])
def test_config_errors(table, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(table, "t")
    assert str(info.value).startswith(message), str(info.value)


class _Graphs:
    """aot_eager's forward and backward graphs, recorded through its nop compiler."""

    def __init__(self, monkeypatch) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        nop = debugging.boxed_nop

        def record(gm, example_inputs):
            self.graphs.append(gm)
            return nop(gm, example_inputs)

        monkeypatch.setattr(debugging, "boxed_nop", record)


def _train(offload, steps: int = 2, **memory):
    """Two SGD steps of a 2-block GPT under Float8CurrentScaling: losses, gradients, parameters."""
    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2)
    options = {"compiler": "aot_eager"}
    if offload is not None:
        options.update(offload)
    compiled = torch.compile(model, backend="te", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for _ in range(steps):
        loss = compiled(idx, idx)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def _assert_same(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for step_a, step_b in zip(a[1], b[1]):
        assert all(torch.equal(x, y) for x, y in zip(step_a, step_b))
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def test_offload_is_bit_identical_and_pairs_counted(monkeypatch):
    off = _train(None)
    graphs = _Graphs(monkeypatch)
    on = _train({"memory": {"offload_activations": True}})
    _assert_same(off, on)

    fw, bw = graphs.graphs[0], graphs.graphs[1]
    offloads = [n for n in fw.graph.nodes if n.op == "call_function" and n.name.startswith(OFFLOAD_PREFIX)]
    reloads = [n for n in bw.graph.nodes if n.op == "call_function" and n.name.startswith(RELOAD_PREFIX)]
    # the CPU transfer is a real copy; each reload reads the backward input its offload became
    assert offloads and all(n.target is torch.ops.aten._to_copy.default for n in offloads)
    assert {n.args[0].name for n in reloads} == {n.name for n in offloads}
    assert all(n.args[0].op == "placeholder" for n in reloads)

    rows = [s for s in te_compile.report().sites if s.op == "offload"]
    moved = sum(int(s.shapes.split()[0]) for s in rows)
    assert moved == len(offloads) == len(reloads)
    # the rows' byte counts are the transfers' bytes (what bench_offload sums through moved_bytes)
    assert moved_bytes(rows) == sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in offloads) > 0
    # FP8 bytes move as bytes: the saved FP8 operands of the linears are among the transfers
    fp8 = [n for n in offloads if n.meta["val"].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    assert len(fp8) >= 4, [n.meta["val"].dtype for n in offloads]
    proj = next(s for s in rows if s.fqn == "blocks.0.mlp.proj")
    assert proj.rewritten and "float8_e4m3fn[128, 32] 4,096 B" in proj.reason


def test_every_block_but_the_last(monkeypatch):
    on = _train({"memory": {"offload_activations": True},
                 "overrides": [{"modules": "blocks.1*", "offload_activations": False}]}, steps=1)
    rows = {s.fqn: s for s in te_compile.report().sites if s.op == "offload"}
    assert any(f.startswith("blocks.0") and s.rewritten for f, s in rows.items())
    assert not any(f.startswith("blocks.1") for f in rows), sorted(rows)
    _assert_same(_train(None, steps=1), on)


def test_missing_machinery_is_a_config_error(monkeypatch):
    import torch._functorch.config as functorch_config

    monkeypatch.delattr(functorch_config, "enable_activation_offloading")
    torch._dynamo.reset()
    compiled = torch.compile(TinyGPT(n_layer=1), backend="te",
                             options={"compiler": "aot_eager", "memory": {"offload_activations": True}})
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"options: memory\.offload_activations: activation offload: torch "
                                          r"\S+ has no activation offloading in its partitioner"):
        compiled(idx, idx)


def test_probe_names_the_device():
    from te_compile.hardware import is_activation_offload_available

    assert is_activation_offload_available(device="cpu")
    ok, why = is_activation_offload_available(return_reason=True, device="meta")
    assert not ok and "device meta" in why
