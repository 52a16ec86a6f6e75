"""DelayedScaling under the te backend: the scale rule step by step, state as graph buffers,
checkpoint/resume bit for bit, separate models keep separate state."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import te_compile
from te_compile.recipe import DelayedScaling
from te_compile.scaling import FLT_MAX
from utils import AotGraphs, assert_bitwise_equal, assert_sqnr_at_least, count_calls, sqnr

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


def _input_state(layer):
    sd = te_compile.recipe_state_dict(layer)
    return sd["input.scale"].item(), sd["input.amax_history"].tolist()


def test_zero_and_nonfinite_amax_keep_previous_scale():
    torch._dynamo.reset()
    layer = nn.Linear(16, 16)
    compiled = torch.compile(layer, backend="te", options={**OPTIONS, "amax_history_len": 1})

    def step(value):
        compiled(torch.full((2, 16), value)).sum().backward()
        return _input_state(layer)

    assert step(2.0) == (224.0, [2.0])
    assert step(0.0) == (224.0, [0.0])                  # amax 0: keep 224
    assert step(float("inf")) == (224.0, [0.0])         # amax inf: keep 224, the history stays finite
    assert step(float("nan")) == (224.0, [0.0])         # amax NaN: the same
    assert step(1e-44)[0] == FLT_MAX                     # 448 / tiny overflows: FLT_MAX


def test_scaling_follows_the_data_again_right_after_a_nan_step():
    """TransformerEngine's rule: a non-finite amax keeps the previous scale and never enters the
    history, so one NaN batch does not freeze the scale for amax_history_len steps."""
    torch._dynamo.reset()
    layer = nn.Linear(16, 16)
    compiled = torch.compile(layer, backend="te", options={**OPTIONS, "amax_history_len": 3})
    scales = []
    for value in (2.0, float("nan"), 8.0):
        compiled(torch.full((2, 16), value)).sum().backward()
        scale, history = _input_state(layer)
        assert all(math.isfinite(h) for h in history), history
        scales.append(scale)
    assert scales == [224.0, 224.0, 56.0]


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


def test_load_recipe_state_dict_names_unexpected_missing_and_misshapen_keys():
    torch._dynamo.reset()
    model = MLP()
    compiled = torch.compile(model, backend="te", options=OPTIONS)
    compiled(torch.randn(4, 32)).sum().backward()
    good = te_compile.recipe_state_dict(model)
    assert len(good) == 2 * 6
    with pytest.raises(RuntimeError, match=r"unexpected keys \['nope.input.scale'\]"):
        te_compile.load_recipe_state_dict(model, {**good, "nope.input.scale": torch.ones(1)})
    with pytest.raises(RuntimeError, match=r"unexpected keys \['fc.activation.scale'\].*role in"):
        te_compile.load_recipe_state_dict(model, {**good, "fc.activation.scale": torch.ones(1)})
    partial = {k: v for k, v in good.items() if k != "proj.grad_output.scale"}
    with pytest.raises(RuntimeError, match=r"missing keys \['proj.grad_output.scale'\]"):
        te_compile.load_recipe_state_dict(model, partial)
    only_fc = {k: v for k, v in good.items() if k.startswith("fc.")}
    with pytest.raises(RuntimeError, match=r"missing keys \['proj.input.scale', "):
        te_compile.load_recipe_state_dict(model, only_fc)
    with pytest.raises(RuntimeError, match=r"fc.input.amax_history has shape \(5,\), expected \(3,\)"):
        te_compile.load_recipe_state_dict(model, {**good, "fc.input.amax_history": torch.zeros(5)})

    # Nothing was copied by the calls that raised; strict=False loads what matches and says the rest.
    assert all(torch.equal(v, good[k]) for k, v in te_compile.recipe_state_dict(model).items())
    changed = {"fc.input.scale": torch.full((1,), 7.0), "nope.input.scale": torch.ones(1)}
    result = te_compile.load_recipe_state_dict(model, changed, strict=False)
    assert result.unexpected_keys == ["nope.input.scale"]
    assert len(result.missing_keys) == 2 * 6 - 1 and "fc.input.scale" not in result.missing_keys
    assert te_compile.recipe_state_dict(model)["fc.input.scale"].item() == 7.0


def test_loading_into_a_model_without_state_needs_every_key_of_the_weights_it_names():
    model = MLP()
    with pytest.raises(RuntimeError, match=r"missing keys \['fc.input.amax_history', "):
        te_compile.load_recipe_state_dict(model, {"fc.input.scale": torch.ones(1)})
    assert te_compile.recipe_state_dict(model) == {}


class SharedLayer(nn.Module):
    """One linear called twice in a forward (a shared block)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(16, 16, bias=False)

    def forward(self, x1, x2):
        return self.layer(x1), self.layer(x2)


