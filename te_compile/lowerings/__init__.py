"""What each rewritten site becomes: callables around autograd functions of quantized GEMMs.

One module per site kind, named as the pass that inserts it (te_compile/passes/): ``linear``,
``grouped_linear`` (MoE experts), ``norm_fusion``, ``activation_fusion``, ``attention``, ``attention_inputs``, ``attention_projection``,
``delayed_state``; the linear's recipe paths beside them (``fp8_linear``: per-tensor FP8;
``quantized_linear``: quantizer objects; ``sharded_linear``: DTensor operands).
"""

from .linear import LinearLowering, LinearSpec, gemm_kind

__all__ = ["LinearLowering", "LinearSpec", "gemm_kind"]
