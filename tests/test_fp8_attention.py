"""FP8 attention's numerics (te_compile/kernels/fp8_attention.py): the reference forward against fp32
SDPA for every mask form the SDPA sites take, its online softmax and its edge rows; the backward in
both modes against fp32 SDPA's gradients; the Triton forward against the reference in Triton's
interpreter."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from te_compile.kernels._fp_bits import HAS_TRITON
from te_compile.kernels.fp8_attention import (
    P_SCALE,
    fp8_attention_backward_reference,
    fp8_attention_backward_triton,
    fp8_attention_forward_reference,
    fp8_attention_forward_triton,
    quantize_heads,
)
from utils import assert_bitwise_equal, assert_sqnr_at_least, sqnr

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
# the kernels run on the GPU where there is one, else in Triton's interpreter (conftest.py)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_kernel_device(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    move = lambda t: t.to(KERNEL_DEVICE) if isinstance(t, torch.Tensor) else t   # noqa: E731
    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def _assert_kernel_close(got, expect, interpreter_tol: dict, name: str) -> None:
    """Interpreter: the reference's values up to fp32 summation order. GPU: its exp differs from
    torch's in the last bits, which can move an FP8-rounded P or dS by one step: SQNR instead."""
    got = got.cpu()
    if KERNEL_DEVICE == "cpu":
        torch.testing.assert_close(got, expect, **interpreter_tol, msg=name)
    else:
        assert_sqnr_at_least(expect.float(), got.float(), 40.0, name)


def _qkv(b=2, h=4, hkv=4, tq=96, tk=96, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=gen)
    k = torch.randn(b, hkv, tk, d, generator=gen)
    v = torch.randn(b, hkv, tk, d, generator=gen)
    # heads of different magnitudes: per-(batch, head) scales must follow them
    q = q * torch.logspace(-1, 0, h)[None, :, None, None]
    return q, k, v


def _fp8(q, k, v, **kwargs):
    (q8, qd), (k8, kd), (v8, vd) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
    kwargs.setdefault("sm_scale", 1 / math.sqrt(q.shape[-1]))
    return fp8_attention_forward_reference(q8, k8, v8, qd, kd, vd, **kwargs)


def test_quantize_heads_scales_each_head():
    q, _, _ = _qkv()
    q8, descale = quantize_heads(q)
    assert q8.dtype == torch.float8_e4m3fn and descale.shape == (2, 4)
    # each head's largest magnitude lands on E4M3's largest value
    assert_bitwise_equal(q8.float().abs().amax(dim=(-2, -1)), torch.full((2, 4), 448.0))
    # descale = 1 / scale with the recipes' scale = 448 / amax
    assert_bitwise_equal(descale, torch.div(1.0, torch.div(448.0, q.abs().amax(dim=(-2, -1)))))
    assert_sqnr_at_least(q, q8.float() * descale[..., None, None], 25.0, "per-head E4M3")
    zeros8, zeros_descale = quantize_heads(torch.zeros(1, 2, 4, 8))
    assert not zeros8.float().any() and torch.equal(zeros_descale, torch.ones(1, 2))


MASKS = ["none", "causal", "bool", "float", "causal-rect"]


@pytest.mark.parametrize("form", MASKS)
def test_forward_against_fp32_sdpa(form):
    q, k, v = _qkv(tk=160 if form == "causal-rect" else 96)
    kwargs, sdpa = {}, {}
    if form.startswith("causal"):
        kwargs["causal"] = sdpa["is_causal"] = True
    elif form == "bool":
        keep = torch.rand(2, 1, 96, 96, generator=torch.Generator().manual_seed(3)) > 0.3
        keep[..., 0] = True   # every query sees a key
        kwargs["mask"] = sdpa["attn_mask"] = keep
    elif form == "float":
        bias = torch.randn(1, 4, 96, 96, generator=torch.Generator().manual_seed(4))
        kwargs["mask"] = sdpa["attn_mask"] = bias
    ref = F.scaled_dot_product_attention(q, k, v, **sdpa)
    o, lse = _fp8(q, k, v, **kwargs)
    assert_sqnr_at_least(ref, o, 25.0, form)
    # lse is the log of the softmax denominator of the fp32 scores (no FP8 rounding of P in it)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(64)
    if form.startswith("causal"):
        s = s.masked_fill(~torch.ones(96, k.shape[2], dtype=torch.bool).tril(), float("-inf"))
    elif form == "bool":
        s = s.masked_fill(~kwargs["mask"], float("-inf"))
    elif form == "float":
        s = s + kwargs["mask"]
    assert sqnr(torch.logsumexp(s, dim=-1), lse) > 30.0


def test_grouped_query_heads_match_repeated_kv():
    q, k, v = _qkv(h=8, hkv=2)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    o, _ = _fp8(q, k, v, causal=True)
    assert_sqnr_at_least(ref, o, 25.0, "GQA")
    # the same as giving each query head its own copy of its key/value head
    o_rep, _ = _fp8(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), causal=True)
    assert_bitwise_equal(o, o_rep, "GQA vs repeated heads")


