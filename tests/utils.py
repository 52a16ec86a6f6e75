"""Helpers shared by the test files: SQNR, bitwise comparison with a readable failure, seeding, and
the plain-torch per-tensor FP8 reference the quantizers are checked against."""

from __future__ import annotations

import math
import os
import random
import sys
from typing import Optional

import pytest
import torch
import torch.distributed as dist

FLT_MAX = torch.finfo(torch.float32).max
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_id(dtype: torch.dtype) -> str:
    """Short parametrize id of an fp8 dtype."""
    return {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}[dtype]


def seed(value: int = 0) -> torch.Generator:
    """Seed torch and random; return a CPU generator seeded with ``value`` for explicit draws."""
    torch.manual_seed(value)
    random.seed(value)
    return torch.Generator().manual_seed(value)


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20*log10(||ref|| / ||ref - x||); inf when equal."""
    ref64 = ref.detach().to(torch.float64)
    noise = torch.linalg.vector_norm(ref64 - x.detach().to(torch.float64)).item()
    signal = torch.linalg.vector_norm(ref64).item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 20.0 * math.log10(signal / noise)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the bytes, so NaNs compare equal to themselves and -0 differs from +0."""
    t = t.detach().contiguous()
    if t.dtype in (torch.float32,):
        return t.view(torch.int32)
    if t.dtype in (torch.float64,):
        return t.view(torch.int64)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.element_size() == 1 and t.dtype is not torch.bool:
        return t.view(torch.uint8)
    return t


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, msg: str = "", *, show: int = 5) -> None:
    """Same shape, dtype and bytes; on failure name how many elements differ and the first few."""
    prefix = f"{msg}: " if msg else ""
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (
        f"{prefix}expected two tensors, got {type(a).__name__} and {type(b).__name__}")
    assert a.shape == b.shape, f"{prefix}shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{prefix}dtype {a.dtype} != {b.dtype}"
    abits, bbits = _as_bits(a), _as_bits(b)
    diff = abits != bbits
    n = int(diff.sum())
    if n == 0:
        return
    idx = diff.nonzero()[:show]
    lines = []
    for i in idx.tolist():
        i = tuple(i)
        mask = (1 << (8 * abits.element_size())) - 1
        lines.append(f"  at {list(i)}: {a.detach()[i].item()!r} vs {b.detach()[i].item()!r} "
                     f"(bits {abits[i].item() & mask:#x} vs {bbits[i].item() & mask:#x})")
    raise AssertionError(f"{prefix}{n} of {a.numel()} elements differ; first {len(lines)}:\n"
                         + "\n".join(lines))


def assert_sqnr_at_least(ref: torch.Tensor, x: torch.Tensor, threshold_db: float, msg: str = "") -> None:
    value = sqnr(ref, x)
    assert value >= threshold_db, f"{msg}: SQNR {value:.2f} dB < threshold {threshold_db} dB"


# ---- independent per-tensor FP8 reference (written from DESIGN.md §5, shares no library code) ----

def ref_scale(amax: float, fp8_dtype: torch.dtype, *, force_pow_2: bool = False,
              amax_epsilon: float = 0.0, margin: int = 0) -> torch.Tensor:
    """fp32 [1] scale from a Python float amax: fp64 division rounded once to fp32 (the correctly
    rounded fp32 quotient), inf -> FLT_MAX, amax 0/inf/NaN -> 1, pow2 rounds down via frexp."""
    fmax = FP8_MAX[fp8_dtype]
    if amax_epsilon > 0.0 and not math.isnan(amax):
        # the epsilon is an fp32 value on device, as in TransformerEngine's kernels
        amax = max(amax, torch.tensor(amax_epsilon, dtype=torch.float32).item())
    if amax == 0.0 or math.isinf(amax) or math.isnan(amax):
        return torch.ones(1, dtype=torch.float32)
    scale64 = fmax / amax / 2.0**margin
    scale = torch.tensor([scale64], dtype=torch.float64).to(torch.float32)
    if torch.isinf(scale).item():
        scale = torch.tensor([FLT_MAX], dtype=torch.float32)
    if force_pow_2:
        mantissa, exponent = math.frexp(scale.item())  # scale = m * 2**e, m in [0.5, 1)
        scale = torch.tensor([math.ldexp(1.0, exponent - 1)], dtype=torch.float32)
    return scale


def ref_amax(x: torch.Tensor) -> float:
    """max|x| as a Python float (NaN if any element is NaN), 0 for an empty tensor."""
    if x.numel() == 0:
        return 0.0
    x64 = x.detach().to(torch.float64)
    if torch.isnan(x64).any():
        return math.nan
    return x64.abs().max().item()


def ref_cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """uint8 bytes of clamp(x * scale, -max, max) cast to fp8 (the product rounded once to fp32)."""
    fmax = FP8_MAX[fp8_dtype]
    scaled = (x.detach().to(torch.float64) * scale.to(torch.float64)).to(torch.float32)
    return scaled.clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8)


def ref_scale_inv(scale: torch.Tensor) -> torch.Tensor:
    return (1.0 / scale.to(torch.float64)).to(torch.float32)


