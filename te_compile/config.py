"""The backend's configuration: which recipe, which sites to rewrite, per-module overrides.

A config comes from exactly one place (see ``resolve_config``): ``torch.compile`` options, the file
named by ``TE_COMPILE_CONFIG``, ``./te_compile.toml``, ``[tool.te_compile]`` in ``./pyproject.toml``
or the defaults. The TOML schema is DESIGN.md §4. Strings in the file are mapped to recipe classes,
``Format`` members and imported callables here, and every mistake is a ``ConfigError`` naming the
source, the key path and what would be valid, so a typo never silently trains in the wrong precision.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import importlib
import os
import typing
from dataclasses import dataclass, fields, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Mapping, Optional, Union

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .recipe import RECIPES, Float8CurrentScaling, Format, Recipe

__all__ = [
    "ConfigError",
    "RewriteConfig",
    "Override",
    "DistributedConfig",
    "InferenceConfig",
    "TeConfig",
    "load_config",
    "config_from_dict",
    "resolve_config",
    "config_argument",
]

_ENV_VAR = "TE_COMPILE_CONFIG"
_COMPILERS = ("inductor", "aot_eager")
_NONE_NAMES = ("none", "None")
_TOP_KEYS = ("recipe", "recipe_options", "rewrite", "overrides", "compiler", "native_block_gemm", "distributed",
             "amax_group", "mesh", "inference")
_INFERENCE_CHOICES = {"scaling": ("static", "current"), "activation_scaling": ("tensor", "row")}
_DISTRIBUTED_KEYS = ("amax_group", "expert_amax_group", "sharded_modules", "mesh", "pipeline_dims",
                     "context_parallel", "async_tp")
_AMAX_GROUP_NAMES = ("auto", "world", "none")
_EXPERT_AMAX_GROUP_NAMES = ("same", "auto", "world", "none")
_GROUP_FORMS = "a list of mesh dim names, or from Python a ProcessGroup or a DeviceMesh"
_OVERRIDE_KEYS = ("modules", "recipe", "recipe_options")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the source, the key path and valid values."""


def _error(source: str, key: str, problem: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {problem}")


def _glob_problem(glob: Any) -> Optional[str]:
    """Why ``glob`` is not a usable fnmatch pattern over module FQNs, or None if it is."""
    if not isinstance(glob, str):
        return (f"must be a single glob string (write one [[overrides]] table per glob), "
                f"got {glob!r}")
    if not glob.strip():
        return f"must be a non-empty glob string, got {glob!r}"
    # fnmatch reads an unclosed '[' as a literal character, which is never what a user meant.
    i = glob.find("[")
    while i != -1:
        j = i + 1
        if glob[j:j + 1] == "!":
            j += 1
        if glob[j:j + 1] == "]":  # a ']' right after '[' (or '[!') is a member of the set
            j += 1
        close = glob.find("]", j)
        if close == -1:
            return f"glob {glob!r} has a '[' at position {i} without a closing ']'"
        i = glob.find("[", close + 1)
    return None


@dataclass(frozen=True)
class RewriteConfig:
    """Which site kinds the backend rewrites; a disabled kind stays in high precision."""

    linear: bool = True
    # the experts' grouped GEMMs of MoE layers (torch._grouped_mm and transformers' fallback op)
    grouped_linear: bool = True
    layer_norm: bool = True  # fused into the following linears' input quantization when possible
    rms_norm: bool = True
    activation: bool = True  # GELU / ReLU / ReLU² / SwiGLU fused into the following linear's quantization
    # off by default: FP8 attention costs accuracy that most models do not want to trade for speed
    sdpa: bool = False
    # the output layer and its cross_entropy as one chunked op: no [tokens, vocab] logits saved
    linear_cross_entropy: bool = True
    linear_cross_entropy_chunk: int = 0   # rows per chunk; 0: chosen from the shapes

    def __post_init__(self):
        for f in fields(self):
            problem = self.value_problem(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"{f.name}: {problem}")

    @staticmethod
    def value_problem(key: str, value: Any) -> Optional[str]:
        """Why ``value`` is not valid for ``key`` (beyond its type), or None."""
        if key == "linear_cross_entropy_chunk" and value < 0:
            return f"must be >= 0 (0: chosen from the shapes), got {value}"
        return None


@dataclass(frozen=True)
class Override:
    """A per-module recipe: ``modules`` is an fnmatch glob over the module FQN."""

    modules: str  # e.g. "layers.*.mlp.*"; '*' also matches across dots
    recipe: Optional[Recipe]  # None keeps the matching modules in high precision

    def __post_init__(self):
        problem = _glob_problem(self.modules)
        if problem:
            raise ValueError(f"Override.modules {problem}")
        if self.recipe is not None and not isinstance(self.recipe, Recipe):
            raise ValueError(f"Override.recipe must be a Recipe or None, got {self.recipe!r}")


def _group_problem(value: Any, names: tuple[str, ...]) -> Optional[str]:
    """Why ``value`` is no amax group setting (one of ``names``, a list of mesh dim names, a
    ProcessGroup, a DeviceMesh), or None. Dim names are checked against the mesh at compile time."""
    if isinstance(value, str):
        if value in names:
            return None
        return f"unknown amax group {value!r}; allowed: {list(names)}, {_GROUP_FORMS}"
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(d, str) and d for d in value):
            return f"a list of mesh dim names must be non-empty strings, got {list(value)!r}"
        if len(set(value)) != len(value):
            return f"mesh dim names repeat in {list(value)!r}"
        return None
    if _is_group_object(value):
        return None
    return f"expected {list(names)}, {_GROUP_FORMS}, got {value!r} ({type(value).__name__})"


