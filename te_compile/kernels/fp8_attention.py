"""FP8 attention forward: the numerics of a flash-attention kernel with E4M3 Q, K, V and P.

This file holds the pure-torch reference (the first step of FP8 attention; the Triton kernel that
will sit beside it computes the same algorithm). For q [B, H, Tq, D], k and v [B, Hkv, Tk, D]
(H a multiple of Hkv: grouped-query attention), all arithmetic in fp32:

    q8, q_descale = quantize_heads(q)     E4M3 bytes, one current-scaling scale per (batch, head):
                                          descale [B, H] = amax / 448 (so q ~= q8 * descale)
    k8, v8 likewise, descales [B, Hkv]
    for each block of ``block_n`` keys (the kernel's loop):
        s = (q8 @ k8ᵀ) * q_descale * k_descale * sm_scale, then the mask (causal, boolean, additive)
        m_new = max(m, rowmax(s));  alpha = exp(m - m_new)
        p = exp(s - m_new)                in [0, 1]
        l = l * alpha + rowsum(p)         the softmax denominator, from the unrounded p
        p8 = e4m3(p * 448)                P in FP8 with a fixed scale: its range is known
        acc = acc * alpha + (p8 @ v8) * v_descale / 448
    o = acc / l;  lse = m + log(l)        lse [B, H, Tq], what the backward needs instead of P

The online softmax is part of the numerics: p is quantized relative to the running row max, so the
result depends on ``block_n``; the kernel and this reference take the same block size and then agree
to fp32 rounding (the order of the dot products' sums). Rows whose keys are all masked give o = 0 and
lse = -inf (torch's SDPA gives NaN there).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..scaling import cast_to_fp8, compute_scale, fp8_max

__all__ = ["quantize_heads", "fp8_attention_forward_reference", "P_SCALE", "BLOCK_N"]

E4M3 = torch.float8_e4m3fn
# P = exp(s - m) lies in [0, 1]: a fixed scale maps it onto E4M3's range (FlashAttention-3's choice)
P_SCALE = fp8_max(E4M3)
BLOCK_N = 64   # keys per step of the online softmax


def quantize_heads(x: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, T, D] -> (FP8 bytes [B, H, T, D], descale [B, H] fp32): current scaling per (batch,
    head), with the per-tensor recipes' scale rules (an all-zero head gets scale 1)."""
    amax = x.detach().abs().amax(dim=(-2, -1)).to(torch.float32)
    scale = compute_scale(amax, fp8_dtype)
    data = cast_to_fp8(x, scale[..., None, None], fp8_dtype)
    return data, torch.div(torch.ones_like(scale), scale)


def _block_bias(mask: Optional[torch.Tensor], causal: bool, rows: int, cols: torch.Tensor,
                device) -> Optional[torch.Tensor]:
    """The additive bias for key columns ``cols`` (0 or -inf, or the float mask), broadcastable to
    [B, H, Tq, len(cols)]; None when nothing is masked."""
    bias = None
    if causal:
        # torch's is_causal: query i sees keys 0..i (top-left aligned, also when Tq != Tk)
        allowed = torch.arange(rows, device=device)[:, None] >= cols[None, :]
        bias = torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))
    if mask is not None:
        part = mask[..., cols]
        part = (torch.zeros(part.shape, device=device).masked_fill(~part, float("-inf")) if part.dtype == torch.bool
                else part.to(torch.float32))
        bias = part if bias is None else bias + part
    return bias


def fp8_attention_forward_reference(
    q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
    q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor,
    *, sm_scale: float, causal: bool = False, mask: Optional[torch.Tensor] = None,
    block_n: int = BLOCK_N, out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, Tq, D] in ``out_dtype``, lse [B, H, Tq] fp32) from FP8 q8 [B, H, Tq, D], k8 and v8
    [B, Hkv, Tk, D] and their descales ([B, H], [B, Hkv]). ``mask``: boolean (True = attend) or
    additive float, broadcastable to [B, H, Tq, Tk]."""
    b, h, tq, d = q8.shape
    hkv, tk = k8.shape[1], k8.shape[2]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    group = h // hkv
    # grouped-query attention: each key/value head serves ``group`` consecutive query heads
    k = k8.to(torch.float32).repeat_interleave(group, dim=1)
    v = v8.to(torch.float32).repeat_interleave(group, dim=1)
    kv_scale = (q_descale * k_descale.repeat_interleave(group, dim=1) * sm_scale)[..., None, None]
    v_descale = (v_descale.repeat_interleave(group, dim=1) / P_SCALE)[..., None, None]
    q = q8.to(torch.float32)
    if mask is not None:
        mask = mask.expand(*mask.shape[:-2], tq, tk) if mask.dim() >= 2 else mask
    m = torch.full((b, h, tq), float("-inf"), device=q.device)
    l = torch.zeros((b, h, tq), device=q.device)
    acc = torch.zeros((b, h, tq, d), device=q.device)
    for start in range(0, tk, block_n):
        cols = torch.arange(start, min(start + block_n, tk), device=q.device)
        s = (q @ k[:, :, start:start + block_n].transpose(-2, -1)) * kv_scale
        bias = _block_bias(mask, causal, tq, cols, q.device)
        if bias is not None:
            s = s + bias
        m_new = torch.maximum(m, s.amax(dim=-1))
        # rows with every key so far masked: keep them at 0 (exp(-inf - -inf) would be NaN)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe[..., None])
        l = l * alpha + p.sum(dim=-1)
        p8 = cast_to_fp8(p, torch.tensor(P_SCALE, device=q.device), E4M3)
        acc = acc * alpha[..., None] + (p8.to(torch.float32) @ v[:, :, start:start + block_n]) * v_descale
        m = m_new
    empty = l == 0
    o = torch.where(empty[..., None], torch.zeros_like(acc), acc / torch.where(empty, 1.0, l)[..., None])
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(l))
    return o.to(out_dtype), lse
