"""Amax reductions across ranks: which process groups, and the collective that goes into the graph.

Two kinds of reduction keep FP8 scales right when a model runs on several ranks:
- Delayed scaling keeps amax histories per weight. Each rank sees other data (DDP) or another shard
  (tensor parallel), so without a reduction the histories and scales drift apart. The amaxes a graph
  records are all-reduced with MAX over the *amax group* before they enter the histories: one
  coalesced all-reduce per graph and step (lowerings/delayed_state.py).
- Current scaling computes a tensor's scale from its own amax. For a tensor sharded across ranks
  (a row-parallel input, sequence-parallel activations, a sharded weight) the local amax is only
  part of it: the amax is all-reduced over the group the tensor is sharded on first, so each rank's
  FP8 bytes equal those of one process quantizing the whole tensor (lowerings/linear_paths/sharded.py).

The collective is a functional collective (``_c10d_functional.all_reduce`` + ``wait_tensor``): an
ordinary node in the traced graph that inductor can schedule and overlap, under either compiler.
Its autograd supports only sums, so amaxes are detached first (they never need a gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .recipe import GEMM_ROLES

__all__ = ["AmaxGroup", "NO_GROUPS", "resolve_amax_group", "mesh_dim_group", "minimal_groups", "merge_role_groups",
           "reduce_amaxes", "describe_groups", "describe_role_groups", "is_dtensor", "local_value",
           "expert_shard_groups", "describe_placements", "mesh_dims_group", "graph_mesh", "all_reduce",
           "resolve_context_parallel"]


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_value(t):
    """A DTensor's local shard (a fake one at compile time); anything else as it is."""
    return t._local_tensor if is_dtensor(t) else t


@dataclass(frozen=True)
class AmaxGroup:
    """A process group an amax is all-reduced over: its c10d name (what funcol takes) and, for the
    report and errors, a label ("world", a mesh dim name) and its size."""

    name: str
    label: str
    size: int
    ranks: tuple[int, ...]   # global ranks, to tell when one group covers another

    def __str__(self) -> str:
        return f"{self.label} ({self.size} ranks)"

    def covers(self, other: "AmaxGroup") -> bool:
        return set(other.ranks) <= set(self.ranks)


# Per role of a linear's GEMMs (GEMM_ROLES), no group: one process, or nothing to reduce.
NO_GROUPS: tuple[tuple[AmaxGroup, ...], ...] = ((), (), ())


def _group(pg, label: str) -> Optional[AmaxGroup]:
    import torch.distributed as dist

    if dist.get_rank(pg) < 0:
        raise ValueError(f"amax group {label!r}: this process (global rank {dist.get_rank()}) is not a "
                         f"member of it (ranks {dist.get_process_group_ranks(pg)}); every rank that runs "
                         f"the model must be in its amax group")
    size = dist.get_world_size(pg)
    if size == 1:
        return None   # a group of one needs no collective
    return AmaxGroup(pg.group_name, label, size, tuple(dist.get_process_group_ranks(pg)))


def mesh_dim_group(mesh, dim: int) -> Optional[AmaxGroup]:
    """The group of ``mesh``'s dimension ``dim`` (None when it holds one rank)."""
    names = mesh.mesh_dim_names
    label = names[dim] if names else (f"mesh dim {dim}" if mesh.ndim > 1 else "mesh")
    return _group(mesh.get_group(dim), label)


def mesh_dims_group(mesh, dims: Sequence[int]) -> tuple[AmaxGroup, ...]:
    """The group(s) spanning ``mesh``'s dims ``dims`` together: one group over their product (the
    flattened sub-mesh torch names "dp_shard_tp"), so that one MAX all-reduce covers every rank that
    holds part of a tensor split over those dims. A mesh without dim names cannot be flattened: one
    group per dim then (a max over each in turn is the same max, at one collective per dim)."""
    dims = [d for d in dims if mesh.size(d) > 1]
    if len(dims) <= 1:
        return minimal_groups(mesh_dim_group(mesh, d) for d in dims)
    names = mesh.mesh_dim_names
    if not names:
        return minimal_groups(mesh_dim_group(mesh, d) for d in dims)
    flat = mesh[tuple(names[d] for d in dims)]._flatten()
    # the label is ours: torch may hand back an equal flattened mesh made earlier under another name
    return minimal_groups([_group(flat.get_group(0), "_".join(names[d] for d in dims))])


