"""Tensor-parallel FP8 linears in the form inductor's micro-pipeline TP pass fuses (async TP).

Under sequence parallelism (torchtitan's and torch's plans: activations Shard(d) along the sequence
between blocks) a column-parallel linear first all-gathers its input and a row-parallel linear
reduce-scatters its output. Done by DTensor, the all-gather moves the high-precision activation and
te's FP8 GEMM follows a quantize, so nothing matches what ``micro_pipeline_tp_pass`` looks for. Here
each linear issues its own collectives, on FP8 data, next to ``aten._scaled_mm``:

    column: x [.., S/R, .., K] (Shard(d) on the TP dim), w [N/R, K] (Shard(0))
        amax(x), amax(w) all-reduced (MAX) over the TP group: one process's scales, one process's bytes
        x8 = all_gather(quantize(x), d)          E4M3, 1 byte per element on the wire (half of bf16)
        y [.., S, .., N/R] = reshape -> _scaled_mm(x8, w8) -> reshape        (fused_all_gather_scaled_matmul)
      backward: dgrad [.., S, .., K] = _scaled_mm(g8, w8), reduce_scatter(d) -> dx [.., S/R, .., K];
                wgrad [N/R, K] = g8ᵀ @ x8 (the gathered x8, saved)
    row: x [.., S, .., K/R] (Shard(-1)), w [N, K/R] (Shard(1))
        y [.., S/R, .., N] = reduce_scatter(reshape -> _scaled_mm(x8, w8) -> reshape, d)
                                                                          (fused_scaled_matmul_reduce_scatter)
      backward: g8 = all_gather(quantize(g), d) (E5M2 under HYBRID; current scaling all-reduces its amax first);
                dgrad = _scaled_mm(g8, w8) [.., S, .., K/R]; wgrad = g8ᵀ @ x8

The collectives are written as torch's functional collectives write them (``all_gather_tensor`` and
``reduce_scatter_tensor`` with a non-zero dim: chunk and cat around the dim-0 collective), which is
the form the pass's patterns describe. Gloo has no FP8 all-gather: there the bytes travel as uint8
views, which the pass does not fuse (it needs NCCL and symmetric memory anyway); the numbers are the
same. Where the pass does not fuse (no symmetric memory for the group), the collectives still run
in FP8, before the GEMM.

Per-tensor recipes: Float8CurrentScaling all-reduces the amaxes before quantizing; DelayedScaling
quantizes with its state's scales and leaves the amaxes to the graph's update, which reduces them
over the TP dim among its groups. The passes leave block-scaled recipes on DTensor's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...distributed import AmaxGroup, mesh_dim_group, reduce_amaxes
from ...gemm.per_tensor import column_major, quantize_weight, scaled_mm
from ...gemm.operands import weight_is_operand
from ...scaling import quantize_per_tensor, tensor_amax

__all__ = ["AsyncTp", "async_tp_column", "async_tp_row", "all_gather_seq", "reduce_scatter_seq"]


@dataclass(frozen=True)
class AsyncTp:
    """A site's async-TP form: ``kind`` "column" (all-gather in front) or "row" (reduce-scatter
    behind), ``dim`` the sequence dim of x (non-negative, not the last), ``mesh_dim`` the TP dim."""

    kind: str
    dim: int
    mesh_dim: int


def _type_erased(group: AmaxGroup) -> bool:
    """Whether FP8 must travel as uint8 on ``group``: gloo has no FP8 collectives."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_backend(_resolve_process_group(group.name)) == "gloo"


