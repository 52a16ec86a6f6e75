"""What the passes take from the config and from the process, resolved once per graph before any
pass runs: the driver (``run_passes``) only orders the passes, and no pass works a setting out.

The process decides three things the config leaves open: whether the graph is an inference graph
(Dynamo guards on the grad mode, so a training graph has its own), which mesh the graph runs on (the
config's, else the one its DTensor inputs live on), and which pipeline stage, if any, is calling the
module (no amax group may cross its stages; its schedule keeps micro-batches in flight, so
DelayedScaling's "auto" state update waits for the optimizer step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..config import ConfigError, TeConfig
from ..distributed import AmaxGroup, graph_mesh, resolve_amax_group, resolve_context_parallel
from ..pipeline import PipelineStageInfo, choose_update_on, confine_to_stage, current_stage
from ..recipe import Recipe

__all__ = ["PassSettings", "resolve_settings"]


@dataclass(frozen=True)
class PassSettings:
    """The config as the passes apply it to one graph, and the groups it names, for this process."""

    config: TeConfig                   # for_inference() in an inference graph; update_on "auto" resolved
    inference: bool                    # compiled with grad disabled: no backward, no state update
    amax_group: Optional[AmaxGroup]    # [distributed] amax_group, resolved on the graph's mesh and stage
    expert_amax_group: Optional[AmaxGroup]   # [distributed] expert_amax_group, resolved ("same": the above)
    # [distributed] context_parallel: (the dim's group, this rank's index along it), or None
    context_parallel: Optional[tuple]
    # why amax_group is None where te left the reduction out itself (a pipeline stage that holds the
    # whole world), for the DelayedScaling sites' report rows; "" otherwise
    amax_note: str
    # the DelayedScaling recipes whose update_on te set to "optimizer_step" in a pipeline stage, and
    # the note their rewritten sites' report rows end with
    update_chosen: tuple[Recipe, ...]
    update_note: str


def resolve_settings(config: TeConfig, example_inputs: Sequence) -> PassSettings:
    """The settings for a graph Dynamo hands over with ``example_inputs``, compiled now (the grad mode
    and the calling pipeline stage are this moment's). Raises ConfigError naming the config's file and
    key for a group this rank cannot take part in."""
    inference = not torch.is_grad_enabled()
    if inference:
        config = config.for_inference()
    setting = config.distributed
    mesh = setting.mesh if setting.mesh is not None else graph_mesh(example_inputs)
    stage = current_stage()
    # an inference graph has no backward and no update
    config, update_chosen, update_note = (config, (), "") if inference else choose_update_on(config, stage)
    amax_group, amax_note = _amax_group(config, "amax_group", mesh, stage)
    same = isinstance(setting.expert_amax_group, str) and setting.expert_amax_group == "same"
    expert_group = amax_group if same else _amax_group(config, "expert_amax_group", mesh, stage)[0]
    try:
        context_parallel = resolve_context_parallel(setting.context_parallel, mesh, setting.pipeline_dims)
    except ValueError as e:
        raise ConfigError(f"{config.source}: distributed.{e}") from None
    return PassSettings(config, inference, amax_group, expert_group, context_parallel, amax_note, update_chosen,
                        update_note)


def _amax_group(config: TeConfig, key: str, mesh: Any,
                stage: Optional[PipelineStageInfo]) -> tuple[Optional[AmaxGroup], str]:
    """``[distributed] <key>`` for this process and stage, and the report's note (confine_to_stage)."""
    setting = config.distributed
    try:
        spec = getattr(setting, key)
        return confine_to_stage(key, spec, resolve_amax_group(spec, mesh, setting.pipeline_dims), mesh, stage)
    except ValueError as e:   # "amax_group: <problem>"
        raise ConfigError(f"{config.source}: distributed.{key}:{str(e).partition(':')[2]}") from None
