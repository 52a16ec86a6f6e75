"""Delayed-scaling state (amax history and scale per role) kept as tensors the compiled graph owns.

A linear site's state is keyed by its weight ``nn.Parameter``: a recompile (new shapes, a graph
break) finds the same tensors, two models never share state, and ``load_recipe_state_dict`` can
create the state before the first compile. An SDPA site has no weight, so its state (per tensor:
query, key, value, grad_output) hangs off a parameter of the module that calls it (or of its nearest
ancestor that has one), under a site key ("sdpa"; "core.sdpa" for a parameter-less submodule "core"):
that parameter is what tells two instances of a module apart when they share one compiled graph. All
SDPA calls of one module share its state, as all calls of one weight share the weight's.
The backend registers these very tensors as buffers of the graph module, so the compiled forward and
backward update them in place (no host sync).

Inference graphs (compiled with grad disabled) never update state, and never create it either
(``read_state``, ``read_attention_state``): a weight that has none yet is read at the initial scales
(1), kept aside where ``recipe_state_dict`` does not see them, so that serving a model adds no keys to
what training, ``calibrate`` or ``load_recipe_state_dict`` gave it. Whichever of these first gives
the weight state takes those very tensors over: a graph that read them keeps reading the same
addresses (CUDA graphs) and now sees the state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .recipe import ATTENTION_ROLES, GEMM_ROLES

__all__ = ["RoleState", "LinearState", "AttentionState", "IncompatibleKeys", "recipe_state_dict",
           "load_recipe_state_dict", "state_tensors", "amax_anchor", "attention_key_param",
           "read_state", "read_attention_state"]

FIELDS = ("scale", "amax_history")
# the last component of an SDPA site's name in the state dict ("blocks.0.attn.sdpa")
ATTENTION_SITE = "sdpa"


@dataclass
class RoleState:
    amax_history: torch.Tensor   # fp32 [L], most recent first
    scale: torch.Tensor          # fp32 [1], used by the next quantize


class RoleStates:
    """A RoleState for each of ``ROLES``."""

    ROLES: tuple[str, ...] = ()

    def __init__(self, history_len: int, device: torch.device, experts: int = 0) -> None:
        self.history_len = history_len
        self.experts = experts   # E for a 3-D expert weight: histories [E, L], scales [E]; else 0
        lead = (experts,) if experts else ()
        self.roles = {
            role: RoleState(
                amax_history=torch.zeros(*lead, history_len, dtype=torch.float32, device=device),
                scale=torch.ones(experts or 1, dtype=torch.float32, device=device),
            )
            for role in self.ROLES
        }

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each field's shape, as ``recipe_state_dict`` writes it."""
        lead = (self.experts,) if self.experts else ()
        return {"amax_history": (*lead, self.history_len), "scale": (self.experts or 1,)}

    def tensors(self) -> list[torch.Tensor]:
        """Flat list in the order the lowering takes them: per role (amax_history, scale)."""
        out = []
        for role in self.ROLES:
            out += [self.roles[role].amax_history, self.roles[role].scale]
        return out


class LinearState(RoleStates):
    """The state of one weight: a RoleState per role of its GEMMs' operands (GEMM_ROLES); for a 3-D
    expert weight [E, ...], one history and scale per expert in each."""

    ROLES = GEMM_ROLES

    def __init__(self, history_len: int, device: torch.device, experts: int = 0) -> None:
        super().__init__(history_len, device, experts)
        # module paths of the linear sites that use this weight (the state's name in the state dict)
        self.sites: list[str] = []


class AttentionState(RoleStates):
    """The state of one SDPA call site: a RoleState per role in ATTENTION_ROLES."""

    ROLES = ATTENTION_ROLES