def all_gather_seq(x: torch.Tensor, dim: int, group: AmaxGroup) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` (rank order), as funcol's ``all_gather_tensor``
    computes it: a dim-0 all-gather, then its R chunks concatenated along ``dim``."""
    fp8 = x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and _type_erased(group)
    data = x.contiguous().view(torch.uint8) if fp8 else x.contiguous()
    out = torch.ops._c10d_functional.all_gather_into_tensor.default(data, group.size, group.name)
    out = torch.ops._c10d_functional.wait_tensor.default(out)
    if dim != 0:
        out = torch.cat(torch.chunk(out, group.size, dim=0), dim=dim)
    return out.view(x.dtype) if fp8 else out


def reduce_scatter_seq(y: torch.Tensor, dim: int, group: AmaxGroup) -> torch.Tensor:
    """This rank's part along ``dim`` of the sum of the ranks' ``y``, as funcol's
    ``reduce_scatter_tensor`` computes it: the R chunks along ``dim`` stacked on dim 0, then a dim-0
    reduce-scatter."""
    if dim != 0:
        y = torch.cat(torch.chunk(y, group.size, dim=dim))
    out = torch.ops._c10d_functional.reduce_scatter_tensor.default(y.contiguous(), "sum", group.size, group.name)
    return torch.ops._c10d_functional.wait_tensor.default(out)


def _mm(a8: torch.Tensor, b8_nk: torch.Tensor, a_sinv, b_sinv, out_dtype) -> torch.Tensor:
    """a8 [..., K] @ b8_nk [N, K].T -> [..., N]: reshape, ``_scaled_mm``, reshape (the pass's ND form)."""
    y = scaled_mm(a8.reshape(-1, a8.shape[-1]), b8_nk.t(), a_sinv, b_sinv, out_dtype)
    return y.reshape(*a8.shape[:-1], b8_nk.shape[0])


def _rows_column_major(x8: torch.Tensor, shared: bool = False) -> torch.Tensor:
    """x8 [..., K] as the [rows, K] column-major operand of a wgrad (``shared``: several read it)."""
    return column_major(x8.reshape(-1, x8.shape[-1]), shared=shared)


def _wgrad(g8: torch.Tensor, x_cm: torch.Tensor, g_sinv, x_sinv, dtype) -> torch.Tensor:
    """g8 [..., N]ᵀ @ x [rows, K] -> [N, K] over every leading position; ``x_cm`` from
    ``_rows_column_major``, made once however many wgrads read it (inductor would write one copy per
    reader)."""
    g2 = g8.reshape(-1, g8.shape[-1])
    return scaled_mm(g2.t().contiguous(), x_cm, g_sinv, x_sinv, dtype)


def _operands(x, ws, recipe, group, x_scale, w_scale):
    """The forward's FP8 operands: (xq, x_sinv, [wq], [w_sinv], this rank's amaxes [x, w] for
    DelayedScaling's carrier or None). Current scaling all-reduces the amaxes over ``group`` first (a
    weight that arrives quantized, FSDP2's FP8 all-gather, brings its whole scale); DelayedScaling
    quantizes with the state's scales and keeps the local amaxes, which its update reduces."""
    w_amaxes = [None if weight_is_operand(w, recipe) else tensor_amax(w) for w in ws]
    x_amax = tensor_amax(x)
    if x_scale is None:
        present = [i for i, a in enumerate(w_amaxes) if a is not None]
        reduced = reduce_amaxes([x_amax, *(w_amaxes[i] for i in present)], [(group,)] * (1 + len(present)))
        x_amax = reduced[0]
        for i, amax in zip(present, reduced[1:]):
            w_amaxes[i] = amax
    xq, x_sinv, x_amax = quantize_per_tensor(x, "input", recipe, x_scale, x_amax)
    wqs, w_sinvs, recorded = [], [], None
    for w, amax in zip(ws, w_amaxes):
        wq, w_sinv, amax = quantize_weight(w, recipe, w_scale, amax)
        wqs.append(wq.contiguous())
        w_sinvs.append(w_sinv)
        if x_scale is not None:
            recorded = torch.cat([x_amax, amax])
    return xq, x_sinv, wqs, w_sinvs, recorded


def _grad_operand(g, recipe, group, g_scale):
    """(gq, g_sinv, this rank's amax [1]) of a gradient split over ``group``: its amax all-reduced
    under current scaling, the state's scale under DelayedScaling."""
    amax = tensor_amax(g)
    if g_scale is None:
        [amax] = reduce_amaxes([amax], [(group,)])
    gq, g_sinv, amax = quantize_per_tensor(g, "grad_output", recipe, g_scale, amax)
    return gq, g_sinv, amax


class _Column(torch.autograd.Function):
    """Column-parallel sites reading one sequence-sharded x: one FP8 all-gather of x for all of them
    (ColwiseParallel's wq, wk, wv read one norm output), then a GEMM per weight. Backward: the sites'
    dgrads summed, then one reduce-scatter. DelayedScaling (one site: x's scale is the site's own)
    passes ``carrier`` and the input, weight and grad_output scales, as Fp8LinearFunction takes them;
    current scaling passes None for all four."""

    @staticmethod
    def forward(ctx, x, recipe, dim, group, carrier, x_scale, w_scale, g_scale, *ws):
        xq, x_sinv, wqs, w_sinvs, recorded = _operands(x, ws, recipe, group, x_scale, w_scale)
        x8 = all_gather_seq(xq.contiguous(), dim, group)
        ctx.recipe, ctx.dim, ctx.group, ctx.dtypes = recipe, dim, group, (x.dtype, [w.dtype for w in ws])
        ctx.delayed = recorded is not None
        ctx.save_for_backward(x8, x_sinv, *wqs, *w_sinvs, *((recorded, g_scale) if ctx.delayed else ()))
        return tuple(_mm(x8, wq, x_sinv, w_sinv, x.dtype) for wq, w_sinv in zip(wqs, w_sinvs))

    @staticmethod
    def backward(ctx, *gs):
        x8, x_sinv, *rest = ctx.saved_tensors
        n = len(gs)
        wqs, w_sinvs, delayed = rest[:n], rest[n:2 * n], rest[2 * n:]
        g_scale = delayed[1] if delayed else None
        dx, dws, g_amax = None, [], None
        x_cm = _rows_column_major(x8, shared=True) if any(ctx.needs_input_grad[8 + i] for i in range(n)) else None
        for i, (g, wq, w_sinv) in enumerate(zip(gs, wqs, w_sinvs)):
            gq, g_sinv, g_amax = _grad_operand(g, ctx.recipe, ctx.group, g_scale)   # g is split along N
            if ctx.needs_input_grad[0]:
                part = _mm(gq, column_major(wq).t(), g_sinv, w_sinv, ctx.dtypes[0])
                dx = part if dx is None else dx + part
            dws.append(_wgrad(gq, x_cm, g_sinv, x_sinv, ctx.dtypes[1][i]) if ctx.needs_input_grad[8 + i] else None)
        if dx is not None:
            dx = reduce_scatter_seq(dx, ctx.dim, ctx.group)
        carrier_grad = torch.cat([delayed[0], g_amax]) if delayed and ctx.needs_input_grad[4] else None
        return (dx, None, None, None, carrier_grad, None, None, None, *dws)


class _Row(torch.autograd.Function):
    """A row-parallel site whose output is reduce-scattered along the sequence; delayed arguments as
    _Column's."""

    @staticmethod
    def forward(ctx, x, w, recipe, dim, group, carrier, x_scale, w_scale, g_scale):
        xq, x_sinv, [wq], [w_sinv], recorded = _operands(x, [w], recipe, group, x_scale, w_scale)
        xq = xq.contiguous()
        ctx.recipe, ctx.dim, ctx.group, ctx.dtypes = recipe, dim, group, (x.dtype, w.dtype)
        ctx.delayed = recorded is not None
        ctx.save_for_backward(xq, x_sinv, wq, w_sinv, *((recorded, g_scale) if ctx.delayed else ()))
        return reduce_scatter_seq(_mm(xq, wq, x_sinv, w_sinv, x.dtype), dim, group)

    @staticmethod
    def backward(ctx, g):
        xq, x_sinv, wq, w_sinv, *delayed = ctx.saved_tensors
        gq, g_sinv, g_amax = _grad_operand(g, ctx.recipe, ctx.group, delayed[1] if delayed else None)
        g8 = all_gather_seq(gq.contiguous(), ctx.dim, ctx.group)   # g is split along the sequence
        dx = _mm(g8, column_major(wq).t(), g_sinv, w_sinv, ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        dw = _wgrad(g8, _rows_column_major(xq), g_sinv, x_sinv, ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        carrier_grad = torch.cat([delayed[0], g_amax]) if delayed and ctx.needs_input_grad[5] else None
        return dx, dw, None, None, None, carrier_grad, None, None, None


def async_tp_column(x, ws_nk, recipe, form: AsyncTp, delayed: tuple = ()) -> list:
    """x @ w.T for each DTensor weight ``w`` of ``ws_nk`` (each Shard(0) on the TP dim), x
    sequence-sharded on it: one FP8 all-gather for all (module docstring). DTensors, Shard(-1).
    ``delayed``: DelayedScaling's (carrier, input, weight, grad_output scales) of a single site."""
    from torch.distributed.tensor import Shard

    mesh = ws_nk[0].device_mesh
    group = mesh_dim_group(mesh, form.mesh_dim)
    ys = _Column.apply(x.to_local(), recipe, form.dim, group, *(delayed or (None,) * 4),
                       *(w.to_local() for w in ws_nk))
    placements = list(x.placements)
    placements[form.mesh_dim] = Shard(x.dim() - 1)
    return [_global(y, x, w, mesh, placements) for y, w in zip(ys, ws_nk)]


def async_tp_row(x, w_nk, recipe, form: AsyncTp, delayed: tuple = ()):
    """x @ w_nk.T, x Shard(-1) and w Shard(1) on the TP dim, reduce-scattered to Shard(dim) (module
    docstring). A DTensor. ``delayed`` as async_tp_column's."""
    from torch.distributed.tensor import Shard

    mesh = w_nk.device_mesh
    group = mesh_dim_group(mesh, form.mesh_dim)
    y = _Row.apply(x.to_local(), w_nk.to_local(), recipe, form.dim, group, *(delayed or (None,) * 4))
    placements = list(x.placements)
    placements[form.mesh_dim] = Shard(form.dim)
    return _global(y, x, w_nk, mesh, placements)


def _global(y_local, x, w_nk, mesh, placements):
    """``y_local`` as the DTensor [..., N] of x @ w_nk.T."""
    from torch.distributed.tensor import DTensor

    shape = torch.Size((*x.shape[:-1], w_nk.shape[0]))
    return DTensor.from_local(y_local, mesh, placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())
