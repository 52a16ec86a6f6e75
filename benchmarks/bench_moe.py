"""One MoE layer's training step, forward + backward: te vs inductor vs torchao's MoE FP8 prototype,
measured side by side in one run.

    python benchmarks/bench_moe.py                  # CPU: small shapes (see SHAPES)
    python benchmarks/bench_moe.py --device cuda    # Mixtral-like and small-expert shapes, 16k tokens
    python benchmarks/bench_moe.py --providers bf16 "te Float8CurrentScaling" --jsonl results.jsonl
                                                    # a lease part: rows, kernels, generated code

The layer (``MoELayer``, written as torchtitan writes one): a router (``nn.Linear``, top-k of a
softmax), each token's copies sorted by expert, the experts as three grouped GEMMs with a SwiGLU
(``te_compile.models.Experts``: 3-D weights through ``torch._grouped_mm`` in bf16), and the weighted
sum back to the tokens. Shapes: Mixtral-like (E = 8, top-2, hidden 4096, ffn 14336), small experts
(E = 64, top-8, hidden 2048, ffn 1408), DeepSeek-V3's experts (hidden 7168, ffn 2048, top-8; 64 of its
256 experts, to fit one GPU) and Qwen3-30B-A3B's (E = 128, top-8, hidden 2048, ffn 768), 16k tokens,
on CUDA; scaled down on CPU.

Providers: ``inductor`` (torch.compile in high precision: the experts' grouped GEMMs in bf16 as the
model casts them, the rest bf16 on CUDA and fp32 on CPU); ``te <Recipe>`` (torch.compile with
backend="te"), each per-tensor recipe also with ``fp8_activation_input`` (the SwiGLU's gate and up
saved for backward in FP8); ``torchao MoE float8 rowwise`` (``torchao.quantization.quantize_`` with
``Float8TrainingOpConfig`` on the experts, then inductor) when torchao imports; its FP8 grouped GEMM
(``torch._scaled_grouped_mm`` and Triton kernels) needs an sm90 GPU: off CUDA the row says how it failed.

Columns: the median step time and its ratio to inductor's; the first call (compile included); the
bytes one step saves for backward (distinct storages; parameters, buffers and delayed scaling's
state excluded, as they live across steps anyway: te keeps FP8 copies of the
expert GEMMs' operands, inductor high-precision activations) and their ratio; the expert GEMM sites te
rewrote. The goals (GPU: expert GEMMs fwd+bwd >= 1.3x bf16 at the Mixtral shape, never slower than
bf16 at the small-expert shape; CPU: saved bytes <= 0.6x high precision) are printed beside the
measured figures.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import torch
import torch.nn as nn
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common  # noqa: E402
import te_compile  # noqa: E402
from te_compile.gemm.grouped import pad_groups  # noqa: E402
from te_compile.memory import saved_for_backward_bytes  # noqa: E402
from te_compile.models import Experts  # noqa: E402

# name -> (experts, top-k, hidden, ffn, tokens), per device
SHAPES = {
    # DeepSeek-V3's routed experts (hidden 7168, FFN 2048, top-8) with 64 of its 256 experts, so that
    # the bf16 weights and their gradients (11 GB, not 45) leave an 80 GB GPU room for the rest;
    # Qwen3-30B-A3B's (128 experts, hidden 2048, FFN 768, top-8)
    "cuda": {"mixtral": (8, 2, 4096, 14336, 16384), "small experts": (64, 8, 2048, 1408, 16384),
             "deepseek-v3": (64, 8, 7168, 2048, 16384), "qwen3-moe": (128, 8, 2048, 768, 16384)},
    "cpu": {"mixtral": (8, 2, 256, 512, 1024), "small experts": (32, 8, 128, 96, 512),
            "deepseek-v3": (16, 8, 224, 64, 512), "qwen3-moe": (32, 8, 128, 48, 512)},
    # the lease kit's --dry: the same code paths in seconds
    "dry": {"mixtral": (4, 2, 32, 64, 64), "small experts": (8, 4, 32, 32, 64),
            "deepseek-v3": (8, 4, 64, 32, 64), "qwen3-moe": (8, 4, 32, 32, 64)},
}
# lease part providers; "E4M3" puts the gradients in E4M3 (HYBRID's E5M2 has no scaled grouped GEMM)
LEASE_PROVIDERS = ("bf16", "te Float8CurrentScaling", "te Float8CurrentScaling E4M3", "torchao MoE float8 rowwise")
GOALS = {"mixtral": 1.3, "small experts": 1.0, "saved_cpu": 0.6}
TE_RECIPES = ("Float8CurrentScaling", "DelayedScaling", "Float8BlockScaling", "MXFP8BlockScaling")
PER_TENSOR = ("Float8CurrentScaling", "DelayedScaling")


class MoELayer(nn.Module):
    """Router, top-k, permute, experts, unpermute: one MoE layer without its shared expert."""

    def __init__(self, experts: int, top_k: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.top_k = top_k
        # rows per expert group: torchao's FP8 grouped GEMM needs every group a multiple of 16 rows, and
        # torchtitan pads the permuted tokens for it; te pads inside its lowering, so 1 elsewhere
        self.align = 1
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, ffn)
        for p in self.experts.parameters():
            nn.init.normal_(p, std=hidden ** -0.5)

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None):
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)          # [T, k]
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.router.out_features, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))
        tokens = x[order // self.top_k]
        if self.align > 1:   # zero rows after each group, on the device (te's own padding code)
            dest, padded_offs, rows = pad_groups(torch.cumsum(counts, 0, dtype=torch.int32), tokens.shape[0],
                                                 self.align)
            tokens = tokens.new_zeros(rows, tokens.shape[1]).index_copy(0, dest, tokens)
            out = self.experts(tokens, torch.diff(padded_offs, prepend=padded_offs.new_zeros(1))).index_select(0, dest)
        else:
            out = self.experts(tokens, counts)
        routed = out * weights.reshape(-1)[order, None]
        y = torch.zeros_like(x).index_add(0, order // self.top_k, routed)
        return y, y.float().square().mean()


def torchao_moe(model: MoELayer) -> MoELayer:
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    # quantize_'s default filter takes nn.Linear modules only: name the experts, as torchtitan does
    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda module, fqn: isinstance(module, Experts))
    model.align = 16
    return model


def _providers(device: torch.device, recipes, args) -> list[_common.Provider]:
    """inductor, te with each recipe (and its variants), torchao's MoE training."""
    out = [_common.Provider("inductor", False, lambda m: torch.compile(m, dynamic=False),
                            "torch.compile, experts in bf16")]
    for recipe in recipes:
        options = dict(_common.TE_RECIPES.get(recipe, {}), recipe=recipe)
        variants = [(f"te {recipe}", options, "")]
        if recipe in PER_TENSOR and args.e4m3_grads:
            # HYBRID's E5M2 gradients have no native grouped GEMM (torch._scaled_grouped_mm is E4M3 x E4M3)
            variants.append((f"te {recipe} E4M3 grads", dict(options, fp8_format="E4M3"), "fp8_format = E4M3"))
        if recipe in PER_TENSOR and not args.no_fp8_act_input:   # the SwiGLU's inputs saved in FP8
            variants.append((f"te {recipe} +fp8 act input", dict(options, fp8_activation_input=True),
                             "fp8_activation_input = true"))
        for name, o, note in variants:
            out.append(_common.Provider(
                name, True, lambda m, o=o: torch.compile(m, backend=te_compile.backend(**o), dynamic=False), note))
    if _common.torchao_available():
        out.append(_common.Provider(
            "torchao MoE float8 rowwise", True, lambda m: torch.compile(torchao_moe(m), dynamic=False),
            "rowwise FP8 grouped GEMMs (torch._scaled_grouped_mm, sm90 GPUs); groups padded to 16 rows"))
    else:
        out.append(_common.Provider("torchao MoE float8 rowwise", True, None, _common.TORCHAO_MISSING))
    return out


