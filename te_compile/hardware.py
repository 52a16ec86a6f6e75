"""What the current device runs natively and what te_compile emulates, in one place.

Mirrors TransformerEngine's ``is_*_available(return_reason=...)``. "Available" means the device has
native GEMMs for the format; where it does not, te_compile still runs the recipe with an exact
dequantize-then-matmul emulation, and the reason string says so.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = [
    "get_device_compute_capability",
    "is_bf16_available",
    "is_fp8_available",
    "is_mxfp8_available",
    "is_fp8_block_scaling_available",
    "is_nvfp4_available",
    "is_activation_offload_available",
    "code_device_type",
]

DeviceLike = Optional[Union[str, torch.device]]


def _device(device: DeviceLike) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def get_device_compute_capability(device: DeviceLike = None) -> tuple[int, int]:
    """(major, minor) of a CUDA device; (0, 0) for a CPU or when CUDA is not available."""
    device = _device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def _answer(ok: bool, reason: str, return_reason: bool):
    return (ok, reason) if return_reason else ok


def _cuda_probe(device, need: tuple[int, int], what: str, return_reason: bool,
                only_major: Optional[int] = None):
    """``need``: the lowest compute capability; ``only_major``: the one architecture family that has
    it, where later ones dropped it."""
    if not torch.cuda.is_available():
        # A probe answers rather than raises: asking about "cuda" on a CPU-only build is a question.
        return _answer(False, f"{what}: {device} requested but CUDA is not available; "
                       "te_compile emulates it (dequantize-then-matmul)", return_reason)
    cc = get_device_compute_capability(device)
    if cc >= need and (only_major is None or cc[0] == only_major):
        return _answer(True, f"{what}: native on compute capability {cc[0]}.{cc[1]}", return_reason)
    wanted = f"{only_major}.x" if only_major is not None else f"{need[0]}.{need[1]}+"
    return _answer(
        False,
        f"{what}: needs compute capability {wanted}, found {cc[0]}.{cc[1]}; "
        "te_compile emulates it (dequantize-then-matmul)",
        return_reason,
    )


# A CPU's answer for the block formats: no native GEMM, the exact emulation instead.
_EMULATED_ON_CPU = (False, "emulated on CPU (dequantize-then-matmul)")


def _probe(device: DeviceLike, what: str, on_cpu: tuple[bool, str], need: tuple[int, int], return_reason: bool,
           only_major: Optional[int] = None):
    """``on_cpu``: (answer, why) for a CPU; else the CUDA device's compute capability decides."""
    device = _device(device)
    if device.type == "cpu":
        return _answer(on_cpu[0], f"{what}: {on_cpu[1]}", return_reason)
    return _cuda_probe(device, need, what, return_reason, only_major)


def is_bf16_available(return_reason: bool = False, device: DeviceLike = None):
    """bf16 arithmetic: CPU and CUDA sm80+."""
    return _probe(device, "bf16", (True, "supported on CPU (slow matmuls; test in fp32)"), (8, 0), return_reason)


def is_fp8_available(return_reason: bool = False, device: DeviceLike = None):
    """Per-tensor FP8 GEMMs (torch._scaled_mm): CPU and CUDA sm89+ run them natively."""
    return _probe(device, "FP8", (True, "torch._scaled_mm runs per-tensor FP8 GEMMs on CPU"), (8, 9), return_reason)


def is_mxfp8_available(return_reason: bool = False, device: DeviceLike = None):
    """MXFP8 block-scaled GEMMs: Blackwell (sm100+) only; emulated elsewhere."""
    return _probe(device, "MXFP8", _EMULATED_ON_CPU, (10, 0), return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False, device: DeviceLike = None):
    """1x128 / 128x128 block-scaled FP8 GEMMs: Hopper (sm90) only; emulated elsewhere.

    cuBLASLt (12.9+) has these scaling modes on Hopper alone, and torch's scaled_mm refuses them on
    other architectures ("DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90").
    """
    return _probe(device, "FP8 block scaling", _EMULATED_ON_CPU, (9, 0), return_reason, only_major=9)


def is_nvfp4_available(return_reason: bool = False, device: DeviceLike = None):
    """NVFP4 GEMMs: Blackwell (sm100+) only; emulated elsewhere."""
    return _probe(device, "NVFP4", _EMULATED_ON_CPU, (10, 0), return_reason)


# torch._functorch.config flags activation offload needs: the partitioner's offload/reload insertion,
# its side-stream form and the backward's reload prefetch
_OFFLOAD_FLAGS = ("enable_activation_offloading", "activation_offload_separate_stream", "activation_reload_prefetch")


def is_activation_offload_available(return_reason: bool = False, device: DeviceLike = None):
    """Moving the compiled graphs' saved tensors to host memory (``[memory] offload_activations``).

    torch's partitioner inserts the transfers (``torch._functorch._activation_offloading``, behind
    ``torch._functorch.config.enable_activation_offloading``). On an accelerator te runs them on a side
    stream into pinned memory with the ``ao::offload`` / ``ao::reload`` / ``ao::wait_tensor`` ops; on
    a CPU they are host copies on the compute thread. Other devices have neither."""
    import torch._functorch.config as functorch_config

    version = torch.__version__.split("+")[0]
    missing = [flag for flag in _OFFLOAD_FLAGS if not hasattr(functorch_config, flag)]
    if missing:
        return _answer(False, f"activation offload: torch {version} has no activation offloading in its "
                       f"partitioner (torch._functorch.config lacks {', '.join(missing)})", return_reason)
    device = _device(device)
    if device.type == "cpu":
        return _answer(True, "activation offload: on CPU the transfers are host copies (no side stream)",
                       return_reason)
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != device.type:
        return _answer(False, f"activation offload: device {device} is neither the CPU nor this process's "
                       f"accelerator ({accelerator or 'none'}), which the side stream needs", return_reason)
    try:
        from torch._functorch._activation_offloading import offload_ops  # noqa: F401 (registers the ops)
    except ImportError:
        return _answer(False, f"activation offload: torch {version} has the partitioner flags but not the "
                       "ao::offload / ao::reload ops (torch._functorch._activation_offloading.offload_ops) "
                       "te runs the side-stream transfers with", return_reason)
    return _answer(True, f"activation offload: side-stream transfers to pinned host memory on {device}",
                   return_reason)


def code_device_type(t: torch.Tensor) -> str:
    """The device type whose code a compiled graph holding ``t`` is generated for: ``t``'s own.
    benchmarks/offline.py answers "cuda" while it traces, on a CPU, the code inductor would write for an
    H100; the passes and lowerings that choose by device call it through this module so that one patch
    covers them all."""
    return t.device.type
