"""The linear pass finds every linear, in every form, and says what it did with each (aot_eager)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from fp8_reference import Fp8Reference
from utils import assert_sqnr_at_least

K, N, B, T = 32, 48, 2, 8
OPTIONS = {"compiler": "aot_eager"}


class Forms(nn.Module):
    """Each form a linear takes in real model code, on its own weight, one after the other."""

    FORMS = ("falcon", "dot_t", "transpose", "cast_to", "cast_type_as", "in_out", "mm", "addmm", "addmm_t",
             "bmm", "baddbmm", "left")
    OPS = ("matmul", "matmul", "matmul", "linear", "linear", "matmul", "matmul", "addmm", "addmm", "bmm",
           "baddbmm", "matmul")

    def __init__(self):
        super().__init__()
        self.w = nn.ParameterDict({f: nn.Parameter(torch.randn(K, K) / K**0.5) for f in self.FORMS})
        self.b = nn.Parameter(torch.randn(K) / 10)

    def forward(self, x):  # x: [B, T, K]
        w = self.w
        x = x @ w["falcon"].T + self.b                                # HF FalconLinear
        x = x @ w["dot_t"].t()
        x = torch.matmul(x, w["transpose"].transpose(0, 1))
        x = F.linear(x, w["cast_to"].to(x.dtype))
        x = F.linear(x, w["cast_type_as"].type_as(x))
        x = x @ w["in_out"]                                           # a weight stored [in, out]
        x2d = x.reshape(-1, K)
        x2d = torch.mm(x2d, w["mm"])
        x2d = torch.addmm(self.b, x2d, w["addmm"])                    # HF Conv1D
        x2d = torch.addmm(self.b, x2d, w["addmm_t"].t())
        x = x2d.reshape(B, T, K)
        x = torch.bmm(x, w["bmm"].expand(B, K, K))
        x = torch.baddbmm(self.b, x, w["baddbmm"].unsqueeze(0).expand(B, K, K))
        return (w["left"] @ x.transpose(1, 2)).transpose(1, 2)       # W @ x


class Unsupported(nn.Module):
    """Matmuls with a parameter operand that are not linears; each must still show in the report."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(K, K))
        self.a = nn.Parameter(torch.randn(K, 16))
        self.b = nn.Parameter(torch.randn(16, K))
        self.experts = nn.Parameter(torch.randn(B, K, K))

    def forward(self, x):  # x: [B, T, K]
        merged = self.a @ self.b                                  # two parameters
        y = torch.einsum("btk,nk->btn", x, self.w)                # einsum
        return torch.baddbmm(y, y, self.experts), merged          # a batched parameter plus an addend


def _fp8_reference_of_forms(model, x):
    """The same computation with every form written as F.linear, under the eager FP8 emulation."""
    w = model.w
    with Fp8Reference():
        h = F.linear(x, w["falcon"]) + model.b
        for name in ("dot_t", "transpose", "cast_to", "cast_type_as"):
            h = F.linear(h, w[name])
        h = F.linear(h, w["in_out"].t())
        h = F.linear(h, w["mm"].t())
        h = F.linear(h, w["addmm"].t()) + model.b
        h = F.linear(h, w["addmm_t"]) + model.b
        h = F.linear(h, w["bmm"].t())
        h = F.linear(h, w["baddbmm"].t()) + model.b
        return F.linear(h, w["left"])


@pytest.fixture(scope="module")
def forms():
    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    model = Forms()
    x = torch.randn(B, T, K, requires_grad=True)
    y = torch.compile(model, backend="te", options=OPTIONS, fullgraph=True)(x)
    y.square().sum().backward()
    return model, x, y, te_compile.report()


