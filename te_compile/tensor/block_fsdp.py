"""FSDP2's all-gather of block-scaled tensors (MXFP8, Float8 block) in their quantized form.

A block-scaled shard (an FP8 primary weight sharded by fully_shard, or te_compile/fsdp.py's quantized
high-precision shard) gathers its own buffers: rows split at block boundaries hold whole blocks, so
the gathered buffers are the whole weight's, bit for bit. BlockScaledTensor's FSDP2 hooks call these
two functions; te_compile/fsdp.py calls the post-all-gather for the shards it quantizes itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FsdpBlockMeta", "fsdp_block_pre_all_gather", "fsdp_block_post_all_gather"]


@dataclass(frozen=True)
class FsdpBlockMeta:
    """How to rebuild a gathered block-scaled tensor: its class, the gathered buffers' names (in
    order), its format fields, the whole tensor's shape and the quantizer it carries."""

    cls: type
    names: tuple
    format: dict
    shape: tuple
    quantizer: Any


def fsdp_block_pre_all_gather(tensor, mesh, orig_size) -> tuple[tuple[torch.Tensor, ...], FsdpBlockMeta]:
    """The shard's row-laid-out buffers (its class's ``_FSDP_GATHERED``), and how to rebuild the
    gathered tensor; ``tensor`` is a BlockScaledTensor shard of a tensor of ``orig_size``."""
    name = type(tensor).__name__
    if not tensor._FSDP_GATHERED:
        raise NotImplementedError(f"{name} cannot be all-gathered by FSDP2 in its quantized form")
    if tensor.dim() < 2 or tuple(tensor.shape[1:]) != tuple(orig_size[1:]):
        raise RuntimeError(f"{name}: an FSDP2 all-gather of block-scaled data needs dim-0 (row) shards; "
                           f"shard {list(tensor.shape)} of {list(orig_size)}")
    world = mesh.size()
    if orig_size[0] % world or tensor.shape[0] != orig_size[0] // world:
        # FSDP2 pads an uneven shard and wants every all-gather input at the padded shard size,
        # which scale buffers (fewer rows than the data) cannot be
        raise RuntimeError(f"{name}: an FSDP2 all-gather of block-scaled data needs even shards: "
                           f"{orig_size[0]} rows over {world} ranks")
    missing = [n[1:] for n in tensor._FSDP_GATHERED if getattr(tensor, n) is None]
    if missing:
        raise RuntimeError(f"{name}: the shard lacks {missing}, which the all-gather moves")
    format_fields = {n[1:]: getattr(tensor, n) for n in tensor._META}
    meta = FsdpBlockMeta(type(tensor), tensor._FSDP_GATHERED, format_fields, tuple(orig_size), tensor._quantizer)
    return tuple(getattr(tensor, n).contiguous() for n in tensor._FSDP_GATHERED), meta


def fsdp_block_post_all_gather(all_gather_outputs, metadata: FsdpBlockMeta, param_dtype, *, out=None):
    """FSDP2's post-all-gather of block-scaled buffers: the whole tensor over the gathered buffers
    (they are its storage: FSDP frees and refills them, the tensor follows)."""
    if out is not None:   # FSDP re-gathered into the buffers ``out`` already views
        if out._rowwise_data is None or (out._rowwise_data.untyped_storage().data_ptr()
                                         != all_gather_outputs[0].untyped_storage().data_ptr()):
            raise RuntimeError("FSDP2 re-gathered a block-scaled weight into a new buffer; expected "
                               "the buffers of the first all-gather")
        return None
    fields = {name[1:]: t for name, t in zip(metadata.names, all_gather_outputs)}
    weight = metadata.cls(shape=metadata.shape, dtype=param_dtype, quantizer=metadata.quantizer,
                          **fields, **metadata.format)
    return weight, tuple(all_gather_outputs)
