"""Activation offload: the saved tensors of te's compiled forward go to host memory until the backward.

torch's partitioner does the graph surgery (``torch._functorch._activation_offloading``, run inside
``min_cut_rematerialization_partition`` when ``torch._functorch.config.enable_activation_offloading``
is set): every forward node whose ``meta["should_offload"]`` is true and which the partitioner saves
for the backward (not a view, a getitem or a non-contiguous tensor: its ``can_offload``) gets a
transfer after its last forward use, and the backward a transfer back before its first use. torch
sets ``should_offload`` nowhere itself; ``OffloadPartitioner`` is the partitioner te hands
AOTAutograd (inductor's ``custom_partitioner_fn``, aot_eager's ``partition_fn``), and it adds:

- the rule: a joint-graph node is marked when the module it was traced in (``nn_module_stack``, named
  as the report names sites) has offload on (``TeConfig.offload_for``: ``[memory]`` and
  ``[[overrides]]``). te's lowerings are traced through, so an FP8 site's saved tensors are its
  bytes (``float8_*``) and scales (fp32): they move as they are, never dequantized;
- the CPU form: on a CPU, torch's transfer (``prims.device_put`` to the same device, ``Tensor.to``)
  returns its input under aot_eager; te makes the forward's transfer an ``aten._to_copy`` there, so
  the backward reads a separate host copy as it does after a real transfer (inductor's lowering of
  ``device_put`` copies already);
- FP8 operands saved as views: te saves their contiguous base instead and takes the views again in
  the backward (``_save_bases``), as torch's pass never offloads a view;
- the report: one row per module with offload on, listing what moved (dtype, shape, bytes) and what
  stayed, with torch's reason.

On an accelerator the transfers run on torch's side stream (``activation_offload_separate_stream``:
``ao::offload`` / ``ao::wait_tensor``) with the backward's reloads prefetched
(``activation_reload_prefetch``). ``activation_offload_sink_wait`` stays off: it keeps every offloaded
tensor on the device until the end of the forward graph, which for a whole model compiled as one graph
is the memory peak offload is meant to lower.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

from ..config import TeConfig
from ..report import SiteRecord
from .graphs import module_fqn

__all__ = ["OffloadPartitioner", "offload_flags", "moved_bytes", "OFFLOAD_PREFIX", "RELOAD_PREFIX"]

# the names torch's pass gives the transfer nodes (its identifiers for them, as in its own code)
OFFLOAD_PREFIX = "cpu_offload_"
RELOAD_PREFIX = "gpu_reload_"


def offload_flags(device: torch.device) -> dict[str, Any]:
    """The ``torch._functorch.config`` settings the partition runs under on ``device``."""
    side_stream = device.type != "cpu"
    return {"enable_activation_offloading": True, "activation_offload_separate_stream": side_stream,
            "activation_offload_sink_wait": False, "activation_reload_prefetch": side_stream}


def _nbytes(value: torch.Tensor) -> int:
    numel = value.numel()
    if not isinstance(numel, int):   # a symbolic size: its value in this compile's example inputs
        numel = numel.node.hint
    return int(numel) * value.element_size()


def _describe(value: torch.Tensor) -> str:
    dtype = str(value.dtype).removeprefix("torch.")
    return f"{dtype}{list(value.shape)} {_nbytes(value):,} B"


def _view_test() -> Callable[[fx.Node], bool]:
    """The partitioner's own test for a view op (its op lists are built on each call: take it once per
    partition, not per node)."""
    from torch._functorch.partitioners import get_default_op_list

    return get_default_op_list().is_view


def _kept_reason(node: fx.Node, is_view: Callable[[fx.Node], bool]) -> str:
    """Why torch's ``can_offload`` left a marked saved tensor on the device."""
    if is_view(node):
        return "a view"
    if node.target is operator.getitem:
        return "a getitem"
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and not value.is_contiguous():
        return "not contiguous"
    return "an input or output of the graph"


