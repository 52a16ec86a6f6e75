"""Per-tensor FP8 GEMM whose epilogue records the amax of its output and can write it in FP8.

A quantize-GEMM-amax fusion. After ``y = a @ b`` an FP8 training step reads y again for its amax
(the next site's scaling state, or its current scale) and once more to quantize it for the next FP8
GEMM. Under delayed scaling the next site's scale is known before the GEMM runs (it comes from
earlier steps), so the GEMM's epilogue can do both while the tile is still in registers:

    y    = (a @ b) * (a_scale_inv * b_scale_inv)     fp32 accumulation, rounded to ``out_dtype``
    amax = max |y|                                   [1] fp32, NaN if y has one
    out  = y                                         [M, N] out_dtype             (out_scale None)
         | e4m3/e5m2(clamp(y * out_scale))            [M, N] uint8 FP8 bytes       (out_scale given)

a: FP8 [M, K]; b: FP8 [K, N], any strides (the linears pass the transpose of a row-major [N, K]);
the scales are fp32 [1]. ``out`` in FP8 has the bits of ``cast_to_fp8(y, out_scale)``, the unfused path.

Three functions with one signature: ``fp8_gemm_amax_reference`` (plain torch: fp32 matmul of the FP8
values, then the epilogue's operations in the same order), ``fp8_gemm_amax_triton`` (the launcher;
CPU tensors run under ``TRITON_INTERPRET=1``) and ``fp8_gemm_amax`` (the kernel for CUDA tensors,
through ``torch.library.triton_op`` so inductor schedules it; the reference elsewhere). Kernel and
reference sum the products in different orders, so they agree to fp32 rounding in general, and bit for
bit where the sums are exact (tests/test_experiment_fp8_gemm.py builds such operands); the amax and
the FP8 bytes always equal those of the kernel's own y.

An experiment (experiments/README.md): the lowerings do not call it until a GPU measurement (the
lease kit's kernels part, ``benchmarks/bench_quantize.py``) shows it beats torch._scaled_mm (cuBLASLt)
plus inductor's amax and cast kernels. The amax partials are per tile, reduced once after the launch:
no atomics, so the result does not depend on the order of programs.
"""

from __future__ import annotations

from typing import Optional

import torch

from te_compile.kernels._fp_bits import HAS_TRITON
from te_compile.kernels._launch import require_triton
from te_compile.scaling import cast_to_fp8, tensor_amax

