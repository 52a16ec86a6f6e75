"""MXFP8: FP8 elements in blocks of 32 sharing a power-of-two scale stored as an E8M0 exponent code.

Buffers (x2d = [M, K], the tensor flattened to 2-D; see block_scaled_tensor.py):
- ``_rowwise_data`` uint8 [M, K] fp8 bytes, ``_rowwise_scale_inv`` uint8 [M, ceil(K/32)] E8M0 codes of
  the 1x32 blocks along K;
- ``_columnwise_data`` uint8 [M, K] (the same layout, not transposed), ``_columnwise_scale_inv`` uint8
  [ceil(M/32), K] codes of the 32x1 blocks along M.
Code c means the block's values are fp8 * 2^(c - 127); code 255 is NaN (a block holding inf or NaN).
The exponent is rounded up (DESIGN.md §5), so no element clips. Scales are kept unpadded and unswizzled;
a native MX GEMM would need them rearranged into cuBLAS's tiled layout.
"""

from __future__ import annotations

import torch

from ..kernels.mxfp8_quantize import MXFP8_BLOCK, mxfp8_quantize
from .block_scaled_tensor import (
    BlockScaledQuantizer,
    BlockScaledTensor,
    BlockScaledTensorStorage,
    expand_block_scales,
)
from ..scaling import fp8_max

__all__ = ["MXFP8Quantizer", "MXFP8Tensor", "MXFP8TensorStorage", "e8m0_to_fp32"]


def e8m0_to_fp32(codes: torch.Tensor) -> torch.Tensor:
    """2^(c - 127) for uint8 codes c, exactly: code 0 is the fp32 subnormal 2^-127, 255 is NaN."""
    c = codes.to(torch.int32)
    # c in 1..254 is the fp32 exponent field itself; 2^-127 is the subnormal with mantissa 0x400000.
    bits = torch.where(c == 0, torch.full_like(c, 0x400000), c << 23)
    bits = torch.where(c == 255, torch.full_like(c, 0x7FC00000), bits)
    return bits.view(torch.float32)


class MXFP8TensorStorage(BlockScaledTensorStorage):
    """MXFP8 buffers without torch.Tensor behaviour."""

    _META = ("_fp8_dtype",)

    def _dequantize_rowwise(self) -> torch.Tensor:
        k = self._rowwise_data.shape[1]
        values = self._rowwise_data.view(self._fp8_dtype).to(torch.float32)
        scale = e8m0_to_fp32(self._rowwise_scale_inv)
        return values * expand_block_scales(scale, 1, k, MXFP8_BLOCK)

    def _dequantize_columnwise(self) -> torch.Tensor:
        m = self._columnwise_data.shape[0]
        values = self._columnwise_data.view(self._fp8_dtype).to(torch.float32)
        scale = e8m0_to_fp32(self._columnwise_scale_inv)
        return values * expand_block_scales(scale, 0, m, MXFP8_BLOCK)

    def _x2d_cols(self) -> int:
        data = self._rowwise_data if self._rowwise_data is not None else self._columnwise_data
        return data.shape[1]   # both copies are [M, K]

    def _slice_rows(self, start: int, stop: int) -> dict:
        out = {}
        if self._rowwise_data is not None:
            out.update(rowwise_data=self._rowwise_data[start:stop],
                       rowwise_scale_inv=self._rowwise_scale_inv[start:stop])
        if self._columnwise_data is not None:
            self._check_row_cut(start, stop, MXFP8_BLOCK, "columnwise MXFP8 blocks")
            out.update(columnwise_data=self._columnwise_data[start:stop],
                       columnwise_scale_inv=self._columnwise_scale_inv[
                           start // MXFP8_BLOCK:-(-stop // MXFP8_BLOCK)])
        return out


class MXFP8Tensor(BlockScaledTensor, MXFP8TensorStorage):
    """A torch.Tensor of nominal ``dtype`` holding MXFP8 data."""

    # both copies are [M, K] with row-laid-out scales: all four buffers gather along dim 0
    _FSDP_GATHERED = MXFP8TensorStorage._BUFFERS

    def _default_quantizer(self):
        return MXFP8Quantizer(self._fp8_dtype)


class MXFP8Quantizer(BlockScaledQuantizer):
    """MXFP8 quantizer (OCP MX): 32-element blocks, E8M0 scales, E4M3 or E5M2 elements."""

    _tensor_cls = MXFP8Tensor
    _storage_cls = MXFP8TensorStorage

    def __init__(self, fp8_dtype: torch.dtype, *, rowwise: bool = True, columnwise: bool = True) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        fp8_max(fp8_dtype)  # validates the dtype, naming the allowed ones
        self.dtype = fp8_dtype

    def matches(self, tensor) -> bool:
        """Whether ``tensor`` is in this quantizer's format (usable as its output)."""
        return isinstance(tensor, MXFP8TensorStorage) and tensor._fp8_dtype == self.dtype

    def _fields_for(self, x2d: torch.Tensor) -> dict:
        fields = {"fp8_dtype": self.dtype}
        if self.rowwise_usage:
            data, scale = mxfp8_quantize(x2d, self.dtype)
            fields.update(rowwise_data=data, rowwise_scale_inv=scale)
        if self.columnwise_usage:
            # blocks along M: quantize the transpose rowwise, transpose back ([K, M] -> [M, K])
            data_t, scale_t = mxfp8_quantize(x2d.t().contiguous(), self.dtype)
            fields.update(columnwise_data=data_t.t().contiguous(),
                          columnwise_scale_inv=scale_t.t().contiguous())
        return fields
