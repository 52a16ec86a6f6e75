"""The attention pass (te_compile/passes/attention.py): which SDPA calls become FP8 attention, the
report rows, both backward modes end to end, and what the compiled forward saves for the backward.

The forms share one module and one aot_eager compile per backward mode; outputs and gradients are
checked bit for bit against the kernels' references called directly, and against fp32 SDPA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from te_compile.kernels.fp8_attention import (
    fp8_attention_backward_reference,
    fp8_attention_forward_reference,
    quantize_heads,
)
from utils import assert_bitwise_equal, assert_sqnr_at_least

B, H, HKV, T, D = 2, 4, 2, 24, 16


class Sdpa(nn.Module):
    """One SDPA call with fixed keyword arguments; ``kv``: which key/value pair it reads."""

    def __init__(self, kv="kv", mask=None, own_q=False, **kwargs):
        super().__init__()
        self.kv, self.mask, self.own_q, self.kwargs = kv, mask, own_q, kwargs

    def forward(self, q, inputs):
        k, v = inputs[self.kv]
        if self.own_q:   # a query of the key's head dim
            q = inputs[self.kv + "_q"]
        mask = inputs[self.mask] if isinstance(self.mask, str) else self.mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kwargs)


class LearnedBias(Sdpa):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(T, T))

    def forward(self, q, inputs):
        k, v = inputs["kv"]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)


# name: (module, rewritten?, what the reason says)
FORMS = {
    "plain": (lambda: Sdpa(), True, "FP8 forward"),
    "causal": (lambda: Sdpa(is_causal=True), True, "FP8 forward"),
    "bool_mask": (lambda: Sdpa(mask="bool"), True, "FP8 forward"),
    "float_mask": (lambda: Sdpa(mask="float"), True, "FP8 forward"),
    "gqa": (lambda: Sdpa(kv="gqa", is_causal=True, enable_gqa=True), True, "FP8 forward"),
    "mqa": (lambda: Sdpa(kv="mqa"), True, "FP8 forward"),   # one k/v head, broadcast (Falcon)
    "scale": (lambda: Sdpa(scale=0.3), True, "FP8 forward"),
    "dropout": (lambda: Sdpa(dropout_p=0.5), False, "dropout_p=0.5 (FP8 attention has no dropout)"),
    "learned_bias": (LearnedBias, True, "FP8 forward"),   # its gradient: test_a_learned_bias_gets_its_gradient
    "wide_head": (lambda: Sdpa(kv="wide", own_q=True), False, "head dim 320 > 256"),
}
REWRITTEN = [name for name, (_, ok, _) in FORMS.items() if ok]


class Forms(nn.Module):
    def __init__(self):
        super().__init__()
        self.forms = nn.ModuleDict({name: make() for name, (make, _, _) in FORMS.items()})

    def forward(self, q, inputs):
        return {name: m(q, inputs) for name, m in self.forms.items()}


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    keep = torch.rand(B, 1, T, T, generator=gen) > 0.3
    keep[..., 0] = True
    q = rnd(B, H, T, D)
    inputs = {"kv": (rnd(B, H, T, D), rnd(B, H, T, D)), "gqa": (rnd(B, HKV, T, D), rnd(B, HKV, T, D)),
              "mqa": (rnd(B, 1, T, D), rnd(B, 1, T, D)),
              "wide": (rnd(B, H, T, 320), rnd(B, H, T, 320)), "wide_q": rnd(B, H, T, 320), "bool": keep,
              "float": torch.randn(1, H, T, T, generator=gen)}
    return q, inputs


def _reference_call(name, q, inputs):
    """What the rewritten site computes, from the kernels' references: (o, q8.., descales, lse, kwargs)."""
    module = FORMS[name][0]()
    k, v = inputs[module.kv]
    kwargs = {"causal": module.kwargs.get("is_causal", False),
              "sm_scale": module.kwargs.get("scale") or 1 / math.sqrt(D)}
    if module.mask is not None:
        kwargs["mask"] = inputs[module.mask]
    quantized = [quantize_heads(t.detach()) for t in (q, k, v)]
    (q8, qd), (k8, kd), (v8, vd) = quantized
    o, lse = fp8_attention_forward_reference(q8, k8, v8, qd, kd, vd, out_dtype=q.dtype, **kwargs)
    return o, (q8, k8, v8, qd, kd, vd), lse, kwargs


