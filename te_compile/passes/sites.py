"""Find linear sites in one graph: every matmul-like call with a weight, and name its module.

A linear site is ``F.linear(x, w, b)`` with any weight, or a matmul whose one operand is a 2-D
parameter, reached directly or through transposes and dtype casts, and whose other operand is an
activation:

    x @ W.T + b   x @ W.t()   torch.matmul(x, W.transpose(0, 1))   F.linear(x, W.to(x.dtype))
    x @ W (W stored [in, out])   torch.addmm(b, x, W) (HF Conv1D)   torch.mm(x, W)   W @ x
    torch.baddbmm(b, x, W.expand(B, K, N))   torch.bmm(x, W.expand(B, K, N))

The weight may also be one expert's matrix of a 3-D parameter, taken with a constant index inside a
per-expert loop (``expert`` then says which):

    F.linear(x_e, W[e])   x_e @ W[e].T   x_e @ W[e] (W stored [E, in, out])

A grouped GEMM site is one call of an MoE layer's experts: tokens sorted by expert [M, K] times a 3-D
parameter [E, K, N] (or [E, N, K] read through ``.transpose(-2, -1)``), groups given by ``offs``, or
every expert's equal share of a batch [E, T, K] (Llama 4's experts):

    torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)   F.grouped_mm(x, W, offs=offs)
    torch.ops.transformers.grouped_mm_fallback(x, W, offs)  (transformers' op for fp32 / fp16 weights)
    torch.bmm(x.view(E, T, K), W)                           (no offs: T rows per expert)

W may be read through ``W.to_local()``: a DTensor parameter's shard (torchtitan's experts under
expert parallelism hold ``Shard(0)`` weights and compute on this rank's experts).

A matmul-like call with a parameter operand in any other form (einsum, a batched parameter, two
parameters, addmm with alpha/beta) is returned too, with ``unsupported`` saying why, so the report
lists it: a layer the report does not show does not exist.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ..fx.graphs import GraphScope, ParamRef, module_fqn
from ..fx.matching import value_of

__all__ = ["LinearSite", "find_linear_sites", "GroupedSite", "find_grouped_sites"]


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


_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_MATMUL_FNS = (torch.matmul, operator.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm)
_MATMUL_METHODS = ("matmul", "mm", "__matmul__")
_ADDMM_FNS = (torch.addmm, torch.Tensor.addmm)
_BMM_FNS = (torch.bmm, torch.Tensor.bmm)
_BADDBMM_FNS = (torch.baddbmm, torch.Tensor.baddbmm)
_OTHER_MATMULS = {torch.einsum: "einsum", torch.functional.einsum: "einsum", torch.tensordot: "tensordot",
                  torch.inner: "inner", torch.mv: "mv", torch.addmv: "addmv", torch.outer: "outer",
                  torch.nn.functional.bilinear: "bilinear"}
# Words that make any other op (grouped_mm, a library's custom GEMM op) count as matmul-like for the
# report when one of its operands reaches a parameter.
_MATMUL_WORDS = frozenset({"mm", "bmm", "matmul", "einsum", "linear", "gemm", "addmm", "baddbmm"})

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


def _rank(node) -> int:
    value = value_of(node)
    return value.dim() if value is not None else -1


def _method(node: fx.Node) -> Optional[str]:
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
    rank = _rank(node)
    if rank not in (2, 3):
        return False
    name = _method(node)
    if name in ("t", "T", "mT"):
        return rank == 2 or name == "mT" or (node.target is getattr and node.args[1] == "mT")
    dims = [a for a in node.args[1:]]
    if name in ("transpose", "swapaxes", "swapdims"):
        return len(dims) == 2 and all(isinstance(d, int) for d in dims) and \
            sorted(d % rank for d in dims) == [rank - 2, rank - 1]
    if name == "permute":
        flat = dims[0] if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
        return [d % rank for d in flat if isinstance(d, int)] == [*range(rank - 2), rank - 1, rank - 2]
    return False


def _expert_index(node: fx.Node) -> Optional[int]:
    """e for ``W[e]``, ``W[e, :, :]``, ``W.select(0, e)`` of a 3-D ``W`` with a constant e; else None."""
    name = _method(node) or getattr(node.target, "__name__", None)
    if len(node.args) < 2 or _rank(node.args[0]) != 3:
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


def _param_behind(node, params: dict[fx.Node, ParamRef],
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
        name = _method(node)
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


def _unbroadcast(node) -> Optional[fx.Node]:
    """The 2-D tensor a 3-D bmm operand broadcasts over its batch dim, or None."""
    while isinstance(node, fx.Node) and _rank(node) != 2:
        if _method(node) not in _BROADCAST_METHODS or not node.args:
            return None
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def _reaches_param(node, params) -> bool:
    """Does ``node`` carry (part of) a parameter through views, casts, broadcasts and slicing?"""
    while isinstance(node, fx.Node):
        if node in params:
            return True
        name = _method(node)
        if name not in (*_CAST_METHODS, *_TRANSPOSE_METHODS, *_BROADCAST_METHODS, *_SLICE_METHODS) or not node.args:
            return False
        node = node.args[0]
    return False


def _matmul_word_name(node: fx.Node) -> Optional[str]:
    """The name of an op not handled above that reads like a matmul ("grouped_mm", a custom op)."""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", None) or str(target)
    words = set(name.lower().replace(".", "_").replace(":", "_").split("_"))
    return name if words & _MATMUL_WORDS else None


def _matmul_site(node, x, w, bias, op_name, fqn, params) -> Optional[LinearSite]:
    """A site for ``x @ w (+ bias)`` where one operand is a parameter; None when neither is."""
    w_param, _, w_expert = _param_behind(w, params, experts=True)
    x_param, _, x_expert = _param_behind(x, params, experts=True)
    if w_param is None and x_param is None:
        if _reaches_param(w, params) or _reaches_param(x, params):
            return LinearSite(node, x, w, None, bias, True, fqn, op_name,
                              unsupported=f"{op_name} with a parameter reached through other ops")
        return None
    if w_param is not None and x_param is not None:
        return LinearSite(node, x, w, w_param, bias, True, fqn, op_name,
                          unsupported=f"{op_name} of two parameters ({x_param.name}, {w_param.name}): "
                                      "no activation operand")
    if w_param is not None:
        if _rank(w) != 2:
            return LinearSite(node, x, w, w_param, bias, True, fqn, op_name,
                              unsupported=f"parameter operand {w_param.name} is {_rank(w)}-D, not 2-D")
        return LinearSite(node, x, w, w_param, bias, True, fqn, op_name, expert=w_expert)
    # W @ x: the weight is [N, K] as read, x [..., K, M]
    if _rank(x) != 2:
        return LinearSite(node, w, x, x_param, bias, False, fqn, op_name, weight_first=True,
                          unsupported=f"parameter operand {x_param.name} is {_rank(x)}-D, not 2-D")
    if bias is not None:
        return LinearSite(node, w, x, x_param, bias, False, fqn, op_name, weight_first=True,
                          unsupported=f"{op_name} with the parameter as its left operand and an addend")
    return LinearSite(node, w, x, x_param, None, False, fqn, op_name, weight_first=True, expert=x_expert)


def _site(node: fx.Node, params: dict[fx.Node, ParamRef], fqn: str) -> Optional[LinearSite]:
    target = node.target
    if node.op == "call_function" and target in _LINEAR:
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        param, _, expert = _param_behind(w, params, experts=True)
        return LinearSite(node, x, w, param, b, False, fqn, "linear", expert=expert)
    is_call = node.op == "call_function"
    if (is_call and target in _MATMUL_FNS) or (node.op == "call_method" and target in _MATMUL_METHODS):
        if len(node.args) != 2 or node.kwargs:
            return None
        return _matmul_site(node, node.args[0], node.args[1], None, "matmul", fqn, params)
    if is_call and target in _ADDMM_FNS:
        b, x, w = node.args[:3]
        site = _matmul_site(node, x, w, b, "addmm", fqn, params)
        if site is not None and (len(node.args) > 3 or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha"))):
            site.unsupported = "addmm with beta or alpha other than 1"
        return site
    if is_call and target in (*_BMM_FNS, *_BADDBMM_FNS):
        baddbmm = target in _BADDBMM_FNS
        b, x, w = node.args[:3] if baddbmm else (None, *node.args[:2])
        if not baddbmm and _batched_experts(x, w, params):
            return None   # find_grouped_sites
        w2 = _unbroadcast(w)
        site = None
        if w2 is not None and _param_behind(w2, params)[0] is not None and _rank(x) == 3:
            site = _matmul_site(node, x, w2, b, target.__name__, fqn, params)
        elif _reaches_param(w, params) or _reaches_param(x, params):
            site = LinearSite(node, x, w, None, b, True, fqn, target.__name__,
                              unsupported=f"{target.__name__} with a batched parameter operand")
        if site is not None and baddbmm and any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
            site.unsupported = "baddbmm with beta or alpha other than 1"
        return site
    if _grouped_op(node) is not None or (node.op == "call_method" and target == "bmm" and len(node.args) == 2
                                         and _batched_experts(*node.args, params)):
        return None   # find_grouped_sites
    name = _OTHER_MATMULS.get(target) if is_call else None
    name = name or _matmul_word_name(node)
    if name is not None:
        operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
        if operands and any(_reaches_param(a, params) for a in operands):
            return LinearSite(node, operands[0], operands[-1], None, None, False, fqn, name,
                              unsupported=f"{name} with a parameter operand is not lowered")
    return None


def find_linear_sites(scope: GraphScope) -> list[LinearSite]:
    """Every linear-like call of ``scope``'s graph, in graph order (see the module docstring)."""
    sites = []
    for node in scope.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        site = _site(node, scope.params, scope.fqn(module_fqn(node)))
        if site is None:
            continue
        if site.fqn == "" and site.param is not None and "." in site.param.name:
            # A root-level call on a submodule's weight (F.linear(h, self.wte.weight)): name the site
            # after the module that owns the weight.
            site.fqn = site.param.name.rsplit(".", 1)[0]
        sites.append(site)
    return sites


