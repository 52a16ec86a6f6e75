"""What bench_linear.py and bench_block.py share: providers, timing, peaks, table and JSON output.

A provider turns a plain ``nn.Module`` into the callable that is timed:
- ``inductor``: ``torch.compile`` with inductor in high precision (the baseline; bf16 on CUDA, fp32 on
  CPU, where bf16 matmuls are extremely slow);
- ``te <Recipe>``: ``torch.compile(backend=te_compile.backend(recipe=...))`` for every recipe the
  backend supports;
- ``torchao float8`` (tensorwise) / ``torchao float8 rowwise``: the peer a user would pick instead,
  ``torchao.float8.convert_to_float8_training`` (a module swap) + inductor, when torchao imports
  (``pip install -e '.[bench]'``). Tensorwise (torchao's default: per-tensor dynamic scales, E4M3
  forward, E5M2 grad_output) is the peer of te's per-tensor recipes; rowwise (per-row power-of-two
  scales, E4M3 everywhere) the closest peer of te's block recipes. On CUDA torchao runs its own FP8
  GEMMs; elsewhere ``emulate=True``, its fp32 matmul of the dequantized FP8 values, the counterpart
  of te's CPU GEMMs (fp32 matmuls of the FP8 values). torchao's non-emulated path also runs on a CPU,
  through torch 2.13's CPU ``torch._scaled_mm`` and its scalar upcasts, which te avoids; it is not
  measured.

Every provider of a case gets a deep copy of one model instance and the same data.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import statistics
import traceback
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from tabulate import tabulate

import te_compile
from te_compile.cli import _torchao_float8   # the demo's peer conversion, shared with every torchao row

# Dense tensor-core peaks of an H100 SXM (NVIDIA datasheet, without sparsity), in TFLOP/s.
H100_SXM_BF16_TFLOPS = 989.0
H100_SXM_FP8_TFLOPS = 1979.0

# The recipes the te backend can compile now, with the options each needs.
TE_RECIPES = {
    "Float8CurrentScaling": {},
    "DelayedScaling": {"amax_history_len": 16},
    "CustomRecipe": {"qfactory": "te_compile.custom_recipes.quantization_current_scaling:"
                                 "current_scaling_ref_quantizer_factory"},
    # block-scaled recipes: native GEMMs (F.scaled_mm) where the device passes te_compile's self-test,
    # else emulated; on CUDA each also gets an "emulated" row (native_block_gemm = false) to compare
    "MXFP8BlockScaling": {},
    "Float8BlockScaling": {},
    "NVFP4BlockScaling": {},
}

BLOCK_RECIPES = ("MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling")

# torchao float8 recipes (Float8LinearConfig.from_recipe_name) measured beside te's: tensorwise for
# the per-tensor recipes, rowwise for the block recipes
TORCHAO_RECIPES = ("tensorwise", "rowwise")
TORCHAO_MISSING = "torchao not installed (pip install -e '.[bench]')"


def torchao_available() -> bool:
    """Whether torchao.float8 imports (the ``bench`` extra)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def torchao_convert(model: torch.nn.Module, recipe: str, device: torch.device) -> torch.nn.Module:
    """``model`` with its linears swapped for torchao's Float8Linear, in place (what a torchao user
    writes before ``torch.compile``): the demo's peer conversion (linears whose dims are not multiples
    of 16 stay as they are), with torchao's own FP8 GEMMs on CUDA and ``emulate=True`` elsewhere.
    Raises ImportError without torchao."""
    if recipe not in TORCHAO_RECIPES:
        raise ValueError(f"torchao recipe must be one of {TORCHAO_RECIPES}, got {recipe!r}")
    return _torchao_float8(model, emulate=torch.device(device).type != "cuda", recipe=recipe)


def torchao_note(recipe: str, device: torch.device) -> str:
    """What a torchao row runs, for its note column."""
    gemm = "FP8 GEMMs" if torch.device(device).type == "cuda" else "emulate=True"
    return f"{recipe}, {gemm}, inductor"


@dataclass
class Provider:
    name: str
    fp8: bool                                   # judged against the FP8 peak
    prepare: Optional[Callable]                 # nn.Module -> callable; None: not available
    note: str = ""                              # why it is not available, or what it runs


