"""Per-tensor FP8 GEMMs: torch._scaled_mm on CUDA (exact emulation where the device has no FP8 GEMM),
and the three GEMMs of a per-tensor linear around it.

``fp8_gemm`` is one scaled GEMM. ``fp8_fprop`` and ``fp8_dgrad_wgrad`` are a linear's (HYBRID: E4M3
forward tensors, E5M2 gradients; all E4M3 for the E4M3 format), each quantizing the operand it owns
(the weight in fprop, the gradient in backward) with te_compile.scaling's ``quantize_per_tensor``;
the per-tensor linear (lowerings/linear.py) and the fused lowerings (norm, activation, attention
projection, output layer) call them with an FP8 input they made themselves:

- fprop  y  = x  @ w.T   : x  [M, K] E4M3 (row-major),  w  [N, K] E4M3 (as column-major [K, N])
- dgrad  dx = g  @ w     : g  [M, N] E5M2 (row-major),  w  [N, K] E4M3 (as column-major)
- wgrad  dw = g.T @ x    : g.T [N, M] E5M2 (row-major), x  [M, K] E4M3 (as column-major)

On CPU, torch._scaled_mm is itself an emulation: it upcasts both operands to fp32 with scalar eager
loops (slow: ~1.8 ns per element here, as long as the matmul itself at the demo's shapes), then
runs an fp32 matmul. The same arithmetic written as torch ops, ``(a.float() * sa) @ (b.float() * sb)``,
lets inductor vectorize the upcast and fuse it with its neighbours, and gives the same bits. A
one-time check per process (``cpu_emulates_scaled_mm``) confirms the equality on this machine's
kernels before the emulation replaces _scaled_mm; if the bits ever differ, _scaled_mm stays.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes
from torch._prims_common import is_contiguous_or_false
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..hardware import is_fp8_available
from .operands import weight_is_operand
from ..scaling import quantize_per_tensor, tensor_amax
from ..tensor.quantized_tensor import QuantizedTensor

__all__ = ["fp8_gemm", "scaled_mm", "adds_bias", "split_bias", "add_bias", "fp8_fprop", "fp8_dgrad_wgrad",
           "quantize_weight", "column_major", "operand_a", "operand_b", "emulates_fp8_gemm", "uses_native_fp8_gemm", "cpu_emulates_scaled_mm",
           "fp8_gemm_kind", "CUDA_ALIGN"]

log = logging.getLogger(__name__)

# cuBLASLt FP8 GEMMs need the contraction dim and the output columns in multiples of 16.
CUDA_ALIGN = 16


def uses_native_fp8_gemm(device: torch.device) -> bool:
    """True where torch._scaled_mm runs per-tensor FP8 (CPU, CUDA sm89+)."""
    return bool(is_fp8_available(device=device))


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` [R, C] laid out row-major, also in inductor's output: it drops a bare ``contiguous()``
    before a pointwise op and keeps the input's layout, and a BLAS matmul can round differently for
    a transposed operand (seen at 8x256x8). A ``t`` already row-major (the upcast of a row-major
    operand: inductor lays a pointwise result out as its input) is returned as it is, no node."""
    if is_contiguous_or_false(t):
        return t
    force = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    if force is None:
        return t.contiguous()
    return force.default(t, (t.shape[1], 1))


def column_major(t: torch.Tensor, shared: bool = False) -> torch.Tensor:
    """Same values, column-major layout: the b operand of _scaled_mm.

    ``shared``: several GEMMs read the copy (every loss chunk's dgrad reads the output layer's
    weight). Its layout is then forced, and inductor writes it once as a buffer of its own that they
    share; a plain transpose-copy is inlined into a copy per reading GEMM (16 copies of a [V, K] FP8
    weight). Not forced for one reader: a forced copy is a node of its own to the partitioner, which
    then saves other tensors around it (under fp8_mha it kept a second per-head FP8 copy of
    attention's output)."""
    out = t.t().contiguous().t()
    force = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    if not shared or force is None:
        return out
    return force.default(out, (1, t.shape[0]))


def emulates_fp8_gemm(device: torch.device) -> bool:
    """Does ``fp8_gemm`` on ``device`` run as its fp32 emulation rather than torch._scaled_mm (the CPU,
    where the emulation gives _scaled_mm's bits; a GPU without FP8 GEMMs)?"""
    device = torch.device(device)
    return not uses_native_fp8_gemm(device) or (device.type == "cpu" and cpu_emulates_scaled_mm())


