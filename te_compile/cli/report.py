"""``te-compile report MODULE:FACTORY``: a dry run of the te backend on any model. The factory's
model is compiled with aot_eager (no inductor codegen), run forward and backward once on a sample
input, and the site table says which sites were rewritten and why the others were not."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Callable, Optional

import torch

from .common import Command, UsageError, recipe_label, te_backend

__all__ = ["COMMAND", "run"]


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


def _build(args: argparse.Namespace, factory: Callable) -> tuple[torch.nn.Module, Any]:
    """(the factory's model, its own example input or None)."""
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
    return built, explicit


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


def run(args: argparse.Namespace) -> int:
    """The ``report`` command."""
    from .. import report as te_report, reset

    if args.batch_size < 1 or (args.seq_len is not None and args.seq_len < 1):
        raise UsageError(f"--batch-size and --seq-len must be >= 1, got {args.batch_size} and {args.seq_len}")
    if args.config is not None and not os.path.isfile(args.config):
        raise UsageError(f"--config {args.config}: no such file")
    factory, module = _load_factory(args.factory)
    te = te_backend(args.config, args.recipe, "aot_eager", default_recipe=None)
    model, explicit = _build(args, factory)
    example, described = _sample_input(model, module, explicit, args.batch_size, args.seq_len)

    print(f"te-compile report {args.factory}: {type(model).__name__}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"{_count_linear_modules(model)} linear modules", flush=True)
    print(f"  input: {described}")
    print(f"  recipe: {recipe_label(te)}; dry run with compiler aot_eager (no inductor codegen)")
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


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", metavar="MODULE:FACTORY",
                        help="e.g. te_compile.models:gpt_small or examples.hf_models:tiny_llama; the "
                             "factory returns a model or (model, example_input)")
    parser.add_argument("--config", metavar="PATH", help="te_compile TOML config")
    parser.add_argument("--recipe", metavar="NAME", help="recipe class name, layered over --config")
    parser.add_argument("--batch-size", type=int, default=2, help="sample batch size (default: 2)")
    parser.add_argument("--seq-len", type=int,
                        help="sample sequence length (default: 64, capped at the model's maximum)")


COMMAND = Command("report", _add_arguments, run,
                  help="compile a model factory with the te backend and print the site table",
                  description="Dry run: build MODULE:FACTORY (the current directory is importable), compile it "
                              "with the te backend (aot_eager), run one forward and backward on a sample input "
                              "and print which sites were rewritten and why the others were not.")
