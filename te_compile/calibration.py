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
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Union

import torch
import torch.nn as nn

from .config import TeConfig, config_argument
from .quantization import weight_ineligibility
from .scaling import update_role_state
from .state import state_for

__all__ = ["calibrate"]


@contextlib.contextmanager
def calibrate(model: nn.Module, config: Union[str, os.PathLike, TeConfig, None] = None,
              **options: Any) -> Iterator[dict[str, int]]:
    """Within the block, ``model`` (an ``nn.Module`` or what ``torch.compile`` returned for it) runs in
    high precision and every ``nn.Linear`` under DelayedScaling records its input's and weight's amax
    into its scales (module docstring). ``config`` / ``options``: as for ``te_compile.backend``; use the
    config the model is compiled with. Yields {linear fqn: calls recorded}, filled as the block runs.
    """
    cfg = config_argument(config, options, "calibrate")
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
    try:
        with torch.compiler.set_stance("force_eager"):
            yield calls
    finally:
        for handle in handles:
            handle.remove()