# ---- grouped GEMMs (MoE experts) ------------------------------------------------------------------


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


_GROUPED_MM_FNS = (torch._grouped_mm, getattr(torch.nn.functional, "grouped_mm", torch._grouped_mm))
# transformers' custom op for the weights torch._grouped_mm cannot compile (fp32, fp16): same operands
_GROUPED_MM_OPS = ("transformers::grouped_mm_fallback",)


def _batched_experts(x, w, params) -> bool:
    """Is ``bmm(x, w)`` every expert's GEMM at once: x [E, T, K] and w a 3-D parameter read as
    [E, K, N] (stored so, or [E, N, K] transposed)?"""
    return _rank(x) == 3 and _rank(w) == 3 and _param_behind(w, params)[0] is not None


def _grouped_op(node: fx.Node) -> Optional[str]:
    """"grouped_mm" / "grouped_mm_fallback" for a grouped GEMM call, else None."""
    if node.op != "call_function":
        return None
    if node.target in _GROUPED_MM_FNS:
        return "grouped_mm"
    packet = getattr(node.target, "_overloadpacket", node.target)   # OpOverload or OpOverloadPacket
    qualified = getattr(packet, "_qualified_op_name", None)
    return qualified.split("::")[1] if qualified in _GROUPED_MM_OPS else None


