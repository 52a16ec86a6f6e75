"""Multi-dimensional meshes: FSDP2 + tensor parallel and HSDP on 2 x 2 CPU gloo ranks.

One spawned world of 4 ranks (one thread each, aot_eager) runs every case; the test process asserts
on what the ranks saved. Each case trains a torchtitan-style model (TP plan first, then fully_shard
per block and on the root, FP8 all-gather on) for 2 steps and, on every rank, the same model in one
process on the same global batch:
- DelayedScaling: the whole global batch at once. Its scales come from amaxes reduced over all 4
  ranks, which equal one process's, so the two runs quantize alike.
- Float8CurrentScaling and MXFP8: one micro-batch per data-parallel rank (gradients accumulated),
  since each data-parallel rank scales its own activations (a scale per tensor, or MXFP8's 32-token
  blocks of the wgrad copies), as TransformerEngine and torchao do; the weights' scales are those of
  the whole weight on every rank.
Local losses are sums over the global element count and FSDP's gradient divide factor is 1, so each
rank's gradients (and DelayedScaling's grad_output amaxes) are those of the one-process run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import te_compile
from te_compile.config import ConfigError
from utils import needs_gloo, run_ranks

pytestmark = needs_gloo

WORLD = 4
# 2 steps: the second is the first to quantize with a delayed-scaling history (every delayed scale is
# 1 in the first step, so an amax reduced over too few ranks shows from the second on) and to gather
# weights the optimizer moved
STEPS = 2
D, HIDDEN = 32, 64
BATCH = (8, 4, D)   # the global batch
RECIPES = ("Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling")
LAYOUTS = ("fsdp_tp", "hsdp")
FUNCOL_ALL_REDUCE = "_c10d_functional::all_reduce"


class FeedForward(nn.Module):
    """torchtitan's layer names and layout (no biases); the TP plan makes w1 column- and w2 row-parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Output(nn.Module):
    """The output layer, a module of its own so that it compiles on its own (Dynamo does not trace a
    bare nn.Linear's compiled call: torch's own frames are skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D, bias=False)   # left whole by the TP plan: sharded on dp only

    def forward(self, x):
        return self.proj(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([FeedForward(), FeedForward()])
        self.output = Output()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def _options(recipe: str) -> dict:
    return {"recipe": recipe, "compiler": "aot_eager", **({"amax_history_len": 4} if recipe == "DelayedScaling" else {})}


def _global_batch(step: int) -> torch.Tensor:
    return torch.randn(*BATCH, generator=torch.Generator().manual_seed(step))


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).sum() / (BATCH[0] * BATCH[1] * D)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)


def _reference(recipe: str, init: dict, micro_batches: int, steps: int = STEPS) -> tuple[list, dict, list]:
    """One process: the losses of ``steps`` steps, the recipe state after STEPS of them and each
    step's gradients ({parameter name: gradient} per step)."""
    torch._dynamo.reset()
    model = Net()
    model.load_state_dict(init)
    compiled = torch.compile(model, backend="te", options={**_options(recipe), "amax_group": "none"})
    opt = _optimizer(model)
    losses, grads = [], []
    for step in range(steps):
        total = 0.0
        for x in _global_batch(step).chunk(micro_batches):
            loss = _loss(compiled(x))
            loss.backward()
            total += loss.item()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(total)
        if step == STEPS - 1:
            state = {k: v.clone() for k, v in te_compile.recipe_state_dict(model).items()}
    return losses, state, grads


