"""The ways one linear executes, each named after the GEMM path it uses.

``lowerings/linear.py`` (``LinearLowering``) picks one per call; the fused lowerings (norm,
activation, attention projection) call the per-tensor GEMMs of ``per_tensor`` with an FP8 input
they made themselves. Every module here sits below the lowerings and imports none of them.

- ``per_tensor``: per-tensor FP8 (current and delayed scaling), torch._scaled_mm
  (``Fp8LinearFunction``, ``quantize_weight``, ``fp8_fprop``, ``fp8_dgrad_wgrad``)
- ``quantizer``: quantizer objects (block-scaled recipes, CustomRecipe), native block GEMMs or
  dequantize-then-matmul (``QuantizedLinearFunction``)
- ``rowwise``: inference, one input scale per token, the rowwise scaled GEMM (``rowwise_fp8_linear``)
- ``sharded``: DTensor operands run shard by shard on one of the above (``plan_linear_sharding``, ``sharded_linear``)
- ``async_tp``: sequence-parallel sites with their collectives on FP8 data next to the GEMM
  (``async_tp_column``, ``async_tp_row``)
"""

__all__: list[str] = []
