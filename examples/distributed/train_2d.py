"""FSDP2 + tensor parallel on a 2-D mesh, with FP8 weights on the wire and one amax story.

    torchrun --nproc-per-node 4 examples/distributed/train_2d.py [--tp 2] [--recipe NAME] [--gather fp8|high]

torchtitan's layout: a ("dp_shard", "tp") mesh; each block's MLP is split column- then row-wise over
tp (``parallelize_module``), then each block is compiled with the te backend and sharded with
``fully_shard`` on dp_shard, then the root. ``te_compile.enable_fp8_all_gather`` (before fully_shard)
makes FSDP2 gather the TP shards of the FP8 linears' weights as FP8 bytes, cast with the scale of
the *whole* weight: its amax is all-reduced over dp_shard x tp, once per step for every weight.
Inside the compiled blocks current scaling reduces the amaxes of TP-sharded activations over tp, and
delayed scaling reduces its histories over every mesh dim ("auto"), once per graph and step.

At the end rank 0 prints which group every amax is reduced over (the report's collectives column,
tallied), the bytes this rank handed to FSDP2's all-gathers per step against what high precision
would move, and checks that all ranks keep the same recipe state. CPU (gloo) or CUDA (nccl).
"""

import argparse

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import te_compile
from te_compile.models import gpt_small

from _common import count_all_gathers, finish, gather_in_fp8, print_amax_groups, setup, train

STEPS = 10
RECIPES = ("Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel degree (the world must divide by it)")
parser.add_argument("--recipe", choices=RECIPES, default="Float8CurrentScaling")
parser.add_argument("--gather", choices=("fp8", "high"), default="fp8")
args = parser.parse_args()
# lm_head runs eagerly in the root (Dynamo breaks the root's graph at FSDP2's per-block hooks)
OPTIONS = {"recipe": args.recipe, "overrides": [{"modules": "lm_head", "recipe": "none"}]}

rank, world, device = setup()
if world % args.tp:
    raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp_shard", "tp"))
gathered = count_all_gathers()

torch.manual_seed(0)                                       # the same initial weights on every rank
model = gpt_small().to(device)
for block in model.blocks:
    parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
if args.gather == "fp8":
    gather_in_fp8(model, rank, OPTIONS)
for block in model.blocks:
    block.compile(backend=te_compile.backend(**OPTIONS))
    fully_shard(block, mesh=mesh["dp_shard"])
fully_shard(model, mesh=mesh["dp_shard"])

# data parallel over dp_shard: the two tp ranks of a dp group read the same batches
gen = torch.Generator().manual_seed(1000 + mesh["dp_shard"].get_local_rank())
train(model, model, device, gen, rank, STEPS, mean_over_ranks=True)
if rank == 0:
    print_amax_groups()
    gathered.print(STEPS, world)
    if args.gather == "fp8":
        print(f"whole-weight amax all-reduces for the FP8 all-gather: {model._te_fp8_all_gather.refreshes} "
              f"refreshes in {STEPS} steps")
finish(model, rank)
