"""What a rewritten grouped GEMM site calls: ``GroupedLinearLowering(spec)(x, w, offs)``, the experts
of a mixture-of-experts layer (TransformerEngine's GroupedLinear, from unchanged model code).

x: [M, K] tokens sorted by expert; w: [E, K, N] as ``torch._grouped_mm`` reads it (a parameter
[E, K, N], or [E, N, K] through ``.transpose(-2, -1)``); offs: [E] the running end of each
expert's rows, or None for E equal groups of M / E rows (a batched bmm's experts, flattened by the
pass). y [M, N]: rows offs[e-1]:offs[e] times w[e]; rows from offs[-1] on are 0.

Per-tensor FP8 per expert, as GroupedLinear gives each GEMM its own quantizers: one scale for each
expert's token rows, one per expert weight, one per expert slice of grad_output (HYBRID: E4M3
forward, E5M2 gradients). Current scaling computes them from this call's amaxes; DelayedScaling
reads them from the weight's state (an amax history per expert and role, te_compile.state) and
hands this call's amaxes to the graph's one update node (delayed_state.py). An expert without tokens
has amax 0, so scale 1, and contributes zero rows and a zero weight gradient. The GEMMs
(te_compile.gemm.grouped) apply the scales to the fp32 accumulator, as torch._scaled_grouped_mm does:
- fprop  y  = x @ w[e]        : xq [M, K] E4M3, wq [E, N, K] E4M3 read as [E, K, N]
- dgrad  dx = g @ w[e].T      : gq [M, N] E5M2, wq read as [E, N, K]
- wgrad  dw[e] = g_e.T @ x_e  : gq.T [N, M] E5M2, xq [M, K] E4M3, grouped along M
Only the FP8 copies of x and w are saved for backward.

The block-scaled recipes (MXFP8, Float8 block) run per expert through their quantizer objects:
``BlockGroupedLinearFunction`` says how no block spans two experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..fx.cache_names import name_lowering
from ..gemm.block import quantize_copies, quantize_tokens_per_group, quantizer_factory
from ..gemm.grouped import equal_group_offsets, group_index, grouped_mm_f32, pad_groups, scaled_grouped_mm
from ..recipe import Recipe
from ..scaling import quantize_per_expert, quantize_rows_per_group
from ..tensor.grouped_float8_tensor import GroupedFloat8Tensor
from ..tensor.quantized_tensor import QuantizedTensor, prepare_for_saving, restore_from_saved

__all__ = ["GroupedLinearSpec", "GroupedLinearLowering", "GatherRows", "PadRows", "padding_sources",
           "pad_expert_rows", "unpad_expert_rows", "Fp8GroupedLinearFunction", "BlockGroupedLinearFunction",
           "expert_weight_operand", "grouped_fprop", "grouped_dgrad_wgrad"]


@dataclass(frozen=True)
class GroupedLinearSpec:
    """Everything about a grouped site the lowering needs that is not a tensor."""

    fqn: str
    recipe: Recipe
    # pad every expert's rows to a multiple of this before the GEMMs (the native grouped GEMM's 16),
    # on the device; 1: no padding
    align: int = 1


def _per_row(scale_inv: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """[E] -> [M]: each row's expert value (rows of no expert read the last one; their output is 0)."""
    return scale_inv[groups.clamp(max=scale_inv.shape[0] - 1)]


def _per_column(scale_inv: torch.Tensor, columns: int) -> torch.Tensor:
    """[E] -> [E, columns]: the expert's value in every column (the rowwise form of a tensor scale)."""
    return scale_inv[:, None].expand(scale_inv.shape[0], columns)


