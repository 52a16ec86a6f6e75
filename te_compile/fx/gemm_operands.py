"""How a GEMM call reads its parameter operand, and the records of the GEMM sites the passes find.

A weight reaches a matmul through ops that keep it the same weight: transposes (the call then reads
it the other way round), dtype casts, a DTensor's ``to_local()``, or one expert's matrix ``W[e]`` of a
3-D parameter. ``param_behind`` walks back through those to the parameter; ``reaches_param`` also
through broadcasts, slices and reshapes, for the report's "has a parameter operand".

``LinearSite`` and ``GroupedSite`` are what the linear and grouped linear passes' finders return
(``passes/linear.py``, ``passes/grouped_linear.py``); they live here, below the passes, so that the
modules those passes consult (eligibility, async TP, inference weights, the fused loss) can name
them without importing a pass.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from .graphs import ParamRef
from .matching import value_of

__all__ = ["LinearSite", "GroupedSite", "BMM_FNS", "rank", "tensor_method", "param_behind", "unbroadcast",
           "reaches_param", "batched_experts", "grouped_op", "argument"]


@dataclass
class LinearSite:
    node: fx.Node               # the call to replace
    x: fx.Node                  # activation [..., K] (weight_first: [..., K, M], or [K])
    weight: fx.Node             # the weight as the call reads it: [N, K], or [K, N] when weight_in_out
    param: Optional[ParamRef]   # the parameter behind ``weight`` (through transposes, casts); None: computed
    bias: Optional[fx.Node]     # added to the product: [N] for linear, any broadcastable addend for addmm
    weight_in_out: bool         # the call reads the weight as [in, out] (x @ W, x @ W.t(), HF Conv1D)
    fqn: str                    # module path as named_modules() gives it
    op_name: str                # the graph op, for reports: "linear", "addmm", "matmul", ...
    weight_first: bool = False  # W @ x: the weight is the left operand (y = (x.mT @ W.T).mT)
    unsupported: Optional[str] = None   # why this matmul with a parameter operand is not lowered
    expert: Optional[int] = None        # the weight is ``param[expert]``, one expert of a 3-D parameter


@dataclass
class GroupedSite:
    node: fx.Node               # the call to replace
    x: fx.Node                  # tokens sorted by expert [M, K]
    weight: fx.Node             # the weight as the call reads it: [E, K, N]
    offs: Optional[fx.Node]     # int [E]: the running end of each expert's rows
    param: Optional[ParamRef]   # the 3-D parameter behind ``weight``; None: computed
    weight_in_out: bool         # the parameter is stored [E, in, out] (else [E, out, in], read transposed)
    fqn: str                    # the experts module's path
    op_name: str                # "grouped_mm" | "grouped_mm_fallback" | "bmm", for reports
    unsupported: Optional[str] = None   # why this grouped GEMM is not lowered
    batched: bool = False       # bmm of x [E, T, K]: T rows per expert, no offs


BMM_FNS = (torch.bmm, torch.Tensor.bmm)
_GROUPED_MM_FNS = (torch._grouped_mm, getattr(torch.nn.functional, "grouped_mm", torch._grouped_mm))
# transformers' custom op for the weights torch._grouped_mm cannot compile (fp32, fp16): same operands
_GROUPED_MM_OPS = ("transformers::grouped_mm_fallback",)

# Single-input ops that keep a weight the same weight: transposes (the call then reads it the other
# way round), dtype casts (the call reads the cast copy; gradients flow back through it) and a DTensor
# parameter's to_local() (the call reads this rank's shard: torchtitan's experts under expert parallelism).
_TRANSPOSE_METHODS = ("t", "transpose", "permute", "swapaxes", "swapdims")
_CAST_METHODS = ("to", "type", "type_as", "float", "half", "bfloat16", "double", "contiguous", "detach",
                 "to_local")
# Views that broadcast a 2-D weight over a batch dim for bmm / baddbmm.
_BROADCAST_METHODS = ("expand", "expand_as", "broadcast_to", "unsqueeze")
# Ops that take part of a parameter (an expert's slice of a 3-D weight) or reshape it: what comes
# out is still parameter data, for the report's "has a parameter operand".
_SLICE_METHODS = ("getitem", "__getitem__", "index_select", "select", "narrow", "view", "reshape",
                  "squeeze", "flatten", "unflatten", "chunk", "split", "unbind")


def rank(node) -> int:
    """The number of dims of ``node``'s example value; -1 when it has none."""
    value = value_of(node)
    return value.dim() if value is not None else -1


