"""Inductor's H100 code for a compiled graph, taken on a machine without one.

Two captures route every inductor compile through a fake H100 (CUDA queries answer as an H100 SXM,
Triton counts as present, the AOT graph's values are moved to ``cuda:0`` as fake tensors); nothing is
compiled for the GPU or run:
- ``Capture().scheduling()`` reads the scheduler's fused nodes just before code generation, which it
  stops: every kernel with the bytes it reads and writes and, for GEMMs and attention, its FLOPs
  (project_gpu.py turns them into time);
- ``CodeCapture().generating()`` lets code generation finish and stops just before the output code
  is loaded as a module: inductor's whole CUDA output code per graph (wrapper and every Triton
  kernel), the bytes each launch of a user Triton kernel (te's, through ``torch.library.triton_op``)
  passes in its tensor arguments, and the scheduler's view of the same graph (offline.py reads them).
``gpu_trace()`` makes te's lowerings take their GPU path meanwhile.
"""

from __future__ import annotations

import contextlib
import re
import types
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence
from unittest import mock

import torch
import torch.fx as fx
import torch.nn as nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from _common import wrapping_inductor_inner

__all__ = ["Kernel", "Capture", "GeneratedGraph", "CodeCapture", "gpu_trace", "fake_module"]

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
    opaque: bool = False             # an extern op other than a GEMM, attention or a user Triton kernel

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


def _as_on_sm90(check: Callable) -> Callable:
    """te's grouped GEMM dispatch predicate ``check(mat_a, mat_b, out_dtype)``, asked of fake operands
    of the same dtypes on an sm90 ``cuda:0``."""
    from te_compile.gemm import grouped

    def ask(mat_a: torch.Tensor, mat_b: torch.Tensor, out_dtype: torch.dtype) -> bool:
        with FakeTensorMode():
            a = torch.empty((), dtype=mat_a.dtype, device=_CUDA)
            b = torch.empty((), dtype=mat_b.dtype, device=_CUDA)
        with mock.patch.object(grouped, "get_device_compute_capability", lambda device: (9, 0)):
            return check(a, b, out_dtype)

    return ask


@contextlib.contextmanager
def gpu_trace():
    """The CPU trace takes the GPU path: te's per-tensor GEMMs are ``torch._scaled_mm`` (not the CPU
    emulation), its norms the Triton kernels where they win (te_compile::norm_stats / norm_quantize /
    norm_backward), its small GEMMs in high precision under [rewrite] small_gemms, its activations
    inlined into the amax and the cast that read them (a CPU keeps them as buffers), its expert GEMMs
    the CUTLASS grouped GEMMs of an sm90 (``torch._scaled_grouped_mm``, or ``torch._grouped_mm`` for
    E5M2 operands, with each group padded to GROUP_ALIGN rows), and Triton targets sm90, so that torch
    can read the norm kernels' TTIR to learn which arguments they write (without it, it assumes every
    input is written and copies each one)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from te_compile.gemm import grouped, per_tensor
    from te_compile.kernels import norm_quantize
    from te_compile import hardware
    from te_compile.passes import grouped_linear

    align = grouped_linear._align

    def align_on_sm90(site, recipe):
        # a per-tensor recipe's groups are padded wherever a CUTLASS grouped GEMM runs them, which on
        # an sm90 is every FP8 format (the scaled op for E4M3, the bf16 one for E5M2 operands)
        return grouped.GROUP_ALIGN if recipe.per_tensor else align(site, recipe)

    sm90 = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32))
    with mock.patch.object(per_tensor, "cpu_emulates_scaled_mm", lambda: False), \
            mock.patch.object(norm_quantize, "_on_gpu",
                              lambda x, spec: norm_quantize.HAS_TRITON and norm_quantize._kernel_ok(spec)), \
            mock.patch.object(grouped, "uses_native_grouped_gemm", _as_on_sm90(grouped.uses_native_grouped_gemm)), \
            mock.patch.object(grouped, "uses_bf16_grouped_gemm", _as_on_sm90(grouped.uses_bf16_grouped_gemm)), \
            mock.patch.object(grouped_linear, "_align", align_on_sm90), \
            mock.patch.object(hardware, "code_device_type", lambda t: "cuda"), \
            mock.patch.object(triton.runtime.driver, "_active", sm90):
        yield


@contextlib.contextmanager
def _fake_h100():
    """Inductor lowers, schedules and generates code for an H100 on this machine: CUDA queries answer
    with an H100 SXM (sm90) and Triton counts as present."""
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor import scheduler as sched
    from torch._inductor.runtime.hints import DeviceProperties

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


def fake_module(build: Callable[[], nn.Module], mode: FakeTensorMode, dtype: torch.dtype) -> nn.Module:
    """``build()`` with fake ``dtype`` parameters on the CPU, and fake buffers of their own dtype (full
    size, no storage): built on the meta device, so nothing of its size is ever allocated."""
    with torch.device("meta"):
        module = build()
    with mode:
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None:
                    sub._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=dtype))
            for name, b in list(sub._buffers.items()):
                if b is not None:
                    sub._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    return module


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
# GEMMs too, but not priced (their FLOPs depend on the groups' sizes): neither memory-bound nor opaque
_GROUPED_GEMM_OPS = ("_grouped_mm", "_scaled_grouped_mm")


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

    if not hasattr(node, "kernel_stores"):
        return set()   # torch before 2.13 keeps no store analysis: torch's list of written arguments stands
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
                kernel.opaque = not any(op in name.split(".") for op in _GROUPED_GEMM_OPS)
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
        from torch._inductor import scheduler as sched

        def project(gm, example_inputs, **kwargs):
            graph = "bwd" if kwargs.get("is_backward") else "fwd"
            cuda_gm, cuda_inputs = _on_cuda(gm, example_inputs)
            scheduled: list[Kernel] = []

            def codegen(scheduler):
                scheduled.extend(_kernels(scheduler, graph))
                raise _Scheduled()

            with _fake_h100(), mock.patch.object(sched.Scheduler, "codegen", codegen):
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


# ---- the generated code ------------------------------------------------------------------------------

@dataclass
class GeneratedGraph:
    """Inductor's output code for one AOT graph, as an H100 would load it."""

    graph: str                                  # "fwd" or "bwd"
    code: str                                   # the module's source: wrapper and every kernel
    # one entry per launch of a user Triton kernel (te's kernels through torch.library.triton_op), in
    # launch order: (the wrapper's name for the kernel, bytes of its distinct tensor arguments).
    # Inductor's kernel_num_gb exists only for the kernels it writes, so these are counted here.
    user_launches: list[tuple[str, int]] = field(default_factory=list)
    scheduled: list[Kernel] = field(default_factory=list)   # the scheduler's launches (_kernels)
    schedule_error: str = ""                    # why ``scheduled`` is empty, if it is


