"""NVFP4 quantize: Triton kernel vs reference (bit for bit), the reference vs a brute-force encoding
written here, rounding rules, the random Hadamard transform, and the custom-recipe reference.

The Triton launcher runs in the interpreter on CPU (tests/conftest.py); shapes are kept small."""

from __future__ import annotations

import math

import pytest
import torch

from te_compile.custom_recipes.quantization_nvfp4 import (
    NVFP4QuantizerRef,
    NVFP4TensorRef,
    nvfp4_ref_quantizer_factory,
)
from te_compile.kernels._fp_bits import HAS_TRITON
from te_compile.kernels.nvfp4_quantize import (
    NVFP4_BLOCK,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
    nvfp4_quantize_reference,
    nvfp4_quantize_triton,
    unpack_e2m1,
)
from te_compile.tensor.rht import RHT_SIGNS, apply_rht, rht_matrix, undo_rht
from utils import FLT_MAX, assert_bitwise_equal, seed, sqnr, on_kernel_device

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# numpy under the Triton interpreter warns on the IEEE inf results the kernel relies on (S / 0)
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NAN, INF = float("nan"), float("inf")
TINY = 1e-45  # the smallest fp32 subnormal


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().abs().amax().reshape(1)


def _many_magnitudes(shape, g: torch.Generator) -> torch.Tensor:
    """randn with each row scaled by 2**randint(-40, 40)."""
    x = torch.randn(shape, generator=g)
    return x * 2.0 ** torch.randint(-40, 41, (shape[0], 1), generator=g).float()


def _with_edge_values(x: torch.Tensor) -> torch.Tensor:
    """x with -0, a NaN and a subnormal in its first block and zeros in its last block."""
    x = x.clone()
    flat = x.view(-1)
    flat[: min(3, flat.numel())] = torch.tensor([-0.0, NAN, TINY])[: min(3, flat.numel())]
    x[-1, -NVFP4_BLOCK:] = 0.0
    return x


def _codes(data: torch.Tensor) -> torch.Tensor:
    """Packed uint8 [M, K/2] -> int64 codes [M, K] (low nibble first)."""
    return torch.stack([data & 15, data >> 4], dim=-1).reshape(data.shape[0], -1).to(torch.int64)


