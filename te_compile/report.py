"""What the backend did to each site it saw: one row per site, rendered as a table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tabulate import tabulate

__all__ = ["SiteRecord", "Report", "report", "reset", "add_records", "next_graph_id"]

_SHOWN = 5  # sites left in high precision named per summary line


@dataclass(frozen=True)
class SiteRecord:
    fqn: str                  # module path as model.named_modules() names it, e.g. "blocks.0.mlp.fc"
    # "linear" | "layer_norm" | "rms_norm" | "gelu" | "relu" | "relu2" | "silu" | "swiglu" | "geglu" | "sdpa"
    op: str
    recipe: Optional[str]     # recipe class name, or None when the site stays in high precision
    rewritten: bool
    reason: str               # why not rewritten, or how it was lowered
    shapes: str               # e.g. "x[s0, 64] w[256, 64] b[256]"
    graph: int = 0            # which compiled graph (Dynamo may split a model into several)
    # the cross-rank amax reductions the site takes part in, e.g. "amax all-reduce over tp (2 ranks):
    # input, weight"; "" in one process
    collectives: str = ""
    # bytes of saved tensors this site moves to host memory per step, each way (offload rows; else 0)
    moved_bytes: int = 0


@dataclass
class Report:
    sites: list[SiteRecord] = field(default_factory=list)

    @property
    def rewritten(self) -> list[SiteRecord]:
        return [s for s in self.sites if s.rewritten]

    @property
    def skipped(self) -> list[SiteRecord]:
        return [s for s in self.sites if not s.rewritten]

    def __len__(self) -> int:
        return len(self.sites)

    def __str__(self) -> str:
        if not self.sites:
            return "te_compile: no sites seen (nothing compiled since te_compile.reset())"
        rows = [
            (s.graph, s.fqn or "<root>", s.op, s.recipe or "-", "yes" if s.rewritten else "no",
             s.shapes, s.reason)
            for s in self.sites
        ]
        headers = ["graph", "module", "op", "recipe", "rewritten", "shapes", "reason"]
        if any(s.collectives for s in self.sites):   # the column only where ranks talk
            rows = [(*row, s.collectives or "-") for row, s in zip(rows, self.sites)]
            headers.append("collectives")
        table = tabulate(rows, headers=headers)
        total = f"{len(self.rewritten)} of {len(self.sites)} sites rewritten"
        return "\n".join([table, *self.summary(), total])

    def summary(self) -> list[str]:
        """One line per graph and site kind: how many sites were rewritten, and which were not, why.

        e.g. "graph 0: rewritten 14 of 15 linear sites; 1 left in high precision: lm_head — recipe
        'none' (override 'lm_head')".
        """
        groups: dict[tuple[int, str], list[SiteRecord]] = {}
        for s in self.sites:
            groups.setdefault((s.graph, s.op), []).append(s)
        lines = []
        for (graph, op), sites in groups.items():
            kept = [s for s in sites if not s.rewritten]
            line = f"graph {graph}: rewritten {len(sites) - len(kept)} of {len(sites)} {op} sites"
            if kept:
                shown = ", ".join(f"{s.fqn or '<root>'} — {s.reason}" for s in kept[:_SHOWN])
                more = f", and {len(kept) - _SHOWN} more (see the table)" if len(kept) > _SHOWN else ""
                line += f"; {len(kept)} left in high precision: {shown}{more}"
            lines.append(line)
        return lines

    def op_counts(self) -> list[tuple[str, int, int, dict[str, int]]]:
        """(op, rewritten, total, {reason: sites}) per op, over all graphs, ops in the order they first
        appear; the reasons are those of the sites not rewritten, in the order they first appear.

        e.g. [("layer_norm", 9, 9, {}), ("linear", 17, 17, {}),
              ("sdpa", 0, 4, {"[rewrite] sdpa = false and Float8CurrentScaling.fp8_dpa = false": 4})]
        """
        counts: dict[str, tuple[int, int, dict[str, int]]] = {}
        for s in self.sites:
            rewritten, total, reasons = counts.get(s.op, (0, 0, {}))
            if not s.rewritten:
                reasons[s.reason] = reasons.get(s.reason, 0) + 1
            counts[s.op] = (rewritten + int(s.rewritten), total + 1, reasons)
        return [(op, rewritten, total, reasons) for op, (rewritten, total, reasons) in counts.items()]


_REPORT = Report()


def report() -> Report:
    """Every site seen by the te backend since the last ``reset()`` (a snapshot)."""
    return Report(list(_REPORT.sites))


def reset() -> None:
    """Forget the recorded sites."""
    _REPORT.sites.clear()


def add_records(records: list[SiteRecord]) -> None:
    """Append the rows of a compiled graph (the backend, once the graph compiled)."""
    _REPORT.sites.extend(records)


def next_graph_id() -> int:
    """The number the next compiled graph's rows carry: one past the highest recorded."""
    return 1 + max((s.graph for s in _REPORT.sites), default=-1)
