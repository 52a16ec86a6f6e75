"""Helpers on quantized tensors for custom recipes and distributed optimizers.

FP8 primary weights (te_compile.quantized_model_init) train with fp32 master weights held by the
optimizer, whole or ZeRO-sharded (each rank owns a flat range of each flattened weight). After each
optimizer step ``cast_master_weights_to_fp8`` writes the new bytes and scales into the model weights:
every rank writes the bytes of the range it owns, the scales come from amaxes all-reduced (MAX, one
packed collective for all weights) over ``amax_reduce_group``, so that after the optimizer's
all-gather of the bytes every rank holds what quantizing the whole updated weight in one process
gives, bit for bit (the te backend's on-the-fly quantization of the same values):

- current scaling: one amax per weight, scale from it (the quantizer's pow-2 and epsilon options);
- delayed scaling: the scale the compiled graph keeps for the weight (te_compile.state); the amax of
  the new values goes to the weight (``_amax``) for the graph's amax history;
- Float8 block (128x128 tiles) and MXFP8 (1x32 rowwise and 32x1 columnwise blocks): one amax per
  block; a rank computes the partial amax of the blocks its range touches (the rows around it,
  widened to block boundaries, other elements counted as 0), so shards may cut blocks anywhere.

``post_all_gather_processing`` rebuilds the copies derived from the rowwise bytes (a Float8Tensor's
transpose, a Float8 block weight's columnwise copy) once the bytes are gathered; ``replace_raw_data``
moves a weight's bytes into a caller's buffer (a slice of one flat ZeRO buffer).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed import is_dtensor
from ..kernels.float8_block_quantize import FLOAT8_BLOCK
from ..kernels.mxfp8_quantize import MXFP8_BLOCK, mxfp8_block_amax, mxfp8_cast, mxfp8_codes
from ..scaling import cast_to_fp8, compute_scale, tensor_amax
from .block_scaled_tensor import BlockScaledTensor, expand_block_scales, rows_cols
from .float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage
from .float8_tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    Float8TensorStorage,
    transpose_2d,
)
from .grouped_float8_tensor import GroupedFloat8Quantizer, GroupedFloat8Tensor
from .mxfp8_tensor import MXFP8Quantizer, MXFP8TensorStorage
from .quantized_tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer

__all__ = ["is_custom", "replace_raw_data", "cast_master_weights_to_fp8", "quantize_master_weights",
           "post_all_gather_processing"]


def is_custom(x) -> bool:
    """True for a quantizer, or a quantized tensor made by one, written outside te_compile
    (marked with a class attribute ``custom = True``, as the reference recipes are)."""
    if isinstance(x, Quantizer):
        return bool(getattr(x, "custom", False))
    if isinstance(x, QuantizedTensorStorage):
        if getattr(x, "custom", False):
            return True
        quantizer = getattr(x, "_quantizer", None)
        return quantizer is not None and is_custom(quantizer)
    return False


# The buffer holding each format's rowwise bytes (what a ZeRO all-gather moves).
_RAW_DATA = ((Float8TensorStorage, "_data"), (Float8BlockwiseQTensorStorage, "_rowwise_data"),
             (GroupedFloat8Tensor, "_data"))


def replace_raw_data(tensor: QuantizedTensorStorage, new_raw_data: torch.Tensor) -> None:
    """Move a quantized tensor's rowwise bytes into ``new_raw_data`` (e.g. a slice of one contiguous
    ZeRO buffer) and make it the tensor's buffer; the values do not change, the old buffer is released.
    Float8Tensor and GroupedFloat8Tensor (``_data``) and Float8BlockwiseQTensor (``_rowwise_data``);
    MXFP8 keeps two copies with their own scales, so one buffer cannot hold it."""
    field = next((name for cls, name in _RAW_DATA if isinstance(tensor, cls)), None)
    if field is None:
        raise ValueError(f"replace_raw_data needs a Float8Tensor, GroupedFloat8Tensor or Float8BlockwiseQTensor, got "
                         f"{type(tensor).__name__}" + (" (MXFP8 keeps two independently scaled copies; "
                                                       "gather both)" if isinstance(tensor, MXFP8TensorStorage) else ""))
    old = getattr(tensor, field)
    if old is None:
        raise ValueError("replace_raw_data: the tensor has no rowwise data to move")
    if new_raw_data.dtype != old.dtype or new_raw_data.shape != old.shape:
        raise ValueError(
            f"replace_raw_data: new buffer must be {old.dtype} of shape {tuple(old.shape)}, "
            f"got {new_raw_data.dtype} of shape {tuple(new_raw_data.shape)}"
        )
    new_raw_data.detach().copy_(old)
    setattr(tensor, field, new_raw_data)


def post_all_gather_processing(model_weights) -> None:
    """Rebuild, from the gathered rowwise bytes, the copies derived from them: a Float8Tensor's
    transpose cache and a Float8 block weight's columnwise copy, where the weight keeps one. MXFP8
    (both copies are cast and gathered), GroupedFloat8Tensor (no derived copy) and plain tensors need
    nothing. Idempotent."""
    weights = model_weights if isinstance(model_weights, (list, tuple)) else [model_weights]
    for weight in weights:
        if isinstance(weight, Float8Tensor):
            if weight._transpose is not None:
                weight._transpose = transpose_2d(weight._data)
        elif isinstance(weight, Float8BlockwiseQTensor):
            if weight._columnwise_data is not None:
                weight._columnwise_data = None
                weight.update_usage(columnwise_usage=True)
        elif isinstance(weight, QuantizedTensor) and not isinstance(weight, (MXFP8TensorStorage, GroupedFloat8Tensor)):
            raise ValueError(f"post_all_gather_processing: {type(weight).__name__} is not supported")


# ---- cast_master_weights_to_fp8 ---------------------------------------------------------------------

class _Logical:
    """An FSDP2-sharded per-tensor FP8 weight as the cast sees it: the whole weight's shape and numel,
    the local shard's (whole-weight) scale and amax."""

    def __init__(self, dtensor) -> None:
        local = dtensor._local_tensor
        if not isinstance(local, Float8Tensor):
            raise ValueError(f"cast_master_weights_to_fp8: a sharded weight must hold a Float8Tensor shard, "
                             f"got {type(local).__name__}")
        self.shape, self.dtype, self.device = dtensor.shape, local.dtype, local.device
        self._local = local

    def numel(self) -> int:
        return self.shape.numel()

    def __getattr__(self, name):   # _scale_inv, _amax, _data, _fp8_dtype, _transpose of the shard
        return getattr(self.__dict__["_local"], name)

    def __setattr__(self, name, value):
        if name in ("shape", "dtype", "device", "_local"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._local, name, value)