# ---- kernel vs reference ------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("shape", [(1, 16), (17, 32), (64, 256), (40, 48)], ids=str)
@pytest.mark.parametrize("tile_rows", [1, 16])
@pytest.mark.parametrize("stochastic", [False, True], ids=["rne", "sr"])
def test_triton_matches_reference(shape, tile_rows, stochastic):
    g = seed(sum(shape) + tile_rows)
    x = _with_edge_values(_many_magnitudes(shape, g))
    # the NaN-free amax: a NaN amax would make S = 1 and hide the scaling
    amax = _amax(torch.nan_to_num(x, nan=0.0))
    rand = torch.rand(shape, generator=g) if stochastic else None
    ref = nvfp4_quantize_reference(x, amax, tile_rows=tile_rows, rand=rand)
    out = nvfp4_quantize_triton(x, amax, tile_rows=tile_rows, rand=rand)
    assert_bitwise_equal(out[0], ref[0], "data")
    assert_bitwise_equal(out[1], ref[1], "scale")
    assert ref[0].shape == (shape[0], shape[1] // 2) and ref[1].shape == (shape[0], shape[1] // 16)


@needs_triton
@pytest.mark.parametrize("amax_kind", ["true", "nan_free", "zero", "inf", "tiny"])
@pytest.mark.parametrize("tile_rows", [1, 16])
def test_triton_edge_values(amax_kind, tile_rows):
    # rows: specials, huge, tiny, an all-NaN block, and an ordinary row
    x = torch.zeros(18, 32)
    x[0, :8] = torch.tensor([INF, -INF, NAN, -NAN, FLT_MAX, -FLT_MAX, TINY, -0.0])
    x[1, :16] = FLT_MAX / 3
    x[2, :16] = torch.tensor([TINY * (i + 1) for i in range(16)])
    x[3, 16:] = NAN
    x[4] = torch.linspace(-7, 7, 32)
    x[17] = torch.linspace(-1e-3, 1e-3, 32)
    finite = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    amax = {"true": _amax(x), "nan_free": _amax(finite), "zero": torch.zeros(1),
            "inf": torch.full((1,), INF), "tiny": torch.full((1,), 1e-40)}[amax_kind]
    ref = nvfp4_quantize_reference(x, amax, tile_rows=tile_rows, rand=None)
    out = nvfp4_quantize_triton(x, amax, tile_rows=tile_rows, rand=None)
    assert_bitwise_equal(out[0], ref[0], "data")
    assert_bitwise_equal(out[1], ref[1], "scale")
    codes = _codes(ref[0])
    # NaN -> code 7 with the sign of x; -0 -> code 8; an all-NaN block has scale 0
    assert codes[0, 2] == 7 and codes[0, 3] == 15 and codes[0, 7] == 8
    assert codes[3, 16:].eq(7).all()
    if tile_rows == 1:
        assert ref[1][3, 1] == 0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_half_inputs_and_strides(dtype):
    g = seed(3)
    x = (torch.randn(48, 96, generator=g) * 8).to(dtype)
    amax = _amax(x)
    rand = torch.rand(48, 64, generator=g)
    view = x[:, 16:80]  # row stride 96: the launcher must honour it
    for tile_rows in (1, 16):
        ref = nvfp4_quantize_reference(view, amax, tile_rows=tile_rows, rand=rand)
        out = nvfp4_quantize_triton(view, amax, tile_rows=tile_rows, rand=rand)
        assert_bitwise_equal(out[0], ref[0], f"data tile_rows={tile_rows}")
        assert_bitwise_equal(out[1], ref[1], f"scale tile_rows={tile_rows}")


def test_dispatch_uses_reference_on_cpu():
    g = seed(4)
    x = torch.randn(16, 64, generator=g)
    out = nvfp4_quantize(x, _amax(x), tile_rows=1)
    ref = nvfp4_quantize_reference(x, _amax(x), tile_rows=1, rand=None)
    assert_bitwise_equal(out[0], ref[0])
    assert_bitwise_equal(out[1], ref[1])


# ---- reference vs brute force -------------------------------------------------------------------

def _brute_force(x: torch.Tensor, amax: float, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exhaustive nearest-value search over all e4m3 and E2M1 values, fp32 steps emulated in fp64."""
    f32 = lambda t: t.to(torch.float32).to(torch.float64)  # noqa: E731
    m, k = x.shape
    if amax == 0 or not math.isfinite(amax):
        s = 1.0
    else:
        s = min(f32(torch.tensor(2688.0 / amax)).item(), FLT_MAX)
    e4m3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)  # ascending
    x64 = x.to(torch.float64)
    absx = torch.where(x64.isnan(), 0.0, x64.abs()).reshape(m, k // 16, 16).amax(-1)
    tile = torch.stack([absx[(i // tile_rows) * tile_rows: (i // tile_rows + 1) * tile_rows].amax(0)
                        for i in range(m)])
    target = f32(f32(tile / 6.0) * s).clamp(max=448.0)
    dist = (e4m3 - target[..., None]).abs()
    best = dist.min(-1, keepdim=True).values
    # among the nearest values, the even code (there are at most two)
    idx = torch.where(dist == best, torch.arange(127) % 2 * 1000 + torch.arange(127), 10**6).argmin(-1)
    bs = e4m3[idx]
    f = torch.where(bs == 0, 0.0, f32(s / bs).clamp(max=FLT_MAX))
    v = f32(x64.reshape(m, k // 16, 16) * f[..., None]).reshape(m, k)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    d = (grid - v.abs().clamp(max=6.0)[..., None]).abs()
    near = d == d.min(-1, keepdim=True).values
    mag = torch.where(near, torch.arange(8) % 2 * 100 + torch.arange(8), 10**6).argmin(-1)
    mag = torch.where(v.isnan(), 7, mag)
    codes = mag + 8 * torch.signbit(x64).long()
    return (codes[:, 0::2] + 16 * codes[:, 1::2]).to(torch.uint8), idx.to(torch.uint8)


@pytest.mark.parametrize("tile_rows", [1, 16])
@pytest.mark.parametrize("shape", [(1, 32), (19, 48)], ids=str)
def test_reference_matches_brute_force(shape, tile_rows):
    g = seed(5 + tile_rows)
    x = _with_edge_values(_many_magnitudes(shape, g))
    for amax in (_amax(torch.nan_to_num(x, nan=0.0)), _amax(x), torch.full((1,), 1e-40)):
        data, scale = nvfp4_quantize_reference(x, amax, tile_rows=tile_rows, rand=None)
        exp_data, exp_scale = _brute_force(x, amax.item(), tile_rows)
        assert_bitwise_equal(scale, exp_scale, f"scale, amax={amax.item()}")
        assert_bitwise_equal(data, exp_data, f"data, amax={amax.item()}")


def _unit_scale_block(values) -> torch.Tensor:
    """Rows of 16 whose block amax is 6 under a tensor amax of 6: S = 448, bs = 448, f = 1, so the
    E2M1 rounding sees the values themselves."""
    x = torch.tensor(values, dtype=torch.float32).reshape(-1, 16)
    assert x.abs().amax(1).eq(6.0).all()
    return x


def test_grid_points_round_trip_exactly():
    grid = list(E2M1_GRID) + [-v for v in E2M1_GRID]  # codes 0..15 in order
    x = _unit_scale_block(grid)
    amax = torch.full((1,), 6.0)
    data, scale = nvfp4_quantize_reference(x, amax, tile_rows=1, rand=None)
    assert_bitwise_equal(_codes(data), torch.arange(16).reshape(1, 16))
    assert data[0, 0].item() == 0x10 and data[0, 7].item() == 0xFE  # element 2j in the low nibble
    assert scale.view(torch.float8_e4m3fn).float().item() == 448.0
    assert_bitwise_equal(nvfp4_dequantize(data, scale, amax), x)
    assert_bitwise_equal(unpack_e2m1(data), x)


def test_ties_go_to_the_even_code():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expect = [0, 2, 2, 4, 4, 6, 6]
    # neighbouring fp32 values of the midpoints
    above = torch.nextafter(torch.tensor(mids), torch.tensor(INF)).tolist()
    below = torch.nextafter(torch.tensor(mids), torch.tensor(-INF)).tolist()
    row = lambda vals: vals + [6.0] + [-v for v in vals] + [-6.0]  # noqa: E731
    x = _unit_scale_block(row(mids) + row(above) + row(below))
    codes = _codes(nvfp4_quantize_reference(x, torch.full((1,), 6.0), tile_rows=1, rand=None)[0])
    signed = lambda c: c + [7] + [v + 8 for v in c] + [15]  # noqa: E731
    assert codes[0].tolist() == signed(expect)
    assert codes[1].tolist() == signed([1, 2, 3, 4, 5, 6, 7])   # just above: the upper neighbour
    assert codes[2].tolist() == signed([0, 1, 2, 3, 4, 5, 6])   # just below: the lower neighbour


def test_global_scale_rules():
    amax = torch.tensor([0.0, INF, NAN, 1e-40, 3.0, 448.0])
    s = torch.cat([nvfp4_global_scale(a.reshape(1)) for a in amax])
    expect = torch.tensor([1.0, 1.0, 1.0, FLT_MAX, 2688.0 / 3.0, 6.0], dtype=torch.float64).float()
    assert_bitwise_equal(s, expect)


# ---- properties ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tile_rows", [1, 16])
def test_round_trip_sqnr_and_idempotence(tile_rows):
    g = seed(6)
    x = torch.randn(64, 256, generator=g) * 2.0 ** torch.randint(-3, 4, (64, 1), generator=g).float()
    amax = _amax(x)
    data, scale = nvfp4_quantize_reference(x, amax, tile_rows=tile_rows, rand=None)
    y = nvfp4_dequantize(data, scale, amax)
    value = sqnr(x, y)
    assert value >= 8.0, f"SQNR {value:.2f} dB < 8 dB"
    # the dequantized tensor re-quantizes (with its own amax) to the same bytes
    data2, scale2 = nvfp4_quantize_reference(y, _amax(y), tile_rows=tile_rows, rand=None)
    assert_bitwise_equal(scale2, scale, "scale")
    assert_bitwise_equal(data2, data, "data")


def test_stochastic_rounding_unbiased_and_bracketing():
    g = seed(7)
    # f = 1 (see _unit_scale_block): the codes are the rounding of x itself
    x = torch.rand(4, 16, generator=g) * 12 - 6
    x[:, 0] = 6.0
    x = x.reshape(1, 64)
    draws = 2000
    xs = x.expand(draws, 64).contiguous()
    rand = torch.rand(draws, 64, generator=g)
    data, scale = nvfp4_quantize_reference(xs, torch.full((1,), 6.0), tile_rows=1, rand=rand)
    q = unpack_e2m1(data)
    grid = torch.tensor(E2M1_GRID)
    a = x.abs()
    lo = torch.stack([grid[grid <= v].max() for v in a.view(-1)]).reshape(a.shape)
    hi = torch.stack([grid[grid >= v].min() for v in a.view(-1)]).reshape(a.shape)
    assert (q.abs().eq(lo) | q.abs().eq(hi)).all(), "a draw left the two neighbouring grid points"
    assert (torch.signbit(q) == torch.signbit(x)).all()
    # Bernoulli over a step of (hi - lo): the mean's std is at most (hi - lo) / (2 sqrt(draws))
    tol = 5 * (hi - lo) / (2 * math.sqrt(draws)) + 1e-6
    err = (q.double().mean(0) - x.double()).abs()
    assert (err <= tol.double()).all(), f"max |mean - x| {err.max().item():.4g}"
    # both neighbours occur where x is off the grid; grid points never move
    off_grid = lo != hi
    assert ((q.abs() == hi) & off_grid).any() and ((q.abs() == lo) & off_grid).any()
    assert (q[:, ~off_grid[0]] == x[:, ~off_grid[0]]).all()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_stochastic_rounding_threshold(impl):
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("needs triton")
    fn = nvfp4_quantize_reference if impl == "reference" else nvfp4_quantize_triton
    # f = 1; p = (|x| - lo) / (hi - lo): 0.75 -> 0.5, 2.25 -> 0.25, 5.0 -> 0.5, 6 and 1.5 -> 0
    vals = [0.75, 2.25, 5.0, 6.0, 1.5, -0.75, -5.0, 0.0]
    p = torch.tensor([0.5, 0.25, 0.5, 0.0, 0.0, 0.5, 0.5, 0.0])
    x = _unit_scale_block(vals + vals).expand(2, 16).contiguous()
    below = torch.nextafter(p, torch.tensor(-1.0)).clamp(min=0.0)
    # row 0: rand == p (stays at lo); row 1: rand just below p (goes to hi where p > 0)
    rand = torch.stack([torch.cat([p, p]), torch.cat([below, below])])
    codes = _codes(fn(x, torch.full((1,), 6.0), tile_rows=1, rand=rand)[0])
    lo = [1, 4, 6, 7, 3, 9, 14, 0]
    hi = [2, 5, 7, 7, 3, 10, 15, 0]
    assert codes[0].tolist() == lo + lo
    assert codes[1].tolist() == hi + hi


def test_stochastic_rounding_reproducible_with_seed():
    x = torch.randn(32, 64, generator=seed(8))
    quantizer = NVFP4QuantizerRef(stochastic_rounding=True)
    torch.manual_seed(11)
    a = quantizer.quantize(x)
    torch.manual_seed(11)
    b = quantizer.quantize(x)
    c = quantizer.quantize(x)
    assert_bitwise_equal(a.rowwise_data, b.rowwise_data)
    assert_bitwise_equal(a.columnwise_data, b.columnwise_data)
    assert not torch.equal(b.rowwise_data, c.rowwise_data)


@pytest.mark.parametrize("m", [48, 40], ids=["M48", "M40_ragged"])
def test_tiles_16x16_transpose(m):
    g = seed(9)
    x = _many_magnitudes((m, 64), g) if m % 16 else torch.randn(m, 64, generator=g)
    amax = _amax(x)
    data, scale = nvfp4_quantize_reference(x, amax, tile_rows=16, rand=None)
    mt = -(-m // 16)
    # every row of a tile holds the tile's scale
    for t in range(mt):
        rows = scale[t * 16: min(m, t * 16 + 16)]
        assert (rows == rows[:1]).all()
    if m % 16 == 0:
        data_t, scale_t = nvfp4_quantize_reference(x.t(), amax, tile_rows=16, rand=None)
        assert_bitwise_equal(_codes(data_t), _codes(data).t().contiguous(), "codes")
        assert_bitwise_equal(scale_t[::16], scale[::16].t().contiguous(), "tile scales")
    else:
        # the ragged last tile's scale comes from the rows that exist
        last = x[(mt - 1) * 16:, :16].abs().amax().reshape(1)
        s = nvfp4_global_scale(amax)
        expect = (torch.div(last, torch.full_like(last, 6.0)) * s).to(torch.float8_e4m3fn)
        assert scale[(mt - 1) * 16, 0] == expect.view(torch.uint8)[0]


# ---- RHT ----------------------------------------------------------------------------------------

def test_rht_matrix_fixed_and_orthogonal():
    r = rht_matrix()
    assert r.shape == (16, 16) and r.dtype == torch.float32
    # independent construction: H[i, j] = (-1)^popcount(i & j), rows scaled by TE's signs
    signs = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
    assert list(RHT_SIGNS) == signs
    expect = torch.tensor([[signs[i] * (-1) ** bin(i & j).count("1") / 4 for j in range(16)]
                           for i in range(16)])
    assert_bitwise_equal(r, expect)
    assert_bitwise_equal(r @ r.t(), torch.eye(16))
    assert_bitwise_equal(rht_matrix(dtype=torch.float64), expect.double())
    assert_bitwise_equal(apply_rht(torch.eye(16)), r)


def test_rht_apply_undo_round_trip():
    x = torch.randn(24, 64, generator=seed(10)).to(torch.bfloat16)
    y = apply_rht(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    # orthogonal: norms of each group of 16 are kept
    norms = lambda t: t.float().reshape(24, 4, 16).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(norms(y), norms(x), rtol=1e-6, atol=0)
    torch.testing.assert_close(undo_rht(y), x.float(), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 16"):
        apply_rht(torch.zeros(4, 24))


# ---- custom-recipe reference --------------------------------------------------------------------

def _expected_buffers(x: torch.Tensor, *, with_rht: bool, sr: bool, tile_rows: int, seed_value: int):
    """The rowwise and columnwise copies built from the kernel reference, drawing as documented."""
    x2d = x.reshape(-1, x.shape[-1])
    torch.manual_seed(seed_value)
    rand_r = torch.rand(x2d.shape) if sr else None
    rand_c = torch.rand(x2d.t().shape) if sr else None
    xt = apply_rht(x2d.t()) if with_rht else x2d.t()
    row = nvfp4_quantize_reference(x2d, _amax(x2d), tile_rows=tile_rows, rand=rand_r)
    col = nvfp4_quantize_reference(xt, _amax(xt), tile_rows=tile_rows, rand=rand_c)
    return row + (_amax(x2d),) + col + (_amax(xt),)


@pytest.mark.parametrize("role", ["input", "weight", "output", "grad_output", "grad_input"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_custom_reference_matches_kernel_reference(role, dtype):
    g = seed(12)
    x = _with_edge_values(_many_magnitudes((48, 64), g)).reshape(3, 16, 64).to(dtype)
    x = torch.nan_to_num(x, nan=1.0)  # a NaN would make both amaxes NaN (S = 1): tested elsewhere
    quantizer = nvfp4_ref_quantizer_factory(role)
    torch.manual_seed(13)
    q = quantizer.quantize(x)
    expect = _expected_buffers(x, with_rht=quantizer.with_rht, sr=quantizer.stochastic_rounding,
                               tile_rows=16 if quantizer.with_2d_quantization else 1, seed_value=13)
    names = ("rowwise_data", "rowwise_scale", "amax_rowwise",
             "columnwise_data", "columnwise_scale", "amax_columnwise")
    for name, want in zip(names, expect):
        assert_bitwise_equal(getattr(q, name), want, name)
    y = q.dequantize()
    assert y.shape == x.shape and y.dtype == dtype
    assert sqnr(x.float(), y.float()) >= 8.0


def test_factory_roles_and_errors():
    cfg = lambda q: (q.with_rht, q.stochastic_rounding, q.with_2d_quantization)  # noqa: E731
    assert cfg(nvfp4_ref_quantizer_factory("input")) == (True, False, False)
    assert cfg(nvfp4_ref_quantizer_factory("weight")) == (False, False, True)
    assert cfg(nvfp4_ref_quantizer_factory("grad_output")) == (True, True, False)
    assert cfg(nvfp4_ref_quantizer_factory("grad_input")) == (True, True, False)
    assert cfg(nvfp4_ref_quantizer_factory("output")) == (False, False, False)
    assert NVFP4QuantizerRef.custom and NVFP4TensorRef.custom
    with pytest.raises(ValueError, match="role"):
        nvfp4_ref_quantizer_factory("bias")
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4QuantizerRef()(torch.zeros(16, 40))
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4QuantizerRef()(torch.zeros(8, 32))
    NVFP4QuantizerRef(columnwise=False)(torch.zeros(8, 32))  # rowwise only: any M


@pytest.mark.parametrize("tile_rows", [1, NVFP4_BLOCK])
def test_one_amax_per_row_tile_or_block_column_equals_quantizing_each_alone(tile_rows):
    """Several tensor amaxes (an MoE layer's experts): one per row tile, or per column of blocks,
    gives each part the bytes and values it gets quantized alone with its own amax."""
    g = seed(60)
    x = torch.randn(32, 48, generator=g) * torch.tensor([1.0, 50.0]).repeat_interleave(16)[:, None]
    tiles = x.reshape(32 // tile_rows, -1).abs().amax(dim=1, keepdim=True)           # [Mt, 1]
    data, scale = nvfp4_quantize(x, tiles, tile_rows=tile_rows)
    per_row = tiles.repeat_interleave(tile_rows, dim=0)                               # [M, 1]
    values = nvfp4_dequantize(data, scale, per_row)
    for t in range(32 // tile_rows):
        rows = slice(t * tile_rows, (t + 1) * tile_rows)
        d, sc = nvfp4_quantize(x[rows].contiguous(), tiles[t], tile_rows=tile_rows)
        assert_bitwise_equal(data[rows], d, f"tile {t} bytes")
        assert_bitwise_equal(scale[rows], sc, f"tile {t} scales")
        assert_bitwise_equal(values[rows], nvfp4_dequantize(d, sc, tiles[t]), f"tile {t} values")
    if tile_rows == 1:
        cols = x.abs().reshape(32, 3, NVFP4_BLOCK).amax(dim=(0, 2))[None, :]            # [1, K // 16]
        data, scale = nvfp4_quantize(x, cols, tile_rows=1)
        values = nvfp4_dequantize(data, scale, cols)
        for c in range(3):
            part = x[:, c * NVFP4_BLOCK:(c + 1) * NVFP4_BLOCK].contiguous()
            d, sc = nvfp4_quantize(part, cols[0, c], tile_rows=1)
            assert_bitwise_equal(data[:, c * 8:(c + 1) * 8], d, f"column block {c} bytes")
            assert_bitwise_equal(values[:, c * NVFP4_BLOCK:(c + 1) * NVFP4_BLOCK],
                                 nvfp4_dequantize(d, sc, cols[0, c]), f"column block {c} values")


def test_kernel_argument_errors():
    x = torch.zeros(4, 32)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize_reference(torch.zeros(4, 24), one, tile_rows=1, rand=None)
    with pytest.raises(ValueError, match="tile_rows"):
        nvfp4_quantize_reference(x, one, tile_rows=8, rand=None)
    with pytest.raises(ValueError, match=r"global_amax must be fp32 \[1\] \(the tensor's amax\), \[4, 1\] \(one per "
                                         r"row tile\) or \[1, 2\] \(one per column of blocks\), got \(2,\)"):
        nvfp4_quantize_reference(x, torch.ones(2), tile_rows=1, rand=None)
    with pytest.raises(ValueError, match="rand"):
        nvfp4_quantize_reference(x, one, tile_rows=1, rand=torch.rand(4, 16))
    with pytest.raises(ValueError, match="2-D"):
        nvfp4_quantize_reference(torch.zeros(32), one, tile_rows=1, rand=None)
    if HAS_TRITON:
        with pytest.raises(ValueError, match="multiple of 16"):
            nvfp4_quantize_triton(torch.zeros(4, 24), one, tile_rows=1, rand=None)
        with pytest.raises(ValueError, match="takes one tensor amax"):
            nvfp4_quantize_triton(x, torch.ones(4, 1), tile_rows=1, rand=None)


def test_custom_storage_usage_saving_and_columnwise_dequantize():
    x = torch.randn(32, 48, generator=seed(14))
    weight = nvfp4_ref_quantizer_factory("weight")(x)
    only_col = NVFP4QuantizerRef(rowwise=False, with_2d_quantization=True)(x)
    assert only_col.rowwise_data is None
    # 16x16 tiles without RHT: the columnwise copy dequantizes to the same values
    assert_bitwise_equal(only_col.dequantize(), weight.dequantize())
    rht_col = NVFP4QuantizerRef(rowwise=False, with_rht=True)(x)
    assert sqnr(x, rht_col.dequantize()) >= 8.0
    with pytest.raises(RuntimeError, match="rowwise"):
        only_col.update_usage(rowwise_usage=True)
    tensors, obj = weight.prepare_for_saving()
    assert obj.rowwise_data is None and len(tensors) == 6
    assert obj.restore_from_saved(tensors + [None]) == [None]
    weight.update_usage(columnwise_usage=False)
    assert weight.columnwise_data is None and weight.rowwise_data is not None
    empty = NVFP4QuantizerRef().make_empty((2, 16, 64), dtype=torch.bfloat16)
    assert empty.rowwise_data.shape == (32, 32) and empty.columnwise_scale.shape == (64, 2)
    q = NVFP4QuantizerRef()
    q.update_quantized(x, empty)
    assert_bitwise_equal(empty.rowwise_data, q(x).rowwise_data)


def test_reference_traces_with_torch_compile():
    x = torch.randn(32, 64, generator=seed(15))
    rand = torch.rand(32, 64)
    fn = torch.compile(lambda a, r: nvfp4_quantize_reference(a, _amax(a), tile_rows=16, rand=r),
                       backend="aot_eager", fullgraph=True)
    out = fn(x, rand)
    ref = nvfp4_quantize_reference(x, _amax(x), tile_rows=16, rand=rand)
    assert_bitwise_equal(out[0], ref[0])
    assert_bitwise_equal(out[1], ref[1])


# ---- GPU ----------------------------------------------------------------------------------------

@needs_cuda
@needs_triton
@pytest.mark.parametrize("tile_rows", [1, 16])
@pytest.mark.parametrize("stochastic", [False, True], ids=["rne", "sr"])
def test_gpu_kernel_matches_reference(tile_rows, stochastic):
    g = seed(16)
    for shape in [(1, 16), (257, 1024), (4096, 2048)]:
        x = _with_edge_values(_many_magnitudes(shape, g))
        amax = _amax(torch.nan_to_num(x, nan=0.0))
        rand = torch.rand(shape, generator=g) if stochastic else None
        cpu = nvfp4_quantize_reference(x, amax, tile_rows=tile_rows, rand=rand)
        xc, ac, rc = x.cuda(), amax.cuda(), rand.cuda() if stochastic else None
        ref = nvfp4_quantize_reference(xc, ac, tile_rows=tile_rows, rand=rc)
        out = nvfp4_quantize(xc, ac, tile_rows=tile_rows, rand=rc)
        for name, a, b, c in zip(("data", "scale"), out, ref, cpu):
            assert_bitwise_equal(a.cpu(), b.cpu(), f"{name} {shape}: kernel vs cuda reference")
            assert_bitwise_equal(b.cpu(), c, f"{name} {shape}: cuda vs cpu reference")


# CPU-built operands run on the GPU where there is one (tests/utils.py)
nvfp4_quantize_triton = on_kernel_device(nvfp4_quantize_triton)
