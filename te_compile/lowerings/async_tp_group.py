"""What column-parallel async-TP sites reading one input call together: ``AsyncTpColumnGroupLowering(specs)(x,
*weights, *biases) -> (y, ...)``.

Sites such as wq, wk, wv (or w1, w3) read the same sequence-sharded activation. Apart, each would
all-gather it; together (linear_paths/async_tp.py's column form with several weights) they gather it once
in FP8 and inductor's micro-pipeline pass fuses that one gather with all their GEMMs. The specs are
those each site would have had alone (same recipe and form; the pass groups only such sites).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..autocast import autocast_dtype
from ..fx.cache_names import name_lowering
from .linear import LinearSpec
from .linear_paths.async_tp import async_tp_column

__all__ = ["AsyncTpColumnGroupLowering"]


class AsyncTpColumnGroupLowering:
    """Callable inserted into the FX graph in place of several linear sites. x: a DTensor [..., K]
    sequence-sharded on the TP dim; weights: DTensors [N_i, K] Shard(0) there; biases: added to each
    product, or None. Returns one DTensor [..., N_i] per site, Shard(-1). Under autocast the operands
    are cast to autocast's dtype first, as each linear would cast them."""

    def __init__(self, specs: tuple[LinearSpec, ...]) -> None:
        self.specs = specs
        name_lowering(self, f"te_async_tp_column_group_{specs[0].recipe.name}", __name__)

    def __call__(self, x: torch.Tensor, *operands: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        n = len(self.specs)
        weights, biases = list(operands[:n]), list(operands[n:])
        dtype = autocast_dtype(x)
        if dtype is None:
            return self._run(x, weights, biases)
        x, weights = x.to(dtype), [w.to(dtype) for w in weights]
        biases = [b.to(dtype) if b is not None and b.is_floating_point() else b for b in biases]
        with torch.autocast(x.device.type, enabled=False):
            return self._run(x, weights, biases)

    def _run(self, x, weights, biases) -> tuple[torch.Tensor, ...]:
        spec = self.specs[0]
        ys = async_tp_column(x, weights, spec.recipe, spec.async_tp)
        return tuple(y if b is None else y + b for y, b in zip(ys, biases))

    def __repr__(self) -> str:
        return f"AsyncTpColumnGroupLowering({[s.fqn for s in self.specs]!r})"