def _parallel_model(layout: str, recipe: str, init: dict):
    """(model, dp group, dp rank, dp size, FP8 all-gather outcome)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = Net()
    model.load_state_dict(init)
    if layout == "fsdp":   # 4 x 1: FSDP alone, the shape a 2 x 2 checkpoint is resharded to
        mesh = fsdp_mesh = dp = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    elif layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fsdp_mesh = dp = mesh["dp_shard"]
    elif layout == "hsdp_tp":   # HSDP + TP on a 3-D mesh (4 ranks: a shard dim of one)
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fsdp_mesh = mesh["dp_replicate", "dp_shard"]
        dp = fsdp_mesh._flatten()
    else:
        mesh = fsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        dp = mesh._flatten()
    outcome = te_compile.enable_fp8_all_gather(model, **_options(recipe))
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)   # local losses are already shares of the global one
            module.set_force_sum_reduction_for_comms(True)   # gloo has no PREMUL_SUM
    # per module, as torchtitan compiles its blocks: Dynamo breaks the root's graph at FSDP2's hooks.
    # FSDP + TP: the graphs of the TP'd layers find the mesh in their DTensors ("auto" reduces over
    # dp_shard x tp), the output layer's graph has none ("auto" is the world, the same ranks); HSDP names
    # the mesh in the options, as a model without DTensors must for "auto" to follow it
    # HSDP + TP names it too: this process built other meshes before, and DTensor may hand the graph
    # an equal sub-mesh of an earlier root (torch compares meshes by their ranks)
    options = {**_options(recipe), **({"mesh": mesh} if layout in ("hsdp", "hsdp_tp") else {})}
    for module in (*model.layers, model.output):
        module.compile(backend="te", options=options)
    return model, dp.get_group(), dp.get_local_rank(), dp.size(), outcome


def _train_step(model, opt, step: int, dp_rank: int, dp_size: int, grads: list | None = None) -> torch.Tensor:
    """One step on this rank's share of the global batch; ``grads`` gets {name: gradient} (this rank's
    shards, DTensors) before the optimizer steps."""
    loss = _loss(model(_global_batch(step).chunk(dp_size)[dp_rank]))
    loss.backward()
    if grads is not None:
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    opt.step()
    opt.zero_grad()
    return loss


def _save(model, opt, checkpoint: str) -> None:
    """Model, optimizer and recipe state through torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state, "recipe": te_compile.recipe_state_dict(model)},
             checkpoint_id=checkpoint)


