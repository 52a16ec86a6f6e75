"""What the commands share: how a command joins the entry point, the usage error, the te backend
their --config / --recipe describe, and the short summary of the te run's sites that the demo and
generate print."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from ..report import Report

__all__ = ["Command", "UsageError", "te_backend", "recipe_label", "site_counts"]

_REASONS_SHOWN = 3    # distinct reasons named per op in the site counts; all of them: --report
_REASON_WIDTH = 100   # characters of one reason shown there


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand as its module describes it; the entry point adds each to its subparsers."""

    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]   # the command's own options
    run: Callable[[argparse.Namespace], int]                   # the handler: the exit status
    help: str           # its line in ``te-compile --help``
    description: str    # the head of ``te-compile NAME --help``

    def add_to(self, subparsers) -> None:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.description)
        self.add_arguments(parser)
        parser.set_defaults(handler=self.run)


class UsageError(Exception):
    """A mistake in the command line or its inputs: printed without a traceback, exit status 2."""


def te_backend(config_path: Optional[str], recipe: Optional[str], compiler: Optional[str],
               default_recipe: Optional[str]) -> Callable:
    """``te_compile.backend`` for the command line's --config / --recipe (the recipe is layered over
    the file). With neither, ``default_recipe`` is used, or (None) the usual config resolution
    (TE_COMPILE_CONFIG, ./te_compile.toml, [tool.te_compile] in ./pyproject.toml, defaults)."""
    from .. import backend
    from ..config import ConfigError, resolve_config

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


def recipe_label(te: Callable) -> str:
    """The recipe a te backend compiles with and where its config came from, for a header line."""
    config = te.config
    name = config.recipe.name if config.recipe is not None else "none (high precision)"
    return f"{name} (config: {config.source})"


def site_counts(rep: Report) -> list[str]:
    """A few lines on the te run's sites in place of the table (one row per site): a count per op,
    then, for each op with sites left in high precision, their distinct reasons. e.g.

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
