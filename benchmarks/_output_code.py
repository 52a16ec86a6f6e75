"""Reading inductor's CUDA output code: what one compiled graph launches, and each of its Triton
kernels built for sm90 on a machine without a GPU.

An output-code module (what ``TORCH_COMPILE_DEBUG`` or ``TORCHINDUCTOR_CACHE_DIR`` keep on a GPU, or
``_h100_schedule.CodeCapture`` on a CPU) defines every Triton kernel as
``name = async_compile.triton('...', '''source''', device_str='cuda')`` and then launches them, in
order, from its ``call``: ``name.run(...)`` for a Triton kernel, ``extern_kernels.mm(...)`` or
``torch.ops.aten.<op>(...)`` for everything else. With ``benchmark_kernel`` on, each kernel inductor
writes carries ``kernel_num_gb``: the bytes it estimates the kernel reads and writes (each buffer once
at its dtype). A user Triton kernel (``torch.library.triton_op``, marked ``custom_kernel=True``) has
no estimate: its bytes come from the capture (its tensor arguments' sizes) or stay unknown.

``build_sm90`` compiles a kernel's source through inductor's own path (the kernel's
``CachingAutotuner._precompile_config``, as ``precompile`` does on a GPU), with the Triton driver's
target set to sm90 and the GPU-only pieces a build never calls stubbed out; registers and local memory
(spills) come from Triton's bundled ``cuobjdump`` on the cubin, shared memory from Triton's metadata.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import types
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence
from unittest import mock

__all__ = [
    # the launches of a graph
    "TINY_BYTES", "GEMM_OPS", "KernelSource", "Launch", "kernel_sources", "launches", "repeated_stores",
    # sm90 builds
    "Build", "ptxas_available", "build_sm90",
]

TINY_BYTES = 1 << 20    # a launch moving less than this is launch-bound on an H100 (amaxes, scales, zeros)
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm", "_int_mm")
# extern calls that launch nothing: views, allocations and pool slices the wrapper writes as calls
_NO_LAUNCH_OPS = ("_alloc_from_pool", "_reinterpret_tensor", "view", "as_strided", "alias", "empty",
                  "empty_strided", "resize_storage_bytes_")

_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.triton\('(\w+)', '''(.*?)''', device_str='(\w+)'\)",
                         re.S | re.M)
_NUM_GB = re.compile(r"'kernel_num_gb': ([0-9.eE+-]+)")
_RUN = re.compile(r"^\s*(\w+)\.run\(")
# a statement calling an extern kernel, a torch.ops op, or an aten op through the wrapper's ``aten`` alias
_EXTERN = re.compile(r"^\s*(?:[\w, ]+ = )?(?:extern_kernels\.(?P<extern>\w+)|torch\.ops\.(?P<ns>\w+)\.(?P<op>\w+)"
                     r"|aten\.(?P<aten>\w+))[\w.]*\(")


@dataclass(frozen=True)
class KernelSource:
    """One Triton kernel an output-code module defines."""

    name: str                 # the module's variable: what the wrapper calls ``.run`` on
    source: str               # the Python module async_compile.triton builds it from
    user: bool                # a user Triton kernel (torch.library.triton_op: te's own)
    num_bytes: Optional[int]  # inductor's estimate (kernel_num_gb); None for user kernels


@dataclass
class Launch:
    """One launch of a graph, in the wrapper's order."""

    index: int
    kind: str                 # "triton" (inductor's), "user" (a user Triton kernel), "gemm", "attention", "extern"
    name: str                 # the kernel's variable, or the extern op (``_scaled_mm``, ``aten.sort.stable``)
    bytes: Optional[int]      # Triton launches: bytes read + written; extern calls: None (not counted here)

    @property
    def tiny(self) -> bool:
        return self.bytes is not None and self.bytes < TINY_BYTES


def kernel_sources(code: str) -> dict[str, KernelSource]:
    """Every Triton kernel ``code`` defines, by the wrapper's name for it."""
    out = {}
    for m in _KERNEL_DEF.finditer(code):
        name, body = m.group(1), m.group(3)
        estimate = _NUM_GB.search(body)
        user = "custom_kernel=True" in body
        out[name] = KernelSource(name, body, user, None if user or not estimate
                                 else round(float(estimate.group(1)) * 1e9))
    return out


# tl.store(out_ptr3 + (x0 + 8192*r0_1), tmp38, mask): the pointer, the index, the value
_STORE = re.compile(r"tl\.store\((\w+) \+ \((.*?)\), (tmp\d+)\b")


def repeated_stores(code: str) -> dict[str, int]:
    """Per Triton kernel that ``code`` defines, how many of its stores write a value it already stores
    at the same index into another buffer: one tensor materialized several times (inductor inlines a
    node into a copy per extern reader it does not realize for). Scalar stores (an index without a
    program variable: each reader's amax slot) are not counted."""
    out = {}
    for name, kernel in kernel_sources(code).items():
        seen: dict[tuple[str, str], int] = {}
        for _ptr, index, value in _STORE.findall(kernel.source):
            if re.search(r"\b[xyr]\w*\d", index):   # x0, y1, r0_1, xindex: varies over the tensor
                seen[(value, index)] = seen.get((value, index), 0) + 1
        extra = sum(n - 1 for n in seen.values())
        if extra:
            out[name] = extra
    return out


def _call_body(code: str) -> str:
    """The wrapper's launching code: everything after the kernels are defined (a graph with no Triton
    kernel has no ``async_compile.wait``: then from its ``call``)."""
    for marker in ("async_compile.wait(globals())", "class Runner", "def call("):
        if marker in code:
            return code[code.index(marker):]
    raise ValueError("not an inductor output-code module: it has no 'def call(' (nor "
                     "'async_compile.wait(globals())')")


