"""Linears inside activation-checkpointed regions (HOP subgraphs): found, rewritten, reported, and
recomputed bit for bit (aot_eager)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import te_compile
import te_compile.state
from utils import assert_bitwise_equal, assert_sqnr_at_least

D, B, T = 32, 2, 8
RECIPES = {
    "Float8CurrentScaling": {"recipe": "Float8CurrentScaling", "compiler": "aot_eager"},
    "DelayedScaling": {"recipe": "DelayedScaling", "amax_history_len": 4, "compiler": "aot_eager"},
}
MODES = ("non_reentrant", "reentrant", "selective", "nested")


def _save_gemms(ctx, op, *args, **kwargs):
    """A selective-checkpointing policy: keep GEMM outputs, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(fn, mode: str):
    if mode == "none":
        return fn
    kwargs = {"use_reentrant": mode == "reentrant"}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_gemms)
    return functools.partial(checkpoint, fn, **kwargs)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 2 * D)
        self.proj = nn.Linear(2 * D, D)
        self.mode = "none"

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, D)
        self.mlp = MLP()
        self.mode = "none"

    def forward(self, x):
        h = x + self.qkv(x)
        # "nested": the MLP is checkpointed again inside the checkpointed block
        return h + (_checkpointed(self.mlp, "non_reentrant")(h) if self.mode == "nested" else self.mlp(h))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 16)
        self.mode = "none"

    def set_mode(self, mode: str) -> "Net":
        for m in self.modules():
            if hasattr(m, "mode"):
                m.mode = mode
        return self

    def forward(self, x):
        for block in self.blocks:
            x = _checkpointed(block, "non_reentrant" if self.mode == "nested" else self.mode)(x)
        return self.head(x)


def _train(model: Net, options: dict, steps: int = 3):
    torch._dynamo.reset()
    te_compile.reset()
    compiled = torch.compile(model, backend="te", options=options, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        x = torch.randn(B, T, D, generator=g, requires_grad=True)
        loss = compiled(x).square().mean()
        loss.backward()
    return dict(loss=loss.detach(), dx=x.grad, grads={n: p.grad for n, p in model.named_parameters()},
                state=te_compile.recipe_state_dict(model), report=te_compile.report())


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return Net()


@pytest.fixture(scope="module")
def unchecked(base):
    return {name: _train(copy.deepcopy(base), options) for name, options in RECIPES.items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_checkpointed_linears_are_rewritten_and_recompute_bit_for_bit(base, unchecked, mode, recipe):
    got = _train(copy.deepcopy(base).set_mode(mode), RECIPES[recipe])
    report = got["report"]
    linears = [s for s in report.sites if s.op == "linear"]
    assert len([s for s in linears if s.rewritten]) == len(linears) == 7, str(report)
    # and each block's GELU fused into mlp.proj inside the region
    gelus = [s.reason for s in report.sites if s.op == "gelu"]
    assert len(gelus) == 2 and all(r.startswith(f"fused into blocks.{i}.mlp.proj; in a checkpointed region")
                                   for i, r in enumerate(gelus)), str(report)
    checkpointed = {s.fqn for s in linears if "in a checkpointed region" in s.reason}
    assert checkpointed == {f"blocks.{i}.{m}" for i in range(2) for m in ("qkv", "mlp.fc", "mlp.proj")}
    assert [s.fqn for s in report.sites][-1] == "head"                    # rows in model order
    ref = unchecked[recipe]
    # Recomputation quantizes exactly as the forward did (same scales, same bytes): the result is
    # the unchecked run's, bit for bit; delayed-scaling state advanced once per step, not twice.
    assert_bitwise_equal(got["loss"], ref["loss"], "loss")
    assert_bitwise_equal(got["dx"], ref["dx"], "input grad")
    for name, grad in ref["grads"].items():
        assert_bitwise_equal(got["grads"][name], grad, name)
    assert got["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        assert_bitwise_equal(got["state"][key], value, key)
    if recipe == "DelayedScaling":
        assert len(got["state"]) == 7 * 6 and got["state"]["blocks.0.mlp.fc.input.amax_history"].count_nonzero() == 3


class OneBlock(nn.Module):
    def __init__(self, block: Block, mode: str):
        super().__init__()
        self.block = block
        self.mode = mode

    def forward(self, x):
        return _checkpointed(self.block, self.mode)(x)


def _saved_activation_bytes(model: nn.Module, options: dict) -> int:
    """Bytes autograd keeps for one compiled forward, not counting parameters and recipe state."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="te", options=options, fullgraph=True)
    x = torch.randn(B, T, D, requires_grad=True)
    compiled(x).sum().backward()   # compile, create the state
    persistent = {p.untyped_storage().data_ptr() for p in model.parameters()}
    persistent |= {t.untyped_storage().data_ptr() for p in model.parameters()
                   for t in (te_compile.state._STATES[p].tensors() if p in te_compile.state._STATES else ())}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in persistent and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(x).sum()
    return total


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_checkpointed_block_keeps_no_more_activations_with_te(base, recipe):
    block = base.blocks[0]
    high = _saved_activation_bytes(OneBlock(copy.deepcopy(block), "non_reentrant"),
                                   {"recipe": "none", "compiler": "aot_eager"})
    te = _saved_activation_bytes(OneBlock(copy.deepcopy(block), "non_reentrant"), RECIPES[recipe])
    unchecked = _saved_activation_bytes(OneBlock(copy.deepcopy(block), "none"), RECIPES[recipe])
    assert te <= high < unchecked, (te, high, unchecked)


def test_checkpointed_delayed_scaling_under_inductor_matches_the_unchecked_run(base):
    options = {**RECIPES["DelayedScaling"], "compiler": "inductor"}
    ref = _train(copy.deepcopy(base), options, steps=2)
    got = _train(copy.deepcopy(base).set_mode("non_reentrant"), options, steps=2)
    assert len([s for s in got["report"].rewritten if s.op == "linear"]) == 7
    for key, value in ref["state"].items():
        assert_bitwise_equal(got["state"][key], value, key)
    assert_sqnr_at_least(ref["loss"], got["loss"], 100.0, "loss")
    for name, grad in ref["grads"].items():
        assert_sqnr_at_least(grad, got["grads"][name], 60.0, name)
