"""The configuration's types: frozen dataclasses whose fields say what each setting trades.

Each class checks its own values in ``__post_init__`` (a ``ValueError`` naming the field), so a config
built in Python is as safe as one read from TOML; loading.py maps the TOML strings onto these types and
reports mistakes with the source and key path. The validators the loader reuses are public here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from fnmatch import fnmatchcase
from typing import Any, Optional

from ..recipe import Float8CurrentScaling, Recipe

__all__ = [
    # the config's types
    "ConfigError", "TeConfig", "RewriteConfig", "Override", "DistributedConfig", "InferenceConfig", "MemoryConfig",
    # value checks the TOML loader reports with a source and key path
    "COMPILERS", "INFERENCE_CHOICES", "AMAX_GROUP_NAMES", "EXPERT_AMAX_GROUP_NAMES", "SMALL_GEMMS",
    "glob_problem", "group_problem", "is_mesh",
]

COMPILERS = ("inductor", "aot_eager")
INFERENCE_CHOICES = {"scaling": ("static", "current"), "activation_scaling": ("tensor", "row")}
AMAX_GROUP_NAMES = ("auto", "world", "none")
EXPERT_AMAX_GROUP_NAMES = ("same", "auto", "world", "none")
# [rewrite] small_gemms: "auto" keeps a GPU's too-small per-tensor GEMMs in high precision, "fp8" never does
SMALL_GEMMS = ("auto", "fp8")
_GROUP_FORMS = "a list of mesh dim names, or from Python a ProcessGroup or a DeviceMesh"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the source, the key path and valid values."""


def glob_problem(glob: Any) -> Optional[str]:
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
    # "auto": on a GPU a per-tensor linear whose GEMM is too small for FP8 to win (a lease measured it
    # slower) stays in high precision (passes/eligibility.py, why_small_gemm); "fp8": every eligible
    # linear runs in FP8 whatever its size
    small_gemms: str = "auto"

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
        if key == "small_gemms" and value not in SMALL_GEMMS:
            return f"must be one of {list(SMALL_GEMMS)}, got {value!r}"
        return None


@dataclass(frozen=True)
class Override:
    """A per-module recipe (and activation offload): ``modules`` is an fnmatch glob over the module FQN."""

    modules: str  # e.g. "layers.*.mlp.*"; '*' also matches across dots
    recipe: Optional[Recipe]  # None keeps the matching modules in high precision
    # True / False: offload (or not) the saved tensors the matching modules' forward makes, whatever
    # [memory] says; None: [memory]'s setting
    offload_activations: Optional[bool] = None
    # False: the override sets only offload_activations (its TOML table names no recipe), so
    # recipe_for passes over it to the next match and ``recipe`` is unused
    sets_recipe: bool = True

    def __post_init__(self):
        problem = glob_problem(self.modules)
        if problem:
            raise ValueError(f"Override.modules {problem}")
        if self.recipe is not None and not isinstance(self.recipe, Recipe):
            raise ValueError(f"Override.recipe must be a Recipe or None, got {self.recipe!r}")
        if self.offload_activations not in (None, True, False):
            raise ValueError(f"Override.offload_activations must be true, false or None, "
                             f"got {self.offload_activations!r}")
        if not self.sets_recipe and self.offload_activations is None:
            raise ValueError("an Override that sets no recipe must set offload_activations")


@dataclass(frozen=True)
class MemoryConfig:
    """What te does to the memory a training step holds (docs/memory.md)."""

    # The tensors the compiled forward saves for its backward move to host memory after their last
    # forward use and come back before their first backward use (torch's partitioner machinery; on an
    # accelerator on a side stream into pinned memory): device memory for PCIe traffic. FP8 saved
    # tensors move as their bytes and scales. [[overrides]] may set it per module.
    offload_activations: bool = False

    def __post_init__(self):
        if not isinstance(self.offload_activations, bool):
            raise ValueError(f"MemoryConfig.offload_activations must be true or false, "
                             f"got {self.offload_activations!r}")


def group_problem(value: Any, names: tuple[str, ...]) -> Optional[str]:
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


def is_mesh(value: Any) -> bool:
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
        for key, allowed in INFERENCE_CHOICES.items():
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
        for key, names in (("amax_group", AMAX_GROUP_NAMES), ("expert_amax_group", EXPERT_AMAX_GROUP_NAMES)):
            value = getattr(self, key)
            if isinstance(value, list):
                object.__setattr__(self, key, value := tuple(value))
            problem = group_problem(value, names)
            if problem:
                raise ValueError(f"DistributedConfig.{key}: {problem}")
        for glob in self.sharded_modules:
            problem = glob_problem(glob)
            if problem:
                raise ValueError(f"DistributedConfig.sharded_modules {problem}")
        if self.mesh is not None and not is_mesh(self.mesh):
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
    # inductor's combo kernels for te's GPU graphs: independent small kernels (a DelayedScaling site's
    # 1 / scale, amax finishes) launched as one; off until a lease times it against the default
    combo_kernels: bool = False
    # training: each weight quantized once per optimizer step, its FP8 copy reused by every
    # gradient-accumulation micro-batch until the weight changes (weight_cache.py); 1 byte per weight
    # element kept between steps, so off unless asked for
    cache_fp8_weights: bool = False
    distributed: DistributedConfig = DistributedConfig()
    inference: InferenceConfig = InferenceConfig()
    memory: MemoryConfig = MemoryConfig()
    source: str = "<defaults>"  # where the config came from, for messages and reports

    def __post_init__(self):
        if self.compiler not in COMPILERS:
            raise ValueError(f"TeConfig.compiler must be one of {list(COMPILERS)}, got {self.compiler!r}")
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

    def offload_for(self, fqn: str) -> bool:
        """Whether the saved tensors of module ``fqn``'s forward are offloaded: the first matching
        override that sets ``offload_activations``, else ``[memory] offload_activations``."""
        for override in self.overrides:
            if override.offload_activations is not None and fnmatchcase(fqn, override.modules):
                return override.offload_activations
        return self.memory.offload_activations

    def offload_key(self) -> Optional[str]:
        """The key that turns activation offload on somewhere (for error messages), or None if off."""
        if self.memory.offload_activations:
            return "memory.offload_activations"
        return next((f"overrides[{i}].offload_activations" for i, o in enumerate(self.overrides)
                     if o.offload_activations), None)

    def recipe_for(self, fqn: str) -> tuple[Optional[Recipe], str]:
        """(recipe, why) for a module FQN: the first matching override, else the global recipe."""
        for override in self.overrides:
            # fnmatchcase: module names are case-sensitive on every platform
            if override.sets_recipe and fnmatchcase(fqn, override.modules):
                return override.recipe, f"override {override.modules!r}"
        return self.recipe, "global"

