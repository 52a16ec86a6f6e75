"""[rewrite] small_gemms: on a GPU, a per-tensor linear whose GEMM is no larger in any dim than the
shape a lease measured FP8 losing at (M = K = N = 4096) stays in high precision, with the reason in its
report row.

The sites are built on fake CUDA tensors (no GPU needed): the rule reads only shapes and the device.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import te_compile
from te_compile.config import ConfigError, config_from_dict
from te_compile.fx.gemm_operands import LinearSite
from te_compile.passes.eligibility import SMALL_GEMM_DIM, why_small_gemm
from te_compile.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling


def _site(x_shape, w_shape, device="cuda", weight_in_out=False, **kwargs) -> LinearSite:
    mode = FakeTensorMode()
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    for node, shape in ((x, x_shape), (w, w_shape)):
        meta = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        node.meta["example_value"] = FakeTensor(mode, meta, torch.device(device, 0) if device == "cuda" else
                                                torch.device(device))
    call = graph.call_function(torch.nn.functional.linear, (x, w))
    return LinearSite(call, x, w, None, None, weight_in_out, "proj", "linear", **kwargs)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling()])
def test_a_gpu_gemm_no_larger_than_4096_cubed_stays_in_high_precision(recipe):
    assert SMALL_GEMM_DIM == 4096
    why = why_small_gemm(_site((2, 2048, 4096), (4096, 4096)), recipe, "auto")   # M = 4096 tokens
    assert why is not None and "4096 x 4096 x 4096" in why and 'small_gemms = "fp8"' in why, why
    # one more row than the measured losing shape, and Llama 3 8B's k/v projections at 8192 tokens
    # (8192 x 4096 x 1024: larger in M, not judged from that point), run in FP8
    assert why_small_gemm(_site((4097, 4096), (4096, 4096)), recipe, "auto") is None
    assert why_small_gemm(_site((8192, 4096), (1024, 4096)), recipe, "auto") is None
    # a weight stored [in, out] (x @ W): N and K read from the other dims
    assert "128 x 4096 x 64" in why_small_gemm(_site((128, 4096), (4096, 64), weight_in_out=True), recipe, "auto")


def test_the_rule_leaves_cpus_block_recipes_fp8_and_experts_alone():
    small = ((64, 256), (128, 256))
    assert why_small_gemm(_site(*small), Float8CurrentScaling(), "auto") is not None
    assert why_small_gemm(_site(*small), Float8CurrentScaling(), "fp8") is None
    assert why_small_gemm(_site(*small, device="cpu"), Float8CurrentScaling(), "auto") is None   # emulated GEMMs
    assert why_small_gemm(_site(*small), MXFP8BlockScaling(), "auto") is None     # not measured
    assert why_small_gemm(_site(*small, expert=0), Float8CurrentScaling(), "auto") is None
    assert why_small_gemm(_site(*small, weight_first=True), Float8CurrentScaling(), "auto") is None


def test_the_key_is_read_from_the_rewrite_table_with_its_choices():
    assert te_compile.TeConfig().rewrite.small_gemms == "auto"
    assert config_from_dict({"rewrite": {"small_gemms": "fp8"}}, "te.toml").rewrite.small_gemms == "fp8"
    with pytest.raises(ConfigError, match=r"te\.toml: rewrite\.small_gemms: must be one of \['auto', 'fp8'\], "
                                          r"got 'never'"):
        config_from_dict({"rewrite": {"small_gemms": "never"}}, "te.toml")


def test_cpu_sites_of_any_size_stay_in_fp8_under_the_default():
    torch._dynamo.reset()
    te_compile.reset()
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    torch.compile(model, backend="te", options={"compiler": "aot_eager"})(torch.randn(4, 64)).sum().backward()
    rows = [r for r in te_compile.report().sites if r.op == "linear"]
    assert len(rows) == 2 and all(r.rewritten for r in rows), [(r.fqn, r.reason) for r in rows]
