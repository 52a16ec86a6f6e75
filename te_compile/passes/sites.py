"""Find linear sites in a Dynamo FX graph and name the module each belongs to."""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

__all__ = ["LinearSite", "module_fqn", "find_linear_sites"]


@dataclass
class LinearSite:
    node: fx.Node               # the call to replace
    x: fx.Node                  # activation [..., K]
    weight: fx.Node             # [N, K], or [K, N] when weight_in_out
    bias: Optional[fx.Node]     # [N] or None
    weight_in_out: bool         # matmul/addmm against a stored [in, out] weight (HF Conv1D)
    fqn: str                    # module path as named_modules() gives it
    op_name: str                # the graph op, for reports: "linear", "addmm", "matmul"


_ROOT = re.compile(r"^L\['[^']*'\]\.?")
_ITEM = re.compile(r"\[\s*'?([^\]']+)'?\s*\]")
_GETATTR = re.compile(r"getattr\((.*), '([^']*)'\)$")


def _normalize_path(path: str) -> str:
    """Dynamo's source names -> named_modules() names.

    "L['self'].blocks.0.mlp.fc" -> "blocks.0.mlp.fc"; "L['self']._modules['h'][0]" -> "h.0";
    "getattr(L['self'].layers, '0')" -> "layers.0".
    """
    m = _GETATTR.match(path)
    while m:
        path = f"{m.group(1)}.{m.group(2)}"
        m = _GETATTR.match(path)
    path = _ROOT.sub("", path)
    path = path.replace("._modules", "").replace("_modules", "")
    path = _ITEM.sub(r".\1", path)
    return path.strip(".").replace("..", ".")


def module_fqn(node: fx.Node) -> str:
    """The innermost module a node was traced in ("" for the root module)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return _normalize_path(path)


def find_linear_sites(gm: fx.GraphModule, params: set[fx.Node]) -> list[LinearSite]:
    """Every linear-like call: ``F.linear(x, w, b)``; ``addmm(b, x, w)`` and ``matmul(x, w)`` /
    ``x @ w`` where ``w`` is a 2-D parameter stored [in, out] (``params``: placeholder nodes that
    are ``nn.Parameter``s)."""
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (torch._C._nn.linear, torch.nn.functional.linear):
            x, w = node.args[0], node.args[1]
            b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            sites.append(LinearSite(node, x, w, b, False, module_fqn(node), "linear"))
        elif node.target is torch.addmm and len(node.args) == 3 and not node.kwargs:
            b, x, w = node.args
            if w in params and _is_vector(b):
                sites.append(LinearSite(node, x, w, b, True, module_fqn(node), "addmm"))
        elif node.target in (torch.matmul, operator.matmul) and len(node.args) == 2:
            x, w = node.args
            if w in params and _rank(w) == 2:
                sites.append(LinearSite(node, x, w, None, True, module_fqn(node), "matmul"))
    return sites


def _rank(node) -> int:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value.dim() if isinstance(value, torch.Tensor) else -1


def _is_vector(node) -> bool:
    return _rank(node) == 1
