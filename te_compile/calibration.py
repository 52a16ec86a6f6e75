"""Calibration: delayed-scaling scales from a few high-precision forwards, without training.

``with te_compile.calibrate(model):`` runs the model (compiled or not) eagerly in high precision, as
``torch.compiler.set_stance("force_eager")`` does, and records at every call of each ``nn.Linear``
under DelayedScaling the amax of its input and of its weight into the weight's recipe state (the
state the compiled graphs keep: ``te_compile.recipe_state_dict`` saves it), one history entry per
call, each followed by the scales the history gives. Outputs inside the block are the model's own.
Afterwards a compiled graph quantizes with those scales: static scaling, no amax reduction on the hot
path (TransformerEngine's ``fp8_autocast(calibrating=True)`` does the same for its modules).

The grad_output role is not calibrated (there is no backward). Sites that are not ``nn.Linear``
modules (a functional ``F.linear`` on a parameter, FP8 attention) keep the scales they have.

Without a config, calibration takes the one the model is compiled with, however it was compiled:
``torch.compile(model)``, ``model.compile()``, or Hugging Face's ``model.forward =
torch.compile(model.forward)``, whose wrapper is not the model that ``calibrate`` receives. The
default config's recipe is not DelayedScaling, so falling back to it would calibrate nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.nn as nn
from torch._dynamo.eval_frame import innermost_backend

from .config import TeConfig, config_argument
from .quantization import weight_ineligibility
from .scaling import update_role_state
from .state import state_for

__all__ = ["calibrate"]


def _compile_callbacks(model: nn.Module) -> list[Callable]:
    """Dynamo's callbacks for the ways ``model`` may be compiled, outermost first: the wrapper
    ``torch.compile(model)`` returned, ``model.compile()``'s compiled ``__call__``, a compiled
    ``forward`` assigned to the instance (Hugging Face's way)."""
    callbacks = []
    ctx = getattr(model, "dynamo_ctx", None)
    if ctx is not None:
        callbacks.append(ctx.callback)
    for module in (model, getattr(model, "_orig_mod", model)):
        for name in ("_compiled_call_impl", "forward"):
            fn = vars(module).get(name)
            if fn is not None and hasattr(fn, "_torchdynamo_orig_callable"):
                # torch.compile(fn) returns a closure over the callback that runs Dynamo
                callbacks.append(inspect.getclosurevars(fn).nonlocals.get("callback"))
    return [c for c in callbacks if callable(c)]


def _compiled_config(model: nn.Module) -> Optional[TeConfig]:
    """The config of the te backend ``model`` is compiled with (module docstring); None when it is not
    compiled with te. A te backend carries ``compile_config(backend kwargs)`` (backend.py)."""
    for callback in _compile_callbacks(model):
        wrapper = innermost_backend(callback)   # torch.compile's wrapper: the backend and its kwargs
        compile_config = getattr(getattr(wrapper, "compiler_fn", wrapper), "compile_config", None)
        if compile_config is not None:
            return compile_config(getattr(wrapper, "kwargs", {}))
    return None


@contextlib.contextmanager
def calibrate(model: nn.Module, config: Union[str, os.PathLike, TeConfig, None] = None,
              **options: Any) -> Iterator[dict[str, int]]:
    """Within the block, ``model`` (an ``nn.Module`` or what ``torch.compile`` returned for it) runs in
    high precision and every ``nn.Linear`` under DelayedScaling records its input's and weight's amax
    into its scales (module docstring). ``config`` / ``options``: as for ``te_compile.backend``; without
    them, the config the model is compiled with (else the one ``torch.compile(..., backend="te")``
    would resolve). Yields {linear fqn: calls recorded}, filled as the block runs. An error names the
    config when no linear of the model runs under DelayedScaling in it (nothing to calibrate).
    """
    cfg = None if config is not None or options else _compiled_config(model)
    cfg = cfg or config_argument(config, options, "calibrate")
    root = getattr(model, "_orig_mod", model)
    calls: dict[str, int] = {}
    handles = []

    def hook(fqn, state, recipe):
        def record(module, args):
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor):
                return
            with torch.no_grad():
                for role, t in (("input", x), ("weight", module.weight)):
                    # one history entry, then the scale the history gives (as the graphs' update does)
                    update_role_state(state.roles[role].amax_history, state.roles[role].scale,
                                      t.detach().abs().amax().float().reshape(1), role, recipe)
            calls[fqn] += 1
        return record

    for fqn, module in root.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        recipe, _ = cfg.recipe_for(fqn)
        if recipe is None or not recipe.delayed() or weight_ineligibility(module.weight, recipe):
            continue
        state = state_for(module.weight, recipe.amax_history_len, f"{fqn or '<root>'} (calibration)")
        calls[fqn] = 0
        handles.append(module.register_forward_pre_hook(hook(fqn, state, recipe)))
    if not calls:
        recipe = cfg.recipe.name if cfg.recipe is not None else "none"
        raise ValueError(f"calibrate: no nn.Linear of {type(root).__name__} runs under DelayedScaling in the "
                         f"config from {cfg.source} (recipe {recipe}, {len(cfg.overrides)} overrides), so there "
                         f"is nothing to calibrate; pass the config the model is compiled with (config=PATH "
                         f"or the options given to torch.compile), one whose recipe is DelayedScaling")
    try:
        with torch.compiler.set_stance("force_eager"):
            yield calls
    finally:
        for handle in handles:
            handle.remove()
