"""``te-compile`` / ``python -m te_compile``: the demo and the report dry run.

    te-compile demo [--config PATH | --recipe NAME] [--steps N] [--device cpu|cuda] [--plot out.png]
                    [--report] [--peer torchao]
    te-compile generate --checkpoint PATH --prompt TEXT [--tokens N] [--config PATH | --recipe NAME]
    te-compile report MODULE:FACTORY [--config PATH] [--recipe NAME] [--batch-size B] [--seq-len T]
    te-compile --version

``demo`` trains the same GPT (te_compile.models) twice on the same batches of the standard library's
source bytes (te_compile.data): once compiled with ``backend="te"``, once with inductor in high
precision, and prints the two loss curves, throughput, saved-activation memory and how many sites of
each op the te run rewrote (the full site table with --report); ``--peer torchao`` adds a third run,
the same model converted with torchao's float8 training (the peer a user would pick instead).
``demo --save PATH`` keeps the te run's model; ``generate`` continues a prompt with it, compiled with
the te backend for inference and in high precision, and compares the two.
``report`` compiles any model factory with the te backend (aot_eager: no codegen) and prints which
sites were rewritten and why the others were not. Usage errors exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from tabulate import tabulate
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

if TYPE_CHECKING:
    from .report import Report

__all__ = ["main"]

_PROG = "te-compile"
_DEFAULT_RECIPE = "Float8CurrentScaling"
_PLOT_HINT = 'pip install "te_compile[plot]"'
_BENCH_HINT = 'pip install "te_compile[bench]"'
_PEERS = ("torchao",)
_REASONS_SHOWN = 3    # distinct reasons named per op in the demo's site counts; all of them: --report
_REASON_WIDTH = 100   # characters of one reason shown there


class UsageError(Exception):
    """A mistake in the command line or its inputs: printed without a traceback, exit status 2."""


# ---------------------------------------------------------------------------------------------
# Shared helpers


def _te_backend(config_path: Optional[str], recipe: Optional[str], compiler: Optional[str],
                default_recipe: Optional[str]) -> Callable:
    """``te_compile.backend`` for the command line's --config / --recipe (the recipe is layered over
    the file). With neither, ``default_recipe`` is used, or (None) the usual config resolution
    (TE_COMPILE_CONFIG, ./te_compile.toml, [tool.te_compile] in ./pyproject.toml, defaults)."""
    from . import backend
    from .config import ConfigError, resolve_config

    options = {}
    if recipe is not None or (config_path is None and default_recipe is not None):
        options["recipe"] = recipe if recipe is not None else default_recipe
    try:
        if config_path is None and not options:
            config = resolve_config()
            if compiler is not None:
                config = dataclasses.replace(config, compiler=compiler)
            return backend(config)
        if compiler is not None:
            options["compiler"] = compiler
        return backend(config=config_path, **options)
    except ConfigError as e:
        raise UsageError(f"bad config: {e}") from None


def _recipe_label(te: Callable) -> str:
    config = te.config
    name = config.recipe.name if config.recipe is not None else "none (high precision)"
    return f"{name} (config: {config.source})"


def _first_tensor(out: Any) -> Optional[torch.Tensor]:
    """The tensor to backpropagate from a model's output: a tensor, ``.loss`` / ``.logits`` of an HF
    output, or the first floating tensor of a tuple/list/dict."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    for name in ("loss", "logits"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for value in values:
        t = _first_tensor(value)
        if t is not None:
            return t
    return None


def _call(model: torch.nn.Module, example: Any) -> Any:
    if isinstance(example, dict):
        return model(**example)
    if isinstance(example, (tuple, list)):
        return model(*example)
    return model(example)


# ---------------------------------------------------------------------------------------------
# demo


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


