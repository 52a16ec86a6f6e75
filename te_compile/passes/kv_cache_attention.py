"""Finding te's FP8 key/value cache behind an SDPA call's K and V, so that the attention reads its bytes.

``te_compile.fp8_static_cache`` hands the model its keys and values as ``te_compile::dequantize_kv``
(data uint8 [B, Hkv, L, D], scale_inv fp32 [B, Hkv, L, 1], dtype). Between that op and SDPA,
transformers' ``sdpa_attention_forward`` may apply two shape-only steps, in either order:

    repeat_kv:  x[:, :, None].expand(B, Hkv, n_rep, L, D).reshape(B, Hkv * n_rep, L, D)   (GQA with a mask)
    a crop:     x[:, :, :n] or x[:, :, :n, :]       (a causal prefill cropping the cache to its own length)

``kv_cache_sources`` walks back through those to the op; ``kv_cache_operands`` then gives what the
attention reads instead: the bytes and scales, cropped as K and V were (the crop acts on dim 2 of both alike). The
repeat needs nothing: te's kernel reads each key/value head for its group of query heads.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ..kv_cache import dequantize_kv  # noqa: F401  (registers the op the walk looks for)
from ..fx.matching import value_of

__all__ = ["kv_cache_sources", "kv_cache_operands"]

_DEQUANTIZE = torch.ops.te_compile.dequantize_kv.default
_FULL = slice(None, None, None)


def _is_method(node: fx.Node, *names: str) -> bool:
    return node.op == "call_method" and node.target in names


def _index(node: fx.Node) -> Optional[tuple]:
    """The index tuple of ``x[...]`` (operator.getitem with a tuple), else None."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], tuple):
        return node.args[1]
    return None


def _repeat_kv_input(node: fx.Node) -> Optional[fx.Node]:
    """x when ``node`` is transformers' repeat_kv of x [B, Hkv, L, D], else None."""
    if not (_is_method(node, "reshape", "view") and isinstance(node.args[0], fx.Node)):
        return None
    expand = node.args[0]
    if not (_is_method(expand, "expand") and isinstance(expand.args[0], fx.Node)):
        return None
    unsqueeze = expand.args[0]
    index = _index(unsqueeze)
    if index is not None:
        if index[:3] != (_FULL, _FULL, None) or any(i not in (_FULL, Ellipsis) for i in index[3:]):
            return None
    elif not (_is_method(unsqueeze, "unsqueeze") and unsqueeze.args[1:] in ((2,), (-3,))):
        return None
    x, out = unsqueeze.args[0], value_of(node)
    source = value_of(x) if isinstance(x, fx.Node) else None
    if source is None or out is None or source.dim() != 4 or out.dim() != 4:
        return None
    b, hkv, length, d = source.shape
    if (out.shape[0], out.shape[2], out.shape[3]) != (b, length, d) or out.shape[1] % hkv:
        return None
    return x


def _crop(node: fx.Node) -> Optional[tuple[fx.Node, tuple]]:
    """(x, index) when ``node`` is x[:, :, a:b] or x[:, :, a:b, :] with constant bounds, else None."""
    index = _index(node)
    if index is None or len(index) not in (3, 4) or index[:2] != (_FULL, _FULL) or index[3:] not in ((), (_FULL,)):
        return None
    seq = index[2]
    if not isinstance(seq, slice) or seq.step is not None:
        return None
    if any(isinstance(bound, fx.Node) or not (bound is None or isinstance(bound, int)) for bound in (seq.start, seq.stop)):
        return None
    return node.args[0], (_FULL, _FULL, seq)


def _source(node: fx.Node) -> Optional[tuple[fx.Node, Optional[tuple]]]:
    """(the dequantize_kv node, the crop on the way or None) behind ``node``, else None."""
    crop = None
    repeated = False
    while isinstance(node, fx.Node):
        if node.op == "call_function" and node.target is _DEQUANTIZE:
            return node, crop
        if not repeated and (inner := _repeat_kv_input(node)) is not None:
            node, repeated = inner, True
        elif crop is None and (found := _crop(node)) is not None:
            node, crop = found
        else:
            return None
    return None


def kv_cache_sources(key, value) -> Optional[list[tuple[fx.Node, Optional[tuple]]]]:
    """For K and V: (the dequantize_kv node, the crop between it and SDPA or None), when both came from
    te's FP8 cache; else None."""
    found = [_source(key), _source(value)]
    return None if any(f is None for f in found) else found


def kv_cache_operands(graph: fx.Graph, before: fx.Node, sources: list) -> list[fx.Node]:
    """[k_data, k_scale_inv, v_data, v_scale_inv] for ``kv_cache_sources``' answer, any crop re-applied
    to the bytes and the scales in front of ``before``."""
    operands = []
    for dequantize, crop in sources:
        data, scale_inv = dequantize.args[:2]
        if crop is None:
            operands += [data, scale_inv]
            continue
        with graph.inserting_before(before):
            for t in (data, scale_inv):
                cropped = graph.call_function(operator.getitem, (t, crop))
                cropped.meta["example_value"] = value_of(t)[crop]
                operands.append(cropped)
    return operands