def operand_a(t: torch.Tensor) -> torch.Tensor:
    """``fp8_gemm``'s a operand from ``t`` [M, K] in any layout: row-major for torch._scaled_mm, ``t``
    as it is for the emulation, which lays its fp32 upcast out row-major itself (a copy first would
    be one more node to trace at every compile, and on the CPU a copy undone at once)."""
    return t if emulates_fp8_gemm(t.device) else t.contiguous()


def operand_b(t: torch.Tensor, shared: bool = False) -> torch.Tensor:
    """``fp8_gemm``'s b operand from ``t`` [K, N] in any layout: ``column_major(t, shared)`` for
    torch._scaled_mm, ``t`` as it is for the emulation (see ``operand_a``): dgrad's weight operand,
    the forward's row-major FP8 copy, then needs no copy on the CPU at all. Where a copy (or its
    absence) would change what the partitioner saves for backward, callers keep ``column_major``
    so that the CPU saves what a GPU saves."""
    return t if emulates_fp8_gemm(t.device) else column_major(t, shared)


def _emulated(a, b, sa, sb, out_dtype, bias=None) -> torch.Tensor:
    """(a * sa) @ (b * sb) (+ bias) in fp32, then ``out_dtype``: CPU _scaled_mm's operations (its
    fallback without AMX makes both operands row-major first, so the fp32 matmul sees the same layouts).
    Autocast is off around it: a backward that AOTAutograd traces under the caller's autocast would
    otherwise run the matmul on bf16 copies of the fp32 operands, which torch._scaled_mm never does."""
    with torch.autocast(a.device.type, enabled=False):
        a32 = _row_major(a.to(torch.float32) * sa)
        b32 = _row_major(b.to(torch.float32) * sb)
        y = a32 @ b32
        return (y if bias is None else y + bias.to(torch.float32)).to(out_dtype)


def adds_bias(bias: Optional[torch.Tensor], out_dtype: torch.dtype, n: int) -> bool:
    """Whether ``fp8_gemm`` takes ``bias`` into its epilogue for an ``out_dtype`` output [M, ``n``]: a
    bias of shape [n] in that dtype, bf16 or fp16 (torch._scaled_mm's bias rule on CUDA; an addend
    that only broadcasts, such as addmm's [1], is added after). The GEMM then adds it in fp32
    before its one rounding, and no kernel reads and writes the [M, N] output again to add it (0.2 GB
    at a 4096-token qkv projection in bf16). An fp32 output keeps the separate add, on the CPU too,
    so that both round the same way."""
    return (bias is not None and tuple(bias.shape) == (n,) and bias.dtype == out_dtype
            and out_dtype in (torch.bfloat16, torch.float16))


