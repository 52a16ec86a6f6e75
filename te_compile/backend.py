"""The ``te`` Dynamo backend: config -> passes -> lowerings -> inductor (or aot_eager).

For each graph Dynamo hands it, the backend resolves the config as it applies to that graph
(``passes/settings.py``), runs ``PASSES`` over a copy of the graph in order (``run_passes``: the
order and what each pass hands the next are in passes/README.md), and compiles the result with
inductor, appending the recipe state the passes asked for to every call's inputs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch._dynamo.exc import ShortenTraceback
from torch._guards import detect_fake_mode

from .config import ConfigError, TeConfig, config_argument, resolve_config
from .eager_experts import trace_eager_experts
from .library_warnings import ignore_library_warnings
from .passes.activation_fusion import fuse_activations, fuse_hand_written_activations
from .passes.async_tp import async_tp_enabled
from .passes.attention import rewrite_attention
from .passes.attention_projection import hand_off_fp8_mha
from .passes.context import PassContext
from .passes.delayed_state import DelayedState, ExtraInput
from .passes.grouped_linear import rewrite_grouped_linears
from .passes.linear import rewrite_linears
from .passes.linear_cross_entropy import fuse_linear_cross_entropy
from .passes.norm_fusion import fuse_norms
from .passes.settings import PassSettings, resolve_settings
from .fx.cache_names import publish_lowerings
from .fx.graphs import GraphScope, graph_scopes
from .fx.naming import FrameInstances
from .fx.micro_pipeline import micro_pipeline_tp
from .fx.offload import OffloadPartitioner
from .hardware import is_activation_offload_available
from .report import Report, SiteRecord, add_records, next_graph_id

__all__ = ["te_backend", "backend", "run_passes", "PASSES", "PassResult"]

log = logging.getLogger("te_compile")

# transformers' eager experts loops and one-time warnings must be registered with Dynamo before it
# first traces them
trace_eager_experts()
ignore_library_warnings()


Pass = Callable[[PassContext, GraphScope], int]

# The order matters (passes/README.md says why): the norm and activation passes fuse into
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
    the extra inputs the rewritten graph takes.

    The driver knows no site kind and works out no setting: it runs each pass over each graph, lets
    the DelayedScaling state the passes collected wire itself in, and cleans up (dead code, stable
    lowering names for AOTAutograd's cache, lint, recompile)."""
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


@contextlib.contextmanager
def _scaled_gemm_inputs_realized() -> Iterator[None]:
    """While te's graphs lower: inductor writes a node once for all its readers when one of them is in
    its ``needs_realized_inputs`` set, which holds ``mm`` and ``_grouped_mm`` but not the scaled GEMMs.
    Without them an FP8 operand that several ``_scaled_mm`` calls read (q, k and v reading one norm's
    output) is written once per GEMM, in one kernel with as many stores: on an H100 the transposed
    wgrad operand of q, k and v took 2.5 ms a layer written three times, 0.7 written once."""
    from torch._inductor.lowering import needs_realized_inputs

    ops = [getattr(torch.ops.aten, name).default for name in ("_scaled_mm", "_scaled_grouped_mm")
           if hasattr(torch.ops.aten, name)]
    added = [op for op in ops if op not in needs_realized_inputs]
    needs_realized_inputs.update(added)
    try:
        yield
    finally:
        for op in added:
            needs_realized_inputs.discard(op)


def _inner_compile(gm: fx.GraphModule, example_inputs: Sequence, **kwargs):
    """inductor's compile_fx_inner for te's forward and backward graphs (the backward's compile may
    come later, at the first backward; inductor keeps this function for it)."""
    from torch._inductor.compile_fx import compile_fx_inner

    with _scaled_gemm_inputs_realized():
        return compile_fx_inner(gm, example_inputs, **kwargs)


