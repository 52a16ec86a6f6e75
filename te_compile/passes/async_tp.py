"""Which tensor-parallel linear sites take the async-TP form (lowerings/linear_paths/async_tp.py), and why not.

With ``[distributed] async_tp = true`` (or inductor's ``_micro_pipeline_tp`` set by the user), a
linear on DTensors whose weight is split over one mesh dim (the TP dim; every other dim replicated)
takes the form when, on that dim:

    column: w Shard(0) and x comes sequence-sharded: Shard(d), d not the last dim, either as the
            linear's own operand or through the ``redistribute(Replicate)`` that ColwiseParallel's input
            hook (input_layouts=Shard(1)) puts in front of it; the lowering then reads the sharded x
    row:    w Shard(1), x Shard(-1), and the linear's one user is the ``redistribute`` to Shard(d), d
            not the last dim, that RowwiseParallel's output hook (output_layouts=Shard(1)) adds; the
            lowering then returns that placement itself and the redistribute goes

Per-tensor recipes (Float8CurrentScaling, DelayedScaling). Everything else keeps DTensor's
collectives, with the reason in the report.

Column-parallel Float8CurrentScaling sites reading the same sharded x (wq, wk, wv) are then called
together (``column_groups``), so that x is gathered once; DelayedScaling quantizes x with each site's
own scale, so its sites gather apart.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ..distributed import is_dtensor
from ..lowerings.linear_paths.async_tp import AsyncTp
from ..fx.gemm_operands import LinearSite
from ..fx.matching import value_of

__all__ = ["async_tp_enabled", "async_tp_form", "column_groups"]


def async_tp_enabled(config) -> bool:
    """``[distributed] async_tp``, or inductor's micro-pipeline flag set by the user."""
    import torch._inductor.config as inductor_config

    return bool(config.distributed.async_tp or getattr(inductor_config, "_micro_pipeline_tp", False))


def _is_redistribute(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == "redistribute"


def _tp_dim(x, w) -> tuple[Optional[int], str]:
    """The one mesh dim that splits the weight (every other dim replicated for x and w), or why none."""
    mesh = w.device_mesh
    split = [i for i, p in enumerate(w.placements) if not p.is_replicate() and mesh.size(i) > 1]
    if len(split) != 1:
        return None, f"the weight is split over {len(split)} mesh dims (one TP dim is supported)"
    i = split[0]
    if any(not p.is_replicate() and mesh.size(j) > 1 for j, p in enumerate(x.placements) if j != i):
        return None, "the input is split over a mesh dim besides the TP dim"
    return i, ""


def _seq_dim(value, i: int) -> Optional[int]:
    """d when ``value`` is Shard(d) on mesh dim ``i`` (d non-negative), else None."""
    p = value.placements[i]
    return p.dim % value.dim() if p.is_shard() else None


def async_tp_form(site: LinearSite, recipe) -> tuple[Optional[AsyncTp], Optional[fx.Node], Optional[fx.Node], str]:
    """(the site's form, the x node the lowering reads, the redistribute node it absorbs, the report's
    words) for a site whose operands are DTensors; (None, None, None, why not) otherwise."""
    x, w = value_of(site.x), value_of(site.weight)
    if not (is_dtensor(x) and is_dtensor(w)):
        return None, None, None, ""
    if site.weight_in_out or site.weight_first or site.expert is not None:
        return None, None, None, "async TP not applied: the weight is not read as linear's [N, K]"
    if not (recipe.float8_current_scaling() or recipe.delayed()):
        kind = "block-scaled recipes scale per block, and the pass fuses per-tensor _scaled_mm only" \
            if recipe.block_format is not None else \
            f"{recipe.name} (async TP is built for Float8CurrentScaling and DelayedScaling)"
        return None, None, None, f"async TP not applied: {kind}"
    i, why = _tp_dim(x, w)
    if i is None:
        return None, None, None, f"async TP not applied: {why}"
    wp = w.placements[i]
    if wp.is_shard() and wp.dim % 2 == 0:   # column parallel
        source, absorbed = site.x, None
        if _is_redistribute(site.x) and is_dtensor(value_of(site.x.args[0])) and x.placements[i].is_replicate():
            source = site.x.args[0]
        d = _seq_dim(value_of(source), i)
        if d is None:
            return None, None, None, "async TP not applied: the input is not sequence-sharded on the TP dim"
        if d == value_of(source).dim() - 1:
            return None, None, None, "async TP not applied: a last-dim gather (the pass fuses other dims only)"
        return AsyncTp("column", d, i), source, absorbed, f"async TP: FP8 all-gather of x along dim {d} into _scaled_mm"
    if not (wp.is_shard() and x.placements[i].is_shard() and x.placements[i].dim % x.dim() == x.dim() - 1):
        return None, None, None, "async TP not applied: neither column- nor row-parallel on the TP dim"
    users = list(site.node.users)
    if len(users) != 1 or not _is_redistribute(users[0]) or not is_dtensor(value_of(users[0])):
        return None, None, None, "async TP not applied: the row-parallel output is not redistributed to a shard"
    out = value_of(users[0])
    d = _seq_dim(out, i)
    if d is None or d == out.dim() - 1 or any(out.placements[j] != x.placements[j] for j in range(len(x.placements))
                                             if j != i):
        return None, None, None, "async TP not applied: the output is not redistributed to a sequence shard"
    return AsyncTp("row", d, i), site.x, users[0], f"async TP: _scaled_mm into a reduce-scatter along dim {d}"


def column_groups(planned: list) -> list[list[int]]:
    """Indices into ``planned`` (the linear pass's (site, lowering, extra, cached, x, absorbed) entries,
    in graph order) of the column-parallel async-TP sites to call together: two or more reading one x
    with equal specs apart from the module path. A site whose output another planned site reads
    directly stays alone (the pass replaces consumers before producers), as does a group whose
    weights or biases are computed after its first site."""
    order = {node: i for i, node in enumerate(planned[0][0].node.graph.nodes)} if planned else {}
    read = {entry[0].x for entry in planned} | {entry[4] for entry in planned}
    by_source: dict = {}
    for i, (site, lowering, _, _, x_node, _) in enumerate(planned):
        form = lowering.spec.async_tp
        # DelayedScaling quantizes x with each site's own input scale: no shared bytes to gather
        if form is None or form.kind != "column" or site.node in read or lowering.spec.recipe.delayed():
            continue
        key = (x_node, form, lowering.spec.recipe)
        by_source.setdefault(key, []).append(i)
    groups = []
    for members in by_source.values():
        first = min(order[planned[i][0].node] for i in members)
        operands = [n for i in members for n in (planned[i][0].weight, planned[i][0].bias) if n is not None]
        if len(members) > 1 and all(order.get(n, -1) < first for n in operands):
            groups.append(members)
    return groups
