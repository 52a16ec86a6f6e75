"""Random Hadamard transform (RHT) for NVFP4 weight-gradient operands, in plain torch.

NVFP4 gradients (DESIGN.md §5) are quantized for the wgrad GEMM after a 16x16 random Hadamard
transform along the dim that GEMM contracts: it spreads outliers over their block of 16, so one
large value no longer flattens the other 15 to zero. The transform is orthogonal, so
``(x R)(y R)^T = x y^T`` and wgrad needs no inverse; ``undo_rht`` exists for dequantizing.

The matrix is TransformerEngine's: ``R = diag(signs) @ H16 / 4`` with H16 the Sylvester Hadamard
matrix and TE's fixed sign vector (``get_wgrad_sign_vector``), so ``x @ R`` flips the signs of
each group of 16 and then mixes it. Entries are ±1/4, exact in every float dtype, and R is the
same on every call, device and process (no random state is involved).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RHT_SIZE", "RHT_SIGNS", "rht_matrix", "apply_rht", "undo_rht"]

# Length of the groups the transform mixes (one NVFP4 block).
RHT_SIZE = 16

# TransformerEngine's hard-coded "random" signs (transformer_engine/pytorch/tensor/nvfp4_tensor.py).
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def _sylvester_hadamard(n: int) -> list[list[int]]:
    """The n x n Sylvester Hadamard matrix (n a power of two): ±1 entries, H[i][j] = (-1)^popcount(i & j)."""
    return [[-1 if bin(i & j).count("1") % 2 else 1 for j in range(n)] for i in range(n)]


# R's entries, computed once in Python: built from one list, R is one constant in a traced graph
# (built with tensor ops it was ~20 nodes per call for inductor to generate code for)
_R_VALUES = [[sign * h / 4.0 for h in row] for sign, row in zip(RHT_SIGNS, _sylvester_hadamard(RHT_SIZE))]


def rht_matrix(device: Optional[torch.device] = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """R = diag(RHT_SIGNS) @ H16 / 4: [16, 16], orthogonal (R @ R.T == I exactly)."""
    return torch.tensor(_R_VALUES, device=device, dtype=dtype)


def _check_2d(x2d: torch.Tensor, name: str) -> None:
    if not isinstance(x2d, torch.Tensor) or x2d.dim() != 2:
        shape = tuple(x2d.shape) if isinstance(x2d, torch.Tensor) else type(x2d).__name__
        raise ValueError(f"{name} must be a 2-D tensor [R, C], got {shape}")
    if x2d.shape[1] % RHT_SIZE != 0:
        raise ValueError(
            f"{name}: the last dim must be a multiple of {RHT_SIZE}, got shape {tuple(x2d.shape)}"
        )


def _blockwise_matmul(x2d: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x2d [R, C] -> [R, C] fp32: each group of 16 along C times ``matrix`` [16, 16]."""
    rows, cols = x2d.shape
    groups = x2d.to(torch.float32).reshape(rows, cols // RHT_SIZE, RHT_SIZE)
    return (groups @ matrix).reshape(rows, cols)


def apply_rht(x2d: torch.Tensor) -> torch.Tensor:
    """x2d: [R, C] (C % 16 == 0) -> fp32 [R, C], every consecutive group of 16 along C times R."""
    _check_2d(x2d, "apply_rht: x2d")
    return _blockwise_matmul(x2d, rht_matrix(x2d.device))


def undo_rht(y2d: torch.Tensor) -> torch.Tensor:
    """Inverse of ``apply_rht``: y2d [R, C] -> fp32 [R, C], each group of 16 times R.T."""
    _check_2d(y2d, "undo_rht: y2d")
    return _blockwise_matmul(y2d, rht_matrix(y2d.device).t())
