"""Run the Triton kernels in Triton's interpreter on machines without CUDA.

Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel, i.e. when te_compile.kernels
modules are imported, so this must happen before any test module imports them. Plain-torch paths are
unaffected; on a CUDA machine the kernels compile for the GPU as usual.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
