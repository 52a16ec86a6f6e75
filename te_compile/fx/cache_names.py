"""Stable names for the lowerings in a rewritten graph, so that AOTAutograd's cache keeps te graphs.

AOTAutograd keys a Dynamo graph by its generated code and by an import statement for every global
that code calls, and it refuses (bypasses the cache for) a graph that calls anything it cannot vouch
for: only torch functions, ops and builtins pass, plus the names listed in inductor's
``unsafe_marked_cacheable_functions``. Our lowerings are callable objects, one per site, so every te
graph bypassed the cache and each process re-traced forward and backward.

A lowering is a pure function of its type, the plain data it holds (its spec: recipe fields, module
paths, flags), te_compile's own code and the few choices it makes from the process (``_trace_facts``).
``publish_lowerings`` digests these, names the object
after the digest (``te_linear_DelayedScaling_<16 hex>``), makes it importable under that name from
this module, and returns the names for the backend to list in ``unsafe_marked_cacheable_functions``
while it compiles that graph. A change of a recipe field, a module path or any te_compile source file
changes the name, so the code, so the key; equal lowerings in one process share one object.

A lowering holding something without a stable encoding (a function from outside te_compile, such as
CustomRecipe's ``qfactory`` or a callable ``amax_compute_algo``, unless its author gave it a
``cache_hash`` attribute) keeps its plain name: its graph bypasses the cache, as it did before.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import types
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from ..tensor.cache_identity import source_digest

__all__ = ["publish_lowerings", "source_digest", "name_lowering"]

log = logging.getLogger("te_compile")

_LOWERINGS_PACKAGE = "te_compile.lowerings."
_published: dict[str, object] = {}   # name -> lowering: what ``from <this module> import <name>`` finds


def __getattr__(name: str) -> object:
    """Module attribute lookup (PEP 562): a published lowering by its name."""
    try:
        return _published[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


class _NoStableKey(Exception):
    """The object holds a value whose encoding would not be the same in another process."""


def _qualified(fn: Any) -> str:
    """``module.qualname`` of a function, type or op referenced by name (no address)."""
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"op:{fn}"
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not name or "<locals>" in name or "<lambda>" in name:
        raise _NoStableKey(f"{fn!r} is not importable by name")
    return f"{module}.{name}"


def _encode_graph(gm: fx.GraphModule) -> str:
    """A small graph the lowering runs (a hand-written activation): its nodes, by name and target."""
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        raise _NoStableKey("a graph with tensors of its own")
    rows = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            raise _NoStableKey("a graph reading an attribute")
        target = node.target if isinstance(node.target, str) else _qualified(node.target)
        rows.append(f"{node.name}={node.op}:{target}{_encode(node.args)}{_encode(node.kwargs)}")
    return "Graph[" + ";".join(rows) + "]"


def _encode_function(fn: Any) -> str:
    """A function held in a spec (CustomRecipe's qfactory): te_compile's own by name (the source digest
    covers its code); another only with a ``cache_hash`` attribute set by its author, torch's rule for
    code it cannot see (activation checkpointing's context_fn), since its name says nothing of its code."""
    if isinstance(fn, functools.partial):
        if getattr(fn, "cache_hash", None) is not None:
            return f"partial#{fn.cache_hash}"
        return f"partial({_encode_function(fn.func)},{_encode(fn.args)},{_encode(fn.keywords)})"
    if getattr(fn, "cache_hash", None) is not None:
        return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', None)}#{fn.cache_hash!s}"
    name = _qualified(fn)
    if name.startswith("te_compile.") or isinstance(fn, types.BuiltinFunctionType):
        return name
    raise _NoStableKey(f"function {name} has no cache_hash attribute")


def _encode(obj: Any) -> str:
    """A canonical, address-free text of ``obj``; raises _NoStableKey where there is none."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return repr(obj)
    if isinstance(obj, fx.Node):
        return f"%{obj.name}"
    if isinstance(obj, enum.Enum):
        return f"{_qualified(type(obj))}.{obj.name}"
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, (tuple, list)):
        return "(" + ",".join(_encode(o) for o in obj) + ")"
    if isinstance(obj, dict):
        items = sorted((_encode(k), _encode(v)) for k, v in obj.items())   # ordered by the keys' encodings
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(obj, fx.GraphModule):
        return _encode_graph(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = ",".join(f"{f.name}={_encode(getattr(obj, f.name))}" for f in dataclasses.fields(obj))
        return f"{_qualified(type(obj))}({fields})"
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, functools.partial)):
        return _encode_function(obj)
    if type(obj).__module__.startswith(_LOWERINGS_PACKAGE):
        # a lowering (or one it delegates to): its type and its own attributes
        attrs = {k: v for k, v in vars(obj).items() if not k.startswith(("__", "_te_"))}
        return f"{_qualified(type(obj))}{_encode(attrs)}"
    raise _NoStableKey(f"{type(obj).__name__} value {obj!r:.80}")


def _is_lowering(target: Any) -> bool:
    return not isinstance(target, str) and type(target).__module__.startswith(_LOWERINGS_PACKAGE)


def _trace_facts() -> str:
    """What a lowering decides from the process while it is traced, beyond its spec and its inputs'
    devices and dtypes (which the key holds): the CPU FP8 GEMM path (gemm/per_tensor.py; both give the
    same bits, but a test or benchmark that picks one must get it)."""
    from ..gemm import per_tensor

    return f"cpu_emulates_scaled_mm={per_tensor.cpu_emulates_scaled_mm()}"


def name_lowering(lowering: Any, name: str, module: str) -> None:
    """Name a lowering object as the function it stands for: generated code calls it ``module.name``."""
    lowering.__name__ = lowering.__qualname__ = name
    lowering.__module__ = module


def _publish(lowering: Any, facts: str) -> Optional[Any]:
    """The published object equal to ``lowering`` (itself, renamed, if it is the first), or None."""
    base = getattr(lowering, "_te_base_name", lowering.__name__)
    try:
        text = _encode(lowering)
    except _NoStableKey as e:
        log.debug("te_compile: %r has no stable cache name (%s); its graph bypasses AOTAutograd's cache",
                  lowering, e)
        return None
    digest = hashlib.blake2b(f"{source_digest()}|{facts}|{text}".encode(), digest_size=8).hexdigest()
    name = f"{base}_{digest}"
    if name not in _published:
        lowering._te_base_name = base
        name_lowering(lowering, name, __name__)
        _published[name] = lowering
    return _published[name]


def publish_lowerings(gms: Sequence[fx.GraphModule]) -> dict[str, str]:
    """Give every lowering called in ``gms`` its published name (in place; recompile afterwards).

    Returns ``{"<module>.<name>": digest}`` for the lowerings published, the entries the backend adds
    to ``torch._inductor.config.unsafe_marked_cacheable_functions`` while it compiles these graphs.
    """
    names: dict[str, str] = {}
    facts = None
    for gm in gms:
        for node in gm.graph.nodes:
            if node.op != "call_function" or not _is_lowering(node.target):
                continue
            facts = _trace_facts() if facts is None else facts
            published = _publish(node.target, facts)
            if published is None:
                continue
            node.target = published
            names[f"{__name__}.{published.__name__}"] = published.__name__.rsplit("_", 1)[1]
    return names
