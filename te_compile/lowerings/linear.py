"""What a rewritten linear site calls: ``LinearLowering(spec)(x, weight, bias, *state)``, and the two
autograd.Functions it runs.

The backend replaces ``linear(x, w, b)`` (or ``addmm(b, x, w)`` with ``w: [in, out]``) by a call to
a ``LinearLowering``: plain Python around autograd.Functions, so aot_autograd traces forward and
backward. Per-tensor recipes (current and delayed scaling) run ``Fp8LinearFunction``; block-scaled
recipes and CustomRecipe run ``QuantizedLinearFunction`` on quantizer objects (native block-scaled
GEMMs where the pass found the device runs them, see gemm/block_probe.py, else
dequantize-then-matmul). Both are below in this file; the variants of where and how a linear runs
are in linear_paths/: inference's one input scale per token (rowwise.py), DTensor operands shard
by shard (sharded.py) and async tensor parallelism (async_tp.py).

The per-tensor path quantizes x and w (te_compile.scaling's ``quantize_per_tensor``) and runs the
three GEMMs of gemm/per_tensor.py (``fp8_fprop``, ``fp8_dgrad_wgrad``; torch._scaled_mm), while
inductor fuses the amax / scale / cast ops into neighbouring kernels. Only the FP8 copies of x and w
are saved for backward (1 byte per element instead of 2 or 4); bias and its gradient stay in high
precision (a bf16 or fp16 bias of the output's dtype is added in the forward GEMM's epilogue,
``adds_bias``). On shards of tensors split across ranks by hand (sharded.py) current scaling
all-reduces the amaxes of the sharded operands (MAX) before computing their scales: x and w in one
buffer in forward, g in backward; ``groups`` names the groups per role and is empty in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..autocast import autocast_dtype
from ..distributed import NO_GROUPS, AmaxGroup, is_dtensor, reduce_amaxes
from ..fx.cache_names import name_lowering
from ..gemm.block import (dequantized_gemm, native_block_gemm, native_pair_supported, quantize_copies,
                          quantizer_factory)
from ..gemm.operands import weight_is_operand
from ..gemm.per_tensor import (add_bias, column_major, fp8_dgrad_wgrad, fp8_fprop, fp8_gemm_kind,
                                split_bias)
from ..recipe import GEMM_ROLES, Recipe
from ..scaling import quantize_per_tensor, scale_invs, tensor_amax
from ..tensor.quantized_tensor import QuantizedTensor, Quantizer, prepare_for_saving, restore_from_saved
from .linear_paths.async_tp import AsyncTp, async_tp_column, async_tp_row
from .linear_paths.rowwise import rowwise_fp8_linear
from .linear_paths.sharded import plan_linear_sharding, sharded_linear

__all__ = ["LinearSpec", "LinearLowering", "Fp8LinearFunction", "QuantizedLinearFunction", "gemm_kind",
           "casts_weight_itself", "weight_in_input_dtype"]


@dataclass(frozen=True)
class LinearSpec:
    """Everything about a site the lowering needs that is not a tensor."""

    fqn: str
    recipe: Recipe
    weight_in_out: bool = False   # the call reads the weight as [in, out] (x @ W, HF Conv1D addmm)
    native_gemm: bool = False     # block recipes: GEMMs through F.scaled_mm (gemm/block_probe.py said yes)
    weight_first: bool = False    # W @ x: y = (x.mT @ W.T).mT
    # per role (input, weight, grad_output): groups current scaling all-reduces the amax over, for
    # plain tensors sharded by hand ([distributed] sharded_modules); DTensors bring their own
    amax_groups: tuple[tuple[AmaxGroup, ...], ...] = NO_GROUPS
    # inference graphs under [inference] activation_scaling = "row": one input scale per token,
    # forward only (linear_paths/rowwise.py)
    rowwise: bool = False
    # [distributed] async_tp: a sequence-parallel site's collectives on FP8 data next to its _scaled_mm
    # (linear_paths/async_tp.py); x then arrives sequence-sharded (column) or y leaves so (row)
    async_tp: Optional[AsyncTp] = None


def gemm_kind(recipe: Recipe, native: bool = False, why: str = "", device: Optional[torch.device] = None) -> str:
    """How the site's GEMMs run on ``device``, for the report; ``native`` / ``why``: the block-GEMM
    probe's answer."""
    if recipe.per_tensor:
        kind = fp8_gemm_kind(device) if device is not None else "FP8 GEMMs (torch._scaled_mm)"
        on_gpu = device is not None and torch.device(device).type == "cuda"   # CPU accumulates in fp32
        if on_gpu and recipe.fast_accumulation("fprop") and kind.endswith("(torch._scaled_mm)"):
            kind = kind[:-1] + "; forward with fast accumulation)"
        return kind
    if recipe.block_format is None:
        return f"{recipe.format_label}, dequantize-then-matmul GEMMs"
    if native:
        return f"{recipe.format_label}, native GEMMs (F.scaled_mm)"
    return f"{recipe.format_label}, emulated GEMMs (dequantize-then-matmul{'; ' + why if why else ''})"


