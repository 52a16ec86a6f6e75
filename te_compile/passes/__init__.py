"""FX graph rewrites: ``run_passes`` applies ``PASSES`` in order to every graph of a Dynamo capture.

The pass order, what each pass hands the next and why: README.md beside this file. The driver knows
no site kind and works out no setting (the backend resolves them with settings.py and hands them
over): it runs each pass over each graph, lets the recipe state collected on the way wire itself in,
and cleans up (dead code, stable lowering names for AOTAutograd's cache, lint, recompile).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from ..report import SiteRecord
from ..fx.cache_names import publish_lowerings
from ..fx.graphs import GraphScope, graph_scopes
from ..fx.naming import FrameInstances
from .context import PassContext
from .delayed_state import DelayedState, ExtraInput
from .linear import rewrite_linears
from .grouped_linear import rewrite_grouped_linears
from .linear_cross_entropy import fuse_linear_cross_entropy
from .activation_fusion import fuse_activations, fuse_hand_written_activations
from .attention import rewrite_attention
from .attention_projection import hand_off_fp8_mha
from .norm_fusion import fuse_norms
from .settings import PassSettings

__all__ = ["run_passes", "PassContext", "PassResult", "PASSES"]


Pass = Callable[[PassContext, GraphScope], int]

# The order matters (README.md beside this file says why): the norm and activation passes fuse into
# the linears the linear pass created, the fp8_mha pass joins the attention pass's sites to them.
PASSES: tuple[Pass, ...] = (
    rewrite_linears,
    rewrite_grouped_linears,
    fuse_linear_cross_entropy,
    fuse_norms,
    fuse_activations,
    fuse_hand_written_activations,
    rewrite_attention,
    hand_off_fp8_mha,
)


@dataclass
class PassResult:
    records: list[SiteRecord] = field(default_factory=list)
    extra_inputs: list[ExtraInput] = field(default_factory=list)   # after Dynamo's, in order
    counts: dict[str, int] = field(default_factory=dict)           # pass name -> sites rewritten
    instances: Optional[FrameInstances] = None   # None: the graph takes no parameter
    # "<module>.<name>" -> digest of each lowering the graph calls (fx/cache_names.py): for inductor's
    # unsafe_marked_cacheable_functions, so that AOTAutograd's cache may keep the graph
    cacheable: dict[str, str] = field(default_factory=dict)

    def extra_tensors(self, args: Sequence) -> list[torch.Tensor]:
        """The extra graph inputs for a call with Dynamo's ``args``."""
        return [t for extra in self.extra_inputs for t in extra.tensors(args)]


def run_passes(gm: fx.GraphModule, example_inputs: Sequence, settings: PassSettings,
               graph_id: int = 0) -> PassResult:
    """Apply ``PASSES`` to ``gm`` and every HOP body in it, in place, under ``settings`` (the caller
    resolves them for this graph: ``settings.resolve_settings``); return one record per site seen and
    the extra inputs the rewritten graph takes."""
    scopes = graph_scopes(gm, example_inputs)
    # Dynamo's graph holds no dead code: a node nothing reads is there for its effect (an in-place
    # copy_ / relu_ / add_ into a buffer the graph reads later, which fx's own purity test calls pure)
    effects = {n for scope in scopes for n in scope.graph.nodes if not n.users}
    ctx = PassContext.for_graph(settings, graph_id, DelayedState(scopes[0], example_inputs, settings.inference))
    counts = {}
    for rewrite in PASSES:
        counts[rewrite.__name__] = sum(rewrite(ctx, scope) for scope in scopes)
    extra_inputs = ctx.delayed.finish()
    for scope in scopes:
        # only what the passes left unread goes
        scope.graph.eliminate_dead_code(is_impure_node=lambda n: n in effects or n.is_impure())
    cacheable = publish_lowerings([scope.gm for scope in scopes])
    for scope in scopes:
        scope.graph.lint()
        scope.gm.recompile()
    records = ctx.records()
    top = scopes[0]
    anchor = min(top.params.values(), key=lambda p: p.index, default=None)
    instances = None if anchor is None else FrameInstances(
        settings.config, records, top.prefix, anchor.index, anchor.name[len(top.prefix):])
    return PassResult(records, extra_inputs, counts, instances, cacheable)
