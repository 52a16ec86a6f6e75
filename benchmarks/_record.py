"""How every lease-kit measurement is timed, profiled and written down.

One row per measurement goes to a JSON-lines file (``results.jsonl``); a lease's file is committed as
``benchmarks/results/<date>-<device>.jsonl`` so figures can be compared across leases by a script.
A row carries at least::

    part      step | block | linear | moe | attention | quantize | norm | ceiling | smoke | ...
    provider  "bf16 ...", "te <Recipe>" or "torchao ..." (e.g. "te Float8CurrentScaling")
    shape     the sizes, the model shape's name and "fwd" or "fwd+bwd" ("1x8192 llama3-8b-4L fwd+bwd")
    metric    tokens_per_s | ms | GB/s | TFLOP/s | ...
    median, spread (p90 - p10 where timed), device, torch, triton, cuda, date, git, run

Timing on CUDA uses events recorded between back-to-back steps with a single synchronize at the end:
a host sync per step adds the launch latency of the next step to every sample (a copy measured that
way read 2661 GB/s against about 3.0 TB/s). On a CPU each step is timed with ``perf_counter``.

The profile keeps device kernels only (CUDA kernels, memcpy, memset), summed per step, so that the
per-step sum can be set against the event-timed step: CPU-side op times overlap the kernels they
launch, and adding them made earlier profiles exceed the measured step. Kernel names are written in
full: inductor's names (``triton_poi_fused_add_mul_0``) are the key that joins a kernel to its code.

``provider_cache_dir`` gives each provider its own inductor and Triton cache, so the code a provider's
one compile generated can be archived afterwards; call it before the first ``torch.compile``.
"""

from __future__ import annotations

import csv
import datetime
import functools
import json
import os
import re
import statistics
import subprocess
import time
from collections import defaultdict
from typing import Callable, Optional

import torch

__all__ = [
    # what a row says about the machine
    "device_info",
    # writing rows
    "write_row", "PARTS", "PROVIDER_PREFIXES", "KERNEL_COLUMNS",
    # timing and profiling
    "time_steps", "bench_kernel", "profile_steps",
    # per-provider generated code
    "provider_cache_dir", "provider_slug",
]

# Parts a row may name; lease_report.py and the kit's test check rows against these.
PARTS = ("setup", "step", "block", "linear", "moe", "attention", "quantize", "norm", "ceiling",
         "smoke", "ncu", "tests")
PROVIDER_PREFIXES = ("bf16", "te", "torchao")

# kernels.csv columns, in order; calls and times are totals over the profiled steps
KERNEL_COLUMNS = ("part", "provider", "shape", "kernel", "calls", "total_us", "avg_us", "per_step_us",
                  "calls_per_step", "steps", "step_sum_us", "step_ms", "device", "run")