def _is_mesh(value: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(value, DeviceMesh)


def _is_group_object(value: Any) -> bool:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    # NON_GROUP_MEMBER: what dist.new_group returns on a rank outside the group; the backend says so
    return isinstance(value, (dist.ProcessGroup, DeviceMesh)) or value is dist.GroupMember.NON_GROUP_MEMBER


@dataclass(frozen=True)
class InferenceConfig:
    """How graphs compiled with grad disabled (evaluation, ``generate()``) quantize (docs/inference.md)."""

    # DelayedScaling sites: "static" quantizes with the stored scales (trained or calibrated),
    # "current" with each tensor's own amax, as Float8CurrentScaling in the same formats
    scaling: str = "static"
    # the FP8 linears' inputs: "tensor", one scale per tensor; "row", one per token (torch._scaled_mm's
    # rowwise form), with norms, activations and the output layer's loss left unfused before them
    activation_scaling: str = "tensor"

    def __post_init__(self):
        for key, allowed in _INFERENCE_CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}: must be one of {list(allowed)}, got {getattr(self, key)!r}")


@dataclass(frozen=True)
class DistributedConfig:
    """Amax reductions across ranks (te_compile/distributed.py); nothing happens in one process."""

    # The group DelayedScaling's amaxes are all-reduced over (MAX) before they enter the histories,
    # so every rank keeps the same scales: "auto" (every dim of the device mesh but the pipeline dims,
    # or the world when no mesh is known; in a PipelineStage never another stage's ranks, pipeline.py
    # finds the stage), "world" (the default process group), "none" (each rank
    # keeps its own), a list of mesh dim names (["dp_replicate", "dp_shard", "tp"]: one group over
    # their product), or from Python a ProcessGroup or a DeviceMesh (all its dims). Recipes with
    # reduce_amax = false skip it. Tensors sharded as DTensors are reduced over their mesh dims anyway.
    amax_group: Any = "auto"
    # Module globs whose linear operands are shards of one tensor across the amax group although they
    # are plain tensors (tensor parallelism written by hand): current scaling all-reduces their
    # amaxes (input, weight, grad_output) over the amax group, so the bytes match one process.
    sharded_modules: tuple[str, ...] = ()
    # The group the DelayedScaling amaxes of MoE expert weights are all-reduced over: "same" (amax_group's:
    # right when every rank holds every expert, as under DDP or FSDP2), "none" (expert parallelism:
    # each rank's experts are its own, and no other rank sees their tokens), any form amax_group takes,
    # e.g. the mesh dims of the ranks holding the same experts. Under "same", expert weights that are
    # DTensors read through to_local() (torchtitan's expert parallelism) use the mesh dims that do not
    # shard the experts instead.
    expert_amax_group: Any = "same"
    # The DeviceMesh that mesh dim names (and "auto") refer to, from Python only (a TOML file cannot
    # hold one): the root mesh or any sub-mesh of it. None: the root mesh of the DTensors the graph
    # reads (tensor parallelism), if any.
    mesh: Any = None
    # Mesh dims that are pipeline stages: no amax is ever reduced across them ("auto" leaves them out,
    # naming one in amax_group is an error), since each stage holds other weights and runs other graphs.
    pipeline_dims: tuple[str, ...] = ("pp",)
    # The mesh dim whose ranks each hold a load-balanced slice of the sequence (context parallelism):
    # every SDPA site then runs te's context-parallel FP8 attention over it, K and V exchanged in FP8.
    # None: no context parallelism.
    context_parallel: Optional[str] = None
    # Async tensor parallelism: sequence-parallel FP8 linears issue their own all-gather / reduce-scatter
    # on FP8 data next to aten._scaled_mm, and inductor's micro-pipeline TP pass (turned on while te's
    # graphs compile) fuses each collective with its GEMM where the TP group has symmetric memory.
    # torch._inductor.config._micro_pipeline_tp = True set by the user means the same.
    async_tp: bool = False

    def __post_init__(self):
        if not isinstance(self.async_tp, bool):
            raise ValueError(f"async_tp must be true or false, got {self.async_tp!r}")
        if self.context_parallel is not None and (not isinstance(self.context_parallel, str)
                                                  or not self.context_parallel):
            raise ValueError(f"context_parallel must be a mesh dim name, got {self.context_parallel!r}")
        object.__setattr__(self, "sharded_modules", tuple(self.sharded_modules))
        object.__setattr__(self, "pipeline_dims", tuple(self.pipeline_dims))
        for key, names in (("amax_group", _AMAX_GROUP_NAMES), ("expert_amax_group", _EXPERT_AMAX_GROUP_NAMES)):
            value = getattr(self, key)
            if isinstance(value, list):
                object.__setattr__(self, key, value := tuple(value))
            problem = _group_problem(value, names)
            if problem:
                raise ValueError(f"DistributedConfig.{key}: {problem}")
        for glob in self.sharded_modules:
            problem = _glob_problem(glob)
            if problem:
                raise ValueError(f"DistributedConfig.sharded_modules {problem}")
        if self.mesh is not None and not _is_mesh(self.mesh):
            raise ValueError(f"DistributedConfig.mesh must be a DeviceMesh or None, got {self.mesh!r}")
        if not all(isinstance(d, str) and d for d in self.pipeline_dims):
            raise ValueError(f"DistributedConfig.pipeline_dims must be mesh dim names, got {list(self.pipeline_dims)!r}")

    def sharded(self, fqn: str) -> bool:
        return any(fnmatchcase(fqn, glob) for glob in self.sharded_modules)