def test_online_softmax_depends_on_the_block_only_through_p_rounding():
    q, k, v = _qkv()
    outs = [_fp8(q, k, v, causal=True, block_n=n)[0] for n in (16, 64, 96)]
    # P is quantized relative to the running max, so block sizes give slightly different bytes...
    assert not torch.equal(outs[0], outs[2])
    # ...but the same attention to well within the FP8 error
    for o in outs[:2]:
        assert sqnr(outs[2], o) > 35.0


def test_p_uses_the_fixed_scale():
    # one key: p = 1 exactly, quantized to 448 and descaled back to 1: o is v's dequantized row
    q, k, v = _qkv(tq=4, tk=1)
    o, lse = _fp8(q, k, v)
    v8, vd = quantize_heads(v)
    expect = (v8.float() * vd[..., None, None]).expand_as(o)
    assert P_SCALE == 448.0
    # (448 * v8) * (descale / 448): equal to v8 * descale up to the rounding of the two products
    torch.testing.assert_close(o, expect, rtol=3e-7, atol=0)
    assert torch.isfinite(lse).all()


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = _qkv(tq=8, tk=8)
    keep = torch.ones(8, 8, dtype=torch.bool)
    keep[3] = False
    o, lse = _fp8(q, k, v, mask=keep)
    assert not o[:, :, 3].any() and torch.isneginf(lse[:, :, 3]).all()
    assert torch.isfinite(o).all() and torch.isfinite(lse[:, :, [0, 1, 2, 4, 5, 6, 7]]).all()


def test_output_dtype():
    q, k, v = (t.to(torch.bfloat16) for t in _qkv())
    o, lse = _fp8(q, k, v, out_dtype=torch.bfloat16)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_sqnr_at_least(F.scaled_dot_product_attention(q.float(), k.float(), v.float()), o.float(), 25.0)


def _form(form, q, k, v, seed=3):
    """(reference kwargs, SDPA kwargs) for a mask form; k, v heads < q heads means GQA."""
    tq, tk = q.shape[2], k.shape[2]
    kwargs, sdpa = {}, {}
    if k.shape[1] != q.shape[1]:
        sdpa["enable_gqa"] = True
    if form.startswith("causal"):
        kwargs["causal"] = sdpa["is_causal"] = True
    elif form == "bool":
        keep = torch.rand(q.shape[0], 1, tq, tk, generator=torch.Generator().manual_seed(seed)) > 0.3
        keep[..., 0] = True
        kwargs["mask"] = sdpa["attn_mask"] = keep
    elif form == "float":
        kwargs["mask"] = sdpa["attn_mask"] = torch.randn(1, q.shape[1], tq, tk,
                                                         generator=torch.Generator().manual_seed(seed))
    return kwargs, sdpa


