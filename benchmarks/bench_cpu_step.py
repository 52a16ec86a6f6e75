"""Steady-state training step time on CPU: fp32 inductor vs te with each CPU FP8 GEMM path.

    python benchmarks/bench_cpu_step.py                 # the demo's GPT, batch 8x64, 3 rounds
    python benchmarks/bench_cpu_step.py --rounds 5 --steps 60

te's per-tensor FP8 GEMMs on CPU are either the torch-op emulation (gemm/per_tensor.py: the default
where it gives torch._scaled_mm's bits) or torch._scaled_mm itself. Each round measures the three
providers one after the other on the same model and batch (forward, backward, AdamW step; compile
and warm-up excluded), so that a slow moment of a shared machine hits all three; the table gives the
median over rounds and tokens/s relative to inductor.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

import _common    # benchmarks/: the training step the scripts share
import te_compile
from te_compile.gemm import per_tensor as gemm
from te_compile.models import GPT

_EMULATES = gemm.cpu_emulates_scaled_mm
PROVIDERS = {
    "inductor fp32": ("inductor", None),
    "te Float8CurrentScaling, CPU GEMM emulation": ("te", _EMULATES),
    "te Float8CurrentScaling, torch._scaled_mm": ("te", lambda: False),
}


def _step_ms(backend: str, emulates, args, x, y) -> float:
    if emulates is not None:
        gemm.cpu_emulates_scaled_mm = emulates
    try:
        torch._dynamo.reset()
        te_compile.reset()
        torch.manual_seed(0)
        model = GPT(vocab_size=256, n_layer=args.layers, n_head=4, n_embd=args.width, block_size=x.shape[1])
        compiled = torch.compile(model, backend=backend)
        step = _common.train_step(compiled, torch.optim.AdamW(model.parameters(), lr=1e-3), x, y)

        for _ in range(args.warmup):
            step()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        return (time.perf_counter() - start) / args.steps * 1e3
    finally:
        gemm.cpu_emulates_scaled_mm = _EMULATES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="8x64", help="BxT (default 8x64, the demo's)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    b, t = (int(v) for v in args.batch.split("x"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (b, t), generator=gen)
    y = torch.randint(0, 256, (b, t), generator=gen)
    times: dict[str, list[float]] = {name: [] for name in PROVIDERS}
    for r in range(args.rounds):
        for name, (backend, emulates) in PROVIDERS.items():
            times[name].append(_step_ms(backend, emulates, args, x, y))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.1f} ms" for n, v in times.items()), flush=True)
    base = statistics.median(times["inductor fp32"])
    rows = [(name, f"{statistics.median(v):.1f}", f"{min(v):.1f}-{max(v):.1f}",
             f"{b * t / statistics.median(v) * 1e3:,.0f}", f"{base / statistics.median(v):.2f}x")
            for name, v in times.items()]
    print(f"\nGPT {args.layers} layers, width {args.width}, batch {b}x{t}, {args.steps} steps x {args.rounds} rounds, "
          f"cpu ({torch.get_num_threads()} threads), torch {torch.__version__}")
    print(tabulate(rows, headers=["provider", "step ms (median)", "range", "tokens/s", "vs inductor"],
                   disable_numparse=True))


if __name__ == "__main__":
    main()
