"""One delayed-scaling state update per compiled graph and training step, however many call sites.

DelayedScaling quantizes step t with the scales computed from the amaxes of steps <= t-1, so every
call site in a step must read the state as it was before the step, and the state must advance once:
a layer called twice (a shared block, a tied weight in a loop) contributes the max of its calls'
amaxes, as TransformerEngine's amax buffer does, not two history entries. And the update must wait
until nothing reads the old scales any more, including a backward that recomputes a checkpointed
forward.

The mechanism is a node at the start of the graph, ``DelayedScalingUpdate(spec)(anchor, *state)``,
whose outputs are tiny "amax carriers" (zeros, one per role), one per call site. Each site's lowering
takes its carrier as an input and returns its amaxes (a linear's input, weight, grad_output; an SDPA
site's query, key, value, grad_output) as the carrier's *gradient*.
Autograd runs the update node's backward only when every carrier's gradient is in, i.e. after the
backward of every site (recomputation included), and that backward pushes each weight's combined
amaxes into its histories and computes the next scales, in place. A forward without a backward
(evaluation, ``torch.no_grad()``, ``inference_mode``) never runs it: evaluation leaves the state
unchanged, as TransformerEngine skips amax updates when not training.

Across ranks (DDP, tensor parallel) the combined amaxes of all weights are all-reduced with MAX
before they enter the histories, packed into one buffer: one collective per graph and step for the
forward and backward amaxes together (TransformerEngine issues one per forward, eagerly, outside any
graph). A weight's groups are the amax group of its recipe (``reduce_amax``) and the mesh dims its
DTensor operands are sharded on, minus any group another covers; with the world as amax group that
is one group for all.

``anchor`` is a tensor that requires grad (te_compile.state.amax_anchor), so that the carriers do
even where no weight does (frozen weights); the update returns no gradient for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import AmaxGroup, reduce_amaxes
from ..fx.cache_names import name_lowering
from ..recipe import DelayedScaling
from ..kernels.delayed_update import delayed_scaling_update_op
from ..scaling import fp8_max, update_role_state
from ..recipe import GEMM_ROLES

__all__ = ["DelayedScalingUpdate", "UpdateSpec", "update_role_state", "amax_sink", "advance_delayed_state"]

@dataclass(frozen=True)
class UpdateSpec:
    """Which states (a weight's, an SDPA site's) a graph keeps and which state each carrier (call
    site) belongs to."""

    recipes: tuple[DelayedScaling, ...]   # per state, in the order of the state tensors
    site_weights: tuple[int, ...]         # per carrier: index into ``recipes``
    # per state: the groups its amaxes are all-reduced over (MAX) before the update; () for none
    groups: tuple[tuple[AmaxGroup, ...], ...] = ()
    # per state: its roles, in the order of its tensors; () when every state is a weight's (GEMM_ROLES)
    roles: tuple[tuple[str, ...], ...] = ()
    # per state: how many experts it keeps a history for (a 3-D expert weight's E; 0 for one history
    # per role); () when no state is an expert weight's
    experts: tuple[int, ...] = ()

    def roles_of(self, j: int) -> tuple[str, ...]:
        return self.roles[j] if self.roles else GEMM_ROLES

    def experts_of(self, j: int) -> int:
        return self.experts[j] if self.experts else 0

    def carrier_size(self, j: int) -> int:
        """Amaxes a site of state ``j`` returns: one per role, or per role and expert ([roles, E] flat)."""
        return len(self.roles_of(j)) * max(1, self.experts_of(j))

    def deferred(self, j: int) -> bool:
        """Whether state ``j`` advances at the optimizer step (``update_on = "optimizer_step"``): its
        amaxes leave the graph through a sink instead of updating the state in the backward."""
        return self.recipes[j].update_on == "optimizer_step"

    def state_offsets(self) -> list[int]:
        """Where each state's tensors start in the flat state list (2 per role), and the total last."""
        offsets = [0]
        for j in range(len(self.recipes)):
            offsets.append(offsets[-1] + 2 * len(self.roles_of(j)))
        return offsets