@dataclass(frozen=True)
class TeConfig:
    """The resolved configuration of one ``torch.compile(..., backend="te")`` call."""

    # None = high precision everywhere (the backend still records a report of the sites)
    recipe: Optional[Recipe] = Float8CurrentScaling()
    rewrite: RewriteConfig = RewriteConfig()
    overrides: tuple[Override, ...] = ()  # first match wins
    # "aot_eager" skips inductor codegen: much faster to compile, for debugging the rewrites
    compiler: str = "inductor"
    # Block-scaled recipes: native GEMMs where the device passes gemm/block_probe.py's self-test; False
    # keeps the exact dequantize-then-matmul emulation everywhere (A/B checks, a suspect cuBLAS)
    native_block_gemm: bool = True
    distributed: DistributedConfig = DistributedConfig()
    inference: InferenceConfig = InferenceConfig()
    source: str = "<defaults>"  # where the config came from, for messages and reports

    def __post_init__(self):
        if self.compiler not in _COMPILERS:
            raise ValueError(f"TeConfig.compiler must be one of {list(_COMPILERS)}, got {self.compiler!r}")
        # a list from Python callers becomes a tuple, so the config stays immutable and hashable
        object.__setattr__(self, "overrides", tuple(self.overrides))

    def for_inference(self) -> "TeConfig":
        """The config a graph compiled with grad disabled runs under: ``[inference] scaling = "current"``
        turns DelayedScaling into its current-scaling counterpart; ``activation_scaling = "row"`` leaves
        norms, activations and the fused output layer unfused (they hand the linears per-tensor FP8)."""
        setting = self.inference

        def swap(recipe):
            current = setting.scaling == "current" and recipe is not None and recipe.delayed()
            return recipe.current_scaling() if current else recipe

        rewrite = self.rewrite
        if setting.activation_scaling == "row":
            rewrite = replace(rewrite, layer_norm=False, rms_norm=False, activation=False,
                              linear_cross_entropy=False)
        return replace(self, recipe=swap(self.recipe), rewrite=rewrite,
                       overrides=tuple(replace(o, recipe=swap(o.recipe)) for o in self.overrides))

    def recipe_for(self, fqn: str) -> tuple[Optional[Recipe], str]:
        """(recipe, why) for a module FQN: the first matching override, else the global recipe."""
        for override in self.overrides:
            # fnmatchcase: module names are case-sensitive on every platform
            if fnmatchcase(fqn, override.modules):
                return override.recipe, f"override {override.modules!r}"
        return self.recipe, "global"


