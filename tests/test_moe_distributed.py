"""MoE experts across ranks: FSDP2 all-gathering 3-D expert weights in FP8 with one scale per expert,
and expert parallelism (each rank owns some experts, tokens exchanged with all_to_all_single).

One spawned world of 2 CPU gloo ranks (one thread each, aot_eager) runs every check; each is compared
with one process training the same model on the same global batch (each rank's micro-batch in turn).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from utils import needs_gloo, run_ranks

pytestmark = needs_gloo

WORLD = 2
# 2 steps: the second routes other token counts per expert (the dynamic-shape graph), quantizes with
# the delayed-scaling history of the first and gathers weights AdamW moved
STEPS = 2
D, H = 32, 48
CURRENT = {"recipe": "Float8CurrentScaling", "compiler": "aot_eager"}
DELAYED = {"recipe": "DelayedScaling", "amax_history_len": 4, "compiler": "aot_eager"}


class Experts(nn.Module):
    """torchtitan's GroupedExperts: SwiGLU per expert through torch._grouped_mm in bf16, weights fp32."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, H, D) / D**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, H, D) / D**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, D, H) / H**0.5)

    def forward(self, x, counts):   # x [M, D] sorted by expert, counts [E]
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        xb = x.bfloat16()
        h = F.silu(torch._grouped_mm(xb, self.w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(xb, self.w3.bfloat16().transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


def _route(router: nn.Linear, x: torch.Tensor, experts: int):
    """Top-1: (each token's expert, its routing weight, tokens per expert)."""
    scores = router(x).softmax(-1)
    weight, chosen = scores.max(dim=-1)
    return chosen, weight, torch.bincount(chosen, minlength=experts).to(torch.int32)


class MoENet(nn.Module):
    """Router (N = experts: high precision), the experts on tokens sorted by expert, a head."""

    def __init__(self, experts: int = 3, head: int = 16) -> None:
        super().__init__()
        self.router = nn.Linear(D, experts, bias=False)
        self.moe = Experts(experts)
        self.head = nn.Linear(D, head)

    def forward(self, x):   # [T, D]
        chosen, weight, counts = _route(self.router, x, self.moe.w1.shape[0])
        order = torch.argsort(chosen, stable=True)
        out = torch.zeros_like(x).index_add(0, order, self.moe(x[order], counts) * weight[order, None])
        return self.head(x + out).square().mean()


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(24, D, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + rank)


def _reference(options, experts: int = 3, steps: int = STEPS) -> tuple[list[float], dict]:
    """One process: each step runs every rank's micro-batch (the mean of their losses)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    te_compile.reset()
    model = MoENet(experts)
    compiled = torch.compile(model, backend="te", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        total = 0.0
        for rank in range(WORLD):
            loss = compiled(_batch(rank, step))
            (loss / WORLD).backward()
            total += loss.item() / WORLD
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, te_compile.recipe_state_dict(model)


# ---- FSDP2 -------------------------------------------------------------------------------------------


def _fsdp_train(rank: int, options, fp8: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    torch._dynamo.reset()
    te_compile.reset()
    model = MoENet()
    outcome = te_compile.enable_fp8_all_gather(model, **options) if fp8 else None
    # the experts gathered in bf16, the dtype their forward casts them to: the FP8 bytes are then
    # those the one-process run quantizes (from fp32 they would be one rounding closer to the weight)
    fully_shard(model.moe, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    fully_shard(model)
    compiled = torch.compile(model, backend="te", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = compiled(_batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    report = [(s.fqn, s.op, s.rewritten, s.reason) for s in te_compile.report().sites]
    return {"losses": losses, "outcome": outcome, "report": report, "state": te_compile.recipe_state_dict(model),
            "shard_rows": {n: p.to_local().shape[0] for n, p in model.named_parameters() if n.startswith("moe.")}}


def _fsdp_worker(rank: int) -> dict:
    gathered = []

    def counting(output, input, *args, **kwargs):
        gathered.append((input.numel() * input.element_size(), input.dtype))
        return all_gather_single(output, input, *args, **kwargs)

    all_gather_single = dist.all_gather_single
    dist.all_gather_single = counting
    current = _fsdp_train(rank, CURRENT, fp8=True)
    dist.all_gather_single = all_gather_single
    current["gathered"] = gathered
    delayed = [_fsdp_train(rank, DELAYED, fp8) for fp8 in (True, False)]
    return {"current": current, "delayed": delayed}


# ---- expert parallelism ------------------------------------------------------------------------------

EP_EXPERTS = 4
# each rank's experts are its own: their amaxes must not be all-reduced with another rank's experts
EP_DELAYED = {**DELAYED, "distributed": {"expert_amax_group": "none"}}
# the head's N = 8 keeps it in high precision: only the experts are FP8, so the one-process run (whose
# head would see the whole batch's amax) compares exactly
EP_HEAD = 8


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group=None) -> torch.Tensor:
    """Rows ``send[r]`` to rank r of ``group`` (the world), ``recv[r]`` from it, with autograd (the
    backward sends back)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty(sum(recv), *x.shape[1:])
    return all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send,
                             group=group or dist.group.WORLD)


class ExpertParallelNet(nn.Module):
    """MoENet with its experts split across ranks, as torchtitan's expert parallelism does it: rank r
    owns experts [r * E / world, (r + 1) * E / world); each token goes to its expert's rank with
    all_to_all_single, through that rank's local experts, and back. The local experts are the module
    a user compiles (the exchange has data-dependent sizes, read on the host)."""

    def __init__(self, reference: MoENet, rank: int) -> None:
        super().__init__()
        local = EP_EXPERTS // WORLD
        self.router, self.head = reference.router, reference.head
        self.moe = Experts(local)
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                getattr(self.moe, name).copy_(getattr(reference.moe, name)[rank * local:(rank + 1) * local])

    def forward(self, x):
        local = self.moe.w1.shape[0]
        chosen, weight, counts = _route(self.router, x, EP_EXPERTS)
        order = torch.argsort(chosen, stable=True)
        # tokens per (source rank, local expert), from every rank
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts)
        by_source = received_counts.view(WORLD, local)
        send = counts.view(WORLD, local).sum(1).tolist()
        recv = by_source.sum(1).tolist()
        tokens = _all_to_all(x[order], send, recv)
        # arrived grouped by source rank: regroup by local expert (each expert's rows by source)
        expert_of_row = torch.arange(local).repeat(WORLD).repeat_interleave(by_source.reshape(-1))
        regroup = torch.argsort(expert_of_row, stable=True)
        y = self.moe(tokens[regroup], by_source.sum(0).to(torch.int32))
        back = _all_to_all(y[torch.argsort(regroup)], recv, send)
        out = torch.zeros_like(x).index_add(0, order, back * weight[order, None])
        return self.head(x + out).square().mean()


def _ep_reference(options) -> tuple[list[float], dict]:
    """One process with every expert, each step on the whole global batch (both ranks' tokens at
    once, as the experts see them under expert parallelism)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    te_compile.reset()
    model = MoENet(EP_EXPERTS, EP_HEAD)
    compiled = torch.compile(model, backend="te", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = compiled(torch.cat([_batch(rank, step) for rank in range(WORLD)]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, te_compile.recipe_state_dict(model)


def _train_expert_parallel(model: nn.Module, rank: int, world: int = WORLD, steps: int = STEPS) -> list:
    """``steps`` AdamW steps of an expert-parallel model on this rank's batches, the parameters outside
    the experts data parallel over ``world`` ranks (their gradients summed by hand); the global loss of
    each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replicated = [p for n, p in model.named_parameters() if not n.startswith("moe.")]
    losses = []
    for step in range(steps):
        loss = model(_batch(rank, step)) / world
        loss.backward()
        for p in replicated:
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _ep_worker(rank: int, options) -> dict:
    torch.manual_seed(0)
    torch._dynamo.reset()
    te_compile.reset()
    model = ExpertParallelNet(MoENet(EP_EXPERTS, EP_HEAD), rank)
    model.moe.compile(backend="te", options=options)
    losses = _train_expert_parallel(model, rank)
    report = [(s.fqn, s.op, s.rewritten, s.reason) for s in te_compile.report().sites]
    return {"losses": losses, "report": report, "state": te_compile.recipe_state_dict(model)}


# ---- expert parallelism with DTensor weights (torchtitan's ExpertParallel) -----------------------------


class TitanExperts(nn.Module):
    """torchtitan's GroupedExperts as its users run it under expert parallelism: the weights are
    DTensors sharded on the expert dim, and forward reads this rank's experts with ``to_local()``
    (grouped GEMMs, or with ``loop`` one matmul per local expert on its rows)."""

    def __init__(self, reference: Experts, loop: bool = False) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Parameter(getattr(reference, n).detach().clone()) for n in ("w1", "w2", "w3"))
        self.loop = loop

    def forward(self, x, counts):   # x [M, D] sorted by local expert, counts [E_local]
        from torch.distributed.tensor import DTensor

        w1, w2, w3 = ((w.to_local() if isinstance(w, DTensor) else w) for w in (self.w1, self.w2, self.w3))
        if self.loop:   # each local expert's rows; the sizes are read on the host
            outs = []
            for e, rows in enumerate(torch.split(x, counts.tolist())):
                h = F.silu(rows @ w1[e].transpose(-2, -1)) * (rows @ w3[e].transpose(-2, -1))
                outs.append(h @ w2[e].transpose(-2, -1))
            return torch.cat(outs)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        xb = x.bfloat16()
        h = F.silu(torch._grouped_mm(xb, w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(xb, w3.bfloat16().transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


class TokenExchange:
    """torchtitan's ExpertParallel style, in short: ``distribute_module`` shards every expert weight
    Shard(0) on the (1-D) mesh, sends each token to its expert's rank in the mesh before forward
    (input_fn) and back after it (output_fn)."""

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

        def partition(name, mod, mesh):
            for param_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        return distribute_module(module, mesh, partition, input_fn=self._dispatch, output_fn=self._combine)

    def _dispatch(self, mod, inputs, mesh):
        x, counts = inputs   # sorted by global expert, counts [E]
        group, ranks = mesh.get_group(), mesh.size()
        local = counts.shape[0] // ranks
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        by_source = received.view(ranks, local)
        self.send, self.recv = counts.view(ranks, local).sum(1).tolist(), by_source.sum(1).tolist()
        tokens = _all_to_all(x, self.send, self.recv, group)
        # arrived grouped by source rank: regroup by local expert (each expert's rows by source)
        expert_of_row = torch.arange(local).repeat(ranks).repeat_interleave(by_source.reshape(-1))
        self.regroup = torch.argsort(expert_of_row, stable=True)
        return tokens[self.regroup], by_source.sum(0).to(torch.int32)

    def _combine(self, mod, y, mesh):
        return _all_to_all(y[torch.argsort(self.regroup)], self.recv, self.send, mesh.get_group())


class TitanEPNet(nn.Module):
    """MoENet whose experts run under TokenExchange: the parent routes, the style exchanges."""

    def __init__(self, reference: MoENet, mesh, loop: bool = False) -> None:
        super().__init__()
        self.router, self.head = reference.router, reference.head
        self.moe = TokenExchange().apply(TitanExperts(reference.moe, loop), mesh)

    def forward(self, x):
        chosen, weight, counts = _route(self.router, x, self.router.out_features)
        order = torch.argsort(chosen, stable=True)
        out = torch.zeros_like(x).index_add(0, order, self.moe(x[order], counts) * weight[order, None])
        return self.head(x + out).square().mean()


def _titan_ep_worker(rank: int, options, loop: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    torch._dynamo.reset()
    te_compile.reset()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    model = TitanEPNet(MoENet(EP_EXPERTS, EP_HEAD), mesh, loop)
    # the experts' forward: the token exchange's hooks read sizes on the host
    model.moe.forward = torch.compile(model.moe.forward, backend="te", options=options)
    # the loop's sizes (counts.tolist()) traced, not a graph break that would cut w[e] from its parameter
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        losses = _train_expert_parallel(model, rank)
    report = [(s.fqn, s.op, s.rewritten, s.reason, s.collectives) for s in te_compile.report().sites]
    state = te_compile.recipe_state_dict(model)
    # a fresh model loads the rank's rows before it runs (its experts' state is made on load)
    fresh = TitanEPNet(MoENet(EP_EXPERTS, EP_HEAD), mesh, loop)
    te_compile.load_recipe_state_dict(fresh, state)
    return {"losses": losses, "report": report, "state": state, "reloaded": te_compile.recipe_state_dict(fresh),
            "grad_placements": [repr(p.placements) for p in model.moe.parameters()]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    return run_ranks(_worker, tmp, world=WORLD)


def _worker(rank: int) -> dict:
    return {"fsdp": _fsdp_worker(rank), "ep": _ep_worker(rank, CURRENT), "ep_delayed": _ep_worker(rank, EP_DELAYED),
            "ep_delayed_shared": _ep_worker(rank, DELAYED), "titan": _titan_ep_worker(rank, CURRENT),
            "titan_delayed": _titan_ep_worker(rank, DELAYED), "titan_loop": _titan_ep_worker(rank, CURRENT, loop=True)}


def test_expert_parallel_rewrites_each_ranks_experts_and_matches_one_process(results):
    reference, _ = _ep_reference(CURRENT)
    for rank, result in enumerate(results):
        rows = [r for r in result["ep"]["report"] if r[1] == "grouped_linear"]
        assert rows and all(r[2] for r in rows), result["ep"]["report"]
        for step, (got, want) in enumerate(zip(result["ep"]["losses"], reference)):
            assert got == pytest.approx(want, rel=1e-5), f"rank {rank} step {step}: {got} vs {want}"


def _assert_each_ranks_expert_rows(results, run: str) -> dict:
    """Each rank's DelayedScaling state equals one process's rows for that rank's experts; returns
    the one process's state."""
    reference_losses, reference = _ep_reference(DELAYED)   # one process: nothing to reduce
    local = EP_EXPERTS // WORLD
    for rank, result in enumerate(results):
        state = result[run]["state"]
        assert state["moe.w1.input.amax_history"].shape == (local, 4)
        for key, value in state.items():
            want = reference[key]
            if key.startswith("moe.") and want.dim() and want.shape[0] == EP_EXPERTS:
                want = want[rank * local:(rank + 1) * local]
            torch.testing.assert_close(value, want, rtol=1e-5, atol=0, msg=lambda m: f"rank {rank}: {key}: {m}")
        assert result[run]["losses"] == pytest.approx(reference_losses, rel=1e-5)
    return reference


def test_expert_parallel_delayed_scaling_state_is_each_ranks_experts_rows(results):
    reference = _assert_each_ranks_expert_rows(results, "ep_delayed")
    local = EP_EXPERTS // WORLD
    # left at "same" (the world), each expert's history takes the other rank's experts' amaxes too
    shared = results[0]["ep_delayed_shared"]["state"]["moe.w1.input.amax_history"]
    assert not torch.equal(shared, reference["moe.w1.input.amax_history"][:local])
    assert torch.equal(shared, results[1]["ep_delayed_shared"]["state"]["moe.w1.input.amax_history"])


def test_fsdp_gathers_expert_weights_in_fp8_with_one_scale_per_expert(results):
    current = results[0]["fsdp"]["current"]
    assert current["outcome"]["moe.w1"] == "FP8 all-gather (one scale per expert)"
    assert current["outcome"]["head"] == "FP8 all-gather" and "K and N % 16" in current["outcome"]["router"]
    # 3 experts over 2 ranks: 2 and 1 (FSDP2 pads the second shard)
    assert [r["fsdp"]["current"]["shard_rows"]["moe.w1"] for r in results] == [2, 1]
    experts = [row for row in current["report"] if row[1] == "grouped_linear"]
    assert len(experts) == 3 and all(row[2] and "weight already FP8 per expert" in row[3] for row in experts), experts
    assert {d for _, d in current["gathered"]} == {torch.uint8}
    # per step and rank: the three expert weights (2 experts a rank, one padding, one byte an
    # element) in forward and again in backward; the root once: the head's weight in FP8, its bias
    # and the router in fp32
    experts = 3 * 2 * H * D
    root = 8 * D + 8 * 4 + 2 * D * 4
    assert sum(b for b, _ in current["gathered"]) == STEPS * (2 * experts + root)
    # that is half the bytes of the experts' bf16 gather, a quarter of fp32's


def test_fsdp_expert_fp8_gather_matches_one_process(results):
    reference, _ = _reference(CURRENT)
    for rank, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["fsdp"]["current"]["losses"], reference)):
            assert got == pytest.approx(want, rel=1e-5), f"rank {rank} step {step}: {got} vs {want}"


def test_fsdp_expert_fp8_gather_under_delayed_scaling_equals_the_high_precision_gather(results):
    for result in results:
        fp8, high = result["fsdp"]["delayed"]
        assert fp8["outcome"]["moe.w2"] == "FP8 all-gather (one scale per expert)"
        assert fp8["losses"] == high["losses"] and len(set(fp8["losses"])) == STEPS
        for key, value in fp8["state"].items():
            assert torch.equal(value, high["state"][key]), key
        assert fp8["state"]["moe.w1.weight.amax_history"].shape == (3, 4)
    assert all(torch.equal(results[0]["fsdp"]["delayed"][0]["state"][k], v)
               for k, v in results[1]["fsdp"]["delayed"][0]["state"].items()), "ranks disagree on the state"


def test_dtensor_expert_parallel_rewrites_each_ranks_experts_and_matches_one_process(results):
    reference, _ = _ep_reference(CURRENT)
    for rank, result in enumerate(results):
        rows = [r for r in result["titan"]["report"] if r[1] == "grouped_linear"]
        # every graph compiled (the first step's shapes, then dynamic ones) rewrites all three
        assert rows and len(rows) % 3 == 0 and all(r[2] for r in rows), result["titan"]["report"]
        assert all("this rank's shard of the DTensor moe.w" in r[3] and "Shard(dim=0) on ep (2 ranks)" in r[3]
                   for r in rows), rows
        assert result["titan"]["grad_placements"] == ["(Shard(dim=0),)"] * 3
        assert result["titan"]["losses"] == pytest.approx(reference, rel=1e-5), f"rank {rank}"


def test_dtensor_expert_parallel_delayed_scaling_keeps_local_experts_apart_unconfigured(results):
    # the DTensor's placements say the ranks hold different experts: no expert_amax_group needed
    _assert_each_ranks_expert_rows(results, "titan_delayed")
    rows = [r for r in results[0]["titan_delayed"]["report"] if r[1] == "grouped_linear"]
    assert rows and all(r[2] and r[4] == "" for r in rows), rows   # no collective for the experts
    for result in results:   # each rank saves and loads its own experts' rows
        saved, reloaded = result["titan_delayed"]["state"], result["titan_delayed"]["reloaded"]
        assert saved.keys() == reloaded.keys() and all(torch.equal(v, reloaded[k]) for k, v in saved.items())


def _loop_reference() -> list[float]:
    """One process: every expert in the per-expert loop, each step on the whole global batch."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    te_compile.reset()
    model = MoENet(EP_EXPERTS, EP_HEAD)
    model.moe = TitanExperts(model.moe, loop=True)
    compiled = torch.compile(model, backend="te", options=CURRENT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for step in range(STEPS):
            loss = compiled(torch.cat([_batch(rank, step) for rank in range(WORLD)]))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def test_dtensor_expert_parallel_per_expert_loop_is_rewritten_and_matches_one_process(results):
    reference = _loop_reference()
    for rank, result in enumerate(results):
        rows = [r for r in result["titan_loop"]["report"] if r[1] == "grouped_linear"]
        assert all(r[2] and "a per-expert loop" in r[3] and "DTensor" in r[3] for r in rows), rows
        # 2 local experts x 3 weights
        assert {r[3].split(" (a per-expert loop")[0] for r in rows} == {
            f"matmul on expert {e} of moe.{w}" for e in range(EP_EXPERTS // WORLD) for w in ("w1", "w2", "w3")}
        assert result["titan_loop"]["losses"] == pytest.approx(reference, rel=1e-5), f"rank {rank}"
