"""Per-tensor scaled FP8: Float8Tensor and the two quantizers that make it.

Float8Tensor holds the FP8 data behind a high-precision tensor interface, in these fields
(TransformerEngine's names):
- ``_data``: uint8 view of the fp8 bytes, in the tensor's logical shape (the rowwise copy).
- ``_scale_inv``: fp32 [1]; value = fp8 * scale_inv.
- ``_fp8_dtype``: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
- ``_transpose``: uint8 [last_dim, numel // last_dim], the columnwise copy (the 2-D transpose), made
  by ``update_usage(columnwise_usage=True)`` and dropped whenever ``_data`` changes shape or values.
- ``_amax``: fp32 [1] or None, the amax of the high-precision values the bytes were quantized from.
  Only FP8 primary weights under delayed scaling keep it (te_compile/primary_weights.py): the amax
  history wants that amax, not the one of the rounded bytes. Re-quantizing in place refreshes it.
  Views share it (it describes the whole weight: FSDP2's shards of a weight are views).

Quantizers (kept beside the tensor, as TransformerEngine's ``tensor/float8_tensor.py`` does):
- ``Float8Quantizer``: delayed scaling, quantizes with a given scale and accumulates the amax.
- ``Float8CurrentScalingQuantizer``: current scaling, the scale comes from the tensor's own amax.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from .quantized_tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer, implements
from ..scaling import cast_to_fp8, compute_scale, fp8_max, tensor_amax

__all__ = ["Float8TensorStorage", "Float8Tensor", "Float8Quantizer", "Float8CurrentScalingQuantizer", "transpose_2d"]

aten = torch.ops.aten

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def transpose_2d(data: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [K, numel // K] contiguous: the operand layout of GEMMs that contract dim 0."""
    last = data.shape[-1] if data.dim() > 0 else 1
    return data.reshape(-1, last).t().contiguous()


class Float8TensorStorage(QuantizedTensorStorage):
    """The buffers of a Float8Tensor without torch.Tensor behaviour (TE's internal tensor)."""

    def __init__(
        self,
        data: Optional[torch.Tensor],
        scale_inv: torch.Tensor,
        fp8_dtype: torch.dtype,
        *,
        data_transpose: Optional[torch.Tensor] = None,
        quantizer=None,
        shape: Optional[torch.Size] = None,
        dtype: torch.dtype = torch.float32,
        amax: Optional[torch.Tensor] = None,
    ) -> None:
        self._init_fields(data, scale_inv, fp8_dtype, data_transpose, quantizer, shape, dtype, amax)

    def _init_fields(self, data, scale_inv, fp8_dtype, data_transpose, quantizer, shape, dtype, amax=None):
        if fp8_dtype not in _FP8_DTYPES:
            raise ValueError(f"fp8_dtype must be one of {_FP8_DTYPES}, got {fp8_dtype!r}")
        if data is None and data_transpose is None:
            raise ValueError("a Float8Tensor needs _data or _transpose (both were None)")
        if data is not None and data.dtype is not torch.uint8:
            raise ValueError(f"_data must be a uint8 view of fp8 bytes, got dtype {data.dtype}")
        if scale_inv.dtype is not torch.float32 or scale_inv.numel() != 1:
            raise ValueError(
                f"_scale_inv must be an fp32 tensor with one element, got {scale_inv.dtype} "
                f"of shape {tuple(scale_inv.shape)}"
            )
        if shape is None and data is None:
            raise ValueError("shape is required when only the transpose is given")
        if amax is not None and (amax.dtype is not torch.float32 or amax.numel() != 1):
            raise ValueError(f"_amax must be an fp32 tensor with one element, got {amax.dtype} "
                             f"of shape {tuple(amax.shape)}")
        self._data = data
        self._scale_inv = scale_inv.reshape(1)
        self._fp8_dtype = fp8_dtype
        self._transpose = data_transpose
        self._quantizer = quantizer
        self._logical_shape = torch.Size(shape if shape is not None else data.shape)
        self._nominal_dtype = dtype
        self._amax = None if amax is None else amax.reshape(1)

    @property
    def shape(self) -> torch.Size:
        return self._logical_shape

    @property
    def device(self) -> torch.device:
        return self._scale_inv.device

    def _rowwise_data(self) -> torch.Tensor:
        if self._data is not None:
            return self._data
        # Only the columnwise copy is left: transpose it back.
        return self._transpose.t().contiguous().reshape(self._logical_shape)

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        # scale_inv as a 0-d tensor: a [1] factor would turn a 0-d tensor's values into shape [1]
        scale_inv = self._scale_inv.reshape(())
        values = self._rowwise_data().view(self._fp8_dtype).to(torch.float32) * scale_inv
        return values.to(dtype or self._nominal_dtype)

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None):
        if columnwise_usage and self._transpose is None:
            self._transpose = transpose_2d(self._data)
        if rowwise_usage and self._data is None:
            self._data = self._rowwise_data()
        if rowwise_usage is False:
            if self._transpose is None:
                raise ValueError("cannot drop the rowwise copy: no columnwise copy exists")
            self._data = None
        if columnwise_usage is False:
            if self._data is None:
                raise ValueError("cannot drop the columnwise copy: no rowwise copy exists")
            self._transpose = None
        return self

    def prepare_for_saving(self):
        tensors = [self._data, self._transpose, self._scale_inv]
        self._data = self._transpose = self._scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors):
        self._data, self._transpose, self._scale_inv = tensors[:3]
        return list(tensors[3:])

    def clear(self) -> None:
        self._data = torch.empty(0, dtype=torch.uint8, device=self._scale_inv.device)
        self._transpose = None

    def get_metadata(self) -> dict:
        return {
            "data": self._data,
            "scale_inv": self._scale_inv,
            "fp8_dtype": self._fp8_dtype,
            "data_transpose": self._transpose,
            "quantizer": self._quantizer,
        }


