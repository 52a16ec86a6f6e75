"""Tensor-parallel FP8 training: each MLP split column- then row-wise over the ranks, and the output
layer split over the vocabulary with its loss computed in parallel.

    torchrun --nproc-per-node 2 examples/distributed/train_tp.py [config.toml]

``parallelize_module`` makes each block's ``mlp.fc`` weight a DTensor sharded by rows
(ColwiseParallel) and ``mlp.proj`` one sharded by columns (RowwiseParallel); the model code is
unchanged. The te backend quantizes the shards with the scale one process would compute for the
whole tensor: current scaling all-reduces the amax of every sharded operand over the tp mesh (the
report's "collectives" column says which), and delayed scaling reduces its histories once per graph
and step. ``lm_head`` is sharded by vocab and the loss runs under ``loss_parallel()``: te fuses the
two into one op whose ranks all-reduce three numbers per token, never the logits (the report's
linear_cross_entropy row). Default config: examples/current_scaling.toml. CPU (gloo) or CUDA (nccl,
a GPU per rank).
"""

import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

import te_compile
from te_compile.models import gpt_small

from _common import finish, setup, train

STEPS = 20

rank, world, device = setup()
config = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parents[1] / "current_scaling.toml")
mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
torch.manual_seed(0)
model = gpt_small().to(device)
for block in model.blocks:
    parallelize_module(block.mlp, mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
# the logits stay split by vocab (a Shard(-1) DTensor) for the loss
parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
compiled = torch.compile(model, backend=te_compile.backend(config=config))
gen = torch.Generator().manual_seed(1000)                  # tensor parallel: every rank the same batch
with loss_parallel():
    train(compiled, model, device, gen, rank, STEPS, mean_over_ranks=False)
finish(model, rank)
