"""Amax reductions across ranks: DDP + DelayedScaling, tensor / sequence parallel, hand-sharded tensors.

The multi-process tests share one spawned world of 2 CPU processes over gloo (a free port, one
thread each, aot_eager so a compile costs seconds); the workers save what they measured with
torch.save and the test process asserts on it, so a failure shows as an ordinary assertion with
both ranks' values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from te_compile.config import ConfigError, DistributedConfig, config_from_dict
from te_compile.distributed import AmaxGroup, minimal_groups
from utils import run_ranks, sqnr

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORLD = 2
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default


class MLP(nn.Module):
    """``attn``: causal self-attention (2 heads, q = k = v) over the hidden activations."""

    def __init__(self, d: int = 32, hidden: int = 64, norm: bool = False, attn: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d) if norm else nn.Identity()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.attn = attn

    def forward(self, x):
        h = self.up(self.norm(x))
        if self.attn:
            b, t, hidden = h.shape
            heads = h.view(b, t, 2, hidden // 2).transpose(1, 2)
            h = F.scaled_dot_product_attention(heads, heads, heads, is_causal=True).transpose(1, 2).reshape(b, t, hidden)
        return self.down(torch.relu(h))


class _Patch:
    """The one monkeypatch method AotGraphs needs, for use inside a worker."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def _funcol_all_reduces(fn) -> int:
    """How many functional all-reduces run while ``fn()`` runs (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "_c10d_functional::all_reduce")


def _max_all_reduces(gm) -> int:
    """All-reduce nodes with MAX (amax reductions; DTensor's and DDP's own collectives sum)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is ALL_REDUCE
               and n.args[1] == "max")


def _state(model) -> dict:
    return {k: v.clone() for k, v in te_compile.recipe_state_dict(model).items()}


# ---------------------------------------------------------------------------------------------
# DDP + DelayedScaling


def _data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + rank)


