"""The ``te`` Dynamo backend: config -> passes -> lowerings -> inductor (or aot_eager)."""

from __future__ import annotations

import logging
import os
import weakref
from typing import Callable, Optional, Sequence, Union

import torch
import torch.fx as fx

from .config import TeConfig, load_config, resolve_config
from .passes import run_passes
from .report import Report, _next_graph_id, _record

__all__ = ["te_backend", "backend"]

log = logging.getLogger("te_compile")


def _final_compiler(gm: fx.GraphModule, example_inputs: Sequence, config: TeConfig,
                    mode: Optional[str]) -> Callable:
    if config.compiler == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = list_mode_options(mode) if mode else {}
    return compile_fx(gm, example_inputs, config_patches=patches)


def _guard_state_owners(compiled: Callable, owners: dict) -> Callable:
    """Refuse to run a graph holding recipe state for other weights than the ones passed in.

    Dynamo passes parameters as graph inputs and may reuse one compiled graph for another instance
    of the same module class; the state buffers baked into this graph would then be shared.
    """
    if not owners:
        return compiled
    refs = {i: weakref.ref(w) for i, w in owners.items()}

    def run(*args):
        for i, ref in refs.items():
            if args[i] is not ref():
                raise RuntimeError(
                    "te_compile: this compiled graph holds DelayedScaling state for the weights it was "
                    "compiled with, and was called with other weights (another model instance?). "
                    "Compile each model with its own torch.compile(model, backend='te') call."
                )
        return compiled(*args)

    return run


def _compile(gm: fx.GraphModule, example_inputs: Sequence, config: TeConfig,
             mode: Optional[str]) -> Callable:
    result = run_passes(gm, example_inputs, config, graph_id=_next_graph_id())
    records = result.records
    # Dynamo may abandon this attempt (e.g. a restart that specializes a float): the final
    # compiler raises then, and only a compile that went through is reported.
    compiled = _guard_state_owners(_final_compiler(gm, example_inputs, config, mode),
                                   result.state_owners)
    _record(records)
    if records:
        table = str(Report(records))
        log.info("te_compile (%s):\n%s", config.source, table)
        if os.environ.get("TE_COMPILE_LOG", "") not in ("", "0"):
            print(f"te_compile (config: {config.source}):\n{table}", flush=True)
    return compiled


def te_backend(gm: fx.GraphModule, example_inputs: Sequence, **kwargs) -> Callable:
    """Entry point of ``torch.compile(model, backend="te", options=..., mode=...)``."""
    config = resolve_config(kwargs.get("options"))
    return _compile(gm, example_inputs, config, kwargs.get("mode"))


def backend(config: Union[str, os.PathLike, TeConfig, None] = None, **options) -> Callable:
    """A backend callable with its config fixed up front::

        torch.compile(model, backend=te_compile.backend(config="fp8.toml"))
        torch.compile(model, backend=te_compile.backend(recipe="DelayedScaling", amax_history_len=16))

    ``config`` is a TOML path or a ``TeConfig``; ``options`` are the inline keys of
    ``torch.compile(..., options=...)`` (layered over the file when both are given). ``mode`` may be
    given here too ("max-autotune", ...).
    """
    mode = options.pop("mode", None)
    if isinstance(config, TeConfig):
        if options:
            raise ValueError("te_compile.backend: pass either a TeConfig or inline options, not both")
        fixed = config
    elif config is not None:
        fixed = resolve_config({"config": os.fspath(config), **options}) if options else load_config(config)
    else:
        fixed = resolve_config(options or None)

    def te(gm: fx.GraphModule, example_inputs: Sequence, **kwargs) -> Callable:
        return _compile(gm, example_inputs, fixed, kwargs.get("mode", mode))

    te.config = fixed
    return te