class _AmaxCarriers(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: UpdateSpec, anchor, *tensors):
        """tensors: the state tensors of every state, then one sink per deferred state."""
        ctx.spec = spec
        ctx.set_materialize_grads(False)  # a site whose backward never ran contributes nothing
        # only the states updated here are saved: a deferred state is written at the optimizer step,
        # after every backward of the step, and a saved copy would only pin its version
        offsets = spec.state_offsets()
        ctx.save_for_backward(*(t for j in range(len(spec.recipes)) if not spec.deferred(j)
                                for t in tensors[offsets[j]:offsets[j + 1]]))
        device = tensors[0].device
        return tuple(torch.zeros(spec.carrier_size(j), dtype=torch.float32, device=device)
                     for j in spec.site_weights)

    @staticmethod
    def backward(ctx, *site_amaxes):
        spec, saved = ctx.spec, ctx.saved_tensors
        weights, combined = [], []
        sink_grads = []   # per deferred state: its amaxes, or None when none of its sites ran backward
        for j in range(len(spec.recipes)):
            amaxes = [a for a, w in zip(site_amaxes, spec.site_weights) if w == j and a is not None]
            # max over the call sites of this weight; a NaN in any of them stays NaN (non-finite)
            amax = None if not amaxes else torch.stack(amaxes).amax(dim=0) if len(amaxes) > 1 else amaxes[0]
            if spec.deferred(j):
                sink_grads.append(amax)
            elif amax is not None:
                weights.append(j)
                combined.append(amax)
        if weights:
            if spec.groups:
                combined = reduce_amaxes(combined, [spec.groups[j] for j in weights])
            _update_states(spec, _saved_states(spec, saved), weights, combined)
        return (None, None) + (None,) * spec.state_offsets()[-1] + tuple(sink_grads)


def _saved_states(spec: UpdateSpec, saved) -> list:
    """The flat state list with the saved tensors of the states updated in the backward in their
    places (None for deferred states' tensors, which were not saved)."""
    out, it = [], iter(saved)
    offsets = spec.state_offsets()
    for j in range(len(spec.recipes)):
        n = offsets[j + 1] - offsets[j]
        out += [None] * n if spec.deferred(j) else [next(it) for _ in range(n)]
    return out


def _batchable(recipe: DelayedScaling) -> bool:
    """Whether the recipe's update is the multi-tensor kernel's rule (no user callables)."""
    return recipe.amax_compute_algo in ("max", "most_recent") and recipe.scaling_factor_compute_algo is None


def _update_states(spec: UpdateSpec, state, weights: list[int], combined: list[torch.Tensor]) -> None:
    """Fold ``combined[i]`` (amaxes [roles]) into the state of ``weights[i]``, in place.

    Rows with the same history length and window algorithm go to one call of the multi-tensor op
    (kernels/delayed_update.py), whatever their number, an expert weight's roles with their E rows
    each: one node in the graph, one launch on a GPU, instead of a few kernels per role. Recipes
    with user callables are updated role by role.
    """
    offsets = spec.state_offsets()
    groups: dict[tuple[int, bool], list] = {}   # (L, most_recent) -> rows (history, scale, amax, limit, divisor)
    for j, amax in zip(weights, combined):
        recipe = spec.recipes[j]
        tensors = state[offsets[j]:offsets[j + 1]]
        experts = spec.experts_of(j)
        rows = max(1, experts)   # an expert weight's role: histories [E, L], scales [E], one row each
        for r, role in enumerate(spec.roles_of(j)):
            history, scale, role_amax = tensors[2 * r], tensors[2 * r + 1], amax[r * rows:(r + 1) * rows]
            if not _batchable(recipe):
                update_role_state(history, scale, role_amax, role, recipe)
                continue
            limit = fp8_max(recipe.fp8_format.dtype_for(role))
            key = (history.shape[-1], recipe.amax_compute_algo == "most_recent")
            groups.setdefault(key, []).append((history, scale, role_amax, limit, float(2 ** recipe.margin)))
    for (_, most_recent), rows in groups.items():
        histories, scales, amaxes, limits, divisors = zip(*rows)
        delayed_scaling_update_op(list(histories), list(scales), torch.cat(amaxes).to(torch.float32),
                                  list(limits), list(divisors), most_recent)


