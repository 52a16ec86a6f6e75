"""Block-scaled quantize kernels: Triton kernel vs its plain-torch reference (eager and inductor).

    python benchmarks/bench_quantize.py                     # CPU: reference eager vs inductor only
    python benchmarks/bench_quantize.py --device cuda       # CUDA: + the Triton kernels
    python benchmarks/bench_quantize.py --sizes 4096x4096,8192x8192 --json out.json
    python benchmarks/bench_quantize.py --jsonl results.jsonl --kernels-csv kernels.csv   # a lease part

Sizes are MxK of a bf16 (CUDA) / fp32 (CPU) input quantized rowwise. Bandwidth counts the bytes read
(the input) and written (data and scales) once: the floor any kernel must move.

As a lease part (``--jsonl``) it writes rows for part ``quantize`` (te's Triton kernels, each beside
inductor's code for its reference, which decides whether the kernel earns its place, and the
per-tensor quantization inductor generates for te's linears, in GB/s against a copy measured in the
same process) and part ``norm``: RMSNorm fused with per-tensor FP8 quantization at 4096 x 16384 bf16,
te's two Triton kernels (stats, then both FP8 layouts) under current and delayed scaling against
inductor's RMSNorm alone and inductor's RMSNorm-then-quantize; on CUDA also part ``linear``: the FP8
GEMM whose output feeds the next FP8 linear, torch._scaled_mm plus inductor's amax and cast against
``experiments/fp8_gemm.py``'s Triton GEMM with that epilogue. Kernels are timed with
``triton.testing.do_bench``; the compiled and Triton cases are also profiled into --kernels-csv.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Optional

import torch
from tabulate import tabulate

import _common
import _record
from te_compile.kernels.float8_block_quantize import (
    float8_block_quantize_reference,
    float8_block_quantize_triton,
)
from te_compile.kernels.mxfp8_quantize import mxfp8_quantize_reference, mxfp8_quantize_triton
from te_compile.kernels.norm_quantize import NormSpec, norm_quantize, norm_stats
from te_compile.kernels.nvfp4_quantize import nvfp4_quantize_reference, nvfp4_quantize_triton
from te_compile.scaling import cast_to_fp8, compute_scale, tensor_amax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the experiments package

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


# ---- the lease part ------------------------------------------------------------------------------------

# [M, K] of the quantize input and of the norm input, per device ("cpu": the --dry run)
LEASE_SHAPES = {"cuda": {"quantize": (8192, 8192), "norm": (4096, 16384)},
                "cpu": {"quantize": (128, 128), "norm": (64, 128)}}
_EPS = 1e-6


def _per_tensor(x: torch.Tensor):
    """What a te linear does to its input under current scaling: amax, scale, the rowwise FP8 copy and
    the transposed one for wgrad (inductor generates the kernels)."""
    scale = compute_scale(tensor_amax(x), E4M3)
    return cast_to_fp8(x, scale, E4M3), cast_to_fp8(x.t().contiguous(), scale, E4M3)   # [M, K], [K, M]


def _rms_norm(x, w):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, _EPS)


def _rms_norm_then_quantize(x, w, scale):
    """The unfused path: the norm's output, then its amax and both FP8 layouts; ``scale`` None: current
    scaling (the scale from this amax), else delayed scaling's."""
    h = _rms_norm(x, w)
    amax = tensor_amax(h)
    s = compute_scale(amax, E4M3) if scale is None else scale
    return cast_to_fp8(h, s, E4M3), cast_to_fp8(h.t(), s, E4M3).contiguous(), amax


def _fused(x, w, spec, scale):
    """te's kernels: the stats pass (mean, rstd, the output's amax), then one pass writing both layouts."""
    mean, rstd, amax = norm_stats(x, w, None, spec)
    s = compute_scale(amax, E4M3) if scale is None else scale
    return norm_quantize(x, w, None, mean, rstd, s, spec, E4M3), amax


