"""Pipeline stages (te_compile/pipeline.py): DelayedScaling's amaxes never cross stages, without a setting.

Two parts:
- a spawned world of 2 gloo ranks runs torch's pipelining tutorial as it is: a 1-D mesh named "pp"
  from init_device_mesh, its group handed to PipelineStage, one block per stage compiled with te and
  nothing set but the recipe (update_on left to te, which advances the state at the optimizer step
  with 2 micro-batches in flight), under GPipe and 1F1B. Each rank also runs the whole model in one
  process on the same micro-batches; the test process asserts on what the ranks saved.
- one process playing rank 0 of a fake world of 4 ((dp, pp) = 2 x 2): what "auto" and other amax
  groups resolve to there, or the compile error, for a module called by its stage's forward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import te_compile
from te_compile.config import ConfigError
from utils import funcol_all_reduces, needs_gloo, run_ranks

pytestmark = needs_gloo

WORLD = 2
STEPS = 3
MICRO_BATCHES = 2
D, HIDDEN = 16, 32
BATCH = (4, 3, D)   # per step: 2 micro-batches of [2, 3, D]
SCHEDULES = ("GPipe", "1F1B")
# the tutorial's options: the recipe and nothing else ("aot_eager" only spares the test inductor's
# compile time); update_on is te's choice in a stage (docs/distributed.md says which and why)
RECIPE = {"recipe": "DelayedScaling", "compiler": "aot_eager"}
# what te chooses for it in a stage whose schedule keeps several micro-batches in flight
ONCE_PER_STEP = {"recipe_options": {"update_on": "optimizer_step"}}


class Block(nn.Module):
    """One stage's layers; a module of its own so Dynamo traces its forward (not torch's Sequential)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(*BATCH, generator=torch.Generator().manual_seed(step))


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


def _state(module: nn.Module) -> dict:
    return {k: v.clone() for k, v in te_compile.recipe_state_dict(module).items()}


def _pipeline(schedule_name: str, init: list) -> dict:
    """Stage r is block r on rank r; the stage's group is the 1-D "pp" mesh's (the whole world)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch._dynamo.reset()
    te_compile.reset()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("pp",))
    index = mesh["pp"].get_local_rank()
    block = Block()
    block.load_state_dict(init[index])
    block.compile(backend="te", options=RECIPE)
    micro = torch.empty(BATCH[0] // MICRO_BATCHES, *BATCH[1:])
    # static shapes: PipelineStage then runs no shape-inference pass over the compiled block
    stage = PipelineStage(block, index, WORLD, torch.device("cpu"),
                          input_args=(micro.clone().requires_grad_(index > 0),),
                          output_args=(micro.clone().requires_grad_(),), group=mesh["pp"].get_group())
    schedule = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule_name](
        stage, n_microbatches=MICRO_BATCHES, loss_fn=lambda y, _: _loss(y), scale_grads=False)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    losses = []

    def train():
        for step in range(STEPS):
            if index == 0:
                schedule.step(_batch(step))
            else:
                parts = []
                schedule.step(target=torch.zeros(BATCH[0]), losses=parts)
                losses.append([p.item() for p in parts])
            opt.step()
            opt.zero_grad()

    all_reduces = funcol_all_reduces(train)
    rows = [(s.rewritten, s.collectives, s.reason) for s in te_compile.report().sites if s.op == "linear"]
    return dict(stage=index, losses=losses, state=_state(block), all_reduces=all_reduces, rows=rows)


def _one_process(init: list) -> dict:
    """Both blocks in this process on the same micro-batches (no amax reduction: "none"), the state
    advanced once per optimizer step as te chooses in the stages."""
    torch._dynamo.reset()
    te_compile.reset()
    blocks = [Block(), Block()]
    for block, weights in zip(blocks, init):
        block.load_state_dict(weights)
        block.compile(backend="te", options={**RECIPE, **ONCE_PER_STEP, "amax_group": "none"})
    opt = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1)
    losses = []
    for step in range(STEPS):
        parts = []
        for x in _batch(step).chunk(MICRO_BATCHES):
            loss = _loss(blocks[1](blocks[0](x)))
            loss.backward()
            parts.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(parts)
    return dict(losses=losses, states=[_state(b) for b in blocks])


def _worker(rank: int) -> dict:
    torch.manual_seed(0)
    init = [Block().state_dict(), Block().state_dict()]
    out = {schedule: _pipeline(schedule, init) for schedule in SCHEDULES}
    out["one process"] = _one_process(init)
    return out


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("pipeline"), world=WORLD)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tutorial_pipeline_reduces_no_amax_across_stages(pipelined, schedule):
    """The stage's group is the whole world, so no other rank runs a stage: no amax all-reduce runs,
    and the report says why on every DelayedScaling linear, and that te advances the state at the
    optimizer step."""
    for rank in pipelined:
        r = rank[schedule]
        assert r["all_reduces"] == 0, r["all_reduces"]
        why = (f"none: this graph runs in pipeline stage {r['stage']} of 2 (PipelineStage's group: ranks [0, 1] "
               f"of the world's 2); no other rank runs this stage, and amax_group 'auto' reduces over "
               f"data-parallel ranks only")
        assert [row[:2] for row in r["rows"]] == [(True, why)] * 2, r["rows"]
        when = (f"(global); state advances at the optimizer step: update_on is not set and pipeline stage "
                f"{r['stage']} of 2 runs 2 micro-batches per step (an optimizer not from torch.optim calls "
                f"te_compile.advance_delayed_state() after its step)")
        assert all(row[2].endswith(when) for row in r["rows"]), r["rows"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_stage_keeps_the_state_of_one_process(pipelined, schedule):
    """With nothing set but the recipe, each stage's recipe state after 3 steps equals that of its
    block run in one process on the same micro-batches with update_on = "optimizer_step", bit for bit;
    the last stage's losses too. (te's former default, an update in each backward, failed here.)"""
    for rank in pipelined:
        r, ref = rank[schedule], rank["one process"]
        expected = ref["states"][r["stage"]]
        assert r["state"].keys() == expected.keys() and len(expected) == 2 * 3 * 2   # 2 linears x 3 roles
        for key, value in r["state"].items():
            assert torch.equal(value, expected[key]), (schedule, r["stage"], key, value, expected[key])
        if r["stage"] == 1:
            assert r["losses"] == ref["losses"], (r["losses"], ref["losses"])


# ---------------------------------------------------------------------------------------------
# A fake world of 4: (dp, pp) meshes


@pytest.fixture(scope="module")
def fake_world():
    """Rank 0 of a fake world of 4 ranks (no collective runs: each case only compiles)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def _stage_compile(mesh, pp: str, options: dict, micro_batches: int = MICRO_BATCHES):
    """A block compiled with te and called the way a schedule calls it, from its PipelineStage's
    forward on the mesh dim ``pp``'s group: the linears' report rows, or the compile error."""
    from torch.distributed.pipelining import PipelineStage

    torch._dynamo.reset()
    te_compile.reset()
    block = Block()
    block.compile(backend="te", options={**RECIPE, **options})
    micro = torch.empty(2, 3, D)
    stage = PipelineStage(block, mesh[pp].get_local_rank(), 2, torch.device("cpu"), input_args=(micro,),
                          output_args=(micro.clone().requires_grad_(),), group=mesh[pp].get_group())
    stage.chunks = micro_batches   # what a schedule sets before its first forward (no schedule runs here)
    try:
        # what forward_one_chunk calls: the stage's module, with the stage's frames on the stack
        stage.forward_maybe_with_nosync(torch.randn(2, 3, D))
    except ConfigError as e:
        return str(e)
    return [s.collectives for s in te_compile.report().sites if s.op == "linear"]


