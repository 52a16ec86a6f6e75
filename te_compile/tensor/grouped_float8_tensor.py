"""Per-expert FP8: GroupedFloat8Tensor, an MoE layer's 3-D expert weight as E per-tensor FP8 matrices
stacked on dim 0, one scale each.

Fields (Float8Tensor's, one per expert):
- ``_data``: uint8 [E, ...], the bytes in the tensor's logical shape; views keep dim 0, the experts.
- ``_scale_inv``: fp32 [E]; expert e's values are fp8 * scale_inv[e].
- ``_fp8_dtype``: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
- ``_amax``: fp32 [E] or None, each expert's amax of the high-precision values the bytes came from
  (delayed scaling: the amax history wants it, not that of the rounded bytes).
- ``_quantizer``: a ``GroupedFloat8Quantizer`` (delayed scaling: the state the scales belong to,
  ``linear_state``), or None.

FSDP2's FP8 all-gather of an expert weight makes one (te_compile/fsdp.py); the grouped lowering uses
its bytes and scales as the weight operand. ``w[e]`` is expert e's Float8Tensor; any other op runs on
the dequantized values.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .float8_tensor import Float8Tensor
from .quantized_tensor import QuantizedTensor, implements
from ..scaling import cast_to_fp8, compute_scale

__all__ = ["GroupedFloat8Tensor", "GroupedFloat8Quantizer", "GroupedFsdpMeta", "fsdp_grouped_post_all_gather"]

aten = torch.ops.aten

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class GroupedFloat8Quantizer:
    """Delayed scaling's weight scales of an expert weight, fp32 [E] (the compiled graph's state,
    read only), and that state (``linear_state``: te_compile.state finds it through the weight)."""

    def __init__(self, scale: torch.Tensor, fp8_dtype: torch.dtype, linear_state=None) -> None:
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.dim() != 1:
            raise ValueError(f"GroupedFloat8Quantizer: scale must be an fp32 tensor [E], got {scale!r}")
        self.scale = scale
        self.dtype = fp8_dtype
        self.linear_state = linear_state


class GroupedFloat8Tensor(QuantizedTensor):
    """A torch.Tensor of nominal ``dtype`` holding E per-tensor scaled FP8 matrices on dim 0."""

    @staticmethod
    def __new__(cls, *, data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: torch.dtype,
                dtype: torch.dtype = torch.float32, amax: Optional[torch.Tensor] = None, quantizer=None,
                requires_grad: bool = False):
        self = QuantizedTensor.__new__(cls, data.shape, dtype, device=data.device, requires_grad=requires_grad,
                                       strides=data.stride())
        if fp8_dtype not in _FP8_DTYPES:
            raise ValueError(f"fp8_dtype must be one of {_FP8_DTYPES}, got {fp8_dtype!r}")
        if data.dtype is not torch.uint8 or data.dim() < 1:
            raise ValueError(f"_data must be a uint8 view of fp8 bytes [E, ...], got {data.dtype} of shape "
                             f"{tuple(data.shape)}")
        experts = data.shape[0]
        for name, t in (("_scale_inv", scale_inv), ("_amax", amax)):
            if t is not None and (t.dtype is not torch.float32 or tuple(t.shape) != (experts,)):
                raise ValueError(f"{name} must be fp32 [{experts}] (one per expert), got {t.dtype} of shape "
                                 f"{tuple(t.shape)}")
        self._data, self._scale_inv, self._fp8_dtype = data, scale_inv, fp8_dtype
        self._amax, self._quantizer = amax, quantizer
        return self

    def __init__(self, *args, **kwargs):  # all work happens in __new__
        pass

    def _broadcast(self, per_expert: torch.Tensor) -> torch.Tensor:
        return per_expert.view(-1, *([1] * (self._data.dim() - 1)))

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        values = self._data.view(self._fp8_dtype).to(torch.float32) * self._broadcast(self._scale_inv)
        return values.to(dtype or self.dtype)

    def _like(self, data: torch.Tensor, *, scale_inv=None, dtype=None, amax=None, requires_grad=False):
        return GroupedFloat8Tensor(data=data, scale_inv=self._scale_inv if scale_inv is None else scale_inv,
                                   fp8_dtype=self._fp8_dtype, dtype=dtype or self.dtype, amax=amax,
                                   quantizer=self._quantizer, requires_grad=requires_grad)

    def quantize_(self, tensor: torch.Tensor) -> "GroupedFloat8Tensor":
        """Each expert of ``tensor`` quantized into self: with delayed scaling's [E] scales when the
        quantizer holds them, else with each expert's current-scaling scale (the quantizer's options)."""
        tensor = tensor.detach().expand(self.shape)
        amax = tensor.abs().reshape(tensor.shape[0], -1).amax(dim=1).to(torch.float32)
        q = self._quantizer
        if isinstance(q, GroupedFloat8Quantizer):
            scale = q.scale.to(amax.device)
        else:
            scale = compute_scale(amax, self._fp8_dtype, force_pow_2_scales=getattr(q, "force_pow_2_scales", False),
                                  amax_epsilon=getattr(q, "amax_epsilon", 0.0))
        self._data.copy_(cast_to_fp8(tensor, self._broadcast(scale), self._fp8_dtype).view(torch.uint8))
        self._scale_inv.copy_(torch.div(torch.ones_like(scale), scale))
        if self._amax is not None:
            self._amax.copy_(amax)
        return self

    def _copy_from(self, src: torch.Tensor) -> "GroupedFloat8Tensor":
        same = isinstance(src, GroupedFloat8Tensor) and src._fp8_dtype == self._fp8_dtype and src.shape == self.shape
        if not same:
            return self.quantize_(src.dequantize() if isinstance(src, QuantizedTensor) else src)
        self._data.copy_(src._data)
        self._scale_inv.copy_(src._scale_inv)
        if self._amax is not None and src._amax is not None:
            self._amax.copy_(src._amax)
        return self

    def detach(self) -> "GroupedFloat8Tensor":
        return self._like(self._data, amax=self._amax)._alias_of(self)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"GroupedFloat8Tensor(fp8_dtype={self._fp8_dtype}, dtype={self.dtype}, experts={self._data.shape[0]}, "
                f"shape={tuple(self.shape)})")

    def __reduce_ex__(self, protocol):
        # a checkpoint stores the values: it must not depend on te_compile
        return self.dequantize().__reduce_ex__(protocol)

    # torch.compile: the buffers are the inner tensors; the format travels in the context (Dynamo's
    # guards deep-copy it: the quantizer, which reaches modules, stays out, as Float8Tensor's does)
    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"] + (["_amax"] if self._amax is not None else []), (self._fp8_dtype, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        fp8_dtype, dtype = ctx
        return GroupedFloat8Tensor(data=inner["_data"], scale_inv=inner["_scale_inv"], fp8_dtype=fp8_dtype,
                                   dtype=dtype, amax=inner.get("_amax"))


# ---- quantized op rules ---------------------------------------------------------------------------


def _experts_kept(func, args, out: torch.Tensor) -> Optional[int]:
    """How many leading experts the view ``out = func(*args)`` keeps whole on its dim 0, so that the
    first that many scales line up; None when it mixes or moves them. A transpose or permute must
    leave dim 0 in place; a view or as_strided must start at expert 0 with the experts' stride (FSDP2
    trims the padding experts of a gathered weight so)."""
    self = args[0]
    rank = self.dim()
    if func is aten.transpose.int:
        return self.shape[0] if all(d % rank != 0 for d in args[1:3]) else None
    if func is aten.permute.default:
        return self.shape[0] if args[1][0] % rank == 0 else None
    if func is aten.alias.default:
        return self.shape[0]
    if (out.dim() > 0 and out.shape[0] <= self.shape[0] and out.storage_offset() == self._data.storage_offset()
            and (out.shape[0] == 1 or out.stride(0) == self._data.stride(0))
            and out[0].numel() == self._data[0].numel()):
        return out.shape[0]
    return None


_VIEW_OPS = (aten.alias.default, aten.transpose.int, aten.permute.default, aten.view.default,
             aten._unsafe_view.default, aten.as_strided.default)


@implements(GroupedFloat8Tensor, *_VIEW_OPS)
def _view_like(func, args, kwargs):
    self = args[0]
    data = func(self._data, *args[1:], **kwargs)
    kept = _experts_kept(func, args, data)
    if kept is None:
        return func(self.dequantize(), *args[1:], **kwargs)
    amax = None if self._amax is None else self._amax[:kept]
    return self._like(data, scale_inv=self._scale_inv[:kept], amax=amax)


@implements(GroupedFloat8Tensor, aten.select.int)
def _select(func, args, kwargs):
    """``w[e]`` (dim 0): expert e's matrix as a Float8Tensor with its own scale."""
    self, dim, index = args[0], args[1], args[2]
    if dim % self.dim() != 0:
        return func(self.dequantize(), *args[1:], **kwargs)
    amax = None if self._amax is None else self._amax[index].reshape(1)
    return Float8Tensor(data=self._data[index], scale_inv=self._scale_inv[index].reshape(1), fp8_dtype=self._fp8_dtype,
                        dtype=self.dtype, amax=amax)


