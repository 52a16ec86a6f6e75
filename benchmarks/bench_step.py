"""A training step at the shape people train: a Llama 3 8B-shaped model, bf16 inductor vs te vs torchao.

    python benchmarks/bench_step.py --plan                     # the memory plan at the real shape, nothing run
    python benchmarks/bench_step.py --providers "bf16" "te Float8CurrentScaling" \\
        --jsonl OUT/results.jsonl --kernels-csv OUT/kernels.csv --trace-dir OUT/traces --code-dir OUT/code
    python benchmarks/bench_step.py --dry                      # a scaled-down shape on the CPU (the test's run)

The model is Llama 3 8B's width (4096, 32 heads, 8 KV heads of 128, SwiGLU FFN 14336, RMSNorm, RoPE
with theta 500000, vocabulary 128256, an untied output layer) cut to ``--layers`` (4) layers, run on
``--batch`` 1 x ``--tokens`` 8192. It is written as a user writes it: ``nn.Linear``, ``nn.RMSNorm``,
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` and ``F.cross_entropy`` over the
output layer's logits, nothing te-specific, so te finds every linear (norm -> wq/wk/wv and
norm -> w1/w3 fused, SwiGLU -> w2 fused) and the final norm + output layer + loss as one op.

Precision: the weights, gradients and AdamW state are fp32 (master weights) and the forward runs under
``torch.autocast(bfloat16)``, for every provider: "bf16" is that model under plain ``torch.compile``
(inductor), the baseline the FP8 providers are measured against. The optimizer is
``torch.optim.AdamW(fused=True)``, stepped eagerly after the compiled forward and backward.

Providers (``--providers``, default all): ``bf16``, ``te Float8CurrentScaling``, ``te DelayedScaling``
(amax history 16), ``torchao float8 tensorwise`` and ``torchao float8 rowwise``
(``convert_to_float8_training`` of every linear, the output layer included, then the same compile;
``emulate=True`` off CUDA). A torchao provider is skipped, with its reason in the log and a row with
no median, when torchao does not import (``pip install -e '.[bench]'``).
By name only (the lease kit's offload part): ``te Float8CurrentScaling offload`` (te's
``[memory] offload_activations``) and ``bf16 offload`` (torch's own activation offload flags in
``torch._functorch.config``, nothing of te's), each with one more row, ``offloaded_bytes``: the saved
tensors that live in host memory during a step on a GPU (te's report on a CPU; bf16's not counted there).
By name only (the lease kit's combo part): ``te Float8CurrentScaling combo`` and ``te DelayedScaling
combo``, te with its ``combo_kernels`` key (inductor's combo kernels: independent small kernels
launched as one).

Each provider runs in its own process (a child of this script), one after the other, so compiled
code, Dynamo's caches and the CUDA allocator start clean; ratios against bf16 are taken between the
children of one run. A child compiles once: its first step compiles (timed as ``first_call_s``), and
the same compiled code serves the timed steps, the profile and the generated code kept under
``--code-dir/<provider>/`` (its own inductor and Triton cache). Compilation is per block
(``--compile block``, torchtitan's layout: each layer's ``.compile()``, the identical layers sharing
one graph) plus one graph for the final norm, output layer and loss, so compile time is one layer's
whatever ``--layers``; ``--compile whole`` compiles the model as one graph.

Measures, one JSON row each (``benchmarks/_record.py``; part "step", shape
"llama3-8b 4L 1x8192 fwd+bwd+adamw" and "... fwd+bwd"): ``tokens_per_s``, ``ms`` (median, p10, p90 of
CUDA-event-timed back-to-back steps) and ``peak_GiB`` (``torch.cuda.max_memory_allocated`` over the
timed steps; on a CPU the process's peak RSS), with and without the optimizer step. The full step is
then profiled (``--profile-steps``): a Chrome trace per provider in ``--trace-dir`` and every kernel in
``--kernels-csv``. te's rows say how many of the model's linears its report shows rewritten and
whether the output layer and loss were fused. ``--micro-batches N`` makes a step N forward + backward
passes with their gradients accumulated, then the optimizer step (tokens per second count all N): the
shape of training with gradient accumulation, where ``te Float8CurrentScaling cached weights`` (the
``cache_fp8_weights`` key) quantizes each weight once per step instead of once per micro-batch. Its
``fwd+bwd`` rows reuse the copies in every micro-batch (no optimizer step moves the weights there):
compare the full steps.

Memory plan at the real shape (``--plan``; 1 x 8192 tokens, 4 layers), an upper bound that holds
every term at once:

    parameters                1923.1 M  (embedding 525.3 M, output 525.3 M, 4 layers x 218.1 M)
    fp32 weights               7.69 GB
    fp32 gradients             7.69 GB
    AdamW exp_avg, exp_avg_sq 15.39 GB
    bf16 weight copies         2.80 GB  (autocast's casts, one per linear weight)
    saved activations          5.10 GB  (1.28 GB per layer: bf16, the residual stream fp32)
    unfused head + loss       10.51 GB  ([8192, 128256] logits in bf16 and fp32, and the fp32 gradient)
    total                     49.18 GB  (45.8 GiB) against an H100's 80 GB

so the asked shape (4 layers x 8192 tokens with the 128k-vocabulary head) fits with about 30 GB to
spare; the bf16 baseline's unfused head is the largest term after the optimizer state, and te's fused
output layer keeps none of it. The step is 81.9 TFLOP (6 x linear parameters x tokens + attention).

``--dry`` (automatic without CUDA) runs the same code at a tiny shape (width 64, 4 heads, 2 KV heads,
FFN 160, vocabulary 512, 2 layers, 1 x 64 tokens) on the CPU with ``--compiler aot_eager`` (te's
passes and report, no inductor code: an inductor compile of even this shape takes 1-2 minutes per
provider on a 2-core CPU), about 15 s per provider; ``--dry --compiler inductor`` generates the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import _record
from _common import TE_RECIPES, TORCHAO_MISSING, torchao_convert

__all__ = [
    # the model
    "LlamaConfig", "LLAMA3_8B", "DRY", "Llama", "Block", "Attention", "FeedForward", "rope_tables",
    # what it costs
    "memory_plan", "step_flops",
    # the benchmark
    "PROVIDERS", "main",
]

PROVIDERS = ("bf16", "te Float8CurrentScaling", "te DelayedScaling", "torchao float8 tensorwise",
             "torchao float8 rowwise")
# by name only (the lease kit's offload part): the same steps with the saved activations offloaded to host
# memory, te's through [memory] offload_activations, bf16's through torch's partitioner flags alone
OFFLOAD = " offload"
OFFLOAD_PROVIDERS = ("bf16" + OFFLOAD, "te Float8CurrentScaling" + OFFLOAD)
# by name only (the lease kit's combo part): te with inductor's combo kernels (the combo_kernels key)
COMBO = " combo"
COMBO_PROVIDERS = ("te Float8CurrentScaling" + COMBO, "te DelayedScaling" + COMBO)
# by name only (the lease kit's accum part, with --micro-batches): te with the cache_fp8_weights key, each
# weight quantized at the first micro-batch of a step and its FP8 copy reused by the others
CACHED = " cached weights"
CACHED_PROVIDERS = ("te Float8CurrentScaling" + CACHED,)
_PART = "step"
_LAUNCHED = "BENCH_STEP_LAUNCHED"   # the parent's time.time() when it started a child, for the child's startup_s
_GiB = 2.0 ** 30
_H100_BYTES = 80e9


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    name: str            # the shape's name in the rows' ``shape``
    dim: int             # model width
    n_heads: int         # query heads; head_dim = dim // n_heads
    n_kv_heads: int      # key/value heads (grouped-query attention), dividing n_heads
    ffn_dim: int         # SwiGLU hidden width
    vocab: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: dim={self.dim} must divide by n_heads={self.n_heads}, and "
                             f"n_heads by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"{self.name}: RoPE needs an even head_dim, got {self.dim // self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


LLAMA3_8B = LlamaConfig("llama3-8b", dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab=128256)
# every GEMM dim a multiple of 16, so te and torchao take every linear, as at the real shape
DRY = LlamaConfig("llama3-dry", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab=512)
_REAL_RUN = {"layers": 4, "batch": 1, "tokens": 8192, "warmup": 3, "iters": 20, "profile_steps": 3,
             "compiler": "inductor"}
# aot_eager: an inductor compile of the dry shape takes 1-2 minutes per provider on a 2-core CPU
_DRY_RUN = {"layers": 2, "batch": 1, "tokens": 64, "warmup": 1, "iters": 3, "profile_steps": 1,
            "compiler": "aot_eager"}


# ---------------------------------------------------------------------------------------------------
# The model: plain PyTorch, as a user writes a Llama


def rope_tables(head_dim: int, tokens: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [tokens, head_dim] fp32, for the rotate-half form of RoPE."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [hd / 2]
    angles = torch.outer(torch.arange(tokens, dtype=torch.float32), inv_freq)                 # [T, hd / 2]
    angles = torch.cat([angles, angles], dim=-1)                                               # [T, hd]
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, T, hd]; cos, sin: [T, hd], cast to x's dtype so that autocast's bf16 q, k stay bf16
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape                                                     # x: [B, T, dim]
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)      # [B, H, T, hd]
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)   # [B, KV, T, hd]
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, H, T, hd]
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)   # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)   # up
        self.w2 = nn.Linear(hidden, dim, bias=False)   # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm Llama block: h = x + attention(norm(x)); h + feed_forward(norm(h))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """``forward(tokens [B, T], targets [B, T]) -> mean cross-entropy``, for sequences of ``tokens``."""

    def __init__(self, cfg: LlamaConfig, n_layers: int, tokens: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.head_dim, tokens, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)                                       # [B, T, dim]
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.loss(h, targets)

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(h))                                    # [B, T, vocab]
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---------------------------------------------------------------------------------------------------
# What a step costs: memory and FLOPs, computed from the shape alone


def _param_counts(cfg: LlamaConfig, n_layers: int) -> dict[str, int]:
    kv = cfg.n_kv_heads * cfg.head_dim
    attention = cfg.dim * cfg.dim * 2 + cfg.dim * kv * 2          # wq, wo; wk, wv
    layer = attention + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim   # + w1, w2, w3 and two norms
    return {"embedding": cfg.vocab * cfg.dim, "layer": layer, "layers": n_layers * layer,
            "output": cfg.vocab * cfg.dim, "linear": n_layers * (layer - 2 * cfg.dim) + cfg.vocab * cfg.dim,
            "total": 2 * cfg.vocab * cfg.dim + n_layers * layer + cfg.dim}


def memory_plan(cfg: LlamaConfig, n_layers: int, batch: int, tokens: int) -> list[tuple[str, float, str]]:
    """(item, bytes, how it was counted) for one training step, the last item the total: an upper
    bound that counts every saved tensor of the unfused bf16 step at once. Activations are those
    autograd keeps for backward, bf16 under autocast except the fp32 residual stream."""
    p = _param_counts(cfg, n_layers)
    n = batch * tokens
    kv = cfg.n_kv_heads * cfg.head_dim
    per_layer = (4 * n * cfg.dim * 2                               # the two norms' fp32 inputs
                 + 2 * n * cfg.dim * 2                             # their bf16 outputs (linear inputs)
                 + 2 * n * (cfg.dim + 2 * kv)                      # q, k, v after RoPE
                 + 2 * n * cfg.dim + 4 * n * cfg.n_heads           # attention output, its logsumexp
                 + 2 * n * cfg.ffn_dim * 3)                        # w1, w3 outputs and SwiGLU (w2 input)
    head = n * cfg.vocab * (2 + 4 + 4)                             # logits bf16, fp32, fp32 gradient
    items = [
        ("fp32 weights", 4.0 * p["total"], f"{p['total'] / 1e6:.1f} M parameters x 4 B"),
        ("fp32 gradients", 4.0 * p["total"], "x 4 B"),
        ("AdamW exp_avg, exp_avg_sq", 8.0 * p["total"], "x 8 B"),
        ("bf16 weight copies", 2.0 * p["linear"], "autocast's casts, one per linear weight, x 2 B"),
        ("saved activations", float(n_layers * per_layer),
         f"{per_layer / 1e9:.3f} GB per layer x {n_layers}: bf16, residual stream fp32"),
        ("unfused head + loss", float(head), f"[{n}, {cfg.vocab}] logits: bf16, fp32 and the fp32 gradient"),
    ]
    items.append(("total (upper bound)", sum(b for _, b, _ in items), "te's fused head saves the last item"))
    return items


def step_flops(cfg: LlamaConfig, n_layers: int, batch: int, tokens: int) -> float:
    """FLOPs of forward + backward: 6 x linear parameters x tokens, plus attention's
    12 x layers x dim x T per token (not halved for the causal mask, torchtitan's count)."""
    n = batch * tokens
    return 6.0 * _param_counts(cfg, n_layers)["linear"] * n + 12.0 * n_layers * cfg.dim * tokens * n


def _print_plan(cfg: LlamaConfig, n_layers: int, batch: int, tokens: int) -> None:
    p = _param_counts(cfg, n_layers)
    print(f"memory plan: {cfg.name}, {n_layers} layers, {batch} x {tokens} tokens, fp32 weights + "
          f"AdamW, bf16 autocast; parameters {p['total'] / 1e6:.1f} M (embedding {p['embedding'] / 1e6:.1f} M, "
          f"output {p['output'] / 1e6:.1f} M, {n_layers} layers x {p['layer'] / 1e6:.1f} M)")
    for item, nbytes, how in memory_plan(cfg, n_layers, batch, tokens):
        print(f"  {item:<27} {nbytes / 1e9:9.3f} GB {nbytes / _GiB:8.3f} GiB   {how}")
    total = memory_plan(cfg, n_layers, batch, tokens)[-1][1]
    if torch.cuda.is_available():
        device_bytes, device = torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    else:
        device_bytes, device = _H100_BYTES, "an H100's 80 GB"
    verdict = "fits" if total < 0.9 * device_bytes else "DOES NOT FIT (keep 10% for the allocator)"
    print(f"  {verdict} in {device}: {(device_bytes - total) / 1e9:.1f} GB to spare")
    print(f"  step FLOPs {step_flops(cfg, n_layers, batch, tokens) / 1e12:.4g} T (6 x linear params x "
          f"tokens + 12 x layers x dim x T x tokens)")


# ---------------------------------------------------------------------------------------------------
# One provider, in its own process


def _shape(cfg: LlamaConfig, args: argparse.Namespace, what: str) -> str:
    micro = f" x{args.micro_batches} micro-batches" if args.micro_batches > 1 else ""
    return f"{cfg.name} {args.layers}L {args.batch}x{args.tokens}{micro} {what}"


def _backend(provider: str, compiler: str, device: torch.device):
    """The torch.compile backend for ``provider`` (applied after torchao's module swap), whose graphs
    go to ``compiler``: inductor, or aot_eager (te's passes and report, no code generated)."""
    offload = provider.endswith(OFFLOAD)
    combo = provider.endswith(COMBO)
    cached = provider.endswith(CACHED)
    provider = provider.removesuffix(OFFLOAD).removesuffix(COMBO).removesuffix(CACHED)
    if provider == "bf16" or provider.startswith("torchao"):
        if offload:
            _torch_offload_on(device)
            # torch's offload is part of the min-cut partitioner, which plain aot_eager does not run
            return "aot_eager_decomp_partition" if compiler == "aot_eager" else compiler
        return compiler
    import te_compile

    recipe = provider.split(" ", 1)[1]
    memory = {"memory": {"offload_activations": True}} if offload else {}
    keys = {"combo_kernels": combo, "cache_fp8_weights": cached}
    return te_compile.backend(recipe=recipe, compiler=compiler, **TE_RECIPES[recipe], **memory,
                              **{k: True for k, on in keys.items() if on})


def _torch_offload_on(device: torch.device) -> None:
    """Turn on torch's activation offload for every compile of this process (the flags te's offload
    partition runs under), or say which flag this torch lacks."""
    import torch._functorch.config as functorch_config
    from te_compile.fx.offload import offload_flags

    flags = offload_flags(device)
    missing = [name for name in flags if not hasattr(functorch_config, name)]
    if missing:
        raise RuntimeError(f"torch {torch.__version__} has no activation offload flag(s) {missing} in "
                           f"torch._functorch.config")
    for name, value in flags.items():
        setattr(functorch_config, name, value)


def _host_saved_bytes(forward_backward: Callable[[], torch.Tensor], device: torch.device) -> Optional[int]:
    """Bytes of the distinct storages one forward saves for its backward in host memory while the model
    runs on ``device``: what an offload moved off the GPU. None on a CPU, where host and device are one."""
    if device.type == "cpu":
        return None
    from te_compile.memory import storages

    host: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            host.update(storages(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_backward()
    return sum(host.values())


def _compile(model: Llama, backend, mode: str) -> Callable:
    """The callable the steps run: per block (each layer compiled in place, the final norm + output
    layer + loss one more graph) or the whole model as one graph."""
    if mode == "whole":
        return torch.compile(model, backend=backend, dynamic=False)
    for layer in model.layers:
        layer.compile(backend=backend, dynamic=False)
    model.loss = torch.compile(model.loss, backend=backend, dynamic=False)
    return model


def _sdpa_backend(cfg: LlamaConfig, args: argparse.Namespace, device: torch.device) -> str:
    """Which SDPA kernel an eager call at the model's attention shape dispatches to (inductor keeps
    the op the dispatcher picks), from the aten op the profiler sees."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(args.batch, cfg.n_heads, args.tokens, cfg.head_dim, generator=gen).to(device, torch.bfloat16)
    kv = torch.randn(args.batch, cfg.n_kv_heads, args.tokens, cfg.head_dim, generator=gen).to(device, torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    names = {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")
             and e.name != "aten::_scaled_dot_product_attention"}
    return ", ".join(sorted(n.removeprefix("aten::_scaled_dot_product_") for n in names)) or "unknown"


def _te_report(model: Llama) -> dict:
    """How many of the model's nn.Linear modules te's report shows rewritten, and whether the output
    layer and its loss became one op."""
    import te_compile

    linears = {name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    report = te_compile.report()
    print(str(report), flush=True)
    rewritten = {s.fqn for s in report.rewritten if s.op in ("linear", "linear_cross_entropy")}
    fused = any(s.rewritten and s.op == "linear_cross_entropy" and s.fqn == "output" for s in report.sites)
    return {"linears_total": len(linears), "linears_rewritten": len(linears & rewritten),
            "linears_not_rewritten": sorted(linears - rewritten), "head_loss_fused": fused}


def _peak_gib(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / _GiB, "torch.cuda.max_memory_allocated"
    # ru_maxrss is KiB on Linux: the process's peak, not reset between measures
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GiB, "CPU process peak RSS"


def _run_child(args: argparse.Namespace, provider: str) -> int:
    """Build, compile once, time, profile and write the rows of ``provider``."""
    _record.provider_cache_dir(args.code_dir, provider)   # before the first compile: the code lands there
    cfg = DRY if args.dry else LLAMA3_8B
    device = torch.device("cpu" if args.dry else "cuda")
    common = {"batch": args.batch, "tokens": args.tokens, "layers": args.layers, "compile": args.compile,
              "micro_batches": args.micro_batches,
              "compiler": args.compiler,
              "dtype": "bf16 autocast over fp32 weights", "optimizer": "AdamW(fused=True)", "dry": args.dry}
    if provider.startswith("torchao"):
        try:
            import torchao.float8  # noqa: F401
        except ImportError as e:
            reason = f"skipped: {TORCHAO_MISSING}: {e}"
            print(f"bench_step: {provider}: {reason}", flush=True)
            _record.write_row(args.jsonl, part=_PART, provider=provider, metric="tokens_per_s", median=None,
                              shape=_shape(cfg, args, "fwd+bwd+adamw"), note=reason, **common)
            return 0

    torch.manual_seed(0)   # every provider's process builds the same weights and batch
    with torch.device(device):
        model = Llama(cfg, args.layers, args.tokens)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, cfg.vocab, (args.batch, args.tokens + 1), generator=gen).to(device)
    x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()          # [B, T] each
    if provider.startswith("torchao"):
        torchao_convert(model, provider.rsplit(" ", 1)[1], device)   # its FP8 GEMMs on CUDA, emulated elsewhere
    if provider.startswith("te"):
        import te_compile
        te_compile.reset()
    compiled = _compile(model, _backend(provider, args.compiler, device), args.compile)
    # after the swap: torchao's Float8Linear keeps the same Parameter objects
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def forward_backward() -> torch.Tensor:
        # gradient accumulation: the same batch for every micro-batch (their cost is what is timed)
        for _ in range(args.micro_batches):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = compiled(x, y) / args.micro_batches
            loss.backward()
        return loss

    def train_step() -> torch.Tensor:
        loss = forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def fwd_bwd_step() -> torch.Tensor:
        loss = forward_backward()
        opt.zero_grad(set_to_none=True)   # the same gradient buffers' life as in train_step
        return loss

    # from the parent's launch of this process: interpreter, imports, CUDA context, the model built
    startup_s = time.time() - float(os.environ.get(_LAUNCHED, time.time()))
    t0 = time.perf_counter()
    loss = train_step().item() * args.micro_batches   # the one compile; one micro-batch's loss
    first_s = time.perf_counter() - t0
    unique_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    sdpa = _sdpa_backend(cfg, args, device)
    print(f"bench_step: {provider}: first step (compile) {first_s:.1f} s, {unique_graphs} graphs, "
          f"loss {loss:.4f}, SDPA {sdpa}", flush=True)
    if not math.isfinite(loss):
        raise RuntimeError(f"{provider}: the first step's loss is {loss}")
    common.update(startup_s=round(startup_s, 2), first_call_s=round(first_s, 2), graphs=unique_graphs,
                  attention_backend=sdpa, loss=round(loss, 5))
    if provider.startswith("te"):
        common.update(_te_report(model))
        # lease_report.py's note column
        common["note"] = (f"linears {common['linears_rewritten']}/{common['linears_total']} rewritten, head + loss "
                          f"{'fused' if common['head_loss_fused'] else 'NOT fused'}; SDPA {sdpa}")
    if provider.endswith(OFFLOAD):
        _offload_row(args, provider, fwd_bwd_step, device, cfg, common)
    flops = step_flops(cfg, args.layers, args.batch, args.tokens)
    flops *= args.micro_batches
    n_tokens = args.batch * args.tokens * args.micro_batches

    t0 = time.perf_counter()
    steps = {}
    for what, fn in (("fwd+bwd+adamw", train_step), ("fwd+bwd", fwd_bwd_step)):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t = _record.time_steps(fn, warmup=args.warmup, iters=args.iters, device=device)
        peak, peak_how = _peak_gib(device)
        steps[what] = t
        shape = _shape(cfg, args, what)
        tok = {k: n_tokens / (t[f"{k}_ms"] / 1e3) for k in ("median", "p10", "p90")}
        _record.write_row(args.jsonl, part=_PART, provider=provider, shape=shape, metric="tokens_per_s",
                          median=tok["median"], spread=tok["p10"] - tok["p90"],
                          tflops=flops / (t["median_ms"] / 1e3) / 1e12, **common)
        _record.write_row(args.jsonl, part=_PART, provider=provider, shape=shape, metric="ms",
                          median=t["median_ms"], spread=t["p90_ms"] - t["p10_ms"], p10=t["p10_ms"],
                          p90=t["p90_ms"], samples=[round(s, 4) for s in t["samples"]], iters=args.iters,
                          warmup=args.warmup, **common)
        _record.write_row(args.jsonl, part=_PART, provider=provider, shape=shape, metric="peak_GiB",
                          median=peak, measured_by=peak_how, **common)
        print(f"bench_step: {provider}: {what}: {t['median_ms']:.2f} ms (p10 {t['p10_ms']:.2f}, p90 "
              f"{t['p90_ms']:.2f}), {tok['median']:.0f} tokens/s, peak {peak:.2f} GiB", flush=True)

    timing_s, t0 = time.perf_counter() - t0, time.perf_counter()
    if args.profile_steps:
        os.makedirs(args.trace_dir, exist_ok=True)
        trace = os.path.join(args.trace_dir, f"step_{_record.provider_slug(provider)}.json")
        _record.profile_steps(train_step, steps=args.profile_steps, trace_path=trace, csv_path=args.kernels_csv,
                              part=_PART, provider=provider, step_ms=steps["fwd+bwd+adamw"]["median_ms"],
                              shape=_shape(cfg, args, "fwd+bwd+adamw"))
    print(f"bench_step: {provider}: seconds: startup {startup_s:.1f}, first step {first_s:.1f}, timed steps "
          f"{timing_s:.1f}, profile {time.perf_counter() - t0:.1f}", flush=True)
    recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - unique_graphs
    if recompiled:
        print(f"bench_step: {provider}: WARNING: {recompiled} graphs compiled after the first step",
              flush=True)
    return 0


def _offload_row(args, provider: str, forward_backward, device: torch.device, cfg, common: dict) -> None:
    """One row: the bytes a step's offload moves to host memory (each way). Counted from the saved
    tensors that live on the host on a GPU; on a CPU from te's report (its offload rows), and not at
    all for bf16 there."""
    nbytes, how = _host_saved_bytes(forward_backward, device), "saved tensors in host memory (saved_tensors_hooks)"
    if nbytes is None and provider.startswith("te"):
        import te_compile
        from te_compile.fx.offload import moved_bytes

        nbytes, how = moved_bytes(te_compile.report().sites), "te's report (its offload rows)"
    if nbytes is None:
        how = "not counted on a CPU (host and device memory are one)"
    _record.write_row(args.jsonl, part=_PART, provider=provider, shape=_shape(cfg, args, "fwd+bwd"),
                      metric="offloaded_bytes", median=nbytes, measured_by=how, **common)
    print(f"bench_step: {provider}: offloaded per step: "
          f"{'n/a' if nbytes is None else f'{nbytes:,} B'} ({how})", flush=True)


# ---------------------------------------------------------------------------------------------------
# The parent: one child per provider, then the table of ratios


def _child_argv(args: argparse.Namespace, provider: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--child", provider, "--jsonl", args.jsonl,
            "--kernels-csv", args.kernels_csv, "--trace-dir", args.trace_dir, "--code-dir", args.code_dir,
            "--layers", str(args.layers), "--tokens", str(args.tokens), "--batch", str(args.batch),
            "--warmup", str(args.warmup), "--iters", str(args.iters), "--micro-batches", str(args.micro_batches),
            "--profile-steps", str(args.profile_steps), "--compile", args.compile, "--compiler", args.compiler]
    return argv + (["--dry"] if args.dry else [])


def _read_rows(path: str, offset: int) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        f.seek(offset)
        return [json.loads(line) for line in f if line.strip()]


def _summary(rows: list[dict], providers: list[str]) -> str:
    """One line per provider: each measure and its ratio to bf16's of this run."""
    def value(provider, what, metric):
        for r in rows:
            if r["provider"] == provider and r["shape"].endswith(" " + what) and r["metric"] == metric:
                return r
        return None

    def median(row) -> float:   # a measure an interrupted child did not reach reads nan
        return float("nan") if row is None or row["median"] is None else row["median"]

    lines = [f"{'provider':<27} {'step ms':>9} {'tokens/s':>9} {'x bf16':>7} {'fwd+bwd ms':>10} "
             f"{'x bf16':>7} {'peak GiB':>8}  te report"]
    for provider in providers:
        full, fb = value(provider, "fwd+bwd+adamw", "ms"), value(provider, "fwd+bwd", "ms")
        if full is None or full["median"] is None:
            note = (value(provider, "fwd+bwd+adamw", "tokens_per_s") or {}).get("note", "no rows (see the log)")
            lines.append(f"{provider:<27} {note}")
            continue
        base_full, base_fb = value("bf16", "fwd+bwd+adamw", "ms"), value("bf16", "fwd+bwd", "ms")
        ratio_full = f"{base_full['median'] / full['median']:.3f}" if base_full else "-"
        ratio_fb = f"{base_fb['median'] / fb['median']:.3f}" if base_fb and fb and fb["median"] else "-"
        tok, peak = (median(value(provider, "fwd+bwd+adamw", m)) for m in ("tokens_per_s", "peak_GiB"))
        te = (f"linears {full['linears_rewritten']}/{full['linears_total']} rewritten, head + loss "
              f"{'fused' if full['head_loss_fused'] else 'NOT fused'}") if "linears_total" in full else ""
        lines.append(f"{provider:<27} {full['median']:9.2f} {tok:9.0f} {ratio_full:>7} "
                     f"{median(fb):10.2f} {ratio_fb:>7} {peak:8.2f}  {te}")
    return "\n".join(lines)


def _stop(child: subprocess.Popen) -> None:
    """Let an interrupted child finish its own KeyboardInterrupt (``timeout -s INT`` signals the whole
    process group), pass the SIGINT on if it did not get one, and kill it if it still runs."""
    for wait_s, then in ((5, child.send_signal), (25, None)):
        try:
            child.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            if then is not None:
                then(signal.SIGINT)
    child.kill()
    child.wait()


def _run_parent(args: argparse.Namespace) -> int:
    cfg = DRY if args.dry else LLAMA3_8B
    print(f"bench_step: {cfg.name}, {args.layers} layers, {args.batch} x {args.tokens} tokens, "
          f"{'CPU (dry)' if args.dry else torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
          f"bf16 autocast over fp32 weights for every provider, AdamW(fused=True), compiled {args.compile}")
    _print_plan(cfg, args.layers, args.batch, args.tokens)
    offset = os.path.getsize(args.jsonl) if os.path.exists(args.jsonl) else 0
    failed = []
    for provider in args.providers:
        if provider.startswith("torchao") and importlib.util.find_spec("torchao") is None:
            reason = f"skipped: {TORCHAO_MISSING}"
            print(f"bench_step: {provider}: {reason}", flush=True)
            _record.write_row(args.jsonl, part=_PART, provider=provider, metric="tokens_per_s", median=None,
                              shape=_shape(cfg, args, "fwd+bwd+adamw"), note=reason, dry=args.dry)
            continue
        print(f"\nbench_step: {provider}", flush=True)
        t0 = time.perf_counter()
        child = subprocess.Popen(_child_argv(args, provider), env={**os.environ, _LAUNCHED: repr(time.time())})
        try:
            rc = child.wait()
        except KeyboardInterrupt:   # the kit's timeout: the child keeps the rows it wrote
            print(f"bench_step: interrupted during {provider}", flush=True)
            _stop(child)
            failed.append(provider)
            break
        print(f"bench_step: {provider}: process took {time.perf_counter() - t0:.1f} s, exit {rc}", flush=True)
        if rc != 0:
            failed.append(provider)
        if rc != 0 and not any(r["provider"] == provider for r in _read_rows(args.jsonl, offset)):
            _record.write_row(args.jsonl, part=_PART, provider=provider, metric="tokens_per_s", median=None,
                              shape=_shape(cfg, args, "fwd+bwd+adamw"), dry=args.dry,
                              note=f"failed: the provider's process exited {rc} (traceback in the log)")
    print("\n" + _summary(_read_rows(args.jsonl, offset), args.providers), flush=True)
    return 1 if failed else 0


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), metavar="NAME",
                        help=f"from {', '.join(repr(p) for p in PROVIDERS)} (default: all), or by name "
                             f"{', '.join(repr(p) for p in OFFLOAD_PROVIDERS + COMBO_PROVIDERS + CACHED_PROVIDERS)}")
    parser.add_argument("--jsonl", default="bench_step_results.jsonl", help="result rows are appended here")
    parser.add_argument("--kernels-csv", default="bench_step_kernels.csv", help="profiled kernels, appended")
    parser.add_argument("--trace-dir", default="bench_step_traces", help="one Chrome trace per provider")
    parser.add_argument("--code-dir", default="bench_step_code",
                        help="each provider's inductor and Triton cache (its generated code)")
    parser.add_argument("--dry", action="store_true", help="tiny shape on the CPU (automatic without CUDA)")
    parser.add_argument("--plan", action="store_true", help="print the memory plan and FLOPs, run nothing")
    parser.add_argument("--layers", type=int, help="Llama blocks (default 4; --dry 2)")
    parser.add_argument("--tokens", type=int, help="sequence length (default 8192; --dry 64)")
    parser.add_argument("--batch", type=int, help="sequences per step (default 1)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="forward + backward passes per optimizer step, their gradients accumulated (default 1)")
    parser.add_argument("--warmup", type=int, help="untimed steps before each timing (default 3; --dry 1)")
    parser.add_argument("--iters", type=int, help="timed steps per measure (default 20; --dry 3)")
    parser.add_argument("--profile-steps", type=int, help="profiled full steps, 0 for none (default 3; --dry 1)")
    parser.add_argument("--compile", choices=("block", "whole"), default="block",
                        help="per block + the head-and-loss graph (default), or the model as one graph")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"),
                        help="where the graphs go (default inductor; --dry aot_eager: te's passes and "
                             "report, no generated code, seconds per provider on a CPU)")
    parser.add_argument("--child", metavar="PROVIDER", help=argparse.SUPPRESS)   # the parent's children
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available() and not args.plan:
        print("bench_step: no CUDA device: running the --dry shape on the CPU", flush=True)
        args.dry = True
    for key, default in (_DRY_RUN if args.dry else _REAL_RUN).items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    for key in ("layers", "tokens", "batch", "iters", "micro_batches"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0 or args.profile_steps < 0:
        parser.error(f"--warmup and --profile-steps must be >= 0, got {args.warmup} and {args.profile_steps}")
    valid = PROVIDERS + OFFLOAD_PROVIDERS + COMBO_PROVIDERS + CACHED_PROVIDERS
    unknown = [p for p in args.providers + ([args.child] if args.child else []) if p not in valid]
    if unknown:
        parser.error(f"unknown provider(s) {unknown}; valid: {list(valid)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    if args.plan:
        _print_plan(DRY if args.dry else LLAMA3_8B, args.layers, args.batch, args.tokens)
        return 0
    if args.child:
        try:
            return _run_child(args, args.child)
        except KeyboardInterrupt:
            print(f"bench_step: {args.child}: interrupted; rows written so far are kept", flush=True)
            return 130
        except Exception:
            traceback.print_exc()
            return 1
    return _run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