def _resume(checkpoint: str, recipe_keys: dict) -> float:
    """A 2 x 2 FSDP + TP checkpoint loaded into FSDP over 4 ranks (other initial weights): the loss of
    its next step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(123)
    model, dp_group, dp_rank, dp_size, _ = _parallel_model("fsdp", "DelayedScaling", Net().state_dict())
    opt = _optimizer(model)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state,
             "recipe": {k: torch.empty_like(v) for k, v in recipe_keys.items()}}   # shapes only
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    te_compile.load_recipe_state_dict(model, state["recipe"])
    loss = _train_step(model, opt, STEPS, dp_rank, dp_size).detach().clone()
    dist.all_reduce(loss, group=dp_group)
    return loss.item()


def _train(layout: str, recipe: str, init: dict, checkpoint: str = "") -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    te_compile.reset()
    model, dp_group, dp_rank, dp_size, outcome = _parallel_model(layout, recipe, init)
    opt = _optimizer(model)
    gathered = []   # (bytes this rank sends, dtype) per FSDP all-gather

    def counting(output, input, *args, **kwargs):
        gathered.append((input.numel() * input.element_size(), input.dtype))
        return all_gather_single(output, input, *args, **kwargs)

    all_gather_single = dist.all_gather_single
    dist.all_gather_single = counting
    losses, step_bytes, all_reduces, grads = [], [], None, []
    try:
        for step in range(STEPS):
            gathered.clear()

            def train_step():
                return _train_step(model, opt, step, dp_rank, dp_size, grads)

            if step == STEPS - 1:
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    loss = train_step()
                # amax buffers are 1-D; DTensor's own all-reduces (a row-parallel output, a column-
                # parallel input gradient) move [batch, seq, dim] activations
                all_reduces = sum(1 for e in prof.events() if e.name == FUNCOL_ALL_REDUCE
                                  and len(e.input_shapes[0]) == 1)
            else:
                loss = train_step()
            total = loss.detach().clone()
            dist.all_reduce(total, group=dp_group)
            losses.append(total.item())
            step_bytes.append((sum(b for b, _ in gathered), sorted({str(d) for _, d in gathered})))
            # the whole gradients, gathered after the step's collectives were counted
            grads[-1] = {n: g.full_tensor() for n, g in grads[-1].items()}
    finally:
        dist.all_gather_single = all_gather_single
    state = {k: v.clone() for k, v in te_compile.recipe_state_dict(model).items()}
    if checkpoint:
        _save(model, opt, checkpoint)
    # what one all-gather of every sharded weight moves per rank, in elements: the blocks are gathered
    # in forward and again in backward, the root's weight once (it stays unsharded until backward ends)
    layer_elems = sum(p._local_tensor.numel() for layer in model.layers for p in layer.parameters())
    root_elems = model.output.proj.weight._local_tensor.numel()
    sites = [(s.graph, s.fqn, s.op, s.rewritten, s.reason, s.collectives) for s in te_compile.report().sites]
    return dict(losses=losses, step_bytes=step_bytes, all_reduces=all_reduces, state=state, outcome=outcome,
                gather_elems=2 * layer_elems + root_elems, sites=sites,
                refreshes=model._te_fp8_all_gather.refreshes, grads=grads)


SCHEDULES = (("DelayedScaling", "GPipe"), ("Float8CurrentScaling", "1F1B"), ("DelayedScaling", "1F1B"),
             ("MXFP8BlockScaling", "1F1B"))
MICRO_BATCHES = 2


def _pipeline(recipe: str, schedule_name: str, init: dict) -> dict:
    """A (pp, dp) = 2 x 2 mesh: stage 0 is layer 0, stage 1 layer 1 and the output layer, each stage
    fully_shard on dp with FP8 all-gather and its modules compiled; 2 micro-batches per rank. The
    stages are built with static shapes (input_args and output_args), so that PipelineStage runs no
    shape-inference pass over the compiled modules."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch._dynamo.reset()
    te_compile.reset()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index, dp = mesh["pp"].get_local_rank(), mesh["dp"]
    full = Net()
    full.load_state_dict(init)
    stage = nn.Sequential(full.layers[0]) if stage_index == 0 else nn.Sequential(full.layers[1], full.output)
    options = {**_options(recipe), "mesh": mesh}
    if recipe == "DelayedScaling":   # micro-batches in flight: the state must advance at the optimizer step
        options["recipe_options"] = {"amax_history_len": 4, "update_on": "optimizer_step"}
    te_compile.enable_fp8_all_gather(stage, **options)
    fully_shard(stage, mesh=dp)
    stage.set_gradient_divide_factor(1.0)   # the losses are shares of the global one (see _parallel_model)
    stage.set_force_sum_reduction_for_comms(True)
    for module in stage:
        module.compile(backend="te", options=options)
    # the static metadata includes requires_grad: a later stage's input needs its gradient sent back
    micro = torch.empty(BATCH[0] // 2 // MICRO_BATCHES, *BATCH[1:])
    pipe_stage = PipelineStage(stage, stage_index, 2, torch.device("cpu"),
                               input_args=(micro.clone().requires_grad_(stage_index > 0),),
                               output_args=(micro.clone().requires_grad_(),), group=mesh["pp"].get_group())
    schedule = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule_name](
        pipe_stage, n_microbatches=MICRO_BATCHES, loss_fn=lambda y, _: _loss(y), scale_grads=False)
    opt = _optimizer(stage)
    losses = []
    for step in range(STEPS):
        x = _global_batch(step).chunk(2)[dp.get_local_rank()]
        if stage_index == 0:
            schedule.step(x)
            loss = torch.zeros(())
        else:
            parts = []
            schedule.step(target=torch.zeros(x.shape[0]), losses=parts)
            loss = torch.stack(parts).sum().detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss)   # stage 1's dp ranks hold the losses
        losses.append(loss.item())
    state = {k: v.clone() for k, v in te_compile.recipe_state_dict(stage).items()}
    # saved and loaded per stage: a fresh stage module takes the state back
    fresh = nn.Sequential(*(type(m)() for m in stage))
    te_compile.load_recipe_state_dict(fresh, state)
    reloaded = te_compile.recipe_state_dict(fresh)
    sites = [(s.fqn, s.rewritten, s.collectives) for s in te_compile.report().sites if s.op == "linear"]
    return dict(stage=stage_index, losses=losses, state=state, sites=sites,
                reloaded=all(torch.equal(reloaded[k], v) for k, v in state.items()) and reloaded.keys() == state.keys())


