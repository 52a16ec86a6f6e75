"""A GPT training step (forward + backward + AdamW): te (each supported recipe) vs inductor vs torchao
float8 (tensorwise and rowwise, when torchao is installed: ``pip install -e '.[bench]'``).

    python benchmarks/bench_block.py                           # CPU: small models, fp32 baseline
    python benchmarks/bench_block.py --device cuda             # CUDA: width 1024/2048, bf16 baseline
    python benchmarks/bench_block.py --sizes 8x128x256 --layers 2 --iters 10 --json out.json
    python benchmarks/bench_block.py --providers bf16 "te Float8CurrentScaling" --jsonl results.jsonl \
        --kernels-csv kernels.csv --code-dir code      # a lease part: rows, kernels, generated code

Sizes are BxTxC: batch B, sequence T (= block_size), width C of te_compile.models.GPT with --layers
blocks, max(4, C // 128) heads and the byte vocabulary (256). The model is compiled; the AdamW step
runs eagerly and is the same for every provider. FLOPs per step use nanoGPT's estimate:
6 * (linear weights) * tokens + 12 * layers * T * C * tokens (attention, not halved for causality).
Every provider gets a deep copy of one model instance and the same batch.
"""

from __future__ import annotations

import argparse

import torch

import _common
from te_compile.models import GPT

CPU_SIZES = "8x64x128,8x128x256"
CUDA_SIZES = "8x1024x1024,4x2048x2048"
# the lease part: one block at 2 x 2048 tokens, width 4096 (the figure both earlier leases measured);
# --dry: 2 x 32 tokens, width 64
LEASE_SIZE = {"cuda": (2, 2048, 4096), "cpu": (2, 32, 64)}


def _model(t: int, c: int, layers: int, device: torch.device, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=256, n_layer=layers, n_head=max(4, c // 128), n_embd=c,
               block_size=t).to(device=device, dtype=dtype)


def _flops(b: int, t: int, c: int, layers: int, dtype: torch.dtype) -> float:
    model = _model(t, c, layers, "meta", dtype)
    linear = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, torch.nn.Linear))
    tokens = b * t
    return 6.0 * linear * tokens + 12.0 * layers * t * c * tokens


def _builder(b: int, t: int, c: int, layers: int, device: torch.device, dtype: torch.dtype):
    base = _model(t, c, layers, device, dtype)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (b, t + 1), generator=gen).to(device)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    def build(prepare):
        model = _common.fresh_copy(base)
        fn = prepare(model)
        return _common.train_step(fn, torch.optim.AdamW(model.parameters(), lr=1e-4), x, y)
    return build


def lease_main(args) -> None:
    """The lease part: each of --providers compiled once, timed, profiled, its rows to --jsonl."""
    device = _common.lease_device(args)
    dtype = _common.baseline_dtype(device)
    b, t, c = (_common.parse_sizes(args.sizes, "BxTxC")[0] if args.sizes else LEASE_SIZE[device.type])
    layers = args.layers or 1
    shape = f"{b}x{t}x{c} gpt-{layers}L fwd+bwd"
    cuda = device.type == "cuda"
    for provider in args.providers or _common.LEASE_PROVIDERS:
        def build(provider=provider):
            return _builder(b, t, c, layers, device, dtype)(_common.lease_backend(provider, args))
        _common.lease_step(args, part="block", provider=provider, shape=shape, build=build,
                           warmup=3 if cuda else 1, iters=args.iters or (20 if cuda else 3), tokens=b * t,
                           flops=_flops(b, t, c, layers, dtype), optimizer="AdamW (eager, foreach)",
                           dtype=str(dtype).replace("torch.", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", help=f"BxTxC list (default CPU: {CPU_SIZES}; CUDA: {CUDA_SIZES})")
    parser.add_argument("--layers", type=int, default=None, help="GPT blocks (default: 2 on CPU, 4 on CUDA)")
    _common.add_common_args(parser)
    _common.add_lease_args(parser, _common.LEASE_PROVIDERS)
    args = parser.parse_args()
    if args.jsonl or args.ncu_target:
        lease_main(args)
        return
    device = _common.resolve_device(args)
    dtype = _common.baseline_dtype(device)
    layers = args.layers or (4 if device.type == "cuda" else 2)
    sizes = _common.parse_sizes(args.sizes or (CUDA_SIZES if device.type == "cuda" else CPU_SIZES), "BxTxC")

    print(f"bench_block: GPT training step (fwd + bwd + AdamW), {layers} layers, "
          f"{_common.describe_machine(device)}")
    print(f"  {_common.precision_note(device)}")
    print(f"  median of {args.iters} iterations after {args.warmup} warmup; "
          f"FLOPs = 6*linear params*tokens + 12*layers*T*C*tokens\n", flush=True)
    cases = [(f"{b}x{t}x{c}", _flops(b, t, c, layers, dtype), _builder(b, t, c, layers, device, dtype))
             for b, t, c in sizes]
    _common.finish(_common.compare(cases, device, args, ms_digits=2), "bench_block", device, args)


if __name__ == "__main__":
    main()