__all__ = ["fp8_gemm_amax", "fp8_gemm_amax_reference", "fp8_gemm_amax_triton"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # the kernel's OUT_KIND is the index
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): Hopper-sized tiles on the GPU (FP8 wgmma wants
# BLOCK_K >= 32), small ones in the interpreter, whose cost is per program and per element
_CUDA_TILES = (128, 128, 64, 8, 3)
_INTERPRETER_TILES = (32, 32, 32, 4, 1)


def _check_args(a, b, a_scale_inv, b_scale_inv, out_dtype, out_scale, out_fp8_dtype) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in _FP8_DTYPES:
            desc = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 2-D float8_e4m3fn / float8_e5m2 tensor, got {desc}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a [M, K] and b [K, N] disagree on K: {tuple(a.shape)} and {tuple(b.shape)}")
    for name, t in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv), ("out_scale", out_scale)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.numel() != 1):
            raise ValueError(f"{name} must be a one-element tensor, got {t!r}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if (out_scale is None) != (out_fp8_dtype is None):
        raise ValueError("out_scale and out_fp8_dtype go together: both for an FP8 output, neither for out_dtype")
    if out_fp8_dtype is not None and out_fp8_dtype not in _FP8_DTYPES:
        raise ValueError(f"out_fp8_dtype must be one of {_FP8_DTYPES}, got {out_fp8_dtype}")


def fp8_gemm_amax_reference(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                            out_dtype: torch.dtype, out_scale: Optional[torch.Tensor] = None,
                            out_fp8_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [M, N] out_dtype or uint8 FP8 bytes, amax fp32 [1] of y in out_dtype); see the module docstring."""
    _check_args(a, b, a_scale_inv, b_scale_inv, out_dtype, out_scale, out_fp8_dtype)
    acc = a.to(torch.float32) @ b.to(torch.float32)
    s = a_scale_inv.to(torch.float32).reshape(()) * b_scale_inv.to(torch.float32).reshape(())
    y = (acc * s).to(out_dtype)
    amax = tensor_amax(y)
    if out_scale is None:
        return y, amax
    return cast_to_fp8(y, out_scale.reshape(1), out_fp8_dtype).view(torch.uint8), amax


if HAS_TRITON:
    import triton
    import triton.language as tl

    from te_compile.kernels._fp_bits import fp32_to_fp8_bits, nan_abs_max, round_fp32_to

    @triton.jit
    def _fp8_gemm_amax_kernel(
        a_ptr,  # [M, K] fp8, strides (stride_am, stride_ak)
        b_ptr,  # [K, N] fp8, strides (stride_bk, stride_bn)
        out_ptr,  # [M, N] out: out_dtype, or uint8 FP8 bytes when FP8_OUT; contiguous
        partial_ptr,  # [grid_m, grid_n] fp32 out: each tile's max |y|, NaN if the tile holds one
        a_scale_inv_ptr,  # [1] fp32
        b_scale_inv_ptr,  # [1] fp32
        out_scale_ptr,  # [1] fp32: the FP8 output's scale (read only when FP8_OUT)
        M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn,
        OUT_KIND: tl.constexpr,  # y's dtype: 0 float32, 1 bfloat16, 2 float16
        FP8_OUT: tl.constexpr,
        OUT_E4M3: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :] * stride_ak,
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + kk[:, None] * stride_bk + cols[None, :] * stride_bn,
                        mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
        s = tl.load(a_scale_inv_ptr) * tl.load(b_scale_inv_ptr)
        y32 = round_fp32_to(acc * s, OUT_KIND)   # y's value, rounded to out_dtype (RNE)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_n, nan_abs_max(y32, mask))
        offsets = rows[:, None] * N + cols[None, :]
        if FP8_OUT:
            q = fp32_to_fp8_bits(y32 * tl.load(out_scale_ptr), OUT_E4M3).to(tl.uint8)
            tl.store(out_ptr + offsets, q, mask=mask)
        else:   # y32 holds a value of out_dtype: the store's conversion is exact
            tl.store(out_ptr + offsets, y32.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(a, b, a_scale_inv, b_scale_inv, out_dtype, out_scale, out_fp8_dtype, kernel):
    """The launch behind the launcher and the op: ``kernel`` is the jit function, or its
    ``wrap_triton`` inside the op (so inductor sees the kernel)."""
    m, k = a.shape
    n = b.shape[1]
    block_m, block_n, block_k, num_warps, num_stages = _CUDA_TILES if a.is_cuda else _INTERPRETER_TILES
    fp8_out = out_scale is not None
    out = torch.empty((m, n), dtype=torch.uint8 if fp8_out else out_dtype, device=a.device)
    if m == 0 or n == 0:   # nothing to write, and the amax of nothing is 0 (tensor_amax's rule)
        return out, torch.zeros(1, dtype=torch.float32, device=a.device)
    if k == 0:             # no products: y is all zeros (a launch would skip its K loop, but keep it simple)
        return fp8_gemm_amax_reference(a, b, a_scale_inv, b_scale_inv, out_dtype, out_scale, out_fp8_dtype)
    grid = (-(-m // block_m), -(-n // block_n))
    partial = torch.empty(grid, dtype=torch.float32, device=a.device)   # each tile's max |y|
    f32 = [t.detach().to(torch.float32).reshape(1).contiguous() for t in (a_scale_inv, b_scale_inv)]
    out_scale_t = f32[0] if out_scale is None else out_scale.detach().to(torch.float32).reshape(1).contiguous()
    kernel[grid](
        a, b, out, partial, f32[0], f32[1], out_scale_t, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        OUT_KIND=_OUT_DTYPES.index(out_dtype), FP8_OUT=fp8_out, OUT_E4M3=out_fp8_dtype == torch.float8_e4m3fn,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return out, partial.amax().reshape(1)


def fp8_gemm_amax_triton(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                         out_dtype: torch.dtype, out_scale: Optional[torch.Tensor] = None,
                         out_fp8_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``_fp8_gemm_amax_kernel``; same contract as the reference."""
    require_triton("fp8_gemm_amax_triton")
    _check_args(a, b, a_scale_inv, b_scale_inv, out_dtype, out_scale, out_fp8_dtype)
    return _launch(a, b, a_scale_inv, b_scale_inv, out_dtype, out_scale, out_fp8_dtype, _fp8_gemm_amax_kernel)


if HAS_TRITON:
    @torch.library.triton_op("te_compile::fp8_gemm_amax", mutates_args=())
    def _fp8_gemm_amax_op(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                          out_dtype: torch.dtype, out_scale: Optional[torch.Tensor] = None,
                          out_fp8_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch(a, b, a_scale_inv, b_scale_inv, out_dtype, out_scale, out_fp8_dtype,
                       torch.library.wrap_triton(_fp8_gemm_amax_kernel))


def fp8_gemm_amax(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                  out_dtype: torch.dtype, out_scale: Optional[torch.Tensor] = None,
                  out_fp8_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, amax) of the module docstring: the Triton kernel for CUDA tensors (through its op, so
    compiled graphs schedule it), the reference elsewhere."""
    _check_args(a, b, a_scale_inv, b_scale_inv, out_dtype, out_scale, out_fp8_dtype)
    if HAS_TRITON and a.is_cuda:
        return torch.ops.te_compile.fp8_gemm_amax(a, b, a_scale_inv, b_scale_inv, out_dtype, out_scale, out_fp8_dtype)
    return fp8_gemm_amax_reference(a, b, a_scale_inv, b_scale_inv, out_dtype, out_scale, out_fp8_dtype)
