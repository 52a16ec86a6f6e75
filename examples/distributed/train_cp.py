"""Context-parallel FP8 training: every sequence split over the ranks, attention in FP8 across them.

    torchrun --nproc-per-node 2 examples/distributed/train_cp.py [config.toml]

Each rank holds the load-balanced causal slice of every sequence (rank r of R: chunks r and 2R-1-r of
2R), cut by ``te_compile.context_parallel_shard`` together with the targets and the global positions
the model's position embedding reads. ``[distributed] context_parallel = "cp"`` (set here over the
config's recipe) makes every causal SDPA call te's context-parallel FP8 attention: the ranks' K and V
are all-gathered as E4M3 bytes (half of bf16's), and dK, dV are reduce-scattered back in the backward.
The ranks see different tokens of the same sequences, so their gradients are averaged, as data
parallelism averages them. At the end, rank 0 puts one evaluation batch's logits back in order
(``context_parallel_unshard``) and compares them with the same model run on whole sequences.
Default config: examples/fp8_attention.toml. CPU (gloo) or CUDA (nccl, a GPU per rank).
"""

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import te_compile
from te_compile.data import get_batch
from te_compile.models import gpt_small

from _common import finish, setup

STEPS = 20

rank, world, device = setup()
config = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parents[1] / "fp8_attention.toml")
mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
torch.manual_seed(0)
model = gpt_small().to(device)
loaded = te_compile.load_config(config)   # the file's settings, with the sequence split over the mesh's "cp"
loaded = dataclasses.replace(loaded, distributed=dataclasses.replace(loaded.distributed, context_parallel="cp",
                                                                     mesh=mesh))
compiled = torch.compile(model, backend=te_compile.backend(config=loaded))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1000)                  # every rank draws the same whole sequences
positions = torch.arange(model.block_size, device=device)
for step in range(1, STEPS + 1):
    x, y = get_batch("train", 8, model.block_size, gen, device)
    x, y, pos = te_compile.context_parallel_shard(mesh, [x, y, positions], seq_dims=[1, 1, 0])
    _, loss = compiled(x, y, pos)   # the mean over this rank's tokens: [8, block_size / world]
    loss.backward()
    for p in model.parameters():   # equal token counts per rank: the whole batch's gradient is the mean
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    opt.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0:
        print(f"step {step:3d}  loss {mean.item() / world:.4f} (mean over {world} ranks)", flush=True)

with torch.no_grad():
    x, _ = get_batch("val", 4, model.block_size, gen, device)
    local = te_compile.context_parallel_shard(mesh, [x, positions], seq_dims=[1, 0])
    [logits] = te_compile.context_parallel_unshard(mesh, [compiled(local[0], None, local[1])[0]], seq_dims=[1])
    whole, _ = model(x)   # eager, high precision, one process's view of the same sequences
    if rank == 0:
        err = (logits.float() - whole.float()).norm() / whole.float().norm()
        print(f"evaluation: context-parallel FP8 logits put back in order, against the whole sequences in high "
              f"precision: SQNR {-20 * torch.log10(err).item():.1f} dB")
finish(model, rank)
