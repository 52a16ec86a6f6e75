"""What the benchmarks share: providers, the one loop that compiles and times each (``run_provider``),
peaks, table and JSON output.

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
import traceback
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from tabulate import tabulate

import _record
import te_compile
from te_compile.torchao_peer import torchao_float8   # the demo's peer conversion, shared with every torchao row

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
    return torchao_float8(model, emulate=torch.device(device).type != "cuda", recipe=recipe)


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
    """inductor, te with each recipe, torchao tensorwise ("torchao float8") and, with ``rowwise``,
    torchao rowwise."""
    out = [Provider("inductor", False, lambda m: torch.compile(m, dynamic=False),
                    note=f"torch.compile, {str(baseline_dtype(device)).replace('torch.', '')}")]
    for recipe, options in TE_RECIPES.items():
        def prepare(m, recipe=recipe, options=options):
            return torch.compile(m, backend=te_compile.backend(recipe=recipe, **options), dynamic=False)
        out.append(Provider(f"te {recipe}", True, prepare))
        if device.type == "cuda" and recipe == "Float8CurrentScaling":
            # te keeps a GPU's GEMMs no larger than 4096 x 4096 x 4096 in high precision ([rewrite]
            # small_gemms); this row times them in FP8, the measurement that moves that line
            def prepare_fp8(m, recipe=recipe, options=options):
                backend = te_compile.backend(recipe=recipe, rewrite={"small_gemms": "fp8"}, **options)
                return torch.compile(m, backend=backend, dynamic=False)
            out.append(Provider(f"te {recipe} (small GEMMs in FP8)", True, prepare_fp8,
                                note='[rewrite] small_gemms = "fp8"'))
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


def train_step(fn: Callable, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One training step of a GPT-style ``fn(x, y) -> (logits, loss)``: forward, backward, the
    optimizer's step, gradients set to None."""
    def step() -> None:
        _, loss = fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[], None], device: torch.device, iters: int, warmup: int
              ) -> tuple[float, float]:
    """(seconds of the first call (compile), median seconds per call over ``iters`` calls).

    The calls after the first are timed by ``_record.time_steps``: CUDA events between back-to-back
    calls, one synchronize at the end."""
    t0 = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - t0
    timing = _record.time_steps(step, warmup=warmup, iters=iters, device=device)
    return first, timing["median_ms"] / 1e3


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


def run_provider(provider: Provider, build: Callable, device: torch.device, args: argparse.Namespace,
                 measure: Optional[Callable[[], None]] = None) -> tuple[Optional[float], Optional[float], str]:
    """Compile ``build(provider.prepare)``'s step and time it: (first_s, median_s, note).

    ``measure``, when given, runs after the timing, under the same guard: a benchmark's own figures of
    the provider (bytes saved for backward, peak memory), which ``build`` made reachable to it. When
    it fails, the provider's times are dropped with the failure's note, as when the step fails."""
    if provider.prepare is None:
        return None, None, provider.note
    torch._dynamo.reset()  # every provider and size compiles from scratch, with static shapes
    te_compile.reset()     # and its report lists the sites of this provider's graphs only
    try:
        step = build(provider.prepare)
        first, median = time_step(step, device, args.iters, args.warmup)
        if measure is not None:
            measure()
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


# ---- the lease kit (benchmarks/lease.sh): one process per provider, rows through _record --------------

# The dense providers every lease part compares, by the names results rows carry
LEASE_PROVIDERS = ("bf16", "te Float8CurrentScaling", "te DelayedScaling", "torchao float8 tensorwise",
                   "torchao float8 rowwise")


def add_lease_args(parser: argparse.ArgumentParser, providers: tuple[str, ...]) -> None:
    """The options lease_parts.py passes to a benchmark run as one lease part."""
    group = parser.add_argument_group("lease kit (benchmarks/lease.sh runs these; see docs/benchmarks.md)")
    group.add_argument("--providers", nargs="+", metavar="NAME",
                       help=f"run only these providers, each compiled once (default: {', '.join(providers)}); "
                            "with --jsonl, rows go to results.jsonl instead of a table")
    group.add_argument("--jsonl", metavar="PATH", help="append one row per measurement (benchmarks/_record.py)")
    group.add_argument("--kernels-csv", metavar="PATH",
                       help="profile each provider's compiled step and append its kernels here")
    group.add_argument("--trace-dir", metavar="DIR", help="Chrome traces of the profiled steps")
    group.add_argument("--code-dir", metavar="DIR",
                       help="inductor and Triton caches, one folder per provider (its generated code)")
    group.add_argument("--profile-steps", type=int, default=2, help="steps under the profiler (default 2)")
    group.add_argument("--dry", action="store_true",
                       help="CPU at tiny shapes, providers compiled with aot_eager: checks the lease "
                            "kit end to end in seconds, measures nothing")
    group.add_argument("--ncu-target", action="store_true",
                       help="no timing: compile, warm up, then one step inside the NVTX range "
                            "'lease_ncu' (what ncu --nvtx-include profiles)")


