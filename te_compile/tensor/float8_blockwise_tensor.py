"""Float8 block scaling (DeepSeek-V3 style): FP8 elements with one fp32 scale per 1x128 or 128x128 tile.

Buffers (x2d = [M, K], the tensor flattened to 2-D; t = 128 for 2-D tiles, 1 for 1-D blocks):
- ``_rowwise_data`` uint8 [M, K], ``_rowwise_scale_inv`` fp32 [ceil(M/t), ceil(K/128)];
- ``_columnwise_data`` uint8 [K, M] (the transpose, as TransformerEngine stores it),
  ``_columnwise_scale_inv`` fp32 [ceil(K/t), ceil(M/128)].
Both copies are quantized from high precision: with 1-D blocks the columnwise copy's 128x1 blocks are
other groups of elements than the rowwise copy's. With 2-D tiles both copies see the same tiles, so one
is the transpose of the other. Ragged edges (dims not multiples of 128) are partial blocks.
"""

from __future__ import annotations

import torch

from ..kernels.float8_block_quantize import FLOAT8_BLOCK, float8_block_quantize
from .block_scaled_tensor import (
    BlockScaledQuantizer,
    BlockScaledTensor,
    BlockScaledTensorStorage,
    expand_block_scales,
)
from ..scaling import fp8_max

__all__ = ["Float8BlockQuantizer", "Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage"]


def _dequantize_2d(data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype, tile_rows: int) -> torch.Tensor:
    """fp32 values of data [R, C] with scale_inv [ceil(R/tile_rows), ceil(C/128)]."""
    rows, cols = data.shape
    scale = expand_block_scales(scale_inv, 0, rows, tile_rows)
    scale = expand_block_scales(scale, 1, cols, FLOAT8_BLOCK)
    return data.view(fp8_dtype).to(torch.float32) * scale


class Float8BlockwiseQTensorStorage(BlockScaledTensorStorage):
    """Float8 block buffers without torch.Tensor behaviour."""

    _META = ("_fp8_dtype", "_is_2D_scaled")

    @property
    def _tile_rows(self) -> int:
        return FLOAT8_BLOCK if self._is_2D_scaled else 1

    def _dequantize_rowwise(self) -> torch.Tensor:
        return _dequantize_2d(self._rowwise_data, self._rowwise_scale_inv, self._fp8_dtype, self._tile_rows)

    def _dequantize_columnwise(self) -> torch.Tensor:
        return _dequantize_2d(self._columnwise_data, self._columnwise_scale_inv, self._fp8_dtype,
                              self._tile_rows).t()

    def _derived_copy(self, columnwise: bool):
        if not self._is_2D_scaled:
            return None
        # 128x128 tiles are the same both ways: the other copy is the transpose of data and scales.
        src = "rowwise" if columnwise else "columnwise"
        dst = "columnwise" if columnwise else "rowwise"
        return {f"{dst}_data": getattr(self, f"_{src}_data").t().contiguous(),
                f"{dst}_scale_inv": getattr(self, f"_{src}_scale_inv").t().contiguous()}

    def _x2d_cols(self) -> int:
        if self._rowwise_data is not None:
            return self._rowwise_data.shape[1]
        return self._columnwise_data.shape[0]   # stored as the transpose [K, M]

    def _slice_rows(self, start: int, stop: int) -> dict:
        t, b = self._tile_rows, FLOAT8_BLOCK
        out = {}
        if self._rowwise_data is not None:
            self._check_row_cut(start, stop, t, "128x128 tiles")
            out.update(rowwise_data=self._rowwise_data[start:stop],
                       rowwise_scale_inv=self._rowwise_scale_inv[start // t:-(-stop // t)])
        if self._columnwise_data is not None:
            self._check_row_cut(start, stop, b, "columnwise blocks")
            out.update(columnwise_data=self._columnwise_data[:, start:stop],
                       columnwise_scale_inv=self._columnwise_scale_inv[:, start // b:-(-stop // b)])
        return out


class Float8BlockwiseQTensor(BlockScaledTensor, Float8BlockwiseQTensorStorage):
    """A torch.Tensor of nominal ``dtype`` holding Float8 block-scaled data."""

    # the rowwise copy only: the columnwise one is stored transposed ([K, M]); with 128x128 tiles it
    # is derived from the gathered rowwise copy where a GEMM needs it
    _FSDP_GATHERED = ("_rowwise_data", "_rowwise_scale_inv")

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        if not self._is_2D_scaled:
            raise NotImplementedError("Float8BlockwiseQTensor with 1x128 blocks cannot be all-gathered by FSDP2 "
                                      "in its quantized form: its columnwise copy is not the rowwise one's transpose")
        return super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)

    def _default_quantizer(self):
        return Float8BlockQuantizer(self._fp8_dtype, rowwise=True, columnwise=True,
                                    block_scaling_dim=2 if self._is_2D_scaled else 1)


class Float8BlockQuantizer(BlockScaledQuantizer):
    """Float8 block quantizer: 1x128 blocks (``block_scaling_dim=1``) or 128x128 tiles (``=2``)."""

    _tensor_cls = Float8BlockwiseQTensor
    _storage_cls = Float8BlockwiseQTensorStorage

    def __init__(self, fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool,
                 block_scaling_dim: int = 2, force_pow_2_scales: bool = True,
                 amax_epsilon: float = 0.0) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        fp8_max(fp8_dtype)  # validates the dtype, naming the allowed ones
        if isinstance(block_scaling_dim, bool) or block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim must be 1 (1x128 blocks) or 2 (128x128 tiles), "
                             f"got {block_scaling_dim!r}")
        if not amax_epsilon >= 0.0:
            raise ValueError(f"amax_epsilon must be a non-negative float, got {amax_epsilon!r}")
        self.dtype = fp8_dtype
        self.block_scaling_dim = block_scaling_dim
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = float(amax_epsilon)

    def matches(self, tensor) -> bool:
        """Whether ``tensor`` is in this quantizer's format (usable as its output)."""
        return (isinstance(tensor, Float8BlockwiseQTensorStorage) and tensor._fp8_dtype == self.dtype
                and tensor._is_2D_scaled == (self.block_scaling_dim == 2))

    def _quantize_2d(self, x2d: torch.Tensor):
        return float8_block_quantize(
            x2d, self.dtype, tile_rows=FLOAT8_BLOCK if self.block_scaling_dim == 2 else 1,
            force_pow_2_scales=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon,
        )

    def _fields_for(self, x2d: torch.Tensor) -> dict:
        fields = {"fp8_dtype": self.dtype, "is_2D_scaled": self.block_scaling_dim == 2}
        if self.rowwise_usage:
            data, scale_inv = self._quantize_2d(x2d)
            fields.update(rowwise_data=data, rowwise_scale_inv=scale_inv)
        if self.columnwise_usage:
            if self.rowwise_usage and self.block_scaling_dim == 2:
                # same tiles: transposing the rowwise copy equals quantizing the transpose
                data_t, scale_t = data.t().contiguous(), scale_inv.t().contiguous()
            else:
                data_t, scale_t = self._quantize_2d(x2d.t().contiguous())
            fields.update(columnwise_data=data_t, columnwise_scale_inv=scale_t)
        return fields