def test_dp_pp_mesh_reduces_over_dp_or_asks_for_the_mesh(fake_world):
    """(dp, pp) = 2 x 2: rank 0's stage group is ranks [0, 1], its data-parallel ranks [0, 2]. Given the
    mesh, "auto" reduces over dp only; without it te cannot tell the dp ranks from the stage group and
    says which key to set; "world" and a pipeline dim not named in pipeline_dims take in the other
    stage and are errors naming the keys."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    assert _stage_compile(mesh, "pp", {"mesh": mesh}) == [
        "amax history all-reduce over dp (2 ranks), once per optimizer step, every graph's together"] * 2
    error = _stage_compile(mesh, "pp", {})
    assert error.startswith("options: distributed.amax_group: 'auto' has no DeviceMesh to tell the data-parallel "
                            "ranks of this stage from the pipeline's: this graph runs in pipeline stage 0 of 2 "
                            "(PipelineStage's group: ranks [0, 1] of the world's 4), and the world would take "
                            "in the other stages; pass the mesh the stage's group comes from "
                            "(options={'mesh': mesh}"), error
    error = _stage_compile(mesh, "pp", {"amax_group": "world"})
    assert error.startswith("options: distributed.amax_group: world (4 ranks) takes in ranks [1], which run other "
                            "stages of the pipeline (this graph runs in pipeline stage 0 of 2"), error
    assert "list the pipeline's mesh dim in distributed.pipeline_dims" in error

    staged = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "stage"))
    error = _stage_compile(staged, "stage", {"mesh": staged})
    assert error.startswith("options: distributed.amax_group: dp_stage (4 ranks) takes in ranks [1], which run "
                            "other stages of the pipeline"), error
    assert _stage_compile(staged, "stage", {"mesh": staged, "distributed": {"pipeline_dims": ["stage"]}}) == [
        "amax history all-reduce over dp (2 ranks), once per optimizer step, every graph's together"] * 2


def test_update_on_in_a_stage_follows_the_micro_batches_in_flight(fake_world):
    """update_on left unset: "optimizer_step" with 2 micro-batches in flight (the report row says so),
    "backward" with 1 (the same state, no dependence on the optimizer). An explicit "backward" with 2
    is an error naming the key to set; with 1 it compiles."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    per_backward = "amax history all-reduce over dp (2 ranks), one per graph and step"
    assert _stage_compile(mesh, "pp", {"mesh": mesh}, micro_batches=1) == [per_backward] * 2
    assert not any("optimizer step" in s.reason for s in te_compile.report().sites)
    backward = {"mesh": mesh, "recipe_options": {"update_on": "backward"}}
    assert _stage_compile(mesh, "pp", backward, micro_batches=1) == [per_backward] * 2
    error = _stage_compile(mesh, "pp", backward)
    assert error.startswith("options: recipe_options.update_on: 'backward' advances DelayedScaling's state in each "
                     "graph's backward, but this graph runs in pipeline stage 0 of 2 (PipelineStage's group: "
                     "ranks [0, 1] of the world's 4), whose schedule keeps 2 micro-batches in flight: one "
                     "micro-batch's update would change the scales another's backward still reads; set "
                     "[recipe_options] update_on = \"optimizer_step\" (or leave it unset, which chooses it "
                     "here), or run the schedule with n_microbatches=1\n"), error
