"""DelayedScaling under the te backend: the scale rule step by step, state as graph buffers,
checkpoint/resume bit for bit, separate models keep separate state."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import te_compile
from te_compile.scaling import FLT_MAX
from utils import assert_bitwise_equal, assert_sqnr_at_least

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
HISTORY = 3
OPTIONS = {"recipe": "DelayedScaling", "amax_history_len": HISTORY, "compiler": "aot_eager"}


def _fp8(t: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Reference quantize-dequantize with a given scale (saturating)."""
    limit = E4M3_MAX if dtype == torch.float8_e4m3fn else E5M2_MAX
    return (t * scale).clamp(-limit, limit).to(dtype).to(torch.float32) * (1.0 / torch.tensor(scale)).item()


def _expected_scale(amaxes: list[float], fp8_max: float) -> float:
    window = max(amaxes[-HISTORY:])
    return torch.div(torch.tensor([fp8_max]), torch.tensor([window])).item()


@pytest.fixture(scope="module")
def steps():
    """Five steps of one Linear(32, 48) under DelayedScaling with known inputs and upstream grads;
    records outputs, grads and the state after each step, plus what went in."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = nn.Linear(32, 48, bias=False)
    compiled = torch.compile(layer, backend="te", options=OPTIONS, fullgraph=True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    log = []
    for t in range(5):
        x = torch.randn(7, 32) * (4.0 if t == 2 else 1.0)   # an amax spike at step 2
        g = torch.randn(7, 48) * 10.0 ** (t - 2)              # grads growing 100x over the run
        w = layer.weight.detach().clone()
        y = compiled(x)
        y.backward(g)
        log.append(dict(x=x, g=g, w=w, y=y.detach(), dw=layer.weight.grad.clone(),
                        state=te_compile.recipe_state_dict(layer)))
        opt.step()
        opt.zero_grad()
    return log


def test_state_keys(steps):
    assert sorted(steps[0]["state"]) == sorted(
        f"{role}.{field}" for role in ("input", "weight", "grad_output") for field in ("scale", "amax_history")
    )
    assert steps[0]["state"]["input.amax_history"].shape == (HISTORY,)


@pytest.mark.parametrize("role, fp8_max", [("input", E4M3_MAX), ("weight", E4M3_MAX), ("grad_output", E5M2_MAX)])
def test_scale_after_each_step_is_fp8_max_over_window_amax(steps, role, fp8_max):
    key = {"input": "x", "weight": "w", "grad_output": "g"}[role]
    amaxes = []
    for t, step in enumerate(steps):
        amaxes.append(step[key].abs().max().item())
        got = step["state"][f"{role}.scale"].item()
        assert got == _expected_scale(amaxes, fp8_max), f"step {t}: {role} scale {got}"
        newest_first = torch.tensor(list(reversed(amaxes[-HISTORY:])) + [0.0] * (HISTORY - len(amaxes[-HISTORY:])))
        assert_bitwise_equal(step["state"][f"{role}.amax_history"], newest_first, f"step {t} {role} history")


def test_step_t_quantizes_with_scale_from_step_t_minus_1(steps):
    """Forward output equals the FP8 GEMM of x and w quantized with the previous step's scales
    (scale 1 at step 0)."""
    prev = {"input": 1.0, "weight": 1.0}
    for t, step in enumerate(steps):
        xq = _fp8(step["x"], prev["input"], torch.float8_e4m3fn)
        wq = _fp8(step["w"], prev["weight"], torch.float8_e4m3fn)
        assert_sqnr_at_least(xq @ wq.t(), step["y"], 60.0, f"step {t} output")
        prev = {r: step["state"][f"{r}.scale"].item() for r in ("input", "weight")}


def test_backward_uses_scales_from_step_t_minus_1(steps):
    """dgrad and wgrad equal the FP8 GEMMs of grad_output, weight and input quantized with the
    previous step's scales: never the scales this step computes (inputs spike 4x at step 2 and
    grads grow 10x a step, so they saturate, and the reference saturates the same way)."""
    prev = {"input": 1.0, "weight": 1.0, "grad_output": 1.0}
    for t, step in enumerate(steps):
        xq = _fp8(step["x"], prev["input"], torch.float8_e4m3fn)
        gq = _fp8(step["g"], prev["grad_output"], torch.float8_e5m2)
        assert_sqnr_at_least(gq.t() @ xq, step["dw"], 60.0, f"step {t} weight grad")
        prev = {r: step["state"][f"{r}.scale"].item() for r in prev}


def test_weight_grads_track_fp32_without_saturation(steps):
    """Steps 0 and 1 neither spike nor outgrow the previous scale much: FP8 noise only."""
    for t in (0,):
        step = steps[t]
        assert_sqnr_at_least(step["g"].t() @ step["x"], step["dw"], 20.0, f"step {t} weight grad vs fp32")


def test_zero_and_nonfinite_amax_keep_previous_scale():
    torch._dynamo.reset()
    layer = nn.Linear(16, 16)
    compiled = torch.compile(layer, backend="te", options={**OPTIONS, "amax_history_len": 1})
    compiled(torch.full((2, 16), 2.0)).sum().backward()
    assert te_compile.recipe_state_dict(layer)["input.scale"].item() == 224.0
    with torch.no_grad():
        compiled(torch.zeros(2, 16))          # amax 0: keep 224
    assert te_compile.recipe_state_dict(layer)["input.scale"].item() == 224.0
    with torch.no_grad():
        compiled(torch.full((2, 16), float("inf")))  # amax inf: keep 224
    assert te_compile.recipe_state_dict(layer)["input.scale"].item() == 224.0
    with torch.no_grad():
        compiled(torch.full((2, 16), 1e-44))   # 448 / tiny overflows: FLT_MAX
    assert te_compile.recipe_state_dict(layer)["input.scale"].item() == FLT_MAX


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 64)
        self.proj = nn.Linear(64, 16)

    def forward(self, x):
        return self.proj(torch.relu(self.fc(x)))


def _train(compiled, model, opt, batches):
    losses = []
    for x, target in batches:
        loss = torch.nn.functional.mse_loss(compiled(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_checkpoint_resume_is_bitwise_and_models_do_not_share_state():
    torch._dynamo.reset()
    torch.manual_seed(0)
    batches = [(torch.randn(8, 32), torch.randn(8, 16)) for _ in range(6)]
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="te", options=OPTIONS)
    _train(compiled, model, opt, batches[:3])
    checkpoint = copy.deepcopy({
        "model": model.state_dict(), "opt": opt.state_dict(),
        "recipe": te_compile.recipe_state_dict(compiled),
    })
    assert set(checkpoint["recipe"]) >= {"fc.input.scale", "proj.grad_output.amax_history"}
    expected = _train(compiled, model, opt, batches[3:])

    def resume(load_recipe_state: bool):
        fresh = MLP()
        fresh.load_state_dict(checkpoint["model"])
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh_opt.load_state_dict(checkpoint["opt"])
        fresh_compiled = torch.compile(fresh, backend="te", options=OPTIONS)
        # A second model starts from its own, fresh state: nothing leaks from the first.
        assert te_compile.recipe_state_dict(fresh_compiled) == {}
        if load_recipe_state:
            te_compile.load_recipe_state_dict(fresh_compiled, checkpoint["recipe"])  # before the first call
        return _train(fresh_compiled, fresh, fresh_opt, batches[3:]), fresh

    resumed, fresh = resume(load_recipe_state=True)
    assert_bitwise_equal(resumed, expected, "losses after resume")
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert_bitwise_equal(a, b, f"parameter {name} after resume")
    # Control: without the recipe state the run differs, so the state is what made it bitwise.
    without, _ = resume(load_recipe_state=False)
    assert not torch.equal(without, expected)


def test_load_recipe_state_dict_rejects_unknown_keys():
    model = MLP()
    with pytest.raises(ValueError, match="names no weight of this model"):
        te_compile.load_recipe_state_dict(model, {"nope.input.scale": torch.ones(1)})
    with pytest.raises(ValueError, match="role in"):
        te_compile.load_recipe_state_dict(model, {"fc.activation.scale": torch.ones(1)})
