"""The GPU suite: one command for the speed figures to measure on a lent GPU, appended to BENCHMARKS.md.

    python benchmarks/gpu_suite.py                    # CUDA: everything, appended to BENCHMARKS.md
    python benchmarks/gpu_suite.py --device cpu       # tiny shapes, to keep the script working
    python benchmarks/gpu_suite.py --only linear quantize --no-append
    python benchmarks/gpu_suite.py --only projection   # the GPT block step beside its H100 projection

Six parts, each provider measured side by side in this one run:
- linear: forward + backward of one bias-free nn.Linear at M = K = N = 4096 and 8192 (CPU: 128), te
  with each recipe vs inductor (bf16 on CUDA, fp32 on CPU) vs torchao float8 tensorwise when it
  imports; TFLOP/s from 6·M·K·N;
- block: one GPT block's training step (forward, backward, AdamW) at width 4096 (32 heads, batch 2 x
  2048 tokens; CPU: width 64, 2 x 32), same providers;
- quantize: te's quantize kernels in GB/s (input read once, outputs written once: the least any kernel
  must move) against the device-to-device copy bandwidth measured here (``y.copy_(x)``, 2 bytes moved
  per byte copied);
- epilogue: one FP8 GEMM whose output the next FP8 linear reads, at M = K = N = 4096 and 8192 (CPU:
  128): torch._scaled_mm then inductor's amax and FP8 cast (what the lowerings run today) vs the
  Triton GEMM whose epilogue writes the amax and the FP8 bytes (experiments/fp8_gemm.py), and
  torch._scaled_mm alone; it decides whether the lowerings should call the Triton GEMM;
- norm: RMSNorm fused with per-tensor FP8 quantization at 4096 x 16384 bf16 (CPU: 256 x
  512): te's kernels (a stats pass, then one pass writing the rowwise and transposed FP8 bytes) under
  current and delayed scaling vs inductor's RMSNorm alone and inductor's RMSNorm-then-quantize;
- projection: the bare GPT block (te_compile.models.Block: forward + backward, no optimizer, no
  embedding) at 8 x 2048 tokens, width 4096, 32 heads (CPU: 2 x 32, width 64, 4 heads), under the
  providers of benchmarks/project_gpu.py, measured here and printed beside that script's H100
  projection of the same step (computed from inductor's GPU kernels, without a GPU), so that the
  projection's assumptions can be checked against a measurement.

The goals (H100) are printed beside the measured ratios: FP8 linear at 8192³ ≥ 1.7× bf16
(TransformerEngine's current scaling reaches 1.58×), GPT block ≥ 1.35× bf16 and ≥ 1.1× torchao float8,
quantize ≥ 85% of copy bandwidth; and the fused RMSNorm + quantize forward ≤ 1.1× RMSNorm
alone under delayed scaling, ≤ 1.6× under current scaling (Liger's RMSNorm: 0.095 ms published at
that shape) and ≥ 1.3× faster than RMSNorm-then-quantize. On CUDA the tables are appended to
BENCHMARKS.md with the date, the device and the torch / Triton / CUDA versions (``--no-append`` to
skip; on CPU only with ``--append``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Callable, Optional

import torch
from tabulate import tabulate

# the repository root, for the experiments package (the script runs as python benchmarks/gpu_suite.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common
import bench_block
import bench_linear
import project_gpu
from experiments.fp8_cast_transpose import fp8_cast_transpose
from experiments.fp8_gemm import fp8_gemm_amax
from te_compile.gemm import fp8_gemm
from te_compile.kernels.float8_block_quantize import float8_block_quantize
from te_compile.kernels.mxfp8_quantize import mxfp8_quantize
from te_compile.kernels.norm_quantize import NormSpec, norm_quantize, norm_stats
from te_compile.kernels.nvfp4_quantize import nvfp4_quantize
from te_compile.models import Block
from te_compile.scaling import cast_to_fp8, compute_scale, tensor_amax

PARTS = ("linear", "block", "quantize", "epilogue", "norm", "projection")
BENCHMARKS_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "BENCHMARKS.md")
E4M3 = torch.float8_e4m3fn

# per device: linear cubes, the GPT block (B, T, C), the quantize input [M, K], the projected block
# (B, T, C, heads; project_gpu.py's default shape on CUDA)
SHAPES = {
    "cuda": {"linear": (4096, 8192), "block": (2, 2048, 4096), "quantize": (8192, 8192), "epilogue": (4096, 8192),
             "norm": (4096, 16384), "projection": (8, 2048, 4096, 32)},
    "cpu": {"linear": (128,), "block": (2, 32, 64), "quantize": (512, 512), "epilogue": (128,), "norm": (256, 512),
            "projection": (2, 32, 64, 4)},
}
GOALS = {"linear": 1.7, "block": 1.35, "block_vs_torchao": 1.1, "quantize": 0.85,
         "norm_delayed": 1.1, "norm_current": 1.6, "norm_vs_unfused": 1.3}


# ---- linear and block: the providers of bench_linear.py / bench_block.py ---------------------------------

def _run_cases(cases, device, args) -> list[_common.Row]:
    rows = []
    for size, flops, build in cases:
        baseline = None
        for provider in _common.providers(device):
            if args.recipes and provider.name.startswith("te ") and provider.name.split()[1] not in args.recipes:
                continue
            first, median, note = _common.run_provider(provider, build, device, args)
            if provider.name == "inductor":
                baseline = median
            rows.append(_common.make_row(size, provider, first, median, flops, baseline, args, note))
            print(f"  {size:>12}  {provider.name:<36} "
                  f"{'n/a' if median is None else f'{median * 1e3:.3f} ms'}", flush=True)
    return rows


def linear_rows(device, dtype, args) -> list[_common.Row]:
    cases = [(f"{s}x{s}x{s}", 6.0 * s ** 3, bench_linear._builder(s, s, s, device, dtype))
             for s in SHAPES[device.type]["linear"]]
    return _run_cases(cases, device, args)


def block_rows(device, dtype, args) -> list[_common.Row]:
    b, t, c = SHAPES[device.type]["block"]
    flops = bench_block._flops(b, t, c, 1, dtype)
    return _run_cases([(f"{b}x{t}x{c}", flops, bench_block._builder(b, t, c, 1, device, dtype))], device, args)


# ---- quantize ------------------------------------------------------------------------------------------

def _per_tensor(x: torch.Tensor):
    """What an FP8 linear does to its input under current scaling: amax, scale, the rowwise copy and
    the transposed one for wgrad (inductor generates the kernels)."""
    scale = compute_scale(tensor_amax(x), E4M3)
    return cast_to_fp8(x, scale, E4M3), cast_to_fp8(x.t().contiguous(), scale, E4M3)   # [M, K], [K, M]


def _quantize_ops(x: torch.Tensor) -> dict[str, tuple[Callable, int]]:
    """name -> (function of x, bytes it must write) for x [M, K]."""
    m, k = x.shape
    amax = x.abs().amax().float().reshape(1)
    scale = torch.ones(1, device=x.device)
    return {
        "FP8 per-tensor, rowwise + transposed (inductor)": (torch.compile(_per_tensor, dynamic=False), 2 * m * k),
        "FP8 per-tensor, cast + transpose + amax": (lambda t: fp8_cast_transpose(t, scale, E4M3), 2 * m * k),
        "MXFP8 1x32": (lambda t: mxfp8_quantize(t, E4M3), m * k + m * k // 32),
        "FP8 block 1x128": (lambda t: float8_block_quantize(t, E4M3, tile_rows=1, force_pow_2_scales=True,
                                                             amax_epsilon=0.0), m * k + 4 * m * k // 128),
        "NVFP4 1x16": (lambda t: nvfp4_quantize(t, amax, tile_rows=1), m * k // 2 + m * k // 16),
    }


def quantize_rows(device, dtype, args) -> tuple[float, list[dict]]:
    m, k = SHAPES[device.type]["quantize"]
    x = torch.randn(m, k, device=device, dtype=dtype)
    y = torch.empty_like(x)
    copy_s = _common.time_step(lambda: y.copy_(x), device, args.iters, args.warmup)[1]
    copy_gbs = 2 * x.numel() * x.element_size() / copy_s / 1e9
    print(f"  copy {m}x{k} {dtype}: {copy_gbs:.1f} GB/s", flush=True)
    rows = []
    kind = "Triton kernel" if device.type == "cuda" else "reference, eager"
    for name, (fn, out_bytes) in _quantize_ops(x).items():
        try:
            s = _common.time_step(lambda: fn(x), device, args.iters, args.warmup)[1]
        except Exception as e:   # one kernel failing must not hide the others
            rows.append({"kernel": name, "ms": None, "GB/s": None, "of copy": None,
                         "note": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"})
            continue
        gbs = (x.numel() * x.element_size() + out_bytes) / s / 1e9
        rows.append({"kernel": name, "ms": s * 1e3, "GB/s": gbs, "of copy": gbs / copy_gbs,
                     "note": "" if "inductor" in name else kind})
        print(f"  {name:<48} {gbs:8.1f} GB/s", flush=True)
    return copy_gbs, rows


# ---- epilogue: the FP8 GEMM whose output feeds another FP8 linear ------------------------------------

def _unfused_gemm_amax_cast(a, b, sa, sb, out_scale):
    """Today's lowering: the GEMM in bf16, then its amax and its FP8 copy (inductor fuses these two)."""
    y = fp8_gemm(a, b, sa, sb, out_dtype=torch.bfloat16)
    return cast_to_fp8(y, out_scale, E4M3), tensor_amax(y)


