"""Plain-model situations that must neither crash nor silently change results: autocast and
parameter dtypes, odd input ranks and token counts, config mistakes, recompiles, gradient
accumulation, graph breaks, saving the recipe state."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import te_compile
from te_compile.gemm import per_tensor as gemm
from fp8_reference import Fp8Reference
from utils import assert_bitwise_equal, assert_sqnr_at_least, sqnr

K, N = 32, 48


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(K, N)
        self.proj = nn.Linear(N, K)

    def forward(self, x):
        return self.proj(F.relu(self.fc(x)))


def _run(model, x, autocast_dtype):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        y = model(x)
    y.float().square().sum().backward()
    params = getattr(model, "_orig_mod", model).parameters()
    return y, x.grad, [p.grad for p in params]


@pytest.mark.parametrize("param_dtype, autocast_dtype", [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, None),
    (torch.float16, None),
    (torch.bfloat16, torch.bfloat16),
])
def test_output_and_grad_dtypes_equal_eager_under_autocast_and_low_precision_params(param_dtype, autocast_dtype):
    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    model = TwoLinears().to(param_dtype)
    x = torch.randn(4, 8, K, dtype=param_dtype)
    eager = _run(model, x, autocast_dtype)
    compiled = torch.compile(copy.deepcopy(model), backend="te", options={"compiler": "aot_eager"})
    te = _run(compiled, x, autocast_dtype)
    assert len([s for s in te_compile.report().rewritten if s.op == "linear"]) == 2
    y_ref, y = eager[0], te[0]
    assert y.dtype == y_ref.dtype, f"output {y.dtype}, eager {y_ref.dtype}"
    for name, ref, got in zip(["x", *[n for n, _ in model.named_parameters()]], [eager[1], *eager[2]],
                              [te[1], *te[2]]):
        assert got.dtype == ref.dtype, f"grad of {name}: {got.dtype}, eager {ref.dtype}"
    db = sqnr(y_ref.float(), y.float())
    assert 12.0 < db < 40.0, f"FP8 output {db:.1f} dB from eager: expected FP8 noise"


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
def test_fp32_weight_gradient_leaves_its_fp8_gemm_unrounded_under_autocast(recipe):
    """Under autocast over fp32 weights, a per-tensor site's weight gradient is its wgrad GEMM's fp32
    output: dw = (gq.T * g_sinv) @ (xq * x_sinv) on the E5M2 gradient and E4M3 input of the site,
    bit for bit, not that product rounded to bf16 and cast up (on a GPU that cast is a pass over the
    whole gradient, 6 bytes an element). dgrad likewise runs its fp32 product, rounded once to bf16:
    the backward, traced under the caller's autocast, must not run the emulated GEMM in bf16."""
    from te_compile.recipe import Float8CurrentScaling
    from te_compile.scaling import quantize_per_tensor

    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    layer = nn.Linear(K, N, bias=False)
    x = torch.randn(16, K, requires_grad=True)
    g = torch.randn(16, N)
    compiled = torch.compile(layer, backend="te", options={"recipe": recipe, "compiler": "aot_eager"})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = compiled(x)
    y.backward(g.bfloat16())
    dw, dx = layer.weight.grad, x.grad
    assert dw.dtype == torch.float32
    assert not torch.equal(dw, dw.bfloat16().float()), "the weight gradient was rounded to bf16"
    if recipe == "Float8CurrentScaling":   # the first DelayedScaling step's scales are 1, as here too
        r = Float8CurrentScaling()
        xq, x_sinv, _ = quantize_per_tensor(x.bfloat16(), "input", r)
        gq, g_sinv, _ = quantize_per_tensor(g.bfloat16(), "grad_output", r)
        wq, w_sinv, _ = quantize_per_tensor(layer.weight.detach().bfloat16(), "weight", r)
        assert_bitwise_equal(dw, (gq.float() * g_sinv).t() @ (xq.float() * x_sinv))
        assert_bitwise_equal(dx, ((gq.float() * g_sinv) @ (wq.float() * w_sinv)).bfloat16().float())


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling",
                                    "Float8BlockScaling", "NVFP4BlockScaling"])
@pytest.mark.parametrize("shape", [(K,), (1, K), (0, K), (2, 3, 5, K)], ids=["1d", "1token", "0tokens", "4d"])
def test_any_input_rank_or_token_count_gives_eager_or_a_reported_fallback(recipe, shape):
    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    layer = nn.Linear(K, 64)
    x = torch.randn(shape, requires_grad=True)
    y = torch.compile(layer, backend="te", options={"recipe": recipe, "compiler": "aot_eager"})(x)
    y.sum().backward()
    [site] = te_compile.report().sites
    assert y.shape == (*shape[:-1], 64)
    if recipe == "NVFP4BlockScaling" and len(shape) == 1:
        assert not site.rewritten and "NVFP4 needs an input of at least 2 dims" in site.reason
    elif 0 in shape:
        assert not site.rewritten and "is empty: nothing to quantize" in site.reason
    else:
        assert site.rewritten, site
    if y.numel():
        assert_sqnr_at_least(layer(x).detach(), y, 10.0, f"{recipe} {shape}")