def _case(name: str, device: torch.device, dtype: torch.dtype, args, recipes) -> list[dict]:
    experts, top_k, hidden, ffn, tokens = SHAPES[device.type][name]
    torch.manual_seed(0)
    base = MoELayer(experts, top_k, hidden, ffn).to(device=device, dtype=dtype)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=None)
    # three GEMMs of [tokens * k, hidden] x [hidden, ffn] (or back), forward and two backward each
    flops = 6.0 * 3 * tokens * top_k * hidden * ffn
    rows, baseline, baseline_bytes = [], None, None
    for provider in _providers(device, recipes, args):
        row = {"shape": name, "provider": provider.name, "ms": None, "vs inductor": None, "TFLOP/s": None,
               "first s": None, "saved MiB": None, "saved vs inductor": None, "expert sites": "",
               "note": provider.note}
        rows.append(row)
        made = {}

        def build(prepare: Callable, made=made) -> Callable[[], None]:
            model = made["model"] = prepare(_common.fresh_copy(base))
            return lambda: model(x)[1].backward()

        def measure(made=made) -> None:
            made["saved"] = saved_for_backward_bytes(made["model"], x, None)

        first, median, row["note"] = _common.run_provider(provider, build, device, args, measure)
        if median is None:
            continue
        saved = made["saved"]
        if provider.name == "inductor":
            baseline, baseline_bytes = median, saved
        sites = [s for s in te_compile.report().sites if s.op == "grouped_linear"]
        row.update({"ms": median * 1e3, "TFLOP/s": flops / median / 1e12, "first s": first,
                    "saved MiB": saved / 2**20,
                    "expert sites": f"{sum(s.rewritten for s in sites)}/{len(sites)}"
                    if provider.name.startswith("te") else ""})
        if baseline:
            row["vs inductor"] = baseline / median
            row["saved vs inductor"] = saved / baseline_bytes
        print(f"  {name:>14}  {provider.name:<28} {median * 1e3:9.2f} ms  saved {saved / 2**20:8.2f} MiB",
              flush=True)
    return rows