@pytest.fixture(scope="module", params=["high_precision", "fp8"])
def compiled(request):
    torch._dynamo.reset()
    te_compile.reset()
    model = Forms().train()
    fn = torch.compile(model, backend="te", options={
        "recipe": "Float8CurrentScaling", "fp8_dpa": True, "fp8_dpa_backward": request.param,
        "compiler": "aot_eager"})
    q, inputs = _inputs()
    outs = fn(q, inputs)
    grads = {}
    for name in REWRITTEN:
        module = FORMS[name][0]()
        k, v = inputs[module.kv]
        grads[name] = torch.autograd.grad(outs[name], (q, k, v), torch.ones_like(outs[name]), retain_graph=True)
    return request.param, te_compile.report(), q, inputs, outs, grads


def test_report_has_one_row_per_call_with_the_reason(compiled):
    mode, report, *_ = compiled
    rows = {s.fqn.split(".")[-1]: s for s in report.sites}
    assert sorted(rows) == sorted(FORMS) and all(s.op == "sdpa" for s in report.sites), str(report)
    for name, (_, rewritten, reason) in FORMS.items():
        row = rows[name]
        assert row.rewritten == rewritten and reason in row.reason, (name, row)
        assert row.recipe == "Float8CurrentScaling"
        assert row.shapes.startswith(f"q[2, 4, 24, {320 if name == 'wide_head' else 16}] k["), row.shapes
    expected = ("FP8 forward, high-precision backward" if mode == "high_precision"
                else "FP8 forward and backward (dO, dS in E5M2)")
    assert expected in rows["plain"].reason
    assert rows["bool_mask"].shapes.endswith("mask[2, 1, 24, 24]")


@pytest.mark.parametrize("name", REWRITTEN)
def test_rewritten_forms_compute_the_reference_bit_for_bit(compiled, name):
    mode, _, q, inputs, outs, grads = compiled
    o, (q8, k8, v8, qd, kd, vd), lse, kwargs = _reference_call(name, q, inputs)
    assert_bitwise_equal(outs[name], o, name)
    # the backward reads O from its FP8 copy
    o8, od = quantize_heads(o)
    o_saved = o8.float() * od[..., None, None]
    expect = fp8_attention_backward_reference(torch.ones_like(o), q8, k8, v8, qd, kd, vd, o_saved, lse,
                                              fp8_grads=mode == "fp8", **kwargs)
    for g, e, which in zip(grads[name], expect, "qkv"):
        assert_bitwise_equal(g, e, f"{name} d{which}")
    # ...and that is attention: against fp32 SDPA on the same inputs
    module = FORMS[name][0]()
    k, v = inputs[module.kv]
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    ref = module(qr, {**inputs, module.kv: (kr, vr)})
    assert_sqnr_at_least(ref, outs[name], 25.0, name)
    ref.sum().backward()
    floor = 15.0 if mode == "fp8" else 20.0
    for g, t, which in zip(grads[name], (qr, kr, vr), "qkv"):
        assert_sqnr_at_least(t.grad, g, floor, f"{name} d{which}")


def test_fallbacks_still_compute_sdpa(compiled):
    _, _, q, inputs, outs, _ = compiled
    for name in ("wide_head",):
        module = FORMS[name][0]()
        torch.testing.assert_close(outs[name], module(q, inputs), rtol=1e-5, atol=1e-6)
    assert outs["dropout"].shape == q.shape and torch.isfinite(outs["dropout"]).all()


