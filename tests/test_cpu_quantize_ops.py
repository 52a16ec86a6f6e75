"""The block formats' CPU quantize/dequantize as opaque ops (for compile time).

On CPU ``mxfp8_quantize``, ``float8_block_quantize``, ``nvfp4_quantize`` and ``nvfp4_dequantize`` call
one ``te_compile::*_cpu`` op each: a compiled graph holds one node per call instead of the ~40 ops of
the reference, which inductor turned into C++ kernels to generate and compile (the NVFP4 demo's first
compile went from 208 s to under 60 s). The ops must give the reference's bits, have fakes that match
(opcheck: schema, fake tensor, AOT dispatch), and stay opaque under torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from te_compile.kernels import float8_block_quantize as fbq
from te_compile.kernels import mxfp8_quantize as mxq
from te_compile.kernels import nvfp4_quantize as nvq
from utils import assert_bitwise_equal, seed


def _x(m, k, s=0):
    # a wide range of magnitudes so that blocks get different scales
    return torch.randn(m, k, generator=seed(s)) * torch.logspace(-3, 3, k)


# (dispatch function, its op, reference, args) with awkward shapes: ragged last blocks and tiles
CASES = {
    "mxfp8-e4m3-33x200": (lambda x: mxq.mxfp8_quantize(x, torch.float8_e4m3fn),
                          lambda x: mxq.mxfp8_quantize_reference(x, torch.float8_e4m3fn),
                          lambda x: (mxq._mxfp8_quantize_cpu, (x, torch.float8_e4m3fn)), (33, 200)),
    "mxfp8-e5m2-1x64": (lambda x: mxq.mxfp8_quantize(x, torch.float8_e5m2),
                        lambda x: mxq.mxfp8_quantize_reference(x, torch.float8_e5m2),
                        lambda x: (mxq._mxfp8_quantize_cpu, (x, torch.float8_e5m2)), (1, 64)),
    "block-1x128-130x200": (
        lambda x: fbq.float8_block_quantize(x, torch.float8_e4m3fn, tile_rows=1, force_pow_2_scales=True,
                                            amax_epsilon=0.0),
        lambda x: fbq.float8_block_quantize_reference(x, torch.float8_e4m3fn, tile_rows=1,
                                                      force_pow_2_scales=True, amax_epsilon=0.0),
        lambda x: (fbq._float8_block_quantize_cpu, (x, torch.float8_e4m3fn, 1, True, 0.0)), (130, 200)),
    "block-128x128-130x200": (
        lambda x: fbq.float8_block_quantize(x, torch.float8_e4m3fn, tile_rows=128, force_pow_2_scales=False,
                                            amax_epsilon=1e-6),
        lambda x: fbq.float8_block_quantize_reference(x, torch.float8_e4m3fn, tile_rows=128,
                                                      force_pow_2_scales=False, amax_epsilon=1e-6),
        lambda x: (fbq._float8_block_quantize_cpu, (x, torch.float8_e4m3fn, 128, False, 1e-6)), (130, 200)),
    "nvfp4-1x16-40x80": (lambda x: nvq.nvfp4_quantize(x, x.abs().amax().reshape(1), tile_rows=1),
                         lambda x: nvq.nvfp4_quantize_reference(x, x.abs().amax().reshape(1), tile_rows=1, rand=None),
                         lambda x: (nvq._nvfp4_quantize_cpu, (x, x.abs().amax().reshape(1), 1, None)), (40, 80)),
    "nvfp4-16x16-40x80": (lambda x: nvq.nvfp4_quantize(x, x.abs().amax().reshape(1), tile_rows=16),
                          lambda x: nvq.nvfp4_quantize_reference(x, x.abs().amax().reshape(1), tile_rows=16,
                                                                 rand=None),
                          lambda x: (nvq._nvfp4_quantize_cpu, (x, x.abs().amax().reshape(1), 16, None)), (40, 80)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_op_gives_the_reference_bits_and_passes_opcheck(case):
    dispatch, reference, op_args, shape = CASES[case]
    x = _x(*shape)
    for a, b in zip(dispatch(x), reference(x)):
        assert_bitwise_equal(a, b, case)
    op, args = op_args(x)
    torch.library.opcheck(op, args)


def test_nvfp4_stochastic_rounding_and_dequantize_ops():
    x = _x(48, 64, 1)
    amax = x.abs().amax().reshape(1)
    rand = torch.rand(x.shape, generator=seed(2))
    data, scale = nvq.nvfp4_quantize(x, amax, tile_rows=1, rand=rand)
    ref = nvq.nvfp4_quantize_reference(x, amax, tile_rows=1, rand=rand)
    assert_bitwise_equal(data, ref[0])
    assert_bitwise_equal(scale, ref[1])
    torch.library.opcheck(nvq._nvfp4_quantize_cpu, (x, amax, 1, rand))
    assert_bitwise_equal(nvq.nvfp4_dequantize(data, scale, amax), nvq.nvfp4_dequantize_reference(data, scale, amax))
    torch.library.opcheck(nvq._nvfp4_dequantize_cpu, (data, scale, amax))
    with pytest.raises(ValueError, match=r"scale must be uint8 \(48, 4\)"):
        nvq.nvfp4_dequantize(data, scale[:, :2], amax)


def test_a_compiled_graph_calls_each_op_once():
    """What keeps compile time down: the op stays one node through AOTAutograd (no decomposition)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def quantize_all(x):
        amax = x.abs().amax().reshape(1)
        data, scale = nvq.nvfp4_quantize(x, amax, tile_rows=1)
        return (nvq.nvfp4_dequantize(data, scale, amax), mxq.mxfp8_quantize(x, torch.float8_e4m3fn)[0],
                fbq.float8_block_quantize(x, torch.float8_e4m3fn, tile_rows=1, force_pow_2_scales=True,
                                          amax_epsilon=0.0)[0])

    torch._dynamo.reset()
    x = _x(32, 128)
    out = torch.compile(quantize_all, backend=aot_autograd(fw_compiler=record), fullgraph=True)(x)
    for a, b in zip(out, quantize_all(x)):
        assert_bitwise_equal(a, b)
    (gm,) = graphs
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    ops = sorted(t for t in targets if t.startswith("te_compile."))
    assert ops == ["te_compile.float8_block_quantize_cpu.default", "te_compile.mxfp8_quantize_cpu.default",
                   "te_compile.nvfp4_dequantize_cpu.default", "te_compile.nvfp4_quantize_cpu.default"], targets
    assert len(targets) <= 16, targets   # the amax, detaches, getitems; the references hold ~40 ops each


@pytest.mark.parametrize("case", ["mxfp8-e4m3-33x200", "block-128x128-130x200", "nvfp4-16x16-40x80"])
def test_the_reference_still_compiles_to_its_own_bits(case):
    """Off CPU (CUDA under torch.compile) the reference is traced and inductor generates its kernel:
    compiled, it must keep the eager bits, ragged last blocks included."""
    _, reference, _, shape = CASES[case]
    x = _x(*shape, 3)
    torch._dynamo.reset()
    for a, b in zip(torch.compile(reference, backend="inductor", fullgraph=True)(x), reference(x)):
        assert_bitwise_equal(a, b, case)
