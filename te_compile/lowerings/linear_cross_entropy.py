"""What a fused output layer and loss calls: ``LinearCrossEntropyLowering(spec)(x, w, b, labels, *state)``.

The backend replaces ``cross_entropy(cap(linear(x, w, b)).view(-1, V), labels)`` (passes/linear_cross_
entropy.py says which spellings) by one op that walks the tokens in chunks of rows. Per chunk:

    z = x_c @ w.T + b                  the output layer, [c, V] in x's dtype (FP8 GEMM or high precision)
    z' = steps(z)                      the casts and soft-caps between the layer and the loss, in order
    loss_c = sum over rows of (1 - eps) * (lse - z'[label]) + eps * (lse - mean(z'))     (fp32)

and, when a backward will follow (grad enabled and an input requiring grad), the chunk's gradient for
an upstream loss gradient of 1, while its logits are at hand (Liger-Kernel's fused linear cross
entropy): dz_u = (softmax - (1 - eps) * onehot - eps / V) * dloss_u through the steps backwards, with
dloss_u = 1 / n_valid under ``mean`` and 1 under ``sum``, quantized to the grad_output FP8 format
(E5M2 under HYBRID) under FP8, and its column sums for the bias gradient. The chunks' dz_u are written
into one [tokens, V] buffer (one byte a logit under FP8, the layer's dtype without) that the forward
saves, with the layer's (FP8) input and weight: never a chunk's logits. The backward recomputes
nothing: the loss's gradient g (a scalar: the loss is one) scales the GEMMs, folded into the FP8
GEMMs' scale_inv (no pass over the [tokens, V] buffer): one input-gradient GEMM dx = dz_u @ w * g and
one weight-gradient GEMM dw = dz_u.T @ x * g, each over every row, and db = g * the column sums.
Without a backward the forward computes no dz.

Numerics, against the unfused path of the same precision:
- The forward GEMM reads the unfused path's operands: under FP8 the input's and weight's scales come
  from the whole tensors (quantized once, before chunking), so every chunk reads the same bytes and
  scales. Its logits are then the unfused ones bit for bit wherever the GEMM library computes a row
  independently of how many rows it is given (seen on CPU for equal chunks, as the tests use); MKL
  takes another kernel for some row counts (e.g. 34 rows against 7), which moves the last bit.
- Each chunk gives its rows' logsumexp and target logit in fp32; the row losses are summed once every
  chunk is done, as the unfused path sums them: equal up to fp32 rounding of the per-row terms. The
  loss has the dtype the unfused ``cross_entropy`` would return (its input's).
- FP8 gradients: the unfused path quantizes dz with its own amax, known only once all of dz exists;
  the forward must quantize each chunk as it goes (keeping [tokens, V] in the layer's dtype until the
  last chunk would undo the fusion's memory saving). Current scaling therefore uses one scale for
  all chunks from a bound: every |dz_u| <= dloss_u (softmax minus a smoothed one-hot lies in [-1, 1],
  a soft-cap's derivative in [0, 1]), scale = fp8_max / dloss_u. The real amax is (1 - p(label)) *
  dloss_u for the row whose label is least likely (without smoothing or soft-cap), so the bound is
  above it by log2(1 / max(1 - p(label))) binades: almost none while any token is still mispredicted
  (a trained model's hardest token), and the largest gradients never overflow. The gradient is not
  the unfused path's bit for bit (another scale, another rounding), and it gives up that many binades
  at the low end of the format's range: nothing that matters for E5M2's wide range, at most that much
  of E4M3's. An exact amax-based scale would need every chunk's logits before the first is quantized:
  the recompute this design removes, or a second pass over the [tokens, V] buffer in the layer's dtype.
  DelayedScaling quantizes with its grad_output scale, as the unfused site does, and records the amax
  of what it quantizes: dz_u, the gradient for an upstream gradient of 1 (the real one scales the
  GEMMs' outputs, never the FP8 bytes). Its gradients are the unfused ones bit for bit when that
  upstream gradient is 1 (a plain loss.backward()).
- The backward's scalar g: a power of two gives g times the g = 1 gradients bit for bit; any other
  value the rounding of one more fp32 product (g * scale_inv) in each GEMM's operand scaling.
- ``ignore_index`` rows add nothing to the loss and get zero gradients; with every row ignored,
  ``mean`` gives nan and ``sum`` 0, with zero gradients, as torch does.
- Memory: the [tokens, V] gradient (1 GB in FP8 at Llama 3's head: 8192 tokens, V 128256) lives from
  the forward to the backward, where the recomputing design held it during the backward only; the
  backward holds no chunk's logits and no softmax. In high precision under torch.compile the
  partitioner runs the GEMMs that read dz_u in the forward (g enters only as a final multiply) and
  saves their [tokens, K] and [V, K] products instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F

from ..autocast import autocast_dtype
from ..distributed import is_dtensor, reduce_amaxes
from ..fx.cache_names import name_lowering
from ..gemm.per_tensor import add_bias, column_major, fp8_gemm, operand_a, quantize_weight, split_bias
from ..kernels.norm_quantize import norm_backward, norm_forward_reference, norm_quantize, norm_stats
from ..norm_spec import NormSpec
from ..gemm.operands import weight_is_operand
from ..recipe import Recipe
from ..scaling import cast_to_fp8, current_scale, fp8_max, quantize_per_tensor, tensor_amax
from .linear import casts_weight_itself, weight_in_input_dtype
from .vocab_parallel import VocabShard, combine_row_stats, plan_vocab_parallel

__all__ = ["LinearCrossEntropySpec", "LinearCrossEntropyLowering", "LinearCrossEntropyFunction", "chunk_rows",
           "size_hint"]

# a chunk's logits are kept about as large as the layer's input (Liger-Kernel's rule): rows = M * K / V,
# rounded up to a power of two, never fewer than 16, and never so few that a chunk holds under 2**22
# logits (16 MiB in fp32): smaller chunks save no memory worth their unrolled GEMMs' compile time
_MIN_CHUNK = 16
_MIN_CHUNK_LOGITS = 1 << 22


@dataclass(frozen=True)
class LinearCrossEntropySpec:
    """Everything about a fused site the lowering needs that is not a tensor."""

    fqn: str
    recipe: Optional[Recipe]          # a per-tensor recipe, or None: high precision
    # the casts ("cast", dtype) and soft-caps ("softcap", c: c * tanh(z / c)) between the layer's output
    # and the loss, in order
    steps: tuple[tuple[str, object], ...] = ()
    ignore_index: int = -100
    reduction: str = "mean"           # "mean" or "sum"
    label_smoothing: float = 0.0
    chunk: int = 0                    # rows per chunk; 0: chosen from the shapes (``chunk_rows``)
    # the logits are also returned (a model output), after this many of ``steps``; -1: not returned
    logits_steps: int = -1
    weight_in_out: bool = False       # the weight is [K, V] (x @ W)
    # the final norm fused in front (FP8 only): x is then the norm's input, quantized by the norm
    # kernels as a fused norm's linears read it (lowerings/norm_fusion.py); its casts included
    norm: Optional[NormSpec] = None


def chunk_rows(m: int, k: int, v: int, chunk: int = 0) -> int:
    """Rows per chunk for ``m`` tokens of width ``k`` and ``v`` classes: ``chunk`` when set, else the
    power of two at or above m * k / v (a chunk's logits about as large as the input), at least 16
    rows and 2**22 logits, at most m."""
    if chunk > 0:
        return max(1, min(chunk, m))
    rows = 1 << max(0, math.ceil(math.log2(max(1, -(-m * k // v)))))
    return max(1, min(m, max(_MIN_CHUNK, -(-_MIN_CHUNK_LOGITS // v), rows)))


def size_hint(n) -> int:
    """A concrete row count for a possibly symbolic one (the chunk count is fixed at trace time)."""
    if isinstance(n, torch.SymInt):
        return n.node.hint if n.node.hint is not None else 8192
    return int(n)


def _apply_steps(z: torch.Tensor, steps) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the loss's input, the soft-caps' tanh outputs in order) from the layer's output ``z``."""
    tanhs = []
    for kind, value in steps:
        if kind == "cast":
            z = z.to(value)
        else:   # softcap
            t = torch.tanh(z / value)
            tanhs.append(t)
            z = t * value
    return z, tanhs


def _steps_backward(dz: torch.Tensor, z: torch.Tensor, steps, tanhs: list[torch.Tensor]) -> torch.Tensor:
    """The gradient of the layer's output from that of the loss's input, through ``steps`` backwards:
    a cast hands the gradient back in the dtype before it (as autograd does), a soft-cap multiplies by
    1 - tanh²."""
    dtypes = [z.dtype]
    for kind, value in steps:
        dtypes.append(value if kind == "cast" else dtypes[-1])
    for i in range(len(steps) - 1, -1, -1):
        kind, _ = steps[i]
        if kind == "cast":
            dz = dz.to(dtypes[i])
        else:
            t = tanhs.pop()
            dz = (dz * (1 - t * t)).to(dtypes[i])
    return dz


def _local_labels(labels: torch.Tensor, valid: torch.Tensor, v_local: int, shard: Optional[VocabShard]):
    """(column of each row's label in these logits [c], whether it is one of them [c]): all valid rows
    in one process; under vocab parallelism only the labels in this rank's shard."""
    if shard is None:
        return torch.where(valid, labels, 0), valid
    local = labels - shard.offset
    hit = valid & (local >= 0) & (local < v_local)
    return torch.where(hit, local, 0), hit


def _is_label(z: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """bool [c, V]: where each row's label column is, for logits z [c, V] and columns [c]."""
    return torch.arange(z.shape[-1], device=z.device) == column[:, None]


def _row_stats(zl: torch.Tensor, labels: torch.Tensor, spec: LinearCrossEntropySpec, shard: Optional[VocabShard]):
    """One chunk's per-row values over the logits it holds, fp32 [c] each: (logsumexp, the target logit
    (0 where the label is elsewhere or ignored), the logits' sum or None without label smoothing)."""
    zf = zl.float()
    lse = torch.logsumexp(zf, dim=-1)
    column, hit = _local_labels(labels, labels != spec.ignore_index, zf.shape[-1], shard)
    # the label's logit as a row sum of one value and zeros (exactly that value): a reduction over the
    # row like the logsumexp, which inductor computes in the same kernel; a gather would be a kernel
    # of its own per chunk
    target = torch.where(hit, torch.where(_is_label(zf, column), zf, 0.0).sum(dim=-1), 0.0)
    return lse, target, (zf.sum(dim=-1) if spec.label_smoothing else None)


def _row_losses(lse, target, zsum, valid, vocab: int, spec: LinearCrossEntropySpec):
    """From the whole rows' values (fp32 [M]): the loss terms, 0 for ignored rows."""
    loss = lse - target
    if spec.label_smoothing:
        eps = spec.label_smoothing
        loss = (1 - eps) * loss + eps * (lse - zsum / vocab)
    return torch.where(valid, loss, 0.0)


def _logit_grad(zl: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, dloss: torch.Tensor,
                spec: LinearCrossEntropySpec, shard: Optional[VocabShard]) -> torch.Tensor:
    """d loss / d z' for one chunk's logits, fp32 [c, V] (this rank's [c, V / R] columns under vocab
    parallelism): (softmax - (1 - eps) onehot - eps / V) * dloss, zero for ignored rows."""
    zf = zl.float()
    dz = torch.exp(zf - lse[:, None])
    eps = spec.label_smoothing
    column, hit = _local_labels(labels, valid, zf.shape[-1], shard)
    # the one-hot term as a comparison inside the same elementwise pass: a scattered zeros buffer
    # would be a [c, V] fp32 write and a scatter kernel per chunk (4.2 GB at Llama 3's head)
    dz = dz - torch.where(_is_label(zf, column), torch.where(hit, 1.0 - eps, 0.0)[:, None], 0.0)
    if eps:
        dz = dz - eps / (shard.vocab if shard is not None else zf.shape[-1])
    return dz * torch.where(valid, dloss, 0.0)[:, None]


class LinearCrossEntropyFunction(torch.autograd.Function):
    """The chunked output layer and loss. x2d [M, K], w_nk [V, K], bias [V] or None, labels int [M].

    ``shard``: this rank's vocab slice when the weight is sharded by vocab (vocab_parallel.py; w_nk and
    bias are then the local rows), else None. ``x_full``: the layer's whole input when x2d holds only
    the rows the loss reads (the causal shift), its amax taken for x2d's scale; else None. ``grads``:
    (dx, dw, db) wanted, each a bool, when a backward will follow (the forward then computes the
    logits' gradient chunk by chunk), else None. DelayedScaling passes its carrier and the three roles'
    scales as the linears do (the backward returns [input, weight, grad_output] amaxes as the
    carrier's gradient); otherwise None for all four. Returns (loss, logits [M, V] or None): the
    logits only when ``spec.logits_steps`` >= 0, as a non-differentiable output (nothing reads them
    for the loss's gradient).
    """

    @staticmethod
    def forward(ctx, x2d, w_nk, bias, labels, norm_w, norm_b, spec, chunks, shard, x_full, grads, carrier, x_scale,
                w_scale, g_scale):
        recipe = spec.recipe
        ctx.spec, ctx.chunks, ctx.grads = spec, chunks, grads
        ctx.has_norm = (norm_w is not None, norm_b is not None)
        # the layer's input dtype: the norm's output dtype when a norm is fused in front
        ctx.dtypes = (x2d.dtype if spec.norm is None else spec.norm.out_dtype, w_nk.dtype,
                      None if bias is None else bias.dtype)
        if recipe is not None and spec.norm is None:   # autocast's cast of the weight, left to us
            w_nk = weight_in_input_dtype(w_nk, x2d.dtype, recipe)
        x_sinv = w_sinv = x_amax = w_amax = mean = rstd = None
        operands = (x2d, w_nk)
        if recipe is not None:
            operands, x_sinv, w_sinv, x_amax, w_amax, mean, rstd = _fp8_operands(
                x2d, w_nk, norm_w, norm_b, spec, shard, x_full, x_scale, w_scale)
        valid = labels != spec.ignore_index
        n_valid = valid.sum()
        g_sinv = None
        if grads is not None:
            # the loss's gradient for an upstream gradient of 1; the backward scales by the real one
            dloss = torch.ones((), dtype=torch.float32, device=x2d.device)
            if spec.reduction == "mean":
                dloss = dloss / n_valid.clamp(min=1)
            if recipe is not None:
                if g_scale is None:
                    # every |dz| <= dloss (module docstring): one scale for all chunks, known before any
                    g_scale = fp8_max(recipe.fp8_format.dtype_for("grad_output")) / dloss.reshape(1)
                g_sinv = torch.div(torch.ones_like(g_scale), g_scale)
        logits, stats, gs, db, g_amax, row_amaxes = [], [], [], None, None, []
        for xc, lc in zip(operands[0].tensor_split(chunks), labels.tensor_split(chunks)):
            z = _logits(xc, operands[1], x_sinv, w_sinv, bias, ctx.dtypes[0],
                        fast_accum=recipe is not None and recipe.fast_accumulation("fprop"))
            if spec.logits_steps >= 0:
                logits.append(_apply_steps(z, spec.steps[:spec.logits_steps])[0])
            zl, tanhs = _apply_steps(z, spec.steps)
            stat = _row_stats(zl, lc, spec, shard)
            if grads is None:
                stats.append(stat)
                continue
            if shard is not None:   # the chunk's whole-row logsumexp before its gradient, [c]-sized all-reduces
                stat = combine_row_stats(*stat, shard)
            stats.append(stat)
            dzl = _logit_grad(zl, stat[0], lc, lc != spec.ignore_index, dloss, spec, shard)
            dz = _steps_backward(dzl.to(zl.dtype), z, spec.steps, tanhs)   # [c, V] in the layer's dtype
            if grads[2]:
                part = dz.float().sum(0)
                db = part if db is None else db + part
            if recipe is not None:
                if carrier is not None:
                    # DelayedScaling records the amax of what it quantizes: per row here, inside the
                    # chunk's kernel, reduced once after the last chunk (a whole-chunk amax would end
                    # in a one-element kernel per chunk)
                    row_amaxes.append(dz.detach().abs().amax(dim=-1).to(torch.float32))
                dz = cast_to_fp8(dz, g_scale, recipe.fp8_format.dtype_for("grad_output")).contiguous()
            gs.append(dz)
        if row_amaxes:   # with a 0, as tensor_amax does for a row count that may be 0 at run time
            g_amax = torch.cat([*row_amaxes, row_amaxes[0].new_zeros(1)]).amax().reshape(1)
        lse, target = torch.cat([s[0] for s in stats]), torch.cat([s[1] for s in stats])
        zsum = torch.cat([s[2] for s in stats]) if spec.label_smoothing else None
        if shard is not None and grads is None:   # this rank's vocab slice -> the whole rows, [M]-sized all-reduces
            lse, target, zsum = combine_row_stats(lse, target, zsum, shard)
        rows = _row_losses(lse, target, zsum, valid, w_nk.shape[0] if shard is None else shard.vocab, spec)
        out_dtype = ctx.dtypes[0]
        for kind, value in spec.steps:
            out_dtype = value if kind == "cast" else out_dtype
        loss = rows.sum() / n_valid if spec.reduction == "mean" else rows.sum()
        if grads is not None:
            # every chunk's gradient in one [M, V] buffer (one byte a logit under FP8), each written once:
            # the backward's dgrad and wgrad GEMMs each read all of it.
            # Autocast, when the op runs under it, has no rule for concatenating FP8 tensors.
            with torch.autocast(x2d.device.type, enabled=False):
                g_all = torch.cat(gs)
            keep = dict(x=operands[0], x_sinv=x_sinv, w=operands[1], w_sinv=w_sinv, g=g_all, g_sinv=g_sinv, db=db,
                        xw_amax=None if carrier is None else torch.cat([x_amax, w_amax]), g_amax=g_amax)
            if spec.norm is not None:
                keep.update(norm_x=x2d, norm_w=norm_w, mean=mean, rstd=rstd)
            ctx.names = tuple(k for k, v in keep.items() if v is not None)
            ctx.save_for_backward(*(v for v in keep.values() if v is not None))
        out = torch.cat(logits) if spec.logits_steps >= 0 else None
        if out is not None:
            ctx.mark_non_differentiable(out)
        return loss.to(out_dtype), out

    @staticmethod
    def backward(ctx, grad_loss, _grad_logits):
        spec, recipe = ctx.spec, ctx.spec.recipe
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        saved = dict(zip(ctx.names, ctx.saved_tensors))
        need_dx, need_dw, need_db = ctx.grads
        dx_dtype = torch.float32 if spec.norm is not None else x_dtype   # a fused norm's backward reads fp32
        x, w, g_all = saved["x"], saved["w"], saved["g"]
        # the forward's gradient is for an upstream gradient of 1: the real one [] scales the GEMMs'
        # outputs, folded into the FP8 GEMMs' scale_inv (no pass over the [M, V] gradient)
        grad = grad_loss.float()
        g_sinv = saved["g_sinv"] * grad if recipe is not None else None
        dx = dw = db = None
        if need_dx:
            # One GEMM over every row of the [M, V] gradient, as the unfused path computes it: the
            # gradient exists whole by now, and per-chunk products would each be copied into the
            # [M, K] result afterwards (16 GEMMs and 16 copies at Llama 3's head, 8192 tokens).
            # The weight's column-major copy has its layout forced, so it is made here in the backward
            # (the partitioner would otherwise save a transposed FP8 copy from the forward).
            wq_cm = column_major(w, shared=True) if recipe is not None else None
            dx = _dgrad(g_all, w, wq_cm, g_sinv, saved.get("w_sinv"), dx_dtype)
            dx = (dx if recipe is not None else dx * grad).to(dx_dtype)
        if need_dw:
            # One GEMM over every row, as the unfused path computes it. Per-chunk partial products added
            # up would each be a [V, K] fp32 buffer, and inductor fuses the chain of adds into one kernel
            # that reads them all: 16 of them alive at once at Llama 3's head (V 128256, K 4096, 8192
            # tokens), 34 GB against this 1 GB.
            with torch.autocast(grad_loss.device.type, enabled=False):
                dw = (g_all.t() @ x * grad if recipe is None
                      else fp8_gemm(operand_a(g_all.t()), column_major(x), g_sinv, saved["x_sinv"],
                                    out_dtype=torch.float32))
            dw = dw.to(w_dtype)
        if need_db:
            db = (saved["db"] * grad).to(b_dtype)
        dnw = dnb = None
        if spec.norm is not None and dx is not None:
            dx, dnw, dnb = norm_backward(dx, saved["norm_x"], saved["norm_w"], saved["mean"], saved["rstd"], spec.norm)
            has_w, has_b = ctx.has_norm
            dnw, dnb = (dnw if has_w else None), (dnb if has_b else None)
        carrier_grad = None
        if "xw_amax" in saved and ctx.needs_input_grad[11]:
            carrier_grad = torch.cat([saved["xw_amax"], saved["g_amax"]])
        return dx, dw, db, None, dnw, dnb, None, None, None, None, None, carrier_grad, None, None, None


def _fp8_operands(x2d, w_nk, norm_w, norm_b, spec, shard, x_full, x_scale, w_scale):
    """The layer's FP8 operands for an FP8 recipe: ((xq [M, K], wq [V, K]), x_sinv, w_sinv, x_amax,
    w_amax, mean, rstd), the norm's statistics None without a fused norm."""
    recipe = spec.recipe
    mean = rstd = w_amax = None
    if spec.norm is not None:   # the norm kernels write the layer's FP8 input
        mean, rstd, x_amax = norm_stats(x2d, norm_w, norm_b, spec.norm)
        if x_scale is None:
            x_scale = current_scale(x_amax, "input", recipe)
        xq = norm_quantize(x2d, norm_w, norm_b, mean, rstd, x_scale, spec.norm,
                           recipe.fp8_format.dtype_for("input"))[0]
        x_sinv = torch.div(torch.ones_like(x_scale), x_scale)
    else:
        # the unfused layer quantizes all of its input's rows, the sliced-off ones too (the causal
        # shift's last position): its amax, so the kept rows get the unfused bytes and scale
        x_amax = tensor_amax(x_full) if x_full is not None else None
        xq, x_sinv, x_amax = quantize_per_tensor(x2d, "input", recipe, x_scale, x_amax)
    if shard is not None and w_scale is None and not weight_is_operand(w_nk, recipe):
        # a shard's rows: the whole weight's amax, so each rank holds one process's bytes
        [w_amax] = reduce_amaxes([tensor_amax(w_nk)], [(shard.group,)])
    wq, w_sinv, w_amax = quantize_weight(w_nk, recipe, w_scale, w_amax)
    # row-major [V, K] with the layout forced, so inductor writes it once as a buffer that every
    # chunk's GEMM reads (0.5 GB at Llama 3's head); a bare contiguous() of a node no output
    # holds is inlined into one copy per reading GEMM
    wq = column_major(wq.t(), shared=True).t()
    return (xq, wq), x_sinv, w_sinv, x_amax, w_amax, mean, rstd


def _dgrad(g, w, wq_cm, g_sinv, w_sinv, out_dtype) -> torch.Tensor:
    """The input gradient g [M, V] @ w [V, K]: high precision (g_sinv None) or the FP8 GEMM with the
    weight's column-major FP8 copy ``wq_cm``."""
    if g_sinv is None:
        return g @ w
    return fp8_gemm(g, wq_cm, g_sinv, w_sinv, out_dtype=out_dtype)


def _logits(xc, w, x_sinv, w_sinv, bias, out_dtype, fast_accum: bool = False) -> torch.Tensor:
    """One chunk's logits z = xc @ w.T (+ bias) in ``out_dtype``: the FP8 GEMM of the quantized bytes
    (x_sinv, w_sinv: their scale_inv [1]; ``fast_accum``: the recipe's forward GEMM setting), or the
    high-precision product (x_sinv None)."""
    if x_sinv is None:
        return F.linear(xc, w, bias)   # the unfused layer's own call (addmm with a bias)
    # a bias in the GEMM's epilogue where the unfused layer's lowering puts it there, so that the
    # logits keep its bits
    in_gemm, bias = split_bias(bias, out_dtype, w.shape[0])
    return add_bias(fp8_gemm(xc.contiguous(), w.t(), x_sinv, w_sinv, out_dtype=out_dtype, fast_accum=fast_accum,
                             bias=in_gemm), bias)


class LinearCrossEntropyLowering:
    """Callable inserted into the FX graph for one fused site: ``(x, w, b, labels, *delayed) -> (loss,
    logits or None)``.

    x: [..., K] the layer's input (the final norm's input with ``spec.norm``), already cut to the rows
    the loss reads (the pass replays the logits' row slicing on it); w: [V, K] ([K, V] with
    ``spec.weight_in_out``); b: [V] or None; labels: the loss's targets, one per row of x; norm_w,
    norm_b: the fused norm's weight and bias, or None; delayed: DelayedScaling's (carrier, input,
    weight, grad_output scales) or empty; x_full: the layer's whole input [..., K] when x holds a slice
    of its rows (the pass replayed the logits' row slicing on x), so FP8 scales come from all rows as
    the unfused layer's do. Under autocast the operands are cast as the linear would cast them and the
    loss is computed and returned in fp32, as autocast runs cross_entropy; a fused norm then runs in
    plain torch in front (as lowerings/norm_fusion.py does under autocast), since autocast changes the
    dtypes the norm kernels were specialised for.
    """

    def __init__(self, spec: LinearCrossEntropySpec) -> None:
        if spec.reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {spec.reduction!r}")
        if spec.recipe is not None and not spec.recipe.per_tensor:
            raise ValueError(f"the fused output layer takes a per-tensor recipe or None, got {spec.recipe.name}")
        if spec.norm is not None and spec.recipe is None:
            raise ValueError("a norm is fused into the output layer under a per-tensor FP8 recipe only")
        self.spec = spec   # all the lowering holds: fx/cache_names.py names it after a digest of it
        # under autocast: the loss in fp32, as autocast runs log_softmax / cross_entropy (the cast's
        # backward hands dz back in the layer's dtype, as autograd does); a fused norm runs unfused
        upcast = spec.steps + (("cast", torch.float32),)
        self._autocast = (replace(spec, steps=upcast), replace(spec, steps=upcast, norm=None))
        name_lowering(self, f"te_linear_cross_entropy_{spec.recipe.name if spec.recipe else 'hp'}", __name__)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                 norm_w: Optional[torch.Tensor] = None, norm_b: Optional[torch.Tensor] = None,
                 *delayed: Optional[torch.Tensor], x_full: Optional[torch.Tensor] = None):
        dtype = autocast_dtype(x)
        if dtype is None:
            return self._call(self.spec, x, weight, bias, labels, norm_w, norm_b, delayed, x_full)
        spec = self._autocast[0]
        if self.spec.norm is not None:
            x = norm_forward_reference(x.reshape(-1, x.shape[-1]), norm_w, norm_b, spec.norm)[0].reshape(x.shape)
            spec, norm_w, norm_b = self._autocast[1], None, None
        x = x.to(dtype)
        if spec.recipe is None or not casts_weight_itself(weight, spec.recipe):
            weight = weight.to(dtype)   # else the FP8 function casts it itself (its forward says why)
        bias = bias.to(dtype) if bias is not None else None
        x_full = x_full.to(dtype) if x_full is not None else None
        with torch.autocast(x.device.type, enabled=False):
            return self._call(spec, x, weight, bias, labels, norm_w, norm_b, delayed, x_full)

    def _call(self, spec, x, weight, bias, labels, norm_w, norm_b, delayed, x_full):
        w_nk = weight.t() if spec.weight_in_out else weight
        logits_shape = (*x.shape[:-1], w_nk.shape[0])
        plan = None
        if is_dtensor(x) or is_dtensor(w_nk):   # tensor parallel: the vocab sharded over one mesh dim
            try:
                plan = plan_vocab_parallel(x, weight, bias, labels, w_in_out=spec.weight_in_out)
            except ValueError as e:
                raise ValueError(f"{self!r}: {e}") from None
            if spec.norm is not None:
                raise ValueError(f"{self!r}: a norm fused into a vocab-parallel output layer is not supported")
            x, w_nk, bias, labels = plan.local_operands(x, w_nk, bias, labels)
            if is_dtensor(x_full):   # read for its amax only
                x_full = x_full.detach().to_local()
        x2d = x.reshape(-1, x.shape[-1])
        m = x2d.shape[0]
        rows = chunk_rows(size_hint(m), x2d.shape[1], w_nk.shape[0], spec.chunk)
        chunks = max(1, -(-size_hint(m) // rows))
        delayed = delayed or (None,) * 4
        # the gradients a backward will want, or None when none will follow (no dz is computed then)
        grads = None
        if torch.is_grad_enabled():
            grads = (x2d.requires_grad or any(t is not None and t.requires_grad for t in (norm_w, norm_b)),
                     w_nk.requires_grad, bias is not None and bias.requires_grad)
            if not any(grads) and not (delayed[0] is not None and delayed[0].requires_grad):
                grads = None
        loss, logits = LinearCrossEntropyFunction.apply(x2d, w_nk, bias, labels.reshape(-1), norm_w, norm_b,
                                                        spec, chunks, plan.shard if plan else None, x_full,
                                                        grads, *delayed)
        if logits is not None:
            logits = logits.reshape(*logits_shape[:-1], w_nk.shape[0])
        if plan is not None:
            loss, logits = plan.wrap(loss, logits, logits_shape)
        return loss, logits

    def __repr__(self) -> str:
        return f"LinearCrossEntropyLowering({self.spec.fqn!r}, {self.spec.recipe.name if self.spec.recipe else 'hp'})"