def _storages(t: torch.Tensor) -> list[tuple[int, int]]:
    """(data pointer, bytes) of each storage behind ``t``: a wrapper subclass's (te's FP8 weights,
    torchao's) are its inner tensors'; its own storage is a placeholder with no data pointer."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [key for name in names for key in _storages(getattr(t, name))]
    try:
        storage = t.untyped_storage()
        return [(storage.data_ptr(), storage.nbytes())]
    except (RuntimeError, NotImplementedError):   # an opaque subclass: counted once, by identity
        return [(id(t), t.numel() * t.element_size())]


def _saved_for_backward_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the distinct storages one training step saves for backward, excluding what lives
    across steps anyway: parameters, buffers and delayed scaling's state (its amax histories are
    inputs of the backward's update).

    Compiled graphs save their tensors through the ordinary autograd mechanism (the compiled
    autograd.Function's ctx), so ``saved_tensors_hooks`` sees exactly what the compiled forward
    keeps alive for the backward: FP8 copies for the te run, high-precision activations otherwise.
    """
    from .state import state_tensors

    persistent = [*model.parameters(), *model.buffers(), *state_tensors(model)]
    params = {key for t in persistent for key, _ in _storages(t)}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        for key, nbytes in _storages(t):
            if key not in params:
                storages[key] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def _warmup_steps(steps: int) -> int:
    # a short linear warmup: without it the first large updates make the loss spike on some batches
    return max(1, min(10, steps // 6))


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


def _fmt(value: Optional[float], spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _site_counts(rep: Report) -> list[str]:
    """The demo's few lines on the te run's sites in place of the table (one row per site): a count per
    op, then, for each op with sites left in high precision, their distinct reasons. e.g.

        te run: 30 of 34 sites rewritten (layer_norm 9/9, linear 17/17, sdpa 0/4, gelu 4/4)
          sdpa, 4 sites not rewritten: [rewrite] sdpa = false and Float8CurrentScaling.fp8_dpa = false
    """
    counts = rep.op_counts()
    if not counts:
        return [str(rep)]
    per_op = ", ".join(f"{op} {rewritten}/{total}" for op, rewritten, total, _ in counts)
    lines = [f"te run: {len(rep.rewritten)} of {len(rep)} sites rewritten ({per_op})"]
    for op, rewritten, total, reasons in counts:
        if not reasons:
            continue
        kept = total - rewritten
        # site-specific reasons (they name a module) can be many and long: the table has them all
        shown = [reason if len(reason) <= _REASON_WIDTH else reason[:_REASON_WIDTH - 3] + "..."
                 for reason in list(reasons)[:_REASONS_SHOWN]]
        if len(reasons) > 1:   # which reason covers how many sites
            shown = [f"{n} x {reason}" for n, reason in zip(reasons.values(), shown)]
        more = len(reasons) - _REASONS_SHOWN
        if more > 0:
            shown.append(f"{more} more reason{'s' if more != 1 else ''} (see --report)")
        lines.append(f"  {op}, {kept} site{'s' if kept != 1 else ''} not rewritten: {'; '.join(shown)}")
    return lines


def _torchao_float8(model: torch.nn.Module, emulate: bool, recipe: str = "tensorwise") -> torch.nn.Module:
    """``model`` with its linears converted by torchao's float8 training, in place: the module swap a
    torchao user writes. ``recipe`` is torchao's recipe name (tensorwise, its default, or rowwise);
    ``emulate`` runs its FP8 GEMMs as fp32 matmuls (a CPU has no FP8 GEMM). Linears whose dims are
    not multiples of 16 stay as they are, as torchao requires (te leaves the same ones in high
    precision). The demo's peer run, and every torchao row of the benchmarks."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def eligible(module: torch.nn.Module, fqn: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0
                and module.out_features % 16 == 0)

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    return convert_to_float8_training(model, config=config, module_filter_fn=eligible)


def _demo(args: argparse.Namespace) -> int:
    from . import report as te_report, reset
    from .data import VOCAB_SIZE, get_batch
    from .models import GPT, gpt_moe, gpt_small, gpt_tiny

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
    # bf16 matmuls are extremely slow on CPUs without AMX; both runs use the same dtype
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype_name = str(dtype).replace("torch.", "")
    te = _te_backend(args.config, args.recipe, args.compiler, default_recipe=_DEFAULT_RECIPE)
    hp_backend = "inductor" if args.compiler in (None, "inductor") else args.compiler

    factory = {"small": gpt_small, "tiny": gpt_tiny, "moe": gpt_moe}[args.model]
    probe = factory()
    block_size = probe.block_size
    gen = torch.Generator().manual_seed(args.seed)
    batches = [get_batch("train", args.batch_size, block_size, gen, device=device)
               for _ in range(args.steps)]
    tokens_per_step = args.batch_size * block_size
    n_params = sum(p.numel() for p in probe.parameters())
    n_layer, n_embd = len(probe.blocks), probe.tok_emb.embedding_dim
    out = sys.stdout
    layers = f"{n_layer} layer{'s' if n_layer != 1 else ''}"
    moe = hasattr(probe.blocks[0], "moe")
    experts = (f", MoE: {probe.blocks[0].moe.router.out_features} experts, top-{probe.blocks[0].moe.top_k}, "
               f"a shared expert" if moe else "")
    print(f"te-compile demo: GPT ({layers}, width {n_embd}{experts}, {n_params / 1e6:.2f}M params, "
          f"vocab {VOCAB_SIZE}) on the Python standard library's source bytes", file=out)
    print(f"  {args.steps} steps of AdamW (lr {args.lr:g}, {_warmup_steps(args.steps)} warmup steps), "
          f"batch {args.batch_size} x {block_size} tokens, {device.type} {dtype_name}, seed {args.seed}",
          file=out)
    te_label = f"te {te.config.recipe.name if te.config.recipe is not None else 'none'}"
    hp_label = f"high precision ({hp_backend})"
    peer_label = "torchao float8"
    print(f"  te run: torch.compile(backend=te), recipe {_recipe_label(te)}", file=out)
    print(f"  hp run: torch.compile(backend={hp_backend!r}), {dtype_name}", file=out)
    if args.peer == "torchao":
        emulated = ", FP8 GEMMs emulated (no FP8 GEMM on a CPU)" if device.type != "cuda" else ""
        print(f"  peer run: torchao.float8.convert_to_float8_training (tensorwise){emulated}, "
              f"torch.compile(backend={hp_backend!r})", file=out)
    print(file=out, flush=True)

    # (label, backend, model transform): te, high precision, and the peer when asked for
    plan = [(te_label, te, None), (hp_label, hp_backend, None)]
    if args.peer == "torchao":
        plan.append((peer_label, hp_backend, lambda model, device: _torchao_float8(model, device.type != "cuda")))
    reset()
    runs = []
    width = max(len(label) for label, _, _ in plan)
    for label, backend_fn, transform in plan:
        torch.manual_seed(args.seed)  # identical initial weights for every run
        model: GPT = factory().to(device=device, dtype=dtype)
        if transform is not None:
            model = transform(model, device)
        compiled = torch.compile(model, backend=backend_fn)
        if backend_fn is te:
            te_model = model
        result = _train(label.ljust(width), compiled, model.parameters(), batches, args.lr,
                        tokens_per_step, device, out)
        result.label = label
        result.saved_bytes = _saved_for_backward_bytes(compiled, *batches[0])
        runs.append(result)
    te_run, hp_run, others = runs[0], runs[1], runs[2:]
    labels = [run.label for run in runs]
    # each low-precision run against high precision: te, then the peer
    against_hp = [(te_run, "te")] + [(run, "torchao") for run in others]

    # Loss curves, side by side: about ten rows plus the first and last step
    every = max(1, args.steps // 10)
    rows = [(s, *(f"{run.losses[s - 1]:.4f}" for run in runs),
             *(f"{run.losses[s - 1] - hp_run.losses[s - 1]:+.4f}" for run, _ in against_hp))
            for s in range(1, args.steps + 1) if s == 1 or s % every == 0 or s == args.steps]
    print(f"\nTraining loss (every {every} steps)", file=out)
    print(tabulate(rows, headers=["step", *labels, *(f"{name} - hp" for _, name in against_hp)],
                   disable_numparse=True), file=out)

    n_final = min(5, args.steps)
    hp_final = hp_run.final_loss()
    gaps = [100.0 * (run.final_loss() - hp_final) / hp_final for run, _ in against_hp]
    tps = [run.tokens_per_s(tokens_per_step) for run in runs]
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
    print(tabulate(summary, headers=["", *labels, *(f"{name} vs hp" for _, name in against_hp)],
                   disable_numparse=True), file=out)
    print(file=out)
    for (_, name), gap in zip(against_hp, gaps):
        print(f"final-loss gap ({name} vs high precision): {gap:+.2f}%", file=out)
    print("saved-for-backward memory: distinct storages that the compiled forward hands to autograd "
          "for the backward (torch.autograd.graph.saved_tensors_hooks), parameters excluded", file=out)
    if device.type == "cpu":
        print("throughput on CPU: FP8 GEMMs are fp32 matmuls of the FP8 values here (a CPU has no FP8 "
              "GEMM), plus the quantization work, so te is expected to be slower than high precision; "
              "the speedup needs an FP8 GPU", file=out)

    rep = te_report()
    print(file=out)
    print("\n".join(_site_counts(rep)), file=out)
    if args.report:
        print("\nte_compile.report() (sites of the te run)", file=out)
        print(rep, file=out)
    else:
        print("full site table (shapes, reasons): te-compile demo --report", file=out)

    if args.plot:
        title = f"GPT {n_layer}x{n_embd}, batch {args.batch_size}x{block_size}, {device.type}"
        _plot(args.plot, runs, title)
        print(f"\nwrote the loss curves to {args.plot}", file=out)
    if args.save:
        _save_checkpoint(args.save, te_model, args.model, te.config)
        print(f"\nsaved the te run's model and recipe state to {args.save} "
              f"(te-compile generate --checkpoint {args.save} --prompt TEXT)", file=out)
    out.flush()
    return 0


# ---------------------------------------------------------------------------------------------
# generate

# what `demo --save` writes: plain tensors, strings and ints only, so that `generate` reads it with
# torch.load(weights_only=True)
_CHECKPOINT_FORMAT = "te_compile.demo/1"
_FACTORIES = ("small", "moe", "tiny")


def _save_checkpoint(path: str, model: torch.nn.Module, name: str, config) -> None:
    from .state import recipe_state_dict

    state = {k: v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()
             for k, v in model.state_dict().items()}
    torch.save({"format": _CHECKPOINT_FORMAT, "model": name, "state_dict": state,
                "recipe_state": {k: v.cpu() for k, v in recipe_state_dict(model).items()},
                "recipe": config.recipe.name if config.recipe is not None else "none"}, path)


def _load_checkpoint(path: str) -> dict:
    if not os.path.isfile(path):
        raise UsageError(f"--checkpoint {path}: no such file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # a pickle with objects weights_only refuses, or not a torch file at all
        raise UsageError(f"--checkpoint {path}: not a checkpoint that te-compile demo --save wrote "
                         f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != _CHECKPOINT_FORMAT:
        raise UsageError(f"--checkpoint {path}: not a checkpoint that te-compile demo --save wrote "
                         f"(expected format {_CHECKPOINT_FORMAT!r})")
    if checkpoint.get("model") not in _FACTORIES:
        raise UsageError(f"--checkpoint {path}: model {checkpoint.get('model')!r} is not one of {list(_FACTORIES)}")
    return checkpoint


def _greedy(model, ids: torch.Tensor, tokens: int, block: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``tokens`` greedy steps of the GPT (no KV cache: each step reads the last ``block`` tokens);
    (the ids with the new tokens, each step's last-position logits [1, V])."""
    steps = []
    for _ in range(tokens):
        logits, _ = model(ids[:, -block:])
        steps.append(logits[:, -1].float())
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids, steps


def _text(ids: torch.Tensor) -> str:
    return repr(bytes(ids.tolist()).decode("utf-8", errors="replace"))


def _generate(args: argparse.Namespace) -> int:
    from . import report as te_report, reset
    from .models import gpt_moe, gpt_small, gpt_tiny
    from .state import load_recipe_state_dict

    if args.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {args.tokens}")
    if args.config is not None and not os.path.isfile(args.config):
        raise UsageError(f"--config {args.config}: no such file")
    prompt = args.prompt.encode("utf-8")
    if not prompt:
        raise UsageError("--prompt must not be empty")
    checkpoint = _load_checkpoint(args.checkpoint)
    model = {"small": gpt_small, "tiny": gpt_tiny, "moe": gpt_moe}[checkpoint["model"]]()
    try:
        model.load_state_dict(checkpoint["state_dict"])
        load_recipe_state_dict(model, checkpoint.get("recipe_state", {}))
    except (RuntimeError, ValueError, KeyError) as e:
        raise UsageError(f"--checkpoint {args.checkpoint}: {str(e).splitlines()[0]}") from None
    model.eval()
    te = _te_backend(args.config, args.recipe, args.compiler, default_recipe=checkpoint["recipe"])
    ids = torch.tensor([list(prompt)], dtype=torch.int64)
    out = sys.stdout
    print(f"te-compile generate: {checkpoint['model']} GPT from {args.checkpoint}, {args.tokens} greedy tokens, "
          f"te recipe {_recipe_label(te)} against high precision (eager), cpu float32", file=out)
    reset()
    with torch.no_grad():
        start = time.perf_counter()
        fp8_ids, fp8_steps = _greedy(torch.compile(model, backend=te), ids, args.tokens, model.block_size)
        fp8_s = time.perf_counter() - start
        hp_ids, _ = _greedy(model, ids, args.tokens, model.block_size)
        # high precision on the FP8 run's own tokens, so that the two logits compare step by step
        hp_steps = [model(fp8_ids[:, :ids.shape[1] + i][:, -model.block_size:])[0][:, -1].float()
                    for i in range(args.tokens)]
    new = slice(ids.shape[1], None)
    diff = (fp8_ids[0, new] != hp_ids[0, new]).nonzero()
    agree = "all tokens equal" if not len(diff) else f"first difference at new token {int(diff[0]) + 1}"
    noise = torch.stack(hp_steps) - torch.stack(fp8_steps)
    sqnr = 20 * math.log10(torch.linalg.vector_norm(torch.stack(hp_steps)) / max(
        torch.linalg.vector_norm(noise).item(), 1e-30))
    rows = [("prompt", _text(ids[0])), ("te (FP8)", _text(fp8_ids[0, new])),
            ("high precision", _text(hp_ids[0, new]))]
    print(tabulate(rows, tablefmt="plain", disable_numparse=True), file=out)
    print(f"\n{agree}; logits SQNR of te against high precision on te's tokens: {sqnr:.1f} dB; "
          f"te: {fp8_s:.1f} s including compilation", file=out)
    print("\n".join(_site_counts(te_report())), file=out)
    return 0


# ---------------------------------------------------------------------------------------------
# report


def _load_factory(spec: str) -> tuple[Callable, Any]:
    """(factory, its module) for ``MODULE:FACTORY``; the current directory is importable."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise UsageError(f"expected MODULE:FACTORY (e.g. te_compile.models:gpt_small), got {spec!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise UsageError(f"cannot import module {module_name!r} (from {spec!r}): "
                         f"{type(e).__name__}: {e}") from None
    obj = module
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise UsageError(f"module {module_name!r} has no attribute {attr_path!r} (from {spec!r})")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise UsageError(f"{spec!r} is not callable (got {type(obj).__name__})")
    return obj, module


def _vocab_size(model: torch.nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    for owner in (config, model):
        value = getattr(owner, "vocab_size", None) if owner is not None else None
        if isinstance(value, int) and value > 0:
            return value
    emb = getattr(model, "tok_emb", None)
    return emb.num_embeddings if isinstance(emb, torch.nn.Embedding) else None


def _max_positions(model: torch.nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    for owner, name in ((model, "block_size"), (config, "max_position_embeddings"),
                        (config, "n_positions")):
        value = getattr(owner, name, None) if owner is not None else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def _sample_input(model: torch.nn.Module, module, explicit: Any, batch_size: int,
                  seq_len: Optional[int]) -> tuple[Any, str]:
    """(input, description): the factory's own example, the module's ``example_input()``, or
    token ids [B, T] for a language model (``config.vocab_size``, ``vocab_size`` or ``tok_emb``)."""
    if explicit is not None:
        return explicit, "the factory's example input"
    if callable(getattr(module, "example_input", None)):
        return module.example_input(), f"{module.__name__}.example_input()"
    vocab = _vocab_size(model)
    if vocab is None:
        raise UsageError(
            f"cannot make a sample input for {type(model).__name__}: it has no vocab_size (or "
            f"config.vocab_size / tok_emb); define example_input() in its module or return "
            f"(model, example_input) from the factory")
    limit = _max_positions(model)
    t = seq_len if seq_len is not None else min(64, limit or 64)
    if limit is not None and t > limit:
        raise UsageError(f"--seq-len {t} exceeds the model's maximum of {limit} positions")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = torch.randint(0, vocab, (batch_size, t), generator=torch.Generator().manual_seed(0))
    return ids.to(device), f"token ids int64[{batch_size}, {t}] (vocab {vocab})"


def _count_linear_modules(model: torch.nn.Module) -> int:
    # nn.Linear, and HF's Conv1D (GPT-2), whose weight is stored [in, out]
    return sum(isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D" for m in model.modules())


def _report(args: argparse.Namespace) -> int:
    from . import report as te_report, reset

    if args.batch_size < 1 or (args.seq_len is not None and args.seq_len < 1):
        raise UsageError(f"--batch-size and --seq-len must be >= 1, got {args.batch_size} and {args.seq_len}")
    if args.config is not None and not os.path.isfile(args.config):
        raise UsageError(f"--config {args.config}: no such file")
    factory, module = _load_factory(args.factory)
    te = _te_backend(args.config, args.recipe, "aot_eager", default_recipe=None)
    try:
        built = factory()
    except Exception as e:
        raise UsageError(f"{args.factory}() failed: {type(e).__name__}: {e}") from None
    explicit = None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module):
        built, explicit = built
    if not isinstance(built, torch.nn.Module):
        raise UsageError(f"{args.factory}() must return an nn.Module or (nn.Module, example_input), "
                         f"got {type(built).__name__}")
    model = built
    example, described = _sample_input(model, module, explicit, args.batch_size, args.seq_len)

    print(f"te-compile report {args.factory}: {type(model).__name__}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"{_count_linear_modules(model)} linear modules", flush=True)
    print(f"  input: {described}")
    print(f"  recipe: {_recipe_label(te)}; dry run with compiler aot_eager (no inductor codegen)")
    reset()
    compiled = torch.compile(model, backend=te)
    out = _call(compiled, example)
    target = _first_tensor(out)
    if target is not None and target.requires_grad:
        target.float().square().mean().backward()  # runs the compiled backward too
    rep = te_report()
    print()
    print(rep)
    graphs = len({s.graph for s in rep.sites})
    if graphs > 1:
        print(f"note: Dynamo split the model into {graphs} graphs (graph breaks)")
    return 0


# ---------------------------------------------------------------------------------------------
# entry point


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=_PROG, description="te_compile: TransformerEngine-style FP8 training through torch.compile.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{demo,generate,report}")

    demo = sub.add_parser(
        "demo", help="train a small GPT in FP8 (te) and in high precision side by side",
        description="Train the same GPT twice on identical batches of Python standard library "
                    "source bytes: compiled with backend='te' and with inductor in high precision.")
    demo.add_argument("--config", metavar="PATH", help="te_compile TOML config (see examples/)")
    demo.add_argument("--recipe", metavar="NAME",
                      help=f"recipe class name, layered over --config (default: {_DEFAULT_RECIPE})")
    demo.add_argument("--steps", type=int, default=60, help="training steps per run (default: 60)")
    demo.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    demo.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    demo.add_argument("--seed", type=int, default=0, help="seed of weights and batches (default: 0)")
    demo.add_argument("--device", choices=("cpu", "cuda"),
                      help="default: cuda when available (bf16), else cpu (fp32)")
    demo.add_argument("--plot", metavar="OUT.png",
                      help=f"write the loss curves (needs matplotlib: {_PLOT_HINT})")
    demo.add_argument("--report", action="store_true",
                      help="also print the te run's full site table (te_compile.report(): one row per "
                           "site with its shapes and why it was or was not rewritten)")
    demo.add_argument("--peer", choices=_PEERS,
                      help="add a third run with a peer's FP8 training on the same model and batches: "
                           f"torchao float8 (tensorwise; needs {_BENCH_HINT})")
    demo.add_argument("--save", metavar="PATH",
                      help="save the te run's trained model and recipe state for te-compile generate")
    demo.add_argument("--model", choices=_FACTORIES, default="small",
                      help="small: 4 blocks of width 128 (default); moe: the same with a mixture of 8 "
                           "experts (top-2, a shared expert) in every block; tiny: one block, for quick checks")
    # for tests and quick checks: aot_eager (no inductor codegen) for both runs
    demo.add_argument("--compiler", choices=("inductor", "aot_eager"), help=argparse.SUPPRESS)
    demo.set_defaults(handler=_demo)

    generate = sub.add_parser(
        "generate", help="generate text with a model te-compile demo --save wrote, in FP8 and in high precision",
        description="Load a checkpoint written by te-compile demo --save (read with torch.load(weights_only="
                    "True)), then continue PROMPT greedily twice: the model compiled with backend='te' under "
                    "no_grad (an inference graph: weights quantized once) and the model in high precision.")
    generate.add_argument("--checkpoint", metavar="PATH", required=True, help="file from te-compile demo --save")
    generate.add_argument("--prompt", required=True, help="text to continue (UTF-8 bytes are the tokens)")
    generate.add_argument("--tokens", type=int, default=32, help="new tokens (default: 32)")
    generate.add_argument("--config", metavar="PATH", help="te_compile TOML config ([inference] keys apply)")
    generate.add_argument("--recipe", metavar="NAME",
                          help="recipe class name, layered over --config (default: the checkpoint's)")
    generate.add_argument("--compiler", choices=("inductor", "aot_eager"), help=argparse.SUPPRESS)
    generate.set_defaults(handler=_generate)

    report = sub.add_parser(
        "report", help="compile a model factory with the te backend and print the site table",
        description="Dry run: build MODULE:FACTORY (the current directory is importable), compile it "
                    "with the te backend (aot_eager), run one forward and backward on a sample input "
                    "and print which sites were rewritten and why the others were not.")
    report.add_argument("factory", metavar="MODULE:FACTORY",
                        help="e.g. te_compile.models:gpt_small or examples.hf_models:tiny_llama; the "
                             "factory returns a model or (model, example_input)")
    report.add_argument("--config", metavar="PATH", help="te_compile TOML config")
    report.add_argument("--recipe", metavar="NAME", help="recipe class name, layered over --config")
    report.add_argument("--batch-size", type=int, default=2, help="sample batch size (default: 2)")
    report.add_argument("--seq-len", type=int,
                        help="sample sequence length (default: 64, capped at the model's maximum)")
    report.set_defaults(handler=_report)
    parser.set_defaults(handler=None, version_string=f"{_PROG} {__version__} (torch {torch.__version__})")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 usage error)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.version:
        print(args.version_string)
        return 0
    if args.handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args)
    except UsageError as e:
        sys.stdout.flush()
        print(f"{_PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