def split_bias(bias: Optional[torch.Tensor], out_dtype: torch.dtype, n: int,
               epilogue: bool = True) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``bias`` as (the GEMM epilogue's bias, the bias added after the GEMM): at most one is not None.
    The epilogue takes it where ``adds_bias`` allows and the caller's GEMM has an epilogue
    (``epilogue``); every lowering splits a bias this way, so a fused site and the plain linear it
    replaces round the same way."""
    if epilogue and adds_bias(bias, out_dtype, n):
        return bias, None
    return None, bias


def add_bias(y: torch.Tensor, after: Optional[torch.Tensor]) -> torch.Tensor:
    """y + the bias ``split_bias`` left for after the GEMM (y itself where there is none)."""
    return y if after is None else y + after


@torch._dynamo.disable
def cpu_emulates_scaled_mm() -> bool:
    """Does the torch-op emulation give CPU torch._scaled_mm's bits on this machine? Checked once per
    process on operand pairs of both FP8 formats, non-power-of-two scales, fp32 and bf16 outputs, and
    shapes with odd M, K, N; on real tensors even when first asked while a graph is being traced."""
    with _disable_current_modes():
        return _check_cpu_emulation()


@functools.lru_cache(maxsize=None)
def _check_cpu_emulation() -> bool:
    gen = torch.Generator().manual_seed(0)
    cases = ((torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32, (37, 64, 48), False),
             (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32, (8, 256, 8), False),
             (torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16, (64, 96, 33), False),
             (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, (40, 96, 48), True),
             (torch.float8_e5m2, torch.float8_e4m3fn, torch.float32, (48, 129, 80), False))
    try:
        for a_dtype, b_dtype, out_dtype, (m, k, n), with_bias in cases:
            a = (torch.randn(m, k, generator=gen) * 16).to(a_dtype)
            b = (torch.randn(n, k, generator=gen) * 16).to(b_dtype).t()
            sa, sb = torch.rand((), generator=gen) + 0.1, torch.rand((), generator=gen) * 3 + 0.1
            bias = (torch.randn(n, generator=gen) * 5).to(out_dtype) if with_bias else None
            native = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)
            if not torch.equal(native, _emulated(a, b, sa, sb, out_dtype, bias)):
                log.info("te_compile: CPU torch._scaled_mm differs from its torch-op emulation here; keeping it")
                return False
    except (RuntimeError, NotImplementedError) as err:   # no CPU _scaled_mm in this build
        log.info("te_compile: CPU torch._scaled_mm unavailable (%s); FP8 GEMMs emulated", err)
        return True
    return True


def fp8_gemm_kind(device: torch.device) -> str:
    """How per-tensor FP8 GEMMs run on ``device``, for the report."""
    device = torch.device(device)
    if device.type == "cpu" and cpu_emulates_scaled_mm():
        return "FP8 GEMMs (CPU: fp32 matmul of the FP8 values, torch._scaled_mm's bits)"
    if not uses_native_fp8_gemm(device):
        return "FP8 GEMMs (emulated: no FP8 GEMM on this device)"
    return "FP8 GEMMs (torch._scaled_mm)"


def _canonical_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous [R, C]) with the strides (C, 1) literally.

    torch calls a tensor with a size-1 dim contiguous whatever that dim's stride, so ``.contiguous()``
    keeps e.g. stride (1, 16) for a [16, 1] transpose of one token's gradient; inductor's _scaled_mm
    lowering checks ``stride[-1] == 1`` as written and refuses it. A view with the canonical strides
    reads the same elements.
    """
    if any(statically_known_true(d == 1) for d in t.shape):
        return t.as_strided(t.shape, (t.shape[1], 1))
    return t


def fp8_gemm(
    a: torch.Tensor,          # fp8 [M, K], row-major (``operand_a``)
    b: torch.Tensor,          # fp8 [K, N], column-major (``operand_b``; the transpose of a row-major [N, K])
    a_scale_inv: torch.Tensor,  # fp32 [1]
    b_scale_inv: torch.Tensor,  # fp32 [1]
    out_dtype: torch.dtype,
    fast_accum: bool = False,
    bias: Optional[torch.Tensor] = None,   # [N] in out_dtype, where ``adds_bias`` allows it
) -> torch.Tensor:
    """(a * a_scale_inv) @ (b * b_scale_inv) (+ bias) with fp32 accumulation, as ``out_dtype`` [M, N];
    ``fast_accum``: torch._scaled_mm's ``use_fast_accum`` on CUDA (the emulation accumulates in fp32).

    Inductor's _scaled_mm lowering needs exactly these layouts (a row-major, b column-major), on CPU
    too, so callers must produce them (``operand_a``, ``operand_b``, which leave them to the emulation
    where it runs); eager would accept any layout and hide the mistake.
    """
    if emulates_fp8_gemm(a.device):
        # the [1] scales broadcast as they are: no reshape nodes (3 GEMMs a site, each node is
        # traced, partitioned and lowered at every compile)
        return _emulated(a, b, a_scale_inv, b_scale_inv, out_dtype, bias)   # the module docstring says why on CPU
    return scaled_mm(a, b, a_scale_inv, b_scale_inv, out_dtype, fast_accum, bias)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool = False, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fp8_gemm`` as ``torch._scaled_mm`` always, the CPU included: the op inductor's micro-pipeline
    TP pass looks for (async tensor parallelism, lowerings/linear_paths/async_tp.py)."""
    sa = a_scale_inv.reshape(())
    sb = b_scale_inv.reshape(())
    a, b = _canonical_strides(a), _canonical_strides(b.t()).t()
    if a.device.type == "cuda":
        # Zero rows/columns along K change nothing; pad K (e.g. the token count in wgrad) to 16.
        k = a.shape[1]
        pad = (-k) % CUDA_ALIGN
        if pad:
            a = F.pad(a.view(torch.uint8), (0, pad)).view(a.dtype)
            b = F.pad(b.t().view(torch.uint8), (0, pad)).view(b.dtype).t()
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum)


# ---- a per-tensor linear's GEMMs --------------------------------------------------------------------


def quantize_weight(w_nk, recipe, scale=None, amax=None, scale_inv=None):
    """(fp8 data [N, K], scale_inv [1], amax [1]) of the weight operand.

    A weight that arrives as a Float8Tensor in the recipe's weight format (FSDP2's FP8 all-gather,
    te_compile/fsdp.py; FP8 primary weights, te_compile/primary_weights.py) is used as it is: its
    bytes and scale, no second quantization. Under delayed scaling its amax still goes into the
    history: the one it carries (``_amax``, the amax of the values it was quantized from) or else the
    one its bytes show; its own scale_inv stands (a ``scale_inv`` passed goes unused). Any other
    weight is quantized like every operand (``quantize_per_tensor``; ``scale_inv``: 1 / scale when the
    caller has it).
    """
    if weight_is_operand(w_nk, recipe):
        data = w_nk._data.view(w_nk._fp8_dtype)
        scale_inv = w_nk._scale_inv
        if amax is None and w_nk._amax is not None:
            amax = w_nk._amax
        elif amax is None:
            amax = tensor_amax(data.to(torch.float32)) * scale_inv if scale is not None else torch.zeros_like(scale_inv)
        return data, scale_inv, amax
    if isinstance(w_nk, QuantizedTensor):   # another format: its values, quantized again
        w_nk = w_nk.dequantize()
    return quantize_per_tensor(w_nk, "weight", recipe, scale, amax, scale_inv=scale_inv)


def fp8_fprop(xq, x_sinv, w_nk, recipe, w_scale=None, w_amax=None, *, out_dtype, w_sinv=None, bias=None):
    """The forward GEMM of a per-tensor site, its FP8 input made by the caller (from x, a norm, an
    activation or an attention output): y [M, N] = xq [M, K] @ quantize(w_nk [N, K]).T (+ bias [N],
    in the GEMM's epilogue: the caller checked ``adds_bias``).

    Returns (y, wq [N, K] contiguous: saved for dgrad, w's scale_inv [1], w's amax [1]). w_scale /
    w_amax / w_sinv: see ``quantize_weight``."""
    wq, w_sinv, w_amax = quantize_weight(w_nk, recipe, w_scale, w_amax, w_sinv)
    wq = wq.contiguous()
    y = fp8_gemm(operand_a(xq), wq.t(), x_sinv, w_sinv, out_dtype=out_dtype,
                 fast_accum=recipe.fast_accumulation("fprop"), bias=bias)
    return y, wq, w_sinv, w_amax


def fp8_dgrad_wgrad(grad_y, recipe, wq, w_sinv, x_sinv, x_colmajor, *, dx_dtype, dw_dtype, g_scale=None,
                    g_amax=None):
    """The backward GEMMs of a per-tensor site from its saved FP8 operands; grad_y [M, N] is quantized
    here (E5M2 under HYBRID) with ``g_scale`` (delayed scaling) or its own amax (``g_amax`` when the
    caller all-reduced it).

    dgrad dx [M, K] = gq @ wq in ``dx_dtype`` (None: not needed); wgrad dw [N, K] = gq.T @ xq in
    ``dw_dtype``, where ``x_colmajor()`` gives the forward's FP8 input [M, K] column-major (saved,
    saved transposed or recomputed: the caller's choice; None: no wgrad). Returns (dx, dw, g_amax [1]).
    """
    gq, g_sinv, g_amax = quantize_per_tensor(grad_y, "grad_output", recipe, g_scale, g_amax)
    gq = gq.contiguous()
    dx = None if dx_dtype is None else fp8_gemm(gq, operand_b(wq), g_sinv, w_sinv, out_dtype=dx_dtype)
    dw = None
    if x_colmajor is not None:
        dw = fp8_gemm(operand_a(gq.t()), x_colmajor(), g_sinv, x_sinv, out_dtype=dw_dtype)
    return dx, dw, g_amax