def _quantize_cases(x: torch.Tensor, cuda: bool, dry: bool) -> list[tuple[str, str, Callable, int]]:
    """(provider, format, fn of x, bytes written) for x [M, K]; on CPU (--dry) the references run
    eagerly: the norm cases' one inductor compile keeps the dry run short."""
    m, k = x.shape
    out = [("te inductor" if cuda else "te reference eager", "FP8 per-tensor rowwise+transposed",
            torch.compile(_per_tensor, dynamic=False) if cuda else _per_tensor, 2 * m * k)]
    if cuda:
        from experiments.fp8_cast_transpose import fp8_cast_transpose

        one = torch.ones(1, device=x.device)
        out.append(("te triton (experiments)", "FP8 per-tensor cast+transpose+amax",
                    lambda t: fp8_cast_transpose(t, one, E4M3), 2 * m * k))
    for fmt, (reference, triton_fn, out_bytes) in _ops(x).items():
        out.append(("te triton" if cuda else "te reference eager", fmt, triton_fn if cuda else reference, out_bytes))
        if cuda:
            # what the lowerings would run without the kernel: inductor's code for the reference
            out.append(("te inductor reference", fmt, torch.compile(reference, dynamic=False), out_bytes))
    return out


def _lease_kernel(args, *, part: str, provider: str, shape: str, fn: Callable, moved: Optional[int],
                  copy_gbs: Optional[float], profile: bool) -> None:
    """Time ``fn``, write its ms (and GB/s) rows, and profile it into --kernels-csv."""
    try:
        fn()
        timing = _record.bench_kernel(fn, device=_common.lease_device(args))
    except Exception as e:   # one kernel failing must not hide the others
        _record.write_row(args.jsonl, part=part, provider=provider, shape=shape, metric="ms", median=None,
                          note=_common.failure_note(e, limit=300))
        return
    ms = timing["median_ms"]
    _record.write_row(args.jsonl, part=part, provider=provider, shape=shape, metric="ms", median=ms,
                      spread=timing["p90_ms"] - timing["p10_ms"], timer="do_bench" if torch.cuda.is_available()
                      and not args.dry else "perf_counter")
    if moved:
        gbs = moved / ms / 1e6
        _record.write_row(args.jsonl, part=part, provider=provider, shape=shape, metric="GB/s", median=gbs,
                          bytes=moved, of_copy=None if not copy_gbs else gbs / copy_gbs)
    print(f"{part} {provider} {shape}: {ms:.4f} ms" + (f", {moved / ms / 1e6:.1f} GB/s" if moved else ""),
          flush=True)
    if profile and args.kernels_csv:
        trace = os.path.join(args.trace_dir or os.path.dirname(os.path.abspath(args.kernels_csv)),
                             f"{part}-{_record.provider_slug(provider)}-{_record.provider_slug(shape)}.json")
        _record.profile_steps(fn, steps=3, trace_path=trace, csv_path=args.kernels_csv, part=part,
                              provider=provider, step_ms=ms, shape=shape)


def _epilogue_cases(s: int, device: torch.device) -> list[tuple[str, Callable]]:
    """An FP8 GEMM [s, s] x [s, s] whose output the next FP8 linear reads: torch._scaled_mm then
    inductor's amax and FP8 cast (what the lowerings run) against the experimental Triton GEMM that
    writes the amax and the FP8 bytes in its epilogue, and torch._scaled_mm alone."""
    from experiments.fp8_gemm import fp8_gemm_amax
    from te_compile.gemm import fp8_gemm

    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(s, s, device=device, generator=gen).to(E4M3)
    b = torch.randn(s, s, device=device, generator=gen).to(E4M3).t()   # column-major, as the linears pass it
    sa, sb, out_scale = (torch.ones(1, device=device) for _ in range(3))

    def unfused(a, b, sa, sb, out_scale):
        y = fp8_gemm(a, b, sa, sb, out_dtype=torch.bfloat16)
        return cast_to_fp8(y, out_scale, E4M3), tensor_amax(y)
    compiled = torch.compile(unfused, dynamic=False)
    return [("te torch._scaled_mm", lambda: fp8_gemm(a, b, sa, sb, out_dtype=torch.bfloat16)),
            ("te torch._scaled_mm + inductor amax, FP8 cast", lambda: compiled(a, b, sa, sb, out_scale)),
            ("te triton GEMM + amax, FP8 out (experiments)",
             lambda: fp8_gemm_amax(a, b, sa, sb, torch.bfloat16, out_scale, E4M3))]