def _git_revision() -> str:
    """HEAD of the checkout this file sits in; the device's copy of the tree may have no .git, in which
    case the lease command passes the revision as TE_COMPILE_REV."""
    if os.environ.get("TE_COMPILE_REV"):
        return os.environ["TE_COMPILE_REV"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


@functools.lru_cache(maxsize=None)
def device_info() -> dict:
    """Where the rows were measured: device name (the GPU's, or "cpu"), torch, triton and CUDA
    versions, the UTC day and the git revision. Cached: every row of a process says the same."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device, sm = props.name, f"sm{props.major}{props.minor}"
    else:
        device, sm = "cpu", ""
    return {
        "device": device,
        "sm": sm,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda or "none",
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "git": _git_revision(),
    }


def _check_row(part: str, provider: str) -> None:
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if not provider.split(" ", 1)[0] in PROVIDER_PREFIXES:
        raise ValueError(f"provider must begin with one of {PROVIDER_PREFIXES} (e.g. "
                         f"'te Float8CurrentScaling'), got {provider!r}")


def write_row(path: str, *, part: str, provider: str, shape: str, metric: str, median: Optional[float],
              spread: Optional[float] = None, **extra) -> dict:
    """Append one measurement to the JSON-lines file ``path`` and return the row.

    ``median`` may be None for a provider that failed or was skipped (say why in ``note=``). Extra
    keyword arguments (p10, p90, samples, note, ...) are stored beside the required keys."""
    _check_row(part, provider)
    if not isinstance(shape, str) or not shape:
        raise ValueError(f"shape must be a non-empty string naming the sizes, got {shape!r}")
    row = {"part": part, "provider": provider, "shape": shape, "metric": metric,
           "median": None if median is None else float(median),
           "spread": None if spread is None else float(spread)}
    info = device_info()
    for key in ("device", "torch", "triton", "cuda", "date", "git"):
        row[key] = info[key]
    # which invocation of lease.sh wrote the row: a part rerun on a warm machine adds rows, and readers
    # keep the latest run's
    row["run"] = os.environ.get("LEASE_RUN", "")
    row.update(extra)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    return row


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list (q in [0, 100])."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _summary(samples_ms: list[float]) -> dict:
    ordered = sorted(samples_ms)
    return {"median_ms": statistics.median(ordered), "p10_ms": _percentile(ordered, 10),
            "p90_ms": _percentile(ordered, 90), "samples": list(samples_ms)}


def time_steps(step_fn: Callable[[], object], *, warmup: int, iters: int,
               device: Optional[torch.device] = None) -> dict:
    """Time ``iters`` back-to-back calls of ``step_fn`` after ``warmup`` untimed ones.

    Returns {median_ms, p10_ms, p90_ms, samples} (samples in ms, one per step). On CUDA (the default
    when a GPU is present) an event is recorded between consecutive steps, so step i's time is
    event[i] -> event[i + 1] on the stream, and the host synchronizes once after the last step: the
    GPU never idles waiting for the host between steps. On a CPU, ``perf_counter`` around each step.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    cuda = (torch.device(device).type == "cuda") if device is not None else torch.cuda.is_available()
    for _ in range(warmup):
        step_fn()
    if cuda:
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record()
        for i in range(iters):
            step_fn()
            events[i + 1].record()
        torch.cuda.synchronize()
        samples = [events[i].elapsed_time(events[i + 1]) for i in range(iters)]
    else:
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step_fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return _summary(samples)


def bench_kernel(fn: Callable[[], object], *, graph: bool = False, device: Optional[torch.device] = None) -> dict:
    """Time one kernel-sized call like ``time_steps`` (same keys; samples empty on CUDA).

    On CUDA ``triton.testing.do_bench`` (L2 flushed between calls, events around each) or, with ``graph``,
    ``do_bench_cudagraph`` (the calls replayed from a CUDA graph: no launch overhead at all); on a CPU
    ``time_steps`` with a few iterations."""
    cuda = (torch.device(device).type == "cuda") if device is not None else torch.cuda.is_available()
    if not cuda:
        return time_steps(fn, warmup=1, iters=5)
    from triton import testing

    quantiles = [0.5, 0.1, 0.9]
    if graph:
        median, p10, p90 = testing.do_bench_cudagraph(fn, rep=100, quantiles=quantiles)
    else:
        median, p10, p90 = testing.do_bench(fn, warmup=25, rep=100, quantiles=quantiles)
    return {"median_ms": median, "p10_ms": p10, "p90_ms": p90, "samples": []}


def _is_device_event(evt) -> bool:
    """A kernel, memcpy or memset that ran on the GPU (not a CPU op, a runtime call, or a record_function
    range such as ``Optimizer.step#AdamW.step``, which the profiler puts on the GPU's timeline too)."""
    if getattr(evt, "is_user_annotation", False):
        return False
    device_type = getattr(evt, "device_type", None)
    return device_type is not None and device_type.name in ("CUDA", "PrivateUse1", "XPU", "MTIA")


def _cpu_self_events(events) -> list:
    """On a CPU there are no device kernels: every op's self time (its time less its children's), which
    do not overlap and sum to the profiled time; inductor's C++ kernels appear by name when
    ``cpp.enable_kernel_profile`` is on (lease.sh --dry sets it)."""
    return [e for e in events if e.self_cpu_time_total > 0 and e.name != "ProfilerStep*"]


def profile_steps(step_fn: Callable[[], object], *, steps: int, trace_path: str, csv_path: str,
                  part: str, provider: str, step_ms: Optional[float] = None, shape: str = "",
                  top: Optional[int] = None) -> list[dict]:
    """Profile ``steps`` calls of ``step_fn`` (already compiled and warm) with torch.profiler.

    Writes the Chrome trace to ``trace_path`` and appends one row per kernel to ``csv_path`` (columns
    KERNEL_COLUMNS; the header when the file is new): calls and microseconds over all steps, the
    average per call, the time per step, and the per-step sum over every kernel (``step_sum_us``),
    which lease_report.py sets against ``step_ms``, the event-timed step. Returns the rows, slowest
    first; ``top`` keeps only the slowest rows in the CSV (never truncates names)."""
    _check_row(part, provider)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step_fn()
        if cuda:
            torch.cuda.synchronize()
    os.makedirs(os.path.dirname(os.path.abspath(trace_path)), exist_ok=True)
    prof.export_chrome_trace(trace_path)

    events = prof.events()
    picked = [e for e in events if _is_device_event(e)] if cuda else _cpu_self_events(events)
    calls: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for evt in picked:
        calls[evt.name] += 1
        # a device event's own interval; a CPU op's self time
        total[evt.name] += evt.time_range.elapsed_us() if cuda else evt.self_cpu_time_total
    step_sum_us = sum(total.values()) / steps
    device = device_info()["device"]
    rows = [{"part": part, "provider": provider, "shape": shape, "kernel": name, "calls": calls[name],
             "total_us": round(total[name], 3), "avg_us": round(total[name] / calls[name], 3),
             "per_step_us": round(total[name] / steps, 3), "calls_per_step": calls[name] / steps,
             "steps": steps, "step_sum_us": round(step_sum_us, 3),
             "step_ms": None if step_ms is None else round(float(step_ms), 4), "device": device,
             "run": os.environ.get("LEASE_RUN", "")}
            for name in sorted(total, key=lambda n: -total[n])]
    kept = rows if top is None else rows[:top]
    os.makedirs(os.path.dirname(os.path.abspath(csv_path)), exist_ok=True)
    new = not os.path.exists(csv_path) or os.path.getsize(csv_path) == 0
    with open(csv_path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=KERNEL_COLUMNS)
        if new:
            writer.writeheader()
        writer.writerows(kept)
    return rows


def provider_slug(provider: str) -> str:
    """A file-name-safe name for a provider: "te Float8CurrentScaling" -> "te_Float8CurrentScaling"."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", provider.strip()).strip("_")
    if not slug:
        raise ValueError(f"provider must contain a letter or digit, got {provider!r}")
    return slug


def provider_cache_dir(root: str, provider: str) -> str:
    """Point inductor's and Triton's caches at ``root/<provider slug>/`` and return that folder.

    Call it before the first ``torch.compile`` in the process: inductor reads TORCHINDUCTOR_CACHE_DIR
    when it writes code, and Triton reads TRITON_CACHE_DIR when it first compiles. The folder then
    holds the provider's generated Python (inductor's output code and every Triton kernel's source)
    and the compiled kernels, for inductor_code.tar.gz."""
    folder = os.path.abspath(os.path.join(root, provider_slug(provider)))
    os.makedirs(os.path.join(folder, "inductor"), exist_ok=True)
    os.makedirs(os.path.join(folder, "triton"), exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
    return folder
