"""Projected H100 time of one GPT block's training step (forward + backward) for each provider.

    python benchmarks/project_gpu.py                         # 8 x 2048 tokens, width 4096, 32 heads
    python benchmarks/project_gpu.py --size 2x2048x4096 --providers inductor "te Float8CurrentScaling"
    python benchmarks/project_gpu.py --fp8-gemm-eff 0.78 --bw-eff 0.92   # torchao's roofline figures
    python benchmarks/project_gpu.py --list "te DelayedScaling"          # every kernel of one provider

The projection is computed from the kernels inductor would generate for a GPU, without a GPU and
without running the math (about 5 s per provider on a 2-core CPU); ``_h100_schedule.py`` takes that
schedule, this script prices it and reports.

What is projected: ``te_compile.models.Block`` (nanoGPT's block: LayerNorm, qkv Linear, causal SDPA,
output projection, residual, LayerNorm, MLP 4h with erf GELU, residual; every Linear has a bias) with
bf16 parameters and activations, x [B, T, C] -> y [B, T, C], then y.backward(dy): the gradients of x
and of every parameter; no optimizer step, embedding or loss. Providers: inductor in bf16 (the
baseline); te with Float8CurrentScaling and with DelayedScaling (bf16 activations between the FP8
GEMMs), each also with FP8 attention (``rewrite.sdpa = true``); torchao float8 tensorwise
(``convert_to_float8_training``, then inductor).

How the kernels are obtained: the block gets fake parameters and a fake input (FakeTensorMode on the
CPU: full size, no storage) and each provider compiles it unchanged. The AOT forward and backward
graphs that reach inductor are copied onto a fake ``cuda:0`` and given to inductor's own
compile_fx_inner: post-grad passes, lowering and the Triton scheduler's fusion run as for an H100
(CUDA queries answer with an H100 SXM's properties), and the scheduler's fused nodes are read just
before code generation, which is skipped. (Autograd cannot trace fake CUDA tensors on a CPU-only build:
hence the CPU trace, then the copy.) te and torchao take their GPU paths: te's per-tensor GEMMs are
``torch._scaled_mm`` (not its CPU fp32 emulation), its fused norms the Triton kernels of
kernels/norm_quantize.py; torchao runs with ``emulate=False``, its GPU setting (``torch._scaled_mm``),
possible only because nothing executes. On a CPU torchao needs ``Float8LinearConfig(emulate=True)``,
whose graph dequantizes both FP8 operands to bf16 and runs a bf16 ``mm``: counting that graph would
charge torchao bf16 GEMM time and 2-byte upcast traffic it never pays on an H100
(``--providers "torchao float8 (emulate=True)"`` shows how much).

The model, per kernel (a scheduler node, or an extern call, is one launch):
- memory-bound kernels (all but GEMMs and attention): bytes as inductor's scheduler counts them for
  the fused node (``get_read_write_buffer_accesses``): each buffer read or written once at its dtype
  (bf16 2 bytes, FP8 1, fp32 4); buffers internal to a fused kernel are free; a reduction that reads
  its input twice counts it once. Opaque ops count their inputs and outputs once; what moves inside
  them is not seen. A user Triton kernel (te's norms) writes the arguments its ``tl.store`` calls
  point into and reads the others: torch's TTIR analysis lists more of them as written, and the
  copies inductor then makes first are kernels of their own, counted as such;
- GEMMs: FLOPs 2*M*N*K, bf16 or FP8 by the operand dtype; bytes = operands + output;
- attention: FLOPs of flash attention, 4*B*H*T*T*D forward and 2.5x that backward, halved when
  causal, at the bf16 rate for torch's SDPA. te's FP8 attention: the forward at the FP8 rate; its
  backward recomputes P in two kernels (7 products of T*T*D instead of 5: 3.5x the forward), at the
  TF32 rate with the default "high_precision" backward (fp32 dots, which Triton runs as TF32 on
  sm90), at the FP8 rate with ``fp8_dpa_backward = "fp8"``;
- time = max(bytes / (HBM bandwidth * bw_eff), FLOPs / (peak * eff)) + launch overhead; the step is
  the sum over its kernels (no overlap).

Hardware (H100 SXM datasheet, dense): 3.35 TB/s HBM3, 989 TFLOP/s bf16, 1979 FP8, 494.7 TF32. The
achievable fractions (defaults; each has a flag) and where they come from:
- bw_eff 0.85: pointwise and reduction kernels at large sizes. torchao's float8 roofline
  (torchao/testing/training/roofline_utils.py, in torchao 0.18) takes 0.92, from large pointwise
  Triton kernels on its H100s; transposing casts, split reductions and row reductions over 4096
  columns do worse than a pointwise copy, hence a round 0.85;
- bf16_gemm_eff 0.75: cuBLAS bf16 at M = 16384, N and K in 4096..16384. Stas Bekman's "maximum
  achievable matmul FLOPS" table (https://github.com/stas00/ml-engineering, compute/accelerator)
  measures 792 TFLOP/s = 0.80 of peak on an H100 SXM at its best shape; torchao's roofline takes
  0.78 for large inputs. Real layer shapes sit a little under the best one;
- fp8_gemm_eff 0.60: the maximum-achievable table above has no FP8 row. FBGEMM's FP8 GEMM at 8192^3
  on a power-capped (500 W) H100 ran at 1126 TFLOP/s (0.57 of the FP8 peak) against 585 (0.59) for
  bf16 (https://github.com/pytorch/FBGEMM/pull/2546). 0.60 on a 700 W part (FP8 GEMMs 1.6x bf16's at
  these shapes) is a deliberately cautious figure; torchao's roofline takes 0.78 for both
  precisions, the optimistic end; the sensitivity table shows both, and the lease kit's ceilings part
  (``bash benchmarks/lease.sh ceilings``) measures it;
- attn_eff 0.35: torch's flash SDPA backend runs FlashAttention-2 kernels, which use about 35% of
  an H100's peak (Shah et al., "FlashAttention-3", 2024, https://arxiv.org/abs/2407.08608, which
  reaches 75% with Hopper-specific kernels); the same fraction is used for te's Triton FP8
  attention kernels, never measured;
- launch overhead 2 us per kernel: torchao's roofline constant (one-element Triton kernel, from a
  GPU trace). CUDA graphs would remove most of it; it is kept because the providers run without.
These fractions are round figures for the regime, not measurements of these kernels: the projection
ranks providers and shows where bytes go; the lease kit's block part (``bash benchmarks/lease.sh
block``) measures the step on a GPU, and ``benchmarks/offline.py`` reads the code inductor generates
for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
from tabulate import tabulate
from torch._subclasses.fake_tensor import FakeTensorMode

import te_compile
from te_compile.models import Block
from te_compile.torchao_peer import torchao_float8   # the demo's peer conversion

from _h100_schedule import Capture, Kernel, fake_module, gpu_trace

GOALS = {"vs inductor": 1.35, "vs torchao": 1.1}
DEFAULT_SIZE = "8x2048x4096"
DEFAULT_HEADS = 32


# ---- the hardware model -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    """Peaks of an H100 SXM (datasheet, dense) and the achievable fractions (module docstring)."""

    hbm_bytes_per_s: float = 3.35e12
    bf16_flops: float = 989e12
    fp8_flops: float = 1979e12
    tf32_flops: float = 494.7e12
    bw_eff: float = 0.85             # of HBM bandwidth, memory-bound kernels
    bf16_gemm_eff: float = 0.75      # of the bf16 peak, cuBLAS GEMMs at these shapes
    fp8_gemm_eff: float = 0.60       # of the FP8 peak, torch._scaled_mm tensorwise
    attn_eff: float = 0.35           # of the peak of the attention's precision (FlashAttention-2 level)
    launch_s: float = 2e-6           # per kernel launch

    def peak(self, precision: str) -> float:
        return {"bf16": self.bf16_flops, "fp8": self.fp8_flops, "tf32": self.tf32_flops}[precision]


@dataclass
class Projection:
    provider: str
    kernels: list[Kernel] = field(default_factory=list)
    note: str = ""
    trace_s: float = 0.0             # wall time of the CPU trace and scheduling

    def seconds(self, hw: Hardware, kind: Optional[str] = None, launch: bool = True) -> float:
        ks = [k for k in self.kernels if kind is None or k.kind == kind]
        return sum(k.seconds(hw) - (0.0 if launch else hw.launch_s) for k in ks)

    def bytes(self, kind: str = "memory") -> int:
        return sum(k.bytes for k in self.kernels if k.kind == kind)


# ---- the providers --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockProvider:
    """How one provider compiles a block for the projection. ``backend()``: the torch.compile backend (None: inductor); ``convert``: a module swap
    done first (torchao), given ``emulate`` (True where the FP8 GEMMs must run on a CPU)."""

    name: str
    backend: Callable[[], Optional[Callable]] = lambda: None
    convert: Optional[Callable[[nn.Module, bool], None]] = None

    def compile(self, module: nn.Module, emulate: bool = False) -> Callable:
        if self.convert is not None:
            self.convert(module, emulate)
        backend = self.backend()
        return torch.compile(module, backend=backend if backend is not None else "inductor", dynamic=False)


def _torchao(module: nn.Module, emulate: bool) -> None:
    torchao_float8(module, emulate)   # tensorwise, the demo's peer conversion


def _te(recipe: str, **options) -> Callable[[], Callable]:
    # DelayedScaling's history length as in benchmarks/_common.py
    extra = {"amax_history_len": 16} if recipe == "DelayedScaling" else {}
    return lambda: te_compile.backend(recipe=recipe, **extra, **options)


PROVIDERS: dict[str, BlockProvider] = {p.name: p for p in (
    BlockProvider("inductor"),
    BlockProvider("te Float8CurrentScaling", _te("Float8CurrentScaling")),
    BlockProvider("te DelayedScaling", _te("DelayedScaling")),
    BlockProvider("te Float8CurrentScaling, FP8 attention", _te("Float8CurrentScaling", rewrite={"sdpa": True})),
    BlockProvider("te DelayedScaling, FP8 attention", _te("DelayedScaling", rewrite={"sdpa": True})),
    BlockProvider("torchao float8", convert=_torchao),
)}
# shown only on request: what counting torchao's CPU (emulated) graph would give
EXTRA_PROVIDERS = {"torchao float8 (emulate=True)": BlockProvider(
    "torchao float8 (emulate=True)", convert=lambda m, emulate: _torchao(m, True))}
DEFAULT_PROVIDERS = tuple(PROVIDERS)


def project_provider(provider: BlockProvider, b: int, t: int, c: int, heads: int) -> Projection:
    """The projected kernels of one block step (forward + backward) under ``provider``."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    start = time.perf_counter()
    torch._dynamo.reset()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    block = fake_module(lambda: Block(c, heads), mode, torch.bfloat16)
    with mode:   # x, dy: [B, T, C] bf16, the block's input and its output's gradient
        x = torch.empty(b, t, c, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.empty(b, t, c, dtype=torch.bfloat16)
    # every graph must reach the scheduler (no cache hits); one compile thread: no worker pool
    with inductor_config.patch(fx_graph_cache=False, compile_threads=1), \
            functorch_config.patch(enable_autograd_cache=False), gpu_trace(), (capture := Capture()).scheduling():
        compiled = provider.compile(block, emulate=False)
        with mode:
            compiled(x).backward(dy)
    torch._dynamo.reset()
    graphs = {k.graph for k in capture.kernels}
    note = "" if graphs == {"fwd", "bwd"} else f"only {sorted(graphs)} scheduled"
    return Projection(provider.name, capture.kernels, note, time.perf_counter() - start)


def project_block(b: int, t: int, c: int, heads: int, providers: Sequence[str] = DEFAULT_PROVIDERS,
                  log: Callable[[str], None] = lambda s: None) -> dict[str, Projection]:
    """Provider name -> its projection; a provider that fails to compile gets a note and no kernels."""
    out = {}
    for name in providers:
        provider = PROVIDERS.get(name) or EXTRA_PROVIDERS[name]
        try:
            out[name] = project_provider(provider, b, t, c, heads)
        except Exception as e:   # one provider failing must not hide the others
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            out[name] = Projection(name, note=f"failed: {type(e).__name__}: {msg[:160]}")
        log(f"  {name}: {len(out[name].kernels)} launches, {out[name].trace_s:.0f} s {out[name].note}")
    return out


# ---- the report ---------------------------------------------------------------------------------------

def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _ratio(num: Optional[float], den: Optional[float]) -> str:
    return f"{num / den:.2f}x" if num and den else "n/a"


def summary_table(projections: dict[str, Projection], hw: Hardware) -> str:
    base = projections.get("inductor")
    ao = projections.get("torchao float8")
    base_s = base.seconds(hw) if base and base.kernels else None
    ao_s = ao.seconds(hw) if ao and ao.kernels else None
    rows = []
    for name, p in projections.items():
        if not p.kernels:
            rows.append((name, "n/a", "", "", "", "", "", "", "", "", p.note))
            continue
        total = p.seconds(hw)
        launches = len(p.kernels)
        rows.append((name, _ms(total), _ms(p.seconds(hw, "gemm", launch=False)),
                     _ms(p.seconds(hw, "attention", launch=False)), _ms(p.seconds(hw, "memory", launch=False)),
                     _ms(launches * hw.launch_s), launches, f"{p.bytes() / 1e9:.2f}",
                     _ratio(base_s, total), _ratio(ao_s, total), p.note))
    return tabulate(rows, headers=["provider", "total ms", "GEMM ms", "attention ms", "memory-bound ms",
                                   "launch ms", "launches", "memory-bound GB", "bf16 / this", "torchao / this",
                                   "note"], disable_numparse=True)


def top_kernels(p: Projection, hw: Hardware, n: int) -> str:
    ks = sorted((k for k in p.kernels if k.kind == "memory"), key=lambda k: -k.bytes)[:n]
    rows = [(k.label, k.name[:72], f"{k.bytes_read / 1e6:.0f}", f"{k.bytes_written / 1e6:.0f}",
             _ms(k.seconds(hw)), "fp8 out" if k.writes_fp8 else ("small out" if k.small_outputs else ""))
            for k in ks]
    return tabulate(rows, headers=["kernel", "name", "read MB", "written MB", "ms", ""], disable_numparse=True)


def kernel_table(p: Projection, hw: Hardware) -> str:
    """Every launch of a provider's step, in schedule order."""
    rows = [(k.label, k.kind, k.name[:72], k.shape, k.precision or "", f"{k.bytes_read / 1e6:.0f}",
             f"{k.bytes_written / 1e6:.0f}", f"{k.flops / 1e9:.0f}" if k.flops else "", _ms(k.seconds(hw)))
            for k in p.kernels]
    return tabulate(rows, headers=["kernel", "kind", "name", "shape", "dtype", "read MB", "written MB", "GFLOP",
                                   "ms"], disable_numparse=True)


def _operand_kernels(p: Projection, gemm: Kernel) -> list[Kernel]:
    """The memory-bound kernels that exist to make ``gemm``'s operands: walking back from its inputs
    through kernels that write FP8 bytes or only small buffers (casts, transposed casts, amaxes,
    scales), stopping at anything else (a norm or activation writing bf16, a GEMM, a graph input)."""
    producer = {}
    for k in p.kernels:
        if k.graph == gemm.graph:
            for name in k.writes:
                producer.setdefault(name, k)
    found: dict[int, Kernel] = {}
    stack = [producer[n] for n in gemm.reads if n in producer]
    while stack:
        k = stack.pop()
        if id(k) in found or k.kind != "memory" or not (k.writes_fp8 or k.small_outputs):
            continue
        found[id(k)] = k
        stack += [producer[n] for n in k.reads if n in producer]
    return sorted(found.values(), key=lambda k: k.index)


def gemm_table(p: Projection, hw: Hardware) -> str:
    rows = []
    for g in (k for k in p.kernels if k.kind in ("gemm", "attention")):
        ops = _operand_kernels(p, g)
        rows.append((g.label, f"{g.name} {g.module} {g.role}".strip(), g.shape, g.precision, _ms(g.seconds(hw)),
                     f"{sum(k.bytes for k in ops) / 1e6:.0f}", _ms(sum(k.seconds(hw) for k in ops)),
                     " ".join(k.label for k in ops)))
    return tabulate(rows, headers=["kernel", "op", "MxNxK (attention BxHxTxD)", "dtype", "ms", "operand kernels MB",
                                   "their ms", "operand kernels"], disable_numparse=True)


# memory-bound kernels by what they do, read from what they write and the ops they hold
CATEGORIES = ("casts (write FP8)", "reductions to small outputs (amax, stats, bias grads)",
              "copies and fills", "norms, activations, residual adds")
_COPY_OPS = {"clone", "as_strided", "zeros", "full", "fill", "copy_", "copy", "cat", "select_scatter",
             "slice_scatter", "expand", "permute", "transpose", "view", "t", "empty"}


def _category(k: Kernel) -> str:
    if k.writes_fp8:
        return CATEGORIES[0]
    if k.small_outputs:
        return CATEGORIES[1]
    if set(k.name.split("+")) <= _COPY_OPS:
        return CATEGORIES[2]
    return CATEGORIES[3]


def _category_bytes(p: Projection) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for k in p.kernels:
        if k.kind == "memory":
            out[_category(k)] += k.bytes
    return out


def category_table(projections: dict[str, Projection]) -> str:
    rows = []
    for name, p in projections.items():
        if not p.kernels:
            continue
        counts = {c: sum(1 for k in p.kernels if k.kind == "memory" and _category(k) == c) for c in CATEGORIES}
        rows.append([name] + [f"{b / 1e9:.2f} / {counts[c]}" for c, b in _category_bytes(p).items()])
    return tabulate(rows, headers=["GB / launches", *CATEGORIES], disable_numparse=True)


def goal_lines(projections: dict[str, Projection], hw: Hardware) -> list[str]:
    """Each te row against the goals. Where one is missed: the memory-bound bytes the goal would allow
    (its time budget less GEMMs, attention and launches, at the achievable bandwidth), and the bytes
    per kind of kernel beside the reference, which say which bytes are in the way."""
    refs = (("bf16", projections.get("inductor"), GOALS["vs inductor"]),
            ("torchao", projections.get("torchao float8"), GOALS["vs torchao"]))
    lines = []
    for name, p in projections.items():
        if not name.startswith("te ") or not p.kernels:
            continue
        total = p.seconds(hw)
        fixed = p.seconds(hw, "gemm", launch=False) + p.seconds(hw, "attention", launch=False) \
            + len(p.kernels) * hw.launch_s
        for label, ref, goal in refs:
            if ref is None or not ref.kernels:
                continue
            ratio = ref.seconds(hw) / total
            lines.append(f"{name}: {ratio:.2f}x {label} (goal >= {goal}x): {'met' if ratio >= goal else 'MISSED'}")
            if ratio >= goal:
                continue
            budget = ref.seconds(hw) / goal - fixed
            if budget <= 0:
                lines.append(f"    GEMMs + attention + launches alone take {_ms(fixed)} ms, over the "
                             f"{_ms(ref.seconds(hw) / goal)} ms the goal allows")
            else:
                allowed = budget * hw.hbm_bytes_per_s * hw.bw_eff
                lines.append(f"    memory-bound kernels may move {allowed / 1e9:.2f} GB, they move "
                             f"{p.bytes() / 1e9:.2f} GB: {(p.bytes() - allowed) / 1e9:.2f} GB in the way")
            mine, theirs = _category_bytes(p), _category_bytes(ref)
            lines.append(f"    GB beside {label}: " + ", ".join(
                f"{c.split(' (')[0]} {(mine[c] - theirs[c]) / 1e9:+.2f}" for c in CATEGORIES))
    return lines


SENSITIVITY = (
    ("defaults", {}),
    ("torchao roofline: bw 0.92, GEMMs 0.78 both", {"bw_eff": 0.92, "bf16_gemm_eff": 0.78, "fp8_gemm_eff": 0.78}),
    ("pessimistic: bw 0.80, FP8 GEMM 0.55", {"bw_eff": 0.80, "fp8_gemm_eff": 0.55}),
    ("no launch overhead (CUDA graphs)", {"launch_s": 0.0}),
)


def sensitivity_table(projections: dict[str, Projection], hw: Hardware) -> str:
    base, ao = projections.get("inductor"), projections.get("torchao float8")
    te = [n for n, p in projections.items() if n.startswith("te ") and p.kernels]
    rows = []
    for label, change in SENSITIVITY:
        h = dataclasses.replace(hw, **change)
        row = [label]
        for name in te:
            t = projections[name].seconds(h)
            row.append(f"{_ratio(base.seconds(h) if base and base.kernels else None, t)} / "
                       f"{_ratio(ao.seconds(h) if ao and ao.kernels else None, t)}")
        rows.append(row)
    return tabulate(rows, headers=["fractions", *[f"{n}: vs bf16 / vs torchao" for n in te]],
                    disable_numparse=True)


def report(projections: dict[str, Projection], hw: Hardware, size: str, heads: int, top: int) -> str:
    lines = [f"{datetime.date.today().isoformat()}, projected H100 SXM, torch {torch.__version__}; "
             f"GPT block {size} (BxTxC), {heads} heads, bf16, forward + backward",
             f"HBM {hw.hbm_bytes_per_s / 1e12:.2f} TB/s x {hw.bw_eff}, bf16 {hw.bf16_flops / 1e12:.0f} TFLOP/s x "
             f"{hw.bf16_gemm_eff}, FP8 {hw.fp8_flops / 1e12:.0f} x {hw.fp8_gemm_eff}, attention x {hw.attn_eff} "
             f"(TF32 {hw.tf32_flops / 1e12:.1f} for te's FP8-attention backward), {hw.launch_s * 1e6:.1f} us "
             "per launch", "", summary_table(projections, hw), ""]
    lines += ["goals:"] + goal_lines(projections, hw) + [""]
    lines += ["sensitivity (projected speedup of each te row):", sensitivity_table(projections, hw), ""]
    lines += ["memory-bound kernels by what they do:", category_table(projections), ""]
    for name, p in projections.items():
        if not p.kernels:
            continue
        lines += [f"{name}: top {top} memory-bound kernels by bytes", top_kernels(p, hw, top), ""]
        lines += [f"{name}: GEMMs and attention, with the kernels that make their operands "
                  "(FP8 casts, transposes, amaxes, scales; shared kernels listed under each reader)",
                  gemm_table(p, hw), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default=DEFAULT_SIZE, help=f"BxTxC (default {DEFAULT_SIZE})")
    parser.add_argument("--heads", type=int, default=DEFAULT_HEADS,
                        help=f"attention heads (default {DEFAULT_HEADS})")
    parser.add_argument("--providers", nargs="+", metavar="NAME", default=list(DEFAULT_PROVIDERS),
                        choices=[*PROVIDERS, *EXTRA_PROVIDERS], help="(default: all but the emulated torchao)")
    parser.add_argument("--top", type=int, default=8, help="memory-bound kernels listed per provider (default 8)")
    parser.add_argument("--list", nargs="+", metavar="NAME", default=[], choices=[*PROVIDERS, *EXTRA_PROVIDERS],
                        help="also list every kernel of these providers (projected too if not in --providers)")
    defaults = Hardware()
    for flag, attr, what in (("--bw-eff", "bw_eff", "fraction of HBM bandwidth"),
                             ("--bf16-gemm-eff", "bf16_gemm_eff", "fraction of the bf16 peak in GEMMs"),
                             ("--fp8-gemm-eff", "fp8_gemm_eff", "fraction of the FP8 peak in GEMMs"),
                             ("--attn-eff", "attn_eff", "fraction of the peak in attention")):
        parser.add_argument(flag, type=float, default=getattr(defaults, attr),
                            help=f"{what} (default {getattr(defaults, attr)})")
    parser.add_argument("--launch-us", type=float, default=defaults.launch_s * 1e6,
                        help=f"overhead per kernel launch in us (default {defaults.launch_s * 1e6:g})")
    args = parser.parse_args()
    parts = args.size.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise SystemExit(f"--size: expected BxTxC, got {args.size!r}")
    b, t, c = (int(p) for p in parts)
    if c % args.heads:
        raise SystemExit(f"--heads {args.heads} must divide the width {c}")
    hw = Hardware(bw_eff=args.bw_eff, bf16_gemm_eff=args.bf16_gemm_eff, fp8_gemm_eff=args.fp8_gemm_eff,
                  attn_eff=args.attn_eff, launch_s=args.launch_us * 1e-6)
    names = [*args.providers, *(n for n in args.list if n not in args.providers)]
    print(f"project_gpu: tracing {len(names)} providers at {args.size}, {args.heads} heads "
          f"(fake tensors, no GPU)", flush=True)
    projections = project_block(b, t, c, args.heads, names, log=lambda s: print(s, flush=True))
    print()
    print(report(projections, hw, args.size, args.heads, args.top))
    for name in args.list:
        if name in projections:
            print(f"\n{name}: every launch\n{kernel_table(projections[name], hw)}")


if __name__ == "__main__":
    main()
