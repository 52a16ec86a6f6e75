"""Data-parallel FP8 training with DelayedScaling: every rank keeps the same scales.

    torchrun --nproc-per-node 2 examples/distributed/train_ddp.py [config.toml]

Each rank trains on its own batches; DDP averages the gradients, and the te backend all-reduces the
amaxes each compiled graph records (MAX over the world, one collective per graph and step, inside
the graph) so the amax histories and scales stay identical on every rank. Default config:
examples/delayed_scaling.toml. Runs on CPU (gloo) and on CUDA (nccl, one GPU per rank).
"""

import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import te_compile
from te_compile.models import gpt_small

from _common import finish, setup, train

STEPS = 20

rank, _, device = setup()
config = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parents[1] / "delayed_scaling.toml")
torch.manual_seed(0)                                       # the same initial weights on every rank
model = gpt_small().to(device)
compiled = torch.compile(DDP(model), backend=te_compile.backend(config=config))
gen = torch.Generator().manual_seed(1000 + rank)          # each rank its own data
train(compiled, model, device, gen, rank, STEPS, mean_over_ranks=True)
finish(model, rank)
