"""Per-tensor FP8 cast with its transpose and amax, in one read of x.

An FP8 linear needs each operand twice: rowwise for one GEMM and transposed for another (x: fprop
and wgrad; grad_output: dgrad and wgrad), plus the operand's amax for the scaling state. Traced as
torch ops, inductor reads x once per copy and once more for the amax. Under delayed scaling the
scale is known before x is (it comes from earlier steps), so one pass can do all three:

    data   = e4m3/e5m2(clamp(x * scale))      [M, K], the bytes of ``cast_to_fp8``
    data_t = data.T, contiguous               [K, M]
    amax   = max |x|                          [1], NaN if x has one (torch.amax's rule)

Three functions with one signature, as for the other quantize kernels: ``fp8_cast_transpose_reference``
(plain torch), ``fp8_cast_transpose_triton`` (the launcher of ``_fp8_cast_transpose_kernel``; CPU
tensors run under ``TRITON_INTERPRET=1``) and ``fp8_cast_transpose`` (the kernel for CUDA tensors when
Triton is present, registered with ``torch.library.triton_op`` so that inductor schedules it inside
compiled graphs; the reference elsewhere). Each program casts one [BLOCK_M, BLOCK_K] tile, stores it
and its transpose, and writes the tile's max |x| to a [grid_m, grid_k] buffer that one small
reduction turns into the amax: no atomics, so the result does not depend on the order of programs.
The casts go through ``_fp_bits.fp32_to_fp8_bits`` (exact in the interpreter too), so kernel and
reference agree bit for bit, NaN bytes aside (0x7F with x's sign in the kernel; torch's NaN byte
may differ in sign).

An experiment (experiments/README.md): the linear lowerings do not call it until a GPU measurement
(the lease kit's kernels part, ``benchmarks/bench_quantize.py``) shows it beats inductor's generated
kernels.
"""

from __future__ import annotations

import torch

from te_compile.kernels._fp_bits import HAS_TRITON
from te_compile.kernels._launch import check_input, launch_row_tiles, require_triton
from te_compile.scaling import cast_to_fp8, tensor_amax

__all__ = ["fp8_cast_transpose", "fp8_cast_transpose_reference", "fp8_cast_transpose_triton"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# 64 x 64 tiles: a transposed store of 64-byte rows per tile; large enough that the interpreter
# (cost per program) stays quick in tests
_BLOCK_M = 64
_BLOCK_K = 64


def _check_args(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> None:
    check_input(x)
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        desc = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"scale must be a one-element tensor, got {desc}")
    if fp8_dtype not in _FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {_FP8_DTYPES}, got {fp8_dtype}")


def fp8_cast_transpose_reference(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K], scale [1] fp32 -> (data uint8 [M, K], data_t uint8 [K, M], amax fp32 [1])."""
    _check_args(x, scale, fp8_dtype)
    data = cast_to_fp8(x, scale.reshape(1), fp8_dtype).view(torch.uint8)
    return data, data.t().contiguous(), tensor_amax(x)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from te_compile.kernels._fp_bits import fp32_to_fp8_bits, nan_abs_max

    @triton.jit
    def _fp8_cast_transpose_kernel(
        x_ptr,  # [M, K] fp32 / bf16 / fp16, row stride stride_xm, unit column stride
        data_ptr,  # [M, K] uint8 out: fp8 bytes of x * scale, contiguous
        data_t_ptr,  # [K, M] uint8 out: the same bytes transposed, contiguous
        partial_ptr,  # [grid_m, grid_k] fp32 out: each tile's max |x|, NaN if the tile holds one
        M,  # rows of x
        K,  # columns of x
        stride_xm,  # elements between rows of x
        scale_ptr,  # [1] fp32: the scale
        IS_E4M3: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # int64: row * stride and column * M reach past 2^31 for large operands
        pid_m = tl.program_id(0).to(tl.int64)
        pid_k = tl.program_id(1).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask = (rows[:, None] < M) & (cols[None, :] < K)  # [BLOCK_M, BLOCK_K]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr)
        q = fp32_to_fp8_bits(x * scale, IS_E4M3).to(tl.uint8)  # [BLOCK_M, BLOCK_K]
        tl.store(data_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
        # the transposed tile, stored along M (consecutive rows of x are consecutive bytes of data_t)
        tl.store(data_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(q), mask=tl.trans(mask))
        tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_k, nan_abs_max(x, mask))


def _launch(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, kernel):
    """The launch behind the launcher and the op: ``kernel`` is the jit function, or its
    ``wrap_triton`` inside the op (so inductor sees the kernel)."""
    m, k = x.shape
    grid = (max(1, -(-m // _BLOCK_M)), max(1, -(-k // _BLOCK_K)))
    data, data_t, partial = launch_row_tiles(
        kernel,
        x,
        [((m, k), torch.uint8),   # data
         ((k, m), torch.uint8),   # data_t
         (grid, torch.float32)],  # per-tile max |x|
        [scale.detach().to(torch.float32).reshape(1).contiguous()],
        block_m=_BLOCK_M,
        block_k=_BLOCK_K,
        # 8 warps: with 4, sm90 ptxas gives a 64x64 tile 254 registers per thread (one block per SM
        # for a bandwidth-bound kernel); with 8, 124-150 (BENCHMARKS.md, "sm90 registers, spills and
        # shared memory", static figures)
        num_warps=8,
        IS_E4M3=fp8_dtype == torch.float8_e4m3fn,
    )
    # empty x: no launch, and the amax of nothing is 0 (tensor_amax's rule)
    amax = partial.amax().reshape(1) if m and k else torch.zeros(1, dtype=torch.float32, device=x.device)
    return data, data_t, amax


def fp8_cast_transpose_triton(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch ``_fp8_cast_transpose_kernel``; same contract as the reference."""
    require_triton("fp8_cast_transpose_triton")
    _check_args(x, scale, fp8_dtype)
    return _launch(x, scale, fp8_dtype, _fp8_cast_transpose_kernel)


if HAS_TRITON:
    @torch.library.triton_op("te_compile::fp8_cast_transpose", mutates_args=())
    def _fp8_cast_transpose_op(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launch(x, scale, fp8_dtype, torch.library.wrap_triton(_fp8_cast_transpose_kernel))


def fp8_cast_transpose(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data uint8 [M, K], data_t uint8 [K, M], amax [1]) of x [M, K] for ``scale``: the Triton kernel
    for CUDA tensors (through its op, so compiled graphs schedule it), the reference elsewhere."""
    _check_args(x, scale, fp8_dtype)
    if HAS_TRITON and x.is_cuda:
        return torch.ops.te_compile.fp8_cast_transpose(x, scale, fp8_dtype)
    return fp8_cast_transpose_reference(x, scale, fp8_dtype)