def _block_shard(dtensor, dest, master: Optional[torch.Tensor], start: int, i: int):
    """The local shard an FSDP2-sharded block-scaled weight's bytes go to. FSDP2 cuts such a weight
    at block boundaries (fully_shard refuses other cuts), so the shard's blocks are whole: the cast
    is local to the shard, with no amax reduction. The master must be the shard's rows, all of them
    (raises otherwise), so it starts at the shard's first element."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = dtensor._local_tensor
    if dest is not local and not (type(dest) is type(local) and dest.shape == local.shape):
        raise ValueError(f"cast_master_weights_to_fp8: fsdp_shard_model_weights[{i}] must be the local shard "
                         f"of model_weights[{i}] (a {type(local).__name__} of shape {tuple(local.shape)})")
    _, offset = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    row0 = offset[0] * math.prod(dtensor.shape[1:-1])
    local_start = start - row0 * dtensor.shape[-1]
    got = 0 if master is None else master.numel()
    if (master is None) != (local.numel() == 0) or (master is not None and (local_start != 0 or got != local.numel())):
        raise ValueError(f"cast_master_weights_to_fp8: master_weights[{i}] must be the rank's whole shard of the "
                         f"block-scaled weight: {local.numel()} elements from offset {row0 * dtensor.shape[-1]}, "
                         f"got {got} from {start}")
    return dest


class _Item:
    """One weight's share of the cast: its master range (flat, in the weight's dtype) or None.
    ``local``: its amaxes are the whole story (a block-scaled FSDP2 shard): no all-reduce."""

    def __init__(self, weight, master: Optional[torch.Tensor], start: int, quantizer, dest, local: bool = False):
        self.weight, self.master, self.start, self.quantizer, self.dest = weight, master, start, quantizer, dest
        self.local = local
        self.m, self.k = rows_cols(weight.shape)

    @property
    def stop(self) -> int:
        return self.start + self.master.numel()

    def rows(self, block: int) -> tuple[int, int, torch.Tensor]:
        """(r0, r1, sub): rows [r0, r1) of the weight around the master range, widened to multiples
        of ``block`` (or the end), as fp32 [r1 - r0, K] holding the master values and 0 elsewhere."""
        r0 = self.start // self.k // block * block
        end_row = -(-self.stop // self.k)   # one past the last row the range touches
        r1 = min(self.m, -(-end_row // block) * block)
        sub = torch.zeros((r1 - r0) * self.k, dtype=torch.float32, device=self.master.device)
        sub[self.start - r0 * self.k:self.stop - r0 * self.k] = self.master.to(torch.float32)
        return r0, r1, sub.view(r1 - r0, self.k)

    def write(self, buffer: torch.Tensor, sub_bytes: torch.Tensor, r0: int) -> None:
        """Copy the master range's bytes out of ``sub_bytes`` (rows from r0) into ``buffer``."""
        flat = sub_bytes.reshape(-1)[self.start - r0 * self.k:self.stop - r0 * self.k]
        if not buffer.is_contiguous():
            raise ValueError("cast_master_weights_to_fp8: the weight's bytes are not contiguous; make them "
                             "so (quantized_model_init does) before casting flat ranges into them")
        buffer.view(-1)[self.start:self.stop].copy_(flat)