def _spmd(recipe: str, init: dict) -> dict:
    """torch 2.13's SPMD form: weights are DTensors on the whole (dp_shard, tp) mesh (Replicate on dp),
    ``fully_shard(mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))``, and the
    activations are DTensors split by rows over dp: one logical global batch, so current scaling
    reduces activation amaxes over dp as well and the run is one process on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import DataParallelMeshDims
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch._dynamo.reset()
    te_compile.reset()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = Net()
    model.load_state_dict(init)
    placements = {"w1": Shard(0), "w2": Shard(1), "proj": Replicate()}
    for module in model.modules():
        for name, tp in placements.items():
            if isinstance(getattr(module, name, None), nn.Linear):
                linear = getattr(module, name)
                linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Replicate(), tp]))
    outcome = te_compile.enable_fp8_all_gather(model, **_options(recipe))
    for module in (*model.layers, model.output, model):
        fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
        module.set_gradient_divide_factor(1.0)   # DTensor's gradients are already the global batch's
        module.set_force_sum_reduction_for_comms(True)
    for module in (*model.layers, model.output):
        module.compile(backend="te", options={**_options(recipe), "mesh": mesh})
    opt = _optimizer(model)
    losses = []
    for step in range(STEPS):
        loss = _loss(model(distribute_tensor(_global_batch(step), mesh, [Shard(0), Replicate()])))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item())
    sites = {s.fqn: s.collectives for s in te_compile.report().sites if s.op == "linear" and s.rewritten}
    return dict(losses=losses, outcome=outcome, sites=sites)


def _dp2ep(recipe: str, fp8: bool) -> dict:
    """torchtitan's dp2ep layout on a (dp_mod_ep, ep) = (2, 2) mesh: 4 experts split over ep by
    ``ExpertParallel`` (DTensor weights Shard(0), tokens exchanged within the ep group), then FSDP2 over
    each rank's 2 experts on dp_mod_ep (one expert per rank), gathered in bf16 as torchtitan does. The
    router and head are replicated, their gradients summed by hand (test_moe_distributed's loop)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from test_moe_distributed import MoENet, TitanEPNet, _train_expert_parallel

    torch._dynamo.reset()
    te_compile.reset()
    options = {"recipe": recipe, "compiler": "aot_eager",
               **({"amax_history_len": 4} if recipe == "DelayedScaling" else {})}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    torch.manual_seed(0)
    model = TitanEPNet(MoENet(4, 8), mesh["ep"])
    outcome = te_compile.enable_fp8_all_gather(model, **options) if fp8 else None
    fully_shard(model.moe, mesh=mesh["dp_mod_ep"],
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    # dynamic: the token counts per expert change every step (one graph, not a recompile on step 2)
    model.moe.forward = torch.compile(model.moe.forward, backend="te", options=options, dynamic=True)
    gathered, real = [], dist.all_gather_single

    def counting(output, input, *args, **kwargs):
        gathered.append((input.numel() * input.element_size(), str(input.dtype)))
        return real(output, input, *args, **kwargs)

    dist.all_gather_single = counting
    try:
        losses = _train_expert_parallel(model, dist.get_rank(), WORLD, STEPS)
    finally:
        dist.all_gather_single = real
    sites = [(s.rewritten, s.collectives) for s in te_compile.report().sites if s.op == "grouped_linear"]
    return dict(losses=losses, outcome=outcome, sites=sites, gathered=gathered,
                state={k: v.clone() for k, v in te_compile.recipe_state_dict(model).items()})


def _errors(rank: int) -> dict:
    """Config errors at compile on a 3-D (pp, dp, tp) mesh, what "auto" resolves to there, and a TP
    plan that cuts MXFP8's blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    x = torch.randn(2, 4, D)
    out = {}
    for name, group in (("unknown dim", ["dp", "ep"]), ("pipeline dim", ["pp", "dp"]), ("auto", "auto")):
        torch._dynamo.reset()
        te_compile.reset()
        model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
        options = {**_options("DelayedScaling"), "amax_group": group, "mesh": mesh}
        try:
            model = torch.compile(model, backend="te", options=options)
            model(x).sum().backward()
            out[name] = [s.collectives for s in te_compile.report().sites if s.op == "linear"]
        except ConfigError as e:
            out[name] = str(e)
    torch._dynamo.reset()
    te_compile.reset()
    cut = parallelize_module(nn.Sequential(nn.Linear(96, 64, bias=False)), mesh["tp"], {"0": RowwiseParallel()})
    torch.compile(cut, backend="te", options=_options("MXFP8BlockScaling"))(torch.randn(2, 32, 48))   # its K shard
    out["cut"] = [(s.rewritten, s.reason) for s in te_compile.report().sites if s.op == "linear"]
    return out


def _worker(rank: int, checkpoint: str) -> dict:
    torch.manual_seed(0)
    init = Net().state_dict()
    out = {"errors": _errors(rank)}
    for recipe in RECIPES:
        for layout in LAYOUTS:
            saving = layout == "fsdp_tp" and recipe == "DelayedScaling"
            out[(layout, recipe)] = _train(layout, recipe, init, checkpoint if saving else "")
        # one process, on rank 0 only (the others would compute the same; delayed scaling: a step
        # more, to compare with the resumed run)
        micro = {"DelayedScaling": (1,), "Float8CurrentScaling": (1, 2, 4), "MXFP8BlockScaling": (2, 4)}[recipe]
        for m in micro if rank == 0 else ():
            losses, state, grads = _reference(recipe, init, m, STEPS + (recipe == "DelayedScaling"))
            out[("reference", recipe, m)] = losses, state
            out[("reference grads", recipe, m)] = grads
    out["resumed"] = _resume(checkpoint, out[("fsdp_tp", "DelayedScaling")]["state"])
    for recipe, schedule in SCHEDULES:
        out[("pp", recipe, schedule)] = _pipeline(recipe, schedule, init)
    out[("hsdp_tp", "DelayedScaling")] = _train("hsdp_tp", "DelayedScaling", init)
    out["spmd"] = _spmd("Float8CurrentScaling", init)
    for recipe in ("Float8CurrentScaling", "DelayedScaling"):
        out[("dp2ep", recipe)] = [_dp2ep(recipe, fp8) for fp8 in (True, False)]
    return out


@pytest.fixture(scope="module")
def nd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nd")
    return run_ranks(_worker, tmp, str(tmp / "checkpoint"), world=WORLD)


def _micro_batches(layout: str, recipe: str) -> int:
    """The one-process run a layout is compared with: the whole batch (delayed scaling), else one
    micro-batch per data-parallel rank."""
    return 1 if recipe == "DelayedScaling" else (2 if layout == "fsdp_tp" else 4)


def _ref(nd, layout: str, recipe: str):
    return nd[0][("reference", recipe, _micro_batches(layout, recipe))]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_losses_match_one_process(nd, layout, recipe):
    ref_losses, _ = _ref(nd, layout, recipe)
    for rank in nd:
        got = rank[(layout, recipe)]["losses"]
        assert got == pytest.approx(ref_losses[:STEPS], rel=1e-6), (got, ref_losses)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_gradients_match_one_process_every_step(nd, layout, recipe):
    """Each step's whole gradients (FSDP's reduce-scattered shards gathered back) equal one process's
    within 1e-5 of each gradient's largest value (DelayedScaling measured <= 3e-7). Every scale is 1 in
    the first step, so a delayed-scaling amax reduced over too few ranks shows from the second step on,
    most in the first block's w1, whose gradient passes through every later site's backward (amaxes
    reduced over tp alone, amax_group = "none": step one exact, then 5e-2 to 3e-1)."""
    ref = nd[0][("reference grads", recipe, _micro_batches(layout, recipe))]
    for r, rank in enumerate(nd):
        got = rank[(layout, recipe)]["grads"]
        assert len(got) == STEPS
        for step in range(STEPS):
            assert got[step].keys() == ref[step].keys()
            for name, want in ref[step].items():
                err = ((got[step][name] - want).abs().max() / want.abs().max()).item()
                assert err <= 1e-5, f"rank {r}, step {step}, {name}: off by {err:.2e} of its largest value"


def test_checkpoint_of_a_2x2_mesh_resumes_on_4x1_with_the_same_loss(nd):
    """torch.distributed.checkpoint of model, optimizer (momentum) and recipe state from FSDP + TP on
    2 x 2, loaded into FSDP over 4 ranks built from other initial weights: its next step's loss is the
    one-process run's (which never stopped)."""
    ref_losses, _ = _ref(nd, "fsdp_tp", "DelayedScaling")
    assert len(ref_losses) == STEPS + 1
    for rank in nd:
        assert rank["resumed"] == pytest.approx(ref_losses[STEPS], rel=1e-6), (rank["resumed"], ref_losses)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_delayed_scaling_state_identical_on_every_rank_and_equal_to_one_process(nd, layout):
    states = [rank[(layout, "DelayedScaling")]["state"] for rank in nd]
    _, ref_state = _ref(nd, layout, "DelayedScaling")
    assert len(states[0]) == 5 * 3 * 2   # 5 linears x 3 roles x (history, scale)
    for r, state in enumerate(states[1:], 1):
        differ = [k for k in state if not torch.equal(state[k], states[0][k])]
        assert not differ, f"rank {r} keeps other state than rank 0 under {layout}: {differ}"
    assert states[0].keys() == ref_state.keys()
    for key in ref_state:
        torch.testing.assert_close(states[0][key], ref_state[key], rtol=1e-5, atol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_all_gather_bytes(nd, layout, recipe):
    for rank in nd:
        r = rank[(layout, recipe)]
        if recipe == "MXFP8BlockScaling":
            # the shards are not whole 32-row blocks over the world's 4 ranks: high-precision gathers
            assert all("do not split into whole 32-row blocks" in why for why in r["outcome"].values()), r["outcome"]
            expected, dtypes = 4 * r["gather_elems"], ["torch.float32"]
        else:
            assert set(r["outcome"].values()) == {"FP8 all-gather"}, r["outcome"]
            expected, dtypes = r["gather_elems"], ["torch.uint8"]   # 1 byte per element on the wire
        assert r["step_bytes"] == [(expected, dtypes)] * STEPS


EXPECTED_COLLECTIVES = {
    # current scaling: column-parallel w1 reduces its grad_output amax over tp, row-parallel w2 its input
    # amax; their weights arrive in FP8 with the whole weight's scale (FSDP's all-gather), the output
    # layer (whole on every TP rank, plain data parallel) needs none
    ("fsdp_tp", "Float8CurrentScaling"): {"layers.0.w1": "amax all-reduce over tp (2 ranks): grad_output",
                                          "layers.0.w2": "amax all-reduce over tp (2 ranks): input",
                                          "output.proj": ""},
    ("hsdp", "Float8CurrentScaling"): {"layers.0.w1": "", "layers.0.w2": "", "output.proj": ""},
    # delayed scaling, "auto": every dim of the mesh, as one flattened group
    ("fsdp_tp", "DelayedScaling"): {
        "layers.0.w1": "amax history all-reduce over dp_shard_tp (4 ranks), one per graph and step",
        "layers.0.w2": "amax history all-reduce over dp_shard_tp (4 ranks), one per graph and step",
        "output.proj": "amax history all-reduce over world (4 ranks), one per graph and step"},
    ("hsdp", "DelayedScaling"): dict.fromkeys(
        ("layers.0.w1", "layers.0.w2", "output.proj"),
        "amax history all-reduce over dp_replicate_dp_shard (4 ranks), one per graph and step"),
    ("fsdp_tp", "MXFP8BlockScaling"): {"layers.0.w1": "none needed: per-block scales",
                                       "layers.0.w2": "none needed: per-block scales", "output.proj": ""},
    ("hsdp", "MXFP8BlockScaling"): {"layers.0.w1": "", "layers.0.w2": "", "output.proj": ""},
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_report_names_the_group_of_every_amax(nd, layout, recipe):
    for rank in nd:
        rows = {fqn: (rewritten, collectives) for _, fqn, op, rewritten, _, collectives in rank[(layout, recipe)]["sites"]
                if op == "linear"}
        assert all(rewritten for rewritten, _ in rows.values()), rows
        got = {fqn: c for fqn, (_, c) in rows.items() if fqn in EXPECTED_COLLECTIVES[(layout, recipe)]}
        assert got == EXPECTED_COLLECTIVES[(layout, recipe)]


def test_amax_all_reduces_per_step(nd):
    for rank in nd:
        for layout, refresh in (("fsdp_tp", 2), ("hsdp", 1)):
            # the FP8 all-gather refreshes the whole weights' amaxes once per step: one all-reduce under
            # HSDP (every weight split on dp_shard), two under FSDP + TP (the TP'd weights over
            # dp_shard x tp, the output layer's over dp_shard alone)
            ds = rank[(layout, "DelayedScaling")]
            graphs = {g for g, _, op, rewritten, _, _ in ds["sites"] if op == "linear" and rewritten}
            assert len(graphs) == 3 and ds["refreshes"] == STEPS
            # delayed scaling: one coalesced all-reduce per graph and step
            assert ds["all_reduces"] == len(graphs) + refresh, (layout, ds["all_reduces"])
            # current scaling: a TP'd layer's graph reduces w2's input amax in forward and w1's
            # grad_output amax in backward; nothing else is split
            cs = rank[(layout, "Float8CurrentScaling")]
            assert cs["all_reduces"] == (2 * 2 if layout == "fsdp_tp" else 0) + refresh, (layout, cs["all_reduces"])
            assert rank[(layout, "MXFP8BlockScaling")]["all_reduces"] == 0


def test_mesh_errors_name_the_dim(nd):
    for rank in nd:
        errors = rank["errors"]
        assert errors["unknown dim"].startswith("options: distributed.amax_group: the mesh has no dim 'ep'; its dims "
                                                "are ['pp', 'dp', 'tp'] (shape (1, 2, 2))\n")
        assert errors["pipeline dim"].startswith("options: distributed.amax_group: 'pp' is a pipeline dim "
                                                 "(distributed.pipeline_dims = ['pp'])")
        # "auto" leaves the pipeline dim out: one group over dp x tp
        assert errors["auto"] == ["amax history all-reduce over dp_tp (4 ranks), one per graph and step"] * 2


def test_tp_plan_cutting_mxfp8_blocks_stays_high_precision_with_the_reason(nd):
    for rank in nd:
        [(rewritten, reason)] = rank["errors"]["cut"]
        assert not rewritten
        assert reason.startswith("in_features (K)=48 is not divisible by 32 (MXFP8 scales blocks of 32 along K and "
                                 "N); the whole weight's in_features is 96, which the tensor-parallel plan splits "
                                 "over tp (2 ranks)"), reason


@pytest.mark.parametrize("recipe, schedule", SCHEDULES, ids=lambda v: v)
def test_pipeline_stages_match_one_process(nd, recipe, schedule):
    """2 stages x 2 data-parallel ranks, 2 micro-batches each: the losses of one process (delayed
    scaling on the whole global batch; the others one micro-batch per pipeline micro-batch)."""
    ref_losses, _ = nd[0][("reference", recipe, 1 if recipe == "DelayedScaling" else 2 * MICRO_BATCHES)]
    for rank in nd:
        got = rank[("pp", recipe, schedule)]["losses"]
        assert got == pytest.approx(ref_losses[:STEPS], rel=1e-6), (got, ref_losses)


@pytest.mark.parametrize("schedule", ("GPipe", "1F1B"))
def test_pipeline_delayed_state_advances_once_per_step_within_each_stage(nd, schedule):
    """Each stage keeps its own layers' state; it equals one process's after 2 steps (one advance per
    optimizer step with the max over the micro-batches and data-parallel ranks: the global batch's),
    is the same on the stage's dp ranks, and is reduced over dp only, never across stages."""
    _, ref_state = nd[0][("reference", "DelayedScaling", 1)]
    by_stage = {}
    for rank in nd:
        r = rank[("pp", "DelayedScaling", schedule)]
        by_stage.setdefault(r["stage"], []).append(r)
        prefix = {0: ("layers.0.",), 1: ("layers.1.", "output.")}[r["stage"]]
        names = {0: {"0.": "layers.0."}, 1: {"0.": "layers.1.", "1.": "output."}}[r["stage"]]
        assert len(r["state"]) == {0: 2, 1: 3}[r["stage"]] * 3 * 2
        for key, value in r["state"].items():
            ref_key = next(names[p] + key[len(p):] for p in names if key.startswith(p))
            assert ref_key.startswith(prefix)
            torch.testing.assert_close(value, ref_state[ref_key], rtol=1e-5, atol=0, msg=lambda m: f"{key}: {m}")
        assert r["reloaded"]
        assert {c for _, rewritten, c in r["sites"] if rewritten} == {
            "amax history all-reduce over dp (2 ranks), once per optimizer step, every graph's together"}
    for stage, ranks in by_stage.items():
        assert len(ranks) == 2
        assert all(torch.equal(ranks[0]["state"][k], ranks[1]["state"][k]) for k in ranks[0]["state"])


def test_hsdp_with_tp_on_a_3d_mesh(nd):
    """(dp_replicate, dp_shard, tp) = (2, 1, 2), delayed scaling: one process's losses, one state on
    every rank, "auto" reducing over the dims with more than one rank (one flattened group)."""
    ref_losses, _ = nd[0][("reference", "DelayedScaling", 1)]
    states = []
    for rank in nd:
        r = rank[("hsdp_tp", "DelayedScaling")]
        assert r["losses"] == pytest.approx(ref_losses[:STEPS], rel=1e-6), (r["losses"], ref_losses)
        assert set(r["outcome"].values()) == {"FP8 all-gather"}
        rows = {fqn: c for _, fqn, op, rewritten, _, c in r["sites"] if op == "linear" and rewritten}
        assert rows["layers.0.w1"] == "amax history all-reduce over dp_replicate_tp (4 ranks), one per graph and step"
        states.append(r["state"])
    assert all(torch.equal(state[k], states[0][k]) for state in states for k in states[0])


def test_fully_shard_with_dp_mesh_dims_is_one_process_on_the_global_batch(nd):
    """The SPMD form with FP8 all-gather, current scaling: the activations are one DTensor, so their
    amaxes are all-reduced over dp too, and the losses are those of one process on the whole batch."""
    ref_losses, _ = nd[0][("reference", "Float8CurrentScaling", 1)]
    for rank in nd:
        r = rank["spmd"]
        assert r["losses"] == pytest.approx(ref_losses[:STEPS], rel=1e-6), (r["losses"], ref_losses)
        assert set(r["outcome"].values()) == {"FP8 all-gather"}, r["outcome"]
        assert r["sites"]["layers.0.w1"] == ("amax all-reduce over dp_shard (2 ranks): input, grad_output; "
                                             "amax all-reduce over tp (2 ranks): grad_output")
        assert r["sites"]["layers.0.w2"] == ("amax all-reduce over dp_shard (2 ranks): input, grad_output; "
                                             "amax all-reduce over tp (2 ranks): input")
        assert r["sites"]["output.proj"] == "amax all-reduce over dp_shard (2 ranks): input, grad_output"


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
def test_dp2ep_experts_gather_in_fp8_as_the_high_precision_gather_computes(nd, recipe):
    """FSDP2 over expert-parallel DTensor experts: each rank's FSDP shard is cast with its experts'
    scales (whole-expert amaxes reduced over dp_mod_ep, never across ep, whose ranks hold other
    experts), so the FP8 all-gather gives the bytes the grouped GEMMs make from the bf16 gather:
    the same losses (and delayed scaling's state) bit for bit, at half the bytes on the wire."""
    for rank in nd:
        fp8, high = rank[("dp2ep", recipe)]
        assert fp8["losses"] == high["losses"], (fp8["losses"], high["losses"])
        assert {k: v for k, v in fp8["outcome"].items() if k.startswith("moe.")} == {
            f"moe.{w}": "FP8 all-gather (one scale per expert)" for w in ("w1", "w2", "w3")}
        assert [rewritten for rewritten, _ in fp8["sites"]] == [True] * 3, fp8["sites"]
        # per step one gather of this rank's expert (w1, w2, w3 in one buffer) in forward, one in backward
        assert {g for g in fp8["gathered"]} == {(3 * 48 * 32, "torch.uint8")}, fp8["gathered"]
        assert {g for g in high["gathered"]} == {(2 * 3 * 48 * 32, "torch.bfloat16")}, high["gathered"]
        for key, value in high["state"].items():
            assert torch.equal(fp8["state"][key], value), key


def test_dp2ep_delayed_state_is_shared_by_the_ranks_holding_the_same_experts(nd):
    """Ranks 0 and 2 (dp_mod_ep 0 and 1, ep 0) hold experts 0-1, ranks 1 and 3 experts 2-3: with no
    setting, each expert's histories are all-reduced over dp_mod_ep (the root mesh's dim the weight
    does not live on), so replicas agree, and never over ep."""
    states = [rank[("dp2ep", "DelayedScaling")][0]["state"] for rank in nd]
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(states[a][k], states[b][k]) for k in states[a]), (a, b)
    assert not torch.equal(states[0]["moe.w1.input.amax_history"], states[1]["moe.w1.input.amax_history"])
    sites = nd[0][("dp2ep", "DelayedScaling")][0]["sites"]
    assert {c for _, c in sites} == {"amax history all-reduce over dp_mod_ep (2 ranks), one per graph and step"}
