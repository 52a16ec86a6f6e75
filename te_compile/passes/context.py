"""What every pass reads and adds to while the passes run over one Dynamo graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.fx as fx

from ..config import TeConfig
from ..distributed import AmaxGroup, describe_groups, describe_placements, expert_shard_groups, is_dtensor
from ..recipe import Recipe
from ..report import SiteRecord
from ..fx.graphs import GraphScope, ParamRef
from .delayed_state import DelayedState
from .settings import PassSettings

__all__ = ["PassContext"]


@dataclass
class PassContext:
    """The config, the graph's number in the report, the DelayedScaling state collected on the way,
    and the report rows every pass adds."""

    config: TeConfig
    graph_id: int
    delayed: DelayedState              # DelayedScaling state inputs and the graph's update node
    amax_group: Optional[AmaxGroup] = None   # config.distributed.amax_group for this process
    expert_amax_group: Optional[AmaxGroup] = None   # config.distributed.expert_amax_group, resolved
    # compiled with grad disabled: the linears read cached FP8 weights (cached_weights.py; training
    # graphs do under config.cache_fp8_weights)
    inference: bool = False
    cached_weights: dict = field(default_factory=dict)   # (weight input index, recipe) -> placeholder
    # [distributed] context_parallel, resolved: (the dim's group, this rank's index along it), or None
    context_parallel: Optional[tuple] = None
    # why amax_group is None where te left the reduction out itself (a pipeline stage that holds the
    # whole world: pipeline.py), for the DelayedScaling sites' report rows; "" otherwise
    amax_note: str = ""
    # the DelayedScaling recipes whose update_on te set to "optimizer_step" in a pipeline stage
    # (pipeline.choose_update_on), and the note their rewritten sites' report rows end with
    update_chosen: tuple[Recipe, ...] = ()
    update_note: str = ""
    _records: list[tuple[tuple[float, ...], SiteRecord]] = field(default_factory=list)

    @classmethod
    def for_graph(cls, settings: PassSettings, graph_id: int, delayed: DelayedState) -> PassContext:
        """The context of one graph's passes, from the settings resolved for it (settings.py)."""
        return cls(settings.config, graph_id, delayed, settings.amax_group, settings.expert_amax_group,
                   inference=settings.inference, context_parallel=settings.context_parallel,
                   amax_note=settings.amax_note, update_chosen=settings.update_chosen,
                   update_note=settings.update_note)

    def record(self, scope: GraphScope, node: fx.Node, record: SiteRecord) -> None:
        """Report a site (call before rewriting ``node``): rows come out in the order the model runs."""
        self._records.append((scope.order_key(node), record))

    def recorder(self, scope: GraphScope, node: fx.Node, fqn: str, op: str, shapes: str) -> Callable[..., None]:
        """``record(rewritten, reason, recipe_name=None, collectives="")``: adds the row of the site at
        ``node``, numbered with this graph and ending with where in the model the scope is."""
        def record(rewritten: bool, reason: str, recipe_name: Optional[str] = None, collectives: str = "") -> None:
            if rewritten and self._update_chosen_for(fqn):
                reason += f"; {self.update_note}"
            self.record(scope, node, SiteRecord(fqn=fqn, op=op, recipe=recipe_name, rewritten=rewritten,
                                                reason=reason + scope.where, shapes=shapes, graph=self.graph_id,
                                                collectives=collectives))
        return record

    def _update_chosen_for(self, fqn: str) -> bool:
        """Whether the site at ``fqn`` runs under a recipe whose update_on te chose (by identity: an
        explicit "optimizer_step" recipe with the same fields was the user's choice)."""
        if not self.update_chosen:
            return False
        recipe, _ = self.config.recipe_for(fqn)
        return any(recipe is chosen for chosen in self.update_chosen)

    def expert_groups(self, param: Optional[ParamRef]) -> tuple[AmaxGroup, ...]:
        """The groups DelayedScaling all-reduces an expert weight's amaxes over: the ranks that hold
        the same experts. A DTensor weight (read through ``to_local()``) names them by its placements
        unless ``[distributed] expert_amax_group`` names a group; a plain one takes that setting."""
        setting = self.config.distributed.expert_amax_group
        if param is not None and is_dtensor(param.value) and isinstance(setting, str) and setting == "same":
            return expert_shard_groups(param.value, self.config.distributed.pipeline_dims)
        return (self.expert_amax_group,) if self.expert_amax_group is not None else ()

    def history_reduction(self, groups, recipe) -> str:
        """The report's collectives text of a DelayedScaling site whose amaxes are reduced over
        ``groups`` (none: "", or ``amax_note`` where te chose none for a recipe that reduces)."""
        if not groups:
            return self.amax_note if recipe.reduce_amax else ""
        when = ("once per optimizer step, every graph's together" if recipe.update_on == "optimizer_step"
                else "one per graph and step")
        return f"amax history all-reduce over {describe_groups(groups)}, {when}"

    @staticmethod
    def local_shard_note(param: Optional[ParamRef]) -> str:
        """For the report, when a site reads a DTensor parameter's ``to_local()``: whose shard; else ""."""
        if param is None or not is_dtensor(param.value):
            return ""
        return f"; weight: this rank's shard of the DTensor {param.name} ({describe_placements(param.value)})"

    @staticmethod
    def why_not_any_site(scope: GraphScope, recipe: Optional[Recipe], why: str) -> Optional[str]:
        """Why a site stays as it is whatever its kind (a graph the passes only report on, recipe
        'none'; ``why``: why the config chose the recipe), or None."""
        if scope.unsupported is not None:
            return scope.unsupported
        if recipe is None:
            return f"recipe 'none' ({why})"
        return None

    def admit(self, scope: GraphScope, site: Any, switch: str, recipe: Optional[Recipe], why: str,
              record: Callable[..., None], why_not_kind: Callable[[Any, Recipe], Optional[str]]) -> bool:
        """The gate of a site the finders found (``site.unsupported``: the finder's own verdict),
        asked in this order: the finder's verdict, ``[rewrite] <switch>``, ``why_not_any_site``, then
        ``why_not_kind(site, recipe)``. False, with the site's row recorded, where one says no."""
        if site.unsupported is not None:
            record(False, f"{site.unsupported} (left in high precision)")
            return False
        if not getattr(self.config.rewrite, switch):
            record(False, f"[rewrite] {switch} = false")
            return False
        if (alone := self.why_not_any_site(scope, recipe, why)) is not None:
            record(False, alone)
            return False
        if (reason := why_not_kind(site, recipe)) is not None:
            record(False, reason, recipe.name)
            return False
        return True

    def records(self) -> list[SiteRecord]:
        return [r for _, r in sorted(self._records, key=lambda kr: kr[0])]