def test_every_form_is_a_rewritten_linear_site(forms):
    model, _, _, report = forms
    assert len(report.sites) == len(Forms.FORMS), str(report)
    assert all(s.rewritten for s in report.sites), str(report)
    named = {s.shapes.split("=")[1].split(" ")[0] for s in report.sites}
    assert named == {f"w.{f}" for f in Forms.FORMS}
    assert tuple(s.reason.split(" ->")[0] for s in report.sites) == Forms.OPS, str(report)
    assert "graph 0: rewritten 12 of 12 linear sites" in str(report)


def test_every_form_computes_the_fp8_linear(forms):
    model, x, y, _ = forms
    x_ref = x.detach().clone().requires_grad_()
    ref = _fp8_reference_of_forms(model, x_ref)
    assert_sqnr_at_least(ref, y, 40.0, "forms: te vs eager FP8 emulation")
    ref.square().sum().backward()
    assert_sqnr_at_least(x_ref.grad, x.grad, 25.0, "forms: input grad")
    assert all(p.grad is not None for p in model.parameters())


def test_matmuls_with_a_parameter_that_are_not_linears_are_reported():
    torch._dynamo.reset()
    te_compile.reset()
    model = Unsupported()
    torch.compile(model, backend="te", options=OPTIONS, fullgraph=True)(torch.randn(B, T, K))
    report = te_compile.report()
    reasons = [s.reason for s in report.sites]
    assert not report.rewritten and len(reasons) == 3, str(report)
    assert "of two parameters (a, b)" in reasons[0]
    assert "einsum with a parameter operand" in reasons[1]
    assert "baddbmm with a batched parameter operand" in reasons[2]   # bmm alone: test_expert_forms.py
    assert "graph 0: rewritten 0 of 3 linear sites; 3 left in high precision: <root> — " in str(report)


