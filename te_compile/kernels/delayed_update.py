"""The delayed-scaling state update of a whole graph in one launch.

Once per step and graph, lowerings/delayed_state.py pushes each role's amax into its history and
computes the next scale: per row r (a role of a weight or an SDPA site)

    amax'      = amax[r] if finite else 0
    history[r] = [amax', history[r][:-1]]               fp32 [L], most recent first, in place
    a          = max(history[r])  ("max")  |  amax'  ("most_recent")
    scale[r]   = limit[r] / a / divisor[r], inf -> FLT_MAX;  kept as it was if a <= 0 or a is not
                 finite, or if amax[r] was not finite                  fp32 [1], in place

where limit is the row's FP8 maximum (448 for E4M3, 57344 for E5M2) and divisor 2**margin. These are
the bits of ``te_compile.scaling.update_role_state`` row by row (tests/test_kernel_delayed_update.py).
Traced row by row, the update is a few kernels per role: three roles per linear, ~50 tiny kernels for
a 4-layer GPT, which inductor must generate and compile (compile time) and a GPU must launch.

A state tensor may hold several rows: an MoE expert weight's role keeps histories [E, L] and scales
[E], one row per expert, with the role's limit and divisor for all of them.

Three functions with one signature (lists of the rows' history and scale tensors, updated in place):
``delayed_update_reference`` (plain torch, the rows stacked: a handful of ops whatever their number),
``delayed_update_triton`` (one launch of ``_delayed_update_kernel``, one program per row; CPU
tensors run under ``TRITON_INTERPRET=1``) and ``delayed_update`` (the kernel for CUDA tensors, the
reference elsewhere; on each CUDA device the kernel must first pass ``kernel_self_test``, bit for
bit, or the reference runs there). The rows live in separate buffers (each weight's state is its own
graph input), so the kernel reads their addresses from a table; the table is kept per set of
addresses, which stay fixed from step to step (module buffers), so CUDA-graph replays launch with no
host-to-device copy.
Because the kernel reads raw addresses it cannot be a ``triton_op`` (inductor would have to trace the
table); the custom op ``te_compile::delayed_scaling_update`` wraps the dispatcher instead, opaque to
inductor, mutating its list arguments, so a compiled graph calls it once per group of rows.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from ._fp_bits import HAS_TRITON
from ._launch import require_triton
from ..scaling import FLT_MAX

log = logging.getLogger(__name__)

__all__ = ["delayed_update", "delayed_update_reference", "delayed_update_triton", "delayed_scaling_update_op",
           "kernel_self_test"]

# elements of a history per loop iteration of the kernel (histories are 1024 by default: one pass)
_BLOCK_L = 1024


def _rows(history: torch.Tensor) -> int:
    """Rows a history tensor holds: 1 for [L], R for [R, L]."""
    return history.shape[0] if history.dim() == 2 else 1


def _check_args(histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], amaxes: torch.Tensor,
                limits: Sequence[float], divisors: Sequence[float]) -> None:
    s = len(histories)
    rows = sum(_rows(h) for h in histories)
    if not (len(scales) == len(limits) == len(divisors) == s) or amaxes.shape != (rows,):
        raise ValueError(f"one scale tensor, limit and divisor per history tensor and one amax per row: {s} "
                         f"histories ({rows} rows), {len(scales)} scales, amaxes {tuple(amaxes.shape)}, "
                         f"{len(limits)} limits, {len(divisors)} divisors")
    if s == 0:
        return
    length, device = histories[0].shape[-1], histories[0].device
    for h, sc in zip(histories, scales):
        if (h.dtype != torch.float32 or h.dim() not in (1, 2) or h.shape[-1] != length or not h.is_contiguous()
                or h.device != device):
            raise ValueError(f"histories must be contiguous fp32 [L] or [R, L] tensors of one length L on one "
                             f"device, got {h.dtype} {tuple(h.shape)} on {h.device} beside L = {length} on {device}")
        if sc.dtype != torch.float32 or sc.numel() != _rows(h) or not sc.is_contiguous() or sc.device != device:
            raise ValueError(f"scales must be contiguous fp32 tensors on {device} with one element per history row, "
                             f"got {sc.dtype} {tuple(sc.shape)} on {sc.device} for a history {tuple(h.shape)}")
    if amaxes.dtype != torch.float32 or amaxes.device != device:
        raise ValueError(f"amaxes must be fp32 on {device}, got {amaxes.dtype} on {amaxes.device}")


def delayed_update_reference(histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], amaxes: torch.Tensor,
                             limits: Sequence[float], divisors: Sequence[float], most_recent: bool) -> None:
    """Update the rows in place: histories S x fp32 [L] or [R, L] (R rows), scales S x fp32 with one
    element per row, amaxes fp32 [rows] (this step's), limits / divisors S floats (the format's
    maximum, 2**margin; for all rows of their tensor), most_recent: the window's algorithm."""
    _check_args(histories, scales, amaxes, limits, divisors)
    if not histories:
        return
    device = amaxes.device
    counts = [_rows(h) for h in histories]
    finite = torch.isfinite(amaxes)
    new_history = torch.cat([torch.where(finite, amaxes, torch.zeros_like(amaxes))[:, None],
                             torch.cat([h.reshape(-1, h.shape[-1]) for h in histories])[:, :-1]], dim=1)  # [rows, L]
    window = new_history[:, 0] if most_recent else new_history.amax(dim=1)      # [rows]
    per_row = lambda values: torch.tensor([v for v, n in zip(values, counts) for _ in range(n)],  # noqa: E731
                                          dtype=torch.float32, device=device)
    # scaling._scale_from_amax's operations, row-wise: true divisions (torch.div of two tensors)
    scale = torch.div(per_row(limits), window)
    scale = torch.div(scale, per_row(divisors))
    scale = torch.clamp(scale, max=FLT_MAX)
    prev = torch.cat([sc.reshape(-1) for sc in scales])
    scale = torch.where((window <= 0) | ~torch.isfinite(window), prev, scale)
    scale = torch.where(finite, scale, prev)
    torch._foreach_copy_(list(histories), [part.reshape(h.shape) for part, h in zip(new_history.split(counts), histories)])
    torch._foreach_copy_(list(scales), [part.reshape(sc.shape) for part, sc in zip(scale.split(counts), scales)])


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _delayed_update_kernel(
        history_ptrs,  # [S] int64: address of row r's history, fp32 [L] contiguous, updated in place
        scale_ptrs,  # [S] int64: address of row r's scale, fp32 [1], updated in place
        amax_ptr,  # [S] fp32: this step's amax per row
        limit_ptr,  # [S] fp32: the row's FP8 maximum
        divisor_ptr,  # [S] fp32: 2**margin
        L,  # history length (>= 1)
        MOST_RECENT: tl.constexpr,
        BLOCK_L: tl.constexpr,
    ):
        row = tl.program_id(0)
        hist = tl.load(history_ptrs + row).to(tl.pointer_type(tl.float32))
        scale_ptr = tl.load(scale_ptrs + row).to(tl.pointer_type(tl.float32))
        amax = tl.load(amax_ptr + row)
        finite = (amax == amax) & (tl.abs(amax) != float("inf"))
        first = tl.where(finite, amax, 0.0)
        acc = tl.full([BLOCK_L], float("-inf"), tl.float32)
        nan = tl.zeros([BLOCK_L], tl.int32)
        # The roll, in place: new[i] = old[i - 1], new[0] = first. Chunks run from the last one down,
        # so no chunk reads what another wrote (chunk c writes [c*B, c*B + B), chunk c - 1 reads below
        # c*B - 1); within a chunk, the barrier keeps every thread's load before any thread's store.
        n_chunks = tl.cdiv(L, BLOCK_L)
        for i in range(0, n_chunks):
            idx = (n_chunks - 1 - i) * BLOCK_L + tl.arange(0, BLOCK_L)
            inside = idx < L
            old = tl.load(hist + idx - 1, mask=inside & (idx >= 1), other=0.0)
            new = tl.where(idx == 0, first, old)
            tl.debug_barrier()
            tl.store(hist + idx, new, mask=inside)
            # GPU max-reductions may drop NaNs (torch.amax keeps them): count them apart
            nan += tl.where(inside & (new != new), 1, 0)
            acc = tl.maximum(acc, tl.where(inside & (new == new), new, float("-inf")))
        if MOST_RECENT:
            window = first
        else:
            window = tl.where(tl.max(nan) > 0, float("nan"), tl.max(acc))
        # div_rn: the correctly rounded division of torch.div ('/' is approximate on GPUs)
        scale = tl.div_rn(tl.load(limit_ptr + row), window)
        scale = tl.div_rn(scale, tl.load(divisor_ptr + row))
        scale = tl.where(tl.abs(scale) == float("inf"), 3.4028234663852886e38, scale)
        prev = tl.load(scale_ptr)
        keep = (window <= 0) | (window != window) | (tl.abs(window) == float("inf")) | ~finite
        tl.store(scale_ptr, tl.where(keep, prev, scale))


