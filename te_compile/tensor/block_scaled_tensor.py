"""What the block-scaled tensors (MXFP8, Float8 block, NVFP4) share: buffers, views, copies, saving.

A block-scaled tensor of logical shape [..., K] is stored as the 2-D matrix x2d = [M, K] (M = numel / K)
in up to two copies, each quantized from high precision:
- rowwise (``_rowwise_data``, ``_rowwise_scale_inv``): blocks run along K, for GEMMs contracting K;
- columnwise (``_columnwise_data``, ``_columnwise_scale_inv``): blocks run along M, for GEMMs contracting
  M (dgrad of a weight, wgrad of an activation). Its layout is the format's (MXFP8 keeps [M, K];
  Float8 block and NVFP4 store the transpose [K, M], as TransformerEngine does).
Each format class names its extra buffers and format fields and says how to dequantize each copy and
how to cut a range of rows; everything else (usage, saving, views, copies, torch.compile flattening,
pickling) lives here once, and FSDP2's all-gather in block_fsdp.py.

Views: only what keeps the block layout is a view: reshapes whose last dim is x2d's K and the flat
1-D view (the 2-D buffers do not change; FSDP2 keeps a flat view of each shard), and slices / splits
along dim 0 at block boundaries (what FSDP2 sharding does). Anything else that would move elements
across blocks (transpose, slicing the last dim, ...) raises; call ``dequantize()`` first.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .block_fsdp import fsdp_block_post_all_gather, fsdp_block_pre_all_gather
from .quantized_tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer, implements

__all__ = ["BlockScaledTensorStorage", "BlockScaledTensor", "BlockScaledQuantizer", "expand_block_scales"]

aten = torch.ops.aten


def rows_cols(shape: torch.Size) -> tuple[int, int]:
    """(M, K) of the 2-D matrix a tensor of ``shape`` is stored as."""
    if len(shape) == 0:
        return 1, 1
    k = shape[-1]
    return math.prod(shape[:-1]), k


def expand_block_scales(scale: torch.Tensor, dim: int, size: int, block: int) -> torch.Tensor:
    """Each block's scale repeated over the ``block`` elements it covers along ``dim``, ``size``
    elements in all (the last block may be partial).

    A gather rather than repeat_interleave-then-slice: inductor (torch 2.13, CPU) miscompiles the
    latter when the last block is partial and leaves the ragged tail unwritten.
    """
    index = torch.arange(size, device=scale.device) // block
    return scale.index_select(dim, index)


class BlockScaledTensorStorage(QuantizedTensorStorage):
    """Buffers of a block-scaled tensor without torch.Tensor behaviour (TE's internal tensor)."""

    # tensor fields in the order used by prepare_for_saving and __tensor_flatten__
    _BUFFERS: tuple[str, ...] = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                                 "_columnwise_scale_inv")
    # non-tensor fields that describe the format; constructor keywords are these names without "_"
    _META: tuple[str, ...] = ()

    def __init__(self, *, shape, dtype: torch.dtype = torch.float32, quantizer=None, **fields) -> None:
        self._init_fields(shape, dtype, quantizer, fields)

    def _init_fields(self, shape, dtype, quantizer, fields) -> None:
        fields = dict(fields)
        for name in self._BUFFERS:
            setattr(self, name, fields.pop(name[1:], None))
        for name in self._META:
            if name[1:] not in fields:
                raise TypeError(f"{type(self).__name__}: missing format field {name[1:]!r}")
            setattr(self, name, fields.pop(name[1:]))
        if fields:
            raise TypeError(f"{type(self).__name__}: unexpected fields {sorted(fields)}")
        if self._rowwise_data is None and self._columnwise_data is None:
            raise ValueError(f"a {type(self).__name__} needs a rowwise or a columnwise copy (both were None)")
        self._quantizer = quantizer
        self._logical_shape = torch.Size(shape)
        self._nominal_dtype = dtype

    # ---- format hooks ----------------------------------------------------------------------------
    def _dequantize_rowwise(self) -> torch.Tensor:
        """fp32 [M, K] from the rowwise copy."""
        raise NotImplementedError

    def _dequantize_columnwise(self) -> torch.Tensor:
        """fp32 [M, K] (original orientation) from the columnwise copy."""
        raise NotImplementedError

    def _slice_rows(self, start: int, stop: int) -> dict:
        """The fields (constructor keywords) of rows [start, stop) of x2d; raise where blocks forbid."""
        raise NotImplementedError

    def _x2d_cols(self) -> int:
        """K of the x2d the buffers hold (a flat 1-D view keeps its source's x2d: K is not its last dim)."""
        raise NotImplementedError

    def _x2d(self) -> tuple[int, int]:
        """(M, K) of the x2d the buffers hold."""
        k = self._x2d_cols()
        return (self._logical_shape.numel() // k if k else rows_cols(self._logical_shape)[0]), k

    def _derived_copy(self, columnwise: bool) -> Optional[dict]:
        """Buffers of the missing copy computed from the other one, where the format allows (2-D
        blocks are the same tiles both ways); None where only high precision can give them."""
        return None

    # ---- shared behaviour --------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self._logical_shape

    @property
    def device(self) -> torch.device:
        data = self._rowwise_data if self._rowwise_data is not None else self._columnwise_data
        return data.device

    def _fields(self) -> dict:
        out = {name[1:]: getattr(self, name) for name in self._BUFFERS}
        out.update({name[1:]: getattr(self, name) for name in self._META})
        return out

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Values from the rowwise copy if present, else from the columnwise copy."""
        if self._rowwise_data is not None:
            values = self._dequantize_rowwise()
        else:
            values = self._dequantize_columnwise()
        return values.reshape(self._logical_shape).to(dtype or self._nominal_dtype)

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None):
        for want, name in ((rowwise_usage, "rowwise"), (columnwise_usage, "columnwise")):
            if want and getattr(self, f"_{name}_data") is None:
                derived = self._derived_copy(columnwise=name == "columnwise")
                if derived is None:
                    raise ValueError(
                        f"{type(self).__name__} has no {name} copy and cannot derive one from the other "
                        f"copy (its blocks run the other way); quantize from high precision with "
                        f"{name} usage on"
                    )
                for key, value in derived.items():
                    setattr(self, "_" + key, value)
        for drop, name, other in ((rowwise_usage, "rowwise", "columnwise"),
                                  (columnwise_usage, "columnwise", "rowwise")):
            if drop is False:
                if getattr(self, f"_{other}_data") is None:
                    raise ValueError(f"cannot drop the {name} copy: no {other} copy exists")
                for key in self._BUFFERS:
                    if key.startswith(f"_{name}_") or key == f"_amax_{name}":
                        setattr(self, key, None)
        return self

    def prepare_for_saving(self):
        tensors = [getattr(self, name) for name in self._BUFFERS]
        for name in self._BUFFERS:
            setattr(self, name, None)
        return tensors, self

    def restore_from_saved(self, tensors):
        n = len(self._BUFFERS)
        for name, value in zip(self._BUFFERS, tensors[:n]):
            setattr(self, name, value)
        return list(tensors[n:])

    def clear(self) -> None:
        for name in self._BUFFERS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.new_empty(0))

    def get_metadata(self) -> dict:
        out = self._fields()
        out.update(shape=self._logical_shape, dtype=self._nominal_dtype, quantizer=self._quantizer)
        return out

    def _check_row_cut(self, start: int, stop: int, granule: int, what: str) -> None:
        """Rows may only be cut at multiples of ``granule`` (the end of the tensor is always fine)."""
        m, _ = self._x2d()
        for edge in (start, stop):
            if edge % granule and edge != m:
                raise RuntimeError(
                    f"{type(self).__name__}: cannot cut rows [{start}, {stop}) of a [{m}, ...] tensor: "
                    f"{what} span {granule} rows, so cuts must fall on multiples of {granule}"
                )


_CLASSES: dict[str, type] = {}


def _rebuild_block_scaled_tensor(cls_name: str, fields: dict, shape, dtype, requires_grad):
    """torch.load entry point (allow-listed for ``weights_only=True``)."""
    return _CLASSES[cls_name](shape=shape, dtype=dtype, requires_grad=requires_grad, **fields)


class BlockScaledTensor(QuantizedTensor, BlockScaledTensorStorage):
    """A torch.Tensor of nominal ``dtype`` whose values live in a block-scaled format."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _CLASSES[cls.__name__] = cls

    @staticmethod
    def __new__(cls, *, shape, dtype: torch.dtype = torch.float32, quantizer=None,
                requires_grad: bool = False, **fields):
        data = fields.get("rowwise_data")
        if data is None:
            data = fields.get("columnwise_data")
        if data is None:
            raise ValueError(f"a {cls.__name__} needs a rowwise or a columnwise copy (both were None)")
        self = QuantizedTensor.__new__(cls, torch.Size(shape), dtype, device=data.device,
                                       requires_grad=requires_grad)
        self._init_fields(shape, dtype, quantizer, fields)
        return self

    def __init__(self, *args, **kwargs):  # all work happens in __new__
        pass

    # torch.Tensor (earlier in the MRO) has a dequantize of its own; the storage's is meant.
    dequantize = BlockScaledTensorStorage.dequantize

    def _default_quantizer(self) -> Quantizer:
        """A quantizer of this tensor's format, for re-quantizing when none travels with it."""
        raise NotImplementedError

    def _like(self, *, shape=None, dtype=None, requires_grad: bool = False, **overrides):
        fields = self._fields()
        fields.update(overrides)
        return type(self)(shape=self.shape if shape is None else shape, dtype=dtype or self.dtype,
                          quantizer=self._quantizer, requires_grad=requires_grad, **fields)

    def _map_buffers(self, fn, **kwargs):
        """A tensor of the same format with ``fn`` applied to every buffer."""
        moved = {name[1:]: (None if getattr(self, name) is None else fn(getattr(self, name)))
                 for name in self._BUFFERS}
        return self._like(**moved, **kwargs)

    def _requantizer(self) -> Quantizer:
        quantizer = (self._quantizer or self._default_quantizer()).copy()
        quantizer.set_usage(rowwise=self._rowwise_data is not None,
                            columnwise=self._columnwise_data is not None)
        return quantizer

    def quantize_(self, tensor: torch.Tensor):
        self._requantizer().update_quantized(tensor, self)
        return self

    def _copy_from(self, src: torch.Tensor):
        same_layout = (
            type(src) is type(self) and src.shape == self.shape
            and all(getattr(src, n) == getattr(self, n) for n in self._META)
            and all((getattr(src, n) is None) == (getattr(self, n) is None) for n in self._BUFFERS)
            and all(getattr(src, n).shape == getattr(self, n).shape for n in self._BUFFERS
                    if getattr(self, n) is not None)
        )
        if same_layout:
            # quantized <- quantized of the same format: the bytes and scales, no rounding
            for name in self._BUFFERS:
                if getattr(self, name) is not None:
                    getattr(self, name).copy_(getattr(src, name))
            return self
        values = src.dequantize() if isinstance(src, QuantizedTensor) else src
        return self.quantize_(values.to(self.device).expand(self.shape))

    def detach(self):
        return self._like()._alias_of(self)

    def __repr__(self, *, tensor_contents=None) -> str:
        meta = ", ".join(f"{name[1:]}={getattr(self, name)}" for name in self._META)
        copies = "+".join(n for n in ("rowwise", "columnwise") if getattr(self, f"_{n}_data") is not None)
        head = f"{type(self).__name__}({meta}, dtype={self.dtype}, shape={tuple(self.shape)}, {copies}"
        buffers = [getattr(self, n) for n in self._BUFFERS if getattr(self, n) is not None]
        # values only from real buffers: while torch.compile traces they are fake tensors
        if any(type(t) is not torch.Tensor or t.device.type == "meta" for t in buffers):
            return head + ")"
        return f"{head}, data={self.dequantize()})"

    def __reduce_ex__(self, protocol):
        return (_rebuild_block_scaled_tensor,
                (type(self).__name__, self._fields(), tuple(self.shape), self.dtype, self.requires_grad))

    def __deepcopy__(self, memo):
        return self._map_buffers(torch.clone, requires_grad=self.requires_grad)

    # torch.compile: the buffers are the inner tensors; the format travels in the context.
    def __tensor_flatten__(self):
        names = [name for name in self._BUFFERS if getattr(self, name) is not None]
        return names, (tuple(getattr(self, name) for name in self._META), self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        meta, dtype = ctx
        fields = {name[1:]: inner.get(name) for name in cls._BUFFERS}
        fields.update({name[1:]: value for name, value in zip(cls._META, meta)})
        return cls(shape=outer_size, dtype=dtype, **fields)

    # ---- FSDP2 all-gather extension (block_fsdp.py) -----------------------------------------------

    # Buffers laid out by x2d rows ([M, ...]) that concatenate along dim 0 into the whole tensor's;
    # the format's other copies are derived after the gather or not gathered at all (empty: the
    # format cannot be gathered this way).
    _FSDP_GATHERED: tuple[str, ...] = ()

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        return fsdp_block_pre_all_gather(self, mesh, orig_size)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return fsdp_block_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)


torch.serialization.add_safe_globals([_rebuild_block_scaled_tensor])


class BlockScaledQuantizer(Quantizer):
    """Quantizes into a block-scaled tensor: the format computes the buffers of x2d = [M, K]."""

    _tensor_cls: type = BlockScaledTensor
    _storage_cls: type = BlockScaledTensorStorage

    def _fields_for(self, x2d: torch.Tensor) -> dict:
        """Constructor fields (buffers of the copies in use, format fields) for x2d [M, K]."""
        raise NotImplementedError

    def _quantize(self, tensor: torch.Tensor):
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__}: both rowwise and columnwise usage are off")
        m, k = rows_cols(tensor.shape)
        fields = self._fields_for(tensor.reshape(m, k))
        cls = self._storage_cls if self.internal else self._tensor_cls
        return cls(shape=tensor.shape, dtype=tensor.dtype, quantizer=self, **fields)

    def update_quantized(self, src, dst, *, noop_flag: Optional[torch.Tensor] = None):
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"update_quantized: src shape {tuple(src.shape)} != dst shape {tuple(dst.shape)}")
        # dst may be a flat view of an [M, K] tensor: quantize src as that x2d
        fields = self._fields_for(src.reshape(dst._x2d()))
        skip = None if noop_flag is None else noop_flag.reshape(()) != 0
        for key, value in fields.items():
            old = getattr(dst, "_" + key)
            if not isinstance(value, torch.Tensor):
                setattr(dst, "_" + key, value)
            elif old is not None and old.shape == value.shape and old.dtype == value.dtype:
                # write in place: the buffers may be shared (a parameter's, a ZeRO shard)
                old.copy_(value if skip is None else torch.where(skip, old, value))
            else:
                if skip is not None:
                    raise ValueError("update_quantized with noop_flag needs dst to hold the same copies")
                setattr(dst, "_" + key, value)
        for name in dst._BUFFERS:  # copies this quantizer does not make are now stale
            if name[1:] not in fields:
                setattr(dst, name, None)
        return dst

    def make_empty(self, shape, *, dtype=torch.float32, device=None, requires_grad=False):
        # Quantized zeros rather than garbage: a block format's "empty" must still decode to numbers.
        device = torch.device(device) if device is not None else torch.device("cpu")
        zeros = torch.zeros(torch.Size(shape), dtype=dtype, device=device)
        out = self._quantize(zeros)
        if isinstance(out, torch.Tensor):
            out.requires_grad_(requires_grad)
        return out