class _PerTensor:
    """Float8Tensor weights: current scaling (Float8CurrentScalingQuantizer) or delayed (Float8Quantizer)."""

    @staticmethod
    def amaxes(item: _Item) -> list[torch.Tensor]:
        device = item.weight._scale_inv.device
        if item.master is None:
            return [torch.zeros(1, dtype=torch.float32, device=device)]
        return [tensor_amax(item.master).to(device)]

    @staticmethod
    def finish(item: _Item, amaxes: list[torch.Tensor], manual: bool) -> None:
        weight, q = item.weight, item.quantizer
        [amax] = amaxes
        if isinstance(q, Float8CurrentScalingQuantizer):
            scale = compute_scale(amax, q.dtype, force_pow_2_scales=q.force_pow_2_scales,
                                  amax_epsilon=q.amax_epsilon)
            q.amax, q.scale = amax, scale
        else:
            # delayed scaling: the graph's scale for this weight; the new amax for its history
            scale = q.scale.reshape(1).to(amax.device)
            q.amax.copy_(amax.to(q.amax.device).reshape(q.amax.shape))
            if weight._amax is not None:
                weight._amax.copy_(amax)
        scale_inv = torch.div(torch.ones_like(scale), scale)
        targets = [weight] + ([item.dest] if isinstance(item.dest, Float8TensorStorage) else [])
        for t in targets:
            t._scale_inv.copy_(scale_inv)
            if not manual:
                t._transpose = None   # stale; post_all_gather_processing or the GEMM rebuilds it
        if item.master is None:
            return
        data = cast_to_fp8(item.master, scale, q.dtype).view(torch.uint8)
        if item.dest is None:
            weight._data.view(-1)[item.start:item.stop].copy_(data)
        else:
            raw = item.dest._data if isinstance(item.dest, Float8TensorStorage) else item.dest
            raw.view(-1).copy_(data)


