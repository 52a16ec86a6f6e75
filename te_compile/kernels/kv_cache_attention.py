"""Attention over an FP8 key/value cache: E4M3 K and V with one scale per (batch row, head, token),
read as bytes, against high-precision queries.

A pure-torch reference (CPU runs it) and, beside it, the Triton kernel computing the same algorithm
(sm89+ GPUs; tested against the reference in Triton's interpreter). For q [B, H, Tq, D] (fp32, bf16
or fp16), k8 and v8 [B, Hkv, Tk, D] in E4M3 with k_scale_inv and v_scale_inv [B, Hkv, Tk] fp32
(a cached vector is x8 * scale_inv), H a multiple of Hkv (grouped-query attention), in fp32 unless
said otherwise:

    for each block of ``block_n`` keys (the kernel's loop):
        s = (q @ k8ᵀ) * (k_scale_inv * sm_scale)   a token's scale is one factor of its column
        the mask (causal, boolean, additive); the online softmax of fp8_attention.py:
        m_new = max(m, rowmax(s));  alpha = exp(m - m_new);  p = exp(s - m_new);  l = l * alpha + rowsum(p)
        acc = acc * alpha + (p * v_scale_inv in q's dtype) @ v8     a token's V scale is one factor of p's column
    o = acc / l

Why the queries stay in high precision: decoding is one query token per head against the whole
cache, so reading K and V is the cost and the arithmetic is not; E4M3 widens to bf16 or fp16 exactly,
so the dots run on the 16-bit tensor cores with fp32 accumulation, P in q's dtype as FlashAttention-2
keeps it. Quantizing Q and P to FP8 as well would add two roundings and save nothing while the bytes
of the cache dominate. The kernel puts the query heads that share a key/value head into one tile's
rows (Tq * group rows per program), so each block of K and V is read once for the whole group.

Rows whose keys are all masked give o = 0 (torch's SDPA gives NaN there), as in fp8_attention.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._fp_bits import HAS_TRITON, use_triton
from ._launch import require_triton
from .fp8_attention import BLOCK_N, E4M3, block_bias, mask_args
from .online_softmax import OnlineSoftmax

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["kv_cache_attention", "kv_cache_attention_reference", "kv_cache_attention_triton"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(q: Tensor, k8: Tensor, v8: Tensor, k_scale_inv: Tensor, v_scale_inv: Tensor) -> int:
    """The grouped-query factor H / Hkv; a ValueError naming what is off otherwise."""
    if q.dim() != 4 or k8.dim() != 4 or v8.shape != k8.shape:
        raise ValueError(f"q must be [B, H, Tq, D] and k8, v8 [B, Hkv, Tk, D] alike, got {tuple(q.shape)}, "
                         f"{tuple(k8.shape)}, {tuple(v8.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q.dtype must be one of {list(_DTYPES)}, got {q.dtype}")
    if k8.dtype != E4M3 or v8.dtype != E4M3:
        raise ValueError(f"k8, v8 must be {E4M3}, got {k8.dtype}, {v8.dtype}")
    b, h, _, d = q.shape
    hkv, tk = k8.shape[1], k8.shape[2]
    if k8.shape[0] != b or k8.shape[3] != d:
        raise ValueError(f"k8 {tuple(k8.shape)} does not match q {tuple(q.shape)} in batch or head dim")
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    for name, s in (("k_scale_inv", k_scale_inv), ("v_scale_inv", v_scale_inv)):
        if tuple(s.shape) != (b, hkv, tk) or s.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [{b}, {hkv}, {tk}], got {s.dtype} {tuple(s.shape)}")
    return h // hkv


def kv_cache_attention_reference(
    q: Tensor, k8: Tensor, v8: Tensor, k_scale_inv: Tensor, v_scale_inv: Tensor, *, sm_scale: float,
    causal: bool = False, mask: Optional[Tensor] = None, block_n: int = BLOCK_N,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """o [B, H, Tq, D] in ``out_dtype`` (q's dtype by default), the module docstring's algorithm.
    ``mask``: boolean (True = attend) or additive float, broadcastable to [B, H, Tq, Tk]."""
    group = _check(q, k8, v8, k_scale_inv, v_scale_inv)
    b, h, tq, d = q.shape
    tk = k8.shape[2]
    k = k8.to(torch.float32).repeat_interleave(group, dim=1)
    v = v8.to(torch.float32).repeat_interleave(group, dim=1)
    k_factor = (k_scale_inv * sm_scale).repeat_interleave(group, dim=1)[:, :, None, :]   # [B, H, 1, Tk]
    v_factor = v_scale_inv.repeat_interleave(group, dim=1)[:, :, None, :]
    q32 = q.to(torch.float32)
    if mask is not None:
        mask = mask.expand(*mask.shape[:-2], tq, tk) if mask.dim() >= 2 else mask
    state = OnlineSoftmax(b, h, tq, d, q.device)
    for start in range(0, tk, block_n):
        end = min(start + block_n, tk)
        s = (q32 @ k[:, :, start:end].transpose(-2, -1)) * k_factor[..., start:end]
        p = state.block(s, block_bias(mask, causal, tq, torch.arange(start, end, device=q.device), q.device))
        pv = (p * v_factor[..., start:end]).to(q.dtype).to(torch.float32)
        state.add(pv @ v[:, :, start:end])
    o, _ = state.finish()
    return o.to(out_dtype or q.dtype)


# rows of a tile (Tq * group query rows in all): tl.dot's smallest M for decoding, FlashAttention's
# usual 64 for a prefill
_DECODE_BLOCK_M, _BLOCK_M = 16, 64

if HAS_TRITON:
    @triton.jit
    def _kv_cache_attention_kernel(
        # each operand beside its strides (the last dim is contiguous)
        q_ptr, s_qb, s_qh, s_qt,              # q [B, H, Tq, D]
        k_ptr, s_kb, s_kh, s_kt,              # k8 [B, Hkv, Tk, D] E4M3
        v_ptr, s_vb, s_vh, s_vt,              # v8 [B, Hkv, Tk, D] E4M3
        ks_ptr, s_sb, s_sh,                   # k_scale_inv [B, Hkv, Tk] fp32
        vs_ptr, s_tb, s_th,                   # v_scale_inv [B, Hkv, Tk] fp32
        mask_ptr, s_mb, s_mh, s_mq, s_mk,     # mask, broadcast to [B, H, Tq, Tk] (mask_args)
        o_ptr, s_ob, s_oh, s_ot,              # o [B, H, Tq, D]
        sm_scale, TQ, TK, H, GROUP,           # GROUP = H // Hkv query heads per key/value head
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, IEEE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        hkv_all = H // GROUP
        b = pid_bh // hkv_all
        hkv = pid_bh % hkv_all
        # row r of the tile: query head hkv * GROUP + r // TQ (repeat_interleave's order), position r % TQ
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        heads = hkv * GROUP + rows // TQ
        pos = rows % TQ
        rmask = rows < TQ * GROUP
        dims = tl.arange(0, BLOCK_D)
        keys = tl.arange(0, BLOCK_N)
        dmask = dims < D
        q_rows = b * s_qb + heads * s_qh + pos * s_qt
        q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = k_ptr + b * s_kb + hkv * s_kh
        v_base = v_ptr + b * s_vb + hkv * s_vh
        m_rows = b * s_mb + heads * s_mh + pos * s_mq
        for start in range(0, TK, BLOCK_N):
            cols = start + keys
            cmask = cols < TK
            tile_n = cmask[:, None] & dmask[None, :]
            # E4M3 widens to q's dtype exactly
            k = tl.load(k_base + cols[:, None] * s_kt + dims[None, :], mask=tile_n, other=0.0).to(q.dtype)
            k_factor = tl.load(ks_ptr + b * s_sb + hkv * s_sh + cols, mask=cmask, other=0.0) * sm_scale
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * k_factor[None, :]
            allowed = rmask[:, None] & cmask[None, :]
            if CAUSAL:   # top-left aligned: query position i sees keys 0..i
                allowed = allowed & (pos[:, None] >= cols[None, :])
            mptr = mask_ptr + m_rows[:, None] + cols[None, :] * s_mk
            if MASK_KIND == 1:
                allowed = allowed & (tl.load(mptr, mask=allowed, other=0) != 0)
            if MASK_KIND == 2:
                s = s + tl.load(mptr, mask=allowed, other=0.0).to(tl.float32)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_factor = tl.load(vs_ptr + b * s_tb + hkv * s_th + cols, mask=cmask, other=0.0)
            pv = (p * v_factor[None, :]).to(q.dtype)
            v = tl.load(v_base + cols[:, None] * s_vt + dims[None, :], mask=tile_n, other=0.0).to(q.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pv, v)
            m_i = m_new
        empty = l_i == 0.0
        o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
        o_rows = b * s_ob + heads * s_oh + pos * s_ot
        tl.store(o_ptr + o_rows[:, None] + dims[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=rmask[:, None] & dmask[None, :])


def kv_cache_attention_triton(
    q: Tensor, k8: Tensor, v8: Tensor, k_scale_inv: Tensor, v_scale_inv: Tensor, *, sm_scale: float,
    causal: bool = False, mask: Optional[Tensor] = None, block_n: int = BLOCK_N,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Triton launcher with the reference's signature; CPU tensors work under TRITON_INTERPRET=1."""
    require_triton("kv_cache_attention_triton")
    group = _check(q, k8, v8, k_scale_inv, v_scale_inv)
    b, h, tq, d = q.shape
    hkv, tk = k8.shape[1], k8.shape[2]
    if d > 256:
        raise ValueError(f"head dim must be <= 256, got {d}")
    q, k8, v8 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k8, v8))
    o = torch.empty((b, h, tq, d), dtype=out_dtype or q.dtype, device=q.device)
    mask_arg, kind, strides = mask_args(mask, b, h, tq, tk, o)
    if o.numel() == 0:
        return o
    block_m = _DECODE_BLOCK_M if tq * group <= _DECODE_BLOCK_M else _BLOCK_M
    k_scale_inv, v_scale_inv = (s if s.stride(-1) == 1 else s.contiguous() for s in (k_scale_inv, v_scale_inv))
    grid = (triton.cdiv(tq * group, block_m), b * hkv)
    _kv_cache_attention_kernel[grid](
        q, *q.stride()[:3],
        k8, *k8.stride()[:3],
        v8, *v8.stride()[:3],
        k_scale_inv, *k_scale_inv.stride()[:2],
        v_scale_inv, *v_scale_inv.stride()[:2],
        mask_arg, *strides,
        o, *o.stride()[:3],
        float(sm_scale), tq, tk, h, group,
        D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), MASK_KIND=kind, IEEE=q.dtype == torch.float32, num_warps=4)
    return o


def kv_cache_attention(q, k8, v8, k_scale_inv, v_scale_inv, *, sm_scale: float, causal: bool = False,
                       mask: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """o as ``kv_cache_attention_reference`` computes it: the Triton kernel on sm89+ GPUs, the reference
    elsewhere."""
    on_gpu = use_triton(q) and torch.cuda.get_device_capability(q.device) >= (8, 9)
    impl = kv_cache_attention_triton if on_gpu else kv_cache_attention_reference
    return impl(q, k8, v8, k_scale_inv, v_scale_inv, sm_scale=sm_scale, causal=causal, mask=mask,
                out_dtype=out_dtype)