# (device, addresses, limits, divisors) -> the kernel's tables on that device; kept so that a step
# (and a CUDA-graph replay, which cannot copy from the host) finds them already there
_TABLES: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _tables(histories, scales, limits, divisors) -> tuple[torch.Tensor, ...]:
    """The kernel's per-row tables: each row's history and scale address (a tensor of R rows gives R,
    its rows L and one fp32 apart), limit and divisor."""
    device = histories[0].device
    rows = [(h, s, r, lim, div) for h, s, lim, div in zip(histories, scales, limits, divisors) for r in range(_rows(h))]
    key = (str(device), tuple(h.data_ptr() + 4 * r * h.shape[-1] for h, _, r, _, _ in rows),
           tuple(s.data_ptr() + 4 * r for _, s, r, _, _ in rows),
           tuple(lim for *_, lim, _ in rows), tuple(div for *_, div in rows))
    tables = _TABLES.get(key)
    if tables is None:
        if len(_TABLES) > 256:   # state rebuilt many times over (tests, sweeps): drop the old tables
            _TABLES.clear()
        tables = (torch.tensor(key[1], dtype=torch.int64, device=device),
                  torch.tensor(key[2], dtype=torch.int64, device=device),
                  torch.tensor(key[3], dtype=torch.float32, device=device),
                  torch.tensor(key[4], dtype=torch.float32, device=device))
        _TABLES[key] = tables
    return tables