def ref_dequantize(data_u8: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: torch.dtype,
                   dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    return (data_u8.view(fp8_dtype).to(torch.float32) * scale_inv.reshape(())).to(dtype)


# ---- the graphs aot_autograd hands its compilers, for counting ops in tests ----

class AotGraphs:
    """Forward and backward graphs of every te compile while installed (``install(monkeypatch)``):
    the backend's final compiler becomes aot_eager with recording compilers. Use with
    ``compiler = "aot_eager"`` in the options (the recorded graphs are what aot_eager would run)."""

    def __init__(self) -> None:
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []

    def install(self, monkeypatch) -> "AotGraphs":
        import importlib

        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        backend_module = importlib.import_module("te_compile.backend")  # te_compile.backend is a function

        def record(into):
            def compiler(gm, example_inputs):
                into.append(gm)
                return boxed_nop(gm, example_inputs)
            return compiler

        def final(gm, example_inputs, config, mode, cacheable=None):
            return aot_eager(gm, example_inputs, fw_compiler=record(self.forward),
                             bw_compiler=record(self.backward))

        monkeypatch.setattr(backend_module, "_final_compiler", final)
        return self


def count_calls(gm: torch.fx.GraphModule, target) -> int:
    """Nodes of ``gm`` calling ``target`` (an OpOverload or OpOverloadPacket)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and (n.target is target or getattr(n.target, "overloadpacket", None) is target))


# ---------------------------------------------------------------------------------------------
# Multi-process tests: gloo ranks spawned on CPU


def funcol_all_reduces(fn) -> int:
    """How many functional all-reduces (te's amax reductions among them) run while ``fn()`` runs
    (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "_c10d_functional::all_reduce")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, fn, out_dir: str, args) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHINDUCTOR_CACHE_DIR=os.path.join(out_dir, "inductor"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# the mark of every test module whose tests spawn gloo ranks (run_ranks)
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def run_ranks(fn, tmp_path, *args, world: int = 2) -> list:
    """``fn(rank, *args)`` on each of ``world`` gloo ranks (one thread each, a free port); the list
    of what each returned (saved with torch.save, so the test process asserts on plain values and a
    failure shows as an ordinary assertion with every rank's values)."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_entry, args=(world, _free_port(), fn, str(tmp_path), args), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


class RankPatch:
    """The one monkeypatch method AotGraphs needs, for use inside a spawned rank (no pytest fixture there)."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def max_all_reduces(gm: torch.fx.GraphModule) -> int:
    """All-reduce nodes with MAX (amax reductions; DTensor's and DDP's own collectives sum)."""
    all_reduce = torch.ops._c10d_functional.all_reduce.default
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is all_reduce
               and n.args[1] == "max")


def full_tensor(t):
    """A DTensor gathered whole; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def recipe_state(model) -> dict:
    """A copy of ``te_compile.recipe_state_dict(model)`` (the live tensors keep changing)."""
    import te_compile

    return {k: v.clone() for k, v in te_compile.recipe_state_dict(model).items()}


class DistMLP(torch.nn.Module):
    """up [64, 32], down [32, 64] for the DDP and tensor-parallel tests. ``norm``: a LayerNorm first
    (the sequence-parallel plan's); ``attn``: causal self-attention (2 heads, q = k = v) over the hidden
    activations."""

    def __init__(self, d: int = 32, hidden: int = 64, norm: bool = False, attn: bool = False) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d) if norm else torch.nn.Identity()
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)
        self.attn = attn

    def forward(self, x):   # x [B, T, d]
        h = self.up(self.norm(x))
        if self.attn:
            b, t, hidden = h.shape
            heads = h.view(b, t, 2, hidden // 2).transpose(1, 2)
            h = torch.nn.functional.scaled_dot_product_attention(heads, heads, heads, is_causal=True)
            h = h.transpose(1, 2).reshape(b, t, hidden)
        return self.down(torch.relu(h))


# Where the Triton launchers run in the kernel tests: on a CUDA machine the kernels compile for the
# GPU (conftest sets TRITON_INTERPRET only without one), so CPU-built operands must move there.
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_kernel_device(launcher):
    """``launcher`` called with its tensor arguments (lists of tensors too) on KERNEL_DEVICE and its
    tensor results brought back to the CPU, so tests build operands and references on the CPU either
    way. Arguments the launcher writes in place (delayed_update's histories and scales) are copied back
    into the caller's tensors; a no-op on CPU-only machines."""
    if KERNEL_DEVICE.type == "cpu":
        return launcher
    from torch.utils._pytree import tree_map

    def call(*args, **kwargs):
        moved = []

        def to_device(t):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                d = t.to(KERNEL_DEVICE)
                moved.append((t, d))
                return d
            return t

        out = launcher(*tree_map(to_device, args), **tree_map(to_device, kwargs))
        for host, dev in moved:   # unchanged inputs copy back their own values
            host.copy_(dev)
        return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, out)

    return call


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def sm90_build_available() -> tuple[bool, str]:
    """(whether kernels can be built for sm90 here, why not): benchmarks/_output_code.py's check, for
    the tests that run the benchmarks' sm90 builds in a subprocess."""
    sys.path.insert(0, BENCHMARKS)
    try:
        from _output_code import ptxas_available
    finally:
        sys.path.remove(BENCHMARKS)
    return ptxas_available()
