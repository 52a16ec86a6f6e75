"""Activation offload on vs off: step time, and what leaves the device.

    python benchmarks/bench_offload.py                        # the demo's GPT, 4 layers, batch 8x64
    python benchmarks/bench_offload.py --layers 2 --width 64 --steps 3 --warmup 1   # the CPU smoke run

Each provider compiles the same GPT with te (Float8CurrentScaling) and trains it (forward, backward,
AdamW step; compile and warm-up excluded). On a GPU the table gives the peak device memory of a
step (``torch.cuda.max_memory_allocated``); on a CPU, where host and device memory are one, it gives
the bytes the offload moves each way per step and the bytes the step saves for backward, both read
from te's report and from saved-tensor hooks, instead.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

import _common    # benchmarks/: the training step the scripts share
import te_compile
from te_compile.fx.offload import moved_bytes
from te_compile.memory import saved_for_backward_bytes
from te_compile.models import GPT


def _measure(offload: bool, args, x, y) -> dict:
    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    model = GPT(vocab_size=256, n_layer=args.layers, n_head=4, n_embd=args.width,
                block_size=x.shape[1]).to(x.device)
    options = {"memory": {"offload_activations": offload}, "compiler": args.compiler}
    compiled = torch.compile(model, backend="te", options=options)
    step = _common.train_step(compiled, torch.optim.AdamW(model.parameters(), lr=1e-3), x, y)

    for _ in range(args.warmup):
        step()
    if x.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    row = {"offload": "on" if offload else "off", "step ms (median)": round(statistics.median(times), 2)}
    if x.is_cuda:
        row["peak MiB"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    row["moved B each way"] = moved_bytes(te_compile.report().sites)
    row["saved-for-backward B"] = saved_for_backward_bytes(compiled, x, y)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.seq), generator=g).to(device)
    y = torch.randint(0, 256, (args.batch, args.seq), generator=g).to(device)
    rows = [_measure(offload, args, x, y) for offload in (False, True)]
    print(f"{device}, {args.layers} layers x {args.width}, batch {args.batch}x{args.seq}, te Float8CurrentScaling")
    print(tabulate([list(r.values()) for r in rows], headers=list(rows[0])))


if __name__ == "__main__":
    main()
