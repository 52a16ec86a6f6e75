"""FSDP2 (``fully_shard``) all-gathers the weights of FP8 linears as FP8 bytes.

Without this, FSDP2 all-gathers each weight in high precision and the te backend quantizes the
gathered weight inside the compiled graph. ``enable_fp8_all_gather(model)``, called once before
``fully_shard``, wraps the weights of the linears the config puts under per-tensor FP8
(Float8CurrentScaling, DelayedScaling; the block formats below) in ``Fp8AllGatherWeight``: a tensor
subclass around the fp32 master shard that implements FSDP2's all-gather extension points. Per
all-gather:

- ``fsdp_pre_all_gather`` casts the local shard (in the mixed-precision ``param_dtype``) to FP8 with
  the scale of the *whole* weight and hands FSDP the uint8 bytes: 1 byte per element on the wire
  instead of 2 (bf16) or 4 (fp32);
- ``fsdp_post_all_gather`` wraps the gathered bytes and that scale in a ``Float8Tensor``: the
  unsharded parameter the compiled graph sees. The linear lowering uses its bytes as the weight
  operand of the FP8 GEMMs (gemm/per_tensor.py ``quantize_weight``): no second quantization.

One scale across shards: current scaling's amax is that of the whole weight, the MAX all-reduce of
the shard amaxes over the FSDP mesh, so the gathered bytes equal those one process quantizing the
whole weight produces. ``_ScaleBook`` does this for every wrapped weight in one all-reduce per
optimizer step: a weight whose shard changed since its scale was computed (its version counter
moved: the optimizer stepped, or a state dict was loaded) triggers one refresh of all weights that
are sharded at that moment; the other all-gathers of the step (per-block wrapping gathers each block,
and again in backward) reuse the cached amaxes. Every rank takes the same decisions, so the
collectives line up. No extra call per step is needed.

Uneven shards and ranks holding empty shards work: the bytes are padded to FSDP's padded shard size,
and an empty shard's amax is 0.

Block formats (MXFP8, Float8 block with 128x128 tiles): when each rank's rows are whole blocks (32
rows for MXFP8's columnwise copy, 128 for Float8 block's tiles) and the shards even, the shard's
blocks are the whole weight's, so ``fsdp_pre_all_gather`` quantizes the shard on its own (no amax
reduction) and gathers every buffer of it (bytes and block scales, both MXFP8 copies; Float8 block's
rowwise copy only, the columnwise one is its transpose) along dim 0; ``fsdp_post_all_gather`` builds
the block-scaled tensor over them. Other shapes keep high-precision gathers (the returned dict says
why).

MoE expert weights (3-D parameters [E, ...] of modules under a per-tensor recipe) get one scale per
expert. FSDP2 shards dim 0, the experts, so each rank holds whole experts: the scale book all-reduces
an [E] vector per weight (each rank's experts at their places, 0 elsewhere), the shard's experts are
cast with their own scales, and ``fsdp_post_all_gather`` builds a ``GroupedFloat8Tensor`` whose bytes
and [E] scales the grouped GEMM lowering uses as they are. Under expert parallelism (torchtitan's
dp2ep: a DTensor Shard(0) on an ep mesh, then FSDP2 on dp_mod_ep) E is the rank's experts, the ones
FSDP gathers, and the vector is all-reduced over FSDP's dims only: the ep ranks hold other experts.

Delayed scaling: the shard is cast with the scale the compiled graph keeps for the weight. The slot
holds that state (te_compile.state, made for the original parameter) and the gathered Float8Tensor
carries it in its quantizer (``linear_state``), so the graph, keyed by FSDP's unsharded parameter,
updates the very scale the next all-gather casts with; the whole weight's amax rides along
(``Float8Tensor._amax``) for the amax history, as the high-precision weight's own amax would.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .config import TeConfig, config_argument
from .distributed import is_dtensor, local_value, mesh_dims_group, reduce_amaxes
from .quantization import weight_ineligibility, weight_quantizer
from .scaling import cast_to_fp8, current_scale, quantize_per_tensor, tensor_amax
from .tensor.block_fsdp import FsdpBlockMeta, fsdp_block_post_all_gather
from .tensor.cache_identity import subclass_cache_hash
from .tensor.float8_tensor import Float8Quantizer, Float8Tensor, fsdp_float8_post_all_gather, fsdp_padded_shard
from .tensor.grouped_float8_tensor import GroupedFloat8Quantizer, GroupedFsdpMeta, fsdp_grouped_post_all_gather

__all__ = ["enable_fp8_all_gather", "Fp8AllGatherWeight"]

aten = torch.ops.aten

# Ops that make another view or copy of the same weight: their result stays a wrapper, so the
# shards FSDP2 cuts out of a wrapped parameter (split, new_zeros, slice, copy_, view) keep the
# all-gather hooks. Everything else (the optimizer's arithmetic, reading values) sees the plain shard.
_KEEP_WRAPPED = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.as_strided.default,
    aten.new_zeros.default, aten.new_empty.default, aten.empty_like.default, aten.clone.default,
    aten._to_copy.default, aten._pin_memory.default,
}


class _Slot:
    """One wrapped weight: where it lives, its recipe, and its last whole-weight amax (fp32 [1]; for a
    3-D expert weight one per expert, [E])."""

    def __init__(self, module: nn.Module, name: str, fqn: str, recipe) -> None:
        self.module, self.name, self.fqn, self.recipe = module, name, fqn, recipe
        weight = getattr(module, name, None)
        # the experts FSDP gathers: this rank's under expert parallelism (a DTensor split on dim 0)
        self.experts = local_value(weight).shape[0] if weight is not None and weight.dim() == 3 else 0
        self.amax: Optional[torch.Tensor] = None
        self.version: Optional[int] = None
        self.groups: Optional[tuple] = None   # reduce_groups, once known
        # block formats: the weight quantizer (scales are per block: shards need no amax reduction)
        self.block_quantizer = weight_quantizer(recipe) if recipe.weight_gather_block_rows else None
        # delayed scaling: the quantizer with the weight's state (its scale), carried to the gathered weight
        self.quantizer: Union[Float8Quantizer, GroupedFloat8Quantizer, None] = (
            weight_quantizer(recipe, weight, fqn) if recipe.delayed() else None)

    def local_amax(self, param, mesh) -> torch.Tensor:
        """The amax of this rank's shard of ``param`` (a DTensor over a wrapper): [1], or for an
        expert weight [E] (the experts FSDP gathers on ``mesh``) with each of the shard's experts at
        its place and 0 elsewhere (FSDP2 cuts dim 0, the experts, so every shard holds whole experts)."""
        shard = param._local_tensor._tensor
        if not self.experts:
            return tensor_amax(shard)
        offset = _gathered_offset(param, mesh)
        out = torch.zeros(self.experts, dtype=torch.float32, device=shard.device)
        if shard.shape[0]:
            amax = shard.detach().abs().reshape(shard.shape[0], -1).amax(dim=1).to(torch.float32)
            out[offset:offset + shard.shape[0]] = amax
        return out

    def sharded(self, mesh) -> Optional[torch.Tensor]:
        """The sharded parameter (a DTensor over a wrapper) when FSDP has it sharded on ``mesh`` right
        now, else None (FSDP holds the unsharded weight on the module between its all-gather and
        its reshard). ``mesh`` is the FSDP shard mesh FSDP2 passes to the all-gather; the parameter
        lives on it, or on a 2-D or 3-D mesh that contains it (HSDP's replicate dim, a TP dim)."""
        from torch.distributed.tensor import DTensor

        param = getattr(self.module, self.name)
        if (isinstance(param, DTensor) and isinstance(param._local_tensor, Fp8AllGatherWeight)
                and _mesh_ranks(mesh) <= _mesh_ranks(param.device_mesh)):
            return param
        return None

    def reduce_groups(self, param, mesh) -> tuple:
        """The groups the shard amaxes are all-reduced over so that they become the whole weight's:
        every mesh dim the sharded parameter is split on (FSDP's dp_shard, a TP dim), as one flattened
        group; HSDP's replicate dim holds copies and is left out, and so is an expert-parallel dim
        (Shard(0) outside FSDP's ``mesh``), whose other ranks hold other experts. Made once: a
        flattened group is a new process group, which every rank creates in the same order (all
        ranks refresh together)."""
        if self.groups is None:
            fsdp = set(mesh.mesh_dim_names or ())
            names = param.device_mesh.mesh_dim_names or ()
            # not is_shard(): FSDP's _StridedShard over a TP-sharded dim is no Shard in torch 2.13
            dims = [d for d, p in enumerate(param.placements) if not (p.is_replicate() or p.is_partial())
                    and not (self.experts and names and names[d] not in fsdp and p.is_shard(0))]
            self.groups = mesh_dims_group(param.device_mesh, dims)
        return self.groups


def _mesh_ranks(mesh) -> set:
    return set(mesh.mesh.flatten().tolist())


def _gathered_offset(param, mesh) -> int:
    """Where this rank's shard of ``param`` (a DTensor) starts along dim 0 of the tensor FSDP gathers
    on ``mesh``: its global offset less that of the gathered tensor, which is the parameter with
    FSDP's dims replicated (the whole expert dim, or this rank's experts under expert parallelism)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dev_mesh = param.device_mesh
    _, offset = compute_local_shape_and_global_offset(param.shape, dev_mesh, param.placements)
    fsdp, names = set(mesh.mesh_dim_names or ()), dev_mesh.mesh_dim_names or ()
    if not names or not fsdp:
        return offset[0]
    gathered = [Replicate() if name in fsdp else p for name, p in zip(names, param.placements)]
    _, base = compute_local_shape_and_global_offset(param.shape, dev_mesh, gathered)
    return offset[0] - base[0]


class _ScaleBook:
    """The whole-weight amaxes of one model's wrapped weights, refreshed together once per step."""

    def __init__(self) -> None:
        self.slots: list[_Slot] = []
        self.refreshes = 0   # all-reduces issued (tests and the example count them)

    def __deepcopy__(self, memo) -> "_ScaleBook":
        # Dynamo's guards deep-copy a traced shard's flatten context (code that reads a sharded
        # weight, e.g. its shape, outside its module's forward): the book is shared, not copied
        return self

    def amax(self, slot_id: int, shard: "Fp8AllGatherWeight", mesh) -> torch.Tensor:
        """The whole weight's amax (fp32 [1]) for the slot whose local shard is ``shard``."""
        slot = self.slots[slot_id]
        param = slot.sharded(mesh)
        if param is None or param._local_tensor is not shard:
            current = getattr(slot.module, slot.name)
            mesh_dims = getattr(getattr(current, "device_mesh", None), "ndim", None)
            raise RuntimeError(
                f"{slot.fqn}: FSDP2 all-gathers a weight that is not the module's parameter sharded on "
                f"the all-gather's mesh {mesh} (the parameter's mesh has {mesh_dims} dims); was the "
                f"parameter replaced after enable_fp8_all_gather?")
        # The optimizer's in-place update (and load_state_dict's copy_) bump the sharded
        # parameter's version counter: then the cached amax is stale.
        if slot.amax is None or slot.version != param._version:
            self._refresh(mesh)
        return slot.amax

    def _refresh(self, mesh) -> None:
        """The shard amaxes of every weight sharded on ``mesh`` now, all-reduced with MAX: one
        collective per distinct group (one for all on a 1-D mesh, under HSDP and under FSDP + TP;
        FSDP + TP adds one for weights TP leaves whole, which are split on dp_shard alone)."""
        members = [(slot, param) for slot in self.slots
                   if slot.block_quantizer is None and (param := slot.sharded(mesh)) is not None]
        amaxes = reduce_amaxes([slot.local_amax(param, mesh) for slot, param in members],
                               [slot.reduce_groups(param, mesh) for slot, param in members])
        self.refreshes += 1
        for (slot, param), amax in zip(members, amaxes):
            slot.amax, slot.version = amax, param._version


class Fp8AllGatherWeight(torch.Tensor):
    """A high-precision weight (shard) whose FSDP2 all-gather carries FP8 bytes.

    Holds the plain tensor in ``_tensor``; every op runs on it (views and copies stay wrapped, see
    ``_KEEP_WRAPPED``), so optimizers, ``state_dict`` and eager code see an ordinary weight.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, book: _ScaleBook, slot: int):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, device=tensor.device, layout=tensor.layout,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, book: _ScaleBook, slot: int) -> None:
        self._tensor = tensor
        self._book = book
        self._slot = slot

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def _quantizer(self):
        """Delayed scaling: the quantizer linking the weight's state (te_compile.state finds it
        through the sharded parameter, for recipe_state_dict); None for the other recipes."""
        return self._book.slots[self._slot].quantizer

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"Fp8AllGatherWeight({self._book.slots[self._slot].fqn}, {self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        unwrap = lambda t: t._tensor  # noqa: E731
        out = func(*pytree.tree_map_only(cls, unwrap, args), **pytree.tree_map_only(cls, unwrap, kwargs))
        if func._schema.is_mutable and args and isinstance(args[0], cls):
            return args[0]   # in place (copy_, the optimizer's add_): the wrapper itself
        if func not in _KEEP_WRAPPED:
            return out
        wrap = lambda t: cls(t, owner._book, owner._slot)  # noqa: E731
        return pytree.tree_map_only(torch.Tensor, wrap, out)

    def __reduce_ex__(self, protocol):
        # torch.save / torch.distributed.checkpoint store the plain weight: a checkpoint must not
        # depend on te_compile (and the scale book holds modules, which do not pickle)
        return self._tensor.__reduce_ex__(protocol)

    # torch.compile: a traceable wrapper around one inner tensor
    def __tensor_flatten__(self):
        return ["_tensor"], (self._book, self._slot)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner["_tensor"], *ctx)

    def _stable_hash_for_caching(self) -> str:
        """AOTAutograd's cache key for this weight as a graph input: traced code only unwraps the plain
        weight, so its layout and the slot; not the book, which holds modules and their weights' values
        (pickled, they would change the key at every step)."""
        return subclass_cache_hash(self, ["_tensor"], (self._slot,))

    # ---- FSDP2 all-gather extension ----------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """The local shard as FP8 bytes [ceil(rows / world), ...] (FSDP's padded shard size) and,
        as metadata, the whole weight's scale_inv [1], its amax [1] (delayed scaling) and the slot's
        quantizer: a Float8Tensor shard's all-gather."""
        slot = self._book.slots[self._slot]
        if tuple(self.shape[1:]) != tuple(orig_size[1:]):
            raise RuntimeError(f"{slot.fqn}: FP8 all-gather needs the weight sharded on dim 0 (rows, or the "
                               f"experts); shard {list(self.shape)} of {list(orig_size)} (a shard_placement_fn "
                               f"other than Shard(0)? keep such weights out of enable_fp8_all_gather with an "
                               f"override to recipe 'none' for their module)")
        dtype = mp_policy.param_dtype or self.dtype
        if slot.block_quantizer is not None:
            return self._block_pre_all_gather(slot, mesh, orig_size, dtype)
        if slot.experts:
            return self._expert_pre_all_gather(slot, mesh, orig_size, dtype)
        # max|round(x)| = round(max|x|): the fp32 amax rounded to param_dtype is the amax of the
        # weight in param_dtype, so one fp32 all-reduce serves every mixed-precision policy.
        amax = self._book.amax(self._slot, self, mesh).to(dtype).float()
        # the lowering's own quantization of a weight, with the whole weight's amax: the bytes one
        # process quantizing the unsharded weight would make
        scale = None if slot.quantizer is None else slot.quantizer.scale   # delayed: the graph's scale
        data, scale_inv, _ = quantize_per_tensor(self._tensor.to(dtype), "weight", slot.recipe, scale, amax)
        # then gathered as a Float8Tensor shard gathers itself; delayed scaling's weight carries the
        # whole weight's amax for the graph's history (current scaling: none)
        shard = Float8Tensor(data=data.view(torch.uint8), scale_inv=scale_inv, fp8_dtype=data.dtype, dtype=dtype,
                             amax=None if slot.quantizer is None else amax, quantizer=slot.quantizer)
        return shard.fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)

    def _expert_pre_all_gather(self, slot, mesh, orig_size, dtype):
        """A 3-D expert weight: each expert of the shard cast with that expert's scale (from the
        whole expert's amax, or delayed scaling's [E] state), the bytes padded to FSDP's shard size;
        every expert's scale_inv [E] (the same on every rank) and amax [E] travel as metadata."""
        amax = self._book.amax(self._slot, self, mesh).to(dtype).float()   # [E]: as the 2-D case says
        offset = _gathered_offset(slot.sharded(mesh), mesh)
        fp8_dtype = slot.recipe.fp8_format.dtype_for("weight")
        scale = current_scale(amax, "weight", slot.recipe) if slot.quantizer is None else slot.quantizer.scale
        local = scale[offset:offset + self.shape[0]]
        data = cast_to_fp8(self._tensor.to(dtype), local.view(-1, 1, 1), fp8_dtype).view(torch.uint8)
        meta = GroupedFsdpMeta(torch.div(torch.ones_like(scale), scale), fp8_dtype,
                               None if slot.quantizer is None else amax, slot.quantizer)
        return (fsdp_padded_shard(data, orig_size, mesh.size()),), meta

    def _block_pre_all_gather(self, slot, mesh, orig_size, dtype):
        """MXFP8 / Float8 block: the shard quantized on its own (its rows are whole blocks, so its
        blocks are the whole weight's), then gathered as such a shard gathers itself."""
        try:
            q = slot.block_quantizer.quantize(self._tensor.to(dtype))
            return q.fsdp_pre_all_gather(mesh, orig_size, None, None, None)
        except RuntimeError as e:
            raise RuntimeError(f"{slot.fqn}: {e}") from e

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """A Float8Tensor over the gathered bytes (FSDP trims the padding with as_strided); a block-
        scaled tensor over the gathered buffers. Under FSDP + TP the buffer ``out`` of a re-gather is
        the unsharded DTensor on the TP mesh; its local tensor is what the first gather returned."""
        out = local_value(out)
        if isinstance(metadata, FsdpBlockMeta):
            return fsdp_block_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        if isinstance(metadata, GroupedFsdpMeta):
            return fsdp_grouped_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        return fsdp_float8_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)