def expert_weight_operand(w_ekn, recipe, w_scale=None):
    """The weight operand of the grouped GEMMs: (wq [E, N, K] fp8 contiguous, scale_inv [E], amax [E]).
    An expert weight FSDP2 gathered in FP8 (a GroupedFloat8Tensor of the recipe's weight format) is
    used as it is, its amaxes those of the high-precision values (delayed scaling's history); anything
    else is quantized per expert here, with DelayedScaling's ``w_scale`` [E] or its own amaxes."""
    fp8_dtype = recipe.fp8_format.dtype_for("weight")
    if isinstance(w_ekn, GroupedFloat8Tensor) and w_ekn._fp8_dtype == fp8_dtype:
        w_enk = w_ekn.transpose(1, 2)
        amax = w_enk._amax if w_enk._amax is not None else w_enk._scale_inv.new_zeros(w_enk.shape[0])
        return w_enk._data.view(fp8_dtype).contiguous(), w_enk._scale_inv, amax
    if isinstance(w_ekn, QuantizedTensor):
        w_ekn = w_ekn.dequantize()
    wq, w_sinv, w_amax = quantize_per_expert(w_ekn.transpose(1, 2), "weight", recipe, w_scale)
    return wq.contiguous(), w_sinv, w_amax


def grouped_fprop(xq, x_sinv, groups, w_ekn, offs, recipe, w_scale=None, *, out_dtype):
    """The forward grouped GEMM from an FP8 input made by the caller: y [M, N] = xq @ quantize(w)[e]
    per expert. xq: [M, K] fp8; x_sinv: [E]; groups: int64 [M] (``group_index``); w_ekn: [E, K, N];
    w_scale: DelayedScaling's [E], else None. Returns (y, wq [E, N, K] contiguous: saved for dgrad,
    w's scale_inv [E], w's amax [E])."""
    wq, w_sinv, w_amax = expert_weight_operand(w_ekn, recipe, w_scale)
    y = scaled_grouped_mm(xq, wq.transpose(1, 2), _per_row(x_sinv, groups), _per_column(w_sinv, wq.shape[1]),
                          offs, out_dtype, fast_accum=recipe.fast_accumulation("fprop"))
    return y, wq, w_sinv, w_amax


def grouped_dgrad_wgrad(grad_y, groups, offs, recipe, wq, w_sinv, xq, x_sinv, g_scale=None, *, dx_dtype,
                        dw_dtype):
    """The backward grouped GEMMs from the saved FP8 operands; grad_y [M, N] is quantized here per
    expert (with DelayedScaling's ``g_scale`` [E], else its own amaxes). dx [M, K] in ``dx_dtype``
    (None: not needed); dw [E, N, K] in ``dw_dtype`` (None: not needed). Returns (dx, dw, g_amax [E])."""
    experts, n, k = wq.shape
    gq, g_sinv, g_amax = quantize_rows_per_group(grad_y, groups, experts, "grad_output", recipe, g_scale)
    dx = dw = None
    if dx_dtype is not None:
        dx = scaled_grouped_mm(gq, wq, _per_row(g_sinv, groups), _per_column(w_sinv, k), offs, dx_dtype)
    if dw_dtype is not None:
        dw = scaled_grouped_mm(gq.t(), xq, _per_column(g_sinv, n).reshape(-1), _per_column(x_sinv, k).reshape(-1),
                               offs, dw_dtype)
    return dx, dw, g_amax


