"""The peer a user would pick instead of te: torchao's float8 training, applied the way a torchao
user applies it (a module swap before ``torch.compile``). The demo's ``--peer torchao`` run and every
torchao row of the benchmarks convert through here, so that they measure the same thing.

torchao is optional (the ``bench`` extra): it is imported when a conversion runs, and a missing
torchao raises ImportError there.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["torchao_float8"]


def torchao_float8(model: torch.nn.Module, emulate: bool, recipe: str = "tensorwise") -> torch.nn.Module:
    """``model`` with its linears converted by torchao's float8 training, in place: the module swap a
    torchao user writes. ``recipe`` is torchao's recipe name (tensorwise, its default, or rowwise);
    ``emulate`` runs its FP8 GEMMs as fp32 matmuls (a CPU has no FP8 GEMM). Linears whose dims are
    not multiples of 16 stay as they are, as torchao requires (te leaves the same ones in high
    precision)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def eligible(module: torch.nn.Module, fqn: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0
                and module.out_features % 16 == 0)

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    return convert_to_float8_training(model, config=config, module_filter_fn=eligible)
