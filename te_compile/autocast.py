"""The dtype autocast would run a matmul in: what every lowering casts its operands to first.

A lowering replaces ops that autocast would have run in its dtype (linear, matmul, attention); it
casts its operands to that dtype and runs with autocast off, so its output dtype matches eager's.
The linear, the fused lowerings, the attention lowerings and the norm pass all ask this one function.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["autocast_dtype"]


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast would run a linear in on ``x``'s device, or None outside autocast."""
    device_type = x.device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)