class Fp8GroupedLinearFunction(torch.autograd.Function):
    """Per-tensor FP8 per expert. x: [M, K], w_ekn: [E, K, N], offs: int32 [E].

    DelayedScaling passes its per-expert scales (fp32 [E] each: input, weight, grad_output), read only,
    and, when a backward follows, ``carrier``: the backward returns this call's amaxes as the carrier's
    gradient, [input, weight, grad_output] x [E] flat, which delayed_state.py folds into the expert
    histories once per step. Current scaling passes None for all four.
    """

    @staticmethod
    def forward(ctx, x, w_ekn, offs, recipe, carrier, x_scale, w_scale, g_scale):
        groups = group_index(offs, x.shape[0])
        xq, x_sinv, x_amax = quantize_rows_per_group(x, groups, w_ekn.shape[0], "input", recipe, x_scale)
        y, wq, w_sinv, w_amax = grouped_fprop(xq, x_sinv, groups, w_ekn, offs, recipe, w_scale, out_dtype=x.dtype)
        ctx.recipe = recipe
        ctx.dtypes = (x.dtype, w_ekn.dtype)
        ctx.save_for_backward(xq, x_sinv, wq, w_sinv, offs, groups, torch.cat([x_amax, w_amax]),
                              *((g_scale,) if g_scale is not None else ()))
        ctx.mark_non_differentiable(offs)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xq, x_sinv, wq, w_sinv, offs, groups, xw_amax, *g_scale = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        dx, dw, g_amax = grouped_dgrad_wgrad(grad_y, groups, offs, ctx.recipe, wq, w_sinv, xq, x_sinv,
                                             g_scale[0] if g_scale else None,
                                             dx_dtype=x_dtype if ctx.needs_input_grad[0] else None,
                                             dw_dtype=w_dtype if ctx.needs_input_grad[1] else None)
        carrier_grad = torch.cat([xw_amax, g_amax]) if ctx.needs_input_grad[4] else None
        return dx, None if dw is None else dw.transpose(1, 2), None, None, carrier_grad, None, None, None


class BlockGroupedLinearFunction(torch.autograd.Function):
    """The block-scaled formats per expert (MXFP8, Float8 block, NVFP4) through quantizer objects, as
    the dense linears' ``QuantizedLinearFunction`` (linear.py). x: [M, K], w_ekn: [E, K, N], offs: int32 [E].

    x and grad_output are quantized rowwise whole: their blocks run along K / N, inside one row, so
    inside one expert. Each expert's weight is quantized alone (Float8 block's 128x128 tiles, NVFP4's
    16x16, stay in one expert). The weight gradient's operands, x and grad_output columnwise (blocks
    running down the token dim), are made from each expert's rows padded with zero rows to
    ``block_rows`` (``Recipe.token_block_rows``): no block spans two experts, and zero rows change no
    block's amax. NVFP4's tensor-level amax is one per expert (``quantize_tokens_per_group``), so each
    expert's tokens are scaled as if alone.
    The GEMMs dequantize both operands to fp32 and multiply expert by expert (grouped_mm_f32): no
    grouped GEMM of these formats is wired natively. The forward saves only quantized copies.
    """

    @staticmethod
    def forward(ctx, x, w_ekn, offs, factory, block_rows):
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        experts = w_ekn.shape[0]
        qx = quantize_tokens_per_group(factory, "input", x, group_index(offs, x.shape[0]), experts)
        qws = [quantize_copies(factory, "weight", w_ekn[e].t(), columnwise=needs_dx) for e in range(experts)]
        w32 = torch.stack([q.dequantize(dtype=torch.float32) for q in qws])            # [E, N, K]
        y = grouped_mm_f32(qx.dequantize(dtype=torch.float32), w32.transpose(1, 2), offs).to(x.dtype)
        qx_col = padding = None
        if needs_dw:
            dest, padded_offs, rows = pad_groups(offs, x.shape[0], block_rows)
            rows = -(-rows // block_rows) * block_rows   # the rows past the last group in whole blocks too
            padding = (dest, padded_offs, rows)
            qx_col = quantize_tokens_per_group(factory, "input", x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x),
                                               group_index(padded_offs, rows), experts, columnwise=True)
        if needs_dx:
            for q in qws:
                q.update_usage(rowwise_usage=False)   # dgrad reads the columnwise copies only
        tensors, ctx.objects = prepare_for_saving(qx_col, *(qws if needs_dx else ()))
        extra = padding[:2] if padding is not None else ()
        ctx.save_for_backward(offs, *extra, *tensors)
        ctx.factory, ctx.padded_rows, ctx.experts = factory, padding[2] if padding is not None else 0, experts
        ctx.dtypes = (x.dtype, w_ekn.dtype)
        ctx.mark_non_differentiable(offs)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        offs, *rest = ctx.saved_tensors
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dest, padded_offs = rest[:2] if needs_dw else (None, None)
        qx_col, *qws = restore_from_saved(ctx.objects, rest[2:] if needs_dw else rest)
        x_dtype, w_dtype = ctx.dtypes
        dx = dw = None
        experts = ctx.experts
        if needs_dx:
            qg = quantize_tokens_per_group(ctx.factory, "grad_output", grad_y, group_index(offs, grad_y.shape[0]),
                                           experts)
            w32 = torch.stack([q.dequantize(dtype=torch.float32) for q in qws])        # [E, N, K]
            dx = grouped_mm_f32(qg.dequantize(dtype=torch.float32), w32, offs).to(x_dtype)
        if needs_dw:
            g_padded = grad_y.new_zeros(ctx.padded_rows, grad_y.shape[1]).index_copy(0, dest, grad_y)
            qg_col = quantize_tokens_per_group(ctx.factory, "grad_output", g_padded,
                                               group_index(padded_offs, ctx.padded_rows), experts, columnwise=True)
            dw_enk = grouped_mm_f32(qg_col.dequantize(dtype=torch.float32).t(),
                                    qx_col.dequantize(dtype=torch.float32), padded_offs)   # [E, N, K]
            dw = dw_enk.transpose(1, 2).to(w_dtype)
        return dx, dw, None, None, None