def _block_shard_problem(weight: torch.Tensor, recipe) -> Optional[str]:
    """Why FSDP2 cannot gather ``weight`` in ``recipe``'s block format, or None. Each rank's rows must
    be whole blocks (32 rows for MXFP8's columnwise copy, 128 for Float8 block's tiles) and the
    shards even: FSDP2 pads uneven shards to one size for every gathered buffer."""
    import torch.distributed as dist

    if (problem := recipe.primary_weight_problem()) is not None:
        return (f"{problem}; an FP8 all-gather needs the same, since the gathered weight rebuilds its "
                f"columnwise copy from the rowwise one")
    if not dist.is_initialized():
        return "block formats need the process group initialized first (to check the shards)"
    world, block = dist.get_world_size(), recipe.weight_gather_block_rows
    rows = weight.shape[0]
    if rows % (world * block):
        return (f"weight {list(weight.shape)}: {rows} rows do not split into whole {block}-row blocks over "
                f"{world} ranks (FSDP2 pads uneven shards; block scales cannot be padded)")
    return None


def _fp8_gather_weights(model: nn.Module, config: TeConfig):
    """(module, parameter name, fqn, recipe) of the weights gathered in FP8: the nn.Linear modules'
    (keyed by the module's fqn) and the 3-D expert weights of MoE layers (keyed by the parameter's
    fqn); and {fqn: why not} for the others."""
    chosen, skipped = [], {}
    for fqn, module in model.named_modules():
        recipe, _ = config.recipe_for(fqn)
        for name, param in module.named_parameters(recurse=False):
            if param.dim() != 3:
                continue
            key = f"{fqn}.{name}" if fqn else name   # an MoE layer's experts [E, ...]
            why = _expert_problem(param, recipe, config)
            if why:
                skipped[key] = why
            else:
                chosen.append((module, name, key, recipe))
        if not isinstance(module, nn.Linear):
            continue
        if not config.rewrite.linear:
            skipped[fqn] = "[rewrite] linear = false"
        elif not (recipe is not None and (recipe.per_tensor or recipe.weight_gather_block_rows)):
            name = recipe.name if recipe is not None else "none"
            skipped[fqn] = (f"recipe {name}: FP8 all-gather supports Float8CurrentScaling, DelayedScaling, "
                            f"MXFP8BlockScaling and Float8BlockScaling")
        elif isinstance(local_value(module.weight), Fp8AllGatherWeight):
            skipped[fqn] = "already wrapped"
        elif why := weight_ineligibility(local_value(module.weight), recipe):
            # the linear pass leaves such a linear in high precision; an FP8-gathered weight would
            # only lose precision there
            skipped[fqn] = why
        elif recipe.weight_gather_block_rows and (why := _block_shard_problem(local_value(module.weight), recipe)):
            skipped[fqn] = why
        else:
            chosen.append((module, "weight", fqn, recipe))
    return chosen, skipped


