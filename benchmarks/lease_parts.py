"""The Python half of the lease kit (benchmarks/lease.sh): the parts that need logic, and packaging.

    python benchmarks/lease_parts.py setup    --work W     # env.json: versions, SMs, clocks, power, git
    python benchmarks/lease_parts.py ceilings --work W     # copy bandwidth, GEMM and grouped-GEMM ceilings
    python benchmarks/lease_parts.py bench PART --work W   # block | moe | attention | kernels: one
                                                           # process per provider (all in one with --dry)
    python benchmarks/lease_parts.py smoke    --work W     # a Hugging Face Llama trains under te vs bf16
    python benchmarks/lease_parts.py ncu      --work W     # Nsight Compute on te's slowest Triton kernels
                                                           # of the step, on the step's cache
    python benchmarks/lease_parts.py tests    --work W -- PYTEST_ARGS
    python benchmarks/lease_parts.py package  --work W --out OUT   # the 8 files, summary.txt printed

The work folder W (/tmp/te_lease on a lease) outlives one device call while the machine stays warm, so
a second call's package holds both calls' rows. Every measurement is one row of W/results.jsonl
(benchmarks/_record.py); ``--dry`` runs each part on the CPU at tiny shapes with providers compiled
through aot_eager, which checks the kit end to end and measures nothing.
"""

from __future__ import annotations

import argparse
import csv
import glob
import gzip
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

__all__ = ["PART_PROVIDERS", "OUT_FILES", "MAX_FILE_BYTES", "main"]

# The files a lease brings back (the device tool returns at most 8, each under 16 MiB)
OUT_FILES = ("summary.txt", "results.jsonl", "kernels.csv", "traces.tar.gz", "inductor_code.tar.gz",
             "ncu.tar.gz", "logs.tar.gz", "timings.tsv")
MAX_FILE_BYTES = 15 * 2**20          # a margin under the tool's 16 MiB

# bench PART -> (script, providers on a GPU, providers in --dry, extra arguments); the names are the ones
# each script's --providers accepts
PART_PROVIDERS = {
    "block": ("bench_block.py",
              ("bf16", "te Float8CurrentScaling", "te DelayedScaling", "torchao float8 tensorwise",
               "torchao float8 rowwise"),
              ("bf16", "te Float8CurrentScaling", "torchao float8 tensorwise"), ()),
    "moe": ("bench_moe.py",
            ("bf16", "te Float8CurrentScaling", "te Float8CurrentScaling E4M3", "torchao MoE float8 rowwise"),
            ("bf16", "te Float8CurrentScaling E4M3", "torchao MoE float8 rowwise"), ()),
    "attention": ("bench_attention.py", ("bf16 sdpa", "te fp8 attention hp-bwd", "te fp8 attention fp8-bwd"),
                  ("bf16 sdpa", "te fp8 attention fp8-bwd"), ()),
    # the quantize and norm kernels: one process, its cases are small
    "kernels": ("bench_quantize.py", (), (), ()),
}
# the MoE shapes per provider process, in value order: each shape's rows are written as it finishes, so a
# process stopped during the small experts keeps its Mixtral rows, and the second shape costs a compile
# (~6-15 s on an H100) where a process of its own would cost the ~10 s startup on top
MOE_SHAPES = {"gpu": ("mixtral", "small experts"), "dry": ("mixtral",)}
# the least time a provider's process is started with, by part. Measured on an H100 (lease 2026-11-27):
# imports and model build 9-12 s, the first step's compile 14-34 s, the timed steps and profile ~8 s, so a
# process given ~20 s is stopped while compiling. moe runs both shapes in one process (bf16 ~48 s, te ~60 s).
# --dry runs all providers in one process at tiny shapes and needs DRY_PROCESS_MIN_SECONDS.
PROCESS_MIN_SECONDS = {"block": 50, "moe": 55, "attention": 50, "kernels": 30}
DRY_PROCESS_MIN_SECONDS = 10