def padding_sources(dest: torch.Tensor, rows: int, padded_rows: int) -> torch.Tensor:
    """int64 [P]: the token row each padded row holds, ``rows`` for a padding row (pad_groups' dest,
    inverted)."""
    src = torch.full((padded_rows,), rows, dtype=torch.int64, device=dest.device)
    return src.index_copy(0, dest, torch.arange(rows, device=dest.device))


def _padding(offs: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dest, padded offs, src) for ``rows`` token rows grouped by ``offs``, every group padded to a
    multiple of ``align`` rows (pad_groups, and its map inverted)."""
    dest, padded_offs, padded_rows = pad_groups(offs, rows, align)
    return dest, padded_offs, padding_sources(dest, rows, padded_rows)


def _rows_at(t: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """[P, *]: row src[p] of t, or zeros where src[p] is len(t), in one gather: no zero-filled [P, *]
    buffer written first and copied into (a write of the whole padded tensor more, and a buffer the
    partitioner moves into the forward and saves when it sits in a backward)."""
    rows = t.shape[0]
    if rows == 0:
        return t.new_zeros(src.shape[0], *t.shape[1:])
    picked = t.index_select(0, src.clamp(max=rows - 1))
    return torch.where((src < rows).view(-1, *([1] * (t.dim() - 1))), picked, picked.new_zeros(()))


class PadRows(torch.autograd.Function):
    """x [M, K] -> [P, K]: x's rows where ``dest`` puts them, zero rows between (``src``: dest
    inverted, ``padding_sources``). Backward reads each token row's gradient back with
    ``index_select``: every row is read exactly once (autograd's backward of a gather would be an
    ``index_add``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, src: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(dest)
        return _rows_at(x, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (dest,) = ctx.saved_tensors
        return grad.index_select(0, dest), None, None


class GatherRows(torch.autograd.Function):
    """``padded.index_select(0, dest)`` for a ``dest`` that names each row at most once (pad_groups'
    map from token rows to padded rows), whose backward writes the gradient rows back where they
    came from and zeros elsewhere in one gather (``src``: dest inverted, ``padding_sources``; made
    from dest when None). Autograd's own backward of index_select is ``index_add``, which must allow
    repeated indices: atomic adds, in bf16 a compare-and-swap loop (2.4 ms a call at Mixtral's
    shape, 16k x 14336, on an H100, three calls a layer)."""

    @staticmethod
    def forward(ctx, padded: torch.Tensor, dest: torch.Tensor, src: Optional[torch.Tensor] = None) -> torch.Tensor:
        if src is None:
            src = padding_sources(dest, dest.shape[0], padded.shape[0])
        ctx.save_for_backward(src)
        return padded.index_select(0, dest)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (src,) = ctx.saved_tensors
        return _rows_at(grad, src), None, None


def _int32_offsets(offs: Optional[torch.Tensor], rows: int, experts: int, device) -> torch.Tensor:
    """The group ends as the grouped GEMMs take them: int32 (transformers' fallback op also takes int64
    offsets), ``experts`` equal groups of ``rows`` when None."""
    if offs is None:
        offs = equal_group_offsets(rows, experts, device)
    return offs.to(torch.int32)


def pad_expert_rows(x: torch.Tensor, offs: Optional[torch.Tensor], experts: int,
                    align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x with every expert's rows padded with zero rows to a multiple of ``align`` [P, K],
    the padded offs int32 [E], dest int64 [M]: each token row's padded row, src int64 [P]: each
    padded row's token row, M for padding). Called in the graph in front of an expert MLP whose
    grouped GEMMs then run on the padded rows as they are (passes/activation_fusion.py): one pad and
    one ``unpad_expert_rows`` for the MLP, not one of each per GEMM. Zero rows stay zero through the
    GEMMs and an activation with act(0) = 0, so they change no expert's amax and add nothing to its
    weight gradient."""
    dest, padded_offs, src = _padding(_int32_offsets(offs, x.shape[0], experts, x.device), x.shape[0], align)
    return PadRows.apply(x, src, dest), padded_offs, dest, src


def unpad_expert_rows(y: torch.Tensor, dest: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """The token rows [M, N] of ``pad_expert_rows``' padded layout y [P, N]."""
    return GatherRows.apply(y, dest, src)


class GroupedLinearLowering:
    """Callable inserted into the FX graph for one grouped site: ``(x, w, offs) -> y`` (module
    docstring: shapes). The output has x's dtype, as ``torch._grouped_mm``'s does."""

    def __init__(self, spec: GroupedLinearSpec) -> None:
        problem = spec.recipe.grouped_gemm_problem()
        if problem is not None:
            raise ValueError(f"grouped GEMMs cannot run under {spec.recipe.name}: {problem}")
        self.spec = spec   # all the lowering holds: fx/cache_names.py names it after a digest of it
        name_lowering(self, f"te_grouped_linear_{spec.recipe.name}", __name__)

    def __call__(self, x: torch.Tensor, w_ekn: torch.Tensor, offs: torch.Tensor,
                 *delayed: Optional[torch.Tensor]) -> torch.Tensor:
        """delayed: DelayedScaling's (carrier or None, input, weight, grad_output scales [E] each)."""
        recipe = self.spec.recipe
        if not recipe.per_tensor:
            return self.padded(lambda x_, offs_: BlockGroupedLinearFunction.apply(
                x_, w_ekn, offs_, quantizer_factory(recipe), recipe.token_block_rows), [x], offs, w_ekn.shape[0])
        state = delayed or (None,) * 4
        return self.padded(lambda x_, offs_: Fp8GroupedLinearFunction.apply(x_, w_ekn, offs_, recipe, *state),
                           [x], offs, w_ekn.shape[0])

    def padded(self, gemm: Callable, rows: list[Optional[torch.Tensor]], offs: Optional[torch.Tensor],
               experts: int) -> torch.Tensor:
        """``gemm(*rows, offs)`` -> [M, N], on tensors [M, *] with every expert's rows padded with zero
        rows to ``spec.align`` first (none when 1) and the output's rows gathered back after; offs
        None: ``experts`` equal groups."""
        m = next(t for t in rows if t is not None).shape[0]
        offs = _int32_offsets(offs, m, experts, rows[0].device)
        if self.spec.align == 1:
            return gemm(*rows, offs)
        dest, padded_offs, src = _padding(offs, m, self.spec.align)
        padded = [None if t is None else PadRows.apply(t, src, dest) for t in rows]
        return GatherRows.apply(gemm(*padded, padded_offs), dest, src)

    def __repr__(self) -> str:
        return f"GroupedLinearLowering({self.spec.fqn!r}, {self.spec.recipe.name})"
