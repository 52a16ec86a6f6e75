"""Abstract quantizer and quantized tensor, with TransformerEngine's interface.

- ``Quantizer`` turns a high-precision tensor into a quantized one (and owns the scaling state).
- ``QuantizedTensorStorage`` holds the quantized buffers of one tensor (no torch.Tensor behaviour);
  TE calls these "internal" tensors. Its ``prepare_for_saving``/``restore_from_saved`` let the
  buffers travel through ``ctx.save_for_backward``.
- ``QuantizedTensor`` is a torch.Tensor wrapper subclass whose dtype is the nominal high-precision
  dtype. Ops with a quantized rule (views, copies, ...) keep the subclass; every other op runs on the
  dequantized values and returns plain tensors; in-place ops re-quantize into the tensor.
"""

from __future__ import annotations

import abc
import copy
from typing import Callable, Iterable, Optional

import torch
from torch.utils._pytree import tree_map

from .cache_identity import subclass_cache_hash

__all__ = [
    "Quantizer",
    "QuantizedTensorStorage",
    "QuantizedTensor",
    "prepare_for_saving",
    "restore_from_saved",
]


class Quantizer(abc.ABC):
    """Builds quantized tensors of one format. ``rowwise``/``columnwise`` choose which copies exist:
    rowwise feeds GEMMs that contract the last dim (fprop), columnwise those that contract the
    first (dgrad of the weight, wgrad of the input)."""

    # Quantizers written outside te_compile set this (see te_compile.tensor.utils.is_custom).
    custom: bool = False

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True) -> None:
        self.rowwise_usage = bool(rowwise)
        self.columnwise_usage = bool(columnwise)
        # True: quantize() returns a bare storage object instead of a torch.Tensor subclass
        self.internal = False

    def quantize(self, tensor: torch.Tensor, *, out: Optional[QuantizedTensorStorage] = None):
        """Quantize ``tensor``; with ``out``, write into that existing quantized tensor instead."""
        if out is not None:
            return self.update_quantized(tensor, out)
        return self._quantize(tensor)

    def __call__(self, tensor: torch.Tensor):
        return self.quantize(tensor)

    @abc.abstractmethod
    def _quantize(self, tensor: torch.Tensor):
        """Return a new quantized tensor (or storage, if ``self.internal``) for ``tensor``."""

    @abc.abstractmethod
    def update_quantized(
        self,
        src: torch.Tensor,
        dst: QuantizedTensorStorage,
        *,
        noop_flag: Optional[torch.Tensor] = None,
    ) -> QuantizedTensorStorage:
        """Re-quantize ``src`` into ``dst`` in place. A non-zero ``noop_flag`` ([1]) leaves ``dst``
        and the quantizer's state unchanged (the flag is read on device: no host sync)."""

    @abc.abstractmethod
    def make_empty(
        self,
        shape: Iterable[int],
        *,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
        requires_grad: bool = False,
    ):
        """An uninitialized quantized tensor of ``shape`` with nominal ``dtype``."""

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def copy(self) -> "Quantizer":
        """A shallow copy: state tensors (scale, amax) stay shared, usage flags become independent."""
        return copy.copy(self)


