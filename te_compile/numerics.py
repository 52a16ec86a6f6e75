"""How close a low-precision result is to its reference: SQNR in dB, the second tier of the
project's numerics (a kernel against the reference of the same quantization is bit-exact instead).

The block GEMMs' self-test judges native against emulated GEMMs with it, and the benchmarks that
compare te's numerics with a peer's report it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["sqnr_db"]


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """20 log10(‖ref‖ / ‖ref − got‖) in float64, any equal shapes; inf when the two are equal."""
    ref, got = ref.double(), got.double()
    noise = (ref - got).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.norm().item() / noise)
