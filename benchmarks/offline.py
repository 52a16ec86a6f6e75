"""An offline model of the H100 step, on the CPU: inductor's whole CUDA output code for each provider,
what it launches, and (``--compile-sm90``) every generated Triton kernel built for sm90.

    python benchmarks/offline.py                                        # dense step, GPT block, MoE layer
    python benchmarks/offline.py --cases block --providers bf16 "te Float8CurrentScaling" --compile-sm90
    python benchmarks/offline.py --copy-gbps 2661 --out /tmp/offline    # another copy bandwidth; code kept there

Nothing here runs on a GPU or times anything: the figures are counts read from the code inductor would
load on an H100 and a roofline **projection** from them, never a measurement. Each provider compiles
each case once on fake tensors (full size, no storage); ``_h100_schedule.CodeCapture`` moves the AOT
graphs onto a fake H100, lets inductor generate its CUDA code with ``benchmark_kernel`` on (each kernel
then carries inductor's byte estimate, ``kernel_num_gb``) and stops just before the module is loaded.
te's lowerings take their GPU paths (``gpu_trace``): ``torch._scaled_mm``, its Triton norm kernels,
and the CUTLASS grouped GEMMs of an sm90 for experts.

Cases (``--cases``):
- ``step``: bench_step.py's Llama 3 8B-shaped model (width 4096, 32 heads, 8 KV heads, FFN 14336,
  RMSNorm, RoPE, SwiGLU, vocabulary 128256), fp32 weights under bf16 autocast, 1 x ``--tokens``
  (8192) tokens, compiled as bench_step compiles it: each layer one graph, the final norm + output
  layer + loss another. One layer and the head are compiled; the step row counts the layer
  ``--layers`` (4) times. The embedding and the fused AdamW run eagerly and are not counted;
- ``block``: one GPT block (``te_compile.models.Block``: LayerNorm, qkv, causal SDPA, projection, MLP
  4h with GELU, biases), bf16 weights and activations, ``--block-size`` 2x2048x4096, ``--heads`` 32,
  forward and the backward of a given output gradient;
- ``moe``: bench_moe.py's MoE layer at ``--moe-shape`` (mixtral: 8 experts, top-2, hidden 4096, FFN
  14336, 16384 tokens), bf16, forward + backward of its loss.

Providers: ``bf16`` (torch.compile with inductor), ``te Float8CurrentScaling``, ``te DelayedScaling``
(amax history 16), for the MoE layer ``te Float8CurrentScaling E4M3`` (E4M3 gradients, so that the
experts' backward GEMMs are scaled grouped GEMMs too), and, when torchao imports, ``torchao float8
tensorwise`` (dense cases: ``convert_to_float8_training`` with its GPU GEMMs, possible because nothing
runs) and ``torchao MoE float8 rowwise`` (the MoE case: bench_moe's ``quantize_`` of the experts,
whose FP8 grouped GEMMs run eagerly between graph breaks and are not in the counts); ``torchao float8
rowwise`` and, for the dense cases, ``te Float8CurrentScaling cached weights`` (``cache_fp8_weights``:
the graph of a gradient-accumulation micro-batch after the first, which reads each weight's FP8 copy;
for the MoE layer ``te Float8CurrentScaling E4M3 cached weights``, its expert weights' copies) on
request.

Columns, per graph: launches (every Triton kernel and extern call the wrapper makes); tiny (Triton
launches moving under 1 MB: amaxes, scales, zero fills, bound by launch latency, not bandwidth); te
kernels (launches of te's own Triton kernels, called through ``torch.library.triton_op``); GEMMs
(extern ``mm``/``_scaled_mm``/grouped GEMMs); attention (SDPA or te's FP8 attention); other extern
(sorts, index_add, te's custom ops); memory-bound GB (inductor's ``kernel_num_gb`` for its kernels,
the tensor arguments' sizes for te's kernels, which inductor leaves out, and the inputs and outputs
of the other extern ops as the scheduler counts them; GEMMs and attention excluded); roofline ms (those
bytes at ``--copy-gbps``, default 3000 GB/s, an H100 SXM's copy bandwidth: the time the memory-bound
kernels would take at full copy speed, a floor, not a prediction).

Outputs under ``--out`` (default /tmp/te_compile_offline): ``<case>/<provider>/<part>_<graph>.py``
(the output code), ``launches.csv`` (every launch), ``summary.txt`` (what is printed),
``summary.json`` (the table rows), and with ``--compile-sm90`` ``sm90.csv`` (every kernel and config:
registers, local memory, shared memory, or the compile error). SDPA stays the CPU op the trace chose
(``_scaled_dot_product_flash_attention_for_cpu``), counted as attention; the code cannot be run on a
GPU as is. Torch and Triton versions change kernel names and registers: run it in a venv with the
device's versions to compare with a device profile.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
from tabulate import tabulate
from torch._subclasses.fake_tensor import FakeTensorMode

from te_compile.config.schema import SMALL_GEMMS

import _common
from _h100_schedule import CodeCapture, GeneratedGraph, fake_module, gpu_trace
from _output_code import Build, Launch, build_sm90, kernel_sources, launches, ptxas_available, repeated_stores

__all__ = [
    # what is compiled
    "Provider", "PROVIDERS", "Part", "Case", "make_cases",
    # what is read from the code
    "GraphResult", "capture", "counts",
    # the script
    "main",
]

DEFAULT_COPY_GBPS = 3000.0     # H100 SXM: the copy bandwidth a large device-to-device copy reaches
DEFAULT_OUT = "/tmp/te_compile_offline"


# ---- providers -------------------------------------------------------------------------------------------

ALL_CASES = ("step", "block", "moe")
_DENSE = ("step", "block")


@dataclass(frozen=True)
class Provider:
    """How one provider compiles a module (or one of its methods): ``convert`` first, in place (a
    module swap), then ``torch.compile`` with ``backend()``."""

    name: str
    backend: Callable[[], object]
    convert: Optional[Callable[[nn.Module], object]] = None
    cases: tuple[str, ...] = ALL_CASES   # the cases it applies to
    torchao: bool = False                # needs torchao (optional: pip install -e '.[bench]')
    default: bool = True                 # run when --providers is not given

    def compile(self, module: nn.Module, method: Optional[str] = None) -> Callable:
        if self.convert is not None:
            self.convert(module)
        target = getattr(module, method) if method else module
        return torch.compile(target, backend=self.backend(), dynamic=False)


# [rewrite] small_gemms for every te provider (--small-gemms): te's default, or "fp8" for shapes scaled
# down below the size at which te keeps a GPU's GEMMs in high precision
_SMALL_GEMMS = {"value": "auto"}


def _te(recipe: str, **options) -> Callable[[], object]:
    import te_compile

    return lambda: te_compile.backend(recipe=recipe, **_common.TE_RECIPES[recipe], **options,
                                      rewrite={"small_gemms": _SMALL_GEMMS["value"]})


def _torchao_dense(recipe: str) -> Callable[[nn.Module], object]:
    # torchao's GPU GEMMs (emulate=False): nothing runs, so the device need not be there
    return lambda module: _common.torchao_convert(module, recipe, torch.device("cuda"))


def _torchao_moe(module: nn.Module) -> object:
    import bench_moe

    return bench_moe.torchao_moe(module)


# the lease kit's names (its dense parts' and bench_moe's)
PROVIDERS: dict[str, Provider] = {p.name: p for p in (
    Provider("bf16", lambda: "inductor"),
    Provider("te Float8CurrentScaling", _te("Float8CurrentScaling")),
    Provider("te DelayedScaling", _te("DelayedScaling")),
    # [combo_kernels]: inductor's horizontal fusion of independent kernels (off by default in te)
    Provider("te Float8CurrentScaling combo", _te("Float8CurrentScaling", combo_kernels=True), cases=_DENSE,
             default=False),
    Provider("te DelayedScaling combo", _te("DelayedScaling", combo_kernels=True), cases=_DENSE, default=False),
    # [cache_fp8_weights]: the graph every micro-batch after the first runs (the weights' FP8 copies are
    # graph inputs; the first micro-batch's quantization runs before the graph, eagerly, not counted)
    Provider("te Float8CurrentScaling cached weights", _te("Float8CurrentScaling", cache_fp8_weights=True),
             cases=_DENSE, default=False),
    # E4M3 gradients: the experts' backward GEMMs in torch._scaled_grouped_mm (E4M3 only) as well
    Provider("te Float8CurrentScaling E4M3", _te("Float8CurrentScaling", fp8_format="E4M3"), cases=("moe",)),
    # and the expert weights' FP8 copies read as graph inputs (a micro-batch after the first)
    Provider("te Float8CurrentScaling E4M3 cached weights",
             _te("Float8CurrentScaling", fp8_format="E4M3", cache_fp8_weights=True), cases=("moe",), default=False),
    Provider("torchao float8 tensorwise", lambda: "inductor", _torchao_dense("tensorwise"), _DENSE, torchao=True),
    Provider("torchao float8 rowwise", lambda: "inductor", _torchao_dense("rowwise"), _DENSE, torchao=True,
             default=False),
    Provider("torchao MoE float8 rowwise", lambda: "inductor", _torchao_moe, ("moe",), torchao=True),
)}


def _default_providers() -> list[str]:
    available = _common.torchao_available()
    return [p.name for p in PROVIDERS.values() if p.default and (available or not p.torchao)]


# ---- cases ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Part:
    """One compiled region of a case: ``run(provider, mode)`` builds it with fake weights, compiles it
    and runs its forward and backward once on fake inputs; a step runs it ``repeats`` times."""

    name: str
    run: Callable[[Provider, FakeTensorMode], None]
    repeats: int = 1


@dataclass(frozen=True)
class Case:
    name: str
    shape: str                   # what is compiled, in words
    parts: tuple[Part, ...]


def _dense_parts(tokens: int, layers: int) -> tuple[Part, ...]:
    """A Llama layer and the head + loss, as bench_step.py compiles them (one graph each)."""
    import bench_step

    cfg = bench_step.LLAMA3_8B

    def layer(provider: Provider, mode: FakeTensorMode) -> None:
        block = fake_module(lambda: bench_step.Block(cfg), mode, torch.float32)
        compiled = provider.compile(block)
        with mode:   # h: [1, T, dim] the fp32 residual stream; cos, sin: [T, head_dim]
            h = torch.empty(1, tokens, cfg.dim, requires_grad=True)
            cos, sin = torch.empty(tokens, cfg.head_dim), torch.empty(tokens, cfg.head_dim)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = compiled(h, cos, sin)
            out.backward(torch.empty_like(out))

    def head(provider: Provider, mode: FakeTensorMode) -> None:
        model = fake_module(lambda: bench_step.Llama(cfg, 0, tokens), mode, torch.float32)
        compiled = provider.compile(model, method="loss")
        with mode:   # h: [1, T, dim] fp32; targets: [1, T] token ids
            h = torch.empty(1, tokens, cfg.dim, requires_grad=True)
            targets = torch.zeros(1, tokens, dtype=torch.long)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = compiled(h, targets)
            loss.backward()

    return Part("layer", layer, repeats=layers), Part("head", head)


def _block_part(b: int, t: int, c: int, heads: int) -> Part:
    from te_compile.models import Block

    def run(provider: Provider, mode: FakeTensorMode) -> None:
        block = fake_module(lambda: Block(c, heads), mode, torch.bfloat16)
        compiled = provider.compile(block)
        with mode:   # x, dy: [B, T, C] bf16
            x = torch.empty(b, t, c, dtype=torch.bfloat16, requires_grad=True)
            compiled(x).backward(torch.empty(b, t, c, dtype=torch.bfloat16))

    return Part("block", run)


def _moe_part(shape: str) -> Part:
    import bench_moe

    if shape not in bench_moe.SHAPES["cuda"]:
        raise ValueError(f"--moe-shape {shape!r}: expected one of {', '.join(bench_moe.SHAPES['cuda'])}")
    experts, top_k, hidden, ffn, tokens = bench_moe.SHAPES["cuda"][shape]

    def run(provider: Provider, mode: FakeTensorMode) -> None:
        layer = fake_module(lambda: bench_moe.MoELayer(experts, top_k, hidden, ffn), mode, torch.bfloat16)
        compiled = provider.compile(layer)
        with mode:   # x: [tokens, hidden] bf16
            x = torch.empty(tokens, hidden, dtype=torch.bfloat16)
            compiled(x)[1].backward()

    return Part("moe", run)


def make_cases(names: list[str], args: argparse.Namespace) -> list[Case]:
    """The cases named, at the shapes ``args`` gives."""
    out = []
    for name in names:
        if name == "step":
            out.append(Case("step", f"Llama 3 8B shape, 1x{args.tokens} tokens, bf16 autocast over fp32 weights; "
                                    f"{args.layers} layers (one compiled) + head and loss",
                            _dense_parts(args.tokens, args.layers)))
        elif name == "block":
            b, t, c = args.block_size
            out.append(Case("block", f"GPT block {b}x{t}x{c}, {args.heads} heads, bf16",
                            (_block_part(b, t, c, args.heads),)))
        elif name == "moe":
            import bench_moe

            part = _moe_part(args.moe_shape)
            e, k, h, f, t = bench_moe.SHAPES["cuda"][args.moe_shape]
            out.append(Case("moe", f"MoE layer '{args.moe_shape}': {e} experts, top-{k}, hidden {h}, FFN {f}, "
                                   f"{t} tokens, bf16", (part,)))
        else:
            raise ValueError(f"unknown case {name!r}: expected one of {', '.join(ALL_CASES)}")
    return out


# ---- capture and counts ----------------------------------------------------------------------------------

@dataclass
class GraphResult:
    """One generated graph of one provider's case, read back."""

    case: str
    provider: str
    part: str
    graph: str                   # "fwd" or "bwd", numbered when a part compiles several
    repeats: int
    code: str = field(repr=False)
    launches: list[Launch] = field(default_factory=list, repr=False)
    opaque_bytes: int = 0        # the other extern ops' inputs and outputs (the scheduler's count)
    note: str = ""