@pytest.mark.parametrize("fp8_grads", [False, True], ids=["high_precision", "fp8"])
@pytest.mark.parametrize("form", ["none", "causal", "bool", "float", "gqa"])
def test_backward_against_fp32_sdpa(form, fp8_grads):
    q, k, v = _qkv(h=8, hkv=2) if form == "gqa" else _qkv()
    kwargs, sdpa = _form("causal" if form == "gqa" else form, q, k, v)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, **sdpa)
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7))
    ref.backward(do)
    (q8, qd), (k8, kd), (v8, vd) = (quantize_heads(t.detach()) for t in (q, k, v))
    sm = 1 / math.sqrt(64)
    o, lse = fp8_attention_forward_reference(q8, k8, v8, qd, kd, vd, sm_scale=sm, **kwargs)
    grads = fp8_attention_backward_reference(do, q8, k8, v8, qd, kd, vd, o, lse, sm_scale=sm,
                                             fp8_grads=fp8_grads, **kwargs)
    floor = 15.0 if fp8_grads else 20.0
    for name, g, t in zip("qkv", grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == torch.float32
        assert_sqnr_at_least(t.grad, g, floor, f"d{name} ({form})")


def test_fp8_backward_quantizes_what_it_says():
    q, k, v = _qkv(tq=32, tk=32)
    (q8, qd), (k8, kd), (v8, vd) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
    o, lse = fp8_attention_forward_reference(q8, k8, v8, qd, kd, vd, sm_scale=0.125)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    args = (do, q8, k8, v8, qd, kd, vd, o, lse)
    hp = fp8_attention_backward_reference(*args, sm_scale=0.125)
    e5 = fp8_attention_backward_reference(*args, sm_scale=0.125, fp8_grads=True)
    e4 = fp8_attention_backward_reference(*args, sm_scale=0.125, fp8_grads=True, grad_dtype=torch.float8_e4m3fn)
    # E4M3 (3 mantissa bits) loses less than E5M2 (2 bits), and both less than nothing
    for name, g_hp, g5, g4 in zip("qkv", hp, e5, e4):
        assert sqnr(g_hp, g4) > sqnr(g_hp, g5) + 3.0, name
    # a dO already on the E5M2 grid with a power-of-two scale quantizes exactly: dV then only
    # differs from high precision by P's rounding
    grid = quantize_heads(do, torch.float8_e5m2)[0].float()
    exact = fp8_attention_backward_reference(grid, q8, k8, v8, qd, kd, vd, o, lse, sm_scale=0.125,
                                             fp8_grads=True)
    hp_grid = fp8_attention_backward_reference(grid, q8, k8, v8, qd, kd, vd, o, lse, sm_scale=0.125)
    assert sqnr(hp_grid[2], exact[2]) > 30.0


def test_backward_of_fully_masked_rows_is_zero():
    q, k, v = _qkv(tq=8, tk=8)
    keep = torch.ones(8, 8, dtype=torch.bool)
    keep[3] = False
    (q8, qd), (k8, kd), (v8, vd) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
    o, lse = fp8_attention_forward_reference(q8, k8, v8, qd, kd, vd, sm_scale=0.125, mask=keep)
    for fp8_grads in (False, True):
        dq, dk, dv = fp8_attention_backward_reference(torch.ones_like(o), q8, k8, v8, qd, kd, vd, o, lse,
                                                      sm_scale=0.125, mask=keep, fp8_grads=fp8_grads)
        assert not dq[:, :, 3].any() and all(torch.isfinite(g).all() for g in (dq, dk, dv))


# ---- Triton forward (interpreter on CPU) == reference ---------------------------------------------

TRITON_CASES = {
    # name: (B, H, Hkv, Tq, Tk, D, form, out dtype)
    "ragged-gqa": (2, 4, 2, 70, 130, 32, "none", torch.float32),
    "causal-d40": (1, 2, 2, 100, 100, 40, "causal", torch.float32),
    "causal-rect": (1, 2, 1, 40, 150, 16, "causal", torch.float32),
    "bool": (1, 2, 1, 50, 90, 16, "bool", torch.float32),
    "float-bf16": (2, 2, 2, 33, 65, 64, "float", torch.bfloat16),
}


def _triton_case(case):
    """(FP8 operands and descales, reference kwargs with sm_scale, output dtype) of a TRITON_CASES entry."""
    b, h, hkv, tq, tk, d, form, dtype = TRITON_CASES[case]
    q, k, v = _qkv(b, h, hkv, tq, tk, d)
    kwargs, _ = _form(form, q, k, v)
    if form == "bool":
        kwargs["mask"][0, 0, 5] = False   # a fully masked row
    (q8, qd), (k8, kd), (v8, vd) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
    kwargs["sm_scale"] = 1 / math.sqrt(d)
    return (q8, k8, v8, qd, kd, vd), kwargs, dtype


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_forward_matches_reference(case):
    args, kwargs, dtype = _triton_case(case)
    kwargs["out_dtype"] = dtype
    o_ref, lse_ref = fp8_attention_forward_reference(*args, **kwargs)
    moved, moved_kwargs = _on_kernel_device(args, kwargs)
    o, lse = fp8_attention_forward_triton(*moved, **moved_kwargs)
    o, lse = o.cpu(), lse.cpu()
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    finite = torch.isfinite(lse_ref)
    # the same algorithm: equal up to the order of the dot products' fp32 sums (and one rounding
    # of the output to its dtype)
    # (on CUDA also of exp2/log2, which round differently: 2.8e-5 relative seen on an H100)
    torch.testing.assert_close(lse[finite], lse_ref[finite], **(dict(rtol=0, atol=2e-6) if KERNEL_DEVICE == "cpu"
                                                                else dict(rtol=1e-4, atol=1e-4)))
    tol = dict(rtol=0, atol=5e-7) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=0)
    _assert_kernel_close(o, o_ref, tol, "o")


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fp8_grads", [False, True], ids=["high_precision", "fp8"])
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_backward_matches_reference(case, fp8_grads):
    args, kwargs, dtype = _triton_case(case)
    o, lse = fp8_attention_forward_reference(*args, out_dtype=dtype, **kwargs)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    # the "float-bf16" case also takes E4M3 gradients (an E4M3 recipe)
    grad_dtype = torch.float8_e4m3fn if dtype == torch.bfloat16 else torch.float8_e5m2
    kwargs.update(fp8_grads=fp8_grads, grad_dtype=grad_dtype)
    expect = fp8_attention_backward_reference(do, *args, o, lse, **kwargs)
    moved, moved_kwargs = _on_kernel_device((do, *args, o, lse), kwargs)
    got = fp8_attention_backward_triton(*moved, **moved_kwargs)
    for name, g, e in zip("qkv", got, expect):
        assert g.shape == e.shape and g.dtype == torch.float32
        # the same values up to the order of fp32 sums (per-block accumulation vs whole matrices)
        _assert_kernel_close(g, e, dict(rtol=0, atol=2e-6 * e.abs().max().item()), f"d{name}")
