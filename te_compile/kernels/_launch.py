"""The launch sequence shared by the row-tiled quantize kernels (MXFP8, Float8 block, NVFP4).

Each launcher calls ``require_triton`` (its kernel only exists when triton is installed), validates
its arguments (x with ``check_input``, the rest itself; CONVENTIONS.md item 3: the messages state the
observed value) and hands the rest to ``launch_row_tiles``: flatten to 2-D -> allocate -> grid ->
launch -> restore shape. The kernels it launches share one calling convention:

    kernel[grid](x_ptr, *output_ptrs, M, K, stride_xm, *extra_args,
                 BLOCK_M=block_m, BLOCK_K=block_k, **constexprs, num_warps=num_warps)

over the grid (ceil(M / BLOCK_M), ceil(K / BLOCK_K)): program (i, j) covers rows
[i * BLOCK_M, +BLOCK_M) and columns [j * BLOCK_K, +BLOCK_K) of x, and writes the outputs that
belong to that tile. Passing BLOCK_M / BLOCK_K from the same numbers as the grid keeps the two in step.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ._fp_bits import HAS_TRITON

__all__ = ["INPUT_DTYPES", "check_input", "launch_row_tiles", "require_triton"]

# What the quantize kernels read as x: they load it and widen it to fp32.
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def require_triton(name: str) -> None:
    """Raise a RuntimeError naming the launcher ``name`` when triton is not installed."""
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs triton, which is not installed")


def check_input(x: torch.Tensor, dtypes: Sequence[torch.dtype] = INPUT_DTYPES) -> None:
    """Raise a ValueError stating what x is unless it is a 2-D tensor [M, K] of one of ``dtypes``
    (floating-point types), as the quantize launchers and their references take it."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise ValueError(f"x.dtype must be one of the floating-point types {list(dtypes)}, got {x.dtype}")


def launch_row_tiles(
    kernel: Any,
    x: torch.Tensor,
    outputs: Sequence[tuple[tuple[int, ...], torch.dtype]],
    extra_args: Sequence[Any] = (),
    *,
    block_m: int,
    block_k: int,
    num_warps: int = 4,
    **constexprs: Any,
) -> tuple[torch.Tensor, ...]:
    """Launch ``kernel`` over the [block_m, block_k] tiles of x and return its outputs.

    kernel: a ``@triton.jit`` kernel with the calling convention of the module docstring.
    x: [M, K], already validated by the caller (2-D, a supported dtype).
    outputs: (shape, dtype) of each output, allocated contiguous on x's device in that shape.
    extra_args: the kernel's runtime arguments after ``stride_xm`` (pointers, sizes, scalars).
    constexprs: the kernel's other compile-time arguments, UPPER_CASE.

    Outputs with no elements to write (M == 0 or K == 0) come back without a launch. Works on CPU
    tensors under ``TRITON_INTERPRET=1`` (the kernel tests run it that way).
    """
    # flatten to 2-D: x is [M, K] by the callers' contract, so this only gives the rows a unit
    # column stride (the kernels address x as row * stride_xm + column)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    # allocate: each output in its final shape, so there is no shape to restore after the launch
    outs = tuple(torch.empty(shape, dtype=dtype, device=x.device) for shape, dtype in outputs)
    if m == 0 or k == 0:
        return outs
    grid = (-(-m // block_m), -(-k // block_k))
    kernel[grid](
        x,
        *outs,
        m,
        k,
        x.stride(0),
        *extra_args,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        num_warps=num_warps,
        **constexprs,
    )
    return outs
