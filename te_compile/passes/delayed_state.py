"""DelayedScaling state as extra inputs of a compiled graph, and the graph's one update node.

Dynamo reuses one compiled graph for every instance of a module class, so state cannot be baked into
the graph: each stateful weight gets six extra placeholders (per role: amax_history [L], scale [1];
[E, L] and [E] for a 3-D expert weight),
each SDPA site's state eight (query, key, value, grad_output), appended after Dynamo's inputs, and
the backend's wrapper passes that weight's or site's tensors (te_compile.state) at every call. Sites
read only the scales; the update happens once per graph and step in ``DelayedScalingUpdate``
(lowerings/delayed_state.py), a node placed at the start of the top-level graph whose outputs, one
amax carrier per site with a backward, the sites take as inputs.
Sites inside HOP bodies (checkpointed blocks) get their scales and carrier lifted in as operands.
An inference graph (compiled with grad disabled) has no update node and reads state without creating
it (te_compile.state ``read_state``): serving a model adds nothing to its ``recipe_state_dict``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..distributed import minimal_groups
from ..lowerings.delayed_state import DelayedScalingUpdate, UpdateSpec, amax_sink
from ..recipe import ATTENTION_ROLES, GEMM_ROLES, DelayedScaling
from ..state import ATTENTION_SITE, amax_anchor, attention_state_for, read_attention_state, read_state, state_for
from ..fx.graphs import GraphScope, ParamRef

__all__ = ["StateInput", "AttentionStateInput", "AnchorInput", "SinkInput", "DelayedState"]

# an SDPA site's state is named after its module: "<module>.sdpa" (te_compile.state)
ATTENTION_SITE_KEY = ATTENTION_SITE


@dataclass(frozen=True)
class StateInput:
    """The state of the weight at Dynamo input ``weight_index``: six extra inputs, looked up per call."""

    weight_index: int
    history_len: int
    where: str   # the site, for error messages
    inference: bool = False   # an inference graph's: reads the state, never creates it

    def tensors(self, args: Sequence) -> list[torch.Tensor]:
        lookup = read_state if self.inference else state_for
        return lookup(args[self.weight_index], self.history_len, self.where).tensors()


@dataclass(frozen=True)
class AttentionStateInput:
    """The state of an SDPA site keyed on the parameter at Dynamo input ``param_index``: eight extra
    inputs, looked up per call (te_compile.state.attention_state_for)."""

    param_index: int
    site_key: str
    owner_depth: int
    history_len: int
    where: str
    inference: bool = False   # an inference graph's: reads the state, never creates it

    def tensors(self, args: Sequence) -> list[torch.Tensor]:
        lookup = read_attention_state if self.inference else attention_state_for
        return lookup(args[self.param_index], self.site_key, self.owner_depth, self.history_len,
                      self.where).tensors()


@dataclass(frozen=True)
class AnchorInput:
    """The requires-grad scalar the update node hangs off (te_compile.state.amax_anchor)."""

    device: torch.device

    def tensors(self, args: Sequence) -> list[torch.Tensor]:
        return [amax_anchor(self.device)]


@dataclass(frozen=True)
class SinkInput:
    """A fresh amax sink for one call (DelayedScaling with ``update_on = "optimizer_step"``): the leaf
    whose gradient carries the state's amaxes of that call out of the graph (lowerings/delayed_state.py
    ``amax_sink``). ``state``: the extra input of the state it is for, to find that call's state."""

    state: Union[StateInput, AttentionStateInput]
    recipe: DelayedScaling
    roles: tuple[str, ...]
    experts: int
    groups: tuple

    def tensors(self, args: Sequence) -> list[torch.Tensor]:
        return [amax_sink(self.state.tensors(args), self.recipe, self.roles, self.experts, self.groups)]


ExtraInput = Union[StateInput, AttentionStateInput, AnchorInput, SinkInput]


@dataclass
class _Weight:
    """One state the graph keeps: a weight's, or an SDPA site's (``roles`` = ATTENTION_ROLES)."""

    index: int                  # position among the graph's states
    recipe: DelayedScaling
    fqn: str                    # the first site using it
    nodes: list[fx.Node]        # its top-level placeholders, in RoleStates.tensors() order
    source: Union[StateInput, AttentionStateInput]   # its extra input
    groups: tuple = ()          # the groups its amaxes are all-reduced over (all its sites')
    roles: tuple = GEMM_ROLES
    experts: int = 0            # a 3-D expert weight's E: one history per expert and role