@dataclass
class Row:
    size: str
    provider: str
    median_ms: Optional[float]
    tflops: Optional[float]
    pct_peak: Optional[float]
    speedup_vs_inductor: Optional[float]
    first_call_s: Optional[float]               # compile + first run
    note: str = ""


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="default: cuda when available, else cpu")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed iterations per provider (default: 20 on CPU, 100 on CUDA)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed iterations after the first (compiling) call (default: 3)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help=f"high-precision peak of the device for %% of peak (default on CUDA: "
                             f"{H100_SXM_BF16_TFLOPS:g}, H100 SXM bf16 dense; on CPU: n/a)")
    parser.add_argument("--peak-fp8-tflops", type=float, default=None,
                        help=f"FP8 peak for the te/torchao rows (default on CUDA: "
                             f"{H100_SXM_FP8_TFLOPS:g}, H100 SXM fp8 dense; on CPU: n/a)")
    parser.add_argument("--json", metavar="OUT.json", help="also write the rows as JSON")


def resolve_device(args: argparse.Namespace) -> torch.device:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available")
    if args.iters is None:
        args.iters = 100 if device.type == "cuda" else 20
    if device.type == "cuda":
        args.peak_tflops = args.peak_tflops or H100_SXM_BF16_TFLOPS
        args.peak_fp8_tflops = args.peak_fp8_tflops or H100_SXM_FP8_TFLOPS
    return device


def baseline_dtype(device: torch.device) -> torch.dtype:
    # bf16 matmuls are extremely slow on CPUs without AMX: compare against fp32 there.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def describe_machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{os.cpu_count()}-core CPU ({platform.machine()}), torch {torch.__version__}"


def precision_note(device: torch.device) -> str:
    if device.type == "cuda":
        return ("inductor baseline in bf16; te per-tensor rows run FP8 GEMMs (torch._scaled_mm); block "
                "rows run F.scaled_mm where te_compile's self-test passed on this GPU (else emulated), "
                "and their '(emulated)' twins force the dequantize-then-matmul emulation")
    return ("CPU: the inductor baseline runs in fp32 (bf16 matmuls are very slow on this CPU); the "
            "te rows' FP8 GEMMs are fp32 matmuls of the FP8 values (torch._scaled_mm's bits) and the "
            "torchao rows run emulate=True (fp32 matmuls of the dequantized values), so both are "
            "expected to be slower than fp32 here")


def providers(device: torch.device, rowwise: bool = False) -> list[Provider]:
    """inductor, te with each recipe, torchao tensorwise ("torchao float8", the name gpu_suite.py's
    goals look up) and, with ``rowwise``, torchao rowwise."""
    out = [Provider("inductor", False, lambda m: torch.compile(m, dynamic=False),
                    note=f"torch.compile, {str(baseline_dtype(device)).replace('torch.', '')}")]
    for recipe, options in TE_RECIPES.items():
        def prepare(m, recipe=recipe, options=options):
            return torch.compile(m, backend=te_compile.backend(recipe=recipe, **options), dynamic=False)
        out.append(Provider(f"te {recipe}", True, prepare))
        if device.type == "cuda" and recipe in BLOCK_RECIPES:
            def prepare_emulated(m, recipe=recipe, options=options):
                backend = te_compile.backend(recipe=recipe, native_block_gemm=False, **options)
                return torch.compile(m, backend=backend, dynamic=False)
            out.append(Provider(f"te {recipe} (emulated)", True, prepare_emulated,
                                note="native_block_gemm = false"))
    available = torchao_available()
    for recipe in TORCHAO_RECIPES if rowwise else ("tensorwise",):
        def prepare_ao(m, recipe=recipe):
            return torch.compile(torchao_convert(m, recipe, device), dynamic=False)
        name = "torchao float8" if recipe == "tensorwise" else f"torchao float8 {recipe}"
        out.append(Provider(name, True, prepare_ao if available else None,
                            note=torchao_note(recipe, device) if available else TORCHAO_MISSING))
    return out


def fresh_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model``: every provider starts from the same instance's weights."""
    return copy.deepcopy(model)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[], None], device: torch.device, iters: int, warmup: int
              ) -> tuple[float, float]:
    """(seconds of the first call (compile), median seconds per call over ``iters`` calls)."""
    t0 = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def make_row(size: str, provider: Provider, first_s: Optional[float], median_s: Optional[float],
             flops: float, baseline_s: Optional[float], args: argparse.Namespace, note: str = "") -> Row:
    if median_s is None:
        return Row(size, provider.name, None, None, None, None, None, note or provider.note)
    tflops = flops / median_s / 1e12
    peak = args.peak_fp8_tflops if provider.fp8 else args.peak_tflops
    return Row(size, provider.name, median_s * 1e3, tflops, 100.0 * tflops / peak if peak else None,
               baseline_s / median_s if baseline_s else None, first_s, note or provider.note)


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def print_table(rows: list[Row]) -> None:
    table = [(r.size, r.provider, _fmt(r.median_ms, ".3f"), _fmt(r.tflops, ".4f"),
              _fmt(r.pct_peak, ".1f", "%"), _fmt(r.speedup_vs_inductor, ".2f", "x"),
              _fmt(r.first_call_s, ".1f"), r.note) for r in rows]
    print(tabulate(table, headers=["size", "provider", "median ms", "TFLOP/s", "% of peak",
                                   "vs inductor", "first call s", "note"], disable_numparse=True))