def lease_main(args) -> None:
    """The lease parts quantize and norm, in one process: the copy first (the bandwidth the kernels are
    judged against), then each kernel."""
    device = _common.lease_device(args)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.code_dir:   # one folder for the part's few compiled functions (before the first compile)
        _record.provider_cache_dir(os.path.join(args.code_dir, "quantize"), "te kernels")
    m, k = LEASE_SHAPES[device.type]["quantize"]
    x = torch.randn(m, k, device=device, dtype=dtype)
    y = torch.empty_like(x)
    copy = _record.bench_kernel(lambda: y.copy_(x), device=device)
    copy_gbs = 2 * x.numel() * x.element_size() / copy["median_ms"] / 1e6
    _record.write_row(args.jsonl, part="quantize", provider="bf16 copy", shape=f"{m}x{k} copy",
                      metric="GB/s", median=copy_gbs, bytes=2 * x.numel() * x.element_size())
    print(f"quantize: copy {m}x{k} {dtype}: {copy_gbs:.1f} GB/s", flush=True)
    for provider, fmt, fn, out_bytes in _quantize_cases(x, cuda, args.dry):
        _lease_kernel(args, part="quantize", provider=provider, shape=f"{m}x{k} {fmt}", fn=lambda fn=fn: fn(x),
                      moved=x.numel() * x.element_size() + out_bytes, copy_gbs=copy_gbs,
                      profile=cuda)

    m, k = LEASE_SHAPES[device.type]["norm"]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
    w = torch.rand(k, device=device, dtype=dtype, generator=gen) + 0.5
    scale = torch.ones(1, device=device)
    spec = NormSpec("rms_norm", _EPS, prod_dtype=dtype)
    # on CPU (--dry) only the unfused current-scaling case compiles (its code and profile are what the
    # report's join is checked on); the rest run eagerly
    norm = torch.compile(_rms_norm, dynamic=False) if cuda else _rms_norm
    unfused = torch.compile(_rms_norm_then_quantize, dynamic=False)
    unfused_delayed = unfused if cuda else _rms_norm_then_quantize
    cases = [("bf16 inductor", "rmsnorm fwd", lambda: norm(x, w)),
             ("te inductor unfused", "rmsnorm+quantize current fwd", lambda: unfused(x, w, None)),
             ("te inductor unfused", "rmsnorm+quantize delayed fwd", lambda: unfused_delayed(x, w, scale)),
             ("te triton fused", "rmsnorm+quantize current fwd", lambda: _fused(x, w, spec, None)),
             ("te triton fused", "rmsnorm+quantize delayed fwd", lambda: _fused(x, w, spec, scale))]
    for provider, what, fn in cases:
        _lease_kernel(args, part="norm", provider=provider, shape=f"{m}x{k} {what}", fn=fn, moved=None,
                      copy_gbs=copy_gbs,
                      profile=cuda or (what == "rmsnorm+quantize current fwd" and "inductor" in provider))

    if cuda:   # the GEMM epilogue experiment (decides whether the lowerings should call it)
        for size in (4096, 8192):
            for provider, fn in _epilogue_cases(size, device):
                _lease_kernel(args, part="linear", provider=provider, shape=f"{size}^3 fp8 gemm epilogue fwd",
                              fn=fn, moved=None, copy_gbs=copy_gbs, profile=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", help=f"MxK list (default CPU: {CPU_SIZES}; CUDA: {CUDA_SIZES})")
    _common.add_common_args(parser)
    _common.add_lease_args(parser, ("te triton", "te inductor"))
    args = parser.parse_args()
    if args.jsonl:
        lease_main(args)
        return
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
