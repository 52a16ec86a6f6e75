"""transformers' eager experts loop, traced over every expert so that its GEMMs reach te.

``experts_implementation="eager"`` runs the experts module's own forward (MixtralExperts and the
sixty-odd transformers classes written the same way):

    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()   # [hit, 1]: experts with tokens
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])           # [n_e] each
        ... F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]) ...

Dynamo cannot unroll a loop over a tensor whose length depends on the data, even when it may
capture data-dependent sizes, and a graph break inside a loop makes it skip the whole frame: the
expert GEMMs then run eagerly in high precision, in no graph te is given, with no report row.

The twin made here is that same function (same source, file and line numbers) with the loop header
``for expert_idx in range(self.num_experts)`` and without the ``expert_idx = expert_idx[0]`` that
unpacked the tensor: ``expert_idx`` is an int, so each GEMM reads ``W[e]`` with a constant e, the
per-expert-loop form te rewrites (passes/linear.py), and with ``capture_dynamic_output_shape_ops`` the
whole loop is one graph, each expert's token count an unbacked size. An expert no token picked gets
zero rows and its ``index_add_`` of zero rows changes nothing, so the twin computes what the loop
computes, in the same order (bit for bit in high precision).

The twin is registered with Dynamo (``torch.compiler.substitute_in_graph``): it is traced in place of
the loop wherever Dynamo inlines the call, and eager calls still run transformers' code. A loop in any
other form is left as it is. Registration needs the function, so classes are looked up in the
transformers modules loaded so far, each time Dynamo starts compiling a frame (a callback that
``torch._dynamo.reset()`` removes and the te backend puts back) and each time the te backend is called.
"""

from __future__ import annotations

import __future__
import ast
import inspect
import logging
import sys
import textwrap
import types
from typing import Iterator, Optional

import torch
import torch._dynamo

__all__ = ["trace_eager_experts"]

log = logging.getLogger("te_compile")

_PACKAGE = "transformers.models."
# the loop's first two statements, with ``{t}`` its target's name
_UNPACK = "{t} = {t}[0]"
_SENTINEL = "if {t} == self.num_experts:\n    continue"
_EVERY_EXPERT = "range(self.num_experts)"

_scanned: set[str] = set()                     # transformers modules already looked through
_modules_seen = 0                              # len(sys.modules) at the last look
_twins: dict[types.FunctionType, Optional[types.FunctionType]] = {}   # forward -> its twin, None: no such loop


def _statement(template: str, target: str) -> str:
    return ast.dump(ast.parse(template.format(t=target)).body[0])


def _is_hit_loop(node: ast.AST) -> bool:
    """``for t in hits: t = t[0]; if t == self.num_experts: continue; ...``"""
    if not (isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Name)
            and len(node.body) > 2 and not node.orelse):
        return False
    target = node.target.id
    return (ast.dump(node.body[0]) == _statement(_UNPACK, target)
            and ast.dump(node.body[1]) == _statement(_SENTINEL, target))


def _every_expert(fn: types.FunctionType) -> Optional[types.FunctionType]:
    """``fn`` with each loop over the hit experts made a loop over every expert, or None when ``fn``
    has no such loop or cannot be rebuilt from its source alone (decorators, closures)."""
    if fn.__code__.co_freevars or "num_experts" not in fn.__code__.co_names:   # cheap: no source read
        return None
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    func = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(func, ast.FunctionDef) or func.decorator_list or func.name != fn.__name__:
        return None
    loops = [node for node in ast.walk(func) if _is_hit_loop(node)]
    if not loops:
        return None
    for loop in loops:
        loop.iter = ast.copy_location(ast.parse(_EVERY_EXPERT, mode="eval").body, loop.iter)
        del loop.body[0]
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)
    ast.fix_missing_locations(tree)
    namespace: dict = {}
    # annotations left unevaluated, as the def's own module may only import their names for type checkers
    code = compile(tree, fn.__code__.co_filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, fn.__globals__, namespace)   # noqa: S102
    twin = namespace[fn.__name__]
    twin.__defaults__, twin.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
    twin.__qualname__ = fn.__qualname__
    return twin


def _loop_functions(module: types.ModuleType) -> Iterator[types.FunctionType]:
    """The original forwards of the experts classes defined in ``module``: transformers'
    ``use_experts_implementation`` wraps each class's forward with ``functools.wraps``, which keeps
    the original as ``__wrapped__``."""
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            wrapped = getattr(value.__dict__.get("forward"), "__wrapped__", None)
            if isinstance(wrapped, types.FunctionType):
                yield wrapped


def _register(fn: types.FunctionType) -> bool:
    try:
        twin = _every_expert(fn)
    except Exception as e:   # runs inside Dynamo's compile start: a loop we cannot rebuild stays eager
        log.debug("te_compile: %s left to transformers' eager loop (%r)", fn.__qualname__, e)
        twin = None
    _twins[fn] = twin
    if twin is None:
        return False
    try:
        torch.compiler.substitute_in_graph(fn)(twin)
    except ValueError:   # a polyfill someone else registered for it first: theirs stands
        return False
    return True


def _scan() -> int:
    global _modules_seen
    if len(sys.modules) == _modules_seen:   # nothing imported since the last look
        return 0
    _modules_seen = len(sys.modules)
    count = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith(_PACKAGE) or name in _scanned or module is None:
            continue
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            _modules_seen = 0   # still being imported, its classes not all defined yet: look again
            continue
        _scanned.add(name)
        for fn in _loop_functions(module):
            if fn not in _twins:
                count += _register(fn)
    return count


def _on_compile_start(_args) -> None:
    _scan()


def trace_eager_experts() -> int:
    """Let Dynamo trace the eager experts loop of every transformers experts class loaded so far, and
    of those loaded later once Dynamo starts compiling; returns how many loops were newly registered."""
    handler = torch._dynamo.callback_handler
    if _on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(_on_compile_start)
    return _scan()
