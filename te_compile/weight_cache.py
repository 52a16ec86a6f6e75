"""FP8 copies of the weights: quantized once, reused until the weight changes.

Inference. A graph compiled under ``torch.no_grad()`` / ``torch.inference_mode()`` serves calls in
which the weights usually stay put: every decode step of ``generate()`` would otherwise re-read each
weight in high precision to find its amax and write its FP8 bytes. There the backend hands the graph,
instead of the parameter, a ``Float8Tensor`` from this cache (an extra graph input,
passes/cached_weights.py), and the linear lowerings take its bytes and scale as they are (the path
FSDP2's FP8 all-gather takes).

The copy is made with the lowering's own quantization (``quantize_per_tensor`` with the weight's
role): current scaling from the weight's amax, delayed scaling with the scale the graph keeps for the
weight, so its bytes are those the lowering would make. It is made again when the weight changes:
its version counter moves (an optimizer step, ``load_state_dict``, any in-place write), its storage
moves (``.to()``, a new tensor assigned), or under delayed scaling its scale changes (calibration,
``load_recipe_state_dict``). The cache holds one FP8 copy per weight and recipe, 1 byte per element
beside the high-precision weight, and lets go of it with the weight (weak keys).

Training (``cache_fp8_weights = true``). A step that accumulates gradients over several micro-batches
runs the forward once per micro-batch, and the weights do not move between them: only the optimizer
step changes them. With the key set, a training graph's linears read ``linked_fp8_weight(parameter)``
instead of quantizing the weight themselves: the same cached copy, wrapped anew at each call in a
``Float8Tensor`` that autograd links to the parameter, so the weight gradient the GEMMs compute flows
into ``parameter.grad`` as before. The first micro-batch after a step quantizes (the version counter
moved), the others reuse the bytes: TransformerEngine's ``is_first_microbatch``, without the flag.
A changed weight gets its new copy in new buffers (the graph's input is not marked static), so a
backward still to run from before the change reads the bytes its forward read.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary

from .recipe import Recipe
from .scaling import quantize_per_expert, quantize_per_tensor
from .state import read_state
from .tensor.float8_tensor import Float8Tensor
from .tensor.grouped_float8_tensor import GroupedFloat8Tensor

__all__ = ["cached_fp8_weight", "linked_fp8_weight", "cached_fp8_experts", "linked_fp8_experts", "cached_bytes"]


@dataclass
class _Entry:
    key: tuple
    tensor: Float8Tensor


# weight (by identity, held weakly) -> {(recipe, transposed, cast dtype[, "experts"]): entry}
_CACHE = WeakIdKeyDictionary()


def _version_key(weight: torch.Tensor, scale: Optional[torch.Tensor]) -> tuple:
    key = (weight._version, weight.data_ptr(), weight.dtype, weight.device)
    return key if scale is None else (*key, scale._version, scale.data_ptr())


def cached_fp8_weight(weight: torch.Tensor, recipe: Recipe, where: str = "cached_fp8_weight",
                      transposed: bool = False, dtype: Optional[torch.dtype] = None,
                      in_place: bool = True) -> Float8Tensor:
    """The FP8 weight operand [N, K] of ``weight`` (stored [N, K]; [K, N] with ``transposed``, as
    GPT-2's Conv1D stores it) under the per-tensor ``recipe``, quantized from the weight cast to
    ``dtype`` when given (autocast's: the linear would cast it first): the cached copy when the weight
    (and its delayed scale) has not changed since it was made, else a new one, written over the old
    copy's buffers when ``in_place``."""
    if not recipe.per_tensor:
        raise ValueError(f"{where}: the FP8 weight cache takes per-tensor recipes, got {recipe.name}")
    if is_fake(weight):
        return _fake_copy(weight, recipe, transposed, dtype)
    # the graph's scale, read and never created here: serving adds no recipe state
    scale = read_state(weight, recipe.amax_history_len, where).roles["weight"].scale if recipe.delayed() else None

    def quantize() -> Float8Tensor:
        w_nk = weight.detach() if dtype is None else weight.detach().to(dtype)
        w_nk = w_nk.t().contiguous() if transposed else w_nk
        data, scale_inv, _ = quantize_per_tensor(w_nk, "weight", recipe, scale)
        return Float8Tensor(data=data.view(torch.uint8), scale_inv=scale_inv,
                            fp8_dtype=recipe.fp8_format.dtype_for("weight"), dtype=dtype or weight.dtype)

    return _cached(weight, (recipe, transposed, dtype), _version_key(weight, scale), in_place, quantize)


def _cached(weight: torch.Tensor, slot: tuple, key: tuple, in_place: bool, quantize):
    """The copy of ``weight`` at ``slot`` when it was made at version ``key``, else ``quantize()``'s new
    one: written over the old copy's buffers when ``in_place`` and they match, else kept in new ones."""
    entries = _CACHE.setdefault(weight, {})
    entry = entries.get(slot)
    if entry is not None and entry.key == key:
        return entry.tensor
    with torch.no_grad():
        tensor = quantize()
    held = entry.tensor if entry is not None else None
    if (in_place and held is not None and held._data.shape == tensor._data.shape
            and held._data.device == tensor._data.device):
        # written where the old copy lives: a graph under CUDA graphs reads its inputs at the
        # addresses it was recorded with (the placeholder is marked static)
        for name in ("_data", "_scale_inv", "_amax"):
            if getattr(tensor, name) is not None:
                getattr(held, name).copy_(getattr(tensor, name))
        entry.key = key
        return held
    entries[slot] = _Entry(key, tensor)
    return tensor


def _fake_copy(weight: torch.Tensor, recipe: Recipe, transposed: bool, dtype: Optional[torch.dtype]) -> Float8Tensor:
    """The copy's metadata for a fake ``weight`` (a compile's example input: DDPOptimizer's split graphs,
    the offline model), made in the fake mode of the compile (the weight's own may be another)."""
    shape = weight.shape[::-1] if transposed else weight.shape
    with detect_fake_mode([weight]) or contextlib.nullcontext():
        data = torch.empty(shape, dtype=torch.uint8, device=weight.device)
        scale_inv = torch.empty(1, dtype=torch.float32, device=weight.device)
    return Float8Tensor(data=data, scale_inv=scale_inv, fp8_dtype=recipe.fp8_format.dtype_for("weight"),
                        dtype=dtype or weight.dtype)


class _LinkToWeight(torch.autograd.Function):
    """A fresh ``Float8Tensor`` over the cached bytes whose gradient goes to ``weight``: the cached
    object itself never enters autograd (it outlives the step)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, cached: Float8Tensor, transposed: bool) -> Float8Tensor:
        ctx.transposed = transposed
        # the weight's own dtype (fp32 under autocast), though the bytes come from autocast's bf16 cast:
        # the lowering then writes dw in fp32 straight from the wgrad GEMM, as for the plain weight
        return Float8Tensor(data=cached._data, scale_inv=cached._scale_inv, fp8_dtype=cached._fp8_dtype,
                            dtype=weight.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # grad [N, K]; the parameter may be stored [K, N] (GPT-2's Conv1D)
        return (grad.t() if ctx.transposed else grad), None, None


def linked_fp8_weight(weight: torch.Tensor, recipe: Recipe, where: str = "linked_fp8_weight",
                      transposed: bool = False, dtype: Optional[torch.dtype] = None) -> Float8Tensor:
    """``cached_fp8_weight``'s copy for a training graph: a new ``Float8Tensor`` over the cached bytes,
    linked to ``weight`` by autograd (its gradient, [N, K], becomes ``weight``'s) when grad is enabled
    and ``weight`` requires it."""
    # a new copy in new buffers when the weight changed: a backward still to run (a forward before the
    # step, its backward after) keeps the bytes its forward read
    cached = cached_fp8_weight(weight, recipe, where, transposed, dtype, in_place=False)
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return cached
    return _LinkToWeight.apply(weight, cached, transposed)


def cached_fp8_experts(weight: torch.Tensor, recipe: Recipe, where: str = "cached_fp8_experts",
                       transposed: bool = False, dtype: Optional[torch.dtype] = None,
                       in_place: bool = True) -> GroupedFloat8Tensor:
    """The FP8 operand of an MoE layer's expert weights ``weight``, stored [E, K, N] and read as it is by
    the grouped GEMM ([E, N, K] read through ``.transpose(-2, -1)`` with ``transposed``), cast to
    ``dtype`` first when given (the model's ``w.bfloat16()``), under the per-tensor current-scaling
    ``recipe``: a ``GroupedFloat8Tensor`` of shape [E, K, N] and nominal dtype ``dtype`` (else the
    weight's), one scale per expert, whose bytes lie [E, N, K] as the grouped lowering's own
    quantization lays them (``expert_weight_operand``), so that it takes them without a copy. Cached and
    made again as ``cached_fp8_weight``'s copy is."""
    if not recipe.per_tensor or recipe.delayed():
        raise ValueError(f"{where}: the expert weight cache takes per-tensor current scaling, got {recipe.name}")
    if weight.dim() != 3:
        raise ValueError(f"{where}: expert weights are 3-D [E, K, N], got shape {tuple(weight.shape)}")
    fp8_dtype = recipe.fp8_format.dtype_for("weight")
    if is_fake(weight):
        e, k, n = weight.shape[0], *(weight.shape[:0:-1] if transposed else weight.shape[1:])
        with detect_fake_mode([weight]) or contextlib.nullcontext():
            data = torch.empty((e, n, k), dtype=torch.uint8, device=weight.device)
            scale_inv = torch.empty(e, dtype=torch.float32, device=weight.device)
            amax = torch.empty(e, dtype=torch.float32, device=weight.device)
        return GroupedFloat8Tensor(data=data, scale_inv=scale_inv, fp8_dtype=fp8_dtype, dtype=dtype or weight.dtype,
                                   amax=amax).transpose(1, 2)

    def quantize() -> GroupedFloat8Tensor:
        w = weight.detach() if dtype is None else weight.detach().to(dtype)
        data, scale_inv, amax = quantize_per_expert(w if transposed else w.transpose(1, 2), "weight", recipe)
        return GroupedFloat8Tensor(data=data.contiguous().view(torch.uint8), scale_inv=scale_inv, fp8_dtype=fp8_dtype,
                                   dtype=dtype or weight.dtype, amax=amax)

    slot = (recipe, transposed, dtype, "experts")
    return _cached(weight, slot, _version_key(weight, None), in_place, quantize).transpose(1, 2)


class _LinkToExperts(torch.autograd.Function):
    """``_LinkToWeight`` for expert weights: a fresh [E, K, N] view of the cached bytes whose gradient
    ([E, K, N], in the dtype the call read the weight in) goes to ``weight``, cast to its dtype as the
    model's own cast would pass it back."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, cached: GroupedFloat8Tensor, transposed: bool) -> GroupedFloat8Tensor:
        ctx.transposed, ctx.dtype = transposed, weight.dtype
        return GroupedFloat8Tensor(data=cached._data, scale_inv=cached._scale_inv, fp8_dtype=cached._fp8_dtype,
                                   dtype=cached.dtype, amax=cached._amax)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.to(ctx.dtype)
        return (grad.transpose(1, 2) if ctx.transposed else grad), None, None


def linked_fp8_experts(weight: torch.Tensor, recipe: Recipe, where: str = "linked_fp8_experts",
                       transposed: bool = False, dtype: Optional[torch.dtype] = None) -> GroupedFloat8Tensor:
    """``cached_fp8_experts``'s copy for a training graph, linked to ``weight`` by autograd (as
    ``linked_fp8_weight``'s), in new buffers when the weight changed."""
    cached = cached_fp8_experts(weight, recipe, where, transposed, dtype, in_place=False)
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return cached
    return _LinkToExperts.apply(weight, cached, transposed)


def cached_bytes(weights) -> int:
    """Bytes of the FP8 copies (data and scales) the cache holds for ``weights`` (e.g. a model's
    parameters)."""
    total = 0
    for w in weights:
        for entry in (_CACHE[w].values() if w in _CACHE else ()):
            parts = (entry.tensor._data, entry.tensor._scale_inv, getattr(entry.tensor, "_amax", None))
            total += sum(t.numel() * t.element_size() for t in parts if t is not None)
    return total
