"""FP8 attention: the numerics of a flash-attention forward and backward with E4M3 Q, K, V and P.

Pure-torch references of the forward and the backward (CPU runs them) and, beside them, the Triton
kernels computing the same algorithms (sm89+ GPUs; tested against the references in Triton's
interpreter). For q [B, H, Tq, D], k and v [B, Hkv, Tk, D] (H a multiple of Hkv: grouped-query
attention), all arithmetic in fp32:

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

The backward recomputes P = exp(s - lse) from the saved FP8 Q, K and the logsumexp (the attention
matrix is never saved), with D = rowsum(dO * O):

    dV = Pᵀ dO;  dP = dO Vᵀ;  dS = P * (dP - D);  dQ = dS K * sm_scale;  dK = dSᵀ Q * sm_scale

"high_precision": those in fp32 from the dequantized Q, K, V. "fp8" (``fp8_grads``): dO in the
gradient format (E5M2 under HYBRID) with one current scale per (batch, head); P in E4M3 with the
forward's fixed scale for dV; dS in the gradient format with one scale per (batch, head) taken from
a bound known before dS exists, |dS_ij| <= P_ij * (|dP_ij| + |D_i|) <= 2 * max_i |dO_i| * max_j |V_j|
(Cauchy-Schwarz; |D_i| <= max_j |dP_ij| since P's row sums to 1), so a kernel needs no pass over dS
to scale it; E5M2's 32 binades absorb the bound's slack. dP and D stay in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..scaling import cast_to_fp8, compute_scale, fp8_max
from ._fp_bits import HAS_TRITON, use_triton
from ._launch import require_triton
from .online_softmax import OnlineSoftmax

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._fp_bits import to_e4m3, to_e5m2

__all__ = ["quantize_heads", "dequantize_heads", "fp8_attention_forward", "fp8_attention_forward_reference", "fp8_attention_backward",
           "fp8_attention_backward_reference", "fp8_attention_forward_triton",
           "fp8_attention_backward_triton", "block_bias", "mask_args", "P_SCALE", "BLOCK_N", "E4M3"]

E4M3 = torch.float8_e4m3fn
# P = exp(s - m) lies in [0, 1]: a fixed scale maps it onto E4M3's range (FlashAttention-3's choice)
P_SCALE = fp8_max(E4M3)
BLOCK_N = 64   # keys per step of the online softmax


def quantize_heads(x: Tensor, fp8_dtype: torch.dtype = E4M3,
                   scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """x [B, H, T, D] -> (FP8 bytes [B, H, T, D], descale [B, H] fp32): current scaling per (batch,
    head), with the per-tensor recipes' scale rules (an all-zero head gets scale 1). ``scale`` (fp32
    [1]): one given scale for the whole tensor instead (delayed scaling); every head's descale is its
    inverse, so the kernels take both alike."""
    if scale is not None:
        data = cast_to_fp8(x, scale, fp8_dtype)
        return data, torch.div(torch.ones_like(scale), scale).expand(x.shape[:2]).contiguous()
    amax = x.detach().abs().amax(dim=(-2, -1)).to(torch.float32)
    scale = compute_scale(amax, fp8_dtype)
    data = cast_to_fp8(x, scale[..., None, None], fp8_dtype)
    return data, torch.div(torch.ones_like(scale), scale)


def block_bias(mask: Optional[Tensor], causal: bool, rows: int, cols: Tensor,
                device) -> Optional[Tensor]:
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


def _score_scale(q_descale: Tensor, k_descale: Tensor, group: int, sm_scale: float) -> Tensor:
    """[B, H, 1, 1]: what (q8 @ k8ᵀ) is multiplied by to give the scores, (q_descale * k_descale) * sm_scale
    (the kernels' order of operations too)."""
    return (q_descale * k_descale.repeat_interleave(group, dim=1) * sm_scale)[..., None, None]


def fp8_attention_forward_reference(
    q8: Tensor, k8: Tensor, v8: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor, *,
    sm_scale: float, causal: bool = False, mask: Optional[Tensor] = None, block_n: int = BLOCK_N,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
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
    kv_scale = _score_scale(q_descale, k_descale, group, sm_scale)
    v_descale = (v_descale.repeat_interleave(group, dim=1) / P_SCALE)[..., None, None]
    q = q8.to(torch.float32)
    if mask is not None:
        mask = mask.expand(*mask.shape[:-2], tq, tk) if mask.dim() >= 2 else mask
    state = OnlineSoftmax(b, h, tq, d, q.device)
    for start in range(0, tk, block_n):
        cols = torch.arange(start, min(start + block_n, tk), device=q.device)
        s = (q @ k[:, :, start:start + block_n].transpose(-2, -1)) * kv_scale
        p = state.block(s, block_bias(mask, causal, tq, cols, q.device))
        p8 = cast_to_fp8(p, torch.tensor(P_SCALE, device=q.device), E4M3)
        state.add((p8.to(torch.float32) @ v[:, :, start:start + block_n]) * v_descale)
    o, lse = state.finish()
    return o.to(out_dtype), lse


def dequantize_heads(x8: Tensor, descale: Tensor, group: int = 1) -> Tensor:
    """``quantize_heads``'s inverse: FP8 [B, Hx, T, D] and descale [B, Hx] -> fp32 [B, Hx * group, T, D]
    (each head repeated ``group`` times, as grouped-query attention reads a key/value head)."""
    x = x8.to(torch.float32) * descale[..., None, None]
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _per_kv_head(x: Tensor, group: int) -> Tensor:
    """[B, H, T, D] per query head -> [B, H / group, T, D]: a key/value head's gradient is the sum
    over the query heads it serves."""
    if group == 1:
        return x
    b, h, t, d = x.shape
    return x.reshape(b, h // group, group, t, d).sum(dim=2)


def _fp8_grad_scales(do32: Tensor, v8: Tensor, v_descale: Tensor, group: int,
                     grad_dtype: torch.dtype, do_scale: Optional[Tensor] = None,
                     grad_scales: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The "fp8" backward's scales: (dO in ``grad_dtype`` [B, H, Tq, D], its descale [B, H], dS's scale
    [B, H] from the module docstring's bound 2 * max_i |dO_i| * max_j |V_j|). ``do_scale``: dO's
    delayed-scaling scale (fp32 [1]), else dO is current-scaled per (batch, head). ``grad_scales``:
    (dO's scale [B, H], dS's scale [B, H]) worked out by the caller (context parallelism: from the
    whole sequence's dO), used as they are."""
    if grad_scales is not None:
        scale, ds_scale = grad_scales
        return (cast_to_fp8(do32, scale[..., None, None], grad_dtype), torch.div(torch.ones_like(scale), scale),
                ds_scale)
    do8, do_descale = quantize_heads(do32, grad_dtype, do_scale)
    v_rows = dequantize_heads(v8, v_descale).norm(dim=-1).amax(dim=-1).repeat_interleave(group, dim=1)
    bound = 2 * do32.norm(dim=-1).amax(dim=-1) * v_rows
    return do8, do_descale, compute_scale(bound, grad_dtype)


def fp8_attention_backward_reference(
    do: Tensor, q8: Tensor, k8: Tensor, v8: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor,
    o: Tensor, lse: Tensor, *, sm_scale: float, causal: bool = False, mask: Optional[Tensor] = None,
    fp8_grads: bool = False, grad_dtype: torch.dtype = torch.float8_e5m2, do_scale: Optional[Tensor] = None,
    return_ds: bool = False, grad_scales: Optional[tuple[Tensor, Tensor]] = None,
) -> tuple[Tensor, ...]:
    """(dq [B, H, Tq, D], dk, dv [B, Hkv, Tk, D]) in fp32, from dO [B, H, Tq, D], the forward's FP8
    operands and descales, its output ``o`` (any dtype) and ``lse`` [B, H, Tq]. ``fp8_grads``: the
    "fp8" mode of the module docstring, ``grad_dtype`` the format of dO and dS, ``do_scale`` dO's
    delayed-scaling scale (fp32 [1]; None: current scaling per (batch, head)). ``return_ds``: also dS
    [B, H, Tq, Tk] in fp32, the gradient of an additive mask (the high-precision backward's in both
    modes)."""
    h, tq, tk = q8.shape[1], q8.shape[2], k8.shape[2]
    group = h // k8.shape[1]
    # the forward's scores, in the forward's order of operations
    q8f, k8f = q8.to(torch.float32), k8.to(torch.float32).repeat_interleave(group, dim=1)
    s = (q8f @ k8f.transpose(-2, -1)) * _score_scale(q_descale, k_descale, group, sm_scale)
    if mask is not None:
        mask = mask.expand(*mask.shape[:-2], tq, tk) if mask.dim() >= 2 else mask
    bias = block_bias(mask, causal, tq, torch.arange(tk, device=q8.device), q8.device)
    if bias is not None:
        s = s + bias
    # fully masked rows have lse = -inf: their P is 0, not exp(-inf + inf)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    p = torch.where(torch.isinf(lse)[..., None], 0.0, p)
    do32 = do.to(torch.float32)
    delta = (do32 * o.to(torch.float32)).sum(dim=-1, keepdim=True)   # D [B, H, Tq, 1]
    if not fp8_grads:
        q, k, v = dequantize_heads(q8, q_descale), dequantize_heads(k8, k_descale, group), dequantize_heads(v8, v_descale, group)
        dv = p.transpose(-2, -1) @ do32
        dp = do32 @ v.transpose(-2, -1)
        ds = p * (dp - delta)
        dq = (ds @ k) * sm_scale
        dk = (ds.transpose(-2, -1) @ q) * sm_scale
        return (dq, _per_kv_head(dk, group), _per_kv_head(dv, group), *((ds,) if return_ds else ()))
    do8, do_descale, ds_scale = _fp8_grad_scales(do32, v8, v_descale, group, grad_dtype, do_scale, grad_scales)
    do_q = do8.to(torch.float32)
    p8 = cast_to_fp8(p, torch.tensor(P_SCALE, device=q8.device), E4M3).to(torch.float32)
    dv = (p8.transpose(-2, -1) @ do_q) * (do_descale / P_SCALE)[..., None, None]
    v_q = v8.to(torch.float32).repeat_interleave(group, dim=1)
    vd = v_descale.repeat_interleave(group, dim=1)
    dp = (do_q @ v_q.transpose(-2, -1)) * (do_descale * vd)[..., None, None]
    ds = p * (dp - delta)
    ds8 = cast_to_fp8(ds, ds_scale[..., None, None], grad_dtype).to(torch.float32)
    ds_descale = torch.div(torch.ones_like(ds_scale), ds_scale)
    kd = k_descale.repeat_interleave(group, dim=1)
    dq = (ds8 @ k8f) * (ds_descale * kd * sm_scale)[..., None, None]
    dk = (ds8.transpose(-2, -1) @ q8f) * (ds_descale * q_descale * sm_scale)[..., None, None]
    if return_ds:
        # the mask's gradient feeds no FP8 GEMM, so it takes neither rounding that only serves one (dO in
        # the gradient format, dS's cast): it is the high-precision backward's dS, bit for bit
        ds = p * (do32 @ dequantize_heads(v8, v_descale, group).transpose(-2, -1) - delta)
    return (dq, _per_kv_head(dk, group), _per_kv_head(dv, group), *((ds,) if return_ds else ()))


# ---------------------------------------------------------------------------------------------------
# Triton forward: one program per (block of BLOCK_M queries, batch * head), the reference's loop over
# BLOCK_N keys inside. S = Q8 K8ᵀ and O += P8 V8 are FP8 tensor-core dots with fp32 accumulation
# (sm89+); P is cast to E4M3 by the GPU's saturating round-to-nearest-even conversion (in the
# interpreter by _fp_bits' arithmetic rounding, which gives the same bits: _fp_bits.to_e4m3).

_MASK_NONE, _MASK_BOOL, _MASK_ADD = 0, 1, 2
_BLOCK_M = 64
# two warpgroups over the 64-row tile: for sm90 (Triton 3.9, D = 128, 64-key steps) the forward then
# builds to 2,744 SASS instructions in 195 registers and spills nothing; with one warpgroup it took
# 4,064 instructions, 255 registers and 67 spill loads and stores
_FWD_WARPS = 8

if HAS_TRITON:
    @triton.jit
    def _masked_scores(q, k, kv_scale, rows, cols, TQ, TK, mptr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
        """S [BLOCK_M, BLOCK_N] = (q8 · k8ᵀ) · kv_scale of FP8 q [BLOCK_M, D] and k [BLOCK_N, D], plus an
        additive mask; -inf where the query may not see the key (out of range, causal, boolean mask)."""
        s = tl.dot(q, tl.trans(k)) * kv_scale
        allowed = (rows < TQ)[:, None] & (cols < TK)[None, :]
        if CAUSAL:   # top-left aligned: query i sees keys 0..i
            allowed = allowed & (rows[:, None] >= cols[None, :])
        if MASK_KIND == 1:
            allowed = allowed & (tl.load(mptr, mask=allowed, other=0) != 0)
        if MASK_KIND == 2:
            s = s + tl.load(mptr, mask=allowed, other=0.0).to(tl.float32)
        return tl.where(allowed, s, float("-inf"))

    @triton.jit
    def _fp8_attention_fwd_kernel(
        q_ptr, k_ptr, v_ptr, qd_ptr, kd_ptr, vd_ptr, mask_ptr, o_ptr, lse_ptr,
        sm_scale, TQ, TK, H, GROUP,
        s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt,
        s_mb, s_mh, s_mq, s_mk, s_ob, s_oh, s_ot,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, P_SCALE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hkv = h // GROUP           # grouped-query attention: repeat_interleave's head order
        hkv_all = H // GROUP
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        keys = tl.arange(0, BLOCK_N)
        rmask = rows < TQ
        dmask = dims < D
        q = tl.load(q_ptr + b * s_qb + h * s_qh + rows[:, None] * s_qt + dims[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        # the reference's order: (q_descale * k_descale) * sm_scale
        kv_scale = tl.load(qd_ptr + b * H + h) * tl.load(kd_ptr + b * hkv_all + hkv) * sm_scale
        v_scale = tl.load(vd_ptr + b * hkv_all + hkv) / P_SCALE
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = k_ptr + b * s_kb + hkv * s_kh
        v_base = v_ptr + b * s_vb + hkv * s_vh
        hi = TK
        if CAUSAL:   # top-left aligned: query i sees keys 0..i; later blocks are all masked
            hi = tl.minimum(TK, (pid_m + 1) * BLOCK_M)
        for start in range(0, hi, BLOCK_N):
            cols = start + keys
            tile_n = (cols < TK)[:, None] & dmask[None, :]
            k = tl.load(k_base + cols[:, None] * s_kt + dims[None, :], mask=tile_n, other=0.0)   # [BLOCK_N, BLOCK_D]
            mptr = mask_ptr + b * s_mb + h * s_mh + rows[:, None] * s_mq + cols[None, :] * s_mk
            s = _masked_scores(q, k, kv_scale, rows, cols, TQ, TK, mptr, CAUSAL, MASK_KIND)   # fp32 [BLOCK_M, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with every key masked so far
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p8 = to_e4m3(p * P_SCALE)
            v = tl.load(v_base + cols[:, None] * s_vt + dims[None, :], mask=tile_n, other=0.0)   # [BLOCK_N, BLOCK_D]
            acc = acc * alpha[:, None] + tl.dot(p8, v) * v_scale
            m_i = m_new
        empty = l_i == 0.0
        o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log(l_i))
        tl.store(o_ptr + b * s_ob + h * s_oh + rows[:, None] * s_ot + dims[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
        tl.store(lse_ptr + pid_bh * TQ + rows, lse, mask=rmask)


def fp8_attention_forward_triton(
    q8: Tensor, k8: Tensor, v8: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor, *,
    sm_scale: float, causal: bool = False, mask: Optional[Tensor] = None, block_n: int = BLOCK_N,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Triton launcher with the reference's signature; CPU tensors work under TRITON_INTERPRET=1."""
    require_triton("fp8_attention_forward_triton")
    b, h, tq, d = q8.shape
    hkv, tk = k8.shape[1], k8.shape[2]
    if q8.dtype != E4M3 or k8.dtype != E4M3 or v8.dtype != E4M3:
        raise ValueError(f"q8, k8, v8 must be {E4M3}, got {q8.dtype}, {k8.dtype}, {v8.dtype}")
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    if d > 256:
        raise ValueError(f"head dim must be <= 256, got {d}")
    q8, k8, v8 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q8, k8, v8))
    o = torch.empty((b, h, tq, d), dtype=out_dtype, device=q8.device)
    lse = torch.empty((b, h, tq), dtype=torch.float32, device=q8.device)
    # without a mask the kernel never reads its pointer (MASK_KIND is a constexpr)
    mask_arg, kind, strides = mask_args(mask, b, h, tq, tk, lse)
    if b * h * tq == 0:
        return o, lse
    grid = (triton.cdiv(tq, _BLOCK_M), b * h)
    _fp8_attention_fwd_kernel[grid](
        q8, k8, v8, q_descale.contiguous(), k_descale.contiguous(), v_descale.contiguous(), mask_arg, o, lse,
        float(sm_scale), tq, tk, h, h // hkv,
        *q8.stride()[:3], *k8.stride()[:3], *v8.stride()[:3], *strides, *o.stride()[:3],
        D=d, BLOCK_D=max(32, triton.next_power_of_2(d)), BLOCK_M=_BLOCK_M, BLOCK_N=block_n,
        CAUSAL=bool(causal), MASK_KIND=kind, P_SCALE=P_SCALE, num_warps=_FWD_WARPS)
    return o, lse


def _use_kernels(q8: Tensor) -> bool:
    """Real CUDA tensors on a GPU with FP8 tensor cores (sm89+) run the Triton kernels."""
    return use_triton(q8) and torch.cuda.get_device_capability(q8.device) >= (8, 9)


def fp8_attention_forward(q8, k8, v8, q_descale, k_descale, v_descale, *, sm_scale: float, causal: bool = False,
                          mask: Optional[Tensor] = None, out_dtype: torch.dtype = torch.float32):
    """(o, lse) as ``fp8_attention_forward_reference`` computes them: the Triton kernel on sm89+ GPUs,
    the reference elsewhere."""
    impl = fp8_attention_forward_triton if _use_kernels(q8) else fp8_attention_forward_reference
    return impl(q8, k8, v8, q_descale, k_descale, v_descale, sm_scale=sm_scale, causal=causal, mask=mask,
                out_dtype=out_dtype)


# ---------------------------------------------------------------------------------------------------
# Triton backward, FlashAttention-2's split: one kernel walks the queries for each block of keys
# (dK, dV), one walks the keys for each block of queries (dQ); both recompute P from lse, so nothing
# of size [Tq, Tk] exists. D = rowsum(dO * O), the "fp8" mode's dO quantization and dS's scale are
# computed in torch before the launch (per row or per (batch, head), cheap). dK and dV are written
# per query head and summed over each key/value head's group afterwards. The high-precision mode's
# dots take fp32 operands (TF32 tensor cores on GPUs, exact fp32 in the interpreter).

if HAS_TRITON:
    @triton.jit
    def _probs(q, k, kv_scale, lse, rows, cols, TQ, TK, mptr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
        """P [BLOCK_M, BLOCK_N] = exp(S - lse) of FP8 q [BLOCK_M, D] and k [BLOCK_N, D]; 0 where masked
        and in fully masked rows (lse = -inf)."""
        s = _masked_scores(q, k, kv_scale, rows, cols, TQ, TK, mptr, CAUSAL, MASK_KIND)
        empty = lse == float("-inf")
        return tl.where(empty[:, None], 0.0, tl.exp(s - tl.where(empty, 0.0, lse)[:, None]))

    @triton.jit
    def _to_grad_fp8(x, GRAD_E4M3: tl.constexpr):
        # one return: after a return inside a constexpr if the compiler still types the code below
        # it, and two returns of different FP8 types fail to compile for a GPU (the interpreter
        # accepts them; tests/test_kernels_compile.py compiles every kernel for sm90)
        if GRAD_E4M3:
            out = to_e4m3(x)
        else:
            out = to_e5m2(x)
        return out

    @triton.jit
    def _dscores(p, do, v, vd, dod, delta, dss, FP8_GRADS: tl.constexpr, GRAD_E4M3: tl.constexpr):
        """dS [BLOCK_M, BLOCK_N] = P * (dO · Vᵀ - D) for the tile's P, dO [BLOCK_M, D] and FP8 V [BLOCK_N, D]:
        fp32 from the dequantized V, or ("fp8": dO in the gradient format, descale ``dod``) from the FP8
        operands, rounded to the gradient format with dS's scale ``dss``."""
        if FP8_GRADS:
            dp = tl.dot(do, tl.trans(v)) * (dod * vd)
            ds = _to_grad_fp8(p * (dp - delta[:, None]) * dss, GRAD_E4M3)
        else:
            dp = tl.dot(do, tl.trans(v.to(tl.float32) * vd))
            ds = p * (dp - delta[:, None])
        return ds

    @triton.jit
    def _bwd_head(pid_bh, H, GROUP, sm_scale, qd_ptr, kd_ptr, vd_ptr, dod_ptr, dss_ptr):
        """Both backward kernels' (batch, head) program: (b, h, its key/value head, q, k, v descales,
        dO's descale, dS's scale, the scores' scale (q_descale * k_descale) * sm_scale)."""
        b = pid_bh // H
        h = pid_bh % H
        hkv = h // GROUP
        hkv_all = H // GROUP
        qd = tl.load(qd_ptr + b * H + h)
        kd = tl.load(kd_ptr + b * hkv_all + hkv)
        return (b, h, hkv, qd, kd, tl.load(vd_ptr + b * hkv_all + hkv), tl.load(dod_ptr + pid_bh),
                tl.load(dss_ptr + pid_bh), qd * kd * sm_scale)

    @triton.jit
    def _query_block(q_ptr, do_ptr, do8_ptr, lse_ptr, delta_ptr, b, h, pid_bh, rows, dims, TQ, D,
                     s_qb, s_qh, s_qt, s_db, s_dh, s_dt, FP8_GRADS: tl.constexpr):
        """What the backward reads of the queries ``rows`` [BLOCK_M] of head (b, h): (FP8 q [BLOCK_M,
        BLOCK_D], lse [BLOCK_M], D [BLOCK_M], dO [BLOCK_M, BLOCK_D] in the gradient format under
        FP8_GRADS else fp32, the tile's mask). Rows past TQ read q = dO = 0, lse = -inf (so P = 0), D = 0."""
        rmask = rows < TQ
        tile = rmask[:, None] & (dims < D)[None, :]
        q = tl.load(q_ptr + b * s_qb + h * s_qh + rows[:, None] * s_qt + dims[None, :], mask=tile, other=0.0)
        lse = tl.load(lse_ptr + pid_bh * TQ + rows, mask=rmask, other=float("-inf"))
        delta = tl.load(delta_ptr + pid_bh * TQ + rows, mask=rmask, other=0.0)
        d_off = b * s_db + h * s_dh + rows[:, None] * s_dt + dims[None, :]
        if FP8_GRADS:
            do = tl.load(do8_ptr + d_off, mask=tile, other=0.0)
        else:
            do = tl.load(do_ptr + d_off, mask=tile, other=0.0).to(tl.float32)
        return q, lse, delta, do, tile

    @triton.jit
    def _key_block(k_ptr, v_ptr, b, hkv, cols, dims, TK, D, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt):
        """FP8 k and v [BLOCK_N, BLOCK_D] of the keys ``cols`` [BLOCK_N] of key/value head (b, hkv), and
        the tile's mask; keys past TK read 0."""
        tile = (cols < TK)[:, None] & (dims < D)[None, :]
        k = tl.load(k_ptr + b * s_kb + hkv * s_kh + cols[:, None] * s_kt + dims[None, :], mask=tile, other=0.0)
        v = tl.load(v_ptr + b * s_vb + hkv * s_vh + cols[:, None] * s_vt + dims[None, :], mask=tile, other=0.0)
        return k, v, tile

    @triton.jit
    def _fp8_attention_bwd_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, qd_ptr, kd_ptr, vd_ptr, mask_ptr, do_ptr, do8_ptr, dod_ptr, dss_ptr,
        lse_ptr, delta_ptr, dk_ptr, dv_ptr,
        sm_scale, TQ, TK, H, GROUP,
        s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_mb, s_mh, s_mq, s_mk, s_db, s_dh, s_dt,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, P_SCALE: tl.constexpr, FP8_GRADS: tl.constexpr,
        GRAD_E4M3: tl.constexpr,
    ):
        """Program (key block n, batch * head): dK and dV [BLOCK_N, D] of keys [n * BLOCK_N, +BLOCK_N)
        for one query head, from every block of BLOCK_M queries that sees them (written per query head,
        [B, H, Tk, D]; the launcher sums each key/value head's group)."""
        pid_bh = tl.program_id(1)
        b, h, hkv, qd, kd, vd, dod, dss, kv_scale = _bwd_head(pid_bh, H, GROUP, sm_scale, qd_ptr, kd_ptr, vd_ptr,
                                                              dod_ptr, dss_ptr)
        dims = tl.arange(0, BLOCK_D)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k, v, tile_n = _key_block(k_ptr, v_ptr, b, hkv, cols, dims, TK, D, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        lo = 0
        if CAUSAL:   # queries before this key block see none of it
            lo = (tl.program_id(0) * BLOCK_N // BLOCK_M) * BLOCK_M
        for start in range(lo, TQ, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            q, lse, delta, do, tile_m = _query_block(q_ptr, do_ptr, do8_ptr, lse_ptr, delta_ptr, b, h, pid_bh, rows,
                                                     dims, TQ, D, s_qb, s_qh, s_qt, s_db, s_dh, s_dt, FP8_GRADS)
            mptr = mask_ptr + b * s_mb + h * s_mh + rows[:, None] * s_mq + cols[None, :] * s_mk
            p = _probs(q, k, kv_scale, lse, rows, cols, TQ, TK, mptr, CAUSAL, MASK_KIND)
            ds = _dscores(p, do, v, vd, dod, delta, dss, FP8_GRADS, GRAD_E4M3)
            if FP8_GRADS:
                dv += tl.dot(tl.trans(to_e4m3(p * P_SCALE)), do)
                dk += tl.dot(tl.trans(ds), q)
            else:
                dv += tl.dot(tl.trans(p), do)
                dk += tl.dot(tl.trans(ds), q.to(tl.float32) * qd)
        if FP8_GRADS:
            dv = dv * (dod / P_SCALE)
            dk = dk * ((1.0 / dss) * qd * sm_scale)
        else:
            dk = dk * sm_scale
        out = pid_bh * TK * D + cols[:, None] * D + dims[None, :]
        tl.store(dk_ptr + out, dk, mask=tile_n)
        tl.store(dv_ptr + out, dv, mask=tile_n)

    @triton.jit
    def _fp8_attention_bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr, qd_ptr, kd_ptr, vd_ptr, mask_ptr, do_ptr, do8_ptr, dod_ptr, dss_ptr,
        lse_ptr, delta_ptr, dq_ptr,
        sm_scale, TQ, TK, H, GROUP,
        s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_mb, s_mh, s_mq, s_mk, s_db, s_dh, s_dt,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, P_SCALE: tl.constexpr, FP8_GRADS: tl.constexpr,
        GRAD_E4M3: tl.constexpr,
    ):
        """Program (query block m, batch * head): dQ [BLOCK_M, D] of queries [m * BLOCK_M, +BLOCK_M),
        from every block of BLOCK_N keys they see."""
        pid_bh = tl.program_id(1)
        b, h, hkv, qd, kd, vd, dod, dss, kv_scale = _bwd_head(pid_bh, H, GROUP, sm_scale, qd_ptr, kd_ptr, vd_ptr,
                                                              dod_ptr, dss_ptr)
        dims = tl.arange(0, BLOCK_D)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        q, lse, delta, do, tile_m = _query_block(q_ptr, do_ptr, do8_ptr, lse_ptr, delta_ptr, b, h, pid_bh, rows,
                                                 dims, TQ, D, s_qb, s_qh, s_qt, s_db, s_dh, s_dt, FP8_GRADS)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = TK
        if CAUSAL:   # keys after this query block are masked for all of it
            hi = tl.minimum(TK, (tl.program_id(0) + 1) * BLOCK_M)
        for start in range(0, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            k, v, tile_n = _key_block(k_ptr, v_ptr, b, hkv, cols, dims, TK, D, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt)
            mptr = mask_ptr + b * s_mb + h * s_mh + rows[:, None] * s_mq + cols[None, :] * s_mk
            p = _probs(q, k, kv_scale, lse, rows, cols, TQ, TK, mptr, CAUSAL, MASK_KIND)
            ds = _dscores(p, do, v, vd, dod, delta, dss, FP8_GRADS, GRAD_E4M3)
            if FP8_GRADS:
                dq += tl.dot(ds, k)
            else:
                dq += tl.dot(ds, k.to(tl.float32) * kd)
        if FP8_GRADS:
            dq = dq * ((1.0 / dss) * kd * sm_scale)
        else:
            dq = dq * sm_scale
        tl.store(dq_ptr + pid_bh * TQ * D + rows[:, None] * D + dims[None, :], dq, mask=tile_m)


def mask_args(mask, b, h, tq, tk, fallback):
    """(kernel pointer, MASK_KIND, strides [B, H, Tq, Tk]) of a mask broadcast to [B, H, Tq, Tk]."""
    if mask is None:
        return fallback, _MASK_NONE, (0, 0, 0, 0)
    kind = _MASK_BOOL if mask.dtype == torch.bool else _MASK_ADD
    arg = mask.expand(b, h, tq, tk)
    if kind == _MASK_BOOL:
        arg = arg.view(torch.uint8)
    return arg, kind, arg.stride()


def fp8_attention_backward_triton(
    do: Tensor, q8: Tensor, k8: Tensor, v8: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor,
    o: Tensor, lse: Tensor, *, sm_scale: float, causal: bool = False, mask: Optional[Tensor] = None,
    fp8_grads: bool = False, grad_dtype: torch.dtype = torch.float8_e5m2, do_scale: Optional[Tensor] = None,
    grad_scales: Optional[tuple[Tensor, Tensor]] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Triton launcher with the reference's signature; CPU tensors work under TRITON_INTERPRET=1."""
    require_triton("fp8_attention_backward_triton")
    b, h, tq, d = q8.shape
    hkv, tk = k8.shape[1], k8.shape[2]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    if grad_dtype not in (torch.float8_e5m2, E4M3):
        raise ValueError(f"grad_dtype must be float8_e5m2 or float8_e4m3fn, got {grad_dtype}")
    group = h // hkv
    q8, k8, v8 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q8, k8, v8))
    do = do.contiguous()
    # per query row: D = rowsum(dO * O); per (batch, head): dO's and dS's scales (module docstring)
    delta = (do.to(torch.float32) * o.to(torch.float32)).sum(dim=-1).contiguous()
    if fp8_grads:
        do8, do_descale, ds_scale = _fp8_grad_scales(do.to(torch.float32), v8, v_descale, group, grad_dtype,
                                                     do_scale, grad_scales)
    else:
        do8, do_descale = do, torch.ones((b, h), device=do.device)
        ds_scale = torch.ones((b, h), device=do.device)
    dq = torch.empty((b, h, tq, d), dtype=torch.float32, device=q8.device)
    dk = torch.empty((b, h, tk, d), dtype=torch.float32, device=q8.device)
    dv = torch.empty((b, h, tk, d), dtype=torch.float32, device=q8.device)
    if b * h == 0 or tq == 0 or tk == 0:
        dk.zero_(), dv.zero_(), dq.zero_()
        return dq, _per_kv_head(dk, group), _per_kv_head(dv, group)
    mask_arg, kind, m_strides = mask_args(mask, b, h, tq, tk, lse)
    args = (q8, k8, v8, q_descale.contiguous(), k_descale.contiguous(), v_descale.contiguous(), mask_arg,
            do, do8, do_descale.contiguous(), ds_scale.contiguous(), lse.contiguous(), delta)
    scalars = (float(sm_scale), tq, tk, h, group, *q8.stride()[:3], *k8.stride()[:3], *v8.stride()[:3],
               *m_strides, *do.stride()[:3])
    meta = dict(D=d, BLOCK_D=max(32, triton.next_power_of_2(d)), BLOCK_M=_BLOCK_M, BLOCK_N=BLOCK_N,
                CAUSAL=bool(causal), MASK_KIND=kind, P_SCALE=P_SCALE, FP8_GRADS=bool(fp8_grads),
                GRAD_E4M3=grad_dtype == E4M3,
                # head dims above 64 spill registers with 4 warps (sm90 ptxas at D=128: up to 1256 bytes
                # per thread in dK/dV, 552 with 8; BENCHMARKS.md, "sm90 registers, spills and shared memory",
                # static figures, not timings)
                num_warps=8 if d > 64 else 4)
    _fp8_attention_bwd_dkdv_kernel[(triton.cdiv(tk, BLOCK_N), b * h)](*args, dk, dv, *scalars, **meta)
    _fp8_attention_bwd_dq_kernel[(triton.cdiv(tq, _BLOCK_M), b * h)](*args, dq, *scalars, **meta)
    return dq, _per_kv_head(dk, group), _per_kv_head(dv, group)


def fp8_attention_backward(do, q8, k8, v8, q_descale, k_descale, v_descale, o, lse, *, sm_scale: float,
                           causal: bool = False, mask: Optional[Tensor] = None, fp8_grads: bool = False,
                           grad_dtype: torch.dtype = torch.float8_e5m2, do_scale: Optional[Tensor] = None,
                           grad_scales: Optional[tuple[Tensor, Tensor]] = None):
    """(dq, dk, dv) as ``fp8_attention_backward_reference`` computes them: the Triton kernels on sm89+
    GPUs, the reference elsewhere."""
    impl = fp8_attention_backward_triton if _use_kernels(q8) else fp8_attention_backward_reference
    return impl(do, q8, k8, v8, q_descale, k_descale, v_descale, o, lse, sm_scale=sm_scale, causal=causal,
                mask=mask, fp8_grads=fp8_grads, grad_dtype=grad_dtype, do_scale=do_scale, grad_scales=grad_scales)