def test_a_layer_called_twice_advances_its_state_once_with_the_max_of_both_calls(monkeypatch):
    torch._dynamo.reset()
    graphs = AotGraphs().install(monkeypatch)
    model = SharedLayer()
    compiled = torch.compile(model, backend="te", options=OPTIONS, fullgraph=True)
    w = model.layer.weight.detach().clone()
    scales = None
    for step, (ax1, ax2, ag1, ag2) in enumerate(((3.0, 5.0, 2.0, 7.0), (6.0, 1.0, 4.0, 0.5))):
        x1 = torch.rand(4, 16) * ax1 / 1.0001
        x2 = torch.rand(4, 16) * ax2 / 1.0001
        x1[0, 0], x2[0, 0] = ax1, ax2
        g1, g2 = torch.full((4, 16), ag1), torch.full((4, 16), -ag2)
        y1, y2 = compiled(x1, x2)
        if scales is not None:  # both calls quantize with the scales of the step before
            for x, y in ((x1, y1), (x2, y2)):
                ref = _fp8(x, scales["input"], torch.float8_e4m3fn) @ _fp8(w, scales["weight"], torch.float8_e4m3fn).t()
                assert_sqnr_at_least(ref, y, 60.0, f"step {step} output")
        torch.autograd.backward((y1, y2), (g1, g2))
        state = te_compile.recipe_state_dict(model)
        for role, amax, fp8_max in (("input", max(ax1, ax2), E4M3_MAX), ("grad_output", max(ag1, ag2), E5M2_MAX)):
            history = state[f"layer.{role}.amax_history"]
            assert history[0].item() == amax and history[step + 1:].eq(0).all(), f"step {step} {role}: {history}"
            assert state[f"layer.{role}.scale"].item() == _expected_scale(
                [history[i].item() for i in range(step, -1, -1)], fp8_max)
        scales = {r: state[f"layer.{r}.scale"].item() for r in ("input", "weight")}
    # The weight is quantized once per forward, not once per call: three casts to FP8 (x1, x2, w).
    [forward] = graphs.forward
    casts = [n for n in forward.graph.nodes if n.target is torch.ops.aten._to_copy.default
             and n.kwargs.get("dtype") == torch.float8_e4m3fn]
    assert len(casts) == 3, forward.code


def test_evaluation_leaves_the_state_unchanged_and_still_runs_fp8():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="te", options=OPTIONS)
    for _ in range(2):
        compiled(torch.randn(8, 32)).sum().backward()
    before = te_compile.recipe_state_dict(model)
    x = torch.randn(8, 32) * 50.0   # an amax no step has seen
    model.eval()
    with torch.no_grad():
        y_no_grad = compiled(x)
    with torch.inference_mode():
        y_inference = compiled(x)
    model.train()
    compiled(x)                      # a forward without a backward is not a training step either
    after = te_compile.recipe_state_dict(model)
    for key, value in before.items():
        assert_bitwise_equal(after[key], value, key)
    # FP8 with the stored scales (x is 50x larger than anything seen: it saturates at 448 / scale)
    def fp8_linear(layer, h, prefix):
        xq = _fp8(h, before[f"{prefix}.input.scale"].item(), torch.float8_e4m3fn)
        wq = _fp8(layer.weight.detach(), before[f"{prefix}.weight.scale"].item(), torch.float8_e4m3fn)
        return xq @ wq.t() + layer.bias.detach()

    ref = fp8_linear(model.proj, torch.relu(fp8_linear(model.fc, x, "fc")), "proj")
    for y in (y_no_grad, y_inference):
        assert_sqnr_at_least(ref, y, 60.0, "evaluation output vs FP8 with the stored scales")
        assert sqnr(model(x).detach(), y) < 30.0, "evaluation ran in high precision"


def test_frozen_weights_keep_their_state_advancing_and_skip_the_wgrad_gemm(monkeypatch):
    torch._dynamo.reset()
    graphs = AotGraphs().install(monkeypatch)
    layer = nn.Linear(32, 16)
    layer.requires_grad_(False)
    compiled = torch.compile(layer, backend="te", options=OPTIONS)
    x = torch.randn(4, 32, requires_grad=True)
    compiled(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is None
    state = te_compile.recipe_state_dict(layer)
    for role in ("input", "weight", "grad_output"):
        assert state[f"{role}.amax_history"][0].item() > 0, role
    [backward] = graphs.backward
    # dgrad only (a _scaled_mm, or on CPU its emulation's fp32 mm: gemm/per_tensor.py)
    assert count_calls(backward, torch.ops.aten._scaled_mm) + count_calls(backward, torch.ops.aten.mm) == 1, \
        backward.code


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.lm_head = nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, idx):
        return self.lm_head(self.embed(idx))


