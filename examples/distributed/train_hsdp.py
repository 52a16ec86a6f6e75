"""HSDP: replicate across groups of ranks, shard within them, with FP8 weight all-gathers.

    torchrun --nproc-per-node 4 examples/distributed/train_hsdp.py [--shard 2] [--recipe NAME] [--gather fp8|high]

``fully_shard`` on a ("dp_replicate", "dp_shard") mesh: each weight is sharded over dp_shard and
replicated over dp_replicate (past one node: shard within a node, replicate across nodes).
``te_compile.enable_fp8_all_gather`` makes the within-shard all-gathers carry FP8 bytes; the whole
weight's amax needs only the dp_shard ranks (the replicas hold the same values). Delayed scaling
reduces its amax histories over both data dims ("auto": every mesh dim), so every rank keeps the
same scales; rank 0 prints the amax groups, the all-gather bytes against fp32, and the state check.
CPU (gloo) or CUDA (nccl).
"""

import argparse

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import te_compile
from te_compile.models import gpt_small

from _common import count_all_gathers, finish, gather_in_fp8, print_amax_groups, setup, train

STEPS = 10
RECIPES = ("Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--shard", type=int, default=2, help="ranks per shard group (the world must divide by it)")
parser.add_argument("--recipe", choices=RECIPES, default="DelayedScaling")
parser.add_argument("--gather", choices=("fp8", "high"), default="fp8")
args = parser.parse_args()
OPTIONS = {"recipe": args.recipe, "overrides": [{"modules": "lm_head", "recipe": "none"}]}

rank, world, device = setup()
if world % args.shard:
    raise SystemExit(f"--shard {args.shard} does not divide the world size {world}")
mesh = init_device_mesh(device.type, (world // args.shard, args.shard), mesh_dim_names=("dp_replicate", "dp_shard"))
gathered = count_all_gathers()

torch.manual_seed(0)
model = gpt_small().to(device)
if args.gather == "fp8":
    gather_in_fp8(model, rank, OPTIONS)
for block in model.blocks:
    # the mesh is named for "auto" (and for amax_group = ["dp_replicate", "dp_shard"]): the graphs of a
    # model without DTensors cannot see it
    block.compile(backend=te_compile.backend(**OPTIONS, mesh=mesh))
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)

gen = torch.Generator().manual_seed(1000 + rank)           # every rank its own data
train(model, model, device, gen, rank, STEPS, mean_over_ranks=True)
if rank == 0:
    print_amax_groups()
    gathered.print(STEPS, world)
finish(model, rank)