# ---- op rules --------------------------------------------------------------------------------------

def _meta_shape(func, self, args, kwargs) -> torch.Size:
    return func(torch.empty(self.shape, device="meta"), *args, **kwargs).shape


# Reshapes: legal when the buffers, stored as x2d, need not change: the new last dim is x2d's K, or
# the result is the flat 1-D view (FSDP2 keeps one of every shard, ``_sharded_param_data``).
_RESHAPE_OPS = (aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.unsqueeze.default,
                aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims)


@implements(BlockScaledTensor, *_RESHAPE_OPS)
def _reshape(func, args, kwargs):
    self = args[0]
    shape = _meta_shape(func, self, args[1:], kwargs)
    last = shape[-1] if len(shape) else 1
    if last != self._x2d_cols() and len(shape) != 1:
        raise RuntimeError(
            f"{type(self).__name__}: {func} from {tuple(self.shape)} to {tuple(shape)} changes the last "
            f"dim, which the blocks run along; only reshapes that keep it (and the flat 1-D view) are "
            f"views of the quantized data (call .dequantize() first)"
        )
    return self._like(shape=shape)


def _dim0_rows(self, start: int, stop: int) -> tuple[int, int]:
    """x2d rows of logical rows [start, stop) along dim 0."""
    if self.dim() < 2:
        raise RuntimeError(
            f"{type(self).__name__}: a 1-D tensor's only dim is the block dim; it cannot be sliced "
            f"(call .dequantize() first)"
        )
    per = math.prod(self.shape[1:-1])
    return start * per, stop * per


