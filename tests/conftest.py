"""Run the Triton kernels in Triton's interpreter on machines without CUDA.

Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel, i.e. when te_compile.kernels
modules are imported, so this must happen before any test module imports them. Plain-torch paths are
unaffected; on a CUDA machine the kernels compile for the GPU as usual.

Also the fixtures several test modules share (imported inside them, after that environment is set).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist, one intra-op thread per worker and core: two workers of two OpenMP threads each
# (and the single-threaded gloo ranks the distributed tests spawn) would oversubscribe the cores, and
# oversubscribed OpenMP threads spin-wait on each other (a 6 s test was seen taking 56 s beside a
# spawned world).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture
def quantizations(monkeypatch):
    """The shapes of the weights te_compile.weight_cache quantizes, in order (the inference and the
    training weight-cache tests count them); an expert weight as [E, N, K]."""
    import te_compile.weight_cache as weight_cache

    seen = []

    def counting(real):
        def count(t, *args, **kwargs):
            seen.append(tuple(t.shape))
            return real(t, *args, **kwargs)
        return count

    # dense weights per tensor, an MoE layer's expert weights per expert
    for name in ("quantize_per_tensor", "quantize_per_expert"):
        monkeypatch.setattr(weight_cache, name, counting(getattr(weight_cache, name)))
    return seen