class _Generated(Exception):
    """Raised in place of loading the output code once it is written."""


def _argument_bytes(raw_args) -> int:
    """Bytes of a kernel launch's tensor arguments, each distinct view once: size x itemsize."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    seen: dict[str, int] = {}
    for arg in raw_args or ():
        if not isinstance(arg, ir.IRNode):
            continue
        try:
            numel = 1
            for s in arg.get_size():
                numel *= int(V.graph.sizevars.optimization_hint(s, fallback=0))
            seen[arg.codegen_reference()] = numel * arg.get_dtype().itemsize
        except (AttributeError, NotImplementedError, TypeError):   # not a tensor (a TMA descriptor, a layout)
            continue
    return sum(seen.values())


class CodeCapture:
    """While ``generating()`` is active, every inductor compile generates its H100 output code, which
    is kept (``graphs``), and hands AOTAutograd fake outputs instead of a loaded module."""

    def __init__(self) -> None:
        self.graphs: list[GeneratedGraph] = []

    def _inner(self, inner: Callable) -> Callable:
        from torch._inductor import scheduler as sched
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen
        from torch._inductor.graph import GraphLowering

        codegen = sched.Scheduler.codegen
        kernel_call = PythonWrapperCodegen.generate_kernel_call

        def generate(gm, example_inputs, **kwargs):
            out = GeneratedGraph("bwd" if kwargs.get("is_backward") else "fwd", "")
            cuda_gm, cuda_inputs = _on_cuda(gm, example_inputs)

            def read_schedule(scheduler):
                try:
                    out.scheduled = _kernels(scheduler, out.graph)
                except Exception as e:   # another torch's internals: the code is still worth having
                    out.schedule_error = f"{type(e).__name__}: {e}"
                return codegen(scheduler)

            def record_user_kernel(wrapper, kernel_name, call_args, **kw):
                # only a user Triton kernel's call names its FX node (UserDefinedTritonKernel.codegen)
                if kw.get("original_fxnode_name") is not None:
                    out.user_launches.append((kernel_name, _argument_bytes(kw.get("raw_args"))))
                return kernel_call(wrapper, kernel_name, call_args, **kw)

            def keep_code(lowering, wrapper_code):
                out.code = wrapper_code.value
                raise _Generated()

            with _fake_h100(), mock.patch.object(sched.Scheduler, "codegen", read_schedule), \
                    mock.patch.object(PythonWrapperCodegen, "generate_kernel_call", record_user_kernel), \
                    mock.patch.object(GraphLowering, "_compile_to_module_lines", keep_code):
                try:
                    inner(cuda_gm, cuda_inputs, **kwargs)
                except Exception:
                    if not out.code:   # failed before the code was written: a real error
                        raise
            if out.code:   # inductor writes no module for a graph that computes nothing (only views)
                self.graphs.append(out)
            return _fake_outputs(gm, detect_fake_mode(example_inputs))

        return generate

    def generating(self):
        return wrapping_inductor_inner(self._inner)