def _cut(self, start: int, stop: int):
    """Rows [start, stop) of dim 0 as a tensor of the same format."""
    row_start, row_stop = _dim0_rows(self, start, stop)
    fields = self._slice_rows(row_start, row_stop)
    return self._like(shape=(stop - start, *self.shape[1:]), **fields)


def _only_dim0(self, func, dim: int) -> None:
    if dim % max(self.dim(), 1) != 0:
        raise RuntimeError(
            f"{type(self).__name__}: {func} along dim {dim} is not supported on the quantized layout "
            f"(only dim 0, at block boundaries); call .dequantize() first"
        )


@implements(BlockScaledTensor, aten.slice.Tensor)
def _slice(func, args, kwargs):
    # aten.slice.Tensor(self, dim=0, start=None, end=None, step=1)
    self = args[0]
    given = dict(zip(("dim", "start", "end", "step"), args[1:]), **kwargs)
    dim, start, end, step = given.get("dim", 0), given.get("start"), given.get("end"), given.get("step", 1)
    _only_dim0(self, func, dim)
    if step != 1:
        raise RuntimeError(f"{type(self).__name__}: slicing with step {step} is not supported (step 1 only)")
    n = self.shape[0]
    start, stop, _ = slice(start, end).indices(n)
    return _cut(self, start, max(start, stop))