def test_a_tied_weight_has_one_set_of_state_keys():
    torch._dynamo.reset()
    model = TiedHead()
    compiled = torch.compile(model, backend="te", options=OPTIONS)
    compiled(torch.randint(0, 64, (2, 8))).sum().backward()
    keys = te_compile.recipe_state_dict(model)
    assert sorted(keys) == sorted(f"lm_head.{r}.{f}" for r in ("input", "weight", "grad_output")
                                  for f in ("scale", "amax_history"))
    te_compile.load_recipe_state_dict(model, keys)                                   # round-trips
    te_compile.load_recipe_state_dict(model, {k.replace("lm_head", "embed"): v for k, v in keys.items()})


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_dynamic_shapes_never_make_the_state_dynamic(compiler):
    """A history as long as the first sequence (16) must not share its size symbol: later lengths
    run the same graph."""
    torch._dynamo.reset()
    counters.clear()
    model = MLP()
    options = {**OPTIONS, "amax_history_len": 16, "compiler": compiler}
    compiled = torch.compile(model, backend="te", options=options, dynamic=True)
    for t in (16, 8, 11):
        compiled(torch.randn(2, t, 32)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert te_compile.recipe_state_dict(model)["fc.input.amax_history"].count_nonzero() == 3


def _update_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The multi-tensor state updates of a (functionalized) backward graph."""
    op = torch.ops.te_compile.delayed_scaling_update.default
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and (n.target is op or (n.target is torch.ops.higher_order.auto_functionalized_v2 and n.args[0] is op))]


def _two_steps(options, monkeypatch):
    torch._dynamo.reset()
    graphs = AotGraphs().install(monkeypatch)
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="te", options=options)
    for scale in (1.0, 3.0):
        compiled(torch.randn(8, 32) * scale).sum().backward()
    return te_compile.recipe_state_dict(model), graphs.backward


def test_one_multi_tensor_update_per_graph_and_the_callable_rule_agrees(monkeypatch):
    """All roles of all linears advance in one op call; a recipe with a user callable (which the op
    cannot run) is updated role by role, and "max" as a callable gives the same state bits."""
    state, backward = _two_steps(OPTIONS, monkeypatch)
    [graph] = backward
    [call] = _update_calls(graph)
    # fc and proj, three roles each; E5M2's maximum for the gradients (HYBRID)
    assert call.kwargs["_histories_length"] == 6, graph.code
    assert call.kwargs["limits"] == [E4M3_MAX, E4M3_MAX, E5M2_MAX] * 2, graph.code

    recipe = DelayedScaling(amax_history_len=HISTORY, amax_compute_algo=lambda h: h.amax())
    callable_state, backward = _two_steps({"recipe": recipe, "compiler": "aot_eager"}, monkeypatch)
    assert not _update_calls(backward[0])
    assert sorted(callable_state) == sorted(state)
    for key, value in state.items():
        assert_bitwise_equal(callable_state[key], value, key)


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _accumulating_run(update_on: str, micro_batches: int, init: dict) -> tuple[list, dict, list]:
    """3 SGD steps on one global batch each, in ``micro_batches`` backwards per step; the state after
    every backward too."""
    torch._dynamo.reset()
    model = _TwoLayers()
    model.load_state_dict(init)
    compiled = torch.compile(model, backend="te", options={
        "compiler": "aot_eager", "recipe": "DelayedScaling",
        "recipe_options": {"amax_history_len": 4, "update_on": update_on}})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, after_backward = [], []
    for step in range(3):
        x = torch.randn(8, 4, 32, generator=torch.Generator().manual_seed(step))
        total = 0.0
        for part in x.chunk(micro_batches):
            loss = compiled(part).pow(2).sum() / x.numel()   # a share of the global batch's loss
            loss.backward()
            total += loss.item()
            after_backward.append(te_compile.recipe_state_dict(model))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, te_compile.recipe_state_dict(model), after_backward


def test_update_on_optimizer_step_advances_once_per_step_with_the_max_of_every_micro_batch():
    """Gradient accumulation over 2 micro-batches with update_on = "optimizer_step" keeps the very
    state of one backward on the whole batch per step (the max of the micro-batches' amaxes is the
    batch's), and nothing moves between the micro-batches; the default advances per backward."""
    torch.manual_seed(0)
    init = _TwoLayers().state_dict()
    whole_losses, whole_state, _ = _accumulating_run("backward", 1, init)
    losses, state, after_backward = _accumulating_run("optimizer_step", 2, init)
    assert state.keys() == whole_state.keys() and len(state) == 12
    for key in state:
        assert_bitwise_equal(state[key], whole_state[key], key)
    assert losses == pytest.approx(whole_losses, rel=1e-6)
    # within a step the state stays as the last optimizer step left it
    for step in range(3):
        first, second = after_backward[2 * step], after_backward[2 * step + 1]
        assert all(torch.equal(first[k], second[k]) for k in first), f"step {step}: advanced between micro-batches"
    # per backward, the same accumulation advances twice per step
    _, per_backward, _ = _accumulating_run("backward", 2, init)
    assert not torch.equal(per_backward["up.input.amax_history"], whole_state["up.input.amax_history"])
    # a second optimizer (or a step without a backward) finds nothing to fold
    assert te_compile.advance_delayed_state() == 0
    [row] = {s.collectives for s in te_compile.report().sites if s.op == "linear"}
    assert row == ""   # one process: nothing to reduce


def test_update_on_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"DelayedScaling.update_on must be one of \['auto', 'backward', 'optimizer_step'\], got 'step'"):
        DelayedScaling(update_on="step")
