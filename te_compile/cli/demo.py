"""``te-compile demo``: the same GPT trained twice on the same batches, compiled with the te backend
and with inductor in high precision (and, with ``--peer torchao``, a third time under torchao's
float8 training), then their loss curves, throughput, saved-activation memory and the te run's site
counts side by side.

Every run starts from the same seed's weights, so the loss curves differ only by the numerics.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from tabulate import tabulate

from ..memory import saved_for_backward_bytes
from .checkpoint import MODELS, model_factory, save_checkpoint
from .common import Command, UsageError, recipe_label, site_counts, te_backend

__all__ = ["COMMAND", "run"]

_DEFAULT_RECIPE = "Float8CurrentScaling"
_PLOT_HINT = 'pip install "te_compile[plot]"'
_BENCH_HINT = 'pip install "te_compile[bench]"'
_PEERS = ("torchao",)


@dataclass
class _RunResult:
    label: str
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)   # seconds per step, step 1 = compile
    saved_bytes: Optional[int] = None                        # saved for backward, params excluded

    def final_loss(self) -> float:
        tail = self.losses[-5:]
        return sum(tail) / len(tail)

    def tokens_per_s(self, tokens_per_step: int) -> Optional[float]:
        steady = self.step_times[1:]
        return tokens_per_step * len(steady) / sum(steady) if steady else None


class _Progress:
    """One line per run, rewritten in place (``\\r``) on a terminal; on a pipe, a line every few steps."""

    def __init__(self, label: str, total: int, stream) -> None:
        self.label, self.total, self.stream = label, total, stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.every = max(1, total // 6)
        self.width = 0

    def _emit(self, text: str, final: bool = False) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(self.width))
            self.width = max(self.width, len(text))
            if final:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def compiling(self) -> None:
        self._emit(f"{self.label}  step    0/{self.total}  compiling (first step)...")

    def step(self, step: int, loss: float, tokens_per_s: Optional[float]) -> None:
        last = step == self.total
        if not self.tty and not (step == 1 or last or step % self.every == 0):
            return
        rate = f"{tokens_per_s:,.0f} tok/s" if tokens_per_s is not None else "(incl. compile)"
        self._emit(f"{self.label}  step {step:>4}/{self.total}  loss {loss:.4f}  {rate}", final=last)


@dataclass
class _Setup:
    """What every run shares: the device and dtype, the batches, and the backends."""
    device: torch.device
    dtype: torch.dtype
    te: Callable                                # the te backend
    hp_backend: str                             # high precision's (and the peer's) compiler
    batches: list[tuple[torch.Tensor, torch.Tensor]]   # (x, y) per step, each [batch, block_size]
    tokens_per_step: int

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")


def _warmup_steps(steps: int) -> int:
    # a short linear warmup: without it the first large updates make the loss spike on some batches
    return max(1, min(10, steps // 6))


def _check(args: argparse.Namespace) -> torch.device:
    """The device to run on, after every check that can fail before training starts."""
    if args.plot:
        try:
            import matplotlib.figure  # noqa: F401  (the plot extra)
        except ImportError:
            raise UsageError(f"--plot needs matplotlib, which is not installed: {_PLOT_HINT}") from None
    if args.peer == "torchao":
        try:
            import torchao.float8  # noqa: F401  (the bench extra)
        except ImportError:
            raise UsageError(f"--peer torchao needs torchao, which is not installed: {_BENCH_HINT}") from None
    if args.steps < 1 or args.batch_size < 1:
        raise UsageError(f"--steps and --batch-size must be >= 1, got {args.steps} and {args.batch_size}")
    if args.config is not None and not os.path.isfile(args.config):
        raise UsageError(f"--config {args.config}: no such file")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available (use --device cpu)")
    return device


def _print_header(args: argparse.Namespace, probe: torch.nn.Module, setup: _Setup, out) -> None:
    """What is trained, on what, and how each run compiles."""
    from ..data import VOCAB_SIZE

    n_params = sum(p.numel() for p in probe.parameters())
    n_layer, n_embd = len(probe.blocks), probe.tok_emb.embedding_dim
    layers = f"{n_layer} layer{'s' if n_layer != 1 else ''}"
    moe = hasattr(probe.blocks[0], "moe")
    experts = (f", MoE: {probe.blocks[0].moe.router.out_features} experts, top-{probe.blocks[0].moe.top_k}, "
               f"a shared expert" if moe else "")
    print(f"te-compile demo: GPT ({layers}, width {n_embd}{experts}, {n_params / 1e6:.2f}M params, "
          f"vocab {VOCAB_SIZE}) on the Python standard library's source bytes", file=out)
    print(f"  {args.steps} steps of AdamW (lr {args.lr:g}, {_warmup_steps(args.steps)} warmup steps), "
          f"batch {args.batch_size} x {probe.block_size} tokens, {setup.device.type} {setup.dtype_name}, "
          f"seed {args.seed}", file=out)
    print(f"  te run: torch.compile(backend=te), recipe {recipe_label(setup.te)}", file=out)
    print(f"  hp run: torch.compile(backend={setup.hp_backend!r}), {setup.dtype_name}", file=out)
    if args.peer == "torchao":
        emulated = ", FP8 GEMMs emulated (no FP8 GEMM on a CPU)" if setup.device.type != "cuda" else ""
        print(f"  peer run: torchao.float8.convert_to_float8_training (tensorwise){emulated}, "
              f"torch.compile(backend={setup.hp_backend!r})", file=out)
    print(file=out, flush=True)


def _train(label: str, compiled: torch.nn.Module, params, batches, lr: float, tokens_per_step: int,
           device: torch.device, stream) -> _RunResult:
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = _warmup_steps(len(batches))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    result = _RunResult(label)
    progress = _Progress(label, len(batches), stream)
    progress.compiling()
    for step, (x, y) in enumerate(batches, start=1):
        t0 = time.perf_counter()
        _, loss = compiled(x, y)
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the device
        if device.type == "cuda":
            torch.cuda.synchronize()
        result.step_times.append(time.perf_counter() - t0)
        if not math.isfinite(value):
            raise RuntimeError(f"{label}: loss is {value} at step {step}")
        result.losses.append(value)
        progress.step(step, value, result.tokens_per_s(tokens_per_step))
    return result


def _train_all(args: argparse.Namespace, setup: _Setup, out) -> tuple[list[_RunResult], torch.nn.Module]:
    """(te, high precision, then the peer when asked for: each run's result; the te run's model)."""
    from ..torchao_peer import torchao_float8

    te = setup.te
    # (label, backend, model transform)
    plan = [(f"te {te.config.recipe.name if te.config.recipe is not None else 'none'}", te, None),
            (f"high precision ({setup.hp_backend})", setup.hp_backend, None)]
    if args.peer == "torchao":
        plan.append(("torchao float8", setup.hp_backend,
                     lambda model, device: torchao_float8(model, device.type != "cuda")))
    runs = []
    width = max(len(label) for label, _, _ in plan)
    for label, backend_fn, transform in plan:
        torch.manual_seed(args.seed)  # identical initial weights for every run
        model = model_factory(args.model)().to(device=setup.device, dtype=setup.dtype)
        if transform is not None:
            model = transform(model, setup.device)
        compiled = torch.compile(model, backend=backend_fn)
        if backend_fn is te:
            te_model = model
        result = _train(label.ljust(width), compiled, model.parameters(), setup.batches, args.lr,
                        setup.tokens_per_step, setup.device, out)
        result.label = label
        result.saved_bytes = saved_for_backward_bytes(compiled, *setup.batches[0])
        runs.append(result)
    return runs, te_model


def _fmt(value: Optional[float], spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _print_losses(runs: list[_RunResult], against_hp, steps: int, out) -> None:
    """The loss curves, side by side: about ten rows plus the first and last step."""
    hp_run = runs[1]
    every = max(1, steps // 10)
    rows = [(s, *(f"{run.losses[s - 1]:.4f}" for run in runs),
             *(f"{run.losses[s - 1] - hp_run.losses[s - 1]:+.4f}" for run, _ in against_hp))
            for s in range(1, steps + 1) if s == 1 or s % every == 0 or s == steps]
    print(f"\nTraining loss (every {every} steps)", file=out)
    print(tabulate(rows, headers=["step", *(run.label for run in runs),
                                  *(f"{name} - hp" for _, name in against_hp)],
                   disable_numparse=True), file=out)


def _print_summary(runs: list[_RunResult], against_hp, steps: int, setup: _Setup, out) -> None:
    """Final loss, throughput, compile time and saved memory of each run, each low-precision run's
    against high precision's, and what the figures mean."""
    n_final = min(5, steps)
    hp_final = runs[1].final_loss()
    gaps = [100.0 * (run.final_loss() - hp_final) / hp_final for run, _ in against_hp]
    tps = [run.tokens_per_s(setup.tokens_per_step) for run in runs]
    mib = [run.saved_bytes / 2**20 if run.saved_bytes else None for run in runs]

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "n/a"

    def vs_hp(values):
        # a low-precision run's figure over high precision's, for te and the peer
        return [ratio(values[runs.index(run)], values[1]) for run, _ in against_hp]

    summary = [
        (f"final loss (mean of last {n_final} steps)", *(f"{run.final_loss():.4f}" for run in runs),
         *(f"{gap:+.2f}%" for gap in gaps)),
        ("tokens/s (steps 2.., compile excluded)", *(_fmt(v, ",.0f") for v in tps), *vs_hp(tps)),
        # no ratio: the runs share one process, so later ones find some compile work cached
        ("first step incl. compile (s)", *(f"{run.step_times[0]:.1f}" for run in runs), *("" for _ in against_hp)),
        ("saved for backward, one step (MiB)", *(_fmt(v, ".2f") for v in mib), *vs_hp(mib)),
    ]
    print("\nSummary", file=out)
    print(tabulate(summary, headers=["", *(run.label for run in runs),
                                     *(f"{name} vs hp" for _, name in against_hp)],
                   disable_numparse=True), file=out)
    print(file=out)
    for (_, name), gap in zip(against_hp, gaps):
        print(f"final-loss gap ({name} vs high precision): {gap:+.2f}%", file=out)
    print("saved-for-backward memory: distinct storages that the compiled forward hands to autograd "
          "for the backward (torch.autograd.graph.saved_tensors_hooks), parameters excluded", file=out)
    if setup.device.type == "cpu":
        print("throughput on CPU: FP8 GEMMs are fp32 matmuls of the FP8 values here (a CPU has no FP8 "
              "GEMM), plus the quantization work, so te is expected to be slower than high precision; "
              "the speedup needs an FP8 GPU", file=out)