_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()
# key parameter -> {site key: (AttentionState, owner depth)}. The owner depth is how many name
# components the parameter has below the module that owns the site (2 for "qkv.weight"), so that the
# site's name follows the parameter's: "blocks.1.attn.qkv.weight" with "sdpa" is "blocks.1.attn.sdpa".
# State loaded before the first compile is registered under every parameter of the owner, so that
# whichever of them the graph receives (a graph split by DDP may lack some) finds it.
_ATTENTION: WeakIdKeyDictionary = WeakIdKeyDictionary()
# What inference graphs read for weights and SDPA sites that have no state (module docstring): weight
# -> LinearState, key parameter -> {site key: AttentionState}; never in a state dict.
_UNSET: WeakIdKeyDictionary = WeakIdKeyDictionary()
_UNSET_ATTENTION: WeakIdKeyDictionary = WeakIdKeyDictionary()
_ANCHORS: dict[torch.device, torch.Tensor] = {}


def state_for(weight: torch.Tensor, history_len: int, where: str) -> LinearState:
    """The state of ``weight``, created on first use. ``where`` names the site for errors."""
    state = _STATES.get(weight)
    experts = _experts(weight)
    if state is None:
        state = _linked_state(weight)
        if state is None:
            state = _take_unset(_UNSET.pop(weight, None), history_len, experts)
        if state is None:
            state = LinearState(history_len, weight.device, experts)
        _STATES[weight] = state
    _check(state, weight, history_len, where)
    return state


def read_state(weight: torch.Tensor, history_len: int, where: str) -> LinearState:
    """The state an inference graph reads for ``weight``: its own (as ``state_for``), else the initial
    state kept aside for it, which no state dict lists (module docstring)."""
    if weight in _STATES or _linked_state(weight) is not None:
        return state_for(weight, history_len, where)
    state = _UNSET.get(weight)
    if state is None:
        state = _UNSET[weight] = LinearState(history_len, weight.device, _experts(weight))
    _check(state, weight, history_len, where)
    return state


def _take_unset(state: Optional[RoleStates], history_len: int, experts: int = 0) -> Optional[RoleStates]:
    """``state``, what inference graphs have read for a weight or SDPA site without state, when it has
    the shape asked for (then it becomes the state); None otherwise (the graphs that read it find the
    new state at their next call, and its shape check names the mismatch)."""
    if state is None or state.history_len != history_len or state.experts != experts:
        return None
    return state


def _check(state: LinearState, weight: torch.Tensor, history_len: int, where: str) -> None:
    experts = _experts(weight)
    if state.experts != experts:
        raise ValueError(f"{where}: this weight of shape {list(weight.shape)} has state for "
                         f"{state.experts or 'no'} experts, expected {experts or 'none'} (loaded for another weight?)")
    if state.history_len != history_len:
        raise ValueError(
            f"{where}: the recipe asks for amax_history_len={history_len}, but this weight already "
            f"has state of length {state.history_len} (loaded or compiled earlier with another recipe)"
        )


def _experts(weight: torch.Tensor) -> int:
    """E for a 3-D expert weight [E, ...] (one state per expert), 0 for a linear's 2-D weight. A
    DTensor's are this rank's experts: the graph reads its local shard (``to_local()``)."""
    weight = getattr(weight, "_local_tensor", weight)
    return weight.shape[0] if weight.dim() == 3 else 0


def attention_state_for(param: torch.Tensor, site_key: str, owner_depth: int, history_len: int,
                        where: str, state: Optional[AttentionState] = None) -> AttentionState:
    """The state of the SDPA site ``site_key`` keyed on ``param``; created on first use, or ``state``
    registered under ``param`` if it has none yet."""
    sites = _ATTENTION.setdefault(param, {})
    if site_key not in sites:
        state = state or _take_unset(_UNSET_ATTENTION.get(param, {}).pop(site_key, None), history_len)
        sites[site_key] = (state or AttentionState(history_len, param.device), owner_depth)
    _check_attention(sites[site_key][0], history_len, where)
    return sites[site_key][0]