@pytest.mark.parametrize("gemm_path", ["emulated", "scaled_mm"])
def test_one_token_and_1d_inputs_under_inductor(monkeypatch, gemm_path):
    """Inductor's _scaled_mm lowering checks strides literally; a [16, 1] operand has a free stride.
    Both CPU GEMM paths (gemm/per_tensor.py): the emulation and _scaled_mm itself."""
    monkeypatch.setattr(gemm, "cpu_emulates_scaled_mm", lambda: gemm_path == "emulated")
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = nn.Linear(K, 64)
    compiled = torch.compile(layer, backend="te", options={"recipe": "Float8CurrentScaling"}, dynamic=False)
    for shape in ((1, K), (K,)):
        x = torch.randn(shape, requires_grad=True)
        y = compiled(x)
        y.sum().backward()
        x_ref = x.detach().clone().requires_grad_()
        with Fp8Reference():
            ref = layer(x_ref)
        ref.sum().backward()
        assert_sqnr_at_least(ref, y, 60.0, f"output {shape}")
        assert_sqnr_at_least(x_ref.grad, x.grad, 40.0, f"input grad {shape}")


# ---- config mistakes surface at once, with our message first ----

def test_config_errors_raise_at_once_from_backend_and_load_config(tmp_path):
    with pytest.raises(te_compile.ConfigError, match=r"^options: recipe: unknown recipe 'Float9'.*allowed"):
        te_compile.backend(recipe="Float9")
    with pytest.raises(te_compile.ConfigError, match=r"^options: amax_histroy_len: unknown option"):
        te_compile.backend(recipe="DelayedScaling", amax_histroy_len=4)
    path = tmp_path / "bad.toml"
    path.write_text('recipe = "DelayedScaling"\n[recipe_options]\nmargin = "zero"\n')
    with pytest.raises(te_compile.ConfigError, match=r"bad.toml: recipe_options.margin: expected an int"):
        te_compile.load_config(path)
    with pytest.raises(te_compile.ConfigError, match=r"bad.toml: recipe_options.margin"):
        te_compile.backend(config=path)


def test_a_config_error_in_compile_options_is_ours_not_a_backend_failure():
    """torch hands options to the backend at the first call; the error raised there is a
    te_compile.ConfigError whose message comes first (no "backend='te' raised:" wrapper)."""
    torch._dynamo.reset()
    compiled = torch.compile(nn.Linear(K, K), backend="te", options={"recipe": "Float9"})
    with pytest.raises(te_compile.ConfigError) as info:
        compiled(torch.randn(2, K))
    message = str(info.value)
    assert message.startswith("options: recipe: unknown recipe 'Float9'"), message
    assert "'Float8CurrentScaling'" in message and "'none'" in message


# ---- already right: keep it so ----

def test_no_recompiles_at_fixed_shapes_and_gradient_accumulation_sums_micro_batches():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = TwoLinears()
    compiled = torch.compile(model, backend="te", options={"compiler": "aot_eager"})
    xs = [torch.randn(4, K) for _ in range(3)]
    single = []
    for x in xs:
        model.zero_grad(set_to_none=True)
        compiled(x).sum().backward()
        single.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    for x in xs:                                   # three micro-batches, one optimizer step
        compiled(x).sum().backward()
    for i, p in enumerate(model.parameters()):
        assert_bitwise_equal(p.grad, single[0][i] + single[1][i] + single[2][i], f"accumulated grad {i}")
    assert counters["stats"]["unique_graphs"] == 1


def test_linears_either_side_of_a_graph_break():
    class Broken(TwoLinears):
        def forward(self, x):
            h = F.relu(self.fc(x))
            torch._dynamo.graph_break()
            return self.proj(h)

    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    model = Broken()
    x = torch.randn(4, K)
    y = torch.compile(model, backend="te", options={"compiler": "aot_eager"})(x)
    report = te_compile.report()
    assert [(s.fqn, s.graph, s.rewritten) for s in report.sites if s.op == "linear"] == [("fc", 0, True),
                                                                                         ("proj", 1, True)]
    with Fp8Reference():
        assert_sqnr_at_least(model(x), y, 60.0, "across a graph break")


def test_the_recipe_state_dict_loads_with_weights_only(tmp_path):
    torch._dynamo.reset()
    model = TwoLinears()
    compiled = torch.compile(model, backend="te", options={"recipe": "DelayedScaling", "amax_history_len": 4,
                                                            "compiler": "aot_eager"})
    compiled(torch.randn(4, K)).sum().backward()
    path = tmp_path / "recipe_state.pt"
    torch.save(te_compile.recipe_state_dict(model), path)
    loaded = torch.load(path, weights_only=True)
    fresh = TwoLinears()
    te_compile.load_recipe_state_dict(fresh, loaded)
    for key, value in te_compile.recipe_state_dict(model).items():
        assert_bitwise_equal(te_compile.recipe_state_dict(fresh)[key], value, key)


def test_in_place_ops_that_nothing_reads_keep_their_effect():
    """Dynamo keeps an in-place op whose result nothing reads for its effect on a buffer read later
    (HF DeepSeek-V3 builds its keys by copy_ into slices of new_empty). fx calls copy_ / relu_ / add_
    pure, and the passes' dead-code sweep used to drop them: the linear then read uninitialized
    memory (NaN losses on DeepSeek-V3)."""
    class InPlace(TwoLinears):
        def forward(self, x):
            h = self.fc(x)
            k = h.new_empty(h.shape)
            k[..., : N // 2].copy_(h[..., N // 2:])
            k[..., N // 2:].copy_(h[..., : N // 2])
            k.add_(1.0)
            torch.relu_(k)
            return self.proj(k)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = InPlace()
    x = torch.randn(4, K)
    y = torch.compile(model, backend="te", options={"compiler": "aot_eager"})(x)
    y.sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads), "fc's output no longer reaches the loss: the copies were dropped"
    model.zero_grad(set_to_none=True)
    with Fp8Reference():
        ref = model(x)
        ref.sum().backward()
    assert_sqnr_at_least(ref, y, 60.0, "forward")
    for p, g in zip(model.parameters(), grads):
        assert_sqnr_at_least(p.grad, g, 40.0, "gradient")
