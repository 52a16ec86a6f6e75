"""The file ``demo --save`` writes and ``generate`` reads: the te run's GPT, its recipe state and
the recipe's name, in plain tensors, strings and ints only, so that ``generate`` reads it with
``torch.load(weights_only=True)``."""

from __future__ import annotations

import os
from typing import Callable

import torch

from .common import UsageError

__all__ = ["MODELS", "model_factory", "save_checkpoint", "load_checkpoint"]

_FORMAT = "te_compile.demo/1"

MODELS = ("small", "moe", "tiny")   # the demo's --model choices, and what a checkpoint may name


def model_factory(name: str) -> Callable[[], torch.nn.Module]:
    """The te_compile.models factory of a name in ``MODELS``."""
    from ..models import gpt_moe, gpt_small, gpt_tiny

    return {"small": gpt_small, "tiny": gpt_tiny, "moe": gpt_moe}[name]


def save_checkpoint(path: str, model: torch.nn.Module, name: str, config) -> None:
    """Write ``model`` (weights in fp32 on the CPU), its recipe state and ``config``'s recipe name."""
    from ..state import recipe_state_dict

    state = {k: v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()
             for k, v in model.state_dict().items()}
    torch.save({"format": _FORMAT, "model": name, "state_dict": state,
                "recipe_state": {k: v.cpu() for k, v in recipe_state_dict(model).items()},
                "recipe": config.recipe.name if config.recipe is not None else "none"}, path)


def load_checkpoint(path: str) -> dict:
    """The dict ``save_checkpoint`` wrote; a UsageError for anything else."""
    if not os.path.isfile(path):
        raise UsageError(f"--checkpoint {path}: no such file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # a pickle with objects weights_only refuses, or not a torch file at all
        raise UsageError(f"--checkpoint {path}: not a checkpoint that te-compile demo --save wrote "
                         f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != _FORMAT:
        raise UsageError(f"--checkpoint {path}: not a checkpoint that te-compile demo --save wrote "
                         f"(expected format {_FORMAT!r})")
    if checkpoint.get("model") not in MODELS:
        raise UsageError(f"--checkpoint {path}: model {checkpoint.get('model')!r} is not one of {list(MODELS)}")
    return checkpoint