def _final_compiler(gm: fx.GraphModule, example_inputs: Sequence, config: TeConfig,
                    mode: Optional[str], cacheable: Optional[dict[str, str]] = None,
                    offload: Optional[OffloadPartitioner] = None) -> Callable:
    """aot_eager or inductor (with ``mode``'s options) on the rewritten graph. ``cacheable``: the
    lowerings' published names (fx/cache_names.py), vouched for to AOTAutograd's cache while
    this graph compiles, which then keys the graph by them instead of bypassing it. ``offload``: the
    partitioner that moves the saved tensors to host memory (fx/offload.py), or None."""
    async_tp = async_tp_enabled(config)
    if config.compiler == "aot_eager":
        from torch._dynamo.backends import debugging
        from torch._dynamo.backends.common import aot_autograd

        def pipelined(graph, inputs):   # what inductor's post-grad passes would do for async TP
            micro_pipeline_tp(graph)
            return debugging.boxed_nop(graph, inputs)

        step = pipelined if async_tp else debugging.boxed_nop
        if offload is None:   # torch's own aot_eager, looked up when called (tests spy on it there)
            return debugging.aot_eager(gm, example_inputs, fw_compiler=step, bw_compiler=step)
        # aot_eager's settings with te's partitioner, which aot_eager does not take
        return aot_autograd(fw_compiler=step, bw_compiler=step, keep_inference_input_mutations=True,
                            partition_fn=offload)(gm, example_inputs)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = list_mode_options(mode) if mode else {}
    if async_tp:
        patches["_micro_pipeline_tp"] = True
    if config.combo_kernels:
        patches["combo_kernels"] = True   # Triton kernels only: inductor leaves CPU nodes out of them
    if cacheable:
        patches["unsafe_marked_cacheable_functions"] = {**inductor_config.unsafe_marked_cacheable_functions,
                                                        **cacheable}
    partition = _partition_settings(functorch_config)
    if offload is None:
        with functorch_config.patch(partition):
            return compile_fx(gm, example_inputs, inner_compile=_inner_compile, config_patches=patches)
    patches["custom_partitioner_fn"] = offload
    # AOTAutograd's cache would skip the partition, and with it the report's offload rows; inductor's
    # FX graph cache still keeps the partitioned graphs
    with functorch_config.patch({**partition, "enable_autograd_cache": False}):
        return compile_fx(gm, example_inputs, inner_compile=_inner_compile, config_patches=patches)


def _partition_settings(functorch_config) -> dict:
    """The min-cut partitioner's settings for te's training graphs (inductor's).

    torch counts a parameter as free to save for the backward (it lives anyway), so the partitioner
    recomputes whatever derives from one cheaply in the backward rather than keep it: each FP8 site's
    weight was cast again there, read in high precision (2 bytes an element in bf16, 4 in fp32), for
    the dgrad GEMM's transposed copy, and delayed scaling's weight amax was a backward reduction of its
    own. Counted at its size, the weight is not worth keeping when a derived FP8 copy is smaller: the
    forward writes the transposed copy beside the row-major one from its one read of the weight (with
    delayed scaling's amax in that pass) and keeps it for the backward, 1 byte an element held from
    forward to backward, as TransformerEngine keeps its FP8 weights. A torch without the setting
    partitions as before."""
    if not hasattr(functorch_config, "treat_parameters_as_free_to_save"):
        return {}
    return {"treat_parameters_as_free_to_save": False}