def read_attention_state(param: torch.Tensor, site_key: str, owner_depth: int, history_len: int,
                         where: str) -> AttentionState:
    """The state an inference graph reads for the SDPA site ``site_key`` keyed on ``param``: its own
    (as ``attention_state_for``), else the initial state kept aside for it, which no state dict lists
    (module docstring)."""
    if site_key in _ATTENTION.get(param, {}):
        return attention_state_for(param, site_key, owner_depth, history_len, where)
    sites = _UNSET_ATTENTION.setdefault(param, {})
    if site_key not in sites:
        sites[site_key] = AttentionState(history_len, param.device)
    _check_attention(sites[site_key], history_len, where)
    return sites[site_key]


def _check_attention(state: AttentionState, history_len: int, where: str) -> None:
    if state.history_len != history_len:
        raise ValueError(
            f"{where}: the recipe asks for amax_history_len={history_len}, but this attention site "
            f"already has state of length {state.history_len} (loaded or compiled earlier with another recipe)"
        )


def attention_key_param(names: list[str], owner: str) -> Optional[str]:
    """Of the parameter names ``names``, the one an SDPA site owned by module ``owner`` keys its state
    on: the first, in sorted order, under ``owner`` (any, for the root module ""); None if none is."""
    under = sorted(n for n in names if not owner or n.startswith(owner + "."))
    return under[0] if under else None


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
    their amax carriers (lowerings/delayed_state.py) get a backward even when no weight requires
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


def _attention_names(model: torch.nn.Module) -> dict[str, AttentionState]:
    """"<owner>.<site key>" -> state for every SDPA site of ``model`` that has state, named after its
    key parameter's first name (FSDP2: the state is on the unsharded parameter)."""
    unsharded = _fsdp_unsharded(model)
    out, seen = {}, set()
    for name, param in _unwrap(model).named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        key = param if param in _ATTENTION else unsharded.get(id(param))
        for site_key, (state, depth) in (_ATTENTION.get(key, {}) if key is not None else {}).items():
            out[".".join([*name.split(".")[:-depth], site_key])] = state
    return out


def _attention_targets(model: torch.nn.Module, site: str) -> Optional[tuple[str, list[tuple[torch.Tensor, int]]]]:
    """Where the state of SDPA site ``site`` ("<module>.sdpa") is to be registered: (site key, [(each
    parameter of the owning module, its owner depth)]), the owner found by the rule the attention pass
    follows (passes/attention.py); None when ``site`` names no module of ``model`` with a parameter."""
    module_path, _, last = site.rpartition(".")
    if last != ATTENTION_SITE:
        return None
    root = _unwrap(model)
    modules = dict(root.named_modules(remove_duplicate=False))
    if module_path not in modules:
        return None
    params = dict(root.named_parameters(remove_duplicate=False))
    # the owner: the module itself or its nearest ancestor that has a parameter
    parts = module_path.split(".") if module_path else []
    for n in range(len(parts), -1, -1):
        owner = ".".join(parts[:n])
        if attention_key_param(list(params), owner) is not None:
            site_key = site[len(owner) + 1:] if owner else site
            under = {id(p): (p, len(name.split(".")) - n) for name, p in params.items()
                     if not owner or name.startswith(owner + ".")}
            return site_key, list(under.values())
    return None


def _key(prefix: str, role: str, field_name: str) -> str:
    return ".".join(p for p in (prefix, role, field_name) if p)  # root module: no prefix


def recipe_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{"<fqn>.<role>.scale" | "<fqn>.<role>.amax_history": tensor}`` (copies) for every weight
    of ``model`` (compiled wrapper or original module) that has delayed-scaling state; one set of
    keys per parameter, however many modules share it. SDPA sites with state add
    ``"<module>.sdpa.<role>.<field>"`` (role in ATTENTION_ROLES)."""
    out = {}
    for prefix, state in _state_names(model).items():
        for role, rs in state.roles.items():
            for field_name in FIELDS:
                out[_key(prefix, role, field_name)] = getattr(rs, field_name).detach().clone()
    for name, state in _attention_names(model).items():
        for role, rs in state.roles.items():
            for field_name in FIELDS:
                out[_key(name, role, field_name)] = getattr(rs, field_name).detach().clone()
    return out


def state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The live tensors (not copies) of every delayed-scaling state ``model`` has: persistent like its
    buffers, so a count of what a step saves for backward leaves them out."""
    states = [*_state_names(model).values(), *_attention_names(model).values()]
    return [t for state in states for t in state.tensors()]