def epilogue_rows(device, args) -> list[dict]:
    rows = []
    kind = "Triton kernel" if device.type == "cuda" else "reference, eager"
    for s in SHAPES[device.type]["epilogue"]:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(s, s, device=device, generator=gen).to(E4M3)
        b = torch.randn(s, s, device=device, generator=gen).to(E4M3).t()   # column-major, as the linears pass it
        sa, sb, out_scale = (torch.ones(1, device=device) for _ in range(3))
        cases = {
            "torch._scaled_mm (bf16 out), alone": lambda: fp8_gemm(a, b, sa, sb, out_dtype=torch.bfloat16),
            "torch._scaled_mm, then amax + FP8 cast (inductor)":
                lambda f=torch.compile(_unfused_gemm_amax_cast, dynamic=False): f(a, b, sa, sb, out_scale),
            "Triton GEMM + amax epilogue (bf16 out)": lambda: fp8_gemm_amax(a, b, sa, sb, torch.bfloat16),
            "Triton GEMM + amax epilogue (FP8 out)":
                lambda: fp8_gemm_amax(a, b, sa, sb, torch.bfloat16, out_scale, E4M3),
        }
        base = None
        for name, fn in cases.items():
            try:
                sec = _common.time_step(fn, device, args.iters, args.warmup)[1]
            except Exception as e:   # one case failing must not hide the others
                rows.append({"size": f"{s}^3", "case": name, "ms": None, "TFLOP/s": None, "vs unfused": None,
                             "note": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"})
                continue
            if "then amax" in name:
                base = sec
            rows.append({"size": f"{s}^3", "case": name, "ms": sec * 1e3, "TFLOP/s": 2.0 * s ** 3 / sec / 1e12,
                         "vs unfused": None, "note": kind if "Triton" in name else ""})
            print(f"  {s}^3  {name:<52} {sec * 1e3:8.3f} ms", flush=True)
        for r in rows:
            if r["size"] == f"{s}^3" and r["ms"] and base:
                r["vs unfused"] = base * 1e3 / r["ms"]
    return rows


# ---- norm: RMSNorm + per-tensor FP8 quantization -------------------------------------------------

_EPS = 1e-6


def _rms_norm(x, w):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, _EPS)


def _rms_norm_then_quantize(x, w, scale):
    """The unfused path: the norm's output in x's dtype, then its amax and both FP8 layouts; ``scale``
    None: current scaling (the scale from this amax), else delayed scaling's."""
    h = _rms_norm(x, w)
    amax = tensor_amax(h)
    s = compute_scale(amax, E4M3) if scale is None else scale
    return cast_to_fp8(h, s, E4M3), cast_to_fp8(h.t(), s, E4M3).contiguous(), amax


def _fused(x, w, spec, scale):
    """te's kernels: the stats pass (mean, rstd, the output's amax), then one pass writing both layouts."""
    mean, rstd, amax = norm_stats(x, w, None, spec)
    s = compute_scale(amax, E4M3) if scale is None else scale
    return norm_quantize(x, w, None, mean, rstd, s, spec, E4M3), amax


def norm_rows(device, dtype, args) -> list[dict]:
    m, k = SHAPES[device.type]["norm"]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
    w = torch.rand(k, device=device, dtype=dtype, generator=gen) + 0.5
    scale = torch.ones(1, device=device)
    spec = NormSpec("rms_norm", _EPS, prod_dtype=dtype)
    kind = "Triton kernels" if device.type == "cuda" else "references, eager"
    compiled = {name: torch.compile(fn, dynamic=False) for name, fn in
                (("norm", _rms_norm), ("unfused", _rms_norm_then_quantize))}
    cases = {
        "RMSNorm alone (inductor)": lambda: compiled["norm"](x, w),
        "RMSNorm then quantize, current scaling (inductor)": lambda: compiled["unfused"](x, w, None),
        "RMSNorm then quantize, delayed scaling (inductor)": lambda: compiled["unfused"](x, w, scale),
        "fused RMSNorm + quantize, current scaling (te)": lambda: _fused(x, w, spec, None),
        "fused RMSNorm + quantize, delayed scaling (te)": lambda: _fused(x, w, spec, scale),
    }
    rows = []
    for name, fn in cases.items():
        try:
            sec = _common.time_step(fn, device, args.iters, args.warmup)[1]
        except Exception as e:   # one case failing must not hide the others
            rows.append({"case": name, "ms": None, "note": f"failed: {type(e).__name__}: "
                                                            f"{str(e).splitlines()[0][:100]}"})
            continue
        rows.append({"case": name, "ms": sec * 1e3, "note": kind if "(te)" in name else ""})
        print(f"  {m}x{k}  {name:<52} {sec * 1e3:8.3f} ms", flush=True)
    return rows


# ---- projection: the block step measured beside project_gpu.py's H100 projection --------------------------

def _block_step(provider: project_gpu.BlockProvider, b: int, t: int, c: int, heads: int, device, dtype):
    """One forward + backward of a compiled Block, with a fixed output gradient: the step project_gpu.py
    projects. torchao emulates its FP8 GEMMs on a CPU (Float8LinearConfig(emulate=True))."""
    torch.manual_seed(0)
    model = Block(c, heads).to(device=device, dtype=dtype)
    fn = provider.compile(model, emulate=device.type == "cpu")
    # x, dy: [B, T, C]; x needs a gradient, as a block inside a deeper model does
    x = torch.randn(b, t, c, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        fn(x).backward(dy)
        x.grad = None
        model.zero_grad(set_to_none=True)
    return step


def projection_rows(device, dtype, args) -> list[dict]:
    b, t, c, heads = SHAPES[device.type]["projection"]
    names = [n for n in project_gpu.DEFAULT_PROVIDERS
             if not (args.recipes and n.startswith("te ") and n.split()[1].rstrip(",") not in args.recipes)]
    measured: dict[str, Optional[float]] = {}
    notes: dict[str, str] = {}
    for name in names:
        torch._dynamo.reset()
        try:
            step = _block_step(project_gpu.PROVIDERS[name], b, t, c, heads, device, dtype)
            measured[name] = _common.time_step(step, device, args.iters, args.warmup)[1]
        except Exception as e:   # one provider failing must not hide the others
            measured[name] = None
            first = str(e).strip().splitlines()[0][:100] if str(e).strip() else ""
            notes[name] = f"failed: {type(e).__name__}: {first}"
        ms = measured[name]
        print(f"  {b}x{t}x{c}  {name:<40} {'n/a' if ms is None else f'{ms * 1e3:.3f} ms'}", flush=True)
    torch._dynamo.reset()
    print("  projecting (H100 model, fake tensors):", flush=True)
    projected = project_gpu.project_block(b, t, c, heads, names, log=lambda line: print(line, flush=True))
    hw = project_gpu.Hardware()
    proj = {n: (p.seconds(hw) if p.kernels else None) for n, p in projected.items()}
    rows = []
    for name in names:
        m, p = measured[name], proj.get(name)
        base_m, base_p = measured.get("inductor"), proj.get("inductor")
        rows.append({"provider": name, "measured ms": None if m is None else m * 1e3,
                     "projected H100 ms": None if p is None else p * 1e3,
                     "measured / projected": m / p if m and p else None,
                     "measured vs inductor": base_m / m if m and base_m else None,
                     "projected vs inductor": base_p / p if p and base_p else None,
                     "note": notes.get(name) or projected[name].note})
    return rows


def _projection_goals(rows, size: str) -> list[str]:
    by = {r["provider"]: r for r in rows}
    fmt = (lambda v: "n/a" if v is None else f"{v:.2f}x")
    out = []
    for name in ("te Float8CurrentScaling", "te DelayedScaling"):
        if name not in by:
            continue
        ratios = {}
        for kind in ("measured", "projected"):
            key = "measured ms" if kind == "measured" else "projected H100 ms"
            mine, ao = by[name][key], by.get("torchao float8", {}).get(key)
            ratios[kind] = (by[name][f"{kind} vs inductor"], ao / mine if ao and mine else None)
        out.append(f"GPT block fwd + bwd {size}, {name}: {fmt(ratios['measured'][0])} vs inductor (projected "
                   f"{fmt(ratios['projected'][0])}, goal >= {GOALS['block']}x), {fmt(ratios['measured'][1])} vs "
                   f"torchao float8 (projected {fmt(ratios['projected'][1])}, goal >= {GOALS['block_vs_torchao']}x)")
    return out


def _norm_goals(rows) -> list[str]:
    ms = {r["case"]: r["ms"] for r in rows}
    alone = ms.get("RMSNorm alone (inductor)")
    out = []
    for recipe, goal in (("delayed", GOALS["norm_delayed"]), ("current", GOALS["norm_current"])):
        fused = ms.get(f"fused RMSNorm + quantize, {recipe} scaling (te)")
        unfused = ms.get(f"RMSNorm then quantize, {recipe} scaling (inductor)")
        if fused and alone:
            out.append(f"fused RMSNorm + quantize, {recipe} scaling: {fused / alone:.2f}x RMSNorm alone "
                       f"(goal <= {goal}x)")
        if fused and unfused:
            out.append(f"fused RMSNorm + quantize, {recipe} scaling: {unfused / fused:.2f}x faster than "
                       f"RMSNorm then quantize (goal >= {GOALS['norm_vs_unfused']}x)")
    return out


# ---- summary and BENCHMARKS.md -------------------------------------------------------------------------

def _ratio(rows, size: str, provider: str, base: str = "inductor") -> Optional[float]:
    by = {(r.size, r.provider): r.median_ms for r in rows}
    a, b = by.get((size, provider)), by.get((size, base))
    return b / a if a and b else None


def goal_lines(device, results) -> list[str]:
    out = []
    fmt = (lambda v: "n/a" if v is None else f"{v:.2f}x")
    if "linear" in results:
        s = max(SHAPES[device.type]["linear"])
        size = f"{s}x{s}x{s}"
        out.append(f"FP8 linear at {size}, te Float8CurrentScaling vs inductor: "
                   f"{fmt(_ratio(results['linear'], size, 'te Float8CurrentScaling'))} (goal >= {GOALS['linear']}x)")
    if "block" in results:
        rows = results["block"]
        size = rows[0].size
        for recipe in ("Float8CurrentScaling", "DelayedScaling"):
            out.append(f"GPT block {size}, te {recipe}: {fmt(_ratio(rows, size, 'te ' + recipe))} vs inductor "
                       f"(goal >= {GOALS['block']}x), {fmt(_ratio(rows, size, 'te ' + recipe, 'torchao float8'))} "
                       f"vs torchao float8 (goal >= {GOALS['block_vs_torchao']}x)")
    if "quantize" in results:
        _, rows = results["quantize"]
        for r in rows:
            share = "n/a" if r["of copy"] is None else f"{100 * r['of copy']:.0f}%"
            out.append(f"quantize {r['kernel']}: {share} of copy bandwidth (goal >= {100 * GOALS['quantize']:.0f}%)")
    if "epilogue" in results:
        for r in results["epilogue"]:
            if r["case"] == "Triton GEMM + amax epilogue (FP8 out)" and r["vs unfused"] is not None:
                out.append(f"FP8 GEMM + amax epilogue at {r['size']}: {r['vs unfused']:.2f}x the unfused path "
                           f"(> 1: wire it into the lowerings)")
    if "norm" in results:
        out += _norm_goals(results["norm"])
    if "projection" in results:
        b, t, c, _ = SHAPES[device.type]["projection"]
        out += _projection_goals(results["projection"], f"{b}x{t}x{c}")
    return out


def _row_table(rows: list[_common.Row]) -> str:
    f = _common._fmt
    return tabulate([(r.size, r.provider, f(r.median_ms, ".3f"), f(r.tflops, ".1f"), f(r.pct_peak, ".1f", "%"),
                      f(r.speedup_vs_inductor, ".2f", "x"), f(r.first_call_s, ".1f"), r.note) for r in rows],
                    headers=["size", "provider", "median ms", "TFLOP/s", "% of peak", "vs inductor",
                             "first call s", "note"], disable_numparse=True)


def report(device, args, results) -> str:
    """The suite's text: what ran where, each table, the goals."""
    cuda = torch.version.cuda or "none"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    lines = [f"{datetime.date.today().isoformat()}, {_common.describe_machine(device)}, Triton {triton_version}, "
             f"CUDA {cuda}", f"command: python benchmarks/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}",
             f"median of {args.iters} iterations after {args.warmup} warm-up; {_common.precision_note(device)}", ""]
    if "linear" in results:
        lines += ["linear (forward + backward, bias-free):", _row_table(results["linear"]), ""]
    if "block" in results:
        lines += ["GPT block training step (one block, AdamW):", _row_table(results["block"]), ""]
    if "quantize" in results:
        copy_gbs, rows = results["quantize"]
        m, k = SHAPES[device.type]["quantize"]
        lines += [f"quantize {m}x{k} (copy bandwidth {copy_gbs:.1f} GB/s):",
                  tabulate(rows, headers="keys", floatfmt=".2f", missingval="-"), ""]
    if "epilogue" in results:
        lines += ["FP8 GEMM feeding an FP8 linear (output in bf16 or FP8, with its amax):",
                  tabulate(results["epilogue"], headers="keys", floatfmt=".2f", missingval="-"), ""]
    if "norm" in results:
        m, k = SHAPES[device.type]["norm"]
        lines += [f"RMSNorm + per-tensor FP8 quantize, forward, {m}x{k} (Liger's RMSNorm alone: 0.095 ms "
                  f"published on an H100 at 4096x16384 bf16):",
                  tabulate(results["norm"], headers="keys", floatfmt=".3f", missingval="-"), ""]
    if "projection" in results:
        b, t, c, heads = SHAPES[device.type]["projection"]
        where = "" if device.type == "cuda" else " (CPU: the measurement is fp32 on this CPU, the projection an H100's)"
        lines += [f"GPT block forward + backward, {b}x{t}x{c}, {heads} heads, measured beside project_gpu.py's H100 "
                  f"projection{where}:",
                  tabulate(results["projection"], headers="keys", floatfmt=".3f", missingval="-"), ""]
    lines += ["goals:"] + [f"- {g}" for g in goal_lines(device, results)]
    return "\n".join(lines)


def append_to_benchmarks(device, text: str) -> None:
    title = f"\n## GPU suite: {datetime.date.today().isoformat()}, {_common.describe_machine(device)}\n\n"
    with open(BENCHMARKS_MD, "a") as f:
        f.write(title + "```\n" + text + "\n```\n")
    print(f"\nappended to {BENCHMARKS_MD}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run (default: all)")
    parser.add_argument("--recipes", nargs="+", metavar="RECIPE",
                        help="te recipes to include (default: every recipe the backend supports)")
    append = parser.add_mutually_exclusive_group()
    append.add_argument("--append", action="store_true", help="append to BENCHMARKS.md (default on CUDA)")
    append.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
    _common.add_common_args(parser)
    args = parser.parse_args()
    default_iters = args.iters is None
    device = _common.resolve_device(args)
    if device.type == "cpu" and default_iters:
        args.iters = 5   # the CPU run only keeps the script working
    dtype = _common.baseline_dtype(device)
    print(f"gpu_suite: {_common.describe_machine(device)}; parts: {', '.join(args.only)}", flush=True)
    results: dict = {}
    if "linear" in args.only:
        print("linear:", flush=True)
        results["linear"] = linear_rows(device, dtype, args)
    if "block" in args.only:
        print("GPT block:", flush=True)
        results["block"] = block_rows(device, dtype, args)
    if "quantize" in args.only:
        print("quantize:", flush=True)
        results["quantize"] = quantize_rows(device, dtype, args)
    if "epilogue" in args.only:
        print("FP8 GEMM epilogue:", flush=True)
        results["epilogue"] = epilogue_rows(device, args)
    if "norm" in args.only:
        print("RMSNorm + quantize:", flush=True)
        results["norm"] = norm_rows(device, dtype, args)
    if "projection" in args.only:
        print("GPT block step, measured and projected:", flush=True)
        results["projection"] = projection_rows(device, dtype, args)
    text = report(device, args, results)
    print("\n" + text)
    if args.append or (device.type == "cuda" and not args.no_append):
        append_to_benchmarks(device, text)


if __name__ == "__main__":
    main()
