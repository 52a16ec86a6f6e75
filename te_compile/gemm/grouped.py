"""Grouped FP8 GEMMs: one GEMM per expert over tokens sorted by expert, as ``torch._grouped_mm`` reads
them (``offs``: int32 [E], the running end of each expert's rows), with per-expert scales.

The forms, named as torch names them (E experts, M token rows, groups contiguous along M):
- 2d x 3d (fprop, dgrad): a [M, K] @ b [E, K, N] -> [M, N]; rows offs[e-1]:offs[e] use b[e].
- 2d x 2d (wgrad): a [N, M] @ b [M, K] -> [E, N, K]; group e contracts over its own rows.

``scaled_grouped_mm`` takes its scales as ``torch._scaled_grouped_mm``'s rowwise form does:
2d x 3d: scale_a [M] (one per row), scale_b [E, N]; 2d x 2d: scale_a [E * N], scale_b [E * K]. A
per-expert tensor scale is that vector filled with the expert's value, so one contract serves the
per-tensor recipes and a later rowwise one.

What runs:
- CUDA sm90, both operands E4M3, a bf16 output: ``torch._scaled_grouped_mm`` (CUTLASS: fp32
  accumulation, the scales applied to the accumulator, one rounding to bf16), with every group's rows
  padded to a multiple of 16 first (``pad_groups``).
- CUDA sm90/sm100, E5M2 operands (HYBRID's gradients), a bf16 output: torch has no scaled grouped GEMM
  of E5M2, so the FP8 values go to bf16 (exact: E4M3 and E5M2 fit in bf16's 8 exponent and 7 mantissa
  bits) and through ``torch._grouped_mm`` (CUTLASS bf16, fp32 accumulation, no host sync); the scales
  are applied to its bf16 output. That is one rounding more than the scaled op (accumulator to bf16,
  then the scaled product to bf16). A first H100 run (torch 2.11) measured the per-group fp32 loop
  below at 8x slower than this layer in bf16.
- Everywhere else (CPU, fp32 / fp16 outputs): the scaled op's arithmetic in two steps:
  ``te_compile::grouped_mm_f32``, an opaque op that multiplies the FP8 values group by group in fp32,
  then the scales and the cast as plain tensor ops, which inductor fuses into the neighbours. The op
  reads the group ends on the host (one sync per call, as TransformerEngine's GroupedLinear does);
  the CUDA paths above never do.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..hardware import get_device_compute_capability

__all__ = ["GROUP_ALIGN", "grouped_mm_f32", "grouped_mm_f32_reference", "scaled_grouped_mm", "group_index",
           "equal_group_offsets", "pad_groups", "uses_native_grouped_gemm", "uses_bf16_grouped_gemm",
           "grouped_gemm_kind"]

# torch._scaled_grouped_mm (CUTLASS, TMA loads): each group's rows a multiple of 16.
GROUP_ALIGN = 16


def group_index(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows]: the group of each row; rows from offs[-1] on get len(offs) (no group)."""
    positions = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, positions, right=True)