def tensor_method(node: fx.Node) -> Optional[str]:
    """The name of a tensor method call (call_method, or call_function on torch / Tensor / getattr)."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        if node.target is getattr and len(node.args) == 2 and node.args[1] in ("T", "mT"):
            return "t"
        if node.target is operator.getitem:
            return "getitem"
        name = getattr(node.target, "__name__", None)
        if node.target in (torch.t, torch.transpose, torch.permute, torch.swapaxes, torch.unsqueeze,
                           torch.broadcast_to, torch.Tensor.to, torch.Tensor.t, torch.Tensor.transpose,
                           torch.Tensor.expand, torch.Tensor.type_as, torch.Tensor.float,
                           torch.Tensor.contiguous):
            return name
    return None


def _is_matrix_transpose(node: fx.Node) -> bool:
    """Swaps the last two dims of a 2-D or 3-D tensor: t(), .T, .mT, transpose(0, 1) / (-2, -1),
    permute(1, 0) / (0, 2, 1). A 3-D weight is a stack of matrices (one per expert)."""
    ndim = rank(node)
    if ndim not in (2, 3):
        return False
    name = tensor_method(node)
    if name in ("t", "T", "mT"):
        return ndim == 2 or name == "mT" or (node.target is getattr and node.args[1] == "mT")
    dims = [a for a in node.args[1:]]
    if name in ("transpose", "swapaxes", "swapdims"):
        return len(dims) == 2 and all(isinstance(d, int) for d in dims) and \
            sorted(d % ndim for d in dims) == [ndim - 2, ndim - 1]
    if name == "permute":
        flat = dims[0] if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
        return [d % ndim for d in flat if isinstance(d, int)] == [*range(ndim - 2), ndim - 1, ndim - 2]
    return False


def _expert_index(node: fx.Node) -> Optional[int]:
    """e for ``W[e]``, ``W[e, :, :]``, ``W.select(0, e)`` of a 3-D ``W`` with a constant e; else None."""
    name = tensor_method(node) or getattr(node.target, "__name__", None)
    if len(node.args) < 2 or rank(node.args[0]) != 3:
        return None
    index = None
    if name == "getitem":
        index = node.args[1]
        if isinstance(index, tuple) and index and all(i == slice(None) for i in index[1:]):
            index = index[0]
    elif name == "select" and len(node.args) == 3 and node.args[1] == 0:
        index = node.args[2]
    if not isinstance(index, int) or isinstance(index, bool):
        return None
    return index % value_of(node.args[0]).shape[0]   # W[-1] is the last expert


def param_behind(node, params: dict[fx.Node, ParamRef],
                  experts: bool = False) -> tuple[Optional[ParamRef], bool, Optional[int]]:
    """(the parameter ``node`` is a transposed / cast copy of, an odd number of transposes?, the
    expert) where the expert is None, or with ``experts``, e for one expert's matrix ``W[e]`` of a 3-D
    parameter taken on the way (transposes of the stack before the index flip it as well)."""
    flipped, expert = False, None
    while isinstance(node, fx.Node):
        if node in params:
            return params[node], flipped, expert
        if node.op not in ("call_method", "call_function") or not node.args:
            break
        name = tensor_method(node)
        if name in _CAST_METHODS:
            node = node.args[0]
        elif name in _TRANSPOSE_METHODS and _is_matrix_transpose(node):
            flipped = not flipped
            node = node.args[0]
        elif experts and expert is None and (e := _expert_index(node)) is not None:
            expert = e
            node = node.args[0]
        else:
            break
    return None, flipped, None


def unbroadcast(node) -> Optional[fx.Node]:
    """The 2-D tensor a 3-D bmm operand broadcasts over its batch dim, or None."""
    while isinstance(node, fx.Node) and rank(node) != 2:
        if tensor_method(node) not in _BROADCAST_METHODS or not node.args:
            return None
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def reaches_param(node, params) -> bool:
    """Does ``node`` carry (part of) a parameter through views, casts, broadcasts and slicing?"""
    while isinstance(node, fx.Node):
        if node in params:
            return True
        name = tensor_method(node)
        if name not in (*_CAST_METHODS, *_TRANSPOSE_METHODS, *_BROADCAST_METHODS, *_SLICE_METHODS) or not node.args:
            return False
        node = node.args[0]
    return False


def batched_experts(x, w, params) -> bool:
    """Is ``bmm(x, w)`` every expert's GEMM at once: x [E, T, K] and w a 3-D parameter read as
    [E, K, N] (stored so, or [E, N, K] transposed)?"""
    return rank(x) == 3 and rank(w) == 3 and param_behind(w, params)[0] is not None


def grouped_op(node: fx.Node) -> Optional[str]:
    """"grouped_mm" / "grouped_mm_fallback" for a grouped GEMM call, else None."""
    if node.op != "call_function":
        return None
    if node.target in _GROUPED_MM_FNS:
        return "grouped_mm"
    packet = getattr(node.target, "_overloadpacket", node.target)   # OpOverload or OpOverloadPacket
    qualified = getattr(packet, "_qualified_op_name", None)
    return qualified.split("::")[1] if qualified in _GROUPED_MM_OPS else None


def argument(node: fx.Node, index: int, name: str):
    """A call's argument by position or keyword (None when absent)."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)