def test_sdpa_is_off_unless_asked_and_follows_overrides():
    torch._dynamo.reset()
    te_compile.reset()
    model = nn.ModuleDict({"a": Sdpa(), "b": Sdpa(), "c": Sdpa()})

    def run(q, inputs):
        return [model[n](q, inputs) for n in "abc"]

    fn = torch.compile(run, backend="te", options={
        "recipe": "DelayedScaling", "compiler": "aot_eager",
        "overrides": [{"modules": "b", "recipe": "Float8CurrentScaling", "recipe_options": {"fp8_dpa": True}},
                      {"modules": "c", "recipe": "none"}]})
    q, inputs = _inputs()
    fn(q, inputs)
    rows = {s.fqn: s for s in te_compile.report().sites}
    assert not rows["a"].rewritten and rows["a"].reason == (
        "[rewrite] sdpa = false and DelayedScaling.fp8_dpa = false"), rows["a"]
    assert rows["b"].rewritten and rows["b"].recipe == "Float8CurrentScaling", rows["b"]
    assert not rows["c"].rewritten and rows["c"].reason.startswith("recipe 'none'"), rows["c"]


def test_rewrite_sdpa_key_enables_every_site():
    torch._dynamo.reset()
    te_compile.reset()
    fn = torch.compile(Sdpa(is_causal=True), backend="te", options={
        "recipe": "MXFP8BlockScaling", "rewrite": {"sdpa": True}, "compiler": "aot_eager"})
    q, inputs = _inputs()
    o = fn(q, inputs)
    (row,) = te_compile.report().sites
    assert row.rewritten and row.recipe == "MXFP8BlockScaling", row
    assert_bitwise_equal(o, _reference_call("causal", q, inputs)[0])


def test_compiled_forward_saves_fp8_qkv_o_and_the_logsumexp():
    """Under inductor (whose partitioner picks what to save): FP8 Q, K, V, O, their descales and
    lse [B, H, T], nothing of shape [.., T, T] and nothing in high precision but lse."""
    torch._dynamo.reset()
    fn = torch.compile(Sdpa(kv="gqa", is_causal=True, enable_gqa=True), backend="te",
                       options={"recipe": "Float8CurrentScaling", "fp8_dpa": True})
    q, inputs = _inputs()

    def as_model_does(t):   # [B, T, H, D] data seen as [B, H, T, D], bf16, a leaf
        return t.detach().transpose(1, 2).contiguous().transpose(1, 2).to(torch.bfloat16).requires_grad_()

    q = as_model_does(q)
    inputs["gqa"] = tuple(as_model_does(t) for t in inputs["gqa"])
    assert not q.is_contiguous()
    saved = []

    def pack(t):
        if not isinstance(t, nn.Parameter):
            saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = fn(q, inputs)
    e4m3 = torch.float8_e4m3fn
    assert sorted(saved, key=str) == sorted([
        ((B, H, T, D), e4m3), ((B, HKV, T, D), e4m3), ((B, HKV, T, D), e4m3), ((B, H, T, D), e4m3),
        ((B, H), torch.float32), ((B, HKV), torch.float32), ((B, HKV), torch.float32), ((B, H), torch.float32),
        ((B, H, T), torch.float32)], key=str), saved
    o.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and inputs["gqa"][0].grad.shape == (B, HKV, T, D)