def _lease_prepare(provider: str, args) -> Callable:
    """MoELayer -> compiled layer for a lease provider name."""
    compiler = _common.lease_compiler(args)
    if provider == "torchao MoE float8 rowwise":
        if not _common.torchao_available():
            raise ImportError(_common.TORCHAO_MISSING)
        return lambda m: torch.compile(torchao_moe(m), backend=compiler, dynamic=False)
    if provider.startswith("te ") and provider.endswith(" E4M3"):
        return _common.lease_backend(provider[:-len(" E4M3")], args, fp8_format="E4M3")
    return _common.lease_backend(provider, args)


def lease_main(args) -> None:
    """The lease part: each of --providers compiled once per shape, timed, profiled, rows to --jsonl."""
    device = _common.lease_device(args)
    cuda = device.type == "cuda"
    dtype = _common.baseline_dtype(device)
    for provider in args.providers or LEASE_PROVIDERS:
        for name in args.shapes:
            experts, top_k, hidden, ffn, tokens = SHAPES["cuda" if cuda else "dry"][name]
            shape = f"E{experts} top{top_k} {hidden}x{ffn} T{tokens} {name.replace(' ', '-')} fwd+bwd"

            def build(provider=provider, experts=experts, top_k=top_k, hidden=hidden, ffn=ffn, tokens=tokens):
                torch.manual_seed(0)
                layer = MoELayer(experts, top_k, hidden, ffn).to(device=device, dtype=dtype)
                x = torch.randn(tokens, hidden, device=device, dtype=dtype)
                model = _lease_prepare(provider, args)(layer)
                return lambda: model(x)[1].backward()
            _common.lease_step(args, part="moe", provider=provider, shape=shape, build=build,
                               warmup=3 if cuda else 1, iters=args.iters or (10 if cuda else 3), tokens=tokens,
                               flops=6.0 * 3 * tokens * top_k * hidden * ffn, dtype=str(dtype).replace("torch.", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES["cpu"]), default=list(SHAPES["cpu"]))
    parser.add_argument("--recipes", nargs="+", choices=TE_RECIPES, default=list(TE_RECIPES[:2]),
                        help="te recipes (default: Float8CurrentScaling DelayedScaling)")
    parser.add_argument("--e4m3-grads", action="store_true",
                        help="also run each per-tensor recipe with fp8_format = E4M3 (gradients in E4M3)")
    parser.add_argument("--no-fp8-act-input", action="store_true",
                        help="skip the fp8_activation_input rows")
    _common.add_common_args(parser)
    _common.add_lease_args(parser, LEASE_PROVIDERS)
    args = parser.parse_args()
    if args.jsonl or args.ncu_target:
        lease_main(args)
        return
    device = _common.resolve_device(args)
    if device.type == "cpu":
        args.iters = min(args.iters, 5)
    dtype = _common.baseline_dtype(device)
    print(f"bench_moe: one MoE layer, forward + backward, {_common.describe_machine(device)}; median of "
          f"{args.iters} after {args.warmup} warm-up", flush=True)
    rows = [r for shape in args.shapes for r in _case(shape, device, dtype, args, args.recipes)]

    def fmt(v, spec, suffix=""):
        return "n/a" if v is None else format(v, spec) + suffix
    table = [(r["shape"], r["provider"], fmt(r["ms"], ".2f"), fmt(r["vs inductor"], ".2f", "x"),
              fmt(r["TFLOP/s"], ".3f"), fmt(r["first s"], ".1f"), fmt(r["saved MiB"], ".2f"),
              fmt(r["saved vs inductor"], ".2f", "x"), r["expert sites"], r["note"]) for r in rows]
    print()
    print(tabulate(table, headers=["shape", "provider", "median ms", "vs inductor", "TFLOP/s", "first call s",
                                   "saved MiB", "saved vs inductor", "expert sites", "note"], disable_numparse=True))
    print("\ngoals:")
    for r in rows:
        if not r["provider"].startswith("te ") or r["ms"] is None:
            continue
        if device.type == "cuda":
            print(f"- {r['shape']}, {r['provider']}: {r['vs inductor']:.2f}x bf16 (goal >= {GOALS[r['shape']]}x)")
        else:
            print(f"- {r['shape']}, {r['provider']}: saved {r['saved vs inductor']:.2f}x high precision "
                  f"(goal <= {GOALS['saved_cpu']}x); speed on CPU says nothing about a GPU")


if __name__ == "__main__":
    main()
