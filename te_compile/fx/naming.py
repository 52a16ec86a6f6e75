"""Full module paths for the sites of a graph, whichever frame Dynamo compiled.

Dynamo names modules relative to the frame it compiles. That is the user's model when it compiles
``model.forward`` in one piece, but a single block after a graph break inside the block (Dynamo then
compiles ``Block.forward`` on its own) or when each block is compiled separately (``block.compile()``,
the torchtitan layout): the linears are then "fc1", not "blocks.0.fc1", and an override written
against ``model.named_modules()`` names would silently miss them. And Dynamo reuses such a graph for
every block of the class, so one compile stands for many layers.

The graph's parameters know better: the model that holds them gives their full names. Models are
found once, in one pass over the garbage collector's objects (the outermost modules, stopping below
wrappers that add a path component: torch.compile's OptimizedModule, DDP), and cached; after that a
name is a dict lookup. A frame's prefix is the difference between a parameter's full name and its
name in the frame.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Iterable

import torch.nn as nn

__all__ = ["full_names", "frame_root", "frame_prefix", "FrameInstances"]

# the models found so far: root module -> {id(parameter): name}
_roots: "weakref.WeakKeyDictionary[nn.Module, dict[int, str]]" = weakref.WeakKeyDictionary()


def _wrapper_types() -> tuple[type, ...]:
    """Modules whose child is the user's model under an extra path component."""
    types: list[type] = []
    try:
        from torch._dynamo.eval_frame import OptimizedModule

        types.append(OptimizedModule)
    except ImportError:  # pragma: no cover - torch without Dynamo
        pass
    from torch.nn.parallel import DistributedDataParallel

    types.append(DistributedDataParallel)
    return tuple(types)


def _find_models(params: set[int]) -> dict[nn.Module, dict[int, str]]:
    """The models (outermost modules, below torch.compile / DDP wrappers) that hold any of ``params``
    (ids), each with {id(parameter): name}: one pass over the garbage collector's objects."""
    wrappers = _wrapper_types()
    # issubclass(type(o)): isinstance would read o.__class__, which some lazy objects turn into warnings
    modules = [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]
    has_parent = set()
    for module in modules:
        if not isinstance(module, wrappers):
            has_parent.update(id(child) for child in module._modules.values() if child is not None)
    found = {}
    for module in modules:
        if id(module) in has_parent or isinstance(module, wrappers):
            continue
        names = {id(p): n for n, p in module.named_parameters()}
        if params & names.keys():
            found[module] = names
    return found


def full_names(params: Iterable[nn.Parameter]) -> dict[int, str]:
    """id(parameter) -> its name in its model (``named_parameters()``: a tied parameter gets its
    first name, as recipe_state_dict does), for those of ``params`` that belong to a model."""
    wanted = {id(p) for p in params}
    out = {}
    for names in _roots.values():
        out.update((k, names[k]) for k in wanted & names.keys())
    missing = wanted - out.keys()
    if missing:  # a model not seen yet (or changed since): locate it
        for root, names in _find_models(missing).items():
            _roots[root] = names
            out.update((k, names[k]) for k in missing & names.keys())
    return out


def frame_root(pairs: Iterable[tuple[nn.Parameter, str]]) -> tuple[str, str]:
    """(what the frame puts before a path of the model, the model's path of the frame's root), from
    (parameter, name in the frame) pairs.

    ("", "blocks.0.") when the frame calls "fc1.weight" what the model calls "blocks.0.fc1.weight"
    (Dynamo compiled one block). ("0.", "") when the frame calls "0.model.norm.weight" what the model
    calls "model.norm.weight": Dynamo compiled a decorator's ``wrapper(*args, **kwargs)`` around the
    model's forward (transformers >= 5.24), so the model is ``args[0]`` of the frame.
    """
    pairs = list(pairs)
    names = full_names(p for p, _ in pairs)
    for param, local in pairs:
        full = names.get(id(param))
        if full is None:
            continue
        if full.endswith(local) and (full == local or full[-len(local) - 1] == "."):
            return "", full[: len(full) - len(local)]
        if local.endswith("." + full):
            return local[: len(local) - len(full)], ""
    return "", ""


def frame_prefix(pairs: Iterable[tuple[nn.Parameter, str]]) -> str:
    """The module path of the compiled frame's root, from (parameter, name in the frame) pairs:
    "blocks.0." when the frame calls "fc1.weight" what the model calls "blocks.0.fc1.weight"."""
    return frame_root(pairs)[1]


class FrameInstances:
    """Which instance of the compiled frame's module a call runs, and its report rows.

    Dynamo compiles ``Block.forward`` once and calls the graph for every block whose guards pass, with
    that block's parameters as inputs; the passes named the sites after the first. At each call the
    first parameter input tells the instance (one dict lookup once it is known). A new instance gets
    its own report rows; if the config would give one of its sites another recipe than the graph was
    built with, the call raises instead of silently training that layer in the wrong precision.
    """

    def __init__(self, config, records, prefix: str, anchor_index: int, anchor_name: str) -> None:
        self.config = config
        self.records = records           # the rows the passes wrote, named with ``prefix``
        self.prefix = prefix
        self.anchor_index = anchor_index
        self.anchor_name = anchor_name   # the anchor parameter's name in the frame
        self.seen: set[int] = set()

    def check(self, args) -> list:
        """The report rows of a call's instance if it is new (raises on a recipe conflict), else []."""
        anchor = args[self.anchor_index]
        if id(anchor) in self.seen:
            return []
        self.seen.add(id(anchor))
        prefix = frame_prefix([(anchor, self.anchor_name)])
        if prefix == self.prefix:
            return []
        rows = []
        for record in self.records:
            local = record.fqn[len(self.prefix):] if record.fqn.startswith(self.prefix) else ""
            fqn = f"{prefix}{local}" if local else prefix.rstrip(".")
            built, _ = self.config.recipe_for(record.fqn)
            wanted, why = self.config.recipe_for(fqn)
            if wanted != built:
                self.seen.discard(id(anchor))
                raise RuntimeError(
                    f"te_compile: graph {record.graph} was built for {record.fqn!r} with recipe "
                    f"{_recipe_name(built)}, and Dynamo reuses it for {fqn!r}, which the config gives "
                    f"recipe {_recipe_name(wanted)} ({why}). Dynamo compiles a module on its own (a graph "
                    f"break inside it, or module.compile()) once for all instances of its class: give "
                    f"those instances one recipe, or compile the whole model without a graph break inside "
                    f"the module."
                )
            rows.append(dataclasses.replace(record, fqn=fqn))
        return rows


def _recipe_name(recipe) -> str:
    return "'none'" if recipe is None else recipe.name
