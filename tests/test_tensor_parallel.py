"""Tensor and sequence parallel: amax reductions over the tp ranks for DTensor shards (parallelize_module
plans, async TP's own FP8 collectives, inductor), and for plain tensors sharded by hand.

The multi-process tests share one world of 2 gloo ranks (``utils.run_ranks``), compiled with
aot_eager so that a compile costs seconds, and with inductor for the case about its code generation.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import te_compile
from te_compile.config import ConfigError
from utils import (DistMLP, RankPatch, full_tensor, funcol_all_reduces, max_all_reduces, recipe_state,
                   needs_gloo, run_ranks)

pytestmark = needs_gloo

WORLD = 2


def _world(rank: int) -> dict:
    """Every multi-process case of this file in one spawned world (a spawn costs seconds of imports
    per rank). Inductor first: the others install AotGraphs, which replaces the final compiler."""
    out = {}
    for key, worker in (("inductor", _inductor_worker), ("async_tp", _async_tp_worker), ("tp", _tp_worker), ("hand", _hand_worker)):
        torch._dynamo.reset()
        te_compile.reset()
        out[key] = worker(rank)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_ranks(_world, tmp_path_factory.mktemp("tensor_parallel"))


# ---------------------------------------------------------------------------------------------
# Tensor and sequence parallel


def _record_gemms():
    """Record the operands of every FP8 GEMM the per-tensor lowering runs (eager)."""
    import te_compile.gemm.per_tensor as fp8_linear

    calls = []
    real = fp8_linear.fp8_gemm

    def recording(a, b, a_scale_inv, b_scale_inv, out_dtype, **options):
        calls.append((a.view(torch.uint8).clone(), b.view(torch.uint8).clone(), a_scale_inv.clone(),
                      b_scale_inv.clone()))
        return real(a, b, a_scale_inv, b_scale_inv, out_dtype=out_dtype, **options)

    fp8_linear.fp8_gemm = recording
    return calls, lambda: setattr(fp8_linear, "fp8_gemm", real)


def _tp_model(mesh, recipe_model: DistMLP, sequence_parallel: bool = False) -> DistMLP:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    model = DistMLP(norm=sequence_parallel)
    model.load_state_dict(recipe_model.state_dict())
    if sequence_parallel:
        plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return parallelize_module(model, mesh, plan)


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
        out["grads"] = [full_tensor(t.grad) for t in (xd, wd_up, wd_down)]
        out["ref_grads"] = [t.grad for t in (xr, w_up, w_down)]
    finally:
        restore()

    # 2. Compiled, 1-D mesh and a 2-D (dp=1, tp=2) mesh, several recipes: matches one process.
    from utils import AotGraphs

    graphs = AotGraphs().install(RankPatch())
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
        base = DistMLP(norm=sp)
        tp_mesh = mesh if mesh_kind == "1d" else mesh_2d["tp"]
        options = {"recipe": recipe_name, "compiler": "aot_eager"}
        if mesh_kind == "2d":
            options["amax_group"] = mesh_2d["dp"]   # one rank: no collective for it
        ref_model = DistMLP(norm=sp)
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
                y = full_tensor(tp(xs))
                y.pow(2).sum().backward()
            y_ref = ref(xs)
            y_ref.pow(2).sum().backward()
            results.append((y.detach(), y_ref.detach()))
        tp_model = tp._orig_mod
        grads = {n: (full_tensor(p.grad), dict(ref_model.named_parameters())[n].grad)
                 for n, p in tp_model.named_parameters()}
        # linears and the norm (the MLP's ReLU row, fused or not, is another test's subject)
        sites = [(s.fqn, s.rewritten, s.collectives) for s in te_compile.report().sites
                 if s.op in ("linear", "layer_norm")]
        fwd = [max_all_reduces(g) for g in graphs.forward]
        bwd = [max_all_reduces(g) for g in graphs.backward]
        state = recipe_state(tp_model) if recipe_name == "DelayedScaling" else {}
        ref_state = recipe_state(ref_model) if recipe_name == "DelayedScaling" else {}
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
        base = DistMLP()
        ref_model = DistMLP()
        ref_model.load_state_dict(base.state_dict())
        tp = torch.compile(_tp_model(mesh, base), backend="te", options={"recipe": recipe})
        ref = torch.compile(ref_model, backend="te", options={"recipe": recipe, "compiler": "aot_eager"})
        xs = torch.randn(2, 8, 32)
        y = full_tensor(tp(xs))
        runs = funcol_all_reduces(lambda: y.pow(2).sum().backward())
        y_ref = ref(xs)
        y_ref.pow(2).sum().backward()
        grads = {n: (full_tensor(p.grad), dict(ref_model.named_parameters())[n].grad)
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
# Plain tensors sharded by hand, and errors


class HandShardedMLP(nn.Module):
    """Column- then row-parallel written by hand: each rank holds its slice as a plain parameter."""

    def __init__(self, full: DistMLP, rank: int) -> None:
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
    full = DistMLP()
    x = torch.randn(4, 8, 32)
    results = {}
    for sharded in ([], ["up", "down"]):
        te_compile.reset()
        model = torch.compile(HandShardedMLP(full, rank), backend="te",
                              options={"recipe": "Float8CurrentScaling", "compiler": "aot_eager",
                                       "distributed": {"sharded_modules": sharded}})
        results[bool(sharded)] = (model(x).detach(), [(s.fqn, s.collectives) for s in te_compile.report().sites
                                                     if s.op == "linear"])
    ref = torch.compile(DistMLP(), backend="te", options={"recipe": "Float8CurrentScaling", "compiler": "aot_eager"})
    ref._orig_mod.load_state_dict(full.state_dict())
    out["results"], out["ref"] = results, ref(x).detach()

    # errors at compile: a group this rank is not in, a mesh with a pipeline dim
    errors = {}
    other = dist.new_group([1 - rank])
    mesh_2d = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("pp", "dp"))
    for name, group in (("not a member", other), ("pipeline mesh", mesh_2d)):
        torch._dynamo.reset()
        try:
            torch.compile(DistMLP(), backend="te", options={"compiler": "aot_eager", "amax_group": group})(x)
            errors[name] = None
        except ConfigError as e:
            errors[name] = str(e)
    # a linear whose operands live on different meshes, or mix DTensor and plain tensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from te_compile.lowerings.linear_paths.sharded import plan_linear_sharding

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
