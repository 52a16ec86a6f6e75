"""NVFP4: 4-bit E2M1 elements, an E4M3 scale per 16 elements and an fp32 scale per tensor.

Buffers (x2d = [M, K], the tensor flattened to 2-D; K and, for a columnwise copy, M multiples of 16):
- ``_rowwise_data`` uint8 [M, K/2]: two E2M1 codes per byte, element 2j in the low nibble;
  ``_rowwise_scale_inv`` uint8 [M, K/16]: E4M3 bytes of the block scales (with 16x16 tiles every row of a
  tile holds the tile's scale); ``_amax_rowwise`` fp32 [1]: max|x|, which sets the tensor scale
  S = 448 * 6 / amax;
- ``_columnwise_data`` uint8 [K, M/2], ``_columnwise_scale_inv`` uint8 [K, M/16], ``_amax_columnwise``
  fp32 [1]: the same for the transpose x2d.T (after the random Hadamard transform when ``_with_rht``).
A value decodes as e2m1 * block_scale / S. The RHT (te_compile.tensor.rht) mixes each 16 consecutive
tokens of the wgrad operands so outliers spread before the 4-bit rounding; dequantize undoes it.
"""

from __future__ import annotations

import torch

from ..distributed import reduce_amaxes
from ..kernels.nvfp4_quantize import NVFP4_BLOCK, nvfp4_dequantize, nvfp4_quantize
from .block_scaled_tensor import BlockScaledQuantizer, BlockScaledTensor, BlockScaledTensorStorage
from .rht import apply_rht, undo_rht
from ..scaling import tensor_amax

__all__ = ["NVFP4Quantizer", "NVFP4Tensor", "NVFP4TensorStorage"]


