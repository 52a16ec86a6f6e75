"""The bit-level Triton casts equal torch's saturating casts (and the E2M1 grid) bit for bit."""

import pytest
import torch

from te_compile.kernels._fp_bits import HAS_TRITON
from utils import FLT_MAX, FP8_DTYPES, FP8_MAX, assert_bitwise_equal, fp8_id, on_kernel_device

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from te_compile.kernels._fp_bits import (
        e2m1_bits_to_fp32,
        e2m1_magnitude_code,
        fp32_to_e2m1_bits,
        fp32_to_fp8_bits,
        min_drop_nan,
        round_to_e4m3,
    )

    @triton.jit
    def _casts_kernel(x_ptr, fp8_ptr, e4m3_ptr, e2m1_ptr, e2m1_val_ptr, mag_ptr, n, IS_E4M3: tl.constexpr,
                      BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(fp8_ptr + offs, fp32_to_fp8_bits(v, IS_E4M3).to(tl.uint8), mask=mask)
        tl.store(e4m3_ptr + offs, round_to_e4m3(v), mask=mask)
        code = fp32_to_e2m1_bits(v)
        tl.store(e2m1_ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(e2m1_val_ptr + offs, e2m1_bits_to_fp32(code), mask=mask)
        # the NVFP4 kernel's path: |v| clamped to 6 (NaN to 6 too), then the magnitude code
        tl.store(mag_ptr + offs, e2m1_magnitude_code(min_drop_nan(tl.abs(v), 6.0)).to(tl.uint8), mask=mask)


def _run(x: torch.Tensor, fp8_dtype):
    n = x.numel()
    fp8 = torch.empty(n, dtype=torch.uint8, device=x.device)
    e4m3 = torch.empty(n, dtype=torch.float32, device=x.device)
    e2m1 = torch.empty(n, dtype=torch.uint8, device=x.device)
    e2m1_val = torch.empty(n, dtype=torch.float32, device=x.device)
    mag = torch.empty(n, dtype=torch.uint8, device=x.device)
    block = 4096
    _casts_kernel[(triton.cdiv(n, block),)](x, fp8, e4m3, e2m1, e2m1_val, mag, n,
                                             IS_E4M3=fp8_dtype == torch.float8_e4m3fn, BLOCK=block)
    return fp8, e4m3, e2m1, e2m1_val, mag


_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1_reference(x: torch.Tensor) -> torch.Tensor:
    """Nearest grid point by brute force, ties to the even code; NaN -> 6; sign bit from x."""
    mag = x.abs().nan_to_num(nan=6.0).clamp(max=6.0)
    dist = (mag[:, None] - _GRID.to(x.device)[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    codes = torch.arange(8, device=x.device)
    # among the (at most two) nearest, prefer the even code
    cost = torch.where(dist == best, codes % 2, torch.full_like(dist, 9, dtype=torch.long))
    code = cost.argmin(dim=1)
    sign = torch.signbit(x).to(torch.long) * 8
    return (code + sign).to(torch.uint8)


def _inputs(device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=g) * torch.pow(2.0, torch.randint(-30, 30, (20000,), generator=g).float())
    # every e4m3/e5m2 value, the midpoints between neighbours (ties) and their one-ulp neighbours
    grid = torch.cat([torch.arange(256, dtype=torch.uint8).view(d).float() for d in FP8_DTYPES])
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    ties = torch.cat([mids, torch.nextafter(mids, torch.tensor(float("inf"))),
                      torch.nextafter(mids, torch.tensor(-float("inf")))])
    e2m1 = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 5.999, 6.001])
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), FLT_MAX, -FLT_MAX,
                            1e-45, -1e-45, 1e-39, 2.0**-126, 464.0, 480.0, 57344.0, 61440.0, 65536.0])
    x = torch.cat([rand, grid, -grid, ties, -ties, e2m1, -e2m1, special]).float()
    return x.to(device)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_id)
def test_casts_match_torch(fp8_dtype):
    x = _inputs()
    fp8, e4m3, e2m1, e2m1_val, mag = on_kernel_device(_run)(x, fp8_dtype)
    fmax = FP8_MAX[fp8_dtype]
    assert_bitwise_equal(fp8, x.clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8), f"{fp8_id(fp8_dtype)} bytes")
    # NaN payloads may differ; NaN positions may not
    expected = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    assert torch.equal(e4m3.isnan(), expected.isnan())
    assert_bitwise_equal(e4m3.nan_to_num(nan=1.0), expected.nan_to_num(nan=1.0), "e4m3 values")
    assert_bitwise_equal(e2m1, _e2m1_reference(x), "e2m1 codes")
    assert_bitwise_equal(mag, _e2m1_reference(x) & 7, "e2m1 magnitude codes")
    signs = torch.where(torch.signbit(x), -1.0, 1.0)
    assert_bitwise_equal(e2m1_val, signs * _GRID[(e2m1 & 7).long()], "e2m1 values")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_casts_match_torch_cuda():
    x = _inputs("cuda")
    for fp8_dtype in FP8_DTYPES:
        fp8, e4m3, e2m1, _, mag = _run(x, fp8_dtype)
        fmax = FP8_MAX[fp8_dtype]
        assert_bitwise_equal(fp8.cpu(), x.cpu().clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8))
        assert_bitwise_equal(e2m1.cpu(), _e2m1_reference(x.cpu()))
        assert_bitwise_equal(mag.cpu(), _e2m1_reference(x.cpu()) & 7)