class LinearLowering:
    """Callable inserted into the FX graph for one site: ``(x, weight, bias, *delayed) -> y``.

    x: [..., K] ([..., K, M] or [K] when ``spec.weight_first``); weight: [N, K] (or [K, N] when
    ``spec.weight_in_out``); bias: added to the product ([N], or any addend that broadcasts to y) or
    None; delayed: DelayedScaling's (carrier or None, input scale, weight scale, grad_output scale),
    see delayed_state.py, else empty. Returns [..., N] ([..., N, M] for ``weight_first``).

    Under autocast the operands are cast to autocast's dtype first and the site computes in it, so
    the output dtype (and every later op) matches eager's ``linear`` under the same autocast.
    """

    def __init__(self, spec: LinearSpec) -> None:
        if not spec.recipe.per_tensor:
            quantizer_factory(spec.recipe)   # a recipe with neither path fails here, naming itself
        self.spec = spec   # all the lowering holds: fx/cache_names.py names it after a digest of it
        # FX codegen names the call after these.
        name_lowering(self, f"te_linear_{spec.recipe.name}", __name__)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 *delayed: Optional[torch.Tensor]) -> torch.Tensor:
        dtype = autocast_dtype(x)
        if dtype is None:
            return self._linear(x, weight, bias, delayed)
        x = x.to(dtype)
        if not self._casts_weight(weight):
            weight = weight.to(dtype)
        if bias is not None and bias.is_floating_point():
            bias = bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            return self._linear(x, weight, bias, delayed)

    def _casts_weight(self, weight: torch.Tensor) -> bool:
        """Does the site's autograd.Function take the weight in its own dtype and cast it to x's
        itself? The per-tensor Function does, for a plain weight: its wgrad GEMM then writes the
        weight's gradient in the weight's dtype (fp32 under autocast over fp32 weights), where a cast
        outside it would have the GEMM write bf16 and a separate kernel read that and write fp32
        (6 bytes an element: 352 MB for one 4096 x 14336 weight). The forward quantizes the same
        bf16 values either way."""
        spec = self.spec
        return (spec.recipe.per_tensor and not spec.rowwise and spec.async_tp is None
                and casts_weight_itself(weight, spec.recipe))

    def _linear(self, x, weight, bias, delayed) -> torch.Tensor:
        if self.spec.weight_first and x.dim() > 1:
            # W @ x = (x.mT @ W.T).mT; the site finder gives this form no addend
            return self._x_wt(x.mT, weight, None, delayed).mT
        return self._x_wt(x, weight, bias, delayed)

    def _x_wt(self, x, weight, bias, delayed) -> torch.Tensor:
        """x [..., K] @ w_nk.T (+ bias) -> [..., N]; on DTensors shard by shard, the bias added by
        DTensor (a row-parallel output is a partial sum: the replicated bias must be added once)."""
        spec = self.spec
        w_nk = weight.t() if spec.weight_in_out else weight
        plan = plan_linear_sharding(x, w_nk, spec.fqn)
        form = spec.async_tp
        if plan is not None and form is not None:
            y = (async_tp_column(x, [w_nk], spec.recipe, form, delayed)[0] if form.kind == "column"
                 else async_tp_row(x, w_nk, spec.recipe, form, delayed))
        elif plan is None:
            # only the per-tensor Function's GEMM takes an epilogue bias
            in_gemm, bias = split_bias(bias, x.dtype, w_nk.shape[0], spec.recipe.per_tensor and not spec.rowwise)
            y = self._local(x, w_nk, delayed, spec.amax_groups, in_gemm)
        else:
            y = sharded_linear(lambda x_, w_, groups: self._local(x_, w_, delayed, groups), x, w_nk, plan,
                               spec.amax_groups)
        return add_bias(y, bias)

    def _local(self, x, w_nk, delayed, groups, bias=None) -> torch.Tensor:
        """x [..., K] @ w_nk.T (+ bias: the epilogue's, per-tensor Function only) -> [..., N] on plain tensors."""
        x2d = x.reshape(-1, x.shape[-1])
        if not self.spec.recipe.per_tensor:
            y = QuantizedLinearFunction.apply(x2d, w_nk, quantizer_factory(self.spec.recipe), self.spec.native_gemm,
                                              groups)
        elif self.spec.rowwise:
            y = rowwise_fp8_linear(x2d, w_nk, self.spec.recipe, delayed[2] if delayed else None)
        else:
            # current scaling: no carrier and no scales
            y = Fp8LinearFunction.apply(x2d, w_nk, self.spec.recipe, groups, *(delayed or (None,) * 4), bias)
        return y.reshape(*x.shape[:-1], w_nk.shape[0])

    def __repr__(self) -> str:
        native = ", native GEMMs" if self.spec.native_gemm else ""
        return f"LinearLowering({self.spec.fqn!r}, {self.spec.recipe.name}{native})"