@implements(GroupedFloat8Tensor, aten.clone.default)
def _clone(func, args, kwargs):
    self = args[0]
    amax = None if self._amax is None else self._amax.clone()
    return self._like(self._data.clone(), scale_inv=self._scale_inv.clone(), amax=amax)


@implements(GroupedFloat8Tensor, aten._to_copy.default)
def _to_copy(func, args, kwargs):
    """A dtype cast changes the nominal dtype only (``w.bfloat16()`` before a grouped GEMM); a device
    move moves every buffer."""
    self = args[0]
    dtype, kwargs = self._copy_target(kwargs)
    moved = lambda t: None if t is None else func(t, **kwargs)  # noqa: E731
    return self._like(moved(self._data), scale_inv=moved(self._scale_inv), dtype=dtype, amax=moved(self._amax))


# ---- FSDP2 -------------------------------------------------------------------------------------------


class GroupedFsdpMeta(NamedTuple):
    """The metadata of an expert weight's FP8 all-gather: every expert's scale_inv [E], the fp8 dtype,
    the experts' amaxes [E] (delayed scaling) and the quantizer carrying the state."""

    scale_inv: torch.Tensor
    fp8_dtype: torch.dtype
    amax: Optional[torch.Tensor]
    quantizer: Optional[GroupedFloat8Quantizer]


