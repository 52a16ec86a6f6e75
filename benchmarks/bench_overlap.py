"""Async tensor parallelism: a sequence-parallel Llama block's training step with its collectives fused
into the GEMMs, against the same block without, measured side by side in one run.

    torchrun --nproc-per-node 2 benchmarks/bench_overlap.py          # CUDA, a GPU per rank (hidden 8192)
    python benchmarks/bench_overlap.py                               # CPU: spawns 2 gloo ranks, a tiny block

The block is torchtitan's Llama block (RMSNorm, wq / wk / wv / wo attention, SwiGLU w1 / w2 / w3)
under torchtitan's sequence-parallel plan on a 1-D TP mesh of every rank. Providers:
- ``inductor``: bf16 (fp32 on CPU), DTensor's collectives;
- ``inductor async TP``: the same with ``torch._inductor.config._micro_pipeline_tp`` (torch's async TP);
- ``te Float8CurrentScaling``: te's FP8 linears, DTensor's collectives (the high-precision activation
  is gathered, then quantized);
- ``te Float8CurrentScaling async_tp``: ``[distributed] async_tp = true``: FP8 all-gathers and the
  reduce-scatters beside ``aten._scaled_mm``, fused by the micro-pipeline pass where the group has
  symmetric memory (enabled on CUDA here, as torchtitan does).

Columns: median step (forward + backward) in ms on rank 0, tokens/s per GPU, the ratio to the te row
without async TP and to inductor, and the bytes per rank and step that the post-grad graphs all-gather
(the gathered tensors) and reduce-scatter (their inputs), counted from the graphs before the pass fuses
them. Goal (CUDA, TP=2, hidden 8192): te async_tp >= 1.1x te without.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import te_compile  # noqa: E402

SHAPES = {"cuda": dict(dim=8192, heads=64, hidden=28672, batch=1, seq=4096),
          "cpu": dict(dim=64, heads=4, hidden=128, batch=2, seq=32)}
PROVIDERS = ("inductor", "inductor async TP", "te Float8CurrentScaling", "te Float8CurrentScaling async_tp")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        bs, seqlen, _ = x.shape
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


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def _plan() -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"attention_norm": SequenceParallel(), "attention": gather,
            **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(), "feed_forward": gather,
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}


class _CollectiveBytes:
    """Bytes all-gathered and reduce-scattered by the post-grad graphs inductor compiles (a custom
    pre-pass: it sees the collectives before the micro-pipeline pass fuses them)."""

    def __init__(self) -> None:
        self.gathered = self.scattered = 0

    def __call__(self, graph) -> None:
        c10d = torch.ops._c10d_functional
        for node in graph.nodes:
            if node.target is c10d.all_gather_into_tensor.default:
                self.gathered += _nbytes(node)
            elif node.target is c10d.reduce_scatter_tensor.default:
                self.scattered += _nbytes(node.args[0])


def _nbytes(node) -> int:
    val = node.meta.get("val")
    return 0 if val is None else val.numel() * val.element_size()


def _compile(model, provider: str):
    if provider.startswith("inductor"):
        return torch.compile(model)
    options = {"recipe": "Float8CurrentScaling", "distributed": {"async_tp": provider.endswith("async_tp")}}
    return torch.compile(model, backend="te", options=options)


def _run(rank: int, world: int, device: torch.device, args) -> None:
    import torch._inductor.config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    shape = SHAPES[device.type]
    if args.dim:
        shape.update(dim=args.dim, hidden=int(args.dim * 3.5), heads=max(1, args.dim // 128))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    if device.type == "cuda":
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(mesh.get_group().group_name)
    rows = []
    base = {}
    for provider in PROVIDERS:
        torch._dynamo.reset()
        te_compile.reset()
        counter = _CollectiveBytes()
        patches = {"post_grad_custom_pre_pass": counter, "_micro_pipeline_tp": provider == "inductor async TP"}
        torch.manual_seed(0)
        block = Block(shape["dim"], shape["heads"], shape["hidden"]).to(device=device, dtype=dtype)
        model = _compile(parallelize_module(block, mesh, _plan()), provider)
        x = torch.randn(shape["batch"], shape["seq"] // world, shape["dim"], device=device, dtype=dtype,
                        requires_grad=True)

        def step():
            model(x).float().pow(2).mean().backward()

        try:
            with inductor_config.patch(patches):
                step()   # compiles
                counted = (counter.gathered, counter.scattered)
                for _ in range(args.warmup):
                    step()
                times = []
                for _ in range(args.iters):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    dist.barrier()
                    t0 = time.perf_counter()
                    step()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times)
            base.setdefault(provider.split()[0], ms)
            rows.append([provider, f"{ms:.2f}", f"{shape['batch'] * shape['seq'] / world / ms * 1e3:,.0f}",
                         f"{base.get('te', ms) / ms:.2f}x" if provider.startswith("te") else "",
                         f"{base['inductor'] / ms:.2f}x", f"{counted[0] / 2**20:.2f}", f"{counted[1] / 2**20:.2f}", ""])
        except Exception as e:   # a provider that cannot run here keeps its row, with why
            rows.append([provider, "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", f"{type(e).__name__}: {str(e)[:90]}"])
        if rank == 0:
            print(f"  {provider}: done", flush=True)
    if rank == 0:
        from tabulate import tabulate

        print(tabulate(rows, headers=["provider", "step ms", "tokens/s/rank", "vs te", "vs inductor",
                                      "all-gathered MiB", "reduce-scattered MiB", "note"], disable_numparse=True))


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _run(rank, world, torch.device("cpu"), args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=None, help="timed steps (default: 20 CUDA, 3 CPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dim", type=int, default=None, help="hidden size (default: 8192 CUDA, 64 CPU)")
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:   # torchrun
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        args.iters = args.iters or (20 if cuda else 3)
        if rank == 0:
            print(f"bench_overlap: TP={world}, {SHAPES[device.type]}; "
                  f"{torch.cuda.get_device_name(device) if cuda else 'CPU'}, torch {torch.__version__}", flush=True)
        _run(rank, world, device, args)
        dist.destroy_process_group()
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.iters = args.iters or 3
    print(f"bench_overlap: TP=2 over gloo (2 spawned CPU ranks), {SHAPES['cpu']}; {os.cpu_count()}-core CPU, "
          f"torch {torch.__version__}; CPU timings say nothing of GPUs, the bytes hold anywhere", flush=True)
    mp.spawn(_worker, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
