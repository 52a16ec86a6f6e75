"""Inductor's schedule for an H100, taken on a machine without one: every kernel a compiled graph would
launch, with the bytes it reads and writes and, for GEMMs and attention, its FLOPs.

``Capture().scheduling()`` routes every inductor compile through a fake H100 (CUDA queries answer as
an H100 SXM, Triton counts as present), moves the AOT graph's values to ``cuda:0`` as fake tensors,
and reads the scheduler's fused nodes just before code generation, which it stops: nothing is
compiled or run. ``gpu_trace()`` makes te's lowerings take their GPU path meanwhile. The cost model
that turns these kernels into time is in project_gpu.py.
"""

from __future__ import annotations

import contextlib
import re
import types
from dataclasses import dataclass
from typing import Callable, Optional, Sequence
from unittest import mock

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from _common import wrapping_inductor_inner

__all__ = ["Kernel", "Capture", "gpu_trace"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SMALL_BUFFER = 1 << 20   # bytes: outputs below this are amaxes, scales, per-row stats, partial sums

@dataclass
class Kernel:
    """One launch of a projected step: a fused Triton kernel, a GEMM, an attention call or an opaque op."""

    graph: str                       # "fwd" or "bwd"
    index: int                       # position in its graph's schedule
    kind: str                        # "gemm", "attention" or "memory"
    name: str                        # inductor's kernel name, the op, or the user Triton kernel
    bytes_read: int
    bytes_written: int
    flops: float = 0.0
    precision: Optional[str] = None  # "bf16", "fp8" or "tf32" for GEMMs and attention
    shape: str = ""                  # GEMM: MxNxK; attention: BxHxTxD
    module: str = ""                 # GEMM: the linear layer (module path)
    role: str = ""                   # GEMM: fprop, dgrad or wgrad
    reads: tuple[str, ...] = ()      # buffer names (for operand tracing)
    writes: tuple[str, ...] = ()
    writes_fp8: bool = False
    small_outputs: bool = False      # every output is below SMALL_BUFFER bytes

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def label(self) -> str:
        return f"{self.graph}#{self.index}"

    def seconds(self, hw) -> float:
        """max(memory time, compute time) + one launch under ``hw``, project_gpu.py's Hardware."""
        memory = self.bytes / (hw.hbm_bytes_per_s * hw.bw_eff)
        compute = 0.0
        if self.flops:
            eff = {"gemm": hw.fp8_gemm_eff if self.precision == "fp8" else hw.bf16_gemm_eff,
                   "attention": hw.attn_eff}[self.kind]
            compute = self.flops / (hw.peak(self.precision) * eff)
        return max(memory, compute) + hw.launch_s



# ---- a fake H100 for inductor ------------------------------------------------------------------------

_H100_PROPERTIES = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, total_memory=80 * 2**30,
    max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536, max_threads_per_block=1024,
    warp_size=32, L2_cache_size=50 * 2**20, shared_memory_per_block_optin=232448, gcnArchName="")
_CUDA = torch.device("cuda", 0)


class _Scheduled(Exception):
    """Raised in place of code generation once the scheduler's fused nodes are read."""


