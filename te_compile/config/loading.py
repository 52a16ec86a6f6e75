"""From TOML or ``torch.compile`` options to a ``TeConfig``: the sources, their precedence, the checks.

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
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping, Optional, Union

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..recipe import RECIPES, Format, Recipe
from .schema import (
    AMAX_GROUP_NAMES,
    COMPILERS,
    EXPERT_AMAX_GROUP_NAMES,
    INFERENCE_CHOICES,
    ConfigError,
    DistributedConfig,
    InferenceConfig,
    MemoryConfig,
    Override,
    RewriteConfig,
    TeConfig,
    glob_problem,
    group_problem,
    is_mesh,
)

__all__ = ["load_config", "config_from_dict", "resolve_config", "config_argument"]

_ENV_VAR = "TE_COMPILE_CONFIG"
_NONE_NAMES = ("none", "None")
_TOP_KEYS = ("recipe", "recipe_options", "rewrite", "overrides", "compiler", "native_block_gemm", "combo_kernels",
             "cache_fp8_weights", "distributed", "amax_group", "mesh", "inference", "memory")
_DISTRIBUTED_KEYS = ("amax_group", "expert_amax_group", "sharded_modules", "mesh", "pipeline_dims",
                     "context_parallel", "async_tp")
_OVERRIDE_KEYS = ("modules", "recipe", "recipe_options", "offload_activations")
_MEMORY_KEYS = ("offload_activations",)


def _error(source: str, key: str, problem: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {problem}")



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
    _check_keys(table, tuple(INFERENCE_CHOICES), "inference.", source)
    for key, v in table.items():
        if v not in INFERENCE_CHOICES[key]:
            raise _error(source, f"inference.{key}", f"must be one of {list(INFERENCE_CHOICES[key])}, got {v!r}")
    return InferenceConfig(**table)


def _build_override(item: Any, index: int, global_recipe: Optional[Recipe], source: str) -> Override:
    if isinstance(item, Override):
        return item
    key = f"overrides[{index}]"
    table = _table(item, key, source)
    _check_keys(table, _OVERRIDE_KEYS, f"{key}.", source)
    offload = table.get("offload_activations")
    if offload is not None:
        offload = _convert(offload, bool, f"{key}.offload_activations", source)
    # Both are required, but for an override that only sets offload_activations: an override
    # without a recipe would be ambiguous (global or default?).
    for required in ("modules", "recipe"):
        if required not in table and (required == "modules" or offload is None):
            raise _error(source, f"{key}.{required}",
                         f"missing required key; an override has keys {list(_OVERRIDE_KEYS)} "
                         f"(recipe may be left out when offload_activations is set)")
    problem = glob_problem(table["modules"])
    if problem:
        raise _error(source, f"{key}.modules", problem)
    if "recipe" not in table:
        if "recipe_options" in table:
            raise _error(source, f"{key}.recipe_options", "given without a recipe; name the recipe they belong to")
        # recipe_for passes over it: the module keeps the recipe the other overrides give it
        return Override(table["modules"], None, offload, sets_recipe=False)
    recipe, options = table["recipe"], table.get("recipe_options")
    # Naming the global recipe with no options of its own means "the global recipe here too",
    # e.g. to re-enable it inside a broader "none" override that comes later.
    if (options is None and global_recipe is not None and isinstance(recipe, str)
            and recipe == type(global_recipe).__name__):
        return Override(table["modules"], global_recipe, offload)
    return Override(table["modules"], _build_recipe(recipe, options, f"{key}.recipe", source), offload)


def _build_memory(value: Any, source: str) -> MemoryConfig:
    if isinstance(value, MemoryConfig):
        return value
    table = _table(value, "memory", source)
    _check_keys(table, _MEMORY_KEYS, "memory.", source)
    return MemoryConfig(**{k: _convert(v, bool, f"memory.{k}", source) for k, v in table.items()})


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
    for name, where, names in (("amax_group", key, AMAX_GROUP_NAMES),
                               ("expert_amax_group", "distributed.expert_amax_group", EXPERT_AMAX_GROUP_NAMES)):
        value = table.get(name, getattr(DistributedConfig, name))
        problem = group_problem(value, names)
        if problem:
            raise _error(source, where, problem)
        groups[name] = tuple(value) if isinstance(value, list) else value
    mesh = table.get("mesh")
    if mesh is not None and not is_mesh(mesh):
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
        problem = glob_problem(glob)
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
    if compiler not in COMPILERS:
        raise _error(source, "compiler", f"must be one of {list(COMPILERS)}, got {compiler!r}")
    native = _convert(data.get("native_block_gemm", TeConfig.native_block_gemm), bool,
                      "native_block_gemm", source)
    combo = _convert(data.get("combo_kernels", TeConfig.combo_kernels), bool, "combo_kernels", source)
    cache = _convert(data.get("cache_fp8_weights", TeConfig.cache_fp8_weights), bool, "cache_fp8_weights", source)
    return TeConfig(recipe=recipe, rewrite=rewrite, overrides=overrides, compiler=compiler,
                    native_block_gemm=native, combo_kernels=combo, cache_fp8_weights=cache,
                    distributed=_build_distributed(data, source),
                    inference=_build_inference(data.get("inference", {}), source),
                    memory=_build_memory(data.get("memory", {}), source), source=source)


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
