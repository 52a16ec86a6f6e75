"""What makes a compiled graph that reads te's tensors reusable in another process.

AOTAutograd's cache keys a graph partly by its example inputs. For a wrapper tensor subclass torch
asks the tensor for ``_stable_hash_for_caching()`` (torch/_functorch/_aot_autograd/autograd_cache.py,
"Tensor subclass stable hashing"); without one it warns in the user's terminal on every launch and
pickles the ``__tensor_flatten__`` metadata itself, leaving out the class. ``subclass_cache_hash``
is that hash for te's subclasses: it covers what changes the traced code and nothing that changes
from call to call or process to process:

- the class (a Float8Tensor [1, N, K] and a GroupedFloat8Tensor of one expert flatten alike);
- the outer tensor's nominal dtype, shape, strides, device and requires_grad (a symbolic size as its
  expression, ``s0``, as torch's own key writes it);
- the flatten metadata: fp8 dtype, nominal dtype, format flags (``is_2D_scaled``, ``with_rht``, ...);
- which inner buffers exist (a transpose, an amax, a columnwise copy) and each one's dtype, shape,
  strides and device;
- te_compile's source (``source_digest``): AOTAutograd traces through the subclass's
  ``__torch_dispatch__`` rules, which are te's code, not the graph's, so an edit to them must not
  find the graph traced before it.

Never the values, the storage or the object's identity: a weight re-quantized, or the same model
loaded in a new process, hashes the same. Metadata without a stable encoding raises ``TypeError``,
which AOTAutograd counts as a cache bypass (it never guesses).
"""

from __future__ import annotations

import enum
import functools
import hashlib
from pathlib import Path
from typing import Any

import torch

__all__ = ["source_digest", "subclass_cache_hash"]


@functools.cache
def source_digest() -> str:
    """A digest of every Python file of the te_compile package (paths and bytes), once per process:
    what a te graph traces to depends on all of them (lowerings, kernels, tensors, recipes)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _encode(value: Any, owner: str) -> str:
    """Text of one flatten-metadata value that is the same in every process."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (torch.dtype, torch.device, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (tuple, list)):   # torch.Size included
        return "(" + ",".join(_encode(v, owner) for v in value) + ")"
    raise TypeError(f"{owner}: flatten metadata {value!r} (a {type(value).__name__}) has no stable cache "
                    f"encoding; expected dtypes, devices, enums, numbers, strings, None or tuples of them")


def _layout(t: torch.Tensor, owner: str) -> str:
    """dtype, shape, strides, device and requires_grad of ``t`` (no values, no address)."""
    return _encode((t.dtype, tuple(t.shape), tuple(t.stride()), t.device, t.requires_grad), owner)


def _inner_text(t: torch.Tensor, owner: str) -> str:
    """An inner buffer's layout; a nested subclass answers for itself."""
    if hasattr(t, "_stable_hash_for_caching"):
        return f"{type(t).__module__}.{type(t).__qualname__}:{t._stable_hash_for_caching()}"
    return _layout(t, owner)


def subclass_cache_hash(tensor: torch.Tensor, inner_names, metadata) -> str:
    """The stable cache hash of a wrapper subclass ``tensor`` whose ``__tensor_flatten__`` gives
    ``(inner_names, metadata)``: 32 hex digits."""
    owner = type(tensor).__name__
    lines = [
        f"{type(tensor).__module__}.{type(tensor).__qualname__}",
        _layout(tensor, owner),
        _encode(metadata, owner),
    ]
    for name in inner_names:
        inner = getattr(tensor, name)
        lines.append(f"{name}: " + ("None" if inner is None else _inner_text(inner, owner)))
    lines.append(source_digest())
    return hashlib.blake2b("\n".join(lines).encode(), digest_size=16).hexdigest()