@pytest.mark.parametrize("fp8_backward", [False, True], ids=["high_precision", "fp8"])
def test_a_learned_bias_gets_its_gradient(fp8_backward):
    """An additive mask that requires grad (T5's position bias) gets dS summed over the dims it was
    broadcast along, in fp32, from the same backward; q, k and v get what they get without it."""
    from te_compile.lowerings.attention import AttentionSpec, Fp8AttentionFunction
    from te_compile.recipe import Float8CurrentScaling

    b, h, t, d = 2, 4, 32, 16
    spec = AttentionSpec("a", Float8CurrentScaling(), d ** -0.5, False, fp8_backward)

    def grads(q, k, v, bias, fp8: bool):
        leaves = [x.detach().requires_grad_() for x in (q, k, v, bias)]
        o = (Fp8AttentionFunction.apply(*leaves, spec, None, None, None, None, None) if fp8 else
             F.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], scale=d ** -0.5))
        o.backward(torch.randn(o.shape, generator=torch.Generator().manual_seed(1)))
        return [x.grad for x in leaves]

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=gen) for _ in range(3))
    bias = torch.randn(1, h, t, t, generator=gen) * 0.5   # broadcast over the batch
    got, ref = grads(q, k, v, bias, True), grads(q, k, v, bias, False)
    assert got[3].shape == bias.shape
    assert_sqnr_at_least(ref[3], got[3], 20.0, "dbias")
    # the same dq, dk, dv as with a bias that needs no gradient
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o = Fp8AttentionFunction.apply(*leaves, bias, spec, None, None, None, None, None)
    o.backward(torch.randn(o.shape, generator=torch.Generator().manual_seed(1)))
    for x, g in zip(leaves, got):
        assert_bitwise_equal(x.grad, g)
    if fp8_backward:   # the mask's gradient is the high-precision backward's: no FP8 GEMM reads it
        hp = AttentionSpec("a", Float8CurrentScaling(), d ** -0.5, False, False)
        leaves = [x.detach().requires_grad_() for x in (q, k, v, bias)]
        o = Fp8AttentionFunction.apply(*leaves, hp, None, None, None, None, None)
        o.backward(torch.randn(o.shape, generator=torch.Generator().manual_seed(1)))
        assert_bitwise_equal(leaves[3].grad, got[3])
        return
    # inputs exact in E4M3 (per-head amax 7, scale 64): dbias as close as dq and dk are, P's rounding
    exact = [torch.randint(-6, 7, (b, h, t, d), generator=gen).float() / 8 for _ in range(3)]
    for x in exact:
        x[..., 0, 0] = 7.0
    bias = torch.randint(-4, 5, (1, h, t, t), generator=gen).float() / 4
    got, ref = grads(*exact, bias, True), grads(*exact, bias, False)
    assert_sqnr_at_least(ref[3], got[3], 35.0, "dbias, exact inputs")


T5_CONFIG = dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                 dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)


@pytest.mark.slow
def test_t5_runs_fp8_attention_in_every_attention_with_its_position_bias_gradient():
    """Tiny HF T5 (encoder-decoder; sdpa): every self- and cross-attention in FP8, the relative position
    bias learned through them. Only the attention is FP8 here, so the bias gradients compare with
    fp32 SDPA's."""
    transformers = pytest.importorskip("transformers")
    import copy

    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5_CONFIG))
    model.config._attn_implementation = "sdpa"
    ref = copy.deepcopy(model)
    ids, labels = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 8))
    torch._dynamo.reset()
    te_compile.reset()
    fp8 = torch.compile(model, backend="te", options={
        "recipe": "Float8CurrentScaling", "compiler": "aot_eager",
        "rewrite": {"sdpa": True, "linear": False, "rms_norm": False, "activation": False}})
    loss = fp8(input_ids=ids, labels=labels).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    rows = [r for r in te_compile.report().sites if r.op == "sdpa"]
    assert len(rows) == 6 and all(r.rewritten for r in rows), [(r.fqn, r.reason) for r in rows]
    assert abs(loss.item() - ref_loss.item()) <= 1e-3 * ref_loss.item()
    ref_params = dict(ref.named_parameters())
    biases = [n for n, _ in model.named_parameters() if "relative_attention_bias" in n]
    assert len(biases) == 2
    for name, p in model.named_parameters():
        # 19.0 and 20.3 dB seen: the forward's FP8 noise of six attentions reaches every gradient (the
        # model's other gradients: median 18.3 dB, lowest 14.6 dB; FP8 linears alone leave the two tables
        # at 12.8 and 18.0 dB), and a table's bucket sums of dS cancel (each row of dS sums to 0)
        if name in biases:
            assert_sqnr_at_least(ref_params[name].grad, p.grad, 17.0, name)