@dataclass
class DelayedState:
    """Collects what DelayedScaling sites need while the passes run; ``finish`` wires the update."""

    top: GraphScope
    example_inputs: Sequence
    # compiled with grad disabled: reads state, never creates it (te_compile.state.read_state)
    inference: bool = False
    inputs: list[ExtraInput] = field(default_factory=list)   # in placeholder order
    # id(weight) or (site key, id(key parameter)) -> its entry
    _weights: dict[Union[int, tuple], _Weight] = field(default_factory=dict)
    _anchor: Optional[fx.Node] = None
    _update: Optional[fx.Node] = None
    _carriers: list[fx.Node] = field(default_factory=list)
    _site_weights: list[int] = field(default_factory=list)

    def site_inputs(self, scope: GraphScope, param: ParamRef, recipe: DelayedScaling, fqn: str,
                    needs_carrier: bool, groups: tuple = ()) -> Union[list, str]:
        """The site's extra lowering arguments in ``scope``'s graph: (carrier or None, input scale,
        weight scale, grad_output scale); or why the site cannot have them. ``groups``: the process
        groups the site's amaxes must be all-reduced over before they enter the weight's histories."""
        weight = self._weights.get(id(param.value))
        if weight is None:
            where = fqn or "<root>"
            lookup = read_state if self.inference else state_for
            state = lookup(param.value, recipe.amax_history_len, where)  # validates the length
            if fqn not in state.sites:
                state.sites.append(fqn)
            source = StateInput(param.index, recipe.amax_history_len, where, self.inference)
            self.inputs.append(source)
            nodes = self._placeholders(f"te_state_{len(self._weights)}", state.tensors())
            weight = self._weights[id(param.value)] = _Weight(len(self._weights), recipe, fqn, nodes, source,
                                                              experts=state.experts)
        elif weight.recipe != recipe:
            return (f"its weight {param.name} is also used by {weight.fqn or '<root>'} under another "
                    f"DelayedScaling config; one weight keeps one state")
        weight.groups = minimal_groups((*weight.groups, *groups))
        return self._site_values(scope, weight, param.value.device, needs_carrier)

    def attention_inputs(self, scope: GraphScope, param: ParamRef, owner: str, recipe: DelayedScaling, fqn: str,
                         needs_carrier: bool, groups: tuple = ()) -> Union[list, str]:
        """An SDPA site's extra lowering arguments in ``scope``'s graph: (carrier or None, query, key,
        value and grad_output scales); or why it cannot have them. The state is keyed on ``param``,
        the key parameter of ``owner``, the module (the site's own or an ancestor) that owns the site
        (state.attention_key_param); every SDPA call of one module shares it, as every call of one
        weight shares the weight's."""
        site_key = ".".join(p for p in (fqn[len(owner):].lstrip("."), ATTENTION_SITE_KEY) if p)
        key = (site_key, id(param.value))
        entry = self._weights.get(key)
        if entry is None:
            depth = len(param.name.split(".")) - (len(owner.split(".")) if owner else 0)
            where = f"{fqn or '<root>'} (SDPA)"
            lookup = read_attention_state if self.inference else attention_state_for
            state = lookup(param.value, site_key, depth, recipe.amax_history_len, where)
            source = AttentionStateInput(param.index, site_key, depth, recipe.amax_history_len, where, self.inference)
            self.inputs.append(source)
            nodes = self._placeholders(f"te_sdpa_state_{len(self._weights)}", state.tensors())
            entry = self._weights[key] = _Weight(len(self._weights), recipe, fqn, nodes, source,
                                                 roles=ATTENTION_ROLES)
        elif entry.recipe != recipe:
            return (f"another SDPA call of {entry.fqn or '<root>'} runs under another DelayedScaling config; "
                    f"one module's SDPA calls keep one state")
        entry.groups = minimal_groups((*entry.groups, *groups))
        return self._site_values(scope, entry, param.value.device, needs_carrier)

    def _site_values(self, scope: GraphScope, entry: _Weight, device: torch.device, needs_carrier: bool) -> list:
        """(carrier or None, one scale per role of ``entry``), brought into ``scope``."""
        carrier = None
        if needs_carrier:
            carrier = scope.lift(self._new_carrier(entry, device), f"te_amax_carrier_{len(self._carriers) - 1}")
        scales = [scope.lift(entry.nodes[2 * r + 1], f"{entry.nodes[2 * r + 1].name}_in")
                  for r in range(len(entry.roles))]
        return [carrier, *scales]

    def finish(self) -> list[ExtraInput]:
        """Give the update node its final spec and arguments; returns the extra inputs in order."""
        if self._update is not None:
            weights = sorted(self._weights.values(), key=lambda w: w.index)
            groups = tuple(w.groups for w in weights)
            roles = tuple(w.roles for w in weights)
            experts = tuple(w.experts for w in weights)
            self._update.target = DelayedScalingUpdate(UpdateSpec(
                tuple(w.recipe for w in weights), tuple(self._site_weights), groups if any(groups) else (),
                roles if any(r != GEMM_ROLES for r in roles) else (), experts if any(experts) else ()))
            sinks = []
            for w in weights:
                if w.recipe.update_on != "optimizer_step":
                    continue
                sink = SinkInput(w.source, w.recipe, w.roles, w.experts, w.groups)
                self.inputs.append(sink)
                sinks += self._placeholders(f"te_amax_sink_{w.index}", sink.tensors(self.example_inputs),
                                            static=False)   # a new leaf each call
            self._update.args = (self._anchor, *(n for w in weights for n in w.nodes), *sinks)
        return self.inputs

    # ---- graph edits (all in the top-level graph) ----

    def extra_input(self, source, prefix: str, static: bool = True) -> list[fx.Node]:
        """Top-level placeholders for the tensors ``source.tensors(args)`` gives at every call (an input
        of another kind than the state's, e.g. passes/cached_weights.py's cached FP8 weights);
        ``static``: the tensors stay at one address from call to call."""
        self.inputs.append(source)
        return self._placeholders(prefix, source.tensors(self.example_inputs), static)

    def _placeholders(self, prefix: str, tensors: list[torch.Tensor], static: bool = True) -> list[fx.Node]:
        """Placeholders after the existing inputs, with static-shape example values (``static``: also
        marked as living at one address, which the amax sinks, new at every call, do not)."""
        graph = self.top.graph
        last = self.top.placeholders()[-1]
        fake_mode = detect_fake_mode(self.example_inputs)
        nodes = []
        for i, t in enumerate(tensors):
            with graph.inserting_after(last):
                last = graph.placeholder(f"{prefix}_{i}")
            # aot_autograd reads every placeholder's Dynamo source; None marks an input that does not
            # come from user code (as DDPOptimizer's split graphs do).
            last._dynamo_source = None
            # a static input, as Dynamo marks one (torch._dynamo.mark_static_address): the state
            # tensors and the anchor are the same objects at every call and the graph updates the
            # state in place, so under CUDA graphs (mode="reduce-overhead") they are read and written
            # where they live, not copied into the graph's own input buffers at each replay
            if static:
                last.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
            if fake_mode is not None:
                last.meta["example_value"] = fake_mode.from_tensor(t, static_shapes=True)
            nodes.append(last)
        return nodes

    def _new_carrier(self, weight: _Weight, device: torch.device) -> fx.Node:
        graph = self.top.graph
        if self._update is None:
            [self._anchor] = self._placeholders("te_amax_anchor", [amax_anchor(device)])
            self.inputs.append(AnchorInput(device))
            first_op = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(first_op):
                # target and args are final only in finish(), once every site is known
                self._update = graph.call_function(DelayedScalingUpdate(UpdateSpec((), ())), ())
        with graph.inserting_after(self._carriers[-1] if self._carriers else self._update):
            carrier = graph.call_function(operator.getitem, (self._update, len(self._carriers)))
        fake_mode = detect_fake_mode(self.example_inputs)
        if fake_mode is not None:
            with fake_mode:
                carrier.meta["example_value"] = torch.zeros(len(weight.roles) * max(1, weight.experts), device=device)
        self._carriers.append(carrier)
        self._site_weights.append(weight.index)
        return carrier