def _dequantize_2d(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """fp32 [R, C] from packed data [R, C/2], E4M3 scale bytes [R, C/16] and the tensor amax [1]:
    e2m1 * e4m3 is exact in fp32, then one rounding in the division by the tensor scale."""
    return nvfp4_dequantize(data, scale, amax)


def _unpack_codes(data: torch.Tensor) -> torch.Tensor:
    """uint8 codes [R, 2C] from packed bytes [R, C] (element 2j in the low nibble)."""
    return torch.stack([data & 0xF, data >> 4], dim=-1).reshape(data.shape[0], -1)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Packed bytes [R, C/2] from uint8 codes [R, C]."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _transposed_tiles(data: torch.Tensor, scale: torch.Tensor):
    """The transpose of a 16x16-tiled copy: data [R, C/2] and scale [R, C/16] (R % 16 == 0) ->
    data [C, R/2] and scale [C, R/16]. Tiles are the same both ways, so only bytes move."""
    tile_scales = scale[::NVFP4_BLOCK]  # [R/16, C/16]: one row per tile row
    return (_pack_codes(_unpack_codes(data).t()),
            tile_scales.t().repeat_interleave(NVFP4_BLOCK, dim=0).contiguous())


class NVFP4TensorStorage(BlockScaledTensorStorage):
    """NVFP4 buffers without torch.Tensor behaviour."""

    _BUFFERS = BlockScaledTensorStorage._BUFFERS + ("_amax_rowwise", "_amax_columnwise")
    _META = ("_with_rht", "_with_2d_quantization")

    def _dequantize_rowwise(self) -> torch.Tensor:
        return _dequantize_2d(self._rowwise_data, self._rowwise_scale_inv, self._amax_rowwise)

    def _dequantize_columnwise(self) -> torch.Tensor:
        values = _dequantize_2d(self._columnwise_data, self._columnwise_scale_inv, self._amax_columnwise)
        if self._with_rht:
            values = undo_rht(values)
        return values.t()

    def _derived_copy(self, columnwise: bool):
        # 16x16 tiles without RHT are the same both ways: transpose the codes and the tile scales.
        if not self._with_2d_quantization or self._with_rht:
            return None
        src, dst = ("rowwise", "columnwise") if columnwise else ("columnwise", "rowwise")
        data, scale = getattr(self, f"_{src}_data"), getattr(self, f"_{src}_scale_inv")
        if data.shape[0] % NVFP4_BLOCK:
            return None  # a partial tile row: the other copy's blocks would need rows that do not exist
        data_t, scale_t = _transposed_tiles(data, scale)
        return {f"{dst}_data": data_t, f"{dst}_scale_inv": scale_t, f"amax_{dst}": getattr(self, f"_amax_{src}")}

    def _x2d_cols(self) -> int:
        if self._rowwise_data is not None:
            return self._rowwise_data.shape[1] * 2   # two codes per byte
        return self._columnwise_data.shape[0]   # stored as the transpose [K, M/2]

    def _slice_rows(self, start: int, stop: int) -> dict:
        out = {}
        if self._rowwise_data is not None:
            if self._with_2d_quantization:
                self._check_row_cut(start, stop, NVFP4_BLOCK, "16x16 tiles")
            out.update(rowwise_data=self._rowwise_data[start:stop],
                       rowwise_scale_inv=self._rowwise_scale_inv[start:stop],
                       amax_rowwise=self._amax_rowwise)
        if self._columnwise_data is not None:
            # (the Hadamard transform mixes the same 16 rows a block holds: aligned cuts keep it whole)
            self._check_row_cut(start, stop, NVFP4_BLOCK, "columnwise blocks")
            out.update(columnwise_data=self._columnwise_data[:, start // 2:stop // 2],
                       columnwise_scale_inv=self._columnwise_scale_inv[
                           :, start // NVFP4_BLOCK:stop // NVFP4_BLOCK],
                       amax_columnwise=self._amax_columnwise)
        return out


class NVFP4Tensor(BlockScaledTensor, NVFP4TensorStorage):
    """A torch.Tensor of nominal ``dtype`` holding NVFP4 data."""

    def _default_quantizer(self):
        return NVFP4Quantizer(with_rht=self._with_rht, with_2d_quantization=self._with_2d_quantization)


class NVFP4Quantizer(BlockScaledQuantizer):
    """NVFP4 quantizer. ``with_2d_quantization``: 16x16 tiles (weights); ``stochastic_rounding``:
    unbiased random rounding (gradients), drawn from torch's default generator (rowwise [M, K] first,
    then columnwise [K, M]) so ``torch.manual_seed`` makes runs reproducible; ``with_rht``: the
    16-point random Hadamard transform on the columnwise copy (the wgrad operand).

    ``amax_reduction_groups`` (te_compile.distributed.AmaxGroup, TransformerEngine's
    ``amax_reduction_group``): for a tensor sharded across ranks, the tensor amax that sets the global
    scale is all-reduced (MAX) over these groups, so the shards share one scale as one tensor would.
    """

    _tensor_cls = NVFP4Tensor
    _storage_cls = NVFP4TensorStorage

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True, with_rht: bool = False,
                 stochastic_rounding: bool = False, with_2d_quantization: bool = False) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.with_rht = bool(with_rht)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.with_2d_quantization = bool(with_2d_quantization)
        self.amax_reduction_groups: tuple = ()

    def _amax(self, x2d: torch.Tensor) -> torch.Tensor:
        amax = tensor_amax(x2d)
        if self.amax_reduction_groups:
            [amax] = reduce_amaxes([amax], [self.amax_reduction_groups])
        return amax

    def _encode(self, x2d: torch.Tensor, amax: torch.Tensor):
        rand = None
        if self.stochastic_rounding:
            rand = torch.rand(x2d.shape, device=x2d.device, dtype=torch.float32)
        tile_rows = NVFP4_BLOCK if self.with_2d_quantization else 1
        return nvfp4_quantize(x2d, amax, tile_rows=tile_rows, rand=rand)

    def _fields_for(self, x2d: torch.Tensor) -> dict:
        m, k = x2d.shape
        fields = {"with_rht": self.with_rht, "with_2d_quantization": self.with_2d_quantization}
        if self.rowwise_usage:
            if k % NVFP4_BLOCK:
                raise ValueError(f"NVFP4 needs the last dim to be a multiple of {NVFP4_BLOCK}, got {k}")
            row_amax = self._amax(x2d)
            data, scale = self._encode(x2d, row_amax)
            fields.update(rowwise_data=data, rowwise_scale_inv=scale, amax_rowwise=row_amax)
        if self.columnwise_usage:
            if m % NVFP4_BLOCK:
                raise ValueError(f"NVFP4's columnwise copy needs the rows (numel / last dim) to be a "
                                 f"multiple of {NVFP4_BLOCK}, got {m}")
            if (self.rowwise_usage and self.with_2d_quantization and not self.with_rht
                    and not self.stochastic_rounding):
                # same 16x16 tiles and tensor amax: transposing the rowwise copy equals quantizing x.T
                data_t, scale_t = _transposed_tiles(data, scale)
                col_amax = row_amax
            else:
                xt = x2d.t().contiguous()
                if self.with_rht:
                    xt = apply_rht(xt)
                col_amax = self._amax(xt)
                data_t, scale_t = self._encode(xt, col_amax)
            fields.update(columnwise_data=data_t, columnwise_scale_inv=scale_t, amax_columnwise=col_amax)
        return fields