@contextlib.contextmanager
def gpu_trace():
    """The CPU trace takes the GPU path: te's per-tensor GEMMs are ``torch._scaled_mm`` (not the CPU
    emulation) and its norms the Triton kernels (te_compile::norm_stats / norm_quantize /
    norm_backward), and Triton targets sm90, so that torch can read those kernels' TTIR to learn which
    arguments they write (without it, it assumes every input is written and copies each one)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from te_compile.gemm import per_tensor
    from te_compile.kernels import norm_quantize

    sm90 = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32))
    with mock.patch.object(per_tensor, "cpu_emulates_scaled_mm", lambda: False), \
            mock.patch.object(norm_quantize, "_on_gpu",
                              lambda x, spec: norm_quantize.HAS_TRITON and norm_quantize._kernel_ok(spec)), \
            mock.patch.object(triton.runtime.driver, "_active", sm90):
        yield


@contextlib.contextmanager
def _fake_h100(on_schedule: Callable):
    """Inductor lowers and schedules for an H100 on this machine: CUDA queries answer with an H100 SXM
    (sm90), Triton counts as present, and ``Scheduler.codegen`` hands the fused nodes to
    ``on_schedule`` and stops."""
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor import scheduler as sched
    from torch._inductor.runtime.hints import DeviceProperties

    def codegen(self):
        on_schedule(self)
        raise _Scheduled()

    props = staticmethod(lambda device=None: _H100_PROPERTIES)
    patches = [
        (torch.cuda, "get_device_properties", lambda device=None: _H100_PROPERTIES),
        (torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "device_count", lambda: 1),
        (CudaInterface, "get_device_properties", props),
        (CudaInterface, "get_compute_capability", staticmethod(lambda device=None: 90)),
        (CudaInterface, "current_device", staticmethod(lambda: 0)),
        (CudaInterface, "device_count", staticmethod(lambda: 1)),
        (CudaInterface, "is_bf16_supported", staticmethod(lambda including_emulation=True: True)),
        (CudaInterface.Worker, "get_device_properties", props),
        (CudaInterface.Worker, "current_device", staticmethod(lambda: 0)),
        (sched, "has_triton", lambda: True),
        (sched.Scheduler, "codegen", codegen),
        # Tensor.copy_'s Python binding takes a device guard, which a CPU-only build has none of for
        # CUDA; the op itself runs on fake tensors (inductor's passes copy fake values)
        (torch.Tensor, "copy_", lambda self, src, non_blocking=False: torch.ops.aten.copy_.default(
            self, src, non_blocking)),
    ]
    with contextlib.ExitStack() as stack:
        for obj, attr, value in patches:
            stack.enter_context(mock.patch.object(obj, attr, value))
        try:
            yield
        finally:
            DeviceProperties.create.cache_clear()   # no fake H100 left for a real GPU run after this


def _to_cuda(mode: FakeTensorMode, value):
    """A fake tensor's twin on cuda:0 (same sizes, strides, dtype); other values unchanged."""
    if isinstance(value, torch.Tensor):
        with mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=_CUDA)
    return value


def _on_cuda(gm: fx.GraphModule, example_inputs: Sequence) -> tuple[fx.GraphModule, list]:
    """A copy of an AOT graph whose values, example inputs and device arguments are on cuda:0."""
    mode = detect_fake_mode(example_inputs)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    cuda_device = (lambda a: _CUDA if isinstance(a, torch.device) and a.type == "cpu" else a)
    for node in graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = tree_map(lambda v: _to_cuda(mode, v), node.meta["val"])
        node.args = tree_map(cuda_device, node.args)
        node.kwargs = tree_map(cuda_device, node.kwargs)
    return fx.GraphModule(gm, graph), [_to_cuda(mode, t) for t in example_inputs]


def _fake_outputs(gm: fx.GraphModule, fallback_mode: FakeTensorMode) -> Callable:
    """The compiled function handed back to AOTAutograd: fresh fake tensors shaped like the graph's
    outputs (nothing runs; the step only has to reach the backward)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    metas = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in output.args[0]]

    def run(args):
        mode = detect_fake_mode(args) or fallback_mode
        with mode:
            return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype) if isinstance(v, torch.Tensor) else v
                    for v in metas]

    run._boxed_call = True
    return run


# ---- reading the scheduler --------------------------------------------------------------------------

_GEMM_OPS = ("mm", "addmm", "bmm", "_scaled_mm")


def _op_name(node) -> str:
    op = getattr(node, "op_overload", None)
    if op is not None:
        return str(op)
    return getattr(node, "python_kernel_name", None) or type(node).__name__


def _gemm_op(name: str) -> Optional[str]:
    parts = name.replace("extern_kernels.", "aten.").split(".")
    return next((p for p in parts if p in _GEMM_OPS), None)


def _origin(node, target):
    return next((o for o in node.origins if o.op == "call_function" and o.target == target), None)


def _named_args(fx_node: fx.Node) -> dict:
    schema = fx_node.target._schema
    named = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(fx_node.args):
            named[arg.name] = fx_node.args[i]
        else:
            named[arg.name] = fx_node.kwargs.get(arg.name, arg.default_value)
    return named


def _size(node) -> list[int]:
    from torch._inductor.virtualized import V

    return [int(V.graph.sizevars.optimization_hint(s, fallback=0)) for s in node.get_size()]


def _gemm(node, op: str) -> tuple[float, str, str]:
    """(FLOPs, precision, "MxNxK") of a GEMM extern node: a [M, K] (bmm: [B, M, K]), b [K, N]; addmm's
    first input is the bias, _scaled_mm's third and fourth the scales."""
    inputs = node.inputs[1:3] if op == "addmm" else node.inputs[0:2]
    a, b = (_size(t) for t in inputs)
    batch = a[0] if op == "bmm" else 1
    m, k, n = a[-2], a[-1], b[-1]
    dtype = inputs[0].get_dtype()
    precision = "fp8" if dtype in FP8_DTYPES else "bf16"
    return 2.0 * batch * m * n * k, precision, f"{m}x{n}x{k}" if batch == 1 else f"{batch}x{m}x{n}x{k}"