class IncompatibleKeys(NamedTuple):
    """What ``load_recipe_state_dict(..., strict=False)`` did not match, as in nn.Module."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _history_len(existing: Optional[RoleStates], given: dict) -> int:
    """The history length of state being loaded: the existing state's, else the saved history's."""
    history = next((v for (_, f), (_, v) in given.items() if f == "amax_history"), None)
    return (existing.history_len if existing is not None
            else history.shape[-1] if history is not None and history.dim() else 1024)


def _shape_problems(given: dict, history_len: int, experts: int = 0) -> list[str]:
    problems = []
    lead = (experts,) if experts else ()
    for (_, field_name), (key, value) in given.items():
        expected = (*lead, history_len) if field_name == "amax_history" else (experts or 1,)
        if tuple(value.shape) != expected:
            problems.append(f"{key} has shape {tuple(value.shape)}, expected {expected}")
    return problems


def _fsdp_problem(name: str) -> str:
    # FSDP2: the graph keys state by the unsharded parameter, which exists from the first all-gather on
    # (an FP8 all-gather weight links its state from the start)
    return (f"{name}: an FSDP2-sharded weight gets its state at its first all-gather; run one forward "
            f"before loading its recipe state")


def _sort_keys(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], prefixes: dict,
               attention: dict) -> tuple[list[str], dict[int, dict], dict[str, dict]]:
    """(unexpected keys, id(param) -> {(role, field): (key, value)}, SDPA site name -> the same) of
    ``state_dict``'s keys."""
    unexpected, entries, sites = [], {}, {}
    for key, value in state_dict.items():
        parts = key.rsplit(".", 2)
        if len(parts) == 2:  # a weight of the root module: "<role>.<field>"
            parts = ["", *parts]
        if len(parts) == 3 and parts[1] in GEMM_ROLES and parts[2] in FIELDS and parts[0] in prefixes:
            entries.setdefault(id(prefixes[parts[0]]), {})[(parts[1], parts[2])] = (key, value)
        elif (len(parts) == 3 and parts[1] in ATTENTION_ROLES and parts[2] in FIELDS
              and (parts[0] in attention or _attention_targets(model, parts[0]) is not None)):
            sites.setdefault(parts[0], {})[(parts[1], parts[2])] = (key, value)
        else:
            unexpected.append(key)
    return unexpected, entries, sites


def _missing_keys(model: torch.nn.Module, prefixes: dict, attention: dict, entries: dict[int, dict],
                  sites: dict[str, dict]) -> tuple[dict[int, str], list[str]]:
    """(id(param) -> its name, the missing keys): every role and field of each weight or site that
    has state already or is being loaded, named as recipe_state_dict names it. Adds an empty entry
    to ``entries`` / ``sites`` for each weight or site with state that ``state_dict`` does not name."""
    names: dict[int, str] = {}
    for prefix, param in prefixes.items():
        names.setdefault(id(param), prefix)
    for prefix in _state_names(model):
        names[id(prefixes[prefix])] = prefix
        entries.setdefault(id(prefixes[prefix]), {})
    for site in attention:
        sites.setdefault(site, {})
    missing = [_key(names[pid], role, f) for pid, given in entries.items()
               for role in GEMM_ROLES for f in FIELDS if (role, f) not in given]
    missing += [_key(site, role, f) for site, given in sites.items()
                for role in ATTENTION_ROLES for f in FIELDS if (role, f) not in given]
    return names, missing


