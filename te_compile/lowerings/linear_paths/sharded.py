"""Linear sites on DTensor operands (tensor and sequence parallelism), run shard by shard.

``parallelize_module`` makes weights DTensors (ColwiseParallel: w [N, K] Shard(0); RowwiseParallel:
w Shard(1), its input Shard(-1); SequenceParallel: activations Shard(1) between blocks). Letting
DTensor dispatch every op of the FP8 lowering would work for some (current scaling: DTensor turns
the max of a sharded tensor into a pending max across ranks) and break others (state tensors and
block scales are plain tensors: "got mixed torch.Tensor and DTensor"). So the lowering unwraps the
operands, runs the one-process code on the local shards and wraps the result, with a placement
plan per mesh dim like DTensor's own rule for mm:

    x          w [N, K]     y                 amax all-reduced over this mesh dim for
    Replicate  Replicate    Replicate         -
    Replicate  Shard(0)     Shard(-1)         weight, grad_output        (column parallel; dx partial)
    Shard(-1)  Shard(1)     Partial(sum)      input, weight              (row parallel)
    Shard(d)   Replicate    Shard(d), d < -1  input, grad_output         (rows: sequence / batch; dw partial)

Any other pair first redistributes x, then w, to Replicate (as DTensor would); Partial operands
become Replicate. Current scaling all-reduces the amax of every sharded operand over its mesh dim
(one collective per direction and group, x and w packed together), so each shard is quantized
with the scale one process would compute for the whole tensor and the FP8 bytes are the same.
Block recipes (MXFP8, Float8 block) scale each block from its own values: no collective; NVFP4's
tensor-level amax is reduced like current scaling's. Delayed scaling records local amaxes, and the
graph's one update reduces them (lowerings/delayed_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...distributed import AmaxGroup, is_dtensor, merge_role_groups, mesh_dim_group, minimal_groups

__all__ = ["LinearSharding", "plan_linear_sharding", "sharded_linear"]


@dataclass(frozen=True)
class LinearSharding:
    """How a linear on DTensors runs: operand placements, output placements, amax groups."""

    mesh: object                   # DeviceMesh
    x_placements: tuple            # x is redistributed to these first (usually its own)
    w_placements: tuple
    y_placements: tuple
    y_grad_placements: tuple       # Partial outputs take a Replicate gradient
    # the local gradients are partial sums where the other operand is split along the output:
    # dx = g @ w sums over N (column parallel), dw = g.T @ x over the rows (row-sharded x)
    x_grad_placements: tuple
    w_grad_placements: tuple
    groups: tuple[tuple[AmaxGroup, ...], ...]   # per role: input, weight, grad_output


def _x_kind(p, x_ndim: int) -> str:
    if not p.is_shard():
        return "R"
    return "K" if p.dim % x_ndim == x_ndim - 1 else "M"


def _w_kind(p, in_out: bool) -> str:
    if not p.is_shard():
        return "R"
    return "N" if p.dim % 2 == (1 if in_out else 0) else "K"


def plan_linear_sharding(x, w_nk, where: str, w_in_out: bool = False) -> Optional[LinearSharding]:
    """The plan for ``x [..., K] @ w_nk.T`` when either is a DTensor (None when neither is).

    Works on real and on fake DTensors (the passes call it on Dynamo's example values, with
    ``w_in_out`` when the weight is stored [K, N] and the call transposes it). Raises ValueError when
    only one operand is a DTensor or the two live on different meshes.
    """
    x_d, w_d = is_dtensor(x), is_dtensor(w_nk)
    if not (x_d or w_d):
        return None
    if x_d != w_d:
        plain = "weight" if x_d else "input"
        raise ValueError(f"{where}: the input is {'a DTensor' if x_d else 'a plain tensor'} and the weight "
                         f"{'a DTensor' if w_d else 'a plain tensor'}; DTensor cannot mix them (make the "
                         f"{plain} a DTensor, e.g. with parallelize_module's input layouts)")
    mesh = w_nk.device_mesh
    if x.device_mesh != mesh:
        raise ValueError(f"{where}: the input lives on mesh {x.device_mesh} and the weight on mesh "
                         f"{mesh}; a linear needs both on one mesh")
    from torch.distributed.tensor import Partial, Replicate, Shard

    table = {("R", "R"): "R", ("R", "N"): "N", ("K", "K"): "P", ("M", "R"): "M"}
    xs, ws, ys, gs, dxs, dws = [], [], [], [], [], []
    groups: tuple[list, list, list] = ([], [], [])
    y_ndim = x.dim()
    for i, (px, pw) in enumerate(zip(x.placements, w_nk.placements)):
        px = Replicate() if px.is_partial() else px
        pw = Replicate() if pw.is_partial() else pw
        if (_x_kind(px, x.dim()), _w_kind(pw, w_in_out)) not in table:
            px = Replicate()
        if (_x_kind(px, x.dim()), _w_kind(pw, w_in_out)) not in table:
            pw = Replicate()
        kx, kw = _x_kind(px, x.dim()), _w_kind(pw, w_in_out)
        out = table[(kx, kw)]
        if out == "R":
            py = Replicate()
        elif out == "N":
            py = Shard(y_ndim - 1)
        elif out == "P":
            py = Partial("sum")
        else:
            py = Shard(px.dim % x.dim())
        group = mesh_dim_group(mesh, i) if mesh.size(i) > 1 else None
        if group is not None:
            if kx != "R":
                groups[0].append(group)
            if kw != "R":
                groups[1].append(group)
            if py.is_shard():
                groups[2].append(group)
        xs.append(px)
        ws.append(pw)
        ys.append(py)
        gs.append(Replicate() if py.is_partial() else py)
        dxs.append(Partial("sum") if out == "N" else px)
        dws.append(Partial("sum") if out == "M" else pw)
    return LinearSharding(mesh, tuple(xs), tuple(ws), tuple(ys), tuple(gs), tuple(dxs), tuple(dws),
                          tuple(minimal_groups(g) for g in groups))


def sharded_linear(local_fn: Callable, x, w_nk, plan: LinearSharding, extra_groups=((), (), ())):
    """``local_fn(x_local, w_local, groups) -> y_local`` on the shards of ``x`` and ``w_nk``, wrapped
    back as a DTensor [..., N] placed as ``plan`` says. ``extra_groups`` (per role) join the plan's."""
    from torch.distributed.tensor import DTensor

    if tuple(x.placements) != plan.x_placements:
        x = x.redistribute(plan.mesh, plan.x_placements)
    if tuple(w_nk.placements) != plan.w_placements:
        w_nk = w_nk.redistribute(plan.mesh, plan.w_placements)
    groups = merge_role_groups(plan.groups, extra_groups)
    y_local = local_fn(x.to_local(grad_placements=plan.x_grad_placements),
                       w_nk.to_local(grad_placements=plan.w_grad_placements), groups)
    shape = torch.Size((*x.shape[:-1], w_nk.shape[0]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(y_local, plan.mesh, plan.y_placements, run_check=False, shape=shape,
                              stride=stride, grad_placements=plan.y_grad_placements)