# what "recipe" means when a config does not name one
_DEFAULT_RECIPE = type(TeConfig.recipe).__name__


# ---------------------------------------------------------------------------------------------
# Values: TOML scalars to the types of dataclass fields


def _is_callable_hint(hint: Any) -> bool:
    candidates = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    return any(h is collections.abc.Callable or typing.get_origin(h) is collections.abc.Callable
               for h in candidates)


def _import_callable(spec: str, key: str, source: str):
    """Import ``"package.module:function"`` (the attribute may be dotted, e.g. ``mod:Class.fn``)."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path or ":" in attr_path:
        raise _error(source, key, f"expected 'package.module:function', got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise _error(source, key, f"cannot import module {module_name!r} from {spec!r}: "
                                  f"{type(e).__name__}: {e}") from e
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise _error(source, key, f"module {module_name!r} has no attribute {attr_path!r} "
                                      f"(from {spec!r})")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise _error(source, key, f"{spec!r} is not callable, got {obj!r}")
    return obj


def _convert(value: Any, hint: Any, key: str, source: str) -> Any:
    """Check ``value`` against a field's type hint and map names to Formats / callables."""
    got = f"got {value!r} ({type(value).__name__})"
    # bool is a subclass of int: a flag where a number is expected (or vice versa) is a mistake.
    if hint is bool:
        if not isinstance(value, bool):
            raise _error(source, key, f"expected a bool (true or false), {got}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _error(source, key, f"expected an int, {got}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _error(source, key, f"expected a float, {got}")
        return float(value)
    if hint is Format:
        if isinstance(value, str):
            try:
                return Format.from_name(value)
            except ValueError as e:
                raise _error(source, key, str(e)) from None
        if isinstance(value, Format):
            return value
        raise _error(source, key, f"expected a format name, one of {[f.name for f in Format]}, {got}")
    if _is_callable_hint(hint):
        if callable(value) or (value is None and type(None) in typing.get_args(hint)):
            return value
        if isinstance(value, str) and ":" in value:
            return _import_callable(value, key, source)
        if isinstance(value, str) and str in typing.get_args(hint):
            return value  # a named algorithm such as "max"; the recipe checks the name
        raise _error(source, key, f"expected a callable or a 'package.module:function' string, {got}")
    return value


def _table(value: Any, key: str, source: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise _error(source, key, f"expected a table, got {value!r} ({type(value).__name__})")
    return value


def _check_keys(table: Mapping, allowed: tuple[str, ...], prefix: str, source: str) -> None:
    for key in table:
        if key not in allowed:
            raise _error(source, f"{prefix}{key}", f"unknown key; allowed keys: {list(allowed)}")


# ---------------------------------------------------------------------------------------------
# Sections


def _recipe_name(value: Any) -> Optional[str]:
    """The class name a ``recipe`` value stands for ("none" for high precision)."""
    if value is None or value in _NONE_NAMES:
        return "none"
    if isinstance(value, Recipe):
        return type(value).__name__
    return value if isinstance(value, str) else None


def _build_recipe(value: Any, options: Any, key: str, source: str) -> Optional[Recipe]:
    """``value`` is a recipe name, "none" or a Recipe; ``options`` (or None) the table of its fields."""
    options_key = f"{key}_options"
    if isinstance(value, Recipe):
        cls, base = type(value), value
    elif _recipe_name(value) == "none":
        if options is not None:
            raise _error(source, options_key, f"{key} is {value!r} (high precision), which takes no "
                                              f"options; remove {options_key} or name a recipe")
        return None
    elif isinstance(value, str) and value in RECIPES:
        cls, base = RECIPES[value], None
    else:
        allowed = [*RECIPES, "none"]
        hint = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.6)
        maybe = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise _error(source, key, f"unknown recipe {value!r}{maybe}; allowed: {allowed}")

    options = _table(options if options is not None else {}, options_key, source)
    hints = typing.get_type_hints(cls)
    names = cls.option_names()
    kwargs = {}
    for name, option in options.items():
        if name not in names:
            raise _error(source, f"{options_key}.{name}",
                         f"unknown option of {cls.__name__}; allowed: {names}")
        kwargs[name] = _convert(option, hints[name], f"{options_key}.{name}", source)
    try:
        # A Recipe object given in Python options is the base its options are applied to.
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except ValueError as e:  # the recipe's own range checks (recipe.py __post_init__)
        raise _error(source, options_key, str(e)) from None


def _build_rewrite(value: Any, source: str) -> RewriteConfig:
    if isinstance(value, RewriteConfig):
        return value
    table = _table(value, "rewrite", source)
    allowed = tuple(f.name for f in fields(RewriteConfig))
    _check_keys(table, allowed, "rewrite.", source)
    hints = typing.get_type_hints(RewriteConfig)
    values = {k: _convert(v, hints[k], f"rewrite.{k}", source) for k, v in table.items()}
    for key, v in values.items():
        if problem := RewriteConfig.value_problem(key, v):
            raise _error(source, f"rewrite.{key}", problem)
    return RewriteConfig(**values)


def _build_inference(value: Any, source: str) -> InferenceConfig:
    if isinstance(value, InferenceConfig):
        return value
    table = _table(value, "inference", source)
    if "kv_cache" in table:
        # transformers makes the cache inside generate(), before the compiled forward runs: a backend
        # sees its buffers as inputs and cannot change their dtype, so the FP8 cache is an object
        raise _error(source, "inference.kv_cache", "not a config key: pass generate(cache="
                     "te_compile.fp8_static_cache(model.config, max_cache_len)) for an FP8 key/value cache, "
                     "which te's attention then reads as bytes")
    _check_keys(table, tuple(_INFERENCE_CHOICES), "inference.", source)
    for key, v in table.items():
        if v not in _INFERENCE_CHOICES[key]:
            raise _error(source, f"inference.{key}", f"must be one of {list(_INFERENCE_CHOICES[key])}, got {v!r}")
    return InferenceConfig(**table)


def _build_override(item: Any, index: int, global_recipe: Optional[Recipe], source: str) -> Override:
    if isinstance(item, Override):
        return item
    key = f"overrides[{index}]"
    table = _table(item, key, source)
    _check_keys(table, _OVERRIDE_KEYS, f"{key}.", source)
    # Both are required: an override without a recipe would be ambiguous (global or default?).
    for required in ("modules", "recipe"):
        if required not in table:
            raise _error(source, f"{key}.{required}",
                         f"missing required key; an override has keys {list(_OVERRIDE_KEYS)}")
    problem = _glob_problem(table["modules"])
    if problem:
        raise _error(source, f"{key}.modules", problem)
    recipe, options = table["recipe"], table.get("recipe_options")
    # Naming the global recipe with no options of its own means "the global recipe here too",
    # e.g. to re-enable it inside a broader "none" override that comes later.
    if (options is None and global_recipe is not None and isinstance(recipe, str)
            and recipe == type(global_recipe).__name__):
        return Override(table["modules"], global_recipe)
    return Override(table["modules"], _build_recipe(recipe, options, f"{key}.recipe", source))


def _build_distributed(data: Mapping, source: str) -> DistributedConfig:
    """The [distributed] table; a top-level ``amax_group`` (handy in Python options) overrides its key."""
    value = data.get("distributed", {})
    if isinstance(value, DistributedConfig):
        table = {"amax_group": value.amax_group, "sharded_modules": value.sharded_modules,
                 "expert_amax_group": value.expert_amax_group, "mesh": value.mesh,
                 "pipeline_dims": value.pipeline_dims, "context_parallel": value.context_parallel,
                 "async_tp": value.async_tp}
    else:
        table = dict(_table(value, "distributed", source))
        _check_keys(table, _DISTRIBUTED_KEYS, "distributed.", source)
    key = "distributed.amax_group"
    if "amax_group" in data:
        table["amax_group"], key = data["amax_group"], "amax_group"
    mesh_key = "distributed.mesh"
    if "mesh" in data:
        table["mesh"], mesh_key = data["mesh"], "mesh"
    groups = {}
    for name, where, names in (("amax_group", key, _AMAX_GROUP_NAMES),
                               ("expert_amax_group", "distributed.expert_amax_group", _EXPERT_AMAX_GROUP_NAMES)):
        value = table.get(name, getattr(DistributedConfig, name))
        problem = _group_problem(value, names)
        if problem:
            raise _error(source, where, problem)
        groups[name] = tuple(value) if isinstance(value, list) else value
    mesh = table.get("mesh")
    if mesh is not None and not _is_mesh(mesh):
        raise _error(source, mesh_key, f"expected a DeviceMesh (from Python: options={{'mesh': mesh}}), got "
                                       f"{mesh!r} ({type(mesh).__name__})")
    pipeline = table.get("pipeline_dims", DistributedConfig.pipeline_dims)
    if isinstance(pipeline, str) or not isinstance(pipeline, (list, tuple)) or not all(
            isinstance(d, str) and d for d in pipeline):
        raise _error(source, "distributed.pipeline_dims", f"expected an array of mesh dim names, got {pipeline!r}")
    globs = table.get("sharded_modules", ())
    if isinstance(globs, str) or not isinstance(globs, (list, tuple)):
        raise _error(source, "distributed.sharded_modules", f"expected an array of module globs, got {globs!r}")
    for i, glob in enumerate(globs):
        problem = _glob_problem(glob)
        if problem:
            raise _error(source, f"distributed.sharded_modules[{i}]", problem)
    cp = table.get("context_parallel")
    if cp is not None and (not isinstance(cp, str) or not cp):
        raise _error(source, "distributed.context_parallel", f"expected a mesh dim name, got {cp!r}")
    async_tp = table.get("async_tp", False)
    if not isinstance(async_tp, bool):
        raise _error(source, "distributed.async_tp", f"expected true or false, got {async_tp!r}")
    return DistributedConfig(groups["amax_group"], tuple(globs), groups["expert_amax_group"], mesh, tuple(pipeline),
                             cp, async_tp)


def config_from_dict(data: Mapping, source: str) -> TeConfig:
    """Validate a parsed TOML table (or an options dict without "config") into a ``TeConfig``."""
    data = _table(data, "<top level>", source)
    _check_keys(data, _TOP_KEYS, "", source)
    recipe = _build_recipe(data.get("recipe", _DEFAULT_RECIPE),
                           data.get("recipe_options"), "recipe", source)
    rewrite = _build_rewrite(data.get("rewrite", {}), source)
    items = data.get("overrides", ())
    if not isinstance(items, (list, tuple)):
        raise _error(source, "overrides", f"expected an array of tables ([[overrides]]), got {items!r}")
    overrides = tuple(_build_override(item, i, recipe, source) for i, item in enumerate(items))
    compiler = data.get("compiler", TeConfig.compiler)
    if compiler not in _COMPILERS:
        raise _error(source, "compiler", f"must be one of {list(_COMPILERS)}, got {compiler!r}")
    native = _convert(data.get("native_block_gemm", TeConfig.native_block_gemm), bool,
                      "native_block_gemm", source)
    return TeConfig(recipe=recipe, rewrite=rewrite, overrides=overrides, compiler=compiler,
                    native_block_gemm=native, distributed=_build_distributed(data, source),
                    inference=_build_inference(data.get("inference", {}), source), source=source)


# ---------------------------------------------------------------------------------------------
# Sources


def _read_toml(path: Path, source: str) -> dict:
    # name the resolved path too when the source spells it differently (relative, or an env var)
    where = "" if str(path) == source else f" ({path})"
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found{where}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML{where}: {e}") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read the config file{where}: {e.strerror or e}") from None