def _weight_loads(prefixes: dict, entries: dict[int, dict], names: dict[int, str],
                  unsharded: dict) -> tuple[list, list[str]]:
    """(one (existing state or None, a function making it, {(role, field): (key, value)}) per weight
    named in ``entries``, what stops one)."""
    loads, problems = [], []
    params = {id(p): p for p in prefixes.values()}
    for pid, given in entries.items():
        if not given:
            continue
        existing = _state_of(params[pid], unsharded)
        if existing is None and pid in unsharded:
            if unsharded[pid] is None:
                problems.append(_fsdp_problem(names[pid]))
                continue
            params[pid] = unsharded[pid]
        history_len = _history_len(existing, given)
        # an FSDP2 shard's state is its unsharded weight's: every expert
        experts = existing.experts if existing is not None else _experts(params[pid])
        problems += _shape_problems(given, history_len, experts)
        where = f"load_recipe_state_dict({names[pid]!r})"
        loads.append((existing, lambda p=params[pid], n=history_len, w=where: state_for(p, n, w), given))
    return loads, problems


def _attention_loads(model: torch.nn.Module, attention: dict, sites: dict[str, dict],
                     unsharded: dict) -> tuple[list, list[str]]:
    """``_weight_loads`` for the SDPA sites named in ``sites``."""
    loads, problems = [], []
    for site, given in sites.items():
        if not given:
            continue
        existing = attention.get(site)
        history_len = _history_len(existing, given)
        problems += _shape_problems(given, history_len)
        if existing is not None:
            loads.append((existing, None, given))
            continue
        site_key, targets = _attention_targets(model, site)
        if any(id(p) in unsharded and unsharded[id(p)] is None for p, _ in targets):
            problems.append(_fsdp_problem(site))
            continue
        targets = [(unsharded.get(id(p)) or p, depth) for p, depth in targets]

        def register(targets=targets, key=site_key, n=history_len, w=f"load_recipe_state_dict({site!r})"):
            # what an inference graph read for the site, under whichever parameter it keys on
            unset = [_take_unset(_UNSET_ATTENTION.get(p, {}).pop(key, None), n) for p, _ in targets]
            state = next((u for u in unset if u is not None), None) or AttentionState(n, targets[0][0].device)
            for param, depth in targets:
                attention_state_for(param, key, depth, n, w, state)
            return state
        loads.append((None, register, given))
    return loads, problems


def load_recipe_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *,
                           strict: bool = True) -> IncompatibleKeys:
    """Copy saved state into ``model``'s state (in place, so compiled graphs see it), creating it
    if the model has not been compiled or run yet.

    Keys are matched as ``recipe_state_dict`` writes them (any name of a tied parameter is accepted).
    ``missing_keys``: the keys of every weight or SDPA site that has state or is named in
    ``state_dict`` that ``state_dict`` lacks; ``unexpected_keys``: keys that name no weight or SDPA
    site of the model or are not "<fqn>.<role>.<field>". With ``strict`` (the default) either is an
    error naming the keys; a value of the wrong shape is always an error. Nothing is copied when an
    error is raised.
    """
    prefixes = _prefixes(model)
    attention = _attention_names(model)
    unexpected, entries, sites = _sort_keys(model, state_dict, prefixes, attention)
    names, missing = _missing_keys(model, prefixes, attention, entries, sites)
    problems = []
    if strict and missing:
        problems.append(f"missing keys {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected} (keys are '<fqn>.<role>.<field>' naming a weight "
                        f"of this model, with role in {GEMM_ROLES}, or '<module>.sdpa.<role>.<field>' "
                        f"naming an SDPA site, with role in {ATTENTION_ROLES}; field in {FIELDS})")

    # Every check runs before the first copy: nothing is copied when an error is raised.
    unsharded = _fsdp_unsharded(model)
    weight_loads, weight_problems = _weight_loads(prefixes, entries, names, unsharded)
    site_loads, site_problems = _attention_loads(model, attention, sites, unsharded)
    problems += weight_problems + site_problems
    if problems:
        hint = " (strict=False loads the keys that match)" if strict and (missing or unexpected) else ""
        raise RuntimeError("load_recipe_state_dict: " + "; ".join(problems) + hint)

    for existing, create, given in weight_loads + site_loads:
        state = existing or create()
        for (role, field_name), (_, value) in given.items():
            with torch.no_grad():
                getattr(state.roles[role], field_name).copy_(value)
    return IncompatibleKeys(missing, unexpected)