def _ddp_worker(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from utils import AotGraphs

    graphs = AotGraphs().install(_Patch())
    options = {"recipe": "DelayedScaling", "amax_history_len": 4, "compiler": "aot_eager"}
    out = {}
    # tiny buckets: DDPOptimizer splits the graph into one piece per linear
    dist._DEFAULT_FIRST_BUCKET_BYTES = 4096
    for group in ("world", "none"):
        torch._dynamo.reset()
        te_compile.reset()
        torch.manual_seed(0)
        model = MLP(attn=True)
        ddp = DDP(model, bucket_cap_mb=0.004)
        compiled = torch.compile(ddp, backend="te", options={**options, "amax_group": group,
                                                             "rewrite": {"sdpa": True}})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        runs = 0
        for step in range(3):
            def train_step():
                compiled(_data(rank, step)).pow(2).mean().backward()
            if step == 2:
                runs = _funcol_all_reduces(train_step)
            else:
                train_step()
            opt.step()
            opt.zero_grad()
        out[group] = {"state": _state(model), "all_reduces_run": runs,
                      "sites": [(s.graph, s.fqn, s.rewritten, s.collectives) for s in te_compile.report().sites
                                if s.op == "linear"],
                      "sdpa": [(s.rewritten, s.reason, s.collectives) for s in te_compile.report().sites
                               if s.op == "sdpa"]}
    out["forward_all_reduces"] = [_max_all_reduces(g) for g in graphs.forward]
    out["backward_all_reduces"] = [_max_all_reduces(g) for g in graphs.backward]

    # one process on both ranks' data (mean over the global batch = DDP's averaged gradients)
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref_model = MLP()
    ref = torch.compile(ref_model, backend="te", options={**options, "amax_group": "none"})
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref_losses, ddp_losses = [], []
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(DDP(model, bucket_cap_mb=0.004), backend="te", options=options)
    ddp_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.cat([_data(r, step) for r in range(WORLD)])
        loss = ref(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
        local = compiled(_data(rank, step)).pow(2).mean()
        local.backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
        mean = local.detach().clone()
        dist.all_reduce(mean)
        ddp_losses.append(mean.item() / WORLD)
    out["ref_losses"], out["ddp_losses"] = ref_losses, ddp_losses
    return out


def _world(rank: int) -> dict:
    """Every multi-process case of this file in one spawned world (a spawn costs seconds of imports
    per rank). Inductor first: the others install AotGraphs, which replaces the final compiler."""
    out = {}
    for key, worker in (("inductor", _inductor_worker), ("async_tp", _async_tp_worker), ("ddp", _ddp_worker),
                        ("tp", _tp_worker),
                        ("vocab", _vocab_worker), ("cp", _cp_worker), ("hand", _hand_worker)):
        torch._dynamo.reset()
        te_compile.reset()
        out[key] = worker(rank)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_ranks(_world, tmp_path_factory.mktemp("distributed"))


@pytest.fixture(scope="module")
def ddp_results(world):
    return [r["ddp"] for r in world]


def test_ddp_delayed_scaling_state_identical_on_ranks(ddp_results):
    a, b = ddp_results
    # two linears' state and the attention's (keyed on a parameter of the root module, named "sdpa")
    assert a["world"]["state"].keys() == b["world"]["state"].keys() and len(a["world"]["state"]) == 12 + 8
    assert "sdpa.query.amax_history" in a["world"]["state"]
    differ = [k for k in a["world"]["state"] if not torch.equal(a["world"]["state"][k], b["world"]["state"][k])]
    assert not differ, f"state differs between ranks with amax_group='world': {differ}"
    # the ranks see different data (rank 1's is twice as large): without the reduction they drift
    differ = [k for k in a["none"]["state"] if not torch.equal(a["none"]["state"][k], b["none"]["state"][k])]
    assert any(k.endswith("input.amax_history") for k in differ), differ
    assert "sdpa.query.amax_history" in differ, differ


def test_ddp_one_all_reduce_per_graph_and_step(ddp_results):
    for rank in ddp_results:
        # DDPOptimizer split the model into 2 graphs; each reduces its amaxes once, in backward
        assert [s[0] for s in rank["world"]["sites"]] == [0, 1]
        assert rank["world"]["all_reduces_run"] == 2
        assert rank["none"]["all_reduces_run"] == 0
        assert sum(rank["forward_all_reduces"]) == 0
        # world: 2 graphs with one all_reduce each; none: 2 graphs without
        assert sorted(rank["backward_all_reduces"]) == [0, 0, 1, 1]
        for _, fqn, rewritten, collectives in rank["world"]["sites"]:
            assert rewritten and collectives == ("amax history all-reduce over world (2 ranks), one per "
                                                 "graph and step"), (fqn, collectives)
        assert all(c == "" for *_, c in rank["none"]["sites"])
        # the attention's amaxes ride in the same all-reduce as the linears'
        [(rewritten, reason, collectives)] = rank["world"]["sdpa"]
        assert rewritten and "per tensor with delayed scaling" in reason, reason
        assert collectives == "amax history all-reduce over world (2 ranks), one per graph and step"
        assert rank["none"]["sdpa"][0][2] == ""


def test_ddp_loss_tracks_one_process(ddp_results):
    ref, got = ddp_results[0]["ref_losses"], ddp_results[0]["ddp_losses"]
    assert got == pytest.approx(ref, rel=2e-3), (got, ref)


# ---------------------------------------------------------------------------------------------
# Tensor and sequence parallel


def _record_gemms():
    """Record the operands of every FP8 GEMM the per-tensor lowering runs (eager)."""
    import te_compile.lowerings.fp8_linear as fp8_linear

    calls = []
    real = fp8_linear.fp8_gemm

    def recording(a, b, a_scale_inv, b_scale_inv, out_dtype):
        calls.append((a.view(torch.uint8).clone(), b.view(torch.uint8).clone(), a_scale_inv.clone(),
                      b_scale_inv.clone()))
        return real(a, b, a_scale_inv, b_scale_inv, out_dtype=out_dtype)

    fp8_linear.fp8_gemm = recording
    return calls, lambda: setattr(fp8_linear, "fp8_gemm", real)


def _tp_model(mesh, recipe_model: MLP, sequence_parallel: bool = False) -> MLP:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    model = MLP(norm=sequence_parallel)
    model.load_state_dict(recipe_model.state_dict())
    if sequence_parallel:
        plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return parallelize_module(model, mesh, plan)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _tp_worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from te_compile.lowerings.linear import LinearLowering, LinearSpec
    from te_compile.recipe import Float8CurrentScaling

    out = {}
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32)
    w_up, w_down = torch.randn(64, 32), torch.randn(32, 64) * 3

    # 1. The FP8 bytes of every GEMM operand on a shard are the matching slice of one process's.
    recipe = Float8CurrentScaling()
    up = LinearLowering(LinearSpec("up", recipe))
    down = LinearLowering(LinearSpec("down", recipe))
    calls, restore = _record_gemms()
    try:
        xr = x.clone().requires_grad_()
        ref = down(torch.relu(up(xr, w_up.requires_grad_(), None)), w_down.requires_grad_(), None)
        ref.sum().backward()
        ref_calls = list(calls)
        calls.clear()
        xd = DTensor.from_local(x.clone(), mesh, [Replicate()]).requires_grad_()
        wd_up = nn.Parameter(DTensor.from_local(w_up.detach().chunk(WORLD, 0)[rank], mesh, [Shard(0)]))
        wd_down = nn.Parameter(DTensor.from_local(w_down.detach().chunk(WORLD, 1)[rank], mesh, [Shard(1)]))
        y = down(torch.relu(up(xd, wd_up, None)), wd_down, None)
        y_full = y.full_tensor()
        y_full.sum().backward()
        out["sharded_calls"], out["ref_calls"] = list(calls), ref_calls
        out["y"], out["ref_y"] = y_full.detach(), ref.detach()
        out["y_placements"] = str(y.placements)
        out["grads"] = [_full(t.grad) for t in (xd, wd_up, wd_down)]
        out["ref_grads"] = [t.grad for t in (xr, w_up, w_down)]
    finally:
        restore()

    # 2. Compiled, 1-D mesh and a 2-D (dp=1, tp=2) mesh, several recipes: matches one process.
    from utils import AotGraphs

    graphs = AotGraphs().install(_Patch())
    cases = [("Float8CurrentScaling", "1d", False), ("DelayedScaling", "1d", False),
             ("MXFP8BlockScaling", "1d", False), ("NVFP4BlockScaling", "1d", False),
             ("Float8CurrentScaling", "2d", False), ("Float8CurrentScaling", "1d", True)]
    mesh_2d = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    out["compiled"] = {}
    for recipe_name, mesh_kind, sp in cases:
        torch._dynamo.reset()
        te_compile.reset()
        graphs.forward.clear()
        graphs.backward.clear()
        torch.manual_seed(1)
        base = MLP(norm=sp)
        tp_mesh = mesh if mesh_kind == "1d" else mesh_2d["tp"]
        options = {"recipe": recipe_name, "compiler": "aot_eager"}
        if mesh_kind == "2d":
            options["amax_group"] = mesh_2d["dp"]   # one rank: no collective for it
        ref_model = MLP(norm=sp)
        ref_model.load_state_dict(base.state_dict())
        tp = torch.compile(_tp_model(tp_mesh, base, sp), backend="te", options=options)
        ref = torch.compile(ref_model, backend="te", options=options)
        results = []
        for step in range(2):
            torch.manual_seed(10 + step)
            xs = torch.randn(2, 8, 32)
            if sp:   # sequence parallel: each rank holds its part of the sequence, in and out
                y_local = tp(xs.chunk(WORLD, 1)[rank])
                y_local.pow(2).sum().backward()
                parts = [torch.empty_like(y_local) for _ in range(WORLD)]
                dist.all_gather(parts, y_local.detach().contiguous())
                y = torch.cat(parts, dim=1)
            else:
                y = _full(tp(xs))
                y.pow(2).sum().backward()
            y_ref = ref(xs)
            y_ref.pow(2).sum().backward()
            results.append((y.detach(), y_ref.detach()))
        tp_model = tp._orig_mod
        grads = {n: (_full(p.grad), dict(ref_model.named_parameters())[n].grad)
                 for n, p in tp_model.named_parameters()}
        # linears and the norm (the MLP's ReLU row, fused or not, is another test's subject)
        sites = [(s.fqn, s.rewritten, s.collectives) for s in te_compile.report().sites
                 if s.op in ("linear", "layer_norm")]
        fwd = [_max_all_reduces(g) for g in graphs.forward]
        bwd = [_max_all_reduces(g) for g in graphs.backward]
        state = _state(tp_model) if recipe_name == "DelayedScaling" else {}
        ref_state = _state(ref_model) if recipe_name == "DelayedScaling" else {}
        out["compiled"][(recipe_name, mesh_kind, sp)] = dict(results=results, grads=grads, sites=sites,
                                                             fwd=fwd, bwd=bwd, state=state, ref_state=ref_state)
    return out


def _async_tp_worker(rank: int) -> dict:
    """A torchtitan-planned TitanBlock (sequence parallel) trained 3 SGD steps with async_tp off and on:
    te's own FP8 all-gathers and reduce-scatters (uint8 on gloo) against DTensor's collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from models import TitanBlock, titan_tp_plan

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    out = {}
    for recipe, async_tp in [(r, a) for r in ("Float8CurrentScaling", "DelayedScaling") for a in (False, True)]:
        torch._dynamo.reset()
        te_compile.reset()
        torch.manual_seed(0)
        model = parallelize_module(TitanBlock(), mesh, titan_tp_plan())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = torch.compile(model, backend="te", options={
            "recipe": recipe, "compiler": "aot_eager", "distributed": {"async_tp": async_tp}})
        losses = []
        for step in range(3):
            x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step)).chunk(WORLD, 1)[rank]
            loss = compiled(x).pow(2).mean()   # this rank's positions
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        out[recipe, async_tp] = dict(losses=torch.stack(losses),
                                     weights={n: p.to_local().detach().clone() for n, p in model.named_parameters()},
                                     rows=[r.reason for r in te_compile.report().sites if r.op == "linear"],
                                     state=te_compile.recipe_state_dict(model))
    return out


def test_async_tp_trains_as_dtensor_collectives_do(world):
    """The same losses and weights after 3 steps, bit for bit, on both ranks: the same FP8 bytes (amaxes
    all-reduced before the gather, as DTensor's path reduces them after), GEMMs and sums (one
    reduce-scatter of wq's + wk's + wv's dgrad, as DTensor sums the partial gradients first)."""
    for result in (r["async_tp"] for r in world):
        off, on = result["Float8CurrentScaling", False], result["Float8CurrentScaling", True]
        assert all("async TP:" in reason for reason in on["rows"]) and len(on["rows"]) == 7
        assert not any("async TP" in reason for reason in off["rows"])
        assert torch.equal(on["losses"], off["losses"]), (on["losses"], off["losses"])
        for name, w in off["weights"].items():
            assert torch.equal(on["weights"][name], w), name


def test_async_tp_under_delayed_scaling(world):
    """DelayedScaling: each site quantizes with its state's scales and hands its local amaxes to the
    update, which reduces them over tp: the histories are DTensor's path's, and so are the losses and
    weights, up to the order of fp32 sums (each of wq, wk, wv reduce-scatters its own dx here; seen:
    equal bit for bit on 2 ranks)."""
    for result in (r["async_tp"] for r in world):
        off, on = result["DelayedScaling", False], result["DelayedScaling", True]
        assert all("async TP:" in reason for reason in on["rows"]) and len(on["rows"]) == 7
        torch.testing.assert_close(on["losses"], off["losses"], rtol=1e-5, atol=0)
        for name, w in off["weights"].items():
            torch.testing.assert_close(on["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
        assert on["state"].keys() == off["state"].keys() and on["state"]
        for key, value in off["state"].items():
            torch.testing.assert_close(on["state"][key], value, rtol=1e-5, atol=0, msg=key)


@pytest.fixture(scope="module")
def tp_results(world):
    return [r["tp"] for r in world]


def test_tp_shards_quantize_to_one_process_bytes(tp_results):
    for rank, r in enumerate(tp_results):
        ref, got = r["ref_calls"], r["sharded_calls"]
        assert len(ref) == len(got) == 6   # two linears: fprop, dgrad, wgrad each
        # forward: up (x replicated, w rows sharded), down (x and w sharded along K)
        (ux, uw, usx, usw), (dx, dw, dsx, dsw) = got[0], got[1]
        (rux, ruw, rusx, rusw), (rdx, rdw, rdsx, rdsw) = ref[0], ref[1]
        assert torch.equal(usx, rusx) and torch.equal(usw, rusw) and torch.equal(dsx, rdsx) and torch.equal(dsw, rdsw)
        assert torch.equal(ux, rux)
        # b operands are w.T (column-major [K, N]): up's N and down's K are split by rank
        assert torch.equal(uw, ruw.chunk(WORLD, 1)[rank])
        assert torch.equal(dx, rdx.chunk(WORLD, 1)[rank])
        assert torch.equal(dw, rdw.chunk(WORLD, 0)[rank])
        # backward: every grad_output scale equals one process's (up's gradient is sharded along N)
        for (_, _, sa, _), (_, _, rsa, _) in zip(got[2:], ref[2:]):
            assert torch.equal(sa, rsa)
        assert r["y_placements"] == "(Partial(sum),)"
        torch.testing.assert_close(r["y"], r["ref_y"], rtol=1e-5, atol=1e-5)
        for g, rg in zip(r["grads"], r["ref_grads"]):
            torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", [("Float8CurrentScaling", "1d", False), ("DelayedScaling", "1d", False),
                                  ("MXFP8BlockScaling", "1d", False), ("NVFP4BlockScaling", "1d", False),
                                  ("Float8CurrentScaling", "2d", False), ("Float8CurrentScaling", "1d", True)],
                         ids=lambda c: f"{c[0]}-{c[1]}{'-sp' if c[2] else ''}")
def test_tp_compiled_matches_one_process(tp_results, case):
    recipe, _, sp = case
    for rank in tp_results:
        r = rank["compiled"][case]
        fqns = ["norm", "up", "down"] if sp else ["up", "down"]
        assert [s[0] for s in r["sites"]] == fqns * 2   # tp model, then ref
        assert all(s[1] for s in r["sites"] if s[0] != "norm")
        if sp:   # the sequence-parallel norm reads a DTensor: left unfused; the one-process one fuses
            assert [s[1] for s in r["sites"] if s[0] == "norm"] == [False, True]
        # NVFP4's stochastic rounding draws other random numbers per shard: compare loosely
        tol = dict(rtol=0.1, atol=0.5) if recipe == "NVFP4BlockScaling" else dict(rtol=1e-5, atol=1e-4)
        for y, y_ref in r["results"]:
            torch.testing.assert_close(y, y_ref, **tol)
        for name, (g, g_ref) in r["grads"].items():
            if recipe == "NVFP4BlockScaling":
                continue
            torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-3, msg=lambda m: f"{name}: {m}")
        for key in r["state"]:
            torch.testing.assert_close(r["state"][key], r["ref_state"][key], rtol=1e-5, atol=0)
        linear_rows = [s for s in r["sites"] if s[0] != "norm"]
        tp_rows, ref_rows = linear_rows[:len(linear_rows) // 2], linear_rows[len(linear_rows) // 2:]
        # the one-process model runs on both ranks alike; only DelayedScaling reduces its amaxes there
        assert all((c != "") == (recipe == "DelayedScaling") for *_, c in ref_rows)
        texts = {fqn: c for fqn, _, c in tp_rows}
        if recipe in ("Float8CurrentScaling", "NVFP4BlockScaling"):
            assert texts == {"up": "amax all-reduce over tp (2 ranks): weight, grad_output",
                             "down": "amax all-reduce over tp (2 ranks): input, weight"}
        elif recipe == "MXFP8BlockScaling":
            assert set(texts.values()) == {"none needed: per-block scales"}
        else:
            assert set(texts.values()) == {"amax history all-reduce over tp (2 ranks), one per graph and step"}


def test_tp_collectives_are_graph_nodes(tp_results):
    for rank in tp_results:
        cs = rank["compiled"][("Float8CurrentScaling", "1d", False)]
        # tp graph: up (w) + down (x, w packed) in forward, up's grad_output in backward; ref graph: none
        assert cs["fwd"] == [2, 0] and cs["bwd"] == [1, 0]
        ds = rank["compiled"][("DelayedScaling", "1d", False)]
        # delayed: nothing in forward; one all_reduce for both weights' amaxes in backward, in the tp
        # graph and in the one-process graph (it runs on both ranks, so its amax group is the world)
        assert ds["fwd"] == [0, 0] and ds["bwd"] == [1, 1]
        mx = rank["compiled"][("MXFP8BlockScaling", "1d", False)]
        assert mx["fwd"] == [0, 0] and mx["bwd"] == [0, 0]


def _inductor_worker(rank: int) -> dict:
    """Tensor parallel under inductor: the collectives survive code generation."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    out = {}
    for recipe in ("Float8CurrentScaling", "DelayedScaling"):
        torch._dynamo.reset()
        torch.manual_seed(1)
        base = MLP()
        ref_model = MLP()
        ref_model.load_state_dict(base.state_dict())
        tp = torch.compile(_tp_model(mesh, base), backend="te", options={"recipe": recipe})
        ref = torch.compile(ref_model, backend="te", options={"recipe": recipe, "compiler": "aot_eager"})
        xs = torch.randn(2, 8, 32)
        y = _full(tp(xs))
        runs = _funcol_all_reduces(lambda: y.pow(2).sum().backward())
        y_ref = ref(xs)
        y_ref.pow(2).sum().backward()
        grads = {n: (_full(p.grad), dict(ref_model.named_parameters())[n].grad)
                 for n, p in tp._orig_mod.named_parameters()}
        out[recipe] = dict(y=y.detach(), y_ref=y_ref.detach(), grads=grads, backward_runs=runs)
    return out


@pytest.mark.slow
def test_tp_under_inductor(world):
    for r in (rank["inductor"] for rank in world):
        for recipe, res in r.items():
            torch.testing.assert_close(res["y"], res["y_ref"], rtol=1e-5, atol=1e-4)
            for name, (g, g_ref) in res["grads"].items():
                torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-3, msg=lambda m: f"{recipe} {name}: {m}")
        # backward: DTensor's own sum of x's partial gradient (column parallel), plus ours: current
        # scaling reduces up's grad_output amax, delayed scaling runs its one update
        assert r["Float8CurrentScaling"]["backward_runs"] == 2, r["Float8CurrentScaling"]["backward_runs"]
        assert r["DelayedScaling"]["backward_runs"] == 2, r["DelayedScaling"]["backward_runs"]


# ---------------------------------------------------------------------------------------------
# Vocab-parallel output layer and loss (ColwiseParallel output layer, loss_parallel)


class TinyLM(nn.Module):
    """torchtitan's output stage: embedding, RMSNorm, output linear, with the loss in the compiled step.
    ``shift``: the causal shift inside the loss; ``logits``: the logits are returned too."""

    def __init__(self, vocab: int, bias: bool = False, smoothing: float = 0.0, shift: bool = True,
                 logits: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, 32)
        self.norm = nn.RMSNorm(32)
        self.output = nn.Linear(32, vocab, bias=bias)
        self.smoothing, self.shift, self.logits = smoothing, shift, logits

    def forward(self, ids, labels):
        logits = self.output(self.norm(self.tok(ids)))
        z, y = (logits[:, :-1], labels[:, 1:]) if self.shift else (logits, labels)
        loss = F.cross_entropy(z.flatten(0, 1).float(), y.flatten(0, 1), label_smoothing=self.smoothing)
        return (loss, logits) if self.logits else loss


# name: (recipe, vocab, TinyLM arguments, torchtitan's sequence-parallel plan); 101 classes split 51 / 50
VOCAB_CASES = {
    "hp": ("none", 101, dict(bias=True, shift=False, logits=True), False),
    "current": ("Float8CurrentScaling", 128, dict(), True),
    "delayed": ("DelayedScaling", 128, dict(bias=True), False),
}
_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def _collectives(gm) -> list[tuple[str, str, int]]:
    """(op, reduce op or "", elements) of each collective node of an AOT graph."""
    out = []
    for n in gm.graph.nodes:
        name = getattr(n.target, "_opname", "")
        if n.op == "call_function" and "_c10d_functional" in str(n.target) and name in _COLLECTIVES:
            out.append((name, n.args[1] if name == "all_reduce" else "", n.meta["val"].numel()))
    return out


def _vocab_worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel,
                                                   parallelize_module)

    from utils import AotGraphs

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    graphs = AotGraphs().install(_Patch())
    out = {}
    for name, (recipe, vocab, kwargs, sp) in VOCAB_CASES.items():
        torch._dynamo.reset()
        te_compile.reset()
        graphs.forward.clear()
        graphs.backward.clear()
        torch.manual_seed(3)
        base = TinyLM(vocab, **kwargs)
        ref_model = TinyLM(vocab, **kwargs)
        ref_model.load_state_dict(base.state_dict())
        plan = {"output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        if sp:   # torchtitan's: the embedding's output and the norm split by sequence, gathered for the output
            plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                    "norm": SequenceParallel(),
                    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
        parallelize_module(base, mesh, plan)
        options = {"recipe": recipe, "compiler": "aot_eager",
                   **({"amax_history_len": 4} if recipe == "DelayedScaling" else {})}
        tp, ref = (torch.compile(m, backend="te", options=options) for m in (base, ref_model))
        steps = []
        for step in range(2):
            g = torch.Generator().manual_seed(20 + step)
            ids, labels = torch.randint(0, vocab, (2, 8), generator=g), torch.randint(0, vocab, (2, 8), generator=g)
            labels[0, 2:4] = -100
            with loss_parallel():
                res = tp(ids, labels)
                loss = res[0] if kwargs.get("logits") else res
                loss.backward()
            if step == 0:
                sites = [(s.op, s.rewritten, s.reason, s.collectives) for s in te_compile.report().sites
                         if s.op == "linear_cross_entropy"]
            ref_res = ref(ids, labels)
            ref_loss = ref_res[0] if kwargs.get("logits") else ref_res
            ref_loss.backward()
            steps.append(dict(loss=loss.full_tensor().detach(), ref_loss=ref_loss.detach(),
                              logits=res[1].full_tensor().detach() if kwargs.get("logits") else None,
                              ref_logits=ref_res[1].detach() if kwargs.get("logits") else None,
                              loss_type=type(loss).__name__))
        params = dict(ref_model.named_parameters())
        grads = {n: (_full(p.grad), params[n].grad) for n, p in base.named_parameters()}
        out[name] = dict(steps=steps, grads=grads, sites=sites, vocab=vocab,
                         forward=[_collectives(g) for g in graphs.forward],
                         backward=[_collectives(g) for g in graphs.backward],
                         state=_state(base) if recipe == "DelayedScaling" else {},
                         ref_state=_state(ref_model) if recipe == "DelayedScaling" else {})
    # loss_parallel refuses label smoothing at trace time, so the eager lowering covers it (and a
    # soft-cap): one process's op on the whole weight against the two ranks' on its shards
    from torch.distributed.tensor import DTensor

    from te_compile.lowerings.linear_cross_entropy import LinearCrossEntropyLowering, LinearCrossEntropySpec
    from te_compile.recipe import Float8CurrentScaling

    spec = LinearCrossEntropySpec("output", Float8CurrentScaling(), (("cast", torch.float32), ("softcap", 3.0)),
                                  label_smoothing=0.1, chunk=8)
    op = LinearCrossEntropyLowering(spec)
    torch.manual_seed(4)
    x, w, labels = torch.randn(16, 32), torch.randn(64, 32), torch.randint(0, 64, (16,))
    labels[3] = -100
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref_loss = op(xs, ws, None, labels)[0]
    ref_loss.backward()
    xd = DTensor.from_local(x.clone(), mesh, [Replicate()]).requires_grad_()
    wd = nn.Parameter(DTensor.from_local(w.chunk(WORLD, 0)[rank].clone(), mesh, [Shard(0)]))
    loss = op(xd, wd, None, labels)[0]
    loss.backward()
    out["eager"] = dict(loss=loss.full_tensor().detach(), ref_loss=ref_loss.detach(),
                        grads=[(_full(xd.grad), xs.grad), (_full(wd.grad), ws.grad)])
    return out


@pytest.fixture(scope="module")
def vocab_results(world):
    return [r["vocab"] for r in world]


def test_vocab_parallel_loss_is_fused(vocab_results):
    for rank, r in enumerate(vocab_results):
        for name, res in ((k, v) for k, v in r.items() if k in VOCAB_CASES):
            [(op, rewritten, reason, collectives)] = res["sites"]
            assert rewritten, (name, reason)
            full = -(-res["vocab"] // WORLD)   # 101 classes: 51 on rank 0, 50 on rank 1
            assert f"[tokens, {min(full, res['vocab'] - rank * full)}] logits per rank" in reason, reason
            assert "all-reduce over tp (2 ranks): per token max (MAX), sum-exp and target logit (SUM)" in collectives
            assert ("weight amax" in collectives) == (name == "current"), collectives


@pytest.mark.parametrize("name", list(VOCAB_CASES))
def test_vocab_parallel_matches_one_process(vocab_results, name):
    """Loss, logits and gradients of the 2-rank vocab-parallel step against one process's fused op."""
    for r in vocab_results:
        res = r[name]
        for step in res["steps"]:
            assert step["loss_type"] == "DTensor"   # loss_parallel's Replicate loss, as unfused
            torch.testing.assert_close(step["loss"], step["ref_loss"], rtol=1e-5, atol=0)
            if step["logits"] is not None:
                torch.testing.assert_close(step["logits"], step["ref_logits"], rtol=1e-5, atol=1e-6)
        for param, (g, g_ref) in res["grads"].items():
            # fp32 summation order only (FP8: the same bytes and scales on the shards as in one process)
            assert sqnr(g_ref, g) >= 60, (name, param, sqnr(g_ref, g))
        for key, value in res["ref_state"].items():
            torch.testing.assert_close(res["state"][key], value, rtol=1e-6, atol=0, msg=lambda m: f"{key}: {m}")


def test_vocab_parallel_label_smoothing_and_softcap(vocab_results):
    for r in vocab_results:
        res = r["eager"]
        torch.testing.assert_close(res["loss"], res["ref_loss"], rtol=1e-5, atol=0)
        for g, g_ref in res["grads"]:
            assert sqnr(g_ref, g) >= 60, sqnr(g_ref, g)


def test_vocab_parallel_never_communicates_logits(vocab_results):
    """Forward: one MAX and one SUM all-reduce of per-token values (and current scaling's weight amax);
    backward: only x's partial gradient [tokens, hidden], summed by DTensor, and the amax update's.
    Nothing as large as a rank's [tokens, V / 2] logits crosses ranks either way."""
    for r in vocab_results:
        for name, res in ((k, v) for k, v in r.items() if k in VOCAB_CASES):
            tokens = 16 if name == "hp" else 14
            local_logits = tokens * -(-res["vocab"] // WORLD)
            forward, backward = res["forward"][0], res["backward"][0]   # the 2-rank model's (compiled first)
            sums = [c for c in forward if c[1] == "sum"]
            maxes = [c for c in forward if c[1] == "max"]
            # sequence parallel: the embedding's reduce-scatter and the norm output's all-gather, [tokens, hidden]
            others = sorted(c[0] for c in forward if c[0] != "all_reduce")
            sp = VOCAB_CASES[name][3]
            assert others == (["all_gather_into_tensor", "reduce_scatter_tensor"] if sp else []), forward
            assert len(sums) == 1 and sums[0][2] == 2 * tokens, forward
            assert sorted(c[2] for c in maxes) == ([1, tokens] if name == "current" else [tokens]), forward
            for op, _, numel in [*forward, *backward]:
                assert numel < local_logits, (name, op, numel, local_logits)


# ---------------------------------------------------------------------------------------------
# Context-parallel FP8 attention (the op; not routed from SDPA sites yet)


def _cp_worker(rank: int) -> dict:
    """Causal attention over a 32-token sequence split load-balanced over 2 ranks (rank 0: positions
    0-7 and 24-31), GQA (4 query heads, 2 key/value heads), against one process's FP8 attention."""
    from torch.distributed.device_mesh import init_device_mesh

    import te_compile.lowerings.context_parallel_attention as cpa
    from te_compile.distributed import mesh_dim_group
    from te_compile.lowerings.attention import AttentionSpec, Fp8AttentionFunction
    from te_compile.recipe import Float8CurrentScaling

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    group = mesh_dim_group(mesh, 0)
    gathered, real = [], cpa._gather_seq

    def counting(x, g):
        gathered.append((str(x.dtype), x.numel() * x.element_size()))
        return real(x, g)

    gen = torch.Generator().manual_seed(0)
    b, h, hkv, t, d = 2, 4, 2, 32, 16
    q = torch.randn(b, h, t, d, generator=gen)
    k, v = (torch.randn(b, hkv, t, d, generator=gen) for _ in range(2))
    do = torch.randn(b, h, t, d, generator=gen)
    pos = te_compile.load_balanced_positions(t, rank, WORLD)
    out = {"pos": pos, "kv_bf16_bytes": 2 * b * hkv * len(pos) * d * 2, "model": _cp_model_worker(rank)}
    # the public split and its inverse, on a token batch [B, T] and FP8 bytes along dim 2 of [B, H, T, D]
    ids, fp8 = torch.randint(0, 100, (2, t), generator=gen), q.to(torch.float8_e4m3fn)
    shards = te_compile.context_parallel_shard(mesh, [ids, fp8], seq_dims=[1, -2])
    out["split"] = {"shards": shards, "expected": [ids[:, pos], fp8[:, :, pos]],
                    "back": te_compile.context_parallel_unshard(mesh["cp"], shards, seq_dims=[-1, 2]),
                    "full": [ids, fp8]}
    try:
        te_compile.context_parallel_shard(mesh, [ids[:, :30]], seq_dims=[1])
    except ValueError as e:
        out["split"]["error"] = str(e)
    for fp8_backward in (False, True):
        cpa._gather_seq = counting
        try:
            local = [x[:, :, pos].clone().requires_grad_() for x in (q, k, v)]
            o = cpa.ContextParallelAttention.apply(*local, pos, group, True, d ** -0.5,
                                                   torch.float8_e5m2 if fp8_backward else None)
            o.backward(do[:, :, pos])
        finally:
            cpa._gather_seq = real
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        spec = AttentionSpec("attn", Float8CurrentScaling(), d ** -0.5, True, fp8_backward)
        ref = Fp8AttentionFunction.apply(*full, None, spec, None, None, None, None, None)
        ref.backward(do)
        out[fp8_backward] = {"o": (o.detach(), ref.detach()[:, :, pos]),
                             "grads": [(x.grad, f.grad[:, :, pos]) for x, f in zip(local, full)],
                             "gathered": list(gathered)}
        gathered.clear()
    return out


class CpGPT(nn.Module):
    """A one-block GPT that takes its tokens' global positions (context parallelism keeps them global)."""

    def __init__(self, vocab: int = 64, d: int = 32, block: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.ln, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, positions):   # idx [B, t], positions [t]
        x = self.tok(idx) + self.pos(positions)
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in self.qkv(self.ln(x)).split(d, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        x = x + self.out(F.gelu(self.fc(x)))
        return self.head(self.ln_f(x))


def _cp_model_worker(rank: int) -> dict:
    """CpGPT trained 3 steps with the sequence split over 2 context-parallel ranks (gradients summed
    over them by hand), against one process on the whole sequence; and the error for a site that
    cannot run context-parallel."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    losses, sites, states, first_logits = {}, {}, {}, {}
    # DelayedScaling: the "fp8" backward, and the amax group left to one rank, so that only the
    # context-parallel reduction te adds for the attention makes its state one process's
    delayed = {"recipe": "DelayedScaling", "recipe_options": {"fp8_dpa_backward": "fp8"}, "amax_group": "none"}
    for mode in ("cp", "one", "cp delayed", "one delayed"):
        torch._dynamo.reset()
        te_compile.reset()
        torch.manual_seed(0)
        model = CpGPT()
        options = {"recipe": "Float8CurrentScaling", "compiler": "aot_eager", "rewrite": {"sdpa": True}}
        if mode.endswith("delayed"):
            options.update(delayed)
        if mode.startswith("cp"):
            options.update(distributed={"context_parallel": "cp"}, mesh=mesh)
        compiled = torch.compile(model, backend="te", options=options)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[mode] = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            idx, target = torch.randint(0, 64, (2, 32), generator=gen), torch.randint(0, 64, (2, 32), generator=gen)
            pos = torch.arange(32)
            if mode.startswith("cp"):   # this rank's rows, their global positions kept
                idx, target, pos = te_compile.context_parallel_shard(mesh, [idx, target, pos], seq_dims=[1, 1, 0])
            logits = compiled(idx, pos)
            if step == 0:
                first_logits[mode] = (te_compile.context_parallel_unshard(mesh, [logits], seq_dims=[1])[0]
                                      if mode.startswith("cp") else logits.detach())
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
            total = loss.detach().clone()
            if mode.startswith("cp"):   # equal token counts: the global mean is the mean of the ranks' means
                (loss / WORLD).backward()   # so dO is one process's too
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                dist.all_reduce(total)
                total /= WORLD
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses[mode].append(total.item())
        sites[mode] = [(r.rewritten, r.reason, r.collectives) for r in te_compile.report().sites if r.op == "sdpa"]
        states[mode] = {k: v for k, v in te_compile.recipe_state_dict(model).items() if "sdpa" in k}
    torch._dynamo.reset()

    def masked(x, mask):
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)

    try:
        torch.compile(masked, backend="te", options={"recipe": "Float8CurrentScaling", "compiler": "aot_eager",
                                                     "distributed": {"context_parallel": "cp"}, "mesh": mesh})(
            torch.randn(1, 2, 8, 16), torch.ones(8, 8, dtype=torch.bool))
        error = ""
    except Exception as e:   # Dynamo wraps the backend's ConfigError
        error = str(e)
    torch._dynamo.reset()
    try:
        torch.compile(lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True), backend="te", options={
            "recipe": "Float8CurrentScaling", "compiler": "aot_eager", "distributed": {"context_parallel": "sp"},
            "mesh": mesh})(torch.randn(1, 2, 8, 16))
        unknown = ""
    except Exception as e:
        unknown = str(e)
    return {"losses": losses, "sites": sites, "states": states, "error": error, "unknown_dim": unknown,
            "first_logits": first_logits}


@pytest.fixture(scope="module")
def cp_results(world):
    return [r["cp"] for r in world]


@pytest.mark.parametrize("fp8_backward", [False, True], ids=["high_precision", "fp8"])
def test_context_parallel_fp8_attention_matches_one_process(cp_results, fp8_backward):
    """Every rank scales Q, K, V (and O; dO in the "fp8" backward) with the whole sequence's per-head
    amax, so its FP8 bytes are one process's: the local output and gradients equal the unsharded FP8
    attention's to fp32 rounding."""
    covered = torch.cat([r["pos"] for r in cp_results]).sort().values
    assert torch.equal(covered, torch.arange(32))
    for r in (r[fp8_backward] for r in cp_results):
        o, ref = r["o"]
        assert sqnr(ref, o) >= 40, sqnr(ref, o)
        for (g, g_ref), name in zip(r["grads"], "qkv"):
            assert sqnr(g_ref, g) >= 40, (name, sqnr(g_ref, g))


def test_context_parallel_shard_and_unshard(cp_results):
    """te_compile.context_parallel_shard gives each rank its load-balanced rows (rank 0: chunks 0 and 3 of
    4), along any dim and for FP8 bytes; context_parallel_unshard puts every rank's rows back in order."""
    def bits(x):   # FP8 compared as its bytes
        return (x.dtype, x.shape, x.view(torch.uint8) if x.dtype.itemsize == 1 else x)

    def same(a, b):
        return a[:2] == b[:2] and torch.equal(a[2], b[2])

    assert torch.equal(cp_results[0]["pos"], torch.cat([torch.arange(8), torch.arange(24, 32)]))
    for r in cp_results:
        split = r["split"]
        for got, want in [*zip(split["shards"], split["expected"]), *zip(split["back"], split["full"])]:
            assert same(bits(got), bits(want)), (got.shape, want.shape)
        assert split["error"] == "context_parallel_shard: buffers[0] has 30 positions along dim 1; 2 ranks need " \
                                 "a multiple of 4", split["error"]


def test_context_parallel_trains_a_gpt_as_one_process_does(cp_results):
    for r in cp_results:
        m = r["model"]
        # the first step's logits, put back together: one process's, but for the FP8 linears, which scale
        # each rank's activations on their own (two roundings apart; 29.5 dB seen)
        assert sqnr(m["first_logits"]["one"], m["first_logits"]["cp"]) >= 25, \
            sqnr(m["first_logits"]["one"], m["first_logits"]["cp"])
        cp, one = m["losses"]["cp"], m["losses"]["one"]
        # the attention's bytes are one process's; the linears scale each rank's activations alone
        assert cp == pytest.approx(one, rel=2e-3), (cp, one)
        [(rewritten, reason, collectives)] = m["sites"]["cp"]
        assert rewritten and reason.startswith("context parallel over cp (2 ranks)"), reason
        assert "all-gather over cp (2 ranks): K, V in FP8" in collectives
        assert "distributed.context_parallel = 'cp', but the SDPA call in <root> cannot run context-parallel: " \
               "an attn_mask" in m["error"], m["error"]
        assert "distributed.context_parallel: the mesh has no dim 'sp'; its dims are ['cp']" in m["unknown_dim"], \
            m["unknown_dim"]


def test_context_parallel_under_delayed_scaling(cp_results):
    """DelayedScaling ("fp8" backward): Q, K, V, dO per tensor with the state's scales, the attention's
    amaxes reduced over the context-parallel ranks (here the only reduction: amax_group = "none"), so
    every rank's histories are one process's: the first step's entries exactly, the later ones as
    close as the runs (each rank's linears keep their own scales under "none"); training follows one
    process's."""
    for r in cp_results:
        m = r["model"]
        cp, one = m["losses"]["cp delayed"], m["losses"]["one delayed"]
        assert cp == pytest.approx(one, rel=2e-3), (cp, one)
        [(rewritten, reason, collectives)] = m["sites"]["cp delayed"]
        assert rewritten and "Q, K, V, dO per tensor with delayed scaling" in reason, reason
        assert "amax history all-reduce over cp (2 ranks)" in collectives, collectives
        states, ref = m["states"]["cp delayed"], m["states"]["one delayed"]
        assert states.keys() == ref.keys() and any(k.endswith("amax_history") for k in states), states.keys()
        histories = [k for k in ref if k.endswith("amax_history")]
        assert len(histories) == 4, histories   # q, k, v, dO
        for key in histories:   # [history len, 1], the newest first: 3 steps
            assert ref[key][:3].gt(0).all(), key
            torch.testing.assert_close(states[key][2], ref[key][2], rtol=1e-6, atol=0, msg=key)
            torch.testing.assert_close(states[key], ref[key], rtol=5e-2, atol=0, msg=key)   # seen: 4%


def test_context_parallel_exchanges_k_and_v_in_fp8(cp_results):
    for r in cp_results:
        gathered = r[False]["gathered"]
        kv = [(dtype, n) for dtype, n in gathered if dtype == "torch.uint8"]
        assert len(kv) == 2 and all(dtype != "torch.bfloat16" for dtype, _ in gathered), gathered
        assert sum(n for _, n in kv) / r["kv_bf16_bytes"] == 0.5   # K and V bytes against bf16's


# ---------------------------------------------------------------------------------------------
# Plain tensors sharded by hand, and errors


class HandShardedMLP(nn.Module):
    """Column- then row-parallel written by hand: each rank holds its slice as a plain parameter."""

    def __init__(self, full: MLP, rank: int) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64 // WORLD)
        self.down = nn.Linear(64 // WORLD, 32, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(full.up.weight.chunk(WORLD, 0)[rank])
            self.up.bias.copy_(full.up.bias.chunk(WORLD, 0)[rank])
            self.down.weight.copy_(full.down.weight.chunk(WORLD, 1)[rank])
        self.bias = nn.Parameter(full.down.bias.detach().clone())

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        partial = self.down(torch.relu(self.up(x)))
        return funcol.all_reduce(partial, "sum", dist.group.WORLD) + self.bias


def _hand_worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    torch.manual_seed(0)
    full = MLP()
    x = torch.randn(4, 8, 32)
    results = {}
    for sharded in ([], ["up", "down"]):
        te_compile.reset()
        model = torch.compile(HandShardedMLP(full, rank), backend="te",
                              options={"recipe": "Float8CurrentScaling", "compiler": "aot_eager",
                                       "distributed": {"sharded_modules": sharded}})
        results[bool(sharded)] = (model(x).detach(), [(s.fqn, s.collectives) for s in te_compile.report().sites
                                                     if s.op == "linear"])
    ref = torch.compile(MLP(), backend="te", options={"recipe": "Float8CurrentScaling", "compiler": "aot_eager"})
    ref._orig_mod.load_state_dict(full.state_dict())
    out["results"], out["ref"] = results, ref(x).detach()

    # errors at compile: a group this rank is not in, a mesh with a pipeline dim
    errors = {}
    other = dist.new_group([1 - rank])
    mesh_2d = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("pp", "dp"))
    for name, group in (("not a member", other), ("pipeline mesh", mesh_2d)):
        torch._dynamo.reset()
        try:
            torch.compile(MLP(), backend="te", options={"compiler": "aot_eager", "amax_group": group})(x)
            errors[name] = None
        except ConfigError as e:
            errors[name] = str(e)
    # a linear whose operands live on different meshes, or mix DTensor and plain tensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from te_compile.lowerings.sharded_linear import plan_linear_sharding

    mesh_a = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    mesh_b = DeviceMesh("cpu", torch.arange(WORLD).flip(0), mesh_dim_names=("tp",))
    x_a = DTensor.from_local(torch.randn(4, 32), mesh_a, [Replicate()])
    w_b = DTensor.from_local(torch.randn(8, 32), mesh_b, [Shard(0)])
    for name, (xx, ww) in (("mesh mismatch", (x_a, w_b)), ("mixed", (x_a, torch.randn(8, 32)))):
        try:
            plan_linear_sharding(xx, ww, "blocks.0.up")
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def hand_results(world):
    return [r["hand"] for r in world]


def test_hand_sharded_modules_reduce_amaxes(hand_results):
    for r in hand_results:
        y_local, rows_local = r["results"][False]
        y_sharded, rows = r["results"][True]
        # with the reduction each shard uses the whole tensor's scale: equal to one process up to the
        # order of the partial sums; without it, the shards' own scales give other bytes
        torch.testing.assert_close(y_sharded, r["ref"], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(y_local, r["ref"], rtol=1e-5, atol=1e-5)
        assert dict(rows) == {"up": "amax all-reduce over world (2 ranks): input, weight, grad_output",
                              "down": "amax all-reduce over world (2 ranks): input, weight, grad_output"}
        assert all(c == "" for _, c in rows_local)


def test_amax_group_errors_at_compile(hand_results):
    for rank, r in enumerate(hand_results):
        assert "is not a member" in r["errors"]["not a member"] and f"global rank {rank}" in r["errors"]["not a member"]
        assert r["errors"]["pipeline mesh"].startswith("options: distributed.amax_group: the mesh's dim 'pp' is a "
                                                       "pipeline dim"), r["errors"]["pipeline mesh"]
        assert r["errors"]["mesh mismatch"].startswith("blocks.0.up: the input lives on mesh")
        assert "DTensor cannot mix them" in r["errors"]["mixed"]


# ---------------------------------------------------------------------------------------------
# One process: config and group arithmetic


def test_distributed_config_from_toml_tables():
    cfg = config_from_dict({"distributed": {"amax_group": "none", "sharded_modules": ["layers.*.mlp.*"]}}, "f.toml")
    assert cfg.distributed == DistributedConfig("none", ("layers.*.mlp.*",))
    assert cfg.distributed.sharded("layers.3.mlp.up") and not cfg.distributed.sharded("lm_head")
    assert config_from_dict({"amax_group": "none"}, "options").distributed.amax_group == "none"
    assert config_from_dict({}, "f").distributed == DistributedConfig()
    dims = config_from_dict({"distributed": {"amax_group": ["dp_replicate", "dp_shard"], "pipeline_dims": ["stage"]}}, "f")
    assert dims.distributed.amax_group == ("dp_replicate", "dp_shard")
    assert dims.distributed.pipeline_dims == ("stage",) and DistributedConfig().amax_group == "auto"


@pytest.mark.parametrize("table, key, words", [
    ({"distributed": {"amax_group": "tp"}}, "distributed.amax_group", "allowed: ['auto', 'world', 'none'], a list of "
                                                                     "mesh dim names"),
    ({"distributed": {"amax_group": ["dp", "dp"]}}, "distributed.amax_group", "mesh dim names repeat in ['dp', 'dp']"),
    ({"distributed": {"amax_group": ["dp", 3]}}, "distributed.amax_group", "must be non-empty strings"),
    ({"distributed": {"pipeline_dims": "pp"}}, "distributed.pipeline_dims", "an array of mesh dim names"),
    ({"distributed": {"mesh": "dp"}}, "distributed.mesh", "expected a DeviceMesh"),
    ({"distributed": {"group": "world"}}, "distributed.group",
     "allowed keys: ['amax_group', 'expert_amax_group', 'sharded_modules', 'mesh', 'pipeline_dims', "
     "'context_parallel', 'async_tp']"),
    ({"distributed": {"context_parallel": 2}}, "distributed.context_parallel", "expected a mesh dim name, got 2"),
    ({"distributed": {"async_tp": "yes"}}, "distributed.async_tp", "expected true or false, got 'yes'"),
    ({"distributed": {"sharded_modules": "up"}}, "distributed.sharded_modules", "array of module globs"),
    ({"distributed": {"sharded_modules": ["up["]}}, "distributed.sharded_modules[0]", "without a closing"),
    ({"amax_group": 3}, "amax_group", "a ProcessGroup or a DeviceMesh, got 3 (int)"),
])
def test_distributed_config_errors_name_the_key(table, key, words):
    with pytest.raises(ConfigError) as info:
        config_from_dict(table, "fp8.toml")
    assert str(info.value).startswith(f"fp8.toml: {key}: ") and words in str(info.value)


def test_minimal_groups_drops_covered_groups():
    world = AmaxGroup("0", "world", 4, (0, 1, 2, 3))
    tp = AmaxGroup("1", "tp", 2, (0, 1))
    dp = AmaxGroup("2", "dp", 2, (0, 2))
    assert minimal_groups([tp, world, tp]) == (world,)
    assert minimal_groups([tp, dp]) == (tp, dp)
    assert minimal_groups([None, tp]) == (tp,)
    assert str(tp) == "tp (2 ranks)"