# ---- the per-tensor path (current and delayed scaling) ------------------------------------------------


def casts_weight_itself(weight: torch.Tensor, recipe) -> bool:
    """Whether a per-tensor Function (this one, the fused output layer's) takes ``weight`` in its own
    dtype under autocast and casts it with ``weight_in_input_dtype``: a plain tensor, or one already in
    the recipe's FP8 format (its bytes go in as they are; a cached copy of an fp32 weight, made from
    its bf16 cast, keeps fp32 as its dtype so that dw comes out of the GEMM in fp32, as for the plain
    weight). A DTensor runs shard by shard and a quantized weight of another format keeps its own
    path; their lowerings cast them first."""
    if is_dtensor(weight):
        return False
    return not isinstance(weight, QuantizedTensor) or weight_is_operand(weight, recipe)


def weight_in_input_dtype(w_nk: torch.Tensor, dtype: torch.dtype, recipe) -> torch.Tensor:
    """``w_nk`` in the input's ``dtype``: autocast's cast of the weight, made inside the Function so that
    its backward returns dw from the wgrad GEMM in the weight's own dtype (fp32 under autocast over
    fp32 weights), with no cast kernel after the GEMM. A weight already in the recipe's FP8 format is
    used as it is."""
    if w_nk.dtype == dtype or weight_is_operand(w_nk, recipe):
        return w_nk
    return w_nk.to(dtype)