def delayed_update_triton(histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], amaxes: torch.Tensor,
                          limits: Sequence[float], divisors: Sequence[float], most_recent: bool) -> None:
    """Launch ``_delayed_update_kernel`` once over all rows; same contract as the reference."""
    require_triton("delayed_update_triton")
    _check_args(histories, scales, amaxes, limits, divisors)
    if not histories:
        return
    history_ptrs, scale_ptrs, limit_t, divisor_t = _tables(histories, scales, limits, divisors)
    _delayed_update_kernel[(history_ptrs.shape[0],)](
        history_ptrs, scale_ptrs, amaxes.contiguous(), limit_t, divisor_t, histories[0].shape[-1],
        MOST_RECENT=bool(most_recent), BLOCK_L=_BLOCK_L, num_warps=4)


_SELF_TESTS: dict[str, tuple[bool, str]] = {}


def kernel_self_test(device: torch.device) -> tuple[bool, str]:
    """(ok, why): does the kernel give the reference's bits on ``device``? Run once per device, eagerly,
    on rows that exercise every rule (the edge amaxes, a fresh state, a history of two chunks, both
    window algorithms). The state of every weight depends on this kernel, so a kernel that fails to
    compile or disagrees must not reach a model: ``delayed_update`` then runs the reference and a
    logged warning says why."""
    key = str(device)
    if key not in _SELF_TESTS:
        _SELF_TESTS[key] = _self_test(torch.device(device))
        if not _SELF_TESTS[key][0]:
            log.warning("te_compile: the delayed-scaling update kernel is off on %s, the plain-torch update "
                        "runs instead: %s", key, _SELF_TESTS[key][1])
    return _SELF_TESTS[key]


