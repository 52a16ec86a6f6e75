"""transformers' one-time warnings as no-ops while Dynamo traces, so they do not split a graph.

transformers logs some messages once per process through ``logger.warning_once``, an lru_cache-wrapped
function it installs on ``logging.Logger``, and some of them sit inside model code. GPT-2's
``loss_function`` property, read on every training step with labels, warns that the model names no
``loss_type``. Dynamo cannot trace a logger call, so it breaks the graph there: the logits end one
graph and the loss begins the next, and te cannot fuse the output layer with its loss
(passes/linear_cross_entropy.py), which then saves the [tokens, vocab] logits for backward.

Dynamo's own answer is ``torch._dynamo.config.ignore_logging_functions``: a call to a function in
that set is a no-op in the traced code (eager calls still log). te adds transformers'
``warning_once`` to it once, when te is imported after transformers, or else right after
``transformers.utils.logging`` is imported (an import hook that then removes itself; Dynamo's
compile-start callbacks would not do, as ``torch._dynamo.reset()`` drops them).

The setting is Dynamo's, so it holds for every compiled frame in the process, whichever backend: a
one-time transformers warning whose first call happens in compiled code is then not printed. To
print them again, discard the function from the set (te does not add it back); the model's
``loss_type`` (``model.loss_type = "ForCausalLM"``) silences GPT-2's warning at its source.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

import torch
import torch._dynamo

__all__ = ["ignore_library_warnings"]

_LOGGING = "transformers.utils.logging"


def _add(module) -> None:
    fn = getattr(module, "warning_once", None)
    if fn is not None:
        torch._dynamo.config.ignore_logging_functions.add(fn)


class _AddAfterExec(importlib.abc.Loader):
    """The module's own loader, with ``_add`` run once the module is executed."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _add(module)

    def __getattr__(self, name):   # get_source, is_package, ...: the module's own loader's
        return getattr(self._loader, name)


class _WhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands on the spec the other finders give for ``_LOGGING``, its loader
    wrapped, and leaves ``sys.meta_path``."""

    def find_spec(self, name, path, target=None):
        if name != _LOGGING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _AddAfterExec(spec.loader)
        return spec


def ignore_library_warnings() -> bool:
    """Make transformers' one-time warnings no-ops in traced code, now when transformers is loaded,
    else once it is (module docstring); returns whether they are already."""
    module = sys.modules.get(_LOGGING)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        _add(module)
        return True
    if not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported())
    return False
