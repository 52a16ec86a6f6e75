"""Forward + backward of one nn.Linear: te (each supported recipe) vs inductor vs torchao float8
(tensorwise and rowwise, when torchao is installed: ``pip install -e '.[bench]'``).

    python benchmarks/bench_linear.py                          # CPU: small sizes, fp32 baseline
    python benchmarks/bench_linear.py --device cuda            # CUDA: 4096..16384, bf16 baseline
    python benchmarks/bench_linear.py --sizes 1024x1024x1024,2048x4096x1024 --iters 50 --json out.json

Sizes are MxKxN: x [M, K] @ w.T with w [N, K]. One step is y = linear(x); y.backward(dy), i.e.
fprop, dgrad and wgrad GEMMs: 6*M*K*N FLOPs. Bias-free, so the GEMMs (and the te quantization
around them) are all that is timed. Every provider gets a deep copy of one linear and the same x, dy.
How te's FP8 operands compare with torchao's, bit for bit: benchmarks/compare_torchao.py.
"""

from __future__ import annotations

import argparse

import torch

import _common

CPU_SIZES = "256x256x256,512x512x512,1024x1024x1024"
CUDA_SIZES = "4096x4096x4096,8192x8192x8192,16384x8192x16384"


def _builder(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype):
    torch.manual_seed(0)
    base = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=dtype)

    def build(prepare):
        linear = _common.fresh_copy(base)
        fn = prepare(linear)

        def step():
            fn(x).backward(dy)
            x.grad = None
            linear.weight.grad = None
        return step
    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", help=f"MxKxN list (default CPU: {CPU_SIZES}; CUDA: {CUDA_SIZES})")
    _common.add_common_args(parser)
    args = parser.parse_args()
    device = _common.resolve_device(args)
    dtype = _common.baseline_dtype(device)
    sizes = _common.parse_sizes(args.sizes or (CUDA_SIZES if device.type == "cuda" else CPU_SIZES), "MxKxN")

    print(f"bench_linear: nn.Linear forward + backward, {_common.describe_machine(device)}")
    print(f"  {_common.precision_note(device)}")
    print(f"  median of {args.iters} iterations after {args.warmup} warmup; FLOPs = 6*M*K*N\n", flush=True)
    cases = [(f"{m}x{k}x{n}", 6.0 * m * k * n, _builder(m, k, n, device, dtype))
             for m, k, n in sizes]
    _common.finish(_common.compare(cases, device, args, ms_digits=3), "bench_linear", device, args)


if __name__ == "__main__":
    main()
