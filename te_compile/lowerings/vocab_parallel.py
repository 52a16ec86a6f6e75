"""The fused output layer and loss on a vocab-sharded output layer (tensor parallel, ``loss_parallel``).

``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` on the output layer shards its
weight by rows, w [V, K] Shard(0) over the tensor-parallel mesh dim, so each of R ranks computes the
logits of its slice of the vocabulary, and ``loss_parallel()`` lets ``cross_entropy`` read them as a
Shard(-1) DTensor. The fused op (linear_cross_entropy.py) splits the work the same way but never
makes the logits: each rank walks its chunks of [c, V / R] logits and keeps, per token, its shard's
logsumexp, the target logit (0 where the label lies in another shard) and, under label smoothing, its
logits' sum. Two all-reduces of [tokens]-sized values then give every rank the whole rows' values:

    m = max_r lse_r                                         (MAX, [M])
    lse = m + log(sum_r exp(lse_r - m)),  target, sum(z)    (SUM, one [3, M] buffer)

When a backward will follow, the forward computes each chunk's gradient while its logits are at
hand, so it combines each chunk's values as the chunk is done ([c]-sized all-reduces, the same
values row for row). The gradient needs no collective of its own: a rank's dz [c, V / R] is its
shard's columns of the whole dz (softmax over the global lse; the one-hot only where the label falls
in the shard), so dw and db are its shard's rows, and dx = dz @ w_shard is a partial sum that the
input's DTensor reduces (the input's gradient is Partial(sum) over the vocab dim, as for any
column-parallel linear).

FP8 (per-tensor recipes): x is replicated, so every rank finds the same amax; the weight's amax is
all-reduced (MAX) over the vocab dim, as for every column-parallel linear, so the shards hold one
process's bytes; dz's scale comes from the bound |dz| <= dloss, the same on every rank (the valid-
token count comes from the labels, which every rank holds). Delayed scaling records local amaxes, reduced by the graph's one update
(the output layer's weight is registered with the vocab dim's group by the linear pass).

Supported placements: x Replicate on every mesh dim; w Shard(vocab) on one mesh dim, Replicate on
the others; the bias like w; the labels a plain tensor or a Replicate DTensor (what ``loss_parallel``
takes on a one-dimensional mesh). Anything else raises ValueError with the placements found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..distributed import AmaxGroup, all_reduce, describe_placements, is_dtensor, mesh_dim_group

__all__ = ["VocabShard", "VocabParallelPlan", "plan_vocab_parallel", "combine_row_stats"]


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary: ids [offset, offset + local) of ``vocab``."""

    group: AmaxGroup   # the mesh dim that shards the vocab (every collective of the op runs over it)
    offset: int
    local: int
    vocab: int


