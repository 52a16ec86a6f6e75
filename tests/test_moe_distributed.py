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
from utils import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORLD = 2
STEPS = 4
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


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """Rows ``send[r]`` to rank r, ``recv[r]`` from it, with autograd (the backward sends back)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty(sum(recv), *x.shape[1:])
    return all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)


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


def _ep_worker(rank: int, options) -> dict:
    torch.manual_seed(0)
    torch._dynamo.reset()
    te_compile.reset()
    model = ExpertParallelNet(MoENet(EP_EXPERTS, EP_HEAD), rank)
    model.moe.compile(backend="te", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replicated = [p for n, p in model.named_parameters() if not n.startswith("moe.")]
    losses = []
    for step in range(STEPS):
        loss = model(_batch(rank, step)) / WORLD
        loss.backward()
        for p in replicated:   # data parallel outside the experts
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    report = [(s.fqn, s.op, s.rewritten, s.reason) for s in te_compile.report().sites]
    return {"losses": losses, "report": report, "state": te_compile.recipe_state_dict(model)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    return run_ranks(_worker, tmp, world=WORLD)


def _worker(rank: int) -> dict:
    return {"fsdp": _fsdp_worker(rank), "ep": _ep_worker(rank, CURRENT), "ep_delayed": _ep_worker(rank, EP_DELAYED),
            "ep_delayed_shared": _ep_worker(rank, DELAYED)}


def test_expert_parallel_rewrites_each_ranks_experts_and_matches_one_process(results):
    reference, _ = _ep_reference(CURRENT)
    for rank, result in enumerate(results):
        rows = [r for r in result["ep"]["report"] if r[1] == "grouped_linear"]
        assert rows and all(r[2] for r in rows), result["ep"]["report"]
        for step, (got, want) in enumerate(zip(result["ep"]["losses"], reference)):
            assert got == pytest.approx(want, rel=1e-5), f"rank {rank} step {step}: {got} vs {want}"


def test_expert_parallel_delayed_scaling_state_is_each_ranks_experts_rows(results):
    reference_losses, reference = _ep_reference(DELAYED)   # one process: nothing to reduce
    local = EP_EXPERTS // WORLD
    for rank, result in enumerate(results):
        state = result["ep_delayed"]["state"]
        assert state["moe.w1.input.amax_history"].shape == (local, 4)
        for key, value in state.items():
            want = reference[key]
            if key.startswith("moe.") and want.dim() and want.shape[0] == EP_EXPERTS:
                want = want[rank * local:(rank + 1) * local]
            torch.testing.assert_close(value, want, rtol=1e-5, atol=0, msg=lambda m: f"rank {rank}: {key}: {m}")
        assert result["ep_delayed"]["losses"] == pytest.approx(reference_losses, rel=1e-5)
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