def capture(case: Case, provider: Provider) -> list[GraphResult]:
    """Every graph ``provider`` generates for ``case``, one part at a time (each its own compile)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import te_compile

    out = []
    for part in case.parts:
        torch._dynamo.reset()
        te_compile.reset()
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        code = CodeCapture()
        # every graph must reach code generation (no cache hits), in this process (no compile workers)
        with inductor_config.patch(fx_graph_cache=False, compile_threads=1, benchmark_kernel=True), \
                functorch_config.patch(enable_autograd_cache=False), gpu_trace(), code.generating():
            part.run(provider, mode)
        torch._dynamo.reset()
        seen: dict[str, int] = {}
        for g in code.graphs:
            seen[g.graph] = seen.get(g.graph, 0) + 1
            label = g.graph if seen[g.graph] == 1 else f"{g.graph}{seen[g.graph]}"
            out.append(_read(case, provider, part, label, g))
    return out


def _read(case: Case, provider: Provider, part: Part, label: str, g: GeneratedGraph) -> GraphResult:
    result = GraphResult(case.name, provider.name, part.name, label, part.repeats, g.code,
                         launches(g.code, g.user_launches))
    result.opaque_bytes = sum(k.bytes for k in g.scheduled if k.opaque)
    if g.schedule_error:
        result.note = f"other extern bytes not counted ({g.schedule_error[:80]})"
    return result


def counts(r: GraphResult, copy_gbps: float) -> dict:
    """The table row of one graph."""
    ls = r.launches
    triton_bytes = sum(x.bytes or 0 for x in ls if x.kind in ("triton", "user"))
    te_bytes = sum(x.bytes or 0 for x in ls if x.kind == "user")
    memory = triton_bytes + r.opaque_bytes
    return {"case": r.case, "provider": r.provider, "graph": f"{r.part} {r.graph}", "repeats": r.repeats,
            "launches": len(ls), "tiny": sum(x.tiny for x in ls), "te_kernels": sum(x.kind == "user" for x in ls),
            "gemms": sum(x.kind == "gemm" for x in ls), "attention": sum(x.kind == "attention" for x in ls),
            "other_extern": sum(x.kind == "extern" for x in ls), "memory_bytes": memory, "te_bytes": te_bytes,
            "roofline_ms": memory / (copy_gbps * 1e9) * 1e3,
            "unknown_bytes": sum(x.bytes is None for x in ls if x.kind in ("triton", "user")),
            "repeated_stores": sum(repeated_stores(r.code).values()), "note": r.note}


_SUMMED = ("launches", "tiny", "te_kernels", "gemms", "attention", "other_extern", "memory_bytes", "te_bytes",
           "roofline_ms", "unknown_bytes", "repeated_stores")


def _total(rows: list[dict], label: str) -> dict:
    total = {"case": rows[0]["case"], "provider": rows[0]["provider"], "graph": label, "repeats": 1, "note": ""}
    for key in _SUMMED:
        total[key] = sum(r[key] * r["repeats"] for r in rows)
    return total


# ---- the report ----------------------------------------------------------------------------------------

_HEADERS = ["graph", "launches", "tiny (< 1 MB)", "te kernels", "GEMMs", "attention", "other extern",
            "memory-bound GB", "of which te kernels GB", "roofline ms", "repeated stores", "note"]


def _cells(row: dict) -> list:
    graph = row["graph"] if row["repeats"] == 1 else f"{row['graph']} (x{row['repeats']} in the step)"
    note = row["note"] or (f"{row['unknown_bytes']} launches without bytes" if row["unknown_bytes"] else "")
    return [graph, row["launches"], row["tiny"], row["te_kernels"], row["gemms"], row["attention"],
            row["other_extern"], f"{row['memory_bytes'] / 1e9:.2f}", f"{row['te_bytes'] / 1e9:.2f}",
            f"{row['roofline_ms']:.3f}", row["repeated_stores"], note]


def provider_table(rows: list[dict], total_label: str, fmt: str = "simple") -> str:
    body = [_cells(r) for r in rows] + [_cells(_total(rows, total_label))]
    return tabulate(body, headers=_HEADERS, tablefmt=fmt, disable_numparse=True)


def case_summary(case: Case, by_provider: dict[str, list[dict]], failures: dict[str, str],
                 fmt: str = "simple") -> str:
    """One row per provider: the step's totals side by side. More graphs than a forward and a backward
    per part are graph breaks: what runs eagerly between them is not in the counts."""
    body = []
    for name, rows in by_provider.items():
        t = _total(rows, "step")
        breaks = len(rows) > 2 * len(case.parts)
        body.append([name, len(rows), t["launches"], t["tiny"], t["te_kernels"], t["gemms"], t["other_extern"],
                     f"{t['memory_bytes'] / 1e9:.2f}", f"{t['roofline_ms']:.3f}",
                     "graph breaks: eager code between the graphs not counted" if breaks else ""])
    body += [[name, "", "", "", "", "", "", "", "", why] for name, why in failures.items()]
    return tabulate(body, headers=["provider", "graphs", "launches", "tiny", "te kernels", "GEMMs", "other extern",
                                   "memory-bound GB", "roofline ms", "note"], tablefmt=fmt, disable_numparse=True)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def _save_code(out_dir: str, r: GraphResult) -> str:
    path = os.path.join(out_dir, r.case, _slug(r.provider), f"{r.part}_{r.graph}.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(r.code)
    return path


def sm90_table(builds_by_graph: dict[tuple[str, str, str], list[Build]], fmt: str = "simple") -> str:
    """Per graph: kernels and configs built, failures, the most registers, spilling kernels, the most
    shared memory."""
    body = []
    for (case, provider, graph), builds in builds_by_graph.items():
        ok = [b for b in builds if b.ok]
        body.append([case, provider, graph, len({b.kernel for b in builds}), len(builds),
                     len(builds) - len(ok), max((b.registers or 0 for b in ok), default=0),
                     len({b.kernel for b in ok if b.local_bytes}), max((b.shared_bytes or 0 for b in ok), default=0)])
    return tabulate(body, headers=["case", "provider", "graph", "kernels", "configs built", "failed",
                                   "max registers", "kernels spilling", "max shared B"], tablefmt=fmt,
                    disable_numparse=True)


def _parse_size(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected BxTxC with positive integers, e.g. 2x2048x4096; got {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--cases", nargs="+", choices=ALL_CASES, default=list(ALL_CASES))
    parser.add_argument("--providers", nargs="+", choices=tuple(PROVIDERS), metavar="NAME",
                        help=f"of {', '.join(PROVIDERS)} (default: all but torchao float8 rowwise, the torchao "
                             "ones only when torchao imports)")
    parser.add_argument("--copy-gbps", type=float, default=DEFAULT_COPY_GBPS,
                        help=f"copy bandwidth of the roofline projection, GB/s (default {DEFAULT_COPY_GBPS:g}, "
                             "an H100 SXM)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"where the code and tables go (default {DEFAULT_OUT})")
    parser.add_argument("--compile-sm90", action="store_true",
                        help="build every generated Triton kernel for sm90 (registers, spills, shared memory)")
    parser.add_argument("--sm90-configs", choices=("all", "first"), default="all",
                        help="build each kernel under every launch config inductor would compile before "
                             "autotuning (all, the default) or only its first")
    parser.add_argument("--markdown", action="store_true", help="print the tables as GitHub markdown")
    parser.add_argument("--tokens", type=int, default=8192, help="step: tokens of the one sequence (default 8192)")
    parser.add_argument("--layers", type=int, default=4, help="step: layers the step row counts (default 4)")
    parser.add_argument("--block-size", type=_parse_size, default=(2, 2048, 4096),
                        help="block: BxTxC (default 2x2048x4096)")
    parser.add_argument("--heads", type=int, default=32, help="block: attention heads (default 32)")
    parser.add_argument("--moe-shape", default="mixtral", help="moe: a bench_moe.py CUDA shape (default mixtral)")
    parser.add_argument("--small-gemms", choices=SMALL_GEMMS, default="auto",
                        help="te's [rewrite] small_gemms (default auto, te's default: a GEMM no larger in any "
                             "dim than 4096 stays in high precision; fp8 for scaled-down shapes)")
    return parser


class _Run:
    """What one run prints and writes: the tables as they are printed, the rows behind them, every
    launch and every sm90 build."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.fmt = "github" if args.markdown else "simple"
        self.lines: list[str] = []
        self.rows: list[dict] = []
        self.launch_rows: list[dict] = []
        self.sm90_rows: list[dict] = []
        self.builds: dict[tuple[str, str, str], list[Build]] = {}

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def case(self, case: Case, names: list[str]) -> None:
        self.say(f"\n== {case.name}: {case.shape}")
        by_provider: dict[str, list[dict]] = {}
        failures: dict[str, str] = {}
        for name in (n for n in names if case.name in PROVIDERS[n].cases):
            start = time.perf_counter()
            try:
                results = capture(case, PROVIDERS[name])
            except Exception as e:   # one provider failing must not hide the others
                failures[name] = _common.failure_note(e, limit=200)
                self.say(f"\n{name}: {failures[name]} (after {time.perf_counter() - start:.0f} s)")
                continue
            by_provider[name] = [counts(r, self.args.copy_gbps) for r in results]
            self.rows += by_provider[name]
            label = "step" if len(case.parts) > 1 or case.parts[0].repeats > 1 else "fwd + bwd"
            self.say(f"\n{name} ({time.perf_counter() - start:.0f} s to generate):")
            self.say(provider_table(by_provider[name], label, self.fmt))
            for r in results:
                self.graph(r)
        if by_provider or failures:
            self.say(f"\n{case.name}, per provider ({case.shape}):")
            self.say(case_summary(case, by_provider, failures, self.fmt))

    def graph(self, r: GraphResult) -> None:
        """Keep one graph's code and launches; build its kernels for sm90 when asked."""
        path = _save_code(self.args.out, r)
        where = dict(case=r.case, provider=r.provider, graph=f"{r.part} {r.graph}")
        self.launch_rows += [dict(where, index=x.index, kind=x.kind, name=x.name,
                                  bytes="" if x.bytes is None else x.bytes) for x in r.launches]
        if self.args.compile_sm90:
            builds = build_sm90(kernel_sources(r.code).values(), os.path.splitext(path)[0] + "_sm90",
                                all_configs=self.args.sm90_configs == "all")
            self.builds[(r.case, r.provider, where["graph"])] = builds
            self.sm90_rows += [dict(where, **asdict(b)) for b in builds]

    def finish(self) -> int:
        """The sm90 summary and failures, then the files; 1 when a kernel failed to build."""
        failed = [b for b in self.sm90_rows if b["error"]]
        if self.args.compile_sm90:
            self.say(f"\nsm90 builds (Triton's ptxas; {self.args.sm90_configs} configs):")
            self.say(sm90_table(self.builds, self.fmt))
            self.say(f"{len(self.sm90_rows) - len(failed)} of {len(self.sm90_rows)} kernel configs built for sm90")
            for b in failed:
                self.say(f"  FAILED {b['case']} / {b['provider']} / {b['graph']}: {b['kernel']} [{b['config']}]: "
                         f"{b['error']}")
        self.say(f"\ncode, launches.csv, summary.txt, summary.json{', sm90.csv' if self.args.compile_sm90 else ''} "
                 f"in {self.args.out}")
        self._write()
        return 1 if failed else 0

    def _write(self) -> None:
        import triton

        out = self.args.out
        for name, table in (("launches.csv", self.launch_rows), ("sm90.csv", self.sm90_rows)):
            if table:
                with open(os.path.join(out, name), "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=list(table[0]))
                    writer.writeheader()
                    writer.writerows(table)
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump({"torch": torch.__version__, "triton": triton.__version__, "copy_gbps": self.args.copy_gbps,
                       "rows": self.rows, "sm90": self.sm90_rows}, f, indent=1)
        with open(os.path.join(out, "summary.txt"), "w") as f:
            f.write("\n".join(self.lines) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.copy_gbps <= 0:
        parser.error(f"--copy-gbps must be positive, got {args.copy_gbps}")
    if args.block_size[2] % args.heads:
        parser.error(f"--heads {args.heads} must divide the block width {args.block_size[2]}")
    if args.compile_sm90:
        ok, why = ptxas_available()
        if not ok:
            parser.error(f"--compile-sm90: {why}")
    names = args.providers or _default_providers()
    _SMALL_GEMMS["value"] = args.small_gemms
    missing = sorted(n for n in names if PROVIDERS[n].torchao and not _common.torchao_available())
    if missing:
        parser.error(f"{', '.join(missing)}: {_common.TORCHAO_MISSING}")
    try:
        cases = make_cases(args.cases, args)
    except ValueError as e:
        parser.error(str(e))

    import triton

    os.makedirs(args.out, exist_ok=True)
    run = _Run(args)
    run.say(f"offline H100 model, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: torch "
            f"{torch.__version__}, Triton {triton.__version__}; counts from inductor's generated CUDA code (no GPU), "
            f"roofline at {args.copy_gbps:g} GB/s: a projection, not a measurement")
    for case in cases:
        run.case(case, names)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
