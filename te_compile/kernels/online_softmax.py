"""The online softmax the attention references share: softmax(s) @ V over blocks of keys, in fp32.

fp8_attention.py's and kv_cache_attention.py's pure-torch references walk the keys in blocks of
``block_n``, as their kernels do, and differ only in how a block's scores and its P @ V are formed
(FP8 P with a fixed scale there; P times the tokens' V scales in q's dtype here). The running state
and its rescaling are this one class, so both references follow the same algorithm:

    m_new = max(m, rowmax(s));  alpha = exp(m - m_new);  p = exp(s - m_new)
    l = l * alpha + rowsum(p);  acc = acc * alpha + (the caller's P @ V of the block)
    o = acc / l;  lse = m + log(l)

Rows whose keys are all masked give o = 0 and lse = -inf (torch's SDPA gives NaN there).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["OnlineSoftmax"]


class OnlineSoftmax:
    """The running state of one attention over key blocks, for queries [B, H, Tq, D]."""

    def __init__(self, b: int, h: int, tq: int, d: int, device) -> None:
        self.m = torch.full((b, h, tq), float("-inf"), device=device)   # running row max
        self.l = torch.zeros((b, h, tq), device=device)                  # softmax denominator
        self.acc = torch.zeros((b, h, tq, d), device=device)             # unnormalized output

    def block(self, s: Tensor, bias: Optional[Tensor]) -> Tensor:
        """p = exp(s - m_new) [B, H, Tq, n] for one block's scores s [B, H, Tq, n] plus the mask's
        ``bias`` (None: nothing masked). m, l and acc move to the new row max; the caller then adds
        the block's P @ V with ``add``. l sums the unrounded p, whatever the caller rounds P to."""
        if bias is not None:
            s = s + bias
        m_new = torch.maximum(self.m, s.amax(dim=-1))
        # rows with every key so far masked: keep them at 0 (exp(-inf - -inf) would be NaN)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(self.m - m_safe)
        p = torch.exp(s - m_safe[..., None])
        self.l = self.l * alpha + p.sum(dim=-1)
        self.acc = self.acc * alpha[..., None]
        self.m = m_new
        return p

    def add(self, pv: Tensor) -> None:
        """Add one block's P @ V [B, H, Tq, D] to the rescaled output."""
        self.acc = self.acc + pv

    def finish(self) -> tuple[Tensor, Tensor]:
        """(o [B, H, Tq, D], lse [B, H, Tq]) in fp32."""
        empty = self.l == 0
        o = torch.where(empty[..., None], torch.zeros_like(self.acc),
                        self.acc / torch.where(empty, 1.0, self.l)[..., None])
        lse = torch.where(empty, torch.full_like(self.m, float("-inf")), self.m + torch.log(self.l))
        return o, lse