def equal_group_offsets(rows, experts: int, device: torch.device) -> torch.Tensor:
    """int32 [experts]: the group ends of ``rows`` rows cut into ``experts`` equal groups (a batched
    bmm's experts: x [E, T, K] flattened to [E * T, K])."""
    return torch.arange(1, experts + 1, device=device, dtype=torch.int32) * (rows // experts)


def _f32(t: torch.Tensor) -> torch.Tensor:
    # contiguous fp32 copies: the product's bits then depend on the values only, not on the layout
    # the caller (eager, or inductor's choice) handed over
    return t.to(torch.float32).contiguous()


def grouped_mm_f32_reference(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grouped_mm_f32``'s contract in plain torch, one matmul per group (the same calls the op makes)."""
    ends = [int(e) for e in offs.tolist()]
    starts = [0, *ends[:-1]]
    if mat_b.dim() == 3:
        out = torch.zeros(mat_a.shape[0], mat_b.shape[2], dtype=torch.float32, device=mat_a.device)
        for e, (start, end) in enumerate(zip(starts, ends)):
            if end > start:
                out[start:end] = _f32(mat_a[start:end]) @ _f32(mat_b[e])
        return out
    out = torch.zeros(len(ends), mat_a.shape[0], mat_b.shape[1], dtype=torch.float32, device=mat_a.device)
    for e, (start, end) in enumerate(zip(starts, ends)):
        if end > start:
            out[e] = _f32(mat_a[:, start:end]) @ _f32(mat_b[start:end])
    return out


@torch.library.custom_op("te_compile::grouped_mm_f32", mutates_args=())
def grouped_mm_f32(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The fp32 products of a grouped GEMM (module docstring: the forms), operands of any float dtype
    (FP8 included: the values multiply exactly in fp32). Rows from offs[-1] on give 0 (2d x 3d); an
    empty group gives a zero [N, K] (2d x 2d)."""
    return grouped_mm_f32_reference(mat_a, mat_b, offs)


@grouped_mm_f32.register_fake
def _(mat_a, mat_b, offs):
    torch._check(mat_a.dim() == 2 and mat_b.dim() in (2, 3),
                 lambda: f"grouped_mm_f32 takes 2d x 3d or 2d x 2d operands, got {mat_a.dim()}d x {mat_b.dim()}d")
    if mat_b.dim() == 3:
        torch._check(mat_a.shape[1] == mat_b.shape[1], lambda: "contraction dims of mat_a and mat_b differ")
        return mat_a.new_empty(mat_a.shape[0], mat_b.shape[2], dtype=torch.float32)
    torch._check(mat_a.shape[1] == mat_b.shape[0], lambda: "contraction dims of mat_a and mat_b differ")
    return mat_a.new_empty(offs.shape[0], mat_a.shape[0], mat_b.shape[1], dtype=torch.float32)


def uses_native_grouped_gemm(mat_a: torch.Tensor, mat_b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Does ``torch._scaled_grouped_mm`` run these operands? CUDA sm90 (its only architecture in torch
    2.13), E4M3 x E4M3, a bf16 output."""
    return (mat_a.device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm")
            and get_device_compute_capability(mat_a.device)[0] == 9
            and mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16)


def uses_bf16_grouped_gemm(mat_a: torch.Tensor, mat_b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Do these FP8 operands run through ``torch._grouped_mm`` in bf16 (module docstring)? CUDA sm90 or
    sm100 (where its CUTLASS kernel runs without a host sync), a bf16 output, FP8 operands the scaled
    op does not take (an E5M2 one)."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    return (mat_a.device.type == "cuda" and hasattr(torch, "_grouped_mm")
            and get_device_compute_capability(mat_a.device)[0] in (9, 10)
            and mat_a.dtype in fp8 and mat_b.dtype in fp8 and out_dtype == torch.bfloat16
            and not uses_native_grouped_gemm(mat_a, mat_b, out_dtype))


def scaled_grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """The grouped GEMM of FP8 operands with rowwise scales (module docstring), in ``out_dtype``;
    ``fast_accum``: the native op's ``use_fast_accum`` (the other paths accumulate in fp32).

    Any layouts: the native op gets mat_a row-major and mat_b column-major (copies where they are
    not), the emulation reads any. Natively, groups must already be padded to ``GROUP_ALIGN`` rows.
    """
    if uses_native_grouped_gemm(mat_a, mat_b, out_dtype):
        mat_b = mat_b.transpose(-2, -1).contiguous().transpose(-2, -1)   # copies only where not column-major
        return torch._scaled_grouped_mm(mat_a.contiguous(), mat_b, scale_a.contiguous(), scale_b.contiguous(),
                                        offs=offs, out_dtype=out_dtype, use_fast_accum=fast_accum)
    if uses_bf16_grouped_gemm(mat_a, mat_b, out_dtype):
        # the same layouts as the scaled op: a row-major, b column-major, each 16-byte aligned
        b16 = mat_b.to(torch.bfloat16).transpose(-2, -1).contiguous().transpose(-2, -1)
        acc = torch._grouped_mm(mat_a.to(torch.bfloat16).contiguous(), b16, offs=offs)
    else:
        acc = grouped_mm_f32(mat_a, mat_b, offs)
    if mat_b.dim() == 3:                                   # acc [M, N]
        groups = group_index(offs, mat_a.shape[0]).clamp(max=mat_b.shape[0] - 1)   # rows past the end are 0
        out = acc * scale_a[:, None] * scale_b[groups]
    else:                                                  # acc [E, N, K]
        experts = offs.shape[0]
        out = acc * scale_a.view(experts, -1, 1) * scale_b.view(experts, 1, -1)
    return out.to(out_dtype)


def pad_groups(offs: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of ``rows`` token rows goes when every group is padded to a multiple of ``align``
    rows, on the device (no host sync: the padded size is the static bound rows + E * (align - 1)).

    Returns (dest int64 [rows]: each row's padded position, padded offs int32 [E], padded rows: the
    bound rounded up to a multiple of ``align``). Rows
    from offs[-1] on keep their distance from the end of the last group. Pad with
    ``x.new_zeros(padded, K).index_copy(0, dest, x)``; unpad with ``y.index_select(0, dest)``.
    """
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded_counts = (counts + (align - 1)) // align * align
    padded_offs = torch.cumsum(padded_counts, 0, dtype=torch.int32)
    # shift of each group's rows: its padded start minus its start; the rows past the end move with
    # the end of the last group
    shift = torch.cat([padded_offs - padded_counts - (offs - counts), (padded_offs - offs)[-1:]])
    dest = torch.arange(rows, device=offs.device) + shift[group_index(offs, rows)]
    # a whole number of aligned rows: the wgrad reads the padded tokens transposed, [N, padded], and
    # the grouped GEMMs want every row stride a multiple of 16 bytes
    bound = rows + offs.shape[0] * (align - 1)
    return dest, padded_offs, -(-bound // align) * align


def grouped_gemm_kind(out_dtype: Optional[torch.dtype], device: torch.device) -> str:
    """How a grouped site's GEMMs run on ``device``, for the report."""
    if device.type == "cuda" and get_device_compute_capability(device)[0] == 9:
        if out_dtype == torch.bfloat16:
            return ("FP8 grouped GEMMs (torch._scaled_grouped_mm for E4M3 x E4M3, groups padded to 16 rows; "
                    "E5M2 gradients: their values in bf16 through torch._grouped_mm, scales after)")
        return "FP8 grouped GEMMs (emulated: torch._scaled_grouped_mm gives bf16 only; one host sync a GEMM)"
    if device.type == "cpu":
        return "FP8 grouped GEMMs (CPU: per-expert fp32 products of the FP8 values, scales applied after, " \
               "torch._scaled_grouped_mm's arithmetic)"
    return "FP8 grouped GEMMs (emulated: torch._scaled_grouped_mm needs sm90; one host sync a GEMM)"
