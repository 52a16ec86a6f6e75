"""Splitting a batch along its sequence for context parallelism, and putting it back together.

te's context-parallel FP8 attention (``[distributed] context_parallel``) expects each rank to hold the
load-balanced causal slice of the sequence that torch's ``context_parallel`` gives it: with R ranks the
sequence is cut into 2R equal chunks and rank r holds chunks r and 2R - 1 - r, so that every rank
does the same causal work (an early chunk has few keys to attend to, its partner late chunk many).

    positions = load_balanced_positions(seq_len, rank, R)                # [seq_len / R]
    idx, labels, pos = context_parallel_shard(cp_mesh, [idx, labels, pos], seq_dims=[1, 1, 0])
    logits = model(idx, pos)                                             # [B, seq_len / R, V]
    [full] = context_parallel_unshard(cp_mesh, [logits], seq_dims=[1])   # [B, seq_len, V], global order

The names and arguments follow torch's ``context_parallel_unshard(mesh, buffers, seq_dims)``, so code
written for torch's context parallelism reads the same. Positions stay global: a model that adds
position embeddings or rotations must be handed the positions of its rows (shard ``torch.arange``).
Both functions run eagerly, outside the compiled model; the unshard is an all-gather with no autograd.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["load_balanced_positions", "context_parallel_shard", "context_parallel_unshard"]


def load_balanced_positions(seq_len: int, rank: int, ranks: int) -> torch.Tensor:
    """The global positions (int64 [seq_len / ranks]) that rank ``rank`` of ``ranks`` holds under the
    load-balanced causal split: chunks ``rank`` and ``2 * ranks - 1 - rank`` of ``2 * ranks`` equal
    chunks (``seq_len`` divisible by ``2 * ranks``)."""
    if ranks < 1 or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} of {ranks} ranks: expected 0 <= rank < ranks")
    if seq_len % (2 * ranks):
        raise ValueError(f"sequence length {seq_len} must split into 2 x {ranks} equal chunks "
                         f"(a multiple of {2 * ranks})")
    chunk = seq_len // (2 * ranks)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * ranks - 1 - rank) * chunk, (2 * ranks - rank) * chunk)])


Group = Union[DeviceMesh, dist.ProcessGroup]


def _rank_and_size(mesh: Group) -> tuple[int, int, dist.ProcessGroup]:
    """(this rank within the group, group size, process group) of a 1-D mesh or a process group."""
    if isinstance(mesh, dist.ProcessGroup):
        group = mesh
    else:
        if mesh.ndim != 1:
            raise ValueError(f"context parallelism takes a 1-D mesh (e.g. mesh['cp']), got {mesh.ndim} dims "
                             f"{mesh.mesh_dim_names}")
        group = mesh.get_group()
    return dist.get_rank(group), dist.get_world_size(group), group


def _checked(buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], what: str) -> list[int]:
    """``seq_dims`` normalised to non-negative dims, one per buffer."""
    if len(buffers) != len(seq_dims):
        raise ValueError(f"{what}: {len(buffers)} buffers but {len(seq_dims)} seq_dims; give one dim per buffer")
    dims = []
    for i, (buffer, dim) in enumerate(zip(buffers, seq_dims)):
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"{what}: buffers[{i}] is a {type(buffer).__name__}, expected a tensor")
        if not -buffer.dim() <= dim < buffer.dim():
            raise ValueError(f"{what}: seq_dims[{i}] = {dim} is out of range for buffers[{i}] of shape "
                             f"{tuple(buffer.shape)}")
        dims.append(dim % buffer.dim())
    return dims


def context_parallel_shard(mesh: Group, buffers: Sequence[torch.Tensor],
                           seq_dims: Sequence[int]) -> list[torch.Tensor]:
    """This rank's load-balanced slice of each buffer along its sequence dim (new contiguous
    tensors; the buffers are not changed). Every rank passes the same full buffers. ``mesh``: the
    context-parallel ranks, a 1-D DeviceMesh or a ProcessGroup."""
    rank, ranks, _ = _rank_and_size(mesh)
    out = []
    for i, (buffer, dim) in enumerate(zip(buffers, _checked(buffers, seq_dims, "context_parallel_shard"))):
        seq_len = buffer.shape[dim]
        if seq_len % (2 * ranks):
            raise ValueError(f"context_parallel_shard: buffers[{i}] has {seq_len} positions along dim {dim}; "
                             f"{ranks} ranks need a multiple of {2 * ranks}")
        positions = load_balanced_positions(seq_len, rank, ranks).to(buffer.device)
        out.append(buffer.index_select(dim, positions))
    return out


def context_parallel_unshard(mesh: Group, buffers: Sequence[torch.Tensor],
                             seq_dims: Sequence[int]) -> list[torch.Tensor]:
    """``context_parallel_shard``'s inverse: every rank's slices all-gathered along the sequence dim and
    put back in global order, so each rank gets the whole buffer (no autograd)."""
    _, ranks, group = _rank_and_size(mesh)
    out = []
    for buffer, dim in zip(buffers, _checked(buffers, seq_dims, "context_parallel_unshard")):
        local = buffer.detach().movedim(dim, 0).contiguous()   # [t, ...]
        # gloo moves no float8: the bytes travel as uint8 and are viewed back after
        wire = local.view(torch.uint8) if local.dtype.itemsize == 1 and local.is_floating_point() else local
        gathered = wire.new_empty((ranks * wire.shape[0], *wire.shape[1:]))
        dist.all_gather_single(gathered, wire, group=group)
        gathered = gathered.view(local.dtype)   # [R * t, ...], the ranks' rows in rank order
        seq_len = gathered.shape[0]
        order = torch.cat([load_balanced_positions(seq_len, r, ranks) for r in range(ranks)]).to(buffer.device)
        full = torch.empty_like(gathered)
        full[order] = gathered
        out.append(full.movedim(0, dim).contiguous())
    return out
