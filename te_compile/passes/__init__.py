"""FX graph rewrites, applied in order by ``run_passes``; each pass changes the graph in place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx

from ..config import TeConfig
from ..lowerings.block_gemm_probe import native_block_gemm_support, recipe_block_format
from ..lowerings.linear import LinearLowering, LinearSpec, gemm_kind
from ..report import SiteRecord
from ..state import state_for
from .eligibility import linear_ineligibility, shape_str
from .rewrite_linear import add_state_inputs, rewrite_linear
from .sites import find_linear_sites

__all__ = ["run_passes", "PassResult", "StateInput"]


@dataclass(frozen=True)
class StateInput:
    """Delayed-scaling state the compiled graph takes as extra inputs, after Dynamo's own: the
    state of the weight at input ``weight_index``, looked up at every call (te_compile.state)."""

    weight_index: int
    history_len: int
    where: str   # the site, for error messages


@dataclass
class PassResult:
    records: list[SiteRecord] = field(default_factory=list)
    state_inputs: list[StateInput] = field(default_factory=list)

    def state_tensors(self, args: Sequence) -> list[torch.Tensor]:
        """The extra graph inputs for a call with Dynamo's ``args``."""
        out = []
        for s in self.state_inputs:
            out += state_for(args[s.weight_index], s.history_len, s.where).tensors()
        return out


def _rewrite_linears(gm: fx.GraphModule, example_inputs: Sequence, config: TeConfig,
                     graph_id: int, result: PassResult) -> int:
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    input_index = {node: i for i, node in enumerate(placeholders)}
    # Dynamo passes parameters as graph inputs: placeholder -> the nn.Parameter it receives.
    params = {
        node: value for node, value in zip(placeholders, example_inputs)
        if isinstance(value, torch.nn.Parameter)
    }
    records = result.records
    state_nodes_of: dict[fx.Node, list[fx.Node]] = {}  # weight -> its state inputs (one set per weight)
    count = 0
    for i, site in enumerate(find_linear_sites(gm, set(params))):
        recipe, why = config.recipe_for(site.fqn)
        record = dict(fqn=site.fqn, op="linear", shapes=shape_str(site), graph=graph_id)
        if not config.rewrite.linear:
            records.append(SiteRecord(recipe=None, rewritten=False, reason="[rewrite] linear = false", **record))
            continue
        if recipe is None:
            records.append(SiteRecord(recipe=None, rewritten=False, reason=f"recipe 'none' ({why})", **record))
            continue
        weight = params.get(site.weight)
        reason = linear_ineligibility(site, recipe, weight is not None)
        if reason is not None:
            records.append(SiteRecord(recipe=recipe.name, rewritten=False, reason=reason, **record))
            continue
        # Block formats: native GEMMs only where the device passes the probe (it may run a self-test).
        native, gemm_why = False, ""
        if recipe_block_format(recipe) is not None:
            if config.native_block_gemm:
                x = site.x.meta["example_value"]
                native, gemm_why = native_block_gemm_support(recipe, x.device, x.dtype)
            else:
                gemm_why = "native_block_gemm = false"
        lowering = LinearLowering(LinearSpec(site.fqn, recipe, site.weight_in_out, native))
        state_nodes = []
        if recipe.delayed():
            if site.weight not in state_nodes_of:
                state = StateInput(input_index[site.weight], recipe.amax_history_len, site.fqn or "<root>")
                # Created now (validating the length); the wrapper passes its tensors at each call.
                tensors = state_for(weight, state.history_len, state.where).tensors()
                result.state_inputs.append(state)
                state_nodes_of[site.weight] = add_state_inputs(gm, f"te_state_{i}", len(tensors))
            state_nodes = state_nodes_of[site.weight]
        count += rewrite_linear(gm, site, lowering, state_nodes)
        how = f"{site.op_name} -> {gemm_kind(recipe, native, gemm_why)} ({why})"
        records.append(SiteRecord(recipe=recipe.name, rewritten=True, reason=how, **record))
    return count


def run_passes(gm: fx.GraphModule, example_inputs: Sequence, config: TeConfig,
               graph_id: int = 0) -> PassResult:
    """Apply the rewrites to ``gm`` in place; return one record per site seen and the weights
    whose recipe state the graph now holds."""
    result = PassResult()
    _rewrite_linears(gm, example_inputs, config, graph_id, result)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return result
