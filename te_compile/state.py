"""Delayed-scaling state (amax history and scale per role) kept as tensors the compiled graph owns.

State is keyed by the weight ``nn.Parameter`` of a linear site: a recompile (new shapes, a graph
break) finds the same tensors, two models never share state, and ``load_recipe_state_dict`` can
create the state before the first compile. The backend registers these very tensors as buffers of
the graph module, so the compiled forward and backward update them in place (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["RoleState", "LinearState", "IncompatibleKeys", "recipe_state_dict", "load_recipe_state_dict",
           "amax_anchor"]

# Roles that keep delayed-scaling state for a linear layer (lowerings/delayed_update.py's order).
STATE_ROLES = ("input", "weight", "grad_output")
FIELDS = ("scale", "amax_history")


@dataclass
class RoleState:
    amax_history: torch.Tensor   # fp32 [L], most recent first
    scale: torch.Tensor          # fp32 [1], used by the next quantize


class LinearState:
    """The state of one weight: a RoleState per role in STATE_ROLES."""

    def __init__(self, history_len: int, device: torch.device) -> None:
        self.history_len = history_len
        self.roles = {
            role: RoleState(
                amax_history=torch.zeros(history_len, dtype=torch.float32, device=device),
                scale=torch.ones(1, dtype=torch.float32, device=device),
            )
            for role in STATE_ROLES
        }
        # module paths of the linear sites that use this weight (the state's name in the state dict)
        self.sites: list[str] = []

    def tensors(self) -> list[torch.Tensor]:
        """Flat list in the order the lowering takes them: per role (amax_history, scale)."""
        out = []
        for role in STATE_ROLES:
            out += [self.roles[role].amax_history, self.roles[role].scale]
        return out


_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()
_ANCHORS: dict[torch.device, torch.Tensor] = {}


def state_for(weight: torch.Tensor, history_len: int, where: str) -> LinearState:
    """The state of ``weight``, created on first use. ``where`` names the site for errors."""
    state = _STATES.get(weight)
    if state is None:
        state = _linked_state(weight)
        if state is None:
            state = LinearState(history_len, weight.device)
        _STATES[weight] = state
    if state.history_len != history_len:
        raise ValueError(
            f"{where}: the recipe asks for amax_history_len={history_len}, but this weight already "
            f"has state of length {state.history_len} (loaded or compiled earlier with another recipe)"
        )
    return state


def _linked_state(weight) -> Optional[LinearState]:
    """The state a weight reaches through its quantizer (``linear_state``): an FP8 primary weight's
    (primary_weights.py) or an FSDP2 FP8 all-gather shard's (fsdp.py), also through the DTensor
    FSDP2 shards it into. Copies of such a weight (FSDP2's unsharded parameter) carry the quantizer,
    so they share the state: the scale the cast or the all-gather quantizes with is the one the graph
    updates."""
    local = getattr(weight, "_local_tensor", weight)
    return getattr(getattr(local, "_quantizer", None), "linear_state", None)


def amax_anchor(device: torch.device) -> torch.Tensor:
    """A scalar that requires grad, one per device, that compiled graphs take as an input so that
    their amax carriers (lowerings/delayed_update.py) get a backward even when no weight requires
    grad. Nothing ever writes a gradient into it."""
    device = torch.device(device)
    if device not in _ANCHORS:
        _ANCHORS[device] = torch.zeros((), device=device, requires_grad=True)
    return _ANCHORS[device]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # torch.compile returns an OptimizedModule whose parameters live in _orig_mod.
    return getattr(model, "_orig_mod", model)


def _prefixes(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """State key prefix -> parameter, for every name a parameter of the model has: "fc" for fc.weight
    (the module's FQN, as in TransformerEngine) and "block.w1" for any other parameter name. A tied
    parameter has several."""
    out = {}
    for module_name, module in _unwrap(model).named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            if param_name == "weight":
                out.setdefault(module_name, param)
            else:
                out.setdefault(f"{module_name}.{param_name}" if module_name else param_name, param)
    return out


def _fsdp_unsharded(model: torch.nn.Module) -> dict[int, Optional[torch.Tensor]]:
    """id(sharded parameter) -> FSDP2's unsharded parameter (None before its first all-gather), for
    the parameters of fully_shard-ed modules: a compiled graph sees, and keys state by, the
    unsharded one."""
    out = {}
    for module in _unwrap(model).modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if get_state is not None else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            out[id(fsdp_param.sharded_param)] = getattr(fsdp_param, "_unsharded_param", None)
    return out


def _state_of(param: torch.Tensor, unsharded: dict) -> Optional[LinearState]:
    """The state a model parameter already has: its own, the one its quantizer links, or (FSDP2) its
    unsharded parameter's."""
    state = _STATES.get(param)
    if state is None:
        state = _linked_state(param)
    if state is None and unsharded.get(id(param)) is not None:
        state = _STATES.get(unsharded[id(param)])
    return state


def _state_names(model: torch.nn.Module) -> dict[str, LinearState]:
    """One prefix per parameter that has state: among its names, the module of a linear site that
    uses it (a tied ``lm_head.weight is embed.weight`` is keyed "lm_head"), else its first name."""
    names: dict[int, list[str]] = {}
    states = {}
    unsharded = _fsdp_unsharded(model)
    for prefix, param in _prefixes(model).items():
        state = _state_of(param, unsharded)
        if state is not None:
            names.setdefault(id(param), []).append(prefix)
            states[id(param)] = state
    out = {}
    for key, prefixes in names.items():
        state = states[key]
        used = [p for p in prefixes if p in state.sites]
        out[(used or prefixes)[0]] = state
    return out


def _key(prefix: str, role: str, field_name: str) -> str:
    return ".".join(p for p in (prefix, role, field_name) if p)  # root module: no prefix


def recipe_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{"<fqn>.<role>.scale" | "<fqn>.<role>.amax_history": tensor}`` (copies) for every weight
    of ``model`` (compiled wrapper or original module) that has delayed-scaling state; one set of
    keys per parameter, however many modules share it."""
    out = {}
    for prefix, state in _state_names(model).items():
        for role, rs in state.roles.items():
            for field_name in FIELDS:
                out[_key(prefix, role, field_name)] = getattr(rs, field_name).detach().clone()
    return out


class IncompatibleKeys(NamedTuple):
    """What ``load_recipe_state_dict(..., strict=False)`` did not match, as in nn.Module."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_recipe_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *,
                           strict: bool = True) -> IncompatibleKeys:
    """Copy saved state into ``model``'s state (in place, so compiled graphs see it), creating it
    if the model has not been compiled or run yet.

    Keys are matched as ``recipe_state_dict`` writes them (any name of a tied parameter is accepted).
    ``missing_keys``: the keys of every weight that has state or is named in ``state_dict`` that
    ``state_dict`` lacks; ``unexpected_keys``: keys that name no weight of the model or are not
    "<fqn>.<role>.<field>". With ``strict`` (the default) either is an error naming the keys; a
    value of the wrong shape is always an error. Nothing is copied when an error is raised.
    """
    prefixes = _prefixes(model)
    unexpected, entries = [], {}   # id(param) -> {(role, field): (key, value)}
    for key, value in state_dict.items():
        parts = key.rsplit(".", 2)
        if len(parts) == 2:  # a weight of the root module: "<role>.<field>"
            parts = ["", *parts]
        if len(parts) != 3 or parts[1] not in STATE_ROLES or parts[2] not in FIELDS or parts[0] not in prefixes:
            unexpected.append(key)
            continue
        prefix, role, field_name = parts
        entries.setdefault(id(prefixes[prefix]), {})[(role, field_name)] = (key, value)

    # Expected: every role and field of each weight that has state already or is being loaded,
    # named as recipe_state_dict names it.
    names: dict[int, str] = {}
    for prefix, param in prefixes.items():
        names.setdefault(id(param), prefix)
    for prefix in _state_names(model):
        names[id(prefixes[prefix])] = prefix
        entries.setdefault(id(prefixes[prefix]), {})
    missing = [_key(names[pid], role, f) for pid, given in entries.items()
               for role in STATE_ROLES for f in FIELDS if (role, f) not in given]
    problems = []
    if strict and missing:
        problems.append(f"missing keys {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected} (keys are '<fqn>.<role>.<field>' naming a weight "
                        f"of this model, with role in {STATE_ROLES} and field in {FIELDS})")

    params = {id(p): p for p in prefixes.values()}
    unsharded = _fsdp_unsharded(model)
    loads = []
    for pid, given in entries.items():
        if not given:
            continue
        existing = _state_of(params[pid], unsharded)
        if existing is None and pid in unsharded:
            # FSDP2: the graph keys state by the unsharded parameter, which exists from the first
            # all-gather on (an FP8 all-gather weight links its state from the start)
            if unsharded[pid] is None:
                problems.append(f"{names[pid]}: an FSDP2-sharded weight gets its state at its first "
                                f"all-gather; run one forward before loading its recipe state")
                continue
            params[pid] = unsharded[pid]
        history = next((v for (_, f), (_, v) in given.items() if f == "amax_history"), None)
        history_len = (existing.history_len if existing is not None
                       else history.numel() if history is not None else 1024)
        for (_, field_name), (key, value) in given.items():
            expected = (history_len,) if field_name == "amax_history" else (1,)
            if tuple(value.shape) != expected:
                problems.append(f"{key} has shape {tuple(value.shape)}, expected {expected}")
        loads.append((params[pid], existing, history_len, names[pid], given))
    if problems:
        hint = " (strict=False loads the keys that match)" if strict and (missing or unexpected) else ""
        raise RuntimeError("load_recipe_state_dict: " + "; ".join(problems) + hint)

    for param, existing, history_len, prefix, given in loads:
        state = existing or state_for(param, history_len, f"load_recipe_state_dict({prefix!r})")
        for (role, field_name), (_, value) in given.items():
            with torch.no_grad():
                getattr(state.roles[role], field_name).copy_(value)
    return IncompatibleKeys(missing, unexpected)