def fsdp_grouped_post_all_gather(all_gather_outputs, metadata: GroupedFsdpMeta, param_dtype, *, out=None):
    """FSDP2's post-all-gather of an expert weight's FP8 bytes: a GroupedFloat8Tensor over them (FSDP
    trims the padding experts with as_strided, which keeps the leading experts' scales). On a
    re-gather into ``out`` only the scales and amaxes are new; their version counters stay put, as
    Float8Tensor's do (float8_tensor.py)."""
    (data,) = all_gather_outputs
    if out is None:
        # the gathered rows include the padding experts of uneven shards: scale 1, amax 0 for them
        pad = data.shape[0] - metadata.scale_inv.shape[0]
        scale_inv = torch.cat([metadata.scale_inv, metadata.scale_inv.new_ones(pad)])
        amax = None if metadata.amax is None else torch.cat([metadata.amax, metadata.amax.new_zeros(pad)])
        weight = GroupedFloat8Tensor(data=data, scale_inv=scale_inv, fp8_dtype=metadata.fp8_dtype, dtype=param_dtype,
                                     amax=amax, quantizer=metadata.quantizer)
        return weight, (data,)
    if out._data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
        raise RuntimeError("FSDP2 re-gathered an FP8 expert weight into a new buffer; expected the buffer of "
                           "the first all-gather")
    for dst, src in ((out._scale_inv, metadata.scale_inv), (out._amax, metadata.amax)):
        if dst is not None:
            with torch.autograd._unsafe_preserve_version_counter(dst):
                dst.copy_(src)
    return None