def _rebuild_float8_tensor(data, scale_inv, fp8_dtype, dtype, data_transpose, requires_grad, amax=None):
    """torch.load entry point (allow-listed for ``weights_only=True``)."""
    return Float8Tensor(
        data=data, scale_inv=scale_inv, fp8_dtype=fp8_dtype, dtype=dtype,
        data_transpose=data_transpose, requires_grad=requires_grad, amax=amax,
    )


class Float8Tensor(QuantizedTensor, Float8TensorStorage):
    """A torch.Tensor of nominal ``dtype`` holding per-tensor scaled FP8 data."""

    @staticmethod
    def __new__(
        cls,
        *,
        data: Optional[torch.Tensor],
        scale_inv: torch.Tensor,
        fp8_dtype: torch.dtype,
        dtype: torch.dtype = torch.float32,
        data_transpose: Optional[torch.Tensor] = None,
        quantizer=None,
        shape: Optional[torch.Size] = None,
        requires_grad: bool = False,
        amax: Optional[torch.Tensor] = None,
    ):
        if shape is None and data is not None:
            shape = data.shape
        if shape is None:
            raise ValueError("shape is required when only the transpose is given")
        strides = data.stride() if data is not None and tuple(data.shape) == tuple(shape) else None
        self = QuantizedTensor.__new__(
            cls, shape, dtype, device=scale_inv.device, requires_grad=requires_grad, strides=strides
        )
        self._init_fields(data, scale_inv, fp8_dtype, data_transpose, quantizer, shape, dtype, amax)
        return self

    def __init__(self, *args, **kwargs):  # all work happens in __new__
        pass

    # torch.Tensor (earlier in the MRO) has a dequantize of its own; the storage's is meant.
    dequantize = Float8TensorStorage.dequantize

    def __repr__(self, *, tensor_contents=None) -> str:
        head = f"Float8Tensor(fp8_dtype={self._fp8_dtype}, dtype={self.dtype}, shape={tuple(self.shape)}"
        # Values only from real buffers: while torch.compile traces, the buffers are fake tensors
        # (.item() gives a SymFloat, or raises), and tracing logs repr the inputs.
        data = self._data if self._data is not None else self._transpose
        if any(type(t) is not torch.Tensor or t.device.type == "meta" for t in (data, self._scale_inv)):
            return head + ")"
        return f"{head}, scale_inv={self._scale_inv.item():.6g}, data={self.dequantize()})"

    def _like(self, data, *, scale_inv=None, dtype=None, data_transpose=None, requires_grad=False,
              amax=None):
        """A Float8Tensor sharing this one's format with new buffers."""
        return Float8Tensor(
            data=data,
            scale_inv=self._scale_inv if scale_inv is None else scale_inv,
            fp8_dtype=self._fp8_dtype,
            dtype=dtype or self.dtype,
            data_transpose=data_transpose,
            quantizer=self._quantizer,
            requires_grad=requires_grad,
            amax=amax,
        )

    def quantize_(self, tensor: torch.Tensor) -> "Float8Tensor":
        if self._quantizer is not None:
            self._quantizer.update_quantized(tensor, self)
        else:
            # No quantizer travels with the tensor (e.g. it was rebuilt from saved buffers):
            # re-quantize with current scaling in the same fp8 format.
            quantizer = Float8CurrentScalingQuantizer(
                self._fp8_dtype, columnwise=self._transpose is not None
            )
            quantizer.update_quantized(tensor, self)
        return self

    def _copy_from(self, src: torch.Tensor) -> "Float8Tensor":
        if isinstance(src, Float8Tensor) and src._fp8_dtype == self._fp8_dtype and src.shape == self.shape:
            # quantized <- quantized of the same format: bytes and scale, no rounding
            self._data.copy_(src._rowwise_data())
            self._scale_inv.copy_(src._scale_inv)
            self._transpose = None if src._transpose is None else src._transpose.to(self.device, copy=True)
            if self._amax is not None:
                # a source without one: the amax its bytes show is the best left
                self._amax.copy_(src._amax if src._amax is not None
                                 else tensor_amax(src.dequantize(dtype=torch.float32)))
            return self
        src_values = src.dequantize() if isinstance(src, QuantizedTensor) else src
        return self.quantize_(src_values.to(self.device).expand(self.shape))

    def detach(self) -> "Float8Tensor":
        return self._like(self._data, data_transpose=self._transpose, amax=self._amax)._alias_of(self)

    def __reduce_ex__(self, protocol):
        return (
            _rebuild_float8_tensor,
            (self._data, self._scale_inv, self._fp8_dtype, self.dtype, self._transpose,
             self.requires_grad, self._amax),
        )

    def __deepcopy__(self, memo):
        clone = lambda t: None if t is None else t.clone()  # noqa: E731
        return self._like(
            self._data.clone(), scale_inv=self._scale_inv.clone(), data_transpose=clone(self._transpose),
            requires_grad=self.requires_grad, amax=clone(self._amax),
        )

    # ---- FSDP2 all-gather extension (an FP8 primary weight sharded by fully_shard) ----------------
    # The shard's bytes are gathered as they are (uint8, one byte per element); the scale is the
    # whole weight's, the same on every shard (cast_master_weights_to_fp8 all-reduces the amax).

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """(the shard's bytes padded to FSDP's padded shard rows,), (scale_inv, fp8 dtype, amax,
        quantizer)."""
        if tuple(self.shape[1:]) != tuple(orig_size[1:]):
            raise RuntimeError(f"FP8 all-gather needs the weight sharded on dim 0 (rows); shard "
                               f"{list(self.shape)} of {list(orig_size)}")
        data = fsdp_padded_shard(self._rowwise_data(), orig_size, mesh.size())
        return (data,), (self._scale_inv, self._fp8_dtype, self._amax, self._quantizer)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return fsdp_float8_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)

    # torch.compile: the buffers are the inner tensors; the format travels in the context.
    def __tensor_flatten__(self):
        names = ["_data", "_scale_inv"]
        if self._transpose is not None:
            names.append("_transpose")
        if self._amax is not None:
            names.append("_amax")
        return names, (self._fp8_dtype, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        fp8_dtype, dtype = ctx
        return Float8Tensor(
            data=inner["_data"], scale_inv=inner["_scale_inv"], fp8_dtype=fp8_dtype, dtype=dtype,
            data_transpose=inner.get("_transpose"), shape=outer_size, amax=inner.get("_amax"),
        )


torch.serialization.add_safe_globals([_rebuild_float8_tensor])


# ---- FSDP2 helpers (Float8Tensor's own hooks and te_compile/fsdp.py's wrapper) ---------------------

def fsdp_padded_shard(data: torch.Tensor, orig_size, world: int) -> torch.Tensor:
    """A shard's bytes [rows, ...] padded with zero rows to FSDP2's padded shard size
    [ceil(orig_rows / world), ...]: FSDP gathers equal-sized shards."""
    rows = -(-orig_size[0] // world) if len(orig_size) else 0
    if data.shape[0] == rows:
        return data
    padded = data.new_zeros((rows, *data.shape[1:]))
    padded[: data.shape[0]].copy_(data)
    return padded


def fsdp_float8_post_all_gather(all_gather_outputs, metadata, param_dtype, *, out=None):
    """FSDP2's post-all-gather of a Float8Tensor shard's bytes: a Float8Tensor over the gathered
    bytes (FSDP trims the padding with as_strided) with the shard's scale, amax (delayed scaling's,
    for the graph's history) and quantizer.

    On a re-gather into the buffer ``out`` already views only the scale (and amax) are new. A
    compiled forward may have saved them for backward, and the re-gather in backward writes the same
    values, so their version counters stay put."""
    (data,), (scale_inv, fp8_dtype, amax, quantizer) = all_gather_outputs, metadata
    if out is None:
        weight = Float8Tensor(data=data, scale_inv=scale_inv.clone(), fp8_dtype=fp8_dtype, dtype=param_dtype,
                              amax=None if amax is None else amax.clone(), quantizer=quantizer)
        return weight, (data,)
    if out._data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
        raise RuntimeError("FSDP2 re-gathered an FP8 weight into a new buffer; expected the buffer of "
                           "the first all-gather")
    for dst, src in ((out._scale_inv, scale_inv), (out._amax, amax)):
        if dst is not None:
            with torch.autograd._unsafe_preserve_version_counter(dst):
                dst.copy_(src)
    return None


# ---- quantizers -----------------------------------------------------------------------------------

class _Float8QuantizerBase(Quantizer):
    """What both per-tensor quantizers share: the cast, the buffers and the in-place update."""

    def __init__(self, fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        fp8_max(fp8_dtype)  # validates the dtype, naming the allowed ones
        self.dtype = fp8_dtype

    def _scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        """The fp32 [1] scale used to quantize ``tensor`` (updates the quantizer's state)."""
        raise NotImplementedError

    def _buffers(self, tensor: torch.Tensor):
        """(rowwise uint8 data or None, columnwise uint8 data or None, scale_inv [1])."""
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__}: both rowwise and columnwise usage are off")
        scale = self._scale_for(tensor)
        data = cast_to_fp8(tensor, scale, self.dtype).view(torch.uint8)
        # True division, as the scale itself: 1/scale correctly rounded.
        scale_inv = torch.div(torch.ones_like(scale), scale)
        transpose = transpose_2d(data) if self.columnwise_usage else None
        return (data if self.rowwise_usage else None), transpose, scale_inv

    def _quantize(self, tensor: torch.Tensor):
        data, transpose, scale_inv = self._buffers(tensor)
        cls = Float8TensorStorage if self.internal else Float8Tensor
        return cls(
            data=data, scale_inv=scale_inv, fp8_dtype=self.dtype, data_transpose=transpose,
            quantizer=self, shape=tensor.shape, dtype=tensor.dtype,
        )

    def update_quantized(self, src, dst, *, noop_flag: Optional[torch.Tensor] = None):
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"update_quantized: src shape {tuple(src.shape)} != dst shape {tuple(dst.shape)}")
        if noop_flag is not None:
            # Evaluate without touching state, then keep the old values where the flag is set.
            skip = noop_flag.reshape(1) != 0
            saved_state = self._save_state()
            data, transpose, scale_inv = self._buffers(src)
            self._restore_state(saved_state, keep_old=skip)
            old = dst._rowwise_data()
            data = torch.where(skip, old, data)
            scale_inv = torch.where(skip, dst._scale_inv, scale_inv)
            transpose = None if transpose is None else transpose_2d(data)
        else:
            data, transpose, scale_inv = self._buffers(src)
        if dst._data is None or data is None:
            dst._data = data
        else:
            dst._data.copy_(data)
        dst._scale_inv.copy_(scale_inv)
        dst._transpose = transpose
        dst._fp8_dtype = self.dtype
        if getattr(dst, "_amax", None) is not None:
            new_amax = tensor_amax(src).to(dst._amax.device).reshape(1)
            dst._amax.copy_(new_amax if noop_flag is None else torch.where(skip, dst._amax, new_amax))
        return dst

    def make_empty(self, shape: Iterable[int], *, dtype=torch.float32, device=None, requires_grad=False):
        shape = torch.Size(shape)
        device = torch.device(device) if device is not None else self._default_device()
        data = torch.empty(shape, dtype=torch.uint8, device=device)
        transpose = transpose_2d(data) if self.columnwise_usage else None
        scale_inv = self._initial_scale_inv(device)
        if self.internal:
            return Float8TensorStorage(data, scale_inv, self.dtype, data_transpose=transpose,
                                       quantizer=self, dtype=dtype)
        return Float8Tensor(data=data, scale_inv=scale_inv, fp8_dtype=self.dtype, dtype=dtype,
                            data_transpose=transpose, quantizer=self, requires_grad=requires_grad)

    # State hooks for noop_flag: subclasses with state tensors save and restore them.
    def _save_state(self):
        return None

    def _restore_state(self, saved, keep_old: torch.Tensor) -> None:
        pass


class Float8Quantizer(_Float8QuantizerBase):
    """Delayed scaling: quantize with the given ``scale`` ([1] fp32, owned by the recipe state) and
    max-accumulate |x| into the given ``amax`` ([1] fp32). The recipe turns amaxes into the next
    scale (te_compile.scaling.delayed_scale_from_history)."""

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype, *,
                 rowwise: bool = True, columnwise: bool = True) -> None:
        super().__init__(fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        for name, t in (("scale", scale), ("amax", amax)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
                raise ValueError(f"Float8Quantizer: {name} must be an fp32 tensor with one element, got {t!r}")
        self.scale = scale
        self.amax = amax

    def _scale_for(self, tensor):
        self.amax.copy_(torch.maximum(self.amax, tensor_amax(tensor).to(self.amax.device).reshape(self.amax.shape)))
        return self.scale.reshape(1).to(tensor.device)

    def _default_device(self):
        return self.scale.device

    def _initial_scale_inv(self, device):
        return torch.div(torch.ones(1, device=device), self.scale.reshape(1).to(device))

    def _save_state(self):
        return self.amax.clone()

    def _restore_state(self, saved, keep_old):
        self.amax.copy_(torch.where(keep_old.to(self.amax.device).reshape(self.amax.shape), saved, self.amax))


class Float8CurrentScalingQuantizer(_Float8QuantizerBase):
    """Current scaling: scale = fp8_max / max|x| computed from the tensor being quantized.

    After each quantize, ``self.amax`` and ``self.scale`` ([1] fp32) hold the values used.
    """

    def __init__(self, fp8_dtype: torch.dtype, device=None, *, rowwise: bool = True,
                 columnwise: bool = True, force_pow_2_scales: bool = False,
                 amax_epsilon: float = 0.0) -> None:
        super().__init__(fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        if not amax_epsilon >= 0.0:
            raise ValueError(f"amax_epsilon must be a non-negative float, got {amax_epsilon!r}")
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = float(amax_epsilon)
        self.device = torch.device(device) if device is not None else None
        self.amax = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.scale = torch.ones(1, dtype=torch.float32, device=self.device)

    def _scale_for(self, tensor):
        amax = tensor_amax(tensor)
        scale = compute_scale(amax, self.dtype, force_pow_2_scales=self.force_pow_2_scales,
                              amax_epsilon=self.amax_epsilon)
        self.amax, self.scale = amax, scale
        return scale

    def _default_device(self):
        return self.device if self.device is not None else torch.device("cpu")

    def _initial_scale_inv(self, device):
        return torch.ones(1, dtype=torch.float32, device=device)

    def _save_state(self):
        return self.amax, self.scale

    def _restore_state(self, saved, keep_old):
        old_amax, old_scale = saved
        self.amax = torch.where(keep_old, old_amax.to(self.amax.device), self.amax)
        self.scale = torch.where(keep_old, old_scale.to(self.scale.device), self.scale)


# ---- quantized op rules ---------------------------------------------------------------------------

# Ops that only move elements: run them on the bytes and keep the scale. The columnwise copy
# describes the old layout, so it is dropped.
_VIEW_OPS = (
    aten.view.default, aten._unsafe_view.default, aten.as_strided.default, aten.slice.Tensor,
    aten.select.int, aten.t.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.expand.default,
    aten.alias.default,
)


@implements(Float8Tensor, *_VIEW_OPS)
def _view_like(func, args, kwargs):
    self = args[0]
    return self._like(func(self._rowwise_data(), *args[1:], **kwargs), amax=self._amax)


@implements(Float8Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
def _split_like(func, args, kwargs):
    self = args[0]
    return [self._like(part, amax=self._amax) for part in func(self._rowwise_data(), *args[1:], **kwargs)]


@implements(Float8Tensor, aten.clone.default)
def _clone(func, args, kwargs):
    self = args[0]
    fmt = kwargs.get("memory_format")
    data = self._rowwise_data().clone(memory_format=fmt) if fmt else self._rowwise_data().clone()
    transpose = None if self._transpose is None else self._transpose.clone()
    amax = None if self._amax is None else self._amax.clone()
    return self._like(data, scale_inv=self._scale_inv.clone(), data_transpose=transpose, amax=amax)


def _new_float8(self, shape, fill: Optional[int], kwargs) -> Float8Tensor:
    """A new Float8Tensor in ``self``'s format: zeros (fill=0) or uninitialized (fill=None)."""
    device = kwargs.get("device") or self.device
    maker = torch.zeros if fill == 0 else torch.empty
    data = maker(shape, dtype=torch.uint8, device=device)
    amax = None if self._amax is None else torch.zeros_like(self._amax, device=device)
    # a meta tensor's scale has no value to copy (Module.to_empty after a meta-device init)
    if self._scale_inv.is_meta:
        out = self._like(data, scale_inv=torch.ones(1, device=device), dtype=kwargs.get("dtype"), amax=amax)
        return out._alias_of(self) if not data.is_meta else out   # materialized: keeps the init holder
    return self._like(data, scale_inv=self._scale_inv.clone().to(device), dtype=kwargs.get("dtype"), amax=amax)


@implements(Float8Tensor, aten.new_zeros.default)
def _new_zeros(func, args, kwargs):
    return _new_float8(args[0], args[1], 0, kwargs)


@implements(Float8Tensor, aten.new_empty.default)
def _new_empty(func, args, kwargs):
    return _new_float8(args[0], args[1], None, kwargs)


@implements(Float8Tensor, aten.empty_like.default)
def _empty_like(func, args, kwargs):
    return _new_float8(args[0], args[0].shape, None, kwargs)


@implements(Float8Tensor, aten.zeros_like.default)
def _zeros_like(func, args, kwargs):
    return _new_float8(args[0], args[0].shape, 0, kwargs)


@implements(Float8Tensor, aten._to_copy.default)
def _to_copy(func, args, kwargs):
    self = args[0]
    dtype, kwargs = self._copy_target(kwargs)
    moved = lambda t: None if t is None else func(t, **kwargs)  # noqa: E731
    return self._like(
        moved(self._rowwise_data()), scale_inv=moved(self._scale_inv), dtype=dtype,
        data_transpose=moved(self._transpose), amax=moved(self._amax),
    )


@implements(Float8Tensor, aten._pin_memory.default)
def _pin_memory(func, args, kwargs):
    self = args[0]
    pin = lambda t: None if t is None else func(t, *args[1:], **kwargs)  # noqa: E731
    return self._like(pin(self._rowwise_data()), scale_inv=pin(self._scale_inv),
                      data_transpose=pin(self._transpose))


@implements(Float8Tensor, aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    return func(args[0]._rowwise_data(), *args[1:], **kwargs)