class _PerExpert:
    """GroupedFloat8Tensor weights (MoE experts [E, ...], one per-tensor scale each): current scaling
    (a Float8CurrentScalingQuantizer, its options applied per expert) or delayed (GroupedFloat8Quantizer:
    the graph's [E] scales)."""

    @staticmethod
    def _experts(item: _Item) -> tuple[int, int, torch.Tensor]:
        """(e0, e1, sub): the experts [e0, e1) the master range touches, as fp32 [e1 - e0, per expert]
        holding the master values and 0 elsewhere."""
        per = item.weight.numel() // item.weight.shape[0]
        e0, e1 = item.start // per, -(-item.stop // per)
        sub = torch.zeros((e1 - e0) * per, dtype=torch.float32, device=item.master.device)
        sub[item.start - e0 * per:item.stop - e0 * per] = item.master.to(torch.float32)
        return e0, e1, sub.view(e1 - e0, per)

    @staticmethod
    def amaxes(item: _Item) -> list[torch.Tensor]:
        amax = torch.zeros(item.weight.shape[0], dtype=torch.float32, device=item.weight._scale_inv.device)
        if item.master is not None:
            e0, e1, sub = _PerExpert._experts(item)
            amax[e0:e1] = sub.abs().amax(dim=1).to(amax.device)
        return [amax]

    @staticmethod
    def finish(item: _Item, amaxes: list[torch.Tensor], manual: bool) -> None:
        weight, q = item.weight, item.quantizer
        [amax] = amaxes
        if isinstance(q, Float8CurrentScalingQuantizer):
            scale = compute_scale(amax, q.dtype, force_pow_2_scales=q.force_pow_2_scales, amax_epsilon=q.amax_epsilon)
        else:   # delayed scaling: the graph's scales for this weight; the new amaxes for its histories
            scale = q.scale.to(amax.device)
        if weight._amax is not None:
            weight._amax.copy_(amax)
        weight._scale_inv.copy_(torch.div(torch.ones_like(scale), scale))
        if item.master is None:
            return
        e0, e1, sub = _PerExpert._experts(item)
        data = cast_to_fp8(sub, scale[e0:e1, None], q.dtype).view(torch.uint8)
        per = sub.shape[1]
        weight._data.view(-1)[item.start:item.stop].copy_(data.reshape(-1)[item.start - e0 * per:item.stop - e0 * per])