class DelayedScalingUpdate:
    """Callable inserted at the start of a graph: ``(anchor, *state) -> carriers``, one per site.

    state: per state entry, per role of ``spec.roles_of(entry)``, (amax_history [L], scale [1]) — the
    order of ``te_compile.state.RoleStates.tensors()``; an expert weight's are [E, L] and [E].
    """

    def __init__(self, spec: UpdateSpec) -> None:
        self.spec = spec
        name_lowering(self, "te_delayed_scaling_update", __name__)  # FX codegen names the call after it

    def __call__(self, anchor: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """state: every state's tensors, then one amax sink per deferred state (``amax_sink``)."""
        sinks = sum(self.spec.deferred(j) for j in range(len(self.spec.recipes)))
        expected = self.spec.state_offsets()[-1] + sinks
        if len(state) != expected:
            raise ValueError(f"expected {expected} state tensors (2 per role, and {sinks} sinks) for "
                             f"{len(self.spec.recipes)} states, got {len(state)}")
        return _AmaxCarriers.apply(self.spec, anchor, *state)

    def __repr__(self) -> str:
        return f"DelayedScalingUpdate({len(self.spec.recipes)} states, {len(self.spec.site_weights)} sites)"


# ---- update_on = "optimizer_step": the amaxes of every backward of a step, folded once --------------

@dataclass
class _Pending:
    """A deferred state's amaxes since its last update, and what its update needs."""

    tensors: list                     # RoleStates.tensors(): per role (amax_history, scale)
    recipe: DelayedScaling
    roles: tuple[str, ...]
    experts: int
    groups: tuple[AmaxGroup, ...]
    amax: torch.Tensor                # [roles * max(1, E)], the max so far


_PENDING: dict[int, _Pending] = {}    # id(first state tensor) -> its pending amaxes, in arrival order
_HOOKED = False


def amax_sink(tensors: list, recipe: DelayedScaling, roles: tuple[str, ...], experts: int,
              groups: tuple) -> torch.Tensor:
    """A fresh leaf [roles * max(1, E)] that requires grad, for one call of a graph with a deferred
    state (``tensors``: that state's RoleStates.tensors()). The update node's backward returns the
    state's amaxes of that call as the leaf's gradient; a hook keeps their running max until the next
    optimizer step folds them into the state (``advance_delayed_state``). A leaf per call, so that two
    calls in one backward (a block run twice) are two gradients, never summed."""
    global _HOOKED
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(lambda *_: advance_delayed_state())
        _HOOKED = True
    sink = torch.zeros(len(roles) * max(1, experts), dtype=torch.float32, device=tensors[0].device,
                       requires_grad=True)

    def keep(leaf: torch.Tensor) -> None:
        amax, leaf.grad = leaf.grad.detach(), None
        entry = _PENDING.get(id(tensors[0]))
        if entry is None:
            _PENDING[id(tensors[0])] = _Pending(tensors, recipe, roles, experts, groups, amax.clone())
        else:   # torch.maximum keeps a NaN: a non-finite micro-batch makes the step's amax non-finite
            entry.amax = torch.maximum(entry.amax, amax)

    sink.register_post_accumulate_grad_hook(keep)
    return sink


def advance_delayed_state() -> int:
    """Fold the amaxes of every backward since the last call into their states (DelayedScaling with
    ``update_on = "optimizer_step"``): all-reduced with MAX per group (one collective per group for
    every state of every graph), pushed into the histories, the next scales computed. Runs after every
    ``torch.optim`` optimizer step by itself; call it after stepping any other optimizer. Every rank of
    a group must call it at the same point. Returns how many states advanced (0 when no backward ran
    since the last call, e.g. a second optimizer stepping in the same iteration)."""
    if not _PENDING:
        return 0
    # in the order their first backward reached them: the same on every rank of a group, which runs
    # the same graphs on the same micro-batch schedule, so the packed all-reduce lines up
    entries = list(_PENDING.values())
    _PENDING.clear()
    amaxes = reduce_amaxes([e.amax for e in entries], [e.groups for e in entries])
    # the backward's own update, over every pending state at once (one multi-tensor op)
    spec = UpdateSpec(tuple(e.recipe for e in entries), (), roles=tuple(e.roles for e in entries),
                      experts=tuple(e.experts for e in entries))
    with torch.no_grad():
        _update_states(spec, [t for e in entries for t in e.tensors], list(range(len(entries))), amaxes)
    return len(entries)
