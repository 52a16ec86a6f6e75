"""Where a te training step spends its time: torch.profiler over a few steps of one GPT block, the top
kernels by device time, and the share that is FP8 bookkeeping (amax, casts, transposes, the state
update) rather than GEMMs and attention.

    python benchmarks/profile_step.py                         # CUDA: width 4096, 32 heads, 2 x 2048 tokens
    python benchmarks/profile_step.py --recipe DelayedScaling --top 30 --trace step.json
    python benchmarks/profile_step.py --device cpu            # tiny shapes, to keep the script working
    python benchmarks/profile_step.py --model moe-mixtral     # bench_moe.py's MoE layer instead of the block

Each kernel is put in one class by its name (first match wins): "gemm" (cuBLAS / cuBLASLt / CUTLASS
GEMMs, ``_scaled_mm``, ``mm``), "attention" (flash / SDPA / te's FP8 attention kernels), "fp8
bookkeeping" (te's quantize, cast-transpose, norm and update kernels; inductor kernels whose fused
name holds an amax, an FP8 conversion or a transpose), "optimizer" (AdamW's foreach kernels),
"other" (the rest: norms, GELU, residual adds, the loss). Inductor names its kernels after the ops
it fused, so a kernel that does a norm and quantizes its output counts as bookkeeping. Device time
on CUDA (``self_device_time_total``), CPU time on CPU.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

import torch
from tabulate import tabulate

import _common
import bench_block
import te_compile

SHAPES = {"cuda": (2, 2048, 4096), "cpu": (2, 32, 64)}   # B, T, C (heads: C // 128, at least 4)

# (class, pattern over the lower-cased kernel name), first match wins
CLASSES = [
    ("gemm", re.compile(r"gemm|cutlass|scaled_mm|sm90_xmma|nvjet|\bmm\b|addmm|matmul|cublas")),
    ("attention", re.compile(r"flash|attention|sdpa|fmha")),
    ("fp8 bookkeeping", re.compile(r"amax|fp8|float8|e4m3|e5m2|to_copy|transpose|cast|quantize|norm_stats|"
                                   r"delayed_update|delayed_scaling|clamp")),
    ("optimizer", re.compile(r"foreach|adam|lerp|addcdiv|addcmul")),
]


def classify(name: str) -> str:
    low = name.lower()
    for label, pattern in CLASSES:
        if pattern.search(low):
            return label
    return "other"


def _moe_step(model: str, device: torch.device, dtype: torch.dtype, prepare):
    """bench_moe.py's MoE layer at one of its shapes: (step, title)."""
    import bench_moe

    name = {"moe-mixtral": "mixtral", "moe-small": "small experts"}[model]
    experts, top_k, hidden, ffn, tokens = bench_moe.SHAPES[device.type][name]
    torch.manual_seed(0)
    layer = prepare(bench_moe.MoELayer(experts, top_k, hidden, ffn).to(device=device, dtype=dtype))
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)

    def step():
        layer(x)[1].backward()
    return step, f"one MoE layer ({name}: E={experts}, top-{top_k}, {hidden}x{ffn}, {tokens} tokens)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="Float8CurrentScaling",
                        help="te recipe, or 'inductor' for the plain baseline (default: Float8CurrentScaling)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps, after the warm-up (default 3)")
    parser.add_argument("--top", type=int, default=20, help="kernels to list (default 20)")
    parser.add_argument("--trace", metavar="PATH", help="also write a Chrome trace")
    parser.add_argument("--model", choices=("block", "moe-mixtral", "moe-small"), default="block",
                        help="one GPT block with AdamW (default), or one MoE layer of bench_moe.py at its "
                             "Mixtral-like or small-expert shape, forward + backward")
    parser.add_argument("--fp8-format", choices=("HYBRID", "E4M3"), help="the te recipe's fp8_format")
    _common.add_common_args(parser)
    args = parser.parse_args()
    device = _common.resolve_device(args)
    dtype = _common.baseline_dtype(device)
    options = {} if args.fp8_format is None else {"fp8_format": args.fp8_format}
    backend = "inductor" if args.recipe == "inductor" else te_compile.backend(recipe=args.recipe, **options)

    def prepare(model):
        return torch.compile(model, backend=backend, dynamic=False)
    if args.model == "block":
        b, t, c = SHAPES[device.type]
        title = f"one GPT block {b}x{t}x{c}"
        step = bench_block._builder(b, t, c, 1, device, dtype)(prepare)
    else:
        step, title = _moe_step(args.model, device, dtype, prepare)
    for _ in range(max(2, args.warmup)):   # compile, and a step with the state already advanced
        step()
    _common._sync(device)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        _common._sync(device)
    if args.trace:
        prof.export_chrome_trace(args.trace)

    # per kernel: its own time on the device (CUDA) or the CPU, summed over the profiled steps
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us <= 0:
            continue
        if device.type == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if device.type == "cpu" and not (event.key.startswith(("cpp_fused", "aten::", "te_compile::",
                                                                "extern_kernels", "torch_ops"))):
            continue
        totals[event.key] += us / args.steps
        counts[event.key] += event.count // args.steps
    whole = sum(totals.values()) or 1.0
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]
    print(f"\nprofile_step: {_common.describe_machine(device)}, {title}, "
          f"{args.recipe}{'' if args.fp8_format is None else ' ' + args.fp8_format}, per step (mean of {args.steps})")
    print(tabulate([(name[:90], classify(name), counts[name], f"{us / 1e3:.3f}", f"{100 * us / whole:.1f}%")
                    for name, us in top],
                   headers=["kernel", "class", "calls", "ms", "share"], disable_numparse=True))
    by_class: dict[str, float] = defaultdict(float)
    for name, us in totals.items():
        by_class[classify(name)] += us
    print()
    print(tabulate([(label, f"{us / 1e3:.3f}", f"{100 * us / whole:.1f}%")
                    for label, us in sorted(by_class.items(), key=lambda kv: -kv[1])],
                   headers=["class", "ms per step", "share"], disable_numparse=True))


if __name__ == "__main__":
    main()
