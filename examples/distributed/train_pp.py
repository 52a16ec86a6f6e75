"""Pipeline parallel FP8 training: two stages, data parallel within each, micro-batches in flight.

    torchrun --nproc-per-node 4 examples/distributed/train_pp.py [--schedule 1F1B|GPipe] [--recipe NAME]

A ("pp", "dp") mesh of 2 x world/2: stage 0 holds the embeddings and the first half of gpt_small's
blocks, stage 1 the rest with the final norm and lm_head (the loss runs there). Each stage is
sharded with ``fully_shard`` on dp (FP8 weight all-gathers), compiled with the te backend, and
driven by ``torch.distributed.pipelining`` with 4 micro-batches per step.

What pipelines need from te (docs/distributed.md, "Pipeline parallelism"): the mesh in the options,
so that amax reductions ("auto") stay within a stage's dp ranks; DelayedScaling with
``update_on = "optimizer_step"``, so that its state advances once per step after every micro-batch's
backward; static shapes for ``PipelineStage``. Rank 0 prints the loss of every step (stage 1's,
averaged over its dp ranks), each stage's amax groups, and every stage checks that its dp ranks keep
the same recipe state. CPU (gloo) or CUDA (nccl).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import te_compile
from te_compile.data import get_batch
from te_compile.models import gpt_small

from _common import setup

STEPS = 10
MICRO_BATCHES = 4
RECIPES = ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--schedule", choices=("1F1B", "GPipe"), default="1F1B")
parser.add_argument("--recipe", choices=RECIPES, default="DelayedScaling")
args = parser.parse_args()


class FirstStage(nn.Module):
    def __init__(self, gpt, blocks) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.blocks = gpt.tok_emb, gpt.pos_emb, nn.ModuleList(blocks)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    def __init__(self, gpt, blocks) -> None:
        super().__init__()
        self.blocks, self.ln_f, self.lm_head = nn.ModuleList(blocks), gpt.ln_f, gpt.lm_head

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


rank, world, device = setup()
if world % 2:
    raise SystemExit(f"two pipeline stages need an even world size, got {world}")
mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("pp", "dp"))
stage_index, dp = mesh["pp"].get_local_rank(), mesh["dp"]
options = {"recipe": args.recipe, "mesh": mesh}
if args.recipe == "DelayedScaling":
    options["recipe_options"] = {"update_on": "optimizer_step"}

torch.manual_seed(0)
gpt = gpt_small().to(device)
half = len(gpt.blocks) // 2
module = FirstStage(gpt, gpt.blocks[:half]) if stage_index == 0 else LastStage(gpt, gpt.blocks[half:])
te_compile.enable_fp8_all_gather(module, **options)
fully_shard(module, mesh=dp)
module.compile(backend=te_compile.backend(**options))

batch, width = 8, gpt_small().pos_emb.embedding_dim
micro = batch // MICRO_BATCHES
# static shapes (and requires_grad: stage 1's input sends its gradient back to stage 0)
example_in = (torch.zeros(micro, gpt.block_size, dtype=torch.long, device=device) if stage_index == 0
              else torch.zeros(micro, gpt.block_size, width, device=device, requires_grad=True))
example_out = (torch.zeros(micro, gpt.block_size, width, device=device) if stage_index == 0
               else torch.zeros(micro, gpt.block_size, gpt.vocab_size, device=device)).requires_grad_()
stage = PipelineStage(module, stage_index, 2, device, input_args=(example_in,), output_args=(example_out,),
                      group=mesh["pp"].get_group())


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / MICRO_BATCHES


schedule = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[args.schedule](
    stage, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn, scale_grads=False)
opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1000 + dp.get_local_rank())   # each dp rank its own data
for step in range(1, STEPS + 1):
    x, y = (t.to(device) for t in get_batch("train", batch, gpt.block_size, gen))
    losses = []
    if stage_index == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    opt.step()   # also advances DelayedScaling's state (update_on = "optimizer_step")
    opt.zero_grad(set_to_none=True)
    loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=device)
    dist.all_reduce(loss)                                   # stage 1's dp ranks hold the losses
    if rank == 0:
        print(f"step {step:3d}  loss {loss.item() / dp.size():.4f} (mean over {dp.size()} dp ranks)", flush=True)

for s in range(2):
    if stage_index == s and dp.get_local_rank() == 0:
        groups = sorted({site.collectives or "none" for site in te_compile.report().sites if site.rewritten
                         and site.op == "linear"})
        print(f"stage {s}: {sum(site.rewritten for site in te_compile.report().sites if site.op == 'linear')} linears "
              f"in FP8; amax reductions: {'; '.join(groups)}", flush=True)
    dist.barrier()
state = {k: v.cpu() for k, v in te_compile.recipe_state_dict(module).items()}
gathered = [None] * dp.size()
dist.all_gather_object(gathered, state, group=dp.get_group())
same = all(torch.equal(other[k], state[k]) for other in gathered for k in state)
if dp.get_local_rank() == 0:
    print(f"stage {stage_index}: {len(state)} state tensors, "
          f"{'identical' if same else 'DIFFERENT'} on its {dp.size()} dp ranks", flush=True)
dist.destroy_process_group()
raise SystemExit(0 if same else 1)