def load_config(path: Union[str, os.PathLike]) -> TeConfig:
    """Read one TOML config file (the schema of DESIGN.md §4)."""
    return config_from_dict(_read_toml(Path(path), str(path)), str(path))


def _layer_options(base: Mapping, inline: Mapping, source: str) -> dict:
    """Inline options over a file's table: recipe_options merge key by key, other keys replace.

    Flat keys that are fields of the chosen recipe (``{"amax_history_len": 16}``) join recipe_options.
    """
    merged = {**base, **{k: v for k, v in inline.items() if k in _TOP_KEYS}}
    name = _recipe_name(merged.get("recipe", _DEFAULT_RECIPE))
    layers = [inline.get("recipe_options", {}), {k: v for k, v in inline.items() if k not in _TOP_KEYS}]
    # The file's recipe_options belong to the file's recipe; they do not carry over to another one.
    if "recipe_options" in base and name == _recipe_name(base.get("recipe", _DEFAULT_RECIPE)):
        layers.insert(0, base["recipe_options"])
    elif "recipe_options" in base and "recipe_options" not in inline:
        del merged["recipe_options"]

    allowed = RECIPES[name].option_names() if name in RECIPES else []
    for key in layers[-1]:
        # With an unknown recipe name, config_from_dict reports the name rather than this key.
        if key not in allowed and (name in RECIPES or name == "none"):
            fields_text = f" or a field of {name}: {allowed}" if allowed else " (recipe 'none' has no fields)"
            raise _error(source, key, f"unknown option; allowed: the top-level keys {list(_TOP_KEYS)}"
                                      f"{fields_text}")
    if "recipe_options" in merged or layers[-1]:
        merged["recipe_options"] = {}
        for layer in layers:
            merged["recipe_options"].update(_table(layer, "recipe_options", source))
    return merged