@implements(BlockScaledTensor, aten.select.int)
def _select(func, args, kwargs):
    self, dim, index = args[0], args[1], args[2]
    _only_dim0(self, func, dim)
    index = index % self.shape[0]
    part = _cut(self, index, index + 1)
    return part._like(shape=self.shape[1:])


def _pieces(self, sizes):
    out, start = [], 0
    try:
        for size in sizes:
            out.append(_cut(self, start, start + size))
            start += size
    except RuntimeError as e:
        # FSDP2's fully_shard cuts every parameter this way (torch.chunk over the ranks)
        raise RuntimeError(
            f"{e}. (Splitting into pieces of {list(sizes)} rows. If this is FSDP2 sharding an FP8 primary "
            f"weight over {len(sizes)} ranks, each rank's rows must be whole blocks: build this linear in "
            f"high precision with te_compile.quantized_model_init(enabled=False), or shard over a world "
            f"size that divides its rows into whole blocks.)"
        ) from e
    return out


@implements(BlockScaledTensor, aten.split.Tensor)
def _split(func, args, kwargs):
    self, size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    _only_dim0(self, func, dim)
    n = self.shape[0]
    return _pieces(self, [min(size, n - s) for s in range(0, n, size)] or [0])


@implements(BlockScaledTensor, aten.split_with_sizes.default)
def _split_with_sizes(func, args, kwargs):
    self, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    _only_dim0(self, func, dim)
    return _pieces(self, sizes)