def _self_test(device: torch.device) -> tuple[bool, str]:
    if not HAS_TRITON:
        return False, "triton is not installed"
    edges = [3.5, 0.0, float("nan"), float("inf"), 1e-40, 3e38, 1e-3, 7e4]
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for length, most_recent in ((1500, False), (4, True), (1, False)):
                rows = len(edges) * 2   # the edges on a history of noise, then on a fresh (zero) one
                hist = [torch.rand(length, generator=gen) * (r < len(edges)) for r in range(rows)]
                scale = [torch.rand(1, generator=gen) * 100 + 0.5 for _ in range(rows)]
                amaxes = torch.tensor(edges * 2, dtype=torch.float32)
                limits = [(448.0, 57344.0)[r % 2] for r in range(rows)]
                divisors = [(1.0, 4.0)[r % 2] for r in range(rows)]
                # and three more rows as one [3, L] tensor, an expert weight's role
                hist.append(torch.rand(3, length, generator=gen))
                scale.append(torch.rand(3, generator=gen) * 100 + 0.5)
                amaxes = torch.cat([amaxes, torch.tensor([2.5, float("nan"), 0.0])])
                limits, divisors, rows = limits + [57344.0], divisors + [2.0], rows + 1
                got_h, got_s = [h.to(device, copy=True) for h in hist], [t.to(device, copy=True) for t in scale]
                delayed_update_triton(got_h, got_s, amaxes.to(device), limits, divisors, most_recent)
                delayed_update_reference(hist, scale, amaxes, limits, divisors, most_recent)
                for r in range(rows):
                    if not (torch.equal(got_h[r].cpu().view(torch.int32), hist[r].view(torch.int32))
                            and torch.equal(got_s[r].cpu().view(torch.int32), scale[r].view(torch.int32))):
                        return False, f"state tensor {r} (history length {length}) differs from the reference"
    except Exception as e:   # a compile or launch failure on this device
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return True, "bit for bit equal to the reference"


def delayed_update(histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], amaxes: torch.Tensor,
                   limits: Sequence[float], divisors: Sequence[float], most_recent: bool) -> None:
    """The update of S rows in place: the Triton kernel for CUDA tensors once it has passed its
    self-test on that device, the reference elsewhere."""
    if HAS_TRITON and amaxes.is_cuda and kernel_self_test(amaxes.device)[0]:
        delayed_update_triton(histories, scales, amaxes, limits, divisors, most_recent)
    else:
        delayed_update_reference(histories, scales, amaxes, limits, divisors, most_recent)


@torch.library.custom_op("te_compile::delayed_scaling_update", mutates_args=("histories", "scales"))
def _delayed_scaling_update_op(histories: list[torch.Tensor], scales: list[torch.Tensor], amaxes: torch.Tensor,
                               limits: list[float], divisors: list[float], most_recent: bool) -> None:
    delayed_update(histories, scales, amaxes, limits, divisors, most_recent)


@_delayed_scaling_update_op.register_fake
def _(histories, scales, amaxes, limits, divisors, most_recent) -> None:
    return None


# what graphs call: (histories, scales, amaxes, limits, divisors, most_recent) -> None, in place
delayed_scaling_update_op = torch.ops.te_compile.delayed_scaling_update.default