class QuantizedTensorStorage:
    """The buffers of one quantized tensor. Subclasses define the fields and these methods."""

    def prepare_for_saving(self) -> tuple[list[Optional[torch.Tensor]], "QuantizedTensorStorage"]:
        """Move the buffers out (to be passed to ``save_for_backward``) and return them with self."""
        raise NotImplementedError(f"{type(self).__name__}.prepare_for_saving")

    def restore_from_saved(self, tensors: list[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
        """Put back the buffers taken by ``prepare_for_saving``; return the unused rest of ``tensors``."""
        raise NotImplementedError(f"{type(self).__name__}.restore_from_saved")

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None):
        """Create or drop the rowwise / columnwise copies."""
        raise NotImplementedError(f"{type(self).__name__}.update_usage")

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.dequantize")

    def clear(self) -> None:
        """Free the quantized buffers (the object stays, holding empty tensors)."""
        raise NotImplementedError(f"{type(self).__name__}.clear")

    def get_metadata(self) -> dict:
        """The constructor arguments that rebuild this tensor."""
        raise NotImplementedError(f"{type(self).__name__}.get_metadata")


def prepare_for_saving(*tensors) -> tuple[list[Optional[torch.Tensor]], list]:
    """Split tensors for ``ctx.save_for_backward``: returns (plain tensor list, objects list).

    Tensors (plain or quantized torch.Tensor subclasses such as Float8Tensor) and None go to the
    tensor list unchanged (their object slot is None): a Float8Tensor is often the caller's
    parameter or is used again later in forward, so it must not be emptied. A bare storage object
    (``internal=True``) contributes its buffers to the tensor list and itself, emptied, to the
    objects list.
    """
    tensor_list: list[Optional[torch.Tensor]] = []
    objects: list = []
    for t in tensors:
        if isinstance(t, QuantizedTensorStorage) and not isinstance(t, torch.Tensor):
            buffers, obj = t.prepare_for_saving()
            tensor_list.extend(buffers)
            objects.append(obj)
        else:
            tensor_list.append(t)
            objects.append(None)
    return tensor_list, objects


def restore_from_saved(objects: list, tensor_list) -> list:
    """Inverse of ``prepare_for_saving``: rebuild the original sequence from ``ctx.saved_tensors``."""
    rest = list(tensor_list)
    out = []
    for obj in objects:
        if obj is None:
            out.append(rest.pop(0))
        else:
            rest = obj.restore_from_saved(rest)
            out.append(obj)
    if rest:
        raise ValueError(f"restore_from_saved: {len(rest)} saved tensors were not consumed")
    return out


# Quantized rules by op, per QuantizedTensor subclass: {cls: {aten op overload: handler}}.
_HANDLERS: dict[type, dict[torch._ops.OpOverload, Callable]] = {}


def implements(cls: type, *ops: torch._ops.OpOverload) -> Callable:
    """Register ``handler(func, args, kwargs)`` as the quantized rule of ``ops`` for ``cls``."""

    def register(handler: Callable) -> Callable:
        table = _HANDLERS.setdefault(cls, {})
        for op in ops:
            table[op] = handler
        return handler

    return register


def _dequantize_arg(x):
    return x.dequantize() if isinstance(x, QuantizedTensor) else x


class QuantizedTensor(torch.Tensor):
    """A wrapper tensor whose dtype is the nominal (high-precision) dtype of quantized data."""

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, *, device=None, requires_grad: bool = False,
                strides=None, **_):
        # ``strides``: those of the wrapped data, so that reshape/contiguous see a transposed or
        # sliced view as non-contiguous (and copy) instead of calling view on strided bytes.
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=strides, dtype=dtype, device=device, requires_grad=requires_grad
        )

    # Python-level torch functions go straight to dispatch; rules live in __torch_dispatch__.
    __torch_function__ = torch._C._disabled_torch_function_impl

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.dequantize")

    def quantize_(self, tensor: torch.Tensor) -> "QuantizedTensor":
        """Re-quantize ``tensor``'s values into self, in place."""
        raise NotImplementedError(f"{type(self).__name__}.quantize_")

    def _copy_from(self, src: torch.Tensor) -> "QuantizedTensor":
        """``self.copy_(src)`` into this format: the bytes and scales of a source in the same layout
        (no rounding), else ``src``'s values quantized."""
        raise NotImplementedError(f"{type(self).__name__}.copy_")

    def detach(self) -> "QuantizedTensor":
        """A tensor of the same format over the same buffers, marked an alias of self (``_alias_of``);
        ``aten.detach`` is this too."""
        raise NotImplementedError(f"{type(self).__name__}.detach")

    # FP8 primary weights (te_compile.quantized_model_init(preserve_high_precision_init_val=True))
    # keep the values they were quantized from, on the CPU, to initialize fp32 master weights. The
    # holder ([tensor, PENDING or None]) is shared with detached aliases (``weight.data``) and with the
    # materialization of a meta weight (``Module.to_empty``), so that an in-place initialization
    # through either (``weight.data.normal_()``, ``reset_parameters()``) fills or refreshes it.
    # PENDING: a meta weight, whose values come with its first initialization; None: cleared.
    _hp_init: Optional[list] = None
    PENDING = "pending"

    def get_high_precision_init_val(self) -> Optional[torch.Tensor]:
        """The high-precision values this weight was created from (CPU), or None when not kept."""
        value = None if self._hp_init is None else self._hp_init[0]
        return None if value is QuantizedTensor.PENDING else value

    def clear_high_precision_init_val(self) -> None:
        """Drop the kept high-precision values (once the master weights are initialized)."""
        if self._hp_init is not None:
            self._hp_init[0] = None

    def _stable_hash_for_caching(self) -> str:
        """torch.compile: AOTAutograd's cache key for this tensor as a graph input, the same in every
        process (cache_identity.py); every subclass's ``__tensor_flatten__`` gives what it covers."""
        names, metadata = self.__tensor_flatten__()
        return subclass_cache_hash(self, names, metadata)

    def _copy_target(self, kwargs: dict) -> tuple[torch.dtype, dict]:
        """For ``aten._to_copy(self, **kwargs)``: (the copy's nominal dtype, the kwargs that move each
        buffer: device, non_blocking). The buffers keep their own dtypes and layouts."""
        kwargs = dict(kwargs)
        dtype = kwargs.pop("dtype", None) or self.dtype
        kwargs.pop("memory_format", None)
        return dtype, kwargs

    def _alias_of(self, other: "QuantizedTensor") -> "QuantizedTensor":
        """Mark self as a full alias of ``other`` (a detach, or the materialization of a meta tensor):
        share what belongs to the values."""
        if other._hp_init is not None:
            self._hp_init = other._hp_init
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in types:
            # a rule registered on a base class (e.g. BlockScaledTensor) serves its subclasses
            for klass in t.__mro__:
                handler = _HANDLERS.get(klass, {}).get(func)
                if handler is not None:
                    return handler(func, args, kwargs)
        # No quantized rule: compute on dequantized values.
        result = func(*tree_map(_dequantize_arg, args), **tree_map(_dequantize_arg, kwargs))
        if func._schema.is_mutable and args and isinstance(args[0], QuantizedTensor):
            # In-place op on a quantized tensor (add_, mul_, zero_, ...): the op ran on a
            # dequantized copy; quantize the result back into the original.
            args[0].quantize_(result)
            if args[0]._hp_init is not None and args[0]._hp_init[0] is not None:   # kept, or pending
                args[0]._hp_init[0] = result.detach().to("cpu", copy=True)
            return args[0]
        return result


# Each format's detach() knows its buffers; the dispatcher's detach (autograd, .data) means the same.
@implements(QuantizedTensor, torch.ops.aten.detach.default)
def _detach(func, args, kwargs):
    return args[0].detach()


@implements(QuantizedTensor, torch.ops.aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, QuantizedTensor):
        # plain <- quantized: copy the values
        return dst.copy_(src.dequantize(dtype=dst.dtype))
    return dst._copy_from(src)
