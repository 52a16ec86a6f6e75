"""The output layer and its loss, forward + backward: te's fused op against the unfused path, measured
side by side in one run.

    python benchmarks/bench_linear_ce.py                  # CPU: 1024 tokens, hidden 256, vocab 16032
    python benchmarks/bench_linear_ce.py --device cuda    # 8192 tokens, hidden 4096, vocab 128256 (Llama 3)

The model is a final RMSNorm, the output layer (bias-free) and ``F.cross_entropy`` on the fp32 logits,
as Hugging Face's causal LMs compute it. Providers: ``inductor`` (torch.compile, the unfused logits),
``te <recipe>`` with ``[rewrite] linear_cross_entropy`` on (fused) and off (unfused, the same recipe),
for high precision (recipe "none") and Float8CurrentScaling, and Liger-Kernel's
``LigerFusedLinearCrossEntropyLoss`` when it imports (the model must call it: that is the module swap
te avoids).

Columns: the median step time and its ratio to inductor's; the bytes one step saves for backward
(distinct storages, the weights excluded) and their ratio to inductor's; on CUDA the peak memory
allocated during a step above what was allocated before it. Goals (the issue's): saved bytes <= 1/8 of
unfused, peak <= 1/4 (CUDA), step time <= 1.05x unfused on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common  # noqa: E402
import te_compile  # noqa: E402
from te_compile.memory import saved_for_backward_bytes  # noqa: E402

SHAPES = {"cuda": (8192, 4096, 128256), "cpu": (1024, 256, 16032)}   # tokens, hidden, vocab


class Head(nn.Module):
    """Final norm, output layer, loss on fp32 logits (``liger``: Liger's fused loss instead); returns
    (None, loss), the demo GPT's (logits, loss) with no logits, for its saved-bytes measure."""

    def __init__(self, hidden: int, vocab: int, liger: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.liger = liger

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> tuple[None, torch.Tensor]:
        x = self.norm(h)
        if self.liger is not None:
            return None, self.liger(self.lm_head.weight, x, labels)
        return None, F.cross_entropy(self.lm_head(x).float(), labels)


def _liger() -> Optional[nn.Module]:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss()


def _providers() -> list[_common.Provider]:
    out = [_common.Provider("inductor", False, lambda m: torch.compile(m, dynamic=False), "torch.compile, unfused")]
    for recipe in ("none", "Float8CurrentScaling"):
        for fused in (True, False):
            backend = te_compile.backend(recipe=recipe, rewrite={"linear_cross_entropy": fused})
            out.append(_common.Provider(f"te {recipe} {'fused' if fused else 'unfused'}", recipe != "none",
                                        lambda m, b=backend: torch.compile(m, backend=b, dynamic=False),
                                        "" if fused else "linear_cross_entropy = false"))
    liger = _liger()
    out.append(_common.Provider("Liger fused linear CE", False,
                                (lambda m: _with_liger(m, liger)) if liger is not None else None,
                                "model calls LigerFusedLinearCrossEntropyLoss" if liger is not None
                                else "liger_kernel not installed"))
    return out


def _with_liger(model: Head, liger: nn.Module) -> Head:
    model.liger = liger
    return model


def _build_and_measure(base: Head, h: torch.Tensor, labels: torch.Tensor, row: dict,
                       device: torch.device) -> tuple[Callable, Callable[[], None]]:
    """(build, measure) for run_provider: the step (forward and backward of a copy of ``base`` on
    h [tokens, hidden] and labels [tokens]), then its CUDA peak and saved bytes, in MiB, into ``row``."""
    made = {}

    def build(prepare: Callable) -> Callable[[], None]:
        model = made["model"] = prepare(_common.fresh_copy(base))

        def step():
            model(h, labels)[1].backward()
        made["step"] = step
        return step

    def measure() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            made["step"]()
            torch.cuda.synchronize()
            row["peak"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        row["saved"] = saved_for_backward_bytes(made["model"], h, labels) / 2**20

    return build, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_common_args(parser)
    args = parser.parse_args()
    device = _common.resolve_device(args)
    if device.type == "cpu":
        args.iters = min(args.iters, 5)
    dtype = _common.baseline_dtype(device)
    tokens, hidden, vocab = SHAPES[device.type]
    print(f"bench_linear_ce: output layer + loss, forward + backward, {tokens} tokens x {hidden} -> {vocab}, "
          f"{_common.describe_machine(device)}; median of {args.iters} after {args.warmup} warm-up", flush=True)
    torch.manual_seed(0)
    base = Head(hidden, vocab).to(device=device, dtype=dtype)
    h = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    rows, baseline = [], None
    for provider in _providers():
        row = {"provider": provider.name, "ms": None, "saved": None, "peak": None, "note": provider.note}
        rows.append(row)
        build, measure = _build_and_measure(base, h, labels, row, device)
        _, median, row["note"] = _common.run_provider(provider, build, device, args, measure)
        if median is None:
            continue
        row["ms"] = median * 1e3
        if provider.name == "inductor":
            baseline = row
        print(f"  {provider.name:<32} {median * 1e3:9.2f} ms  saved {row['saved']:9.2f} MiB", flush=True)

    def ratio(row, key):
        return (f"{row[key] / baseline[key]:.3f}x" if row[key] is not None and baseline and baseline[key]
                else "n/a")
    table = [(r["provider"], "n/a" if r["ms"] is None else f"{r['ms']:.2f}", ratio(r, "ms"),
              "n/a" if r["saved"] is None else f"{r['saved']:.2f}", ratio(r, "saved"),
              "n/a" if r["peak"] is None else f"{r['peak']:.1f}", ratio(r, "peak"), r["note"]) for r in rows]
    print()
    print(tabulate(table, headers=["provider", "median ms", "time / inductor", "saved MiB", "saved vs inductor",
                                   "peak MiB (CUDA)", "peak vs inductor", "note"], disable_numparse=True))
    print("\ngoals: fused saved bytes <= 0.125x unfused; peak <= 0.25x (CUDA); step <= 1.05x unfused (GPU)")


if __name__ == "__main__":
    main()