@dataclass
class _Site:
    moved: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    nbytes: int = 0


class OffloadPartitioner(CustomPartitionerFn):
    """Marks the saved tensors ``config`` selects, partitions with torch's offloading on, and records
    one report row per module with offload on (``records``, filled at each partition)."""

    def __init__(self, config: TeConfig, name: Callable[[str], str], device: torch.device, graph_id: int) -> None:
        self.config = config
        self.name = name          # Dynamo's module path -> the model's (fx/graphs.GraphScope.fqn)
        self.device = device
        self.graph_id = graph_id
        self.records: list[SiteRecord] = []

    def __deepcopy__(self, memo: dict) -> "OffloadPartitioner":
        # inductor copies its config patches; the copy must fill this object's records, and the
        # config and names it holds reach the model's parameters, which do not deep-copy
        return self

    def __reduce__(self):
        # inductor pickles its config into the FX graph cache's key, custom_partitioner_fn included
        # (it is missing from inductor's list of keys it leaves out there): pickle as what decides the
        # graphs, not as the objects held
        return (str, (repr(self.uuid()),))

    def uuid(self) -> Optional[Any]:
        # inductor's caches key the partition by this: the rule and the device decide the graphs
        rule = (self.config.memory.offload_activations,
                tuple((o.modules, o.offload_activations) for o in self.config.overrides))
        return (get_hash_for_files((__file__,)).hex(), repr(rule), self.device.type)

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
        import torch._functorch.config as functorch_config
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        from torch._functorch._activation_offloading.activation_offloading import enable_activation_offloading
        from torch.utils._ordered_set import OrderedSet

        for node in gm.graph.nodes:
            if node.op == "call_function" and self.config.offload_for(self.name(module_fqn(node))):
                node.meta["should_offload"] = True
        # torch's partition first, then te's base-for-view swap, then torch's offload insertion (which
        # the partitioner would otherwise run inside, before te could swap): the marks only name
        # call_function nodes, so no input of static lifetime is a candidate
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        num_fwd_outputs = kwargs.get("num_fwd_outputs", 0)
        _save_bases(fw, bw, num_fwd_outputs)
        with functorch_config.patch(offload_flags(self.device)):
            enable_activation_offloading(fw, bw, num_fwd_outputs, OrderedSet())
        if self.device.type == "cpu" and kwargs.get("compiler") != "inductor":   # inductor's lowering copies
            _copy_on_cpu(fw)
        fw.recompile()
        bw.recompile()
        self.records.extend(self._rows(fw, num_fwd_outputs))
        return fw, bw

    def _rows(self, fw: fx.GraphModule, num_fwd_outputs: int) -> list[SiteRecord]:
        """One row per module with offload on that saves something for the backward."""
        sites: dict[str, _Site] = {}
        is_view = _view_test()
        outputs = fw.graph.find_nodes(op="output")[0].args[0][num_fwd_outputs:]
        for saved in outputs:
            if not isinstance(saved, fx.Node) or not isinstance(saved.meta.get("val"), torch.Tensor):
                continue
            moved = saved.op == "call_function" and saved.name.startswith(OFFLOAD_PREFIX)
            # the transfer's source: device_put / _to_copy take it first, ao::wait_tensor as keepalive
            source = (saved.args[1] if _is_wait(saved) else saved.args[0]) if moved else saved
            if not source.meta.get("should_offload"):
                continue
            value = source.meta["val"]
            site = sites.setdefault(self.name(module_fqn(source)), _Site())
            if moved:
                site.moved.append(_describe(value))
                site.nbytes += _nbytes(value)
            elif source.op == "call_function":
                site.kept.append(f"{_describe(value)} ({_kept_reason(source, is_view)})")
        rows = []
        for fqn, site in sites.items():
            reason = (f"offloaded {len(site.moved)} saved tensors, {site.nbytes:,} B: {', '.join(site.moved)}"
                      if site.moved else "nothing offloaded")
            if site.kept:
                reason += f"; kept on the device: {', '.join(site.kept)}"
            recipe, _ = self.config.recipe_for(fqn)
            rows.append(SiteRecord(fqn=fqn, op="offload", recipe=type(recipe).__name__ if recipe else None,
                                   rewritten=bool(site.moved), reason=reason,
                                   shapes=f"{len(site.moved)} moved, {len(site.kept)} kept",
                                   graph=self.graph_id, moved_bytes=site.nbytes))
        return rows


