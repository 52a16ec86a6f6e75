"""``te-compile`` / ``python -m te_compile``: the demo, generation from its model, and the report dry run.

    te-compile demo [--config PATH | --recipe NAME] [--steps N] [--device cpu|cuda] [--plot out.png]
                    [--report] [--peer torchao]
    te-compile generate --checkpoint PATH --prompt TEXT [--tokens N] [--config PATH | --recipe NAME]
    te-compile report MODULE:FACTORY [--config PATH] [--recipe NAME] [--batch-size B] [--seq-len T]
    te-compile --version

``demo`` (cli/demo.py) trains the same GPT (te_compile.models) twice on the same batches of the
standard library's source bytes (te_compile.data): once compiled with ``backend="te"``, once with
inductor in high precision, and prints the two loss curves, throughput, saved-activation memory and
how many sites of each op the te run rewrote (the full site table with --report); ``--peer torchao``
adds a third run, the same model converted with torchao's float8 training (the peer a user would
pick instead). ``demo --save PATH`` keeps the te run's model (cli/checkpoint.py); ``generate``
(cli/generate.py) continues a prompt with it, compiled with the te backend for inference and in high
precision, and compares the two. ``report`` (cli/report.py) compiles any model factory with the te
backend (aot_eager: no codegen) and prints which sites were rewritten and why the others were not.
Usage errors exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch

from . import demo, generate, report
from .common import UsageError

__all__ = ["main"]

_PROG = "te-compile"


def _parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog=_PROG, description="te_compile: TransformerEngine-style FP8 training through torch.compile.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{demo,generate,report}")
    for command in (demo.COMMAND, generate.COMMAND, report.COMMAND):
        command.add_to(sub)
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