def _graph_device(example_inputs: Sequence) -> torch.device:
    """The device the graph computes on: its first tensor input off the CPU, else the CPU."""
    devices = [t.device for t in example_inputs if isinstance(t, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def _offload_partitioner(gm: fx.GraphModule, example_inputs: Sequence, config: TeConfig,
                         graph_id: int) -> Optional[OffloadPartitioner]:
    """te's offloading partitioner for a graph that trains, when the config offloads anything; a
    config error where the device or torch cannot (never a silent no-op)."""
    key = config.offload_key()
    if key is None or not torch.is_grad_enabled():
        return None
    device = _graph_device(example_inputs)
    ok, why = is_activation_offload_available(return_reason=True, device=device)
    if not ok:
        raise ConfigError(f"{config.source}: {key}: {why}; set it to false here")
    return OffloadPartitioner(config, graph_scopes(gm, example_inputs)[0].fqn, device, graph_id)


def _private_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's graph module for the passes to rewrite.

    Dynamo reads its own graph again after the backend returns (its placeholders are the call's
    arguments), so the passes must not add inputs to it. The copy keeps what aot_autograd reads
    from a Dynamo graph: ``meta``, ``_param_name_to_source`` and each placeholder's source.
    """
    graph = fx.Graph()
    old_to_new: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, old_to_new))
    for old, new in old_to_new.items():
        if old.op == "placeholder":
            new._dynamo_source = getattr(old, "_dynamo_source", None)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    copy._param_name_to_source = getattr(gm, "_param_name_to_source", None)
    return copy


def _per_call(compiled: Callable, result) -> Callable:
    """What runs at each call besides the graph: the extra inputs of the rewritten graph (the recipe
    state of the weights this call receives) appended to Dynamo's arguments, and the report rows of
    a module instance that reuses the graph (fx/naming.py).

    Dynamo passes parameters as graph inputs and reuses one compiled graph for every instance of
    a module class, so state is looked up per call by weight (a weak-keyed dict lookup per stateful
    weight) rather than baked into the graph: each model keeps its own.
    """
    instances = result.instances

    def run(*args):
        if instances is not None:
            rows = instances.check(args)
            if rows:
                add_records(rows)
        return compiled(*args, *result.extra_tensors(args)) if result.extra_inputs else compiled(*args)

    return run


def _static_examples(tensors: list, example_inputs: Sequence) -> list:
    """The extra inputs as example values with static shapes.

    Under ``dynamic=True`` aot_autograd would give every dim of a real tensor it has not seen a size
    symbol, and duck sizing unifies equal sizes: an amax history of length 16 and a sequence of 16
    tokens would share one symbol, so the next length would fail a guard. Recipe state has fixed
    shapes; fake tensors made with ``static_shapes=True`` in Dynamo's fake mode say so.
    """
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        return tensors
    return [fake_mode.from_tensor(t, static_shapes=True) for t in tensors]


def _compile(gm: fx.GraphModule, example_inputs: Sequence, config: TeConfig,
             mode: Optional[str]) -> Callable:
    trace_eager_experts()   # classes loaded since, and the hook again after a torch._dynamo.reset()
    gm = _private_copy(gm)
    graph_id = next_graph_id()
    try:
        offload = _offload_partitioner(gm, example_inputs, config, graph_id)
        # the grad mode, mesh and pipeline stage of this moment decide what the config means here
        settings = resolve_settings(config, example_inputs)
        result = run_passes(gm, example_inputs, settings, graph_id=graph_id)
    except ConfigError as e:   # e.g. an amax group this rank is not in: our message first
        raise CompileConfigError(str(e)) from None
    records = result.records
    # Dynamo may abandon this attempt (e.g. a restart that specializes a float): the final
    # compiler raises then, and only a compile that went through is reported.
    extra = _static_examples(result.extra_tensors(example_inputs), example_inputs)
    partitioner = {"offload": offload} if offload is not None else {}
    compiled = _per_call(_final_compiler(gm, [*example_inputs, *extra], config, mode, result.cacheable,
                                         **partitioner), result)
    add_records(records + (offload.records if offload is not None else []))
    if result.instances is not None:
        result.instances.seen.add(id(example_inputs[result.instances.anchor_index]))
    if records:
        table = str(Report(records))
        log.info("te_compile (%s):\n%s", config.source, table)
        if os.environ.get("TE_COMPILE_LOG", "") not in ("", "0"):
            print(f"te_compile (config: {config.source}):\n{table}", flush=True)
    return compiled


class CompileConfigError(ConfigError, ShortenTraceback):
    """A ConfigError found at the first call of ``torch.compile(..., backend="te", options=...)``,
    the first time torch hands the backend its options.

    Dynamo wraps what a backend raises in BackendCompilerFailed, whose message starts with its own
    words, except exceptions deriving from ShortenTraceback, which it re-raises unchanged: so the user
    reads our message first (file, key, allowed values) and can catch ``te_compile.ConfigError``.
    """

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.first_useful_frame = None   # ShortenTraceback: keep the whole traceback


def te_backend(gm: fx.GraphModule, example_inputs: Sequence, **kwargs) -> Callable:
    """Entry point of ``torch.compile(model, backend="te", options=..., mode=...)``."""
    try:
        config = resolve_config(kwargs.get("options"))
    except ConfigError as e:
        raise CompileConfigError(str(e)) from None
    return _compile(gm, example_inputs, config, kwargs.get("mode"))


def _options_config(kwargs: dict) -> TeConfig:
    """The config ``te_backend`` compiles with, given the backend kwargs torch.compile passes it."""
    return resolve_config(kwargs.get("options"))


# te_compile.calibrate finds the config a model was compiled with through this attribute of the
# backend torch.compile holds (calibration.py), as it cannot import this layer
te_backend.compile_config = _options_config


def backend(config: Union[str, os.PathLike, TeConfig, None] = None, **options) -> Callable:
    """A backend callable with its config fixed up front::

        torch.compile(model, backend=te_compile.backend(config="fp8.toml"))
        torch.compile(model, backend=te_compile.backend(recipe="DelayedScaling", amax_history_len=16))

    ``config`` is a TOML path or a ``TeConfig``; ``options`` are the inline keys of
    ``torch.compile(..., options=...)`` (layered over the file when both are given). ``mode`` may be
    given here too ("max-autotune", ...).
    """
    mode = options.pop("mode", None)
    fixed = config_argument(config, options, "te_compile.backend")

    def te(gm: fx.GraphModule, example_inputs: Sequence, **kwargs) -> Callable:
        return _compile(gm, example_inputs, fixed, kwargs.get("mode", mode))

    te.config = fixed
    te.compile_config = lambda kwargs: fixed   # as te_backend's
    return te