class Fp8LinearFunction(torch.autograd.Function):
    """Per-tensor FP8 (current or delayed scaling). x2d: [M, K], w_nk: [N, K].

    ``groups``: per role (input, weight, grad_output) the groups whose amax all-reduce current scaling
    needs (sharded.py); NO_GROUPS in one process and for delayed scaling, whose update node
    reduces the amaxes.

    Delayed scaling passes the three roles' scales (fp32 [1] each: input, weight, grad_output), read
    only, and, when a backward follows, ``carrier``: the backward returns this call's amaxes
    [input, weight, grad_output] as the carrier's gradient, and delayed_state.py folds them into the
    state once every site's backward has run. Current scaling passes None for all four.

    ``bias`` [N]: added in the forward GEMM's epilogue (``adds_bias`` said yes), its gradient the sum
    of grad_y's rows; None where the lowering adds a bias itself.
    """

    @staticmethod
    def forward(ctx, x2d, w_nk, recipe, groups, carrier, x_scale, w_scale, g_scale, bias=None):
        w_dtype = w_nk.dtype
        w_nk = weight_in_input_dtype(w_nk, x2d.dtype, recipe)
        # delayed scaling: each amax in its cast's pass (tensor_amax's by_rows)
        x_amax = tensor_amax(x2d, by_rows=x_scale is not None)
        w_amax = None if weight_is_operand(w_nk, recipe) else tensor_amax(w_nk, by_rows=w_scale is not None)
        if x_scale is None and (groups[0] or groups[1]):
            if w_amax is None:   # a pre-quantized weight brings its (whole-weight) scale
                [x_amax] = reduce_amaxes([x_amax], groups[:1])
            else:
                x_amax, w_amax = reduce_amaxes([x_amax, w_amax], groups[:2])
        # delayed scaling: both inverses in one op (None, None under current scaling)
        x_sinv, w_sinv = scale_invs(x_scale, w_scale)
        xq, x_sinv, x_amax = quantize_per_tensor(x2d, "input", recipe, x_scale, x_amax, scale_inv=x_sinv)
        xq = xq.contiguous()
        y, wq, w_sinv, w_amax = fp8_fprop(xq, x_sinv, w_nk, recipe, w_scale, w_amax, out_dtype=x2d.dtype,
                                          w_sinv=w_sinv, bias=bias)
        ctx.recipe = recipe
        ctx.g_groups = groups[2]
        ctx.dtypes = (x2d.dtype, w_dtype)
        ctx.save_for_backward(xq, x_sinv, wq, w_sinv, torch.cat([x_amax, w_amax]),
                              *((g_scale,) if g_scale is not None else ()))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xq, x_sinv, wq, w_sinv, xw_amax, *g_scale = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g_amax = tensor_amax(grad_y, by_rows=bool(g_scale))
        if not g_scale and ctx.g_groups:
            [g_amax] = reduce_amaxes([g_amax], [ctx.g_groups])
        dx, dw, g_amax = fp8_dgrad_wgrad(
            # column_major, not operand_b, on the CPU too, as every site keeps it for x: without the copy
            # the partitioner saves other tensors for backward than on a GPU (seen under fp8_mha and in
            # the fused loss, whose tests count what is saved)
            grad_y, ctx.recipe, wq, w_sinv, x_sinv, (lambda: column_major(xq)) if ctx.needs_input_grad[1] else None,
            dx_dtype=x_dtype if ctx.needs_input_grad[0] else None, dw_dtype=w_dtype,
            g_scale=g_scale[0] if g_scale else None, g_amax=g_amax)
        carrier_grad = None
        if ctx.needs_input_grad[4]:
            carrier_grad = torch.cat([xw_amax, g_amax])
        # bias is optional: a call without it has 8 inputs
        db = grad_y.sum(0) if len(ctx.needs_input_grad) > 8 and ctx.needs_input_grad[8] else None
        return (dx, dw, None, None, carrier_grad, None, None, None, db)[:len(ctx.needs_input_grad)]


# ---- the quantizer path (block-scaled recipes, CustomRecipe) -------------------------------------

# Linear layers on quantizer objects: the block-scaled recipes (MXFP8, Float8 block, NVFP4) and
# CustomRecipe. x2d: [M, K], w_nk: [N, K].
#
# Every GEMM gets each operand in the copy whose blocks run along that GEMM's contraction dim:
# - fprop  y  = x @ w.T  : x rowwise (blocks along K), w rowwise (along K)
# - dgrad  dx = g @ w    : g rowwise (along N),        w columnwise (along N)
# - wgrad  dw = g.T @ x  : g columnwise (along M),     x columnwise (along M)
# The forward quantizes the columnwise copies of x and w and saves only those (the quantized bytes,
# not the high-precision tensors). Columnwise operands get their token dim M padded with zero rows to
# a multiple of 16 (NVFP4's block): zero rows change no block amax and add nothing to dw.
#
# GEMMs: with ``native`` (the backend sets it where gemm/block_probe.py found the device runs the format
# natively) each GEMM goes to F.scaled_mm through gemm.block.native_block_gemm; otherwise, and for the
# pairs scaled_mm lacks (E5M2 operands, two 128x128-tiled Float8 operands), both operands are
# dequantized to fp32 and multiplied (gemm.block.dequantized_gemm), which the report calls "emulated".

# NVFP4's columnwise blocks run along M in groups of 16; the other formats accept any M.
_COLUMNWISE_ROW_MULTIPLE = 16


def _quantize(factory: Callable[[str], Quantizer], role: str, t: torch.Tensor, *, rowwise: bool = True,
              columnwise: bool = False, groups=NO_GROUPS):
    """``quantize_copies`` with the groups of ``role`` among the per-role ``groups`` (GEMM_ROLES)."""
    return quantize_copies(factory, role, t, rowwise=rowwise, columnwise=columnwise,
                           amax_groups=groups[GEMM_ROLES.index(role)])