@dataclass(frozen=True)
class VocabParallelPlan:
    """How the op runs on DTensor operands: the mesh, the vocab dim, this rank's shard."""

    mesh: object       # DeviceMesh
    dim: int           # the mesh dim sharding the vocab
    shard: VocabShard

    def local_operands(self, x, w_nk, bias, labels):
        """The local shards, with the gradient placements their backward hands back: dx is a partial
        sum over the vocab dim, dw and db are the shard's rows."""
        from torch.distributed.tensor import Partial, Replicate

        x_grad = tuple(Partial("sum") if d == self.dim else Replicate() for d in range(self.mesh.ndim))
        x = x.to_local(grad_placements=x_grad)
        w_nk = w_nk.to_local(grad_placements=w_nk.placements)
        if bias is not None and is_dtensor(bias):
            bias = bias.to_local(grad_placements=bias.placements)
        if is_dtensor(labels):
            labels = labels.to_local()
        return x, w_nk, bias, labels

    def wrap(self, loss: torch.Tensor, logits: Optional[torch.Tensor], logits_shape):
        """The loss as a Replicate DTensor (what ``loss_parallel``'s cross_entropy returns) and the
        logits, when returned, as the output layer's Shard(-1) DTensor of ``logits_shape``."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        replicate = tuple(Replicate() for _ in range(self.mesh.ndim))
        loss = DTensor.from_local(loss, self.mesh, replicate, run_check=False)
        if logits is not None:
            placements = tuple(Shard(len(logits_shape) - 1) if d == self.dim else Replicate()
                               for d in range(self.mesh.ndim))
            shape = torch.Size(logits_shape)
            logits = DTensor.from_local(logits, self.mesh, placements, run_check=False, shape=shape,
                                        stride=torch.empty(shape, device="meta").stride())
        return loss, logits


def plan_vocab_parallel(x, w_nk, bias=None, labels=None, *, w_in_out: bool = False) -> VocabParallelPlan:
    """The plan for the fused op on ``x [..., K]`` and ``w_nk`` ([V, K]; [K, V] with ``w_in_out``, the
    layer's own weight before it is transposed), real or fake DTensors. Raises ValueError naming the
    placements when they are not the vocab-parallel ones (module docstring)."""
    if not (is_dtensor(x) and is_dtensor(w_nk)):
        which = "input" if not is_dtensor(x) else "weight"
        raise ValueError(f"the output layer's {which} is a plain tensor and the other a DTensor")
    mesh = w_nk.device_mesh
    if x.device_mesh != mesh:
        raise ValueError(f"the output layer's input lives on mesh {x.device_mesh} and its weight on {mesh}")
    vocab_dim = 1 if w_in_out else 0
    dims = [d for d, p in enumerate(w_nk.placements) if p.is_shard() and p.dim % 2 == vocab_dim]
    others = [d for d, p in enumerate(w_nk.placements) if d not in dims and not p.is_replicate()]
    if len(dims) != 1 or others:
        raise ValueError(f"the output layer's weight is placed {describe_placements(w_nk)}; the fused loss "
                         f"takes a weight sharded by vocab on one mesh dim and replicated on the others "
                         f"(ColwiseParallel)")
    if not all(p.is_replicate() for p in x.placements):
        raise ValueError(f"the output layer's input is placed {describe_placements(x)}; the fused loss "
                         f"takes a replicated input (ColwiseParallel's input layout)")
    from torch.distributed.tensor import Replicate, Shard

    dim = dims[0]
    rows = tuple(Shard(0) if d == dim else Replicate() for d in range(mesh.ndim))
    if bias is not None and (not is_dtensor(bias) or tuple(bias.placements) != rows):
        raise ValueError(f"the output layer's bias is placed "
                         f"{describe_placements(bias) if is_dtensor(bias) else 'as a plain tensor'}; the fused "
                         f"loss takes a bias sharded like the weight's vocab rows")
    if is_dtensor(labels) and not all(p.is_replicate() for p in labels.placements):
        raise ValueError(f"the labels are placed {describe_placements(labels)}; the fused loss takes "
                         f"replicated labels (a plain tensor or a Replicate DTensor)")
    vocab, ranks = w_nk.shape[vocab_dim], mesh.size(dim)
    full = -(-vocab // ranks)   # DTensor's Shard: torch.chunk's split, the last shards shorter
    coordinate = mesh.get_coordinate()
    offset = min(vocab, coordinate[dim] * full) if coordinate is not None else 0
    group = mesh_dim_group(mesh, dim)
    if group is None:   # pragma: no cover - a one-rank dim shards nothing
        raise ValueError("the output layer's weight is sharded over a mesh dim of one rank")
    return VocabParallelPlan(mesh, dim, VocabShard(group, offset, min(vocab, offset + full) - offset, vocab))


def combine_row_stats(lse: torch.Tensor, target: torch.Tensor, zsum: Optional[torch.Tensor], shard: VocabShard):
    """Each rank's per-token values over its shard (fp32 [M]: logsumexp, target logit or 0, logit sum
    or None) -> the whole rows' values, equal on every rank (module docstring)."""
    m = all_reduce(lse, "max", shard.group)
    parts = [torch.exp(lse - m), target] + ([zsum] if zsum is not None else [])
    total = all_reduce(torch.stack(parts), "sum", shard.group)
    return m + torch.log(total[0]), total[1], (total[2] if zsum is not None else None)