def lease_compiler(args: argparse.Namespace) -> str:
    """inductor, or aot_eager in a dry run (a CPU compile of a te step takes a minute cold)."""
    return "aot_eager" if args.dry else "inductor"


def lease_backend(provider: str, args: argparse.Namespace, **te_options) -> Callable[[torch.nn.Module], Callable]:
    """nn.Module -> compiled callable for a lease provider name: "bf16" (torch.compile), "te <Recipe>"
    (backend="te", ``te_options`` added) or "torchao float8 <tensorwise|rowwise>" (module swap, then
    torch.compile). Raises ImportError for torchao providers without torchao."""
    compiler = lease_compiler(args)
    if provider.startswith("bf16"):
        return lambda m: torch.compile(m, backend=compiler, dynamic=False)
    if provider.startswith("te "):
        recipe = provider.split()[1]
        if recipe not in TE_RECIPES:
            raise ValueError(f"provider {provider!r}: recipe must be one of {tuple(TE_RECIPES)}")
        options = dict(TE_RECIPES[recipe], recipe=recipe, compiler=compiler, **te_options)
        return lambda m: torch.compile(m, backend=te_compile.backend(**options), dynamic=False)
    if provider.startswith("torchao float8"):
        recipe = provider.split()[-1]
        if not torchao_available():
            raise ImportError(TORCHAO_MISSING)
        device = "cuda" if torch.cuda.is_available() and not args.dry else "cpu"
        return lambda m: torch.compile(torchao_convert(m, recipe, device), backend=compiler, dynamic=False)
    raise ValueError(f"provider must begin with 'bf16', 'te <Recipe>' or 'torchao float8', got {provider!r}")


def lease_step(args: argparse.Namespace, *, part: str, provider: str, shape: str, build: Callable[[], Callable],
               warmup: int, iters: int, tokens: Optional[int] = None, flops: Optional[float] = None,
               **extra) -> Optional[float]:
    """Build, compile, time and profile one provider's step as one lease measurement; returns the median
    ms (None when it failed, and a row says why).

    ``build()`` returns the step (it compiles on its first call). The one compile serves the timed steps,
    the profile and the generated code under --code-dir. Rows: ``ms`` (event-timed median, spread =
    p90 - p10), ``tokens_per_s`` with ``tokens``, ``TFLOP/s`` with ``flops``."""
    if args.code_dir:
        _record.provider_cache_dir(os.path.join(args.code_dir, part), provider)
    torch._dynamo.reset()
    te_compile.reset()
    try:
        step = build()
        t0 = time.perf_counter()
        step()                          # compiles
        _sync(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        first_s = time.perf_counter() - t0
        if args.ncu_target:
            for _ in range(warmup):
                step()
            with torch.cuda.nvtx.range("lease_ncu") if torch.cuda.is_available() else contextlib.nullcontext():
                step()
            _sync(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
            print(f"{part} {provider}: ran one step in the NVTX range lease_ncu", flush=True)
            return None
        timing = _record.time_steps(step, warmup=warmup, iters=iters, device=lease_device(args))
    except Exception as e:   # one provider failing must not hide the others (Ctrl-C / SIGINT still stops)
        note = ("skipped: " + str(e)) if isinstance(e, ImportError) else failure_note(e, limit=300)
        print(f"{part} {provider}: {note}", flush=True)
        if args.jsonl:
            _record.write_row(args.jsonl, part=part, provider=provider, shape=shape, metric="ms", median=None,
                              note=note, **extra)
        return None
    median = timing["median_ms"]
    spread = timing["p90_ms"] - timing["p10_ms"]
    common = dict(part=part, provider=provider, shape=shape)
    row_extra = dict(extra, p10=timing["p10_ms"], p90=timing["p90_ms"], iters=iters, first_call_s=round(first_s, 2))
    _record.write_row(args.jsonl, metric="ms", median=median, spread=spread, **common, **row_extra)
    if tokens:
        _record.write_row(args.jsonl, metric="tokens_per_s", median=tokens / (median / 1e3),
                          spread=tokens / (timing["p10_ms"] / 1e3) - tokens / (timing["p90_ms"] / 1e3),
                          **common, **extra)
    if flops:
        _record.write_row(args.jsonl, metric="TFLOP/s", median=flops / (median / 1e3) / 1e12, **common, **extra)
    print(f"{part} {provider} {shape}: {median:.3f} ms (p10 {timing['p10_ms']:.3f}, p90 {timing['p90_ms']:.3f}), "
          f"first call {first_s:.1f} s", flush=True)
    if args.kernels_csv:
        trace_dir = args.trace_dir or os.path.dirname(os.path.abspath(args.kernels_csv))
        trace = os.path.join(trace_dir, f"{part}-{_record.provider_slug(provider)}-"
                                        f"{_record.provider_slug(shape)}.json")
        _record.profile_steps(step, steps=args.profile_steps, trace_path=trace, csv_path=args.kernels_csv,
                              part=part, provider=provider, step_ms=median, shape=shape)
    return median


def lease_device(args: argparse.Namespace) -> torch.device:
    """cuda unless --dry or no GPU; --dry forces the CPU so the kit's test runs anywhere."""
    if args.dry or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")