def _weight_operand(factory: Callable[[str], Quantizer], w_nk: torch.Tensor, *, columnwise: bool, groups):
    """The weight's quantized copies for this call, as a storage object.

    A weight that already is a tensor of the weight quantizer's format (an FP8 primary weight,
    te_compile/primary_weights.py) is used as it is: a new storage over its buffers (so that dropping
    a copy for saving leaves the parameter whole), the columnwise copy derived where the format
    allows. Anything else is quantized here; another quantized format is dequantized first.
    """
    quantizer = factory("weight")
    if isinstance(w_nk, QuantizedTensor) and getattr(quantizer, "matches", lambda t: False)(w_nk):
        storage = quantizer._storage_cls(shape=w_nk.shape, dtype=w_nk.dtype, **w_nk._fields())
        storage.update_usage(rowwise_usage=True, columnwise_usage=columnwise or None)
        return storage
    if isinstance(w_nk, QuantizedTensor):
        w_nk = w_nk.dequantize()
    return _quantize(factory, "weight", w_nk, columnwise=columnwise, groups=groups)


def _gemm(native: bool, a, b, *, transpose_a: bool = False, transpose_b: bool = False,
          out_dtype: torch.dtype) -> torch.Tensor:
    """op(a) @ op(b): natively where allowed, else the exact emulation."""
    if native and native_pair_supported(a, b):
        return native_block_gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)
    return dequantized_gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = (-t.shape[0]) % _COLUMNWISE_ROW_MULTIPLE
    return F.pad(t, (0, 0, 0, pad)) if pad else t


class QuantizedLinearFunction(torch.autograd.Function):
    """y = x2d @ w_nk.T with every GEMM operand quantized by ``factory(role)``; ``native``: run the
    GEMMs through F.scaled_mm (only where gemm/block_probe.py says the device can); ``groups``: per role,
    where the tensor-level amax is all-reduced on shards (sharded.py)."""

    @staticmethod
    def forward(ctx, x2d, w_nk, factory, native=False, groups=NO_GROUPS):
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        qx = _quantize(factory, "input", x2d, groups=groups)
        # Both weight copies in one call: formats with 2-D weight tiles (Float8 block 128x128, NVFP4
        # 16x16) then transpose the rowwise copy instead of quantizing w twice.
        qw = _weight_operand(factory, w_nk, columnwise=needs_dx, groups=groups)
        x_quantizer = factory("input")
        if hasattr(x_quantizer, "qgemm"):  # a custom recipe may bring its own GEMM
            y = x_quantizer.qgemm(qx, qw, out_dtype=x2d.dtype)
        else:
            y = _gemm(native, qx, qw, transpose_b=True, out_dtype=x2d.dtype)
        # Backward operands: x along M for wgrad, w along N for dgrad; None when not needed.
        qx_col = (_quantize(factory, "input", _pad_rows(x2d), rowwise=False, columnwise=True, groups=groups)
                  if needs_dw else None)
        qw_col = None
        if needs_dx:
            qw.update_usage(rowwise_usage=False)  # save only the copy dgrad reads
            qw_col = qw
        tensors, ctx.objects = prepare_for_saving(qx_col, qw_col)
        ctx.save_for_backward(*tensors)
        ctx.factory = factory
        ctx.native = native
        ctx.groups = groups
        ctx.dtypes = (x2d.dtype, w_nk.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        qx_col, qw_col = restore_from_saved(ctx.objects, ctx.saved_tensors)
        x_dtype, w_dtype = ctx.dtypes
        factory = ctx.factory
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qg = _quantize(factory, "grad_output", grad_y, groups=ctx.groups)
            dx = _gemm(ctx.native, qg, qw_col, out_dtype=x_dtype)
        if ctx.needs_input_grad[1]:
            qg_col = _quantize(factory, "grad_output", _pad_rows(grad_y), rowwise=False, columnwise=True,
                               groups=ctx.groups)
            dw = _gemm(ctx.native, qg_col, qx_col, transpose_a=True, out_dtype=w_dtype)
        return dx, dw, None, None, None