@implements(BlockScaledTensor, aten.unbind.int)
def _unbind(func, args, kwargs):
    self = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    _only_dim0(self, func, dim)
    return [_cut(self, i, i + 1)._like(shape=self.shape[1:]) for i in range(self.shape[0])]


@implements(BlockScaledTensor, aten.as_strided.default)
def _as_strided(func, args, kwargs):
    # FSDP2 views the gathered weight with as_strided(orig_size, contiguous stride, offset 0): with
    # even shards that is the whole tensor, an alias
    self, size, stride = args[0], args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    if tuple(size) == tuple(self.shape) and tuple(stride) == torch.empty(self.shape, device="meta").stride() \
            and not offset:
        return self._like()
    return _refuse(func, args, kwargs)


# Moves that would cross blocks: refuse with a clear message rather than silently dequantize.
# Transposes (t, transpose, permute) are the exception: they run on the dequantized values and
# return a plain tensor (a copy, not a view), because F.linear decomposes into ``weight.t()`` before
# its GEMM, and a block-scaled primary weight (te_compile/primary_weights.py) must run eagerly and
# under Dynamo's fake-tensor trace of F.linear.
# as_strided is refused too, except as the identity view (above).
@implements(BlockScaledTensor, aten.expand.default)
def _refuse(func, args, kwargs):
    raise RuntimeError(
        f"{type(args[0]).__name__}: {func} would move elements across scaling blocks; it is not supported "
        f"on the quantized layout (call .dequantize() first)"
    )