# Llama 3 8B's linears at 8192 tokens (bench_step.py's model): name, in_features, out_features
STEP_LINEARS = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate", 4096, 14336), ("down", 14336, 4096),
                ("lm_head", 4096, 128256))
STEP_TOKENS = 8192
# MoE layers (bench_moe.py's CUDA shapes): name, experts, top-k, hidden, ffn, tokens
MOE_GEMMS = (("mixtral", 8, 2, 4096, 14336, 16384), ("small-experts", 64, 8, 2048, 1408, 16384))
DRY_DIVISOR = 64                     # --dry divides every GEMM dim by this (8192 -> 128)

NCU_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats")
# the per-reason stall counters behind WarpStateStats' chart (not printed by --page details otherwise)
NCU_STALL_METRICS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
NCU_KERNELS = 6                      # te's slowest Triton kernels profiled
NCU_PARTS = ("step", "block")        # whose te profile names them, first found (ncu_target runs it again)
NCU_MAX_LAUNCHES = 64                # one step's launches of them, at most (each costs ~0.5 s of replay)
# Triton kernels: inductor's (triton_poi_fused_add_0) and te's own (_norm_quantize_kernel)
_TRITON_NAME = re.compile(r"^(triton_\w+|_\w+_kernel\w*)$")


def _restore_sigint() -> None:
    """Make SIGINT raise KeyboardInterrupt even when the shell that started us ignored it (a
    background job of a non-interactive shell): timeout -s INT must stop a part cleanly."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _paths(work: str) -> dict:
    paths = {"results": os.path.join(work, "results.jsonl"), "kernels": os.path.join(work, "kernels.csv"),
             "timings": os.path.join(work, "timings.tsv"), "traces": os.path.join(work, "traces"),
             "code": os.path.join(work, "code"), "ncu": os.path.join(work, "ncu"), "logs": os.path.join(work, "logs")}
    for key in ("traces", "code", "ncu", "logs"):
        os.makedirs(paths[key], exist_ok=True)
    return paths


# ---- setup ------------------------------------------------------------------------------------------------

_SMI_FIELDS = {   # env.json key -> the nvidia-smi -q line it is read from (first match)
    "driver": "Driver Version", "cuda_driver": "CUDA Version", "product": "Product Name",
    "power_draw_w": "Power Draw", "power_limit_w": "Current Power Limit", "temperature_c": "GPU Current Temp",
    "clock_sm_mhz": "SM", "clock_mem_mhz": "Memory", "pstate": "Performance State",
}


def _nvidia_smi(logs: str) -> dict:
    """A few fields of ``nvidia-smi -q`` (the whole text goes to logs/nvidia-smi.txt)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"nvidia_smi": "not found"}
    try:
        text = subprocess.run([smi, "-q"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"nvidia_smi": f"failed: {e}"}
    with open(os.path.join(logs, "nvidia-smi.txt"), "w") as f:
        f.write(text)
    out = {}
    for key, label in _SMI_FIELDS.items():
        # newer drivers write "Average Power Draw" / "Instantaneous Power Draw": allow one word before
        prefix = r"(?:\w+ )?" if label == "Power Draw" else ""
        m = re.search(rf"^\s*{prefix}{re.escape(label)}\s*:\s*(.+)$", text, re.MULTILINE)
        if m:
            out[key] = m.group(1).strip()
    return out


def part_setup(args, paths) -> int:
    import torch

    import _record

    info = dict(_record.device_info())
    info.update(python=sys.version.split()[0], run=os.environ.get("LEASE_RUN", ""), dry=bool(args.dry))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
    info.update(_nvidia_smi(paths["logs"]))
    for name in ("torchao", "transformers", "te_compile"):
        try:
            module = __import__(name)
            info[f"{name}_version"] = getattr(module, "__version__", "?")
        except ImportError as e:
            info[f"{name}_version"] = f"missing: {e}"
    info["ncu"] = _find_ncu() or "not found"
    with open(os.path.join(paths["logs"], "env.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info, indent=1))
    return 0


# ---- ceilings ---------------------------------------------------------------------------------------------

def _scaled(dim: int, div: int) -> int:
    """``dim`` divided for --dry, kept a multiple of 16 (the FP8 and grouped GEMMs' alignment)."""
    return dim if div == 1 else max(16, dim // div // 16 * 16)


def _gemm_cases(dry: bool):
    """(name, M, K, N) of the step's GEMMs: each linear's fprop [T, in] x [in, out], dgrad [T, out] x
    [out, in] and wgrad [out, T] x [T, in]; --dry divides every dim."""
    div = DRY_DIVISOR if dry else 1
    t = _scaled(STEP_TOKENS, div)
    for name, k, n in STEP_LINEARS:
        k, n = _scaled(k, div), _scaled(n, div)
        yield f"{name} fprop", t, k, n
        yield f"{name} dgrad", t, n, k
        yield f"{name} wgrad", n, t, k


def _ceiling(args, paths, provider: str, shape: str, fn: Callable, *, flops: float = 0.0, moved: int = 0,
             graph: bool = False) -> None:
    """Time one ceiling case and write its rows; a failure writes a row that says why."""
    import _record

    try:
        fn()
        timing = _record.bench_kernel(fn, graph=graph)
    except Exception as e:   # an op missing on this torch or device must not stop the others
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        _record.write_row(paths["results"], part="ceiling", provider=provider, shape=shape, metric="ms",
                          median=None, note=f"failed: {type(e).__name__}: {msg}")
        print(f"ceiling {provider} {shape}: failed: {type(e).__name__}: {msg}", flush=True)
        return
    ms = timing["median_ms"]
    timer = ("do_bench_cudagraph" if graph else "do_bench") if _cuda(args) else "perf_counter"
    _record.write_row(paths["results"], part="ceiling", provider=provider, shape=shape, metric="ms", median=ms,
                      spread=timing["p90_ms"] - timing["p10_ms"], timer=timer)
    if flops:
        _record.write_row(paths["results"], part="ceiling", provider=provider, shape=shape, metric="TFLOP/s",
                          median=flops / ms / 1e9, timer=timer)
    if moved:
        _record.write_row(paths["results"], part="ceiling", provider=provider, shape=shape, metric="GB/s",
                          median=moved / ms / 1e6, bytes=moved, timer=timer)
    rate = f"{flops / ms / 1e9:.1f} TFLOP/s" if flops else f"{moved / ms / 1e6:.1f} GB/s"
    print(f"ceiling {provider:<34} {shape:<40} {ms:9.4f} ms  {rate}", flush=True)


def _cuda(args) -> bool:
    import torch

    return torch.cuda.is_available() and not args.dry


def part_ceilings(args, paths) -> int:
    import torch

    cuda = _cuda(args)
    device = "cuda" if cuda else "cpu"
    hp = torch.bfloat16 if cuda else torch.float32
    e4m3 = torch.float8_e4m3fn
    gen = torch.Generator(device=device).manual_seed(0)

    # copy: 256 MiB read + 256 MiB written, far past the 50-60 MB L2 (--dry: 1 MiB)
    n = (2**27) if cuda else (2**18)
    x = torch.empty(n, device=device, dtype=hp).normal_(generator=gen)
    y = torch.empty_like(x)
    moved = 2 * x.numel() * x.element_size()
    _ceiling(args, paths, "bf16 copy", f"{moved // 2**21}MiB copy", lambda: y.copy_(x), moved=moved)
    if cuda:
        _ceiling(args, paths, "bf16 copy", f"{moved // 2**21}MiB copy cudagraph", lambda: y.copy_(x), moved=moved,
                 graph=True)
    del x, y

    one = torch.ones((), device=device, dtype=torch.float32)
    square = 8192 if cuda else 8192 // DRY_DIVISOR
    cases = [(f"square {square}^3", square, square, square)] + list(_gemm_cases(not cuda))
    for name, m, k, n in cases:
        a = torch.randn(m, k, device=device, dtype=hp, generator=gen)
        b = torch.randn(n, k, device=device, dtype=hp, generator=gen).t()     # [K, N], column-major
        a8, b8 = a.to(e4m3), b.to(e4m3)
        shape = f"{m}x{k}x{n} {name if name.startswith('square') else 'llama3-8b ' + name}"
        flops = 2.0 * m * k * n
        _ceiling(args, paths, "bf16 torch.mm", shape, lambda: torch.mm(a, b), flops=flops)
        for fast in (False, True):
            _ceiling(args, paths, "te torch._scaled_mm" + (" fast_accum" if fast else ""), shape,
                     lambda fast=fast: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16,
                                                        use_fast_accum=fast), flops=flops)
        if name.endswith("wgrad"):
            # under autocast over fp32 weights te's wgrad GEMM writes the fp32 gradient itself (twice the
            # output bytes of a bf16 one, no cast kernel after it): what that costs the GEMM
            _ceiling(args, paths, "te torch._scaled_mm fp32 out", shape,
                     lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.float32), flops=flops)
        del a, b, a8, b8

    div = 1 if cuda else DRY_DIVISOR
    for name, experts, top_k, hidden, ffn, tokens in MOE_GEMMS:
        rows_per = _scaled(tokens * top_k // experts, div)
        rows, hidden, ffn = rows_per * experts, _scaled(hidden, div), _scaled(ffn, div)
        offs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows_per
        for gemm, k, n in (("w1 fprop", hidden, ffn), ("w2 fprop", ffn, hidden)):
            a = torch.randn(rows, k, device=device, dtype=hp, generator=gen)
            # [E, K, N], each expert column-major, as te hands the grouped GEMMs their weights
            b = torch.randn(experts, n, k, device=device, dtype=hp, generator=gen).transpose(-2, -1)
            a8, b8 = a.to(e4m3), b.to(e4m3)
            a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
            scale_a = torch.ones(rows, device=device, dtype=torch.float32)
            scale_b = torch.ones(experts, n, device=device, dtype=torch.float32)
            shape = f"{rows}x{k}x{n} E{experts} {name} {gemm}"
            flops = 2.0 * rows * k * n
            _ceiling(args, paths, "bf16 torch._grouped_mm", shape,
                     lambda: torch._grouped_mm(a16, b16, offs=offs), flops=flops)
            for fast in (False, True):
                _ceiling(args, paths, "te torch._scaled_grouped_mm" + (" fast_accum" if fast else ""), shape,
                         lambda fast=fast: torch._scaled_grouped_mm(a8, b8, scale_a, scale_b, offs=offs,
                                                                    out_dtype=torch.bfloat16, use_fast_accum=fast),
                         flops=flops)
            del a, b, a8, b8, a16, b16
    return 0


# ---- bench parts: one process per provider ------------------------------------------------------------

def part_bench(args, paths) -> int:
    if args.name not in PART_PROVIDERS:
        raise SystemExit(f"bench: part must be one of {tuple(PART_PROVIDERS)}, got {args.name!r}")
    script, gpu_providers, dry_providers, extra = PART_PROVIDERS[args.name]
    common = [sys.executable, os.path.join(HERE, script), "--jsonl", paths["results"],
              "--kernels-csv", paths["kernels"], "--trace-dir", paths["traces"], "--code-dir", paths["code"],
              *extra]
    if args.name == "moe":
        common += ["--shapes", *MOE_SHAPES["dry" if args.dry else "gpu"]]
    if args.dry:
        common.append("--dry")
        groups = [list(dry_providers)] if dry_providers else [[]]
    else:
        groups = [[p] for p in gpu_providers] or [[]]
    need = DRY_PROCESS_MIN_SECONDS if args.dry else PROCESS_MIN_SECONDS[args.name]
    deadline = time.monotonic() + args.budget
    worst = 0
    for i, providers in enumerate(groups):
        left = deadline - time.monotonic()
        # a process started with less than it needs dies while compiling and measures nothing: skip it,
        # and give each one what is left less the minimum kept back for each later one that can still
        # have it, so a provider that hangs cannot starve the rest and time one leaves over goes on
        later = min(len(groups) - i - 1, max(0, int(left // need) - 1))
        limit = left - later * need
        if limit < need:
            print(f"bench {args.name}: no time left for {providers} ({left:.0f} s left, a process needs "
                  f"{need:.0f} s)", flush=True)
            worst = worst or 124
            continue
        cmd = common + (["--providers", *providers] if providers else [])
        print(f"bench {args.name}: {' '.join(repr(c) if ' ' in c else c for c in cmd[1:])} "
              f"(at most {limit:.0f} s)", flush=True)
        rc = _run(cmd, limit)
        worst = worst or rc
    return worst


def _run(cmd: list[str], limit: float) -> int:
    """Run ``cmd`` (output inherited: the part's log), SIGINT at ``limit`` seconds, SIGKILL 15 s later."""
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"lease_parts: {limit:.0f} s passed, interrupting {os.path.basename(cmd[1])}", flush=True)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 124
    except KeyboardInterrupt:   # the part's own timeout: the child got SIGINT too (same process group)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


# ---- smoke: a Hugging Face Llama trains under te ----------------------------------------------------------

def part_smoke(args, paths) -> int:
    """A small Llama (transformers' LlamaForCausalLM, GQA, SwiGLU, RMSNorm, RoPE) trains from one
    initialization on the same batches under bf16 inductor and te Float8CurrentScaling; the final
    losses (mean of the last 5 steps) must agree within 1%. On a GPU: fp32 weights under bf16 autocast,
    fused AdamW, 50 steps; --dry: fp32, aot_eager, 6 steps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import _record
    import te_compile

    cuda = _cuda(args)
    device = "cuda" if cuda else "cpu"
    if cuda:
        cfg = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=8192, max_position_embeddings=512)
        batch, seq, steps = 8, 256, 50
    else:
        cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
        batch, seq, steps = 2, 32, 6
    config = LlamaConfig(**cfg, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(0)
    # a few sequences repeated: the loss falls, so the two runs are compared while learning
    data = torch.randint(0, cfg["vocab_size"], (4, batch, seq + 1), generator=gen)
    compiler = "aot_eager" if args.dry else "inductor"
    shape = (f"{batch}x{seq} llama h{cfg['hidden_size']} L{cfg['num_hidden_layers']} "
             f"v{cfg['vocab_size']} {steps}steps fwd+bwd")
    finals = {}
    for provider in ("bf16", "te Float8CurrentScaling"):
        torch._dynamo.reset()
        te_compile.reset()
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(device)
        # small_gemms "fp8": the smoke model's GEMMs are below te's small-GEMM line, which would keep
        # them all in high precision on a GPU; the smoke test is of FP8 training
        backend = compiler if provider == "bf16" else te_compile.backend(
            recipe="Float8CurrentScaling", compiler=compiler, rewrite={"small_gemms": "fp8"})
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if cuda else {}))
        losses, t0 = [], time.perf_counter()
        try:
            for i in range(steps):
                idx = data[i % len(data)].to(device)
                with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
                    loss = compiled(input_ids=idx[:, :-1], labels=idx[:, 1:]).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
            losses = [float(v) for v in losses]
        except Exception as e:   # the row says how te failed; bf16's row still stands
            msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            _record.write_row(paths["results"], part="smoke", provider=provider, shape=shape, metric="final_loss",
                              median=None, note=f"failed: {type(e).__name__}: {msg}")
            print(f"smoke {provider}: failed: {type(e).__name__}: {msg}", flush=True)
            continue
        finals[provider] = sum(losses[-5:]) / len(losses[-5:])
        _record.write_row(paths["results"], part="smoke", provider=provider, shape=shape, metric="final_loss",
                          median=finals[provider], first_loss=losses[0], losses=[round(v, 5) for v in losses],
                          seconds=round(time.perf_counter() - t0, 1))
        print(f"smoke {provider}: loss {losses[0]:.4f} -> {finals[provider]:.4f} (mean of the last 5)", flush=True)
    if len(finals) == 2:
        gap = 100.0 * (finals["te Float8CurrentScaling"] - finals["bf16"]) / finals["bf16"]
        ok = abs(gap) <= 1.0
        _record.write_row(paths["results"], part="smoke", provider="te Float8CurrentScaling", shape=shape,
                          metric="loss_gap_pct", median=gap, passed=ok, goal="within ±1%")
        print(f"smoke: te's final loss is {gap:+.2f}% from bf16's ({'within' if ok else 'OUTSIDE'} 1%)", flush=True)
        return 0 if ok else 1
    return 1


# ---- ncu ----------------------------------------------------------------------------------------------

def _find_ncu() -> Optional[str]:
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda-*/bin/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def slowest_te_kernels(kernels_csv: str, count: int = NCU_KERNELS) -> tuple[str, list[str], int]:
    """(part, names, launches): te Float8CurrentScaling's slowest Triton kernels per step in the step
    part's profile (else the block part's), whose code ncu's target runs again, and how many launches of
    them one step makes (the profile's calls per step). Triton kernels are named as identifiers, which
    ncu's -k matches as profiled; cuBLAS's templated names are left to the profile."""
    rows = []
    if os.path.exists(kernels_csv):
        with open(kernels_csv, newline="") as f:
            rows = list(csv.DictReader(f))
    for part in NCU_PARTS:
        picked = [r for r in rows if r["part"] == part and r["provider"] == "te Float8CurrentScaling"
                  and _TRITON_NAME.match(r["kernel"])]
        if not picked:
            continue
        latest = max(r.get("run", "") for r in picked)
        picked = [r for r in picked if r.get("run", "") == latest]
        picked.sort(key=lambda r: -float(r["per_step_us"]))
        per_step: dict[str, int] = {}
        for r in picked:
            if r["kernel"] not in per_step and len(per_step) < count:
                per_step[r["kernel"]] = max(1, math.ceil(float(r.get("calls_per_step") or 1)))
        return part, list(per_step), min(NCU_MAX_LAUNCHES, sum(per_step.values()))
    return "block", [], 0


def ncu_command(ncu: str, names: list[str], target: list[str], stall_metrics: bool = True,
                nvtx_range: Optional[str] = "lease_ncu", launches: int = 0) -> list[str]:
    """ncu at the card's own clocks over ``launches`` launches of the named kernels (3 each by default),
    inside the target's NVTX range ``nvtx_range`` where it has one (the block target's one step after
    warm-up, since a cold compile's autotuning launches share the kernels' names)."""
    cmd = [ncu, "--clock-control", "none"]
    if nvtx_range:
        cmd += ["--nvtx", "--nvtx-include", f"{nvtx_range}/"]
    for section in NCU_SECTIONS:
        cmd += ["--section", section]
    if stall_metrics:
        cmd += ["--metrics", NCU_STALL_METRICS]
    if names:
        cmd += ["-k", "regex:^(" + "|".join(re.escape(n) for n in names) + ")$",
                "-c", str(launches or 3 * len(names))]
    else:
        cmd += ["-c", str(2 * NCU_KERNELS)]
    return cmd + ["--csv", "--page", "details"] + target


def ncu_target(part: str, paths: dict) -> tuple[list[str], Optional[str]]:
    """(command, NVTX range) of the process ncu profiles. The step's: bench_step.py's te process pointed
    at the step part's cache (code/step/te_Float8CurrentScaling), so its compile is an FX graph and
    Triton cache hit with no autotuning launches (te's dry step compiled by inductor on the CPU: a
    104 s first step, 26 s on the warm cache) rather than a compile under ncu, which took the whole
    70 s part on the first lease; one timed step, no profile. Its rows stay in ncu/."""
    rows = os.path.join(paths["ncu"], "target_rows.jsonl")
    if part == "step":
        scratch = os.path.join(os.path.dirname(paths["ncu"]), "ncu_target")   # not packaged
        os.makedirs(scratch, exist_ok=True)
        return ([sys.executable, os.path.join(HERE, "bench_step.py"), "--providers", "te Float8CurrentScaling",
                 "--code-dir", os.path.join(paths["code"], "step"), "--warmup", "1", "--iters", "1",
                 "--profile-steps", "0", "--jsonl", rows, "--kernels-csv", os.path.join(scratch, "kernels.csv"),
                 "--trace-dir", scratch], None)
    return ([sys.executable, os.path.join(HERE, "bench_block.py"), "--providers", "te Float8CurrentScaling",
             "--ncu-target", "--code-dir", paths["code"], "--jsonl", rows], "lease_ncu")


def part_ncu(args, paths) -> int:
    part, names, launches = slowest_te_kernels(paths["kernels"])
    target, nvtx_range = ncu_target(part, paths)
    ncu = _find_ncu()
    out_csv = os.path.join(paths["ncu"], f"ncu_{part}_te_Float8CurrentScaling.csv")
    commands = os.path.join(paths["ncu"], "commands.txt")
    cmd = ncu_command(ncu or "ncu", names, target, nvtx_range=nvtx_range, launches=launches)
    with open(commands, "a") as f:
        f.write(" ".join(repr(c) if (" " in c or "|" in c) else c for c in cmd) + f" > {out_csv}\n")
    print(f"ncu: {part} part, te Float8CurrentScaling, kernels: {names or 'the first of the step'}", flush=True)
    if args.dry or ncu is None:
        reason = "dry run" if args.dry else "ncu not found on this machine"
        with open(commands, "a") as f:
            f.write(f"# not run: {reason}\n")
        print(f"ncu: not run ({reason}); the command is in ncu/commands.txt", flush=True)
        return 0
    rc = 1
    for stall in (True, False):   # an ncu that refuses the stall metrics still gives the sections
        cmd = ncu_command(ncu, names, target, stall_metrics=stall, nvtx_range=nvtx_range, launches=launches)
        with open(out_csv, "w") as out, open(os.path.join(paths["ncu"], "ncu_stderr.log"), "a") as err:
            # one process: no compile workers for ncu to follow (the compile is a cache hit anyway)
            env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, env=env)
            try:
                rc = proc.wait(timeout=max(10.0, args.budget - 5))
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                rc = 124
                break
        with open(out_csv) as f:
            got = '"Kernel Name"' in f.read(1 << 16)
        print(f"ncu: rc {rc}, stall metrics {'on' if stall else 'off'}, CSV rows {'found' if got else 'missing'}",
              flush=True)
        if got:
            return 0
    return rc or 1


# ---- tests ----------------------------------------------------------------------------------------------

def part_tests(args, paths) -> int:
    """pytest in this process, so SIGINT (timeout -s INT) ends in pytest's summary and junit XML."""
    import pytest

    junit = os.path.join(paths["logs"], "tests.xml")
    return int(pytest.main(["-p", "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_family=xunit1",
                            *args.pytest_args]))


# ---- package ------------------------------------------------------------------------------------------

def _tar_once(path: str, members: list[tuple[str, str]], limit: int, dropped: list[str]) -> list[tuple[str, str]]:
    """One pass of _tar: a member goes in while the compressed bytes so far leave room for a quarter
    of its raw size (JSON traces and Python compress 5-10x); returns the members written."""
    kept = []
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) as gz, \
            tarfile.open(fileobj=gz, mode="w") as tar:
        for src, name in members:
            gz.flush()
            if kept and raw.tell() + os.path.getsize(src) // 4 + 2**20 > limit:
                dropped.append(name)
                continue
            tar.add(src, arcname=name)
            kept.append((src, name))
    return kept


def _tar(path: str, members: list[tuple[str, str]], limit: int = MAX_FILE_BYTES) -> list[str]:
    """Write a gzipped tar of (file, name in archive), smallest first, under ``limit`` bytes, leaving
    out what does not fit (the largest, then rewriting if the estimate was short); returns their names."""
    members = sorted(members, key=lambda m: os.path.getsize(m[0]))
    dropped: list[str] = []
    while True:
        kept = _tar_once(path, members, limit, dropped)
        if os.path.getsize(path) <= limit or not kept:
            return dropped
        dropped.append(kept[-1][1])
        members = kept[:-1]


def _files(root: str, suffixes: Optional[tuple[str, ...]] = None) -> list[tuple[str, str]]:
    out = []
    for folder, _, names in os.walk(root):
        for name in names:
            if suffixes is None or name.endswith(suffixes):
                src = os.path.join(folder, name)
                out.append((src, os.path.relpath(src, root)))
    return out


def part_package(args, paths) -> int:
    """The 8 files of OUT_FILES from the work folder; summary.txt printed last."""
    out = args.out
    os.makedirs(out, exist_ok=True)
    for name in ("results.jsonl", "kernels.csv", "timings.tsv"):
        src = os.path.join(args.work, name)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(out, name))
        else:
            open(os.path.join(out, name), "w").close()
    notes = []
    # inductor's and te's generated Python (output code, every kernel's source) and Triton's metadata;
    # the compiled binaries stay behind
    dropped = _tar(os.path.join(out, "inductor_code.tar.gz"), _files(paths["code"], (".py", ".json")))
    dropped += _tar(os.path.join(out, "traces.tar.gz"), _files(paths["traces"], (".json",)))
    dropped += _tar(os.path.join(out, "ncu.tar.gz"), _files(paths["ncu"]))
    dropped += _tar(os.path.join(out, "logs.tar.gz"), _files(paths["logs"]))
    if dropped:
        notes.append(f"left out to stay under {MAX_FILE_BYTES // 2**20} MiB a file: {', '.join(dropped)}")
    for name in ("results.jsonl", "kernels.csv"):   # text files larger than the limit keep their head
        path = os.path.join(out, name)
        if os.path.getsize(path) > MAX_FILE_BYTES:
            with open(path, "rb+") as f:
                f.truncate(MAX_FILE_BYTES)
            notes.append(f"{name} cut at {MAX_FILE_BYTES} bytes")
    import lease_report

    summary = lease_report.summary(out, notes)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(summary)
    extra = sorted(set(os.listdir(out)) - set(OUT_FILES))
    if extra:
        print(f"lease_parts: unexpected files in {out}: {extra}", flush=True)
    print(summary)
    return 0


# ---- main ---------------------------------------------------------------------------------------------

PARTS = {"setup": part_setup, "ceilings": part_ceilings, "bench": part_bench, "smoke": part_smoke,
         "ncu": part_ncu, "tests": part_tests, "package": part_package}


def main(argv: Optional[list[str]] = None) -> int:
    _restore_sigint()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=tuple(PARTS))
    parser.add_argument("name", nargs="?", help="bench: the part (block, moe, attention, kernels)")
    parser.add_argument("--work", default=os.environ.get("LEASE_WORK", "/tmp/te_lease"), help="the work folder")
    parser.add_argument("--out", help="package: where the 8 files go")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("LEASE_PART_SECONDS", 600)),
                        help="seconds this part may take (the shell's timeout is the hard stop)")
    parser.add_argument("--dry", action="store_true", default=os.environ.get("LEASE_DRY") == "1")
    parser.add_argument("pytest_args", nargs="*", help="tests: arguments after --")
    args = parser.parse_args(argv)
    if args.part == "package" and not args.out:
        parser.error("package needs --out")
    if args.name and args.part != "bench":
        args.pytest_args.insert(0, args.name)
    paths = _paths(args.work)
    try:
        return PARTS[args.part](args, paths)
    except KeyboardInterrupt:
        print(f"lease_parts {args.part}: interrupted (its time ran out); the rows written so far stay", flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