@pytest.mark.slow
@pytest.mark.parametrize("backward", ["high_precision", "fp8"])
def test_t5_encoder_learns_its_position_bias_through_fp8_attention(backward):
    """Tiny HF T5's encoder alone (sdpa), trained towards a fixed target: its relative position bias
    table's gradient through FP8 attention against fp32 SDPA's. The loss must depend on the encoder's
    output direction: a mean square of an RMSNorm output is nearly constant, and its near-zero true
    gradient measures only noise."""
    transformers = pytest.importorskip("transformers")
    import copy

    torch.manual_seed(0)
    model = transformers.T5EncoderModel(transformers.T5Config(**T5_CONFIG))
    model.config._attn_implementation = "sdpa"
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    target = torch.randn(2, 16, T5_CONFIG["d_model"], generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    te_compile.reset()
    fp8 = torch.compile(model, backend="te", options={
        "recipe": "Float8CurrentScaling", "compiler": "aot_eager", "recipe_options": {"fp8_dpa_backward": backward},
        "rewrite": {"sdpa": True, "linear": False, "rms_norm": False, "activation": False}})
    for m in (fp8, ref):
        (m(input_ids=ids).last_hidden_state - target).square().mean().backward()
    rows = [r for r in te_compile.report().sites if r.op == "sdpa"]
    assert len(rows) == 2 and all(r.rewritten for r in rows), [(r.fqn, r.reason) for r in rows]
    name = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    # 22.0 dB seen with the high-precision backward, 21.2 dB with the "fp8" one
    assert_sqnr_at_least(dict(ref.named_parameters())[name].grad, dict(model.named_parameters())[name].grad,
                         20.0, name)


def test_sdpa_on_dtensors_split_along_the_sequence_is_left_to_torchs_context_parallel():
    """torch's context_parallel hands SDPA q, k, v as DTensors sharded along the sequence (dim 2): te
    leaves such a call as SDPA and says why; other DTensor inputs (here sharded by head) too. One process
    plays rank 0 of a fake 2-rank world. Dynamo cannot trace a DTensor SDPA on a CPU (no sharding rule
    for the CPU op), so te's passes run on the graph Dynamo would give them, built by hand."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from te_compile.config import resolve_config
    from te_compile.backend import run_passes
    from te_compile.passes.settings import resolve_settings

    config = resolve_config({"recipe": "Float8CurrentScaling", "rewrite": {"sdpa": True}})
    reasons = {}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        for dim in (2, 1):
            x = DTensor.from_local(torch.randn(1, 2, 8, 16), mesh, [Shard(dim)], run_check=False)
            graph = torch.fx.Graph()
            q, k, v = (graph.placeholder(n) for n in "qkv")
            out = graph.call_function(torch._C._nn.scaled_dot_product_attention, (q, k, v), {"is_causal": True})
            graph.output(out)
            for node in (q, k, v, out):
                node.meta["example_value"] = x
            settings = resolve_settings(config, [x, x, x])
            [row] = [r for r in run_passes(torch.fx.GraphModule({}, graph), [x, x, x], settings).records
                     if r.op == "sdpa"]
            assert not row.rewritten, row
            reasons[dim] = row.reason
    finally:
        dist.destroy_process_group()
    assert reasons == {2: "DTensor inputs split along the sequence: torch's context_parallel runs this call (te's "
                          "FP8 context parallelism is [distributed] context_parallel) (left in high precision)",
                       1: "DTensor inputs (left in high precision)"}, reasons