def _attention(node) -> Optional[tuple[float, str, str]]:
    """(FLOPs, precision, "BxHxTxD") of an attention call: torch's SDPA ops or te's FP8 attention."""
    target = getattr(node, "op_overload", None)
    fx_node = _origin(node, target) if target is not None else None
    if fx_node is None:
        return None
    args = _named_args(fx_node)
    q = args.get("query", args.get("q8"))
    k = args.get("key", args.get("k8"))
    if not isinstance(q, fx.Node) or not isinstance(k, fx.Node):
        return None
    bsz, heads, tq, d = q.meta["val"].shape
    tk = k.meta["val"].shape[2]
    causal = bool(args.get("is_causal", args.get("causal", False)))
    forward = 4.0 * bsz * heads * tq * tk * d * (0.5 if causal else 1.0)
    name = str(target)
    shape = f"{bsz}x{heads}x{tq}x{d}"
    if "fp8_attention" in name:
        if "backward" in name:
            return 3.5 * forward, "fp8" if args.get("fp8_grads") else "tf32", shape
        return forward, "fp8", shape
    precision = "fp8" if q.meta["val"].dtype in FP8_DTYPES else "bf16"
    return (2.5 * forward if "backward" in name else forward), precision, shape


def _user_kernel_name(node) -> str:
    try:
        kernel = node.get_kernel_and_metadata()[0]
        return getattr(kernel, "__name__", None) or kernel.fn.__name__
    except Exception:   # naming only: the bytes do not depend on it
        return type(node).__name__


# ops left out of a fused kernel's name: views, layout changes and the GEMMs whose neighbours it holds
_QUIET_OPS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "clone", "alias",
              "squeeze", "unsqueeze", "slice", "select", "split", "split_with_sizes", "getitem", "as_strided",
              "_to_copy", "convert_element_type", "mm", "addmm", "_scaled_mm", "bmm", "contiguous"}


def _fused_name(snode) -> str:
    """The aten ops a fused kernel computes, in schedule order; views, casts and copies named only when
    the kernel does nothing else."""
    names: list[str] = []
    quiet: list[str] = []
    for sub in snode.get_nodes():
        origins = sorted(getattr(sub.node, "origins", ()) or (), key=lambda o: o.name)
        for o in origins:
            op = o.meta.get("original_aten") or o.target
            name = getattr(op, "__name__", str(op)).split(".")[0]
            bucket = quiet if name in _QUIET_OPS else names
            if name not in bucket:
                bucket.append(name)
    return "+".join(names or quiet) or snode.get_name()


def _module(node) -> str:
    """The module whose forward made a GEMM (``nn_module_stack`` of its FX origin; te's fused norm
    sites name the norm)."""
    gemms = [o for o in node.origins if o.op == "call_function" and _gemm_op(str(o.target))]
    for o in sorted(gemms, key=lambda o: o.name):
        stack = o.meta.get("nn_module_stack") or o.meta.get("fwd_nn_module_stack")
        if stack:
            path = list(stack.values())[-1][0]
            return re.sub(r"_modules\['(\w+)'\]", r"\1", path).replace("L['self'].", "").replace("L['self']", "")
    return ""


def _stored_buffers(node) -> set[str]:
    """The buffers a user Triton kernel writes: of the arguments torch's analysis lists as written
    (one mutation output each, in that order), those its source passes to ``tl.store`` as the
    pointer (names used directly in the pointer expression, as te's kernels do)."""
    import ast

    from torch._inductor import ir

    pointers = set()
    for store in node.kernel_stores.stores:
        pointers |= {n.id for n in ast.walk(store.store_pointer_node) if isinstance(n, ast.Name)}
    written = [d.name for d in node.arg_accesses.read_writes.writes
               if isinstance(node.kernel_args.get(d.name), ir.TensorBox)]
    out: set[str] = set()
    for arg, mutation in zip(written, node.mutation_outputs):
        if arg in pointers:
            out |= set(mutation.get_mutation_names())
    return out


