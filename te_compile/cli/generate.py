"""``te-compile generate``: continue a prompt with the model ``demo --save`` wrote, greedily, twice:
compiled with the te backend under no_grad (an inference graph: weights quantized once) and in high
precision, then the two continuations and how far te's logits are from high precision's."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from tabulate import tabulate

from .checkpoint import load_checkpoint, model_factory
from .common import Command, UsageError, recipe_label, site_counts, te_backend

__all__ = ["COMMAND", "run"]


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


def _load_model(args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    """(the checkpoint's GPT in eval mode with its recipe state, the checkpoint)."""
    from ..state import load_recipe_state_dict

    checkpoint = load_checkpoint(args.checkpoint)
    model = model_factory(checkpoint["model"])()
    try:
        model.load_state_dict(checkpoint["state_dict"])
        load_recipe_state_dict(model, checkpoint.get("recipe_state", {}))
    except (RuntimeError, ValueError, KeyError) as e:
        raise UsageError(f"--checkpoint {args.checkpoint}: {str(e).splitlines()[0]}") from None
    model.eval()
    return model, checkpoint


def run(args: argparse.Namespace) -> int:
    """The ``generate`` command."""
    from .. import report as te_report, reset

    if args.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {args.tokens}")
    if args.config is not None and not os.path.isfile(args.config):
        raise UsageError(f"--config {args.config}: no such file")
    prompt = args.prompt.encode("utf-8")
    if not prompt:
        raise UsageError("--prompt must not be empty")
    model, checkpoint = _load_model(args)
    te = te_backend(args.config, args.recipe, args.compiler, default_recipe=checkpoint["recipe"])
    ids = torch.tensor([list(prompt)], dtype=torch.int64)   # [1, prompt bytes]
    out = sys.stdout
    print(f"te-compile generate: {checkpoint['model']} GPT from {args.checkpoint}, {args.tokens} greedy tokens, "
          f"te recipe {recipe_label(te)} against high precision (eager), cpu float32", file=out)
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
    print("\n".join(site_counts(te_report())), file=out)
    return 0


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", metavar="PATH", required=True, help="file from te-compile demo --save")
    parser.add_argument("--prompt", required=True, help="text to continue (UTF-8 bytes are the tokens)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens (default: 32)")
    parser.add_argument("--config", metavar="PATH", help="te_compile TOML config ([inference] keys apply)")
    parser.add_argument("--recipe", metavar="NAME",
                        help="recipe class name, layered over --config (default: the checkpoint's)")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), help=argparse.SUPPRESS)


COMMAND = Command("generate", _add_arguments, run,
                  help="generate text with a model te-compile demo --save wrote, in FP8 and in high precision",
                  description="Load a checkpoint written by te-compile demo --save (read with torch.load("
                              "weights_only=True)), then continue PROMPT greedily twice: the model compiled "
                              "with backend='te' under no_grad (an inference graph: weights quantized once) "
                              "and the model in high precision.")