def _is_wait(node: fx.Node) -> bool:
    ao = getattr(torch.ops, "ao", None)
    return ao is not None and hasattr(ao, "wait_tensor") and node.target is ao.wait_tensor.default


def moved_bytes(records: Sequence[SiteRecord]) -> int:
    """Bytes the offload rows among ``records`` say move to host memory per step (each way)."""
    return sum(record.moved_bytes for record in records if record.op == "offload")


def _view_chain(node: fx.Node, is_view: Callable[[fx.Node], bool]) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """(base, views from the base up to ``node``) when ``node`` is a chain of views, each taking only
    constants besides its input, over a contiguous computed tensor; else None."""
    chain = []
    while node.op == "call_function" and is_view(node):
        others = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, fx.Node)]
        if others or not isinstance(node.args[0], fx.Node):
            return None
        chain.append(node)
        node = node.args[0]
    base = node.meta.get("val")
    if (not chain or node.op != "call_function" or node.target is operator.getitem
            or not isinstance(base, torch.Tensor) or not base.is_contiguous()):
        return None
    return node, chain[::-1]


def _save_bases(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Where the forward saves a view marked for offload (te's FP8 operands are often the transpose
    of a contiguous copy: ``t(clone(x_fp8))`` [K, M] for the wgrad GEMM), save its base instead and
    take the views again in the backward, so that torch's pass, which never offloads a view, moves
    the base. A base saved already, or read by its views through other graph values, is left alone."""
    output = fw.graph.find_nodes(op="output")[0]
    outputs = list(output.args[0])
    saved = set(outputs)
    placeholders = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    # the backward's order, read once: the nodes added below are placeholders and view copies put
    # before an existing node, so the order among existing nodes stays as read
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    is_view = _view_test()
    for i in range(num_fwd_outputs, len(outputs)):
        view = outputs[i]
        if not isinstance(view, fx.Node) or not view.meta.get("should_offload"):
            continue
        found = _view_chain(view, is_view)
        old = placeholders.get(view.name)
        if found is None or found[0] in saved or old is None:
            continue
        base, chain = found
        # the base moves for the view's site: reported under its module, offloaded by its mark
        base.meta["should_offload"] = True
        if "nn_module_stack" in view.meta:
            base.meta["nn_module_stack"] = view.meta["nn_module_stack"]
        outputs[i] = base
        saved.add(base)
        with bw.graph.inserting_after(old):
            new = bw.graph.placeholder(base.name)
        new.meta.update(base.meta)
        if old.users:
            first = min(old.users, key=order.__getitem__)
            value = new
            with bw.graph.inserting_before(first):
                for node in chain:
                    value = bw.graph.node_copy(node, lambda arg: value)
            old.replace_all_uses_with(value)
        bw.graph.erase_node(old)
    output.update_arg(0, tuple(outputs))


def _copy_on_cpu(fw: fx.GraphModule) -> None:
    """torch's synchronous transfer is ``prims.device_put``, i.e. ``Tensor.to``, which returns a CPU
    tensor itself when asked for the CPU: make each forward transfer a real copy."""
    for node in fw.graph.find_nodes(op="call_function", target=torch.ops.prims.device_put.default):
        if node.name.startswith(OFFLOAD_PREFIX):
            node.target = torch.ops.aten._to_copy.default
            node.args, node.kwargs = node.args[:1], {"device": torch.device("cpu")}