def _kernels(scheduler, graph: str) -> list[Kernel]:
    """The launches of one scheduled graph, in order, with the bytes inductor counts for each."""
    from torch._inductor import ir
    from torch._inductor import scheduler as sched
    from torch._inductor.dependencies import WeakDep
    from torch._inductor.virtualized import V

    def targets(name: str) -> list[str]:
        """A mutation's output names the buffers it writes; other buffers name themselves."""
        buf = V.graph.name_to_buffer.get(name)
        if buf is not None and isinstance(buf.layout, ir.NoneLayout):
            return list(buf.get_mutation_names())
        return [name]

    def dtype_of(name: str):
        buf = V.graph.name_to_buffer.get(name) or V.graph.graph_inputs.get(name)
        try:
            return buf.get_dtype()
        except Exception:   # no plain layout
            return None

    outputs = set(V.graph.get_output_names())

    def feeds_output(name: str) -> bool:
        """The buffer is a graph output, or only read by kernels that write graph outputs (a cast,
        a transpose): a weight gradient, where a GEMM's output is an activation gradient."""
        if name in outputs:
            return True
        sbuf = scheduler.name_to_buf.get(name)
        users = [u.node for u in sbuf.users] if sbuf is not None else []
        return bool(users) and all(isinstance(u, sched.BaseSchedulerNode)
                                   and {b.get_name() for b in u.get_outputs()} <= outputs for u in users)

    out = []
    for snode in scheduler.nodes:
        if isinstance(snode, sched.NopKernelSchedulerNode):
            continue
        node = snode.node
        if isinstance(snode, sched.ExternKernelSchedulerNode) and isinstance(node, ir.MultiOutput):
            continue   # the outputs of a multi-output op: no launch of its own
        # per buffer, what inductor counts (each buffer once, internal buffers of a fused kernel free);
        # weak deps only order a mutation after earlier readers and move nothing
        accesses = snode.get_read_write_buffer_accesses(include_reads=True, include_writes=True)
        read = {dep.name for dep in snode.read_writes.reads if not isinstance(dep, WeakDep)}
        written = {dep.name for dep in snode.read_writes.writes}
        mutated = {t for n in written for t in targets(n) if t != n}
        reads = {n: b for n, b in accesses.items() if n in read and n not in written}
        writes = {n: b for n, b in accesses.items() if n in written}
        stored = _stored_buffers(node) if isinstance(node, ir.UserDefinedTritonKernel) else None
        if stored:
            # torch's TTIR analysis may list arguments a Triton kernel only reads as written (then
            # inductor copies them first: a kernel of its own, counted there); the kernel itself writes
            # what its tl.store calls point into and reads the rest
            reads = {n: b for n, b in accesses.items() if n in read and n not in written and n not in stored}
            writes = {n: b for n, b in accesses.items() if n in written and set(targets(n)) <= stored}
        kernel = Kernel(graph, len(out), "memory", "", sum(reads.values()), sum(writes.values()),
                        reads=tuple(read), writes=tuple(written | mutated),
                        writes_fp8=any(dtype_of(t) in FP8_DTYPES for n in writes for t in targets(n)),
                        small_outputs=all(b < SMALL_BUFFER for b in writes.values()))
        if isinstance(snode, sched.ExternKernelSchedulerNode):
            name = _op_name(node)
            gemm = _gemm_op(name)
            attention = _attention(node) if ("scaled_dot_product" in name or "fp8_attention" in name) else None
            if gemm is not None:
                kernel.kind, kernel.name = "gemm", gemm
                kernel.flops, kernel.precision, kernel.shape = _gemm(node, gemm)
                kernel.module = _module(node)
                kernel.role = "fprop" if graph == "fwd" else (
                    "wgrad" if all(feeds_output(n) for n in written) else "dgrad")
            elif attention is not None:
                kernel.kind = "attention"
                kernel.name = ("te FP8 attention" if "fp8_attention" in name else "SDPA (flash)") \
                    + (" bwd" if "backward" in name else " fwd")
                kernel.flops, kernel.precision, kernel.shape = attention
            elif isinstance(node, ir.UserDefinedTritonKernel):
                kernel.name = _user_kernel_name(node)
            else:
                kernel.name = name
        else:
            kernel.name = _fused_name(snode)
        out.append(kernel)
    return out


class Capture:
    """While ``scheduling()`` is active, every inductor compile is scheduled for an H100 and
    recorded, not compiled."""

    def __init__(self) -> None:
        self.kernels: list[Kernel] = []

    def _inner(self, inner: Callable) -> Callable:
        def project(gm, example_inputs, **kwargs):
            graph = "bwd" if kwargs.get("is_backward") else "fwd"
            cuda_gm, cuda_inputs = _on_cuda(gm, example_inputs)
            scheduled: list[Kernel] = []
            with _fake_h100(lambda s: scheduled.extend(_kernels(s, graph))):
                try:
                    inner(cuda_gm, cuda_inputs, **kwargs)
                except Exception:
                    if not scheduled:   # failed before the scheduler: a real error
                        raise
            self.kernels += scheduled
            return _fake_outputs(gm, detect_fake_mode(example_inputs))

        return project

    def scheduling(self):
        return wrapping_inductor_inner(self._inner)