def _from_options(options: Mapping, cwd: Path) -> TeConfig:
    inline = {k: v for k, v in options.items() if k != "config"}
    if "config" not in options:
        return config_from_dict(_layer_options({}, inline, "options"), "options")
    path = options["config"]
    if not isinstance(path, (str, os.PathLike)):
        raise _error("options", "config", f"expected a path to a TOML file, got {path!r}")
    source = f"options[config]={path}"
    base = _read_toml(cwd / path, source)
    return config_from_dict(_layer_options(base, inline, source), source)


def resolve_config(options: Optional[Mapping] = None, *, cwd: Union[str, os.PathLike, None] = None
                   ) -> TeConfig:
    """The config from the first source that exists; sources are not merged with each other.

    1. ``options`` (``torch.compile(..., options=...)``): ``"config": path`` and/or inline keys;
    2. the file named by the ``TE_COMPILE_CONFIG`` environment variable;
    3. ``<cwd>/te_compile.toml``;
    4. the ``[tool.te_compile]`` table of ``<cwd>/pyproject.toml``;
    5. ``TeConfig()``.
    Relative paths are taken against ``cwd`` (default: the process's working directory).
    """
    cwd = Path.cwd() if cwd is None else Path(cwd)
    if options:
        return _from_options(options, cwd)
    env_path = os.environ.get(_ENV_VAR)
    if env_path:
        source = f"{_ENV_VAR}={env_path}"
        return config_from_dict(_read_toml(cwd / env_path, source), source)
    local = cwd / "te_compile.toml"
    if local.is_file():
        return config_from_dict(_read_toml(local, str(local)), str(local))
    pyproject = cwd / "pyproject.toml"
    if pyproject.is_file():
        source = f"{pyproject} [tool.te_compile]"
        tool = _read_toml(pyproject, str(pyproject)).get("tool")
        table = tool.get("te_compile") if isinstance(tool, dict) else None
        if table is not None:
            return config_from_dict(table, source)
    return TeConfig()


def config_argument(config: Union[str, os.PathLike, TeConfig, None], options: Mapping, who: str) -> TeConfig:
    """The TeConfig an API call taking ``config`` (a TOML path or TeConfig, optional) and inline
    ``options`` means: the options layered over the file, or resolved as ``torch.compile(...,
    options=...)`` would be when no file is given."""
    if isinstance(config, TeConfig):
        if options:
            raise ValueError(f"{who}: pass either a TeConfig or inline options, not both")
        return config
    if config is not None:
        return resolve_config({"config": os.fspath(config), **options}) if options else load_config(config)
    return resolve_config(dict(options) or None)
