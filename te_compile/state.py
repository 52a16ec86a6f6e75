"""Delayed-scaling state (amax history and scale per role) kept as tensors the compiled graph owns.

State is keyed by the weight ``nn.Parameter`` of a linear site: a recompile (new shapes, a graph
break) finds the same tensors, two models never share state, and ``load_recipe_state_dict`` can
create the state before the first compile. The backend registers these very tensors as buffers of
the graph module, so the compiled forward and backward update them in place (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["RoleState", "LinearState", "recipe_state_dict", "load_recipe_state_dict"]

# Roles that keep delayed-scaling state for a linear layer.
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

    def tensors(self) -> list[torch.Tensor]:
        """Flat list in the order the lowering takes them: per role (amax_history, scale)."""
        out = []
        for role in STATE_ROLES:
            out += [self.roles[role].amax_history, self.roles[role].scale]
        return out


_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def state_for(weight: torch.Tensor, history_len: int, where: str) -> LinearState:
    """The state of ``weight``, created on first use. ``where`` names the site for errors."""
    state = _STATES.get(weight)
    if state is None:
        state = LinearState(history_len, weight.device)
        _STATES[weight] = state
    elif state.history_len != history_len:
        raise ValueError(
            f"{where}: the recipe asks for amax_history_len={history_len}, but this weight already "
            f"has state of length {state.history_len} (loaded or compiled earlier with another recipe)"
        )
    return state


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # torch.compile returns an OptimizedModule whose parameters live in _orig_mod.
    return getattr(model, "_orig_mod", model)


def _weights(model: torch.nn.Module):
    """(state key prefix, parameter) for every parameter of the model: "fc" for fc.weight (the
    module's FQN, as in TransformerEngine) and "block.w1" for any other parameter name."""
    for module_name, module in _unwrap(model).named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param_name == "weight":
                yield module_name, param
            else:
                yield (f"{module_name}.{param_name}" if module_name else param_name), param


def recipe_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{"<fqn>.<role>.scale" | "<fqn>.<role>.amax_history": tensor}`` (copies) for every weight
    of ``model`` (compiled wrapper or original module) that has delayed-scaling state."""
    out = {}
    for prefix, param in _weights(model):
        state = _STATES.get(param)
        if state is None:
            continue
        for role, rs in state.roles.items():
            for field_name in FIELDS:
                key = ".".join(p for p in (prefix, role, field_name) if p)  # root module: no prefix
                out[key] = getattr(rs, field_name).detach().clone()
    return out


def load_recipe_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy saved state into ``model``'s state (in place, so compiled graphs see it), creating it
    if the model has not been compiled or run yet. Unknown keys are an error."""
    prefixes = dict(_weights(model))
    by_prefix: dict[str, dict[tuple[str, str], torch.Tensor]] = {}
    for key, value in state_dict.items():
        parts = key.rsplit(".", 2)
        if len(parts) == 2:  # a weight of the root module: "<role>.<field>"
            parts = ["", *parts]
        if len(parts) != 3 or parts[1] not in STATE_ROLES or parts[2] not in FIELDS:
            raise ValueError(
                f"load_recipe_state_dict: bad key {key!r}; keys are '<fqn>.<role>.<field>' with role "
                f"in {STATE_ROLES} and field in {FIELDS}"
            )
        prefix, role, field_name = parts
        if prefix not in prefixes:
            raise ValueError(f"load_recipe_state_dict: {key!r} names no weight of this model")
        by_prefix.setdefault(prefix, {})[(role, field_name)] = value
    for prefix, entries in by_prefix.items():
        history = entries.get((STATE_ROLES[0], "amax_history"))
        history_len = history.numel() if history is not None else 1024
        state = state_for(prefixes[prefix], history_len, f"load_recipe_state_dict({prefix!r})")
        for (role, field_name), value in entries.items():
            target = getattr(state.roles[role], field_name)
            if target.shape != value.shape:
                raise ValueError(
                    f"load_recipe_state_dict: {prefix}.{role}.{field_name} has shape "
                    f"{tuple(value.shape)}, expected {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(value)