class Chain(nn.Module):
    """Linears feeding linears directly: a projection into a LoRA pair into a head."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, K)
        self.lora_a = nn.Linear(K, 16, bias=False)
        self.lora_b = nn.Linear(16, K, bias=False)
        self.seq = nn.Sequential(nn.Linear(K, N), nn.Linear(N, K))
        self.head = nn.Linear(K, N)

    def forward(self, x):
        h = self.proj(x)
        return self.head(self.seq(h + self.lora_b(self.lora_a(h))))


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_linears_feeding_linears(compiler):
    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(B, T, K)
    y = torch.compile(model, backend="te", options={"compiler": compiler}, fullgraph=True)(x)
    y.sum().backward()
    assert len(te_compile.report().rewritten) == 6
    with Fp8Reference():
        ref = model(x)
    assert_sqnr_at_least(ref, y, 40.0, "chain of linears")


def test_root_level_call_on_a_submodule_weight_is_named_after_its_module():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, K)

        def forward(self, idx):
            return F.linear(self.embed(idx), self.embed.weight)    # logits against the embedding

    torch._dynamo.reset()
    te_compile.reset()
    torch.compile(Root(), backend="te", options=OPTIONS)(torch.randint(0, 64, (B, T)))
    [site] = te_compile.report().sites
    assert site.fqn == "embed" and site.rewritten and site.shapes == "x[2, 8, 32] w[64, 32]", site


def _wrapped(forward):
    """A decorator as transformers >= 5.24 puts on its models' forward: Dynamo then compiles
    ``wrapper``, whose frame holds the model as ``args[0]``."""
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    return wrapper


def test_a_model_whose_forward_a_decorator_wraps_keeps_its_names():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(K, K), nn.ReLU(), nn.Linear(K, N))

        @_wrapped
        def forward(self, x):
            return self.model(x)

    torch._dynamo.reset()
    te_compile.reset()
    overrides = [{"modules": "model.2", "recipe": "none"}]
    torch.compile(Wrapped(), backend="te", options={**OPTIONS, "overrides": overrides})(torch.randn(B, K))
    report = te_compile.report()
    assert {s.fqn: s.rewritten for s in report.sites if s.op == "linear"} == {"model.0": True, "model.2": False}, \
        str(report)


def test_linears_in_bodies_of_other_higher_order_ops_are_reported_not_rewritten():
    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(K, K)
            self.b = nn.Linear(K, K)
            self.c = nn.Linear(K, K)

        def forward(self, x):
            @torch.compiler.nested_compile_region
            def shared(h):
                return self.c(h)

            y = torch.cond(x.sum() > 0, lambda h: self.a(h), lambda h: self.b(h), (x,))
            return shared(shared(y))

    torch._dynamo.reset()
    te_compile.reset()
    model = Branches()
    x = torch.randn(4, K, requires_grad=True)
    y = torch.compile(model, backend="te", options=OPTIONS)(x)
    y.sum().backward()
    sites = [(s.fqn, s.rewritten, s.reason) for s in te_compile.report().sites]
    assert sites == [
        ("a", False, "inside torch.ops.higher_order.cond, which the te passes do not rewrite"),
        ("b", False, "inside torch.ops.higher_order.cond, which the te passes do not rewrite"),
        ("c", False, "inside torch.ops.higher_order.invoke_subgraph, which the te passes do not rewrite"),
    ], sites
    torch.testing.assert_close(y, model(x))


class Block(nn.Module):
    def __init__(self, graph_break: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(K, N)
        self.fc2 = nn.Linear(N, K)
        self.graph_break = graph_break

    def forward(self, x):
        h = F.relu(self.fc1(x))
        if self.graph_break:
            torch._dynamo.graph_break()   # Dynamo then compiles Block.forward on its own
        return x + self.fc2(h)


class Blocks(nn.Module):
    def __init__(self, graph_break: bool = False):
        super().__init__()
        # blocks 1 and 2 get inputs that require grad: Dynamo compiles one graph for both
        self.blocks = nn.ModuleList(Block(graph_break) for _ in range(3))
        self.head = nn.Linear(K, N)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _blocks_report(layout: str, overrides=()):
    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    model = Blocks(graph_break=layout == "graph_break")
    options = {**OPTIONS, "overrides": list(overrides)}
    if layout == "per_block":               # the torchtitan layout: each block compiled on its own
        for block in model.blocks:
            block.compile(backend="te", options=options)
        run = model
    else:
        run = torch.compile(model, backend="te", options=options)
    run(torch.randn(4, K)).sum().backward()
    return te_compile.report()


@pytest.mark.parametrize("layout", ["graph_break", "per_block"])
def test_sites_carry_the_models_names_and_overrides_match_them_when_blocks_compile_alone(layout):
    report = _blocks_report(layout, [{"modules": "blocks.*.fc2", "recipe": "none"}])
    names = {s.fqn: s.rewritten for s in report.sites if s.op == "linear"}
    # every block is listed under its own name, also where Dynamo reuses one graph for both
    assert {n: r for n, r in names.items() if n.startswith("blocks")} == {
        f"blocks.{i}.fc{j}": j == 1 for i in range(3) for j in (1, 2)}, str(report)


def test_a_reused_graph_refuses_an_instance_the_config_gives_another_recipe():
    with pytest.raises(RuntimeError, match=r"built for 'blocks.1.fc1' with recipe Float8CurrentScaling, and "
                                           r"Dynamo reuses it for 'blocks.2.fc1', which the config gives recipe 'none'"):
        _blocks_report("per_block", [{"modules": "blocks.2.*", "recipe": "none"}])


def test_a_batched_parameter_slice_and_grouped_gemms_are_listed():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, N, K) / K**0.5)

        def forward(self, x, idx):   # x: [T, K], idx: [T]; each token through its expert's weight
            return torch.bmm(self.w[idx], x.unsqueeze(-1)).squeeze(-1)

    torch._dynamo.reset()
    te_compile.reset()
    torch.compile(Experts(), backend="te", options=OPTIONS)(torch.randn(8, K), torch.randint(0, 4, (8,)))
    [site] = te_compile.report().sites
    assert not site.rewritten and "bmm with a batched parameter operand" in site.reason