def write_json(path: str, bench: str, device: torch.device, args: argparse.Namespace,
               rows: list[Row]) -> None:
    payload = {
        "benchmark": bench,
        "date": datetime.date.today().isoformat(),
        "machine": describe_machine(device),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "precision": precision_note(device),
        "iters": args.iters,
        "peak_tflops": args.peak_tflops,
        "peak_fp8_tflops": args.peak_fp8_tflops,
        "rows": [asdict(r) for r in rows],
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"\nwrote {path}")


def failure_note(e: Exception, limit: int = 120) -> str:
    """A provider's table note for ``e`` ("failed: <type>: <first line>"), after the whole traceback on
    stderr: the table keeps one line, and a lent GPU's log is all there is."""
    traceback.print_exc()
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"failed: {type(e).__name__}: {msg[:limit]}"


def run_provider(provider: Provider, build: Callable, device: torch.device,
                 args: argparse.Namespace) -> tuple[Optional[float], Optional[float], str]:
    """Compile ``build()``'s step with ``provider`` and time it: (first_s, median_s, note)."""
    if provider.prepare is None:
        return None, None, provider.note
    torch._dynamo.reset()  # every provider and size compiles from scratch, with static shapes
    try:
        step = build(provider.prepare)
        first, median = time_step(step, device, args.iters, args.warmup)
    except Exception as e:  # one provider failing must not hide the others' results
        return None, None, failure_note(e)
    return first, median, provider.note


def parse_sizes(text: str, form: str) -> list[tuple[int, ...]]:
    """"64x128x256,..." -> [(64, 128, 256), ...]; ``form`` names the dims ("MxKxN", "MxK"): their
    count is the number of numbers each size must have, and errors quote it."""
    ndims = form.lower().count("x") + 1
    sizes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != ndims or not all(p.strip().isdigit() for p in parts):
            raise SystemExit(f"--sizes: expected {form}[,{form}...], got {item!r}")
        sizes.append(tuple(int(p) for p in parts))
    return sizes


def compare(cases, device: torch.device, args: argparse.Namespace, ms_digits: int) -> list[Row]:
    """Run every provider (torchao rowwise included) on every case, printing each median as it comes.

    cases: (size label, FLOPs per step, builder for run_provider). Speedups are against the
    "inductor" provider of the same case.
    """
    rows = []
    for size, flops, build in cases:
        baseline = None
        for provider in providers(device, rowwise=True):
            first, median, note = run_provider(provider, build, device, args)
            if provider.name == "inductor":
                baseline = median
            rows.append(make_row(size, provider, first, median, flops, baseline, args, note))
            print(f"  {size:>16}  {provider.name:<24} "
                  f"{'n/a' if median is None else f'{median * 1e3:.{ms_digits}f} ms'}", flush=True)
    return rows


def finish(rows: list[Row], bench: str, device: torch.device, args: argparse.Namespace) -> None:
    """Print the table and write the JSON file if one was asked for."""
    print()
    print_table(rows)
    if args.json:
        write_json(args.json, bench, device, args, rows)


@contextlib.contextmanager
def wrapping_inductor_inner(wrap: Callable[[Callable], Callable]):
    """While active, every inductor compile (``compile_fx``, which the te backend imports at call
    time) runs its AOT graphs through ``wrap(inner_compile)`` instead of ``inner_compile``.

    compile_fx calls itself when given config patches, with its inner compiler already wrapped: a
    mark on the wrapper (functools.wraps in compile_fx copies it) keeps a graph going through
    ``wrap`` once."""
    import torch._inductor.compile_fx as cfx

    original = cfx.compile_fx

    def compile_fx(gm, example_inputs, inner_compile=None, **kwargs):
        inner = inner_compile or cfx.compile_fx_inner
        if not getattr(inner, "_bench_wrapped", False):
            inner = wrap(inner)
            inner._bench_wrapped = True
        return original(gm, example_inputs, inner_compile=inner, **kwargs)

    cfx.compile_fx = compile_fx
    try:
        yield
    finally:
        cfx.compile_fx = original