class _Float8Block:
    """Float8BlockwiseQTensor weights with 128x128 tiles (rowwise bytes; the columnwise copy is their
    transpose)."""

    @staticmethod
    def _grid_shape(item: _Item) -> tuple[int, int]:
        return -(-item.m // FLOAT8_BLOCK), -(-item.k // FLOAT8_BLOCK)

    @staticmethod
    def amaxes(item: _Item) -> list[torch.Tensor]:
        grid = torch.zeros(_Float8Block._grid_shape(item), dtype=torch.float32, device=item.weight.device)
        if item.master is not None:
            r0, r1, sub = item.rows(FLOAT8_BLOCK)
            rows, cols = -(-(r1 - r0) // FLOAT8_BLOCK), grid.shape[1]
            tiles = F.pad(sub, (0, cols * FLOAT8_BLOCK - item.k, 0, rows * FLOAT8_BLOCK - (r1 - r0)))
            tile_amax = tiles.reshape(rows, FLOAT8_BLOCK, cols, FLOAT8_BLOCK).abs().amax(dim=(1, 3))
            grid[r0 // FLOAT8_BLOCK:r0 // FLOAT8_BLOCK + rows] = tile_amax
        return [grid]

    @staticmethod
    def finish(item: _Item, amaxes: list[torch.Tensor], manual: bool) -> None:
        weight, q = item.weight, item.quantizer
        [grid] = amaxes
        scale = compute_scale(grid, q.dtype, force_pow_2_scales=q.force_pow_2_scales, amax_epsilon=q.amax_epsilon)
        weight._rowwise_scale_inv.copy_(torch.div(torch.ones_like(scale), scale))
        if not manual and weight._columnwise_data is not None:
            weight.update_usage(columnwise_usage=False)   # stale; derived again where a GEMM needs it
        if item.master is None:
            return
        r0, r1, sub = item.rows(FLOAT8_BLOCK)
        tile_scale = scale[r0 // FLOAT8_BLOCK:-(-r1 // FLOAT8_BLOCK)]
        elem_scale = expand_block_scales(expand_block_scales(tile_scale, 0, r1 - r0, FLOAT8_BLOCK),
                                         1, item.k, FLOAT8_BLOCK)
        item.write(weight._rowwise_data, cast_to_fp8(sub, elem_scale, q.dtype).view(torch.uint8), r0)


class _MXFP8:
    """MXFP8Tensor weights: rowwise 1x32 and columnwise 32x1 blocks, both copies [M, K]."""

    @staticmethod
    def amaxes(item: _Item) -> list[torch.Tensor]:
        m, k, b, device = item.m, item.k, MXFP8_BLOCK, item.weight.device
        row = torch.zeros(m, -(-k // b), dtype=torch.float32, device=device)
        col = torch.zeros(-(-m // b), k, dtype=torch.float32, device=device)
        if item.master is not None:
            r0, r1, sub = item.rows(b)
            row[r0:r1] = mxfp8_block_amax(sub)
            col[r0 // b:-(-r1 // b)] = mxfp8_block_amax(sub.t().contiguous()).t()
        return [row, col]

    @staticmethod
    def finish(item: _Item, amaxes: list[torch.Tensor], manual: bool) -> None:
        weight, q, b = item.weight, item.quantizer, MXFP8_BLOCK
        row_code, col_code = (mxfp8_codes(a, q.dtype) for a in amaxes)
        weight._rowwise_scale_inv.copy_(row_code.to(torch.uint8))
        weight._columnwise_scale_inv.copy_(col_code.to(torch.uint8))
        if item.master is None:
            return
        r0, r1, sub = item.rows(b)
        item.write(weight._rowwise_data, mxfp8_cast(sub, row_code[r0:r1], q.dtype), r0)
        col_bytes = mxfp8_cast(sub.t().contiguous(), col_code[r0 // b:-(-r1 // b)].t().contiguous(), q.dtype)
        item.write(weight._columnwise_data, col_bytes.t(), r0)


def _kind(weight, quantizer, i: int):
    if isinstance(weight, GroupedFloat8Tensor) and isinstance(quantizer, (Float8CurrentScalingQuantizer,
                                                                          GroupedFloat8Quantizer)):
        return _PerExpert
    if isinstance(weight, _Logical) and isinstance(quantizer, (Float8CurrentScalingQuantizer, Float8Quantizer)):
        return _PerTensor
    if isinstance(weight, Float8Tensor) and isinstance(quantizer, (Float8CurrentScalingQuantizer, Float8Quantizer)):
        if weight._data is None:
            raise ValueError(f"cast_master_weights_to_fp8: model_weights[{i}] has no rowwise bytes")
        return _PerTensor
    if isinstance(weight, Float8BlockwiseQTensor) and isinstance(quantizer, Float8BlockQuantizer):
        if not weight._is_2D_scaled or weight._rowwise_data is None:
            raise ValueError(f"cast_master_weights_to_fp8: model_weights[{i}] needs 128x128 tiles and a "
                             f"rowwise copy (1x128 blocks cannot be cast from a flat shard)")
        return _Float8Block
    if isinstance(weight, MXFP8TensorStorage) and isinstance(quantizer, MXFP8Quantizer):
        if weight._rowwise_data is None or weight._columnwise_data is None:
            raise ValueError(f"cast_master_weights_to_fp8: model_weights[{i}] needs both MXFP8 copies")
        return _MXFP8
    raise ValueError(
        f"cast_master_weights_to_fp8: model_weights[{i}] is a {type(weight).__name__} with quantizer "
        f"{type(quantizer).__name__}; supported: Float8Tensor (current or delayed scaling), "
        f"GroupedFloat8Tensor (MoE experts, current or delayed scaling), Float8BlockwiseQTensor (128x128 "
        f"tiles), MXFP8Tensor"
    )


def _prepare(i: int, weight, master: Optional[torch.Tensor], quantizer: Optional[Quantizer],
             start: Optional[int], dest: Optional[torch.Tensor]):
    """(the ``_Item`` of model_weights[i], its kind) after checking its arguments; clears the
    weight's high-precision init value."""
    local = False
    if is_dtensor(weight):
        # an FSDP2-sharded weight: the scales live in the local shard (the same on every rank),
        # the bytes go to the shard passed in fsdp_shard_model_weights
        if dest is None:
            raise ValueError(f"cast_master_weights_to_fp8: model_weights[{i}] is sharded (a DTensor); "
                             f"pass its local shard in fsdp_shard_model_weights")
        quantizer = quantizer if quantizer is not None else getattr(weight._local_tensor, "_quantizer", None)
        if isinstance(weight._local_tensor, BlockScaledTensor):
            weight = _block_shard(weight, dest, master, start or 0, i)
            start, dest, local = 0, None, True
        else:
            weight = _Logical(weight)
    if quantizer is None:
        raise ValueError(f"cast_master_weights_to_fp8: model_weights[{i}] has no quantizer (not made by "
                         f"quantized_model_init); pass quantizers=")
    kind = _kind(weight, quantizer, i)
    if master is not None:
        if start is None or start < 0 or start + master.numel() > weight.numel():
            raise ValueError(f"cast_master_weights_to_fp8: master_weights[{i}] ({master.numel()} elements "
                             f"from offset {start}) does not fit model_weights[{i}] ({weight.numel()})")
        master = master.detach().reshape(-1).to(device=weight.device, dtype=weight.dtype)
    if dest is not None:
        if kind is not _PerTensor:
            raise NotImplementedError(f"cast_master_weights_to_fp8: fsdp_shard_model_weights[{i}] with a "
                                      f"whole block-scaled model_weights[{i}]: pass the FSDP2 parameter "
                                      f"(the DTensor) as the model weight")
        if master is None or dest.numel() != master.numel():
            raise ValueError(f"cast_master_weights_to_fp8: fsdp_shard_model_weights[{i}] must hold the "
                             f"same elements as master_weights[{i}]")
    if isinstance(weight, (QuantizedTensor, _Logical)):
        weight.clear_high_precision_init_val()
    return _Item(weight, master, start or 0, quantizer, dest, local), kind


def _all_reduce_max_packed(amaxes: list[torch.Tensor], group) -> None:
    """All-reduce (MAX) ``amaxes`` in place over ``group`` as one packed buffer."""
    packed = torch.cat([a.reshape(-1).to(amaxes[0].device) for a in amaxes])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    for a in amaxes:
        a.copy_(packed[offset:offset + a.numel()].view(a.shape))
        offset += a.numel()


def cast_master_weights_to_fp8(
    model_weights: Sequence[torch.Tensor],
    master_weights: Sequence[Optional[torch.Tensor]],
    quantizers: Optional[Sequence[Optional[Quantizer]]] = None,
    amax_reduce_group=None,
    *,
    start_offsets: Optional[Sequence[Optional[int]]] = None,
    fsdp_shard_model_weights: Optional[Sequence[Optional[torch.Tensor]]] = None,
    manual_post_all_gather_processing: bool = False,
) -> None:
    """Write updated fp32 master weights into FP8 primary weights (bytes and scales), in place.

    model_weights: the quantized weights (whole on every rank). master_weights[i]: None (another rank
    owns all of weight i), the whole weight, or a flat shard: elements [start_offsets[i],
    start_offsets[i] + numel) of the flattened weight. It is cast to the weight's nominal dtype first,
    as an unquantized model would round it before quantizing. quantizers: per weight, default the
    weight's own (quantized_model_init sets it). amax_reduce_group: the ranks that share the weights
    (the data-parallel group); required when master weights are sharded. fsdp_shard_model_weights:
    for FSDP2-sharded model weights (DTensors), the local shards where the bytes go: a Float8Tensor (or
    its uint8 bytes) holding the same elements as master_weights[i], or a block-scaled shard (MXFP8,
    Float8 block), whose master is the rank's whole shard (FSDP2 cuts those weights at block
    boundaries, so their scales need no reduction).
    manual_post_all_gather_processing: keep derived copies (transposes) as they are; the caller calls
    ``post_all_gather_processing`` after gathering the bytes. Otherwise they are dropped (the GEMMs
    derive them from the rowwise bytes where needed).

    Clears each weight's high-precision init value (the master weights exist now).
    """
    n = len(model_weights)
    if quantizers is not None and any(isinstance(q, int) for q in quantizers):
        raise ValueError("cast_master_weights_to_fp8: quantizers holds ints, which look like start offsets: "
                         "the third positional argument here is quantizers; pass start_offsets= and "
                         "amax_reduce_group= by keyword, or call quantize_master_weights (TransformerEngine's "
                         "positional order)")
    quantizers = list(quantizers) if quantizers is not None else [getattr(w, "_quantizer", None) for w in model_weights]
    start_offsets = list(start_offsets) if start_offsets is not None else [0] * n
    dests = list(fsdp_shard_model_weights) if fsdp_shard_model_weights is not None else [None] * n
    for name, seq in (("master_weights", master_weights), ("quantizers", quantizers),
                      ("start_offsets", start_offsets), ("fsdp_shard_model_weights", dests)):
        if len(seq) != n:
            raise ValueError(f"cast_master_weights_to_fp8: {name} has {len(seq)} entries, model_weights {n}")
    items, kinds = [], []
    for i, args in enumerate(zip(model_weights, master_weights, quantizers, start_offsets, dests)):
        item, kind = _prepare(i, *args)
        items.append(item)
        kinds.append(kind)

    sharded = any(not it.local and (it.master is None or it.master.numel() != it.weight.numel()) for it in items)
    if sharded and amax_reduce_group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("cast_master_weights_to_fp8: master weights are sharded, so the amaxes must be "
                         "all-reduced: pass amax_reduce_group (the data-parallel group)")

    # One packed MAX all-reduce for every amax of every weight (but those of whole-block shards).
    local = [kind.amaxes(item) for kind, item in zip(kinds, items)]
    flat = [a for item, per_item in zip(items, local) if not item.local for a in per_item]
    if flat and amax_reduce_group is not None:
        _all_reduce_max_packed(flat, amax_reduce_group)
    for kind, item, amaxes in zip(kinds, items, local):
        kind.finish(item, amaxes, manual_post_all_gather_processing)


def quantize_master_weights(model_weights, master_weights, start_offsets, group, fsdp_shard_model_weights=None,
                            manual_post_all_gather_processing: bool = False) -> None:
    """``cast_master_weights_to_fp8`` with TransformerEngine's newer name and positional order
    (model_weights, master_weights, start_offsets, group, ...), for code written against it."""
    cast_master_weights_to_fp8(model_weights, master_weights, None, group, start_offsets=start_offsets,
                               fsdp_shard_model_weights=fsdp_shard_model_weights,
                               manual_post_all_gather_processing=manual_post_all_gather_processing)
