"""Inductor's micro-pipeline TP pass on te's forward and backward graphs (async tensor parallelism).

Inductor runs ``micro_pipeline_tp_pass`` among its post-grad passes when
``torch._inductor.config._micro_pipeline_tp`` is set: the backend sets it while te's graphs compile
under ``[distributed] async_tp``. With ``compiler = "aot_eager"`` there are no post-grad passes, so
``micro_pipeline_tp`` does what inductor does before the pass (``view_to_reshape``: the pass matches
``aten.reshape`` around ``_scaled_mm``) and runs it on each graph aot_autograd hands over. Either way
the pass fuses an all-gather with the GEMMs it feeds, and a GEMM with the reduce-scatter it feeds,
into ``symm_mem`` ops where the group has symmetric memory (NCCL; the pass leaves the graph as it is
elsewhere).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.fx as fx

__all__ = ["micro_pipeline_tp", "FUSED_OPS"]

log = logging.getLogger("te_compile")

FUSED_OPS = ("fused_all_gather_matmul", "fused_all_gather_scaled_matmul", "fused_matmul_reduce_scatter",
             "fused_scaled_matmul_reduce_scatter")


def micro_pipeline_tp(gm: fx.GraphModule) -> Counter:
    """Normalize ``gm`` as inductor does and run the pass in place; the fused ops it made, by name."""
    from torch._inductor.fx_passes.micro_pipeline_tp import micro_pipeline_tp_pass
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    view_to_reshape(gm)
    micro_pipeline_tp_pass(gm.graph)
    gm.graph.lint()
    gm.recompile()
    fused = Counter(n.target._opname for n in gm.graph.nodes
                    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                    and n.target.namespace == "symm_mem" and n.target._opname in FUSED_OPS)
    log.info("te_compile: micro-pipeline TP pass fused %s", dict(fused) or "nothing")
    return fused
