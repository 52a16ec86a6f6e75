"""Block-scaled quantize kernels: Triton kernel vs its plain-torch reference (eager and inductor).

    python benchmarks/bench_quantize.py                     # CPU: reference eager vs inductor only
    python benchmarks/bench_quantize.py --device cuda       # CUDA: + the Triton kernels
    python benchmarks/bench_quantize.py --sizes 4096x4096,8192x8192 --json out.json

Sizes are MxK of a bf16 (CUDA) / fp32 (CPU) input quantized rowwise. Bandwidth counts the bytes read
(the input) and written (data and scales) once: the floor any kernel must move.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Optional

import torch
from tabulate import tabulate

import _common
from te_compile.kernels.float8_block_quantize import (
    float8_block_quantize_reference,
    float8_block_quantize_triton,
)
from te_compile.kernels.mxfp8_quantize import mxfp8_quantize_reference, mxfp8_quantize_triton
from te_compile.kernels.nvfp4_quantize import nvfp4_quantize_reference, nvfp4_quantize_triton

CPU_SIZES = "1024x1024,2048x4096"
CUDA_SIZES = "4096x4096,8192x8192,16384x8192"
E4M3 = torch.float8_e4m3fn


def _ops(x: torch.Tensor) -> dict[str, tuple[Callable, Callable, int]]:
    """format -> (reference, triton launcher, output bytes) for input x [M, K]."""
    m, k = x.shape
    amax = x.abs().amax().float().reshape(1)
    return {
        "MXFP8 1x32": (lambda t: mxfp8_quantize_reference(t, E4M3),
                       lambda t: mxfp8_quantize_triton(t, E4M3), m * k + m * k // 32),
        "FP8 block 1x128": (
            lambda t: float8_block_quantize_reference(t, E4M3, tile_rows=1, force_pow_2_scales=True,
                                                      amax_epsilon=0.0),
            lambda t: float8_block_quantize_triton(t, E4M3, tile_rows=1, force_pow_2_scales=True,
                                                   amax_epsilon=0.0),
            m * k + 4 * m * k // 128),
        "NVFP4 1x16": (lambda t: nvfp4_quantize_reference(t, amax, tile_rows=1, rand=None),
                       lambda t: nvfp4_quantize_triton(t, amax, tile_rows=1, rand=None),
                       m * k // 2 + m * k // 16),
    }


def _time_ms(fn: Callable, x: torch.Tensor, device: torch.device, iters: int, warmup: int) -> float:
    return 1e3 * _common.time_step(lambda: fn(x), device, iters, warmup)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", help=f"MxK list (default CPU: {CPU_SIZES}; CUDA: {CUDA_SIZES})")
    _common.add_common_args(parser)
    args = parser.parse_args()
    device = _common.resolve_device(args)
    dtype = _common.baseline_dtype(device)
    sizes = _common.parse_sizes(args.sizes or (CUDA_SIZES if device.type == "cuda" else CPU_SIZES), "MxK")
    print(f"bench_quantize: rowwise block quantize, {_common.describe_machine(device)}")
    print(f"  input {dtype}; median of {args.iters} iterations after {args.warmup} warmup\n", flush=True)
    rows = []
    for m, k in sizes:
        x = torch.randn(m, k, device=device, dtype=dtype)
        for fmt, (reference, triton_fn, out_bytes) in _ops(x).items():
            moved = x.numel() * x.element_size() + out_bytes
            timings: dict[str, Optional[float]] = {
                "reference": _time_ms(reference, x, device, args.iters, args.warmup),
                "inductor": _time_ms(torch.compile(reference, dynamic=False), x, device, args.iters,
                                     args.warmup),
                "triton": (_time_ms(triton_fn, x, device, args.iters, args.warmup)
                           if device.type == "cuda" else None),
            }
            for provider, ms in timings.items():
                rows.append({
                    "size": f"{m}x{k}", "format": fmt, "provider": provider,
                    "median_ms": ms, "GB/s": None if ms is None else moved / ms / 1e6,
                    "vs inductor": None if ms is None else timings["inductor"] / ms,
                    "note": "needs CUDA" if ms is None else "",
                })
    print(tabulate(rows, headers="keys", floatfmt=".3f", missingval="-"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "bench_quantize", "device": str(device), "rows": rows}, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