def _expert_problem(param: torch.Tensor, recipe, config: TeConfig) -> Optional[str]:
    """Why a 3-D expert weight [E, ...] is not gathered in FP8, or None."""
    if not config.rewrite.grouped_linear:
        return "[rewrite] grouped_linear = false"
    if recipe is None or not recipe.per_tensor:
        name = recipe.name if recipe is not None else "none"
        return (f"recipe {name}: expert weights are gathered in FP8 under Float8CurrentScaling and "
                f"DelayedScaling (one scale per expert)")
    if isinstance(local_value(param), Fp8AllGatherWeight):
        return "already wrapped"
    if param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"weight dtype {param.dtype} is not one of fp32, bf16, fp16"
    if any(d % recipe.gemm_alignment for d in param.shape[1:]):
        return f"expert weight {list(param.shape)}: {recipe.gemm_alignment_reason}"
    return None


def enable_fp8_all_gather(model: nn.Module, config: Union[str, os.PathLike, TeConfig, None] = None,
                          **options: Any) -> dict[str, str]:
    """Make FSDP2 all-gather the weights of ``model``'s FP8 linears as FP8. Call it once, before
    ``fully_shard`` and before building the optimizer; compile with the same config.

    ``config``/``options``: as for ``te_compile.backend`` (a TOML path or TeConfig, inline keys;
    default: the config ``torch.compile(..., backend="te")`` would resolve). Linears whose recipe is
    Float8CurrentScaling, DelayedScaling, MXFP8BlockScaling or Float8BlockScaling get their weight
    wrapped (block formats where the shards are whole blocks); so do the 3-D parameters of modules
    under Float8CurrentScaling or DelayedScaling, taken as MoE expert weights [E, ...] (one scale per
    expert; FSDP2 shards dim 0, so each rank holds whole experts); others keep high-precision
    all-gathers. Returns {linear fqn or expert weight fqn: what happened}, e.g. ``{"layers.0.mlp.up":
    "FP8 all-gather", "layers.0.moe.experts.w1": "FP8 all-gather (one scale per expert)", "lm_head":
    "recipe none: ..."}``.
    """
    chosen, outcome = _fp8_gather_weights(model, config_argument(config, options, "enable_fp8_all_gather"))
    book = _ScaleBook()
    for module, name, fqn, recipe in chosen:
        weight = getattr(module, name)
        book.slots.append(_Slot(module, name, fqn, recipe))
        if is_dtensor(weight):
            # tensor parallelism came first (torchtitan's order): the wrapper goes around the TP shard,
            # which FSDP2 shards again on its dp dim and all-gathers back to the TP shard
            from torch.distributed.tensor import DTensor

            inner = Fp8AllGatherWeight(weight._local_tensor.detach(), book, len(book.slots) - 1)
            wrapped = DTensor.from_local(inner, weight.device_mesh, weight.placements, run_check=False,
                                         shape=weight.shape, stride=weight.stride())
        else:
            wrapped = Fp8AllGatherWeight(weight.detach(), book, len(book.slots) - 1)
        setattr(module, name, nn.Parameter(wrapped, requires_grad=weight.requires_grad))
        outcome[fqn] = "FP8 all-gather" + (" (one scale per expert)" if weight.dim() == 3 else "")
    model._te_fp8_all_gather = book
    return dict(sorted(outcome.items()))
