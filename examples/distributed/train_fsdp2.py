"""FSDP2 (fully_shard) with the weights of FP8 linears all-gathered as FP8.

    torchrun --nproc-per-node 2 examples/distributed/train_fsdp2.py [--gather fp8|high] [--bf16] [--recipe NAME]
                                                                     [--fp8-weights]

The torchtitan layout: each transformer block is compiled with the te backend and sharded with
fully_shard, then the root. ``te_compile.enable_fp8_all_gather`` (before fully_shard) makes each
block's FP8 linears gather their weights as FP8 bytes with the whole weight's current-scaling scale;
``--gather high`` skips it (FSDP2 gathers fp32 / bf16 and the graph quantizes after the gather).
Each rank trains on its own batches; rank 0 prints the mean loss and, at the end, the bytes this
rank contributed to all-gathers per step. ``--bf16``: MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32). Runs on CPU (gloo) and on CUDA (nccl, one GPU per rank).

``--fp8-weights``: FP8 primary weights instead (``te_compile.quantized_model_init``): the linears
hold only their quantized weight, sharded by fully_shard in its own format and gathered as such;
AdamW updates this rank's fp32 master rows, and ``cast_master_weights_to_fp8`` writes them into the
local shards after each step (one packed amax all-reduce for the per-tensor recipes; the block
formats' shards hold whole blocks and need none). Float8BlockScaling is refused there: gpt_small's
128-row weights cannot be cut into whole 128x128 tiles over several ranks.

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
from te_compile.tensor import QuantizedTensor
from te_compile.tensor.utils import cast_master_weights_to_fp8

from _common import finish, gather_in_fp8, setup, train

STEPS = 10
RECIPES = ("Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling", "Float8BlockScaling")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--gather", choices=("fp8", "high"), default="fp8")
parser.add_argument("--bf16", action="store_true", help="param_dtype=bf16, reduce_dtype=fp32")
parser.add_argument("--recipe", choices=RECIPES, default="Float8CurrentScaling",
                    help="block formats gather in their format where each rank's rows are whole blocks")
parser.add_argument("--fp8-weights", action="store_true",
                    help="FP8 primary weights (quantized_model_init) with fp32 master shards")
args = parser.parse_args()
if args.fp8_weights and args.gather == "high":
    parser.error("--fp8-weights gathers the FP8 weights themselves: it does not combine with --gather high")
if args.fp8_weights and args.recipe == "Float8BlockScaling":
    parser.error("--fp8-weights with Float8BlockScaling: gpt_small's 128-row weights cannot be sharded into "
                 "whole 128x128 tiles over several ranks")
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


class MasterShards:
    """fp32 master rows of this rank's shards of the FP8 primary weights (FSDP2 gives rank r rows
    [r * ceil(N / world), ...) of each weight), updated by AdamW and cast back after each step."""

    def __init__(self, model, init_values: dict) -> None:
        named = dict(model.named_parameters())
        self.weights = [named[name] for name in init_values]
        self.params = [p for name, p in named.items() if name not in init_values]
        self.masters, self.starts = [], []
        for name in list(init_values):
            hp = init_values.pop(name)   # the whole weight's initial values: only this rank's rows stay
            rows = -(-hp.shape[0] // world)
            self.masters.append(hp.chunk(world)[rank].reshape(-1).to(device, torch.float32).requires_grad_())
            self.starts.append(rank * rows * hp.shape[1])
        self.params += self.masters

    def take_grads(self) -> None:
        for weight, master in zip(self.weights, self.masters):
            master.grad = weight.grad.to_local().reshape(-1).float()
            weight.grad = None

    @torch.no_grad()
    def cast(self) -> None:
        cast_master_weights_to_fp8(self.weights, [m.detach() for m in self.masters], start_offsets=self.starts,
                                   amax_reduce_group=dist.group.WORLD,
                                   fsdp_shard_model_weights=[w.to_local() for w in self.weights])


torch.manual_seed(0)                                       # the same initial weights on every rank
recipe = getattr(te_compile.recipe, args.recipe)()
with torch.device(device), te_compile.quantized_model_init(enabled=args.fp8_weights, recipe=recipe,
                                                           preserve_high_precision_init_val=True):
    model = gpt_small()
if args.fp8_weights:
    # lm_head runs eagerly in high precision (OPTIONS): give it back its high-precision weight
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.get_high_precision_init_val().to(device))
init_values = {name: p.get_high_precision_init_val() for name, p in model.named_parameters()
               if isinstance(p, QuantizedTensor)}
if rank == 0 and args.fp8_weights:
    kinds = sorted({type(p).__name__ for p in model.parameters() if isinstance(p, QuantizedTensor)})
    print(f"FP8 primary weights: {len(init_values)} linear weights held as {', '.join(kinds)}")
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
    else MixedPrecisionPolicy()
if args.gather == "fp8" and not args.fp8_weights:
    # once for the whole model: one amax all-reduce per step serves every block's weights
    gather_in_fp8(model, rank, OPTIONS)
for block in model.blocks:
    block.compile(backend=te_compile.backend(**OPTIONS))   # sites keep their model names (blocks.0...)
    fully_shard(block, mp_policy=policy)
fully_shard(model, mp_policy=policy)

gen = torch.Generator().manual_seed(1000 + rank)          # each rank its own data
train(model, model, device, gen, rank, STEPS, mean_over_ranks=True,
      masters=MasterShards(model, init_values) if args.fp8_weights else None)

per_step = sum(gathered_bytes) / STEPS
if rank == 0:
    dtype = "bf16" if args.bf16 else "fp32"
    what = "FP8 primary" if args.fp8_weights else args.gather
    print(f"all-gather ({what} weights, param_dtype {dtype}): {per_step / 2**20:.3f} MiB per step "
          f"from each of {world} ranks ({len(gathered_bytes) // STEPS} all-gathers per step)")
    if args.gather == "fp8" and not args.fp8_weights:
        print(f"weight amax all-reduces: {model._te_fp8_all_gather.refreshes} in {STEPS} steps "
              f"(block formats need none)")
dist.all_gather_single = _all_gather_single
finish(model, rank)
