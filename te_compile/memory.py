"""What one training step keeps alive for its backward, in bytes: the demo's memory figure, and the
saved-bytes column of the benchmarks that compare it across providers.

A tensor is counted by its storages, so that views share one count and a wrapper subclass (te's FP8
weights, torchao's Float8TrainingTensor) counts the inner tensors that hold its data.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["storages", "saved_for_backward_bytes"]


def storages(t: torch.Tensor) -> list[tuple[int, int]]:
    """(data pointer, bytes) of each storage behind ``t``: a wrapper subclass's (te's FP8 weights,
    torchao's) are its inner tensors'; its own storage is a placeholder with no data pointer."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [key for name in names for key in storages(getattr(t, name))]
    try:
        storage = t.untyped_storage()
        return [(storage.data_ptr(), storage.nbytes())]
    except (RuntimeError, NotImplementedError):   # an opaque subclass: counted once, by identity
        return [(id(t), t.numel() * t.element_size())]


def saved_for_backward_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the distinct storages one training step saves for backward, excluding what lives
    across steps anyway: parameters, buffers and delayed scaling's state (its amax histories are
    inputs of the backward's update).

    Compiled graphs save their tensors through the ordinary autograd mechanism (the compiled
    autograd.Function's ctx), so ``saved_tensors_hooks`` sees exactly what the compiled forward
    keeps alive for the backward: FP8 copies for the te run, high-precision activations otherwise.
    ``model(x, y)`` returns (output, loss), as the demo's GPT does.
    """
    from .state import state_tensors

    persistent = [*model.parameters(), *model.buffers(), *state_tensors(model)]
    params = {key for t in persistent for key, _ in storages(t)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        for key, nbytes in storages(t):
            if key not in params:
                saved[key] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())