def _print_sites(full_table: bool, out) -> None:
    """The te run's site counts, and its whole site table with --report."""
    from .. import report as te_report

    rep = te_report()
    print(file=out)
    print("\n".join(site_counts(rep)), file=out)
    if full_table:
        print("\nte_compile.report() (sites of the te run)", file=out)
        print(rep, file=out)
    else:
        print("full site table (shapes, reasons): te-compile demo --report", file=out)


def _plot(path: str, runs: list[_RunResult], title: str) -> None:
    """The loss curves of ``runs`` (te first, then high precision, then a peer) in one figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=120)
    ax = fig.subplots()
    steps = range(1, len(runs[0].losses) + 1)
    for run, style in zip(runs, ("--", "-", ":")):
        ax.plot(steps, run.losses, label=run.label, linewidth=1.5, linestyle=style)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def run(args: argparse.Namespace) -> int:
    """The ``demo`` command: train, print the comparison, then plot and save as asked."""
    from .. import reset
    from ..data import get_batch

    device = _check(args)
    # bf16 matmuls are extremely slow on CPUs without AMX; both runs use the same dtype
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    te = te_backend(args.config, args.recipe, args.compiler, default_recipe=_DEFAULT_RECIPE)
    probe = model_factory(args.model)()
    gen = torch.Generator().manual_seed(args.seed)
    batches = [get_batch("train", args.batch_size, probe.block_size, gen, device=device)
               for _ in range(args.steps)]
    setup = _Setup(device, dtype, te, "inductor" if args.compiler in (None, "inductor") else args.compiler,
                   batches, args.batch_size * probe.block_size)
    out = sys.stdout
    _print_header(args, probe, setup, out)
    reset()
    runs, te_model = _train_all(args, setup, out)
    # each low-precision run against high precision: te, then the peer
    against_hp = [(runs[0], "te")] + [(run, "torchao") for run in runs[2:]]
    _print_losses(runs, against_hp, args.steps, out)
    _print_summary(runs, against_hp, args.steps, setup, out)
    _print_sites(args.report, out)
    if args.plot:
        n_layer, n_embd = len(probe.blocks), probe.tok_emb.embedding_dim
        title = f"GPT {n_layer}x{n_embd}, batch {args.batch_size}x{probe.block_size}, {device.type}"
        _plot(args.plot, runs, title)
        print(f"\nwrote the loss curves to {args.plot}", file=out)
    if args.save:
        save_checkpoint(args.save, te_model, args.model, te.config)
        print(f"\nsaved the te run's model and recipe state to {args.save} "
              f"(te-compile generate --checkpoint {args.save} --prompt TEXT)", file=out)
    out.flush()
    return 0


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH", help="te_compile TOML config (see examples/)")
    parser.add_argument("--recipe", metavar="NAME",
                        help=f"recipe class name, layered over --config (default: {_DEFAULT_RECIPE})")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (default: 60)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and batches (default: 0)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="default: cuda when available (bf16), else cpu (fp32)")
    parser.add_argument("--plot", metavar="OUT.png",
                        help=f"write the loss curves (needs matplotlib: {_PLOT_HINT})")
    parser.add_argument("--report", action="store_true",
                        help="also print the te run's full site table (te_compile.report(): one row per "
                             "site with its shapes and why it was or was not rewritten)")
    parser.add_argument("--peer", choices=_PEERS,
                        help="add a third run with a peer's FP8 training on the same model and batches: "
                             f"torchao float8 (tensorwise; needs {_BENCH_HINT})")
    parser.add_argument("--save", metavar="PATH",
                        help="save the te run's trained model and recipe state for te-compile generate")
    parser.add_argument("--model", choices=MODELS, default="small",
                        help="small: 4 blocks of width 128 (default); moe: the same with a mixture of 8 "
                             "experts (top-2, a shared expert) in every block; tiny: one block, for quick checks")
    # for tests and quick checks: aot_eager (no inductor codegen) for both runs
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), help=argparse.SUPPRESS)


COMMAND = Command("demo", _add_arguments, run,
                  help="train a small GPT in FP8 (te) and in high precision side by side",
                  description="Train the same GPT twice on identical batches of Python standard library "
                              "source bytes: compiled with backend='te' and with inductor in high precision.")
