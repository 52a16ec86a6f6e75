"""te_compile.hardware: what runs natively and what is emulated, with reasons."""

from __future__ import annotations

import pytest
import torch

from te_compile.hardware import (
    get_device_compute_capability,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)

PROBES = (is_bf16_available, is_fp8_available, is_fp8_block_scaling_available, is_mxfp8_available,
          is_nvfp4_available)
EMULATED_ON_CPU = (is_mxfp8_available, is_fp8_block_scaling_available, is_nvfp4_available)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_compute_capability_is_zero_on_cpu(device):
    assert get_device_compute_capability(device) == (0, 0)


def test_fp8_is_available_on_cpu_and_says_so():
    ok, reason = is_fp8_available(return_reason=True, device="cpu")
    assert ok is True
    assert "CPU" in reason and "FP8" in reason, reason
    assert is_fp8_available(device="cpu") is True


@pytest.mark.parametrize("probe", EMULATED_ON_CPU, ids=lambda p: p.__name__)
def test_block_formats_are_emulated_on_cpu(probe):
    ok, reason = probe(return_reason=True, device="cpu")
    assert ok is False
    assert "emulated" in reason and "CPU" in reason, reason
    assert probe(device="cpu") is False


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.__name__)
def test_return_reason_gives_bool_and_str(probe):
    answer = probe(return_reason=True, device="cpu")
    assert isinstance(answer, tuple) and len(answer) == 2
    assert isinstance(answer[0], bool) and isinstance(answer[1], str) and answer[1]
    plain = probe(device="cpu")
    assert isinstance(plain, bool) and plain == answer[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the default device of a CPU-only machine")
def test_default_device_is_cpu_without_cuda():
    assert get_device_compute_capability() == (0, 0)
    assert is_fp8_available(return_reason=True) == is_fp8_available(return_reason=True, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks asking about CUDA on a CPU-only machine")
@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.__name__)
def test_asking_about_cuda_without_cuda_answers_false(probe):
    ok, reason = probe(return_reason=True, device="cuda")
    assert ok is False
    assert "not available" in reason, reason
    assert get_device_compute_capability("cuda") == (0, 0)


# The CUDA branch, driven by a faked compute capability (needs no GPU).
@pytest.mark.parametrize(
    "cc, fp8, block, mx, fp4",
    [((8, 0), False, False, False, False), ((8, 9), True, False, False, False),
     ((9, 0), True, True, False, False), ((10, 0), True, False, True, True),
     ((12, 0), True, False, True, True)],
)
def test_cuda_thresholds(monkeypatch, cc, fp8, block, mx, fp4):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    assert get_device_compute_capability("cuda") == cc
    got = {p.__name__: p(return_reason=True, device="cuda") for p in
           (is_fp8_available, is_fp8_block_scaling_available, is_mxfp8_available, is_nvfp4_available)}
    want = {"is_fp8_available": fp8, "is_fp8_block_scaling_available": block,
            "is_mxfp8_available": mx, "is_nvfp4_available": fp4}
    assert {name: ok for name, (ok, _) in got.items()} == want
    for ok, reason in got.values():
        if ok:
            assert f"native on compute capability {cc[0]}.{cc[1]}" in reason, reason
        else:
            assert f"found {cc[0]}.{cc[1]}" in reason and "emulates" in reason, reason
            assert "needs compute capability" in reason, reason
    assert is_bf16_available(device="cuda") is (cc >= (8, 0))