def expert_shard_groups(weight, pipeline_dims: Sequence[str] = ()) -> tuple[AmaxGroup, ...]:
    """For a 3-D expert weight [E, ...] sharded as a DTensor, the group of the ranks that hold the same
    experts: every dim of its mesh's root mesh except the ones its expert-parallel dims (Shard(0))
    span and the pipeline dims. That takes in the weight's own replicated and tensor-parallel dims
    (Shard(1) / (2)) and the root's data-parallel dims the weight does not live on (the dp_mod_ep
    dim of torchtitan's dp2ep layout, whose ranks run FSDP2 over the same experts). A 1-D
    expert-parallel mesh gives none: each rank's experts are its own."""
    from torch.distributed.tensor import Shard

    mesh = weight.device_mesh
    root = mesh._get_root_mesh()
    spanned: set[int] = set()
    for d, p in enumerate(weight.placements):
        if isinstance(p, Shard) and p.dim == 0 and (group := mesh_dim_group(mesh, d)) is not None:
            coords = [tuple(int(c) for c in (root.mesh == r).nonzero()[0]) for r in group.ranks]
            spanned |= {i for i in range(root.ndim) if len({c[i] for c in coords}) > 1}
    names = root.mesh_dim_names or ()
    return mesh_dims_group(root, [d for d in range(root.ndim)
                                  if d not in spanned and not (names and names[d] in pipeline_dims)])


def describe_placements(t) -> str:
    """"Shard(dim=0) on ep (2 ranks)" for a DTensor, per mesh dim."""
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or [f"mesh dim {d}" for d in range(mesh.ndim)]
    return ", ".join(f"{p!r} on {n} ({mesh.size(d)} ranks)" for d, (p, n) in enumerate(zip(t.placements, names)))


def graph_mesh(values: Sequence) -> Any:
    """The root DeviceMesh of the first DTensor among ``values`` (a graph's example inputs: tensor
    parallel weights and activations), or None."""
    for v in values:
        if is_dtensor(v):
            return v.device_mesh._get_root_mesh()
    return None


def _single(groups: tuple[AmaxGroup, ...], what: str) -> Optional[AmaxGroup]:
    if len(groups) > 1:
        raise ValueError(f"amax_group: {what} has no dim names, so its dims cannot be joined into one "
                         f"group; name the mesh dims (init_device_mesh(..., mesh_dim_names=...))")
    return groups[0] if groups else None


def _named_dims_group(names: Sequence[str], mesh, pipeline_dims: Sequence[str]) -> Optional[AmaxGroup]:
    if mesh is None:
        raise ValueError(f"amax_group: names the mesh dims {list(names)}, but no DeviceMesh is known: pass it "
                         f"in the options (options={{'mesh': mesh}}), or the graph must read DTensors")
    root = mesh._get_root_mesh()
    known = root.mesh_dim_names or ()
    for name in names:
        if name in pipeline_dims:
            raise ValueError(f"amax_group: {name!r} is a pipeline dim (distributed.pipeline_dims = "
                             f"{list(pipeline_dims)}): each stage holds other weights and runs other graphs, "
                             f"so no amax is reduced across stages; name the data and tensor dims only")
        if name not in known:
            raise ValueError(f"amax_group: the mesh has no dim {name!r}; its dims are {list(known)} "
                             f"(shape {tuple(root.shape)})")
    if root.get_coordinate() is None:
        raise ValueError(f"amax_group: this process (global rank {_rank()}) is not in the mesh "
                         f"{root.mesh.tolist()}")
    return _single(mesh_dims_group(root, [known.index(n) for n in names]), "the mesh")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def resolve_amax_group(spec: Any, mesh: Any = None, pipeline_dims: Sequence[str] = ("pp",)) -> Optional[AmaxGroup]:
    """The amax group a config names, for this process; None when no collective is needed.

    spec: "auto" (every dim of ``mesh``'s root mesh but ``pipeline_dims``; the world when ``mesh`` is
    None), "world" (the default process group, when torch.distributed is initialized), "none", a
    tuple of mesh dim names (one group over their product), a ``ProcessGroup`` or a ``DeviceMesh``
    (all its dims). Raises ValueError for a group this rank is not in, a dim the mesh lacks and a
    pipeline dim.
    """
    import torch.distributed as dist

    if isinstance(spec, str) and spec == "none" or not dist.is_available() or not dist.is_initialized():
        return None
    if spec is dist.GroupMember.NON_GROUP_MEMBER:   # what dist.new_group returns on a non-member
        raise ValueError(f"amax_group: this process (global rank {dist.get_rank()}) is not a member of "
                         f"the group (dist.new_group returned NON_GROUP_MEMBER on this rank); every rank "
                         f"that runs the model must be in its amax group")
    if isinstance(spec, str) and spec == "auto":
        if mesh is None:
            return _group(dist.group.WORLD, "world")
        root = mesh._get_root_mesh()
        if not root.mesh_dim_names:
            return _single(mesh_dims_group(root, range(root.ndim)), "the mesh")
        names = [n for n in root.mesh_dim_names if n not in pipeline_dims]
        return _named_dims_group(names, root, pipeline_dims) if names else None
    if isinstance(spec, str) and spec == "world":
        return _group(dist.group.WORLD, "world")
    if isinstance(spec, (tuple, list)):
        return _named_dims_group(spec, mesh, pipeline_dims)
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(spec, DeviceMesh):
        if spec.get_coordinate() is None:
            raise ValueError(f"amax_group: this process (global rank {dist.get_rank()}) is not in the "
                             f"mesh {spec.mesh.tolist()}")
        if spec.ndim == 1:
            return mesh_dim_group(spec, 0)
        for name in spec.mesh_dim_names or ():
            if name in pipeline_dims:
                raise ValueError(f"amax_group: the mesh's dim {name!r} is a pipeline dim (distributed."
                                 f"pipeline_dims); no amax is reduced across stages: pass the mesh without it")
        return _single(mesh_dims_group(spec, range(spec.ndim)), f"the {spec.ndim}-D mesh")
    if isinstance(spec, dist.ProcessGroup):
        return _group(spec, f"group {spec.group_name}")
    raise ValueError(f"amax_group: expected 'auto', 'world', 'none', a list of mesh dim names, a ProcessGroup "
                     f"or a DeviceMesh, got {spec!r}")


