"""The variants of where and how one linear runs, each named after the GEMM path it uses.

``lowerings/linear.py`` (``LinearLowering``) picks one per call; the two Functions most sites run,
per-tensor FP8 (``Fp8LinearFunction``, its GEMMs in gemm/per_tensor.py, which the fused lowerings
call too) and quantizer objects (``QuantizedLinearFunction``: block-scaled recipes, CustomRecipe),
are in that file. Every module here sits below the lowerings and imports none of them.

- ``rowwise``: inference, one input scale per token, the rowwise scaled GEMM (``rowwise_fp8_linear``)
- ``sharded``: DTensor operands run shard by shard on either Function (``plan_linear_sharding``, ``sharded_linear``)
- ``async_tp``: sequence-parallel sites with their collectives on FP8 data next to the GEMM
  (``async_tp_column``, ``async_tp_row``)
"""

__all__: list[str] = []
