"""What each rewritten site becomes: callables around autograd functions of quantized GEMMs.

One module per site kind, named as the pass that inserts it (te_compile/passes/): ``linear``,
``grouped_linear`` (MoE experts), ``norm_fusion``, ``activation_fusion``, ``attention``, ``attention_inputs``, ``attention_projection``,
``delayed_state``, and the async-TP column group the linear pass may choose (``async_tp_group``).
The ways one linear executes (per-tensor, quantizer objects, rowwise, sharded, async TP) are the
sub-package ``linear_paths``, one layer below: the lowerings pick or call them, never the reverse.
"""

from .linear import LinearLowering, LinearSpec, gemm_kind

__all__ = ["LinearLowering", "LinearSpec", "gemm_kind"]
