"""FP8 copies of the weights for inference graphs: quantized once, reused until the weight changes.

A training step must quantize every weight again (the optimizer moved it). A graph compiled under
``torch.no_grad()`` / ``torch.inference_mode()`` serves calls in which the weights usually stay put:
every decode step of ``generate()`` would otherwise re-read each weight in high precision to find its
amax and write its FP8 bytes. There the backend hands the graph, instead of the parameter, a
``Float8Tensor`` from this cache (an extra graph input, passes/inference_weights.py), and the linear
lowerings take its bytes and scale as they are (the path FSDP2's FP8 all-gather takes).

The copy is made with the lowering's own quantization (``quantize_per_tensor`` with the weight's
role): current scaling from the weight's amax, delayed scaling with the scale the graph keeps for the
weight, so its bytes are those the lowering would make. It is made again when the weight changes:
its version counter moves (an optimizer step, ``load_state_dict``, any in-place write), its storage
moves (``.to()``, a new tensor assigned), or under delayed scaling its scale changes (calibration,
``load_recipe_state_dict``). The cache holds one FP8 copy per weight and recipe, 1 byte per element
beside the high-precision weight, and lets go of it with the weight (weak keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .recipe import Recipe
from .scaling import quantize_per_tensor
from .state import read_state
from .tensor.float8_tensor import Float8Tensor

__all__ = ["cached_fp8_weight", "cached_bytes"]


@dataclass
class _Entry:
    key: tuple
    tensor: Float8Tensor


# weight (by identity, held weakly) -> {(recipe, transposed, cast dtype): entry}
_CACHE = WeakIdKeyDictionary()


def _version_key(weight: torch.Tensor, scale: Optional[torch.Tensor]) -> tuple:
    key = (weight._version, weight.data_ptr(), weight.dtype, weight.device)
    return key if scale is None else (*key, scale._version, scale.data_ptr())


def cached_fp8_weight(weight: torch.Tensor, recipe: Recipe, where: str = "cached_fp8_weight",
                      transposed: bool = False, dtype: Optional[torch.dtype] = None) -> Float8Tensor:
    """The FP8 weight operand [N, K] of ``weight`` (stored [N, K]; [K, N] with ``transposed``, as
    GPT-2's Conv1D stores it) under the per-tensor ``recipe``, quantized from the weight cast to
    ``dtype`` when given (autocast's: the linear would cast it first): the cached copy when the weight
    (and its delayed scale) has not changed since it was made, else a new one."""
    if not recipe.per_tensor:
        raise ValueError(f"{where}: the inference weight cache takes per-tensor recipes, got {recipe.name}")
    # the graph's scale, read and never created here: serving adds no recipe state
    scale = read_state(weight, recipe.amax_history_len, where).roles["weight"].scale if recipe.delayed() else None
    key = _version_key(weight, scale)
    entries = _CACHE.setdefault(weight, {})
    entry = entries.get((recipe, transposed, dtype))
    if entry is not None and entry.key == key:
        return entry.tensor
    with torch.no_grad():
        w_nk = weight.detach() if dtype is None else weight.detach().to(dtype)
        w_nk = w_nk.t().contiguous() if transposed else w_nk
        data, scale_inv, _ = quantize_per_tensor(w_nk, "weight", recipe, scale)
        data = data.view(torch.uint8)
        if entry is not None and entry.tensor._data.shape == data.shape and entry.tensor._data.device == data.device:
            # written where the old copy lives: a graph under CUDA graphs reads its inputs at the
            # addresses it was recorded with (the placeholder is marked static)
            entry.tensor._data.copy_(data)
            entry.tensor._scale_inv.copy_(scale_inv)
            entry.key = key
            return entry.tensor
    tensor = Float8Tensor(data=data, scale_inv=scale_inv, fp8_dtype=recipe.fp8_format.dtype_for("weight"),
                          dtype=dtype or weight.dtype)
    entries[(recipe, transposed, dtype)] = _Entry(key, tensor)
    return tensor


def cached_bytes(weights) -> int:
    """Bytes of the FP8 copies (data and scales) the cache holds for ``weights`` (e.g. a model's
    parameters)."""
    total = 0
    for w in weights:
        for entry in (_CACHE[w].values() if w in _CACHE else ()):
            data, scale_inv = entry.tensor._data, entry.tensor._scale_inv
            total += data.numel() * data.element_size() + scale_inv.numel() * scale_inv.element_size()
    return total