def launches(code: str, user_bytes: Sequence[tuple[str, int]] = ()) -> list[Launch]:
    """The launches of one output-code module, in order. ``user_bytes``: (kernel name, bytes) per
    launch of a user Triton kernel, in launch order (``GeneratedGraph.user_launches``); without it
    those launches have no bytes."""
    kernels = kernel_sources(code)
    pending: dict[str, deque[int]] = defaultdict(deque)
    for name, nbytes in user_bytes:
        pending[name].append(nbytes)
    out: list[Launch] = []
    for line in _call_body(code).splitlines():
        run = _RUN.match(line)
        if run and run.group(1) in kernels:
            k = kernels[run.group(1)]
            nbytes = (pending[k.name].popleft() if pending[k.name] else None) if k.user else k.num_bytes
            out.append(Launch(len(out), "user" if k.user else "triton", k.name, nbytes))
            continue
        ext = _EXTERN.match(line)
        if ext is None:
            continue
        op = ext.group("extern") or ext.group("op") or ext.group("aten")
        if op in _NO_LAUNCH_OPS:
            continue
        name = op if ext.group("extern") else f"{ext.group('ns') or 'aten'}.{op}"
        kind = "gemm" if op in GEMM_OPS else "attention" if "scaled_dot_product" in op or "attention" in op \
            else "extern"
        out.append(Launch(len(out), kind, name, None))
    return out


# ---- sm90 builds --------------------------------------------------------------------------------------

@dataclass
class Build:
    """One kernel compiled for sm90 under one of its launch configs."""

    kernel: str
    config: str               # the config's block sizes, warps and stages ("" when the build failed early)
    registers: Optional[int] = None
    local_bytes: Optional[int] = None   # local memory per thread: register spills (and stack arrays)
    shared_bytes: Optional[int] = None  # dynamic shared memory the launch asks for
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def _nvidia_tool(name: str) -> Optional[str]:
    """Triton's bundled NVIDIA tool ``name`` (ptxas, cuobjdump), else one on PATH."""
    try:
        import triton
    except ImportError:
        return None
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return bundled if os.path.exists(bundled) else shutil.which(name)


def ptxas_available() -> tuple[bool, str]:
    """(whether kernels can be built for sm90 here, why not)."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as e:
        return False, f"triton with its NVIDIA backend does not import: {e}"
    for tool in ("ptxas", "cuobjdump"):
        if _nvidia_tool(tool) is None:
            return False, f"no {tool}: neither Triton's bundled one nor one on PATH"
    return True, ""


@contextlib.contextmanager
def _sm90_build():
    """Inductor's kernel modules import and precompile here as on an sm90 GPU: the Triton driver's
    target is sm90, the driver switch and the raw-stream query (run at import, never used by a build)
    are stubbed, and the static launcher (which loads the cubin) is off."""
    import torch
    import torch._inductor.config as inductor_config
    import triton
    from torch._inductor.runtime import triton_helpers
    from triton.backends.compiler import GPUTarget

    target = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32))
    with mock.patch.object(triton_helpers, "set_driver_to_gpu", lambda: None), \
            mock.patch.object(triton.runtime.driver, "_active", target), \
            mock.patch.object(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, create=True), \
            inductor_config.patch(use_static_cuda_launcher=False):
        yield


def _resource_usage(cubin: bytes, path: str) -> tuple[Optional[int], Optional[int]]:
    """(registers, local bytes per thread) of the one kernel in ``cubin``, from ``cuobjdump -res-usage``."""
    with open(path, "wb") as f:
        f.write(cubin)
    usage = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                           check=True).stdout
    reg, local = re.search(r"REG:(\d+)", usage), re.search(r"LOCAL:(\d+)", usage)
    return (int(reg.group(1)) if reg else None), (int(local.group(1)) if local else None)


def _config_text(config) -> str:
    sizes = " ".join(f"{k}={v}" for k, v in sorted(config.kwargs.items()))
    return f"{sizes} warps={config.num_warps} stages={config.num_stages}".strip()


def build_sm90(kernels: Iterable[KernelSource], workdir: str, all_configs: bool = True) -> list[Build]:
    """Compile each kernel for sm90 under each launch config (``all_configs``: every config inductor
    would compile before autotuning on a GPU; else the first), in ``workdir`` (kernel modules and
    cubins are written there: Triton reads a kernel's source from its file)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    os.makedirs(workdir, exist_ok=True)
    builds: list[Build] = []
    with _sm90_build():
        for kernel in kernels:
            path = os.path.join(workdir, f"{kernel.name}.py")
            with open(path, "w") as f:
                f.write(kernel.source)
            try:
                module = types.ModuleType(kernel.name)
                module.__file__ = path
                exec(compile(kernel.source, path, "exec"), module.__dict__)
                tuner = next(v for v in vars(module).values() if isinstance(v, CachingAutotuner))
            except Exception as e:   # the module itself does not import: one row, the reason
                builds.append(Build(kernel.name, "", error=_first_line(e)))
                continue
            for config in tuner.configs if all_configs else tuner.configs[:1]:
                build = Build(kernel.name, _config_text(config))
                try:
                    binary = tuner._precompile_config(config).kernel
                    build.registers, build.local_bytes = _resource_usage(
                        binary.asm["cubin"], os.path.join(workdir, f"{kernel.name}.cubin"))
                    build.shared_bytes = int(binary.metadata.shared)
                except Exception as e:   # a compile error is the finding: keep it and go on
                    build.error = _first_line(e)
                builds.append(build)
    return builds


def _first_line(e: Exception) -> str:
    """The exception's type with its first and last non-empty lines (a Triton compile error puts the
    source position first and the reason last)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = " ... ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else ""
    return f"{type(e).__name__}: {text[:300]}"