def resolve_context_parallel(name: Optional[str], mesh: Any = None, pipeline_dims: Sequence[str] = ("pp",)
                             ) -> Optional[tuple[AmaxGroup, int]]:
    """(the group of the context-parallel mesh dim ``name``, this rank's index along it), or None when
    ``name`` is None or the dim holds one rank. Raises ValueError for a dim the mesh lacks, a pipeline
    dim, or no known mesh."""
    if name is None:
        return None
    if name in pipeline_dims:
        raise ValueError(f"context_parallel: {name!r} is a pipeline dim (distributed.pipeline_dims)")
    if mesh is None:
        raise ValueError(f"context_parallel: names the mesh dim {name!r}, but no DeviceMesh is known: pass it "
                         f"in the options (options={{'mesh': mesh}}), or the graph must read DTensors")
    root = mesh._get_root_mesh()
    known = root.mesh_dim_names or ()
    if name not in known:
        raise ValueError(f"context_parallel: the mesh has no dim {name!r}; its dims are {list(known)}")
    dim = known.index(name)
    group = mesh_dim_group(root, dim)
    return None if group is None else (group, root.get_coordinate()[dim])


def minimal_groups(groups) -> tuple[AmaxGroup, ...]:
    """``groups`` without None, duplicates and groups another one covers (a max over the world
    already includes the max over its tensor-parallel ranks); first come first kept."""
    kept: list[AmaxGroup] = []
    for group in dict.fromkeys(g for g in groups if g is not None):
        if any(k.covers(group) for k in kept):
            continue
        kept = [k for k in kept if not group.covers(k)] + [group]
    return tuple(kept)


def merge_role_groups(*per_role) -> tuple[tuple[AmaxGroup, ...], ...]:
    """Per role (GEMM_ROLES), the minimal union of the groups each argument (a per-role tuple) names."""
    return tuple(minimal_groups(g for groups in role for g in groups) for role in zip(*per_role))


def all_reduce(t: torch.Tensor, op: str, group: AmaxGroup) -> torch.Tensor:
    """``t`` (detached) reduced with ``op`` ("sum", "max") over ``group``: a functional collective and
    its wait, two nodes of the traced graph."""
    out = torch.ops._c10d_functional.all_reduce.default(t.detach(), op, group.name)
    return torch.ops._c10d_functional.wait_tensor.default(out)


def _all_reduce_max(t: torch.Tensor, group: AmaxGroup) -> torch.Tensor:
    # NaN -> inf first: MAX implementations may drop a NaN, and a non-finite amax on any rank must
    # read as non-finite on every rank (delayed scaling then keeps the scale everywhere alike).
    t = t.detach()
    return all_reduce(torch.where(torch.isnan(t), torch.full_like(t, float("inf")), t), "max", group)


def reduce_amaxes(amaxes: Sequence[torch.Tensor], groups: Sequence[Sequence[AmaxGroup]]
                  ) -> list[torch.Tensor]:
    """``amaxes[i]`` (fp32, any shape) all-reduced with MAX over every group in ``groups[i]``.

    One collective per distinct group, however many amaxes need it: they are packed into one buffer,
    reduced, and unpacked. Amaxes with no group are returned as they are.
    """
    out = list(amaxes)
    distinct = list(dict.fromkeys(g for gs in groups for g in gs))
    for group in distinct:
        members = [i for i, gs in enumerate(groups) if group in gs]
        flat = torch.cat([out[i].reshape(-1).float() for i in members])
        reduced = _all_reduce_max(flat, group)
        offset = 0
        for i in members:
            n = out[i].numel()
            out[i] = reduced[offset:offset + n].reshape(out[i].shape).to(out[i].dtype)
            offset += n
    return out


def describe_groups(groups: Sequence[AmaxGroup]) -> str:
    return ", ".join(str(g) for g in groups)


def describe_role_groups(per_role: Sequence[Sequence[AmaxGroup]]) -> str:
    """For the report: "amax all-reduce over tp (2 ranks): weight, grad_output", one clause per group."""
    by_group: dict[AmaxGroup, list[str]] = {}
    for role, groups in zip(GEMM_ROLES, per_role):
        for g in groups:
            by_group.setdefault(g, []).append(role)
    return "; ".join(f"amax all-reduce over {g}: {', '.join(roles)}" for g, roles in by_group.items())
