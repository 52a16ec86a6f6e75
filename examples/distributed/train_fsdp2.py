"""FSDP2 (fully_shard) with the weights of FP8 linears all-gathered as FP8.

    torchrun --nproc-per-node 2 examples/distributed/train_fsdp2.py [--gather fp8|high] [--bf16] [--recipe NAME]

The torchtitan layout: each transformer block is compiled with the te backend and sharded with
fully_shard, then the root. ``te_compile.enable_fp8_all_gather`` (before fully_shard) makes each
block's FP8 linears gather their weights as FP8 bytes with the whole weight's current-scaling scale;
``--gather high`` skips it (FSDP2 gathers fp32 / bf16 and the graph quantizes after the gather).
Each rank trains on its own batches; rank 0 prints the mean loss and, at the end, the bytes this
rank contributed to all-gathers per step. ``--bf16``: MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32). Runs on CPU (gloo) and on CUDA (nccl, one GPU per rank).

Dynamo cannot compile the root's forward under per-block fully_shard (FSDP2's hooks break the graph
inside its loop over the blocks), so the embeddings, the final norm and lm_head run eagerly in high
precision, as in torchtitan; the config's override keeps lm_head out of the FP8 all-gather.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import te_compile
from te_compile.models import gpt_small

from _common import finish, setup, train

STEPS = 10
RECIPES = ("Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling", "Float8BlockScaling")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--gather", choices=("fp8", "high"), default="fp8")
parser.add_argument("--bf16", action="store_true", help="param_dtype=bf16, reduce_dtype=fp32")
parser.add_argument("--recipe", choices=RECIPES, default="Float8CurrentScaling",
                    help="block formats gather in their format where each rank's rows are whole blocks")
args = parser.parse_args()
# lm_head runs eagerly in the root (below): keep it, and its all-gather, in high precision
OPTIONS = {"recipe": args.recipe, "overrides": [{"modules": "lm_head", "recipe": "none"}]}

rank, world, device = setup()

# Count what this rank hands to FSDP2's all-gathers (its shard of every gathered parameter).
gathered_bytes = []
_all_gather_single = dist.all_gather_single


def _counting_all_gather(output, input, *a, **kw):
    gathered_bytes.append(input.numel() * input.element_size())
    return _all_gather_single(output, input, *a, **kw)


dist.all_gather_single = _counting_all_gather

torch.manual_seed(0)                                       # the same initial weights on every rank
model = gpt_small().to(device)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
    else MixedPrecisionPolicy()
if args.gather == "fp8":
    # once for the whole model: one amax all-reduce per step serves every block's weights
    outcome = te_compile.enable_fp8_all_gather(model, **OPTIONS)
    if rank == 0:
        fp8 = [fqn for fqn, what in outcome.items() if what == "FP8 all-gather"]
        print(f"FP8 all-gather: {len(fp8)} linears; " + "; ".join(
            f"{fqn}: {what}" for fqn, what in outcome.items() if fqn not in fp8))
for block in model.blocks:
    block.compile(backend=te_compile.backend(**OPTIONS))   # sites keep their model names (blocks.0...)
    fully_shard(block, mp_policy=policy)
fully_shard(model, mp_policy=policy)

gen = torch.Generator().manual_seed(1000 + rank)          # each rank its own data
train(model, model, device, gen, rank, STEPS, mean_over_ranks=True)

per_step = sum(gathered_bytes) / STEPS
if rank == 0:
    dtype = "bf16" if args.bf16 else "fp32"
    print(f"all-gather ({args.gather} weights, param_dtype {dtype}): {per_step / 2**20:.3f} MiB per step "
          f"from each of {world} ranks ({len(gathered_bytes) // STEPS} all-gathers per step)")
    if args.gather == "fp8":
        print(f"weight amax all-reduces: {model._te_fp8_all_gather.refreshes} in {STEPS} steps "
              f"(block formats need none)")
dist.all_gather_single = _all_gather_single
finish(model, rank)
