"""Sequence-parallel FP8 training with async tensor parallelism: torchtitan's Llama plan, unchanged model code.

    torchrun --nproc-per-node 2 examples/distributed/train_async_tp.py [config.toml]

The model is a small Llama written as torchtitan writes it (RMSNorm, wq / wk / wv / wo attention,
SwiGLU w1 / w2 / w3; no position embedding, to keep the plan short), parallelized with torchtitan's
plan: activations sharded along the sequence between blocks, each block's linears split column- and
row-wise. ``[distributed] async_tp = true`` (set here over the config's recipe) makes te's FP8 linears
all-gather the FP8 activations and reduce-scatter their outputs themselves, in the form inductor's
micro-pipeline TP pass fuses with the GEMMs (on NCCL with symmetric memory, enabled below as torchtitan
does; on gloo the collectives stay apart and move the same FP8 bytes). The report's rows end with
``async TP: ...``. Default config: examples/current_scaling.toml. CPU (gloo) or CUDA (nccl, a GPU per rank).
"""

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

import te_compile

from _common import finish, setup, train

STEPS = 20


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        bs, seqlen, _ = x.shape
        # -1: the heads this rank holds under tensor parallelism
        q, k, v = (w(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False),
                                     nn.Linear(dim, hidden, bias=False))

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, n_heads), FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab_size: int = 256, dim: int = 128, n_layers: int = 2, n_heads: int = 4,
                 hidden: int = 384, block_size: int = 64) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


rank, world, device = setup()
config = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parents[1] / "current_scaling.toml")
mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
if device.type == "cuda":   # what the micro-pipeline pass needs to fuse a collective with a GEMM
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(mesh.get_group().group_name)
torch.manual_seed(0)
model = Llama().to(device)
# torchtitan's parallelize_llama: the sequence is split between the embedding and the output layer
parallelize_module(model, mesh, {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
})
gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
for layer in model.layers:
    parallelize_module(layer, mesh, {
        "attention_norm": SequenceParallel(), "attention": gather,
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(), "feed_forward": gather,
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    })
loaded = te_compile.load_config(config)   # the file's settings, with async_tp turned on
loaded = dataclasses.replace(loaded, distributed=dataclasses.replace(loaded.distributed, async_tp=True))
compiled = torch.compile(model, backend=te_compile.backend(config=loaded))
gen = torch.Generator().manual_seed(1000)                  # tensor parallel: every rank the same batch
train(compiled, model, device, gen, rank, STEPS, mean_over_ranks=False)
finish(model, rank)