@implements(BlockScaledTensor, aten.clone.default)
def _clone(func, args, kwargs):
    return args[0]._map_buffers(torch.clone)


@implements(BlockScaledTensor, aten._to_copy.default)
def _to_copy(func, args, kwargs):
    self = args[0]
    dtype, kwargs = self._copy_target(kwargs)
    return self._map_buffers(lambda t: func(t, **kwargs), dtype=dtype)


@implements(BlockScaledTensor, aten._pin_memory.default)
def _pin_memory(func, args, kwargs):
    return args[0]._map_buffers(lambda t: func(t, *args[1:], **kwargs))


@implements(BlockScaledTensor, aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    self = args[0]
    return all(func(getattr(self, n), *args[1:], **kwargs) for n in self._BUFFERS
               if getattr(self, n) is not None)


def _quantized_zeros(self, shape, kwargs):
    device = kwargs.get("device") or self.device
    dtype = kwargs.get("dtype") or self.dtype
    out = self._requantizer().quantize(torch.zeros(shape, dtype=dtype, device=device))
    if self.device.type == "meta" and out.device.type != "meta":
        out._alias_of(self)   # a meta weight materialized (Module.to_empty): keeps the init holder
    return out


@implements(BlockScaledTensor, aten.new_zeros.default, aten.new_empty.default)
def _new_zeros(func, args, kwargs):
    return _quantized_zeros(args[0], args[1], kwargs)


@implements(BlockScaledTensor, aten.zeros_like.default, aten.empty_like.default)
def _zeros_like(func, args, kwargs):
    return _quantized_zeros(args[0], args[0].shape, kwargs)
