"""Graph-only helpers: reading and editing torch.fx graphs without knowing any te lowering.

The passes (``te_compile.passes``) stand on these; so may anything else that walks a graph. Nothing
here imports a lowering or a pass: ``graphs`` (the scopes of a Dynamo graph), ``editing`` (inserting
and replacing calls, their meta kept right), ``naming`` (module paths whichever frame Dynamo
compiled), ``matching`` (reading nodes as Dynamo records them), ``gemm_operands`` (the parameter
behind a GEMM's operand, and the records of the sites the linear passes find), ``cache_names``
(stable names for the callables a graph calls, for AOTAutograd's cache) and ``micro_pipeline``
(inductor's async-TP pass on the graphs AOTAutograd hands over).
"""

__all__: list[str] = []
