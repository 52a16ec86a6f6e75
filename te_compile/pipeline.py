"""Pipeline stages (``torch.distributed.pipelining``): which stage a graph compiles in, and amax groups
that stay within it.

Each stage of a pipeline holds other layers and runs other graphs. An amax all-reduce whose group takes
in ranks of two stages pairs one stage's collective with another stage's: a deadlock when the two
never meet, or a MAX over unrelated amaxes when they do. So DelayedScaling's amaxes are reduced over
the ranks that run the same stage (its data-parallel replicas) and never along the pipeline.

te finds the stage without a setting: Dynamo compiles a module on its first call, and under a
schedule (GPipe, 1F1B) that call comes from the stage itself (``PipelineStage.forward_one_chunk`` ->
``forward_maybe_with_nosync`` -> ``submod(...)``), so the stage object is on the Python stack while
the backend runs. Its process group (``group=``, the world when None) holds one rank per stage of
this rank's pipeline.

The schedule also keeps several micro-batches in flight (GPipe: every forward, then every backward;
1F1B: stage 0 of 2 runs F0 F1 B0 B1), so DelayedScaling cannot advance its state in each graph's
backward there: B0's update writes the histories and scales in place that F1's graph saved for B1
("modified by an inplace operation" at B1), and the state would advance once per micro-batch. Where
the recipe leaves ``update_on`` unset ("auto"), te advances it at the optimizer step instead
(``choose_update_on``), and refuses an explicit "backward" there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Optional

from .config import ConfigError, TeConfig
from .distributed import AmaxGroup
from .recipe import Recipe

__all__ = ["PipelineStageInfo", "current_stage", "confine_to_stage", "choose_update_on"]


@dataclass(frozen=True)
class PipelineStageInfo:
    """The pipeline stage a graph compiles in: its index, how many stages, and the global ranks of its
    process group (one per stage of this rank's pipeline, this rank among them)."""

    index: int
    stages: int
    ranks: tuple[int, ...]
    world: int   # ranks in the world: a stage group of all of them leaves no data-parallel ranks
    # micro-batches the stage's schedule runs per step (PipelineStage.chunks, which the schedule sets
    # before its first forward of a training step); None where no schedule set it yet (a stage that
    # infers shapes calls the module before that, or a schedule without backward)
    micro_batches: Optional[int] = None

    def __str__(self) -> str:
        return (f"pipeline stage {self.index} of {self.stages} (PipelineStage's group: ranks {list(self.ranks)} "
                f"of the world's {self.world})")


def current_stage() -> Optional[PipelineStageInfo]:
    """The ``PipelineStage`` whose forward is calling the module being compiled, or None (one process,
    no pipeline, or a module compiled by a call from outside the schedule)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        # the base of PipelineStage (manual frontend) and of the tracer frontend's stage
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:   # pragma: no cover - torch without pipelining
        return None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        # only methods: "self" is their first argument (reading f_locals of every frame costs more)
        if code.co_argcount and code.co_varnames[0] == "self":
            stage = frame.f_locals.get("self")
            if isinstance(stage, _PipelineStageBase):
                world = dist.get_world_size()
                ranks = (tuple(dist.get_process_group_ranks(stage.group)) if stage.group is not None
                         else tuple(range(world)))
                return PipelineStageInfo(stage.stage_index, stage.num_stages, ranks, world, stage.chunks)
        frame = frame.f_back
    return None


def confine_to_stage(key: str, spec: Any, group: Optional[AmaxGroup], mesh: Any,
                     stage: Optional[PipelineStageInfo]) -> tuple[Optional[AmaxGroup], str]:
    """(the amax group ``key`` (its setting ``spec``, resolved to ``group`` on ``mesh``) takes in
    ``stage``, the report's reason when te left the reduction out itself, else "").

    "auto" without a DeviceMesh resolves to the world. In a pipeline whose stage group is the whole
    world (a 1-D "pp" mesh, torch's tutorial), no other rank runs this stage: no reduction. In a larger
    world the ranks of the same stage cannot be told from the stage group alone (a guess would
    deadlock), so that is an error naming the ``mesh`` key. Any group that still takes in another
    stage's rank (``"world"``, a mesh dim not in ``pipeline_dims``) is an error naming the key.
    Raises ValueError("<key>: <problem>").
    """
    if stage is None or group is None:
        return group, ""
    import torch.distributed as dist

    if isinstance(spec, str) and spec == "auto" and mesh is None:
        if len(stage.ranks) == stage.world:
            return None, (f"none: this graph runs in {stage}; no other rank runs this stage, and "
                          f"amax_group 'auto' reduces over data-parallel ranks only")
        raise ValueError(f"{key}: 'auto' has no DeviceMesh to tell the data-parallel ranks of this stage "
                         f"from the pipeline's: this graph runs in {stage}, and the world would take in the "
                         f"other stages; pass the mesh the stage's group comes from (options={{'mesh': mesh}}, "
                         f"e.g. init_device_mesh(..., mesh_dim_names=('dp', 'pp'))) so that 'auto' reduces over "
                         f"every dim but 'pp', or name the data-parallel group in {key}")
    others = sorted((set(group.ranks) & set(stage.ranks)) - {dist.get_rank()})
    if others:
        raise ValueError(f"{key}: {group} takes in ranks {others}, which run other stages of the pipeline "
                         f"(this graph runs in {stage}); each stage runs other graphs, so no amax is reduced "
                         f"across stages: list the pipeline's mesh dim in distributed.pipeline_dims, or name "
                         f"the data-parallel dims or group in {key}")
    return group, ""


def choose_update_on(config: TeConfig, stage: Optional[PipelineStageInfo]
                     ) -> tuple[TeConfig, tuple[Recipe, ...], str]:
    """(``config`` with DelayedScaling's ``update_on = "auto"`` resolved for ``stage``, the recipes te
    set to "optimizer_step", the report's note for their sites).

    In a stage whose schedule runs several micro-batches per step (or an unknown number), "auto"
    becomes "optimizer_step": one update per step with the max of every micro-batch's amaxes, which the
    hook torch.optim runs after each ``step()`` folds in (lowerings/delayed_state.py). One micro-batch
    keeps "backward": the same state either way, and no dependence on the optimizer. An explicit
    "backward" with several micro-batches in flight is a ConfigError naming the key, as it would fail
    in the schedule's backward. Outside a stage "auto" stays and means "backward".
    """
    if stage is None or stage.micro_batches == 1:
        return config, (), ""
    in_flight = (f"{stage.micro_batches} micro-batches" if stage.micro_batches is not None
                 else "micro-batches (how many: not known before its first step)")
    chosen = []

    def resolve(recipe: Optional[Recipe], key: str) -> Optional[Recipe]:
        if recipe is None or not recipe.delayed():
            return recipe
        if recipe.update_on == "backward" and stage.micro_batches is not None:
            setting = "[recipe_options] update_on" if key == "recipe_options" else f"{key}.update_on"
            raise ConfigError(
                f"{config.source}: {key}.update_on: 'backward' advances DelayedScaling's state in each "
                f"graph's backward, but this graph runs in {stage}, whose schedule keeps {in_flight} in "
                f"flight: one micro-batch's update would change the scales another's backward still "
                f"reads; set {setting} = \"optimizer_step\" (or leave it unset, which chooses it "
                f"here), or run the schedule with n_microbatches=1")
        if recipe.update_on != "auto":
            return recipe
        resolved = replace(recipe, update_on="optimizer_step")
        chosen.append(resolved)
        return resolved

    # an override that names the global recipe holds the same object: one resolved recipe for both
    global_recipe = resolve(config.recipe, "recipe_options")
    overrides = tuple(
        replace(o, recipe=global_recipe if o.recipe is config.recipe
                else resolve(o.recipe, f"overrides[{i}].recipe_options"))
        for i, o in enumerate(config.overrides))
    if not chosen:
        return config, (), ""
    note = (f"state advances at the optimizer step: update_on is not set and pipeline stage {stage.index} of "
            f"{stage.stages} runs {in_flight} per step (an optimizer not from torch.optim calls "
            f"te_compile.advance_delayed_state() after its step)")
    return replace(config, recipe=global_recipe, overrides=overrides), tuple(chosen), note