def _argument(node: fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _grouped_site(node: fx.Node, op_name: str, params, fqn: str) -> Optional[GroupedSite]:
    fallback = op_name == "grouped_mm_fallback"
    x = _argument(node, 0, "input" if fallback else "mat_a")
    w = _argument(node, 1, "weight" if fallback else "mat_b")
    offs = _argument(node, 2, "offs")
    if not any(_reaches_param(a, params) for a in (x, w)):
        return None   # activations times activations (attention-like): not a weight GEMM
    param, flipped, _ = _param_behind(w, params)
    site = GroupedSite(node, x, w, offs, param, not flipped, fqn, op_name)
    if param is None:
        site.unsupported = (f"{op_name} whose weight operand is not a parameter read as it is or "
                            f"transposed (a computed or sliced weight)")
    elif _rank(x) != 2 or _rank(w) != 3:
        site.unsupported = f"{op_name} of a {_rank(x)}-D input and a {_rank(w)}-D weight (lowered: 2-D tokens x 3-D)"
    elif not isinstance(offs, fx.Node):
        site.unsupported = f"{op_name} without offs"
    elif _argument(node, 3, "bias") is not None:
        site.unsupported = f"{op_name} with a bias argument"
    elif _argument(node, 4, "out_dtype") not in (None, getattr(value_of(x), "dtype", None)):
        site.unsupported = f"{op_name} with out_dtype={_argument(node, 4, 'out_dtype')}, not its input's dtype"
    return site


def _batched_site(node: fx.Node, params, fqn: str) -> Optional[GroupedSite]:
    x, w = node.args[0], node.args[1]
    if len(node.args) != 2 or node.kwargs or not _batched_experts(x, w, params):
        return None
    param, flipped, _ = _param_behind(w, params)
    site = GroupedSite(node, x, w, None, param, not flipped, fqn, "bmm", batched=True)
    if value_of(x).shape[0] != value_of(w).shape[0]:
        site.unsupported = f"bmm of {value_of(x).shape[0]} batches against {value_of(w).shape[0]} experts"
    return site


def find_grouped_sites(scope: GraphScope) -> list[GroupedSite]:
    """Every grouped GEMM call of ``scope``'s graph with a parameter operand, in graph order."""
    sites = []
    for node in scope.graph.nodes:
        op_name = _grouped_op(node)
        fqn = scope.fqn(module_fqn(node)) if node.op in ("call_function", "call_method") else ""
        if op_name is not None:
            site = _grouped_site(node, op_name, scope.params, fqn)
        elif (node.op == "call_function" and node.target in _BMM_FNS) or (node.op == "call_method"
                                                                           and node.target == "bmm"):
            site = _batched_site(node, scope.params, fqn)
        else:
            site = None
        if site is not None:
            sites.append(site)
    return sites
