"""fp8_mha's input hand-off (passes/attention_inputs.py): under DelayedScaling the projections making
Q, K and V quantize their outputs once, and attention reads the FP8 bytes.

Every form runs twice, with the pass and without it (the attention then quantizes Q, K, V itself):
the forward, the gradients and the delayed-scaling state must agree bit for bit over three steps in
which Q, K and V have different amaxes (so a column cast with another role's scale would show)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import te_compile
import te_compile.passes as passes
from te_compile.kernels._fp_bits import HAS_TRITON
from te_compile.kernels.fp8_attention import (
    E4M3,
    fp8_attention_forward_reference,
    fp8_attention_forward_triton,
)
from utils import assert_bitwise_equal

B, T, C, H, HKV = 2, 16, 64, 4, 2
D = C // H
STEPS = 3
SEPARATE = ("separate", "rotary", "opt", "repeat_kv", "cache")


class Block(nn.Module):
    """Projections to q, k, v spelled as ``form`` says, causal attention, an output projection."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        if form in SEPARATE:            # BERT, ViT, Llama, OPT: three linears, GQA
            self.q, self.k, self.v = nn.Linear(C, C), nn.Linear(C, HKV * D), nn.Linear(C, HKV * D)
        else:
            self.qkv = nn.Linear(C, 3 * C)
        if form == "layer_norm":
            self.ln = nn.LayerNorm(C)
        self.proj = nn.Linear(C, C)
        with torch.no_grad():           # q, k, v of different magnitudes: different amaxes and scales
            for i, w in enumerate(self._weights()):
                w.mul_(1.0 + i)

    def _weights(self):
        if self.form in SEPARATE:
            return [self.q.weight, self.k.weight, self.v.weight]
        return list(self.qkv.weight.split(C))

    def forward(self, x):
        f = self.form
        if f == "opt":                  # OPT / Whisper: q scaled after q_proj; contiguous [B, H, T, D]
            q = (self.q(x) * 0.5).view(B, T, H, D).transpose(1, 2).contiguous()
            k = self.k(x).view(B, T, HKV, D).transpose(1, 2).contiguous()
            v = self.v(x).view(B, T, HKV, D).transpose(1, 2).contiguous()
        elif f in ("separate", "rotary", "repeat_kv", "cache"):
            q = self.q(x).view(B, T, H, D).transpose(1, 2)
            k = self.k(x).view(B, T, HKV, D).transpose(1, 2)
            v = self.v(x).view(B, T, HKV, D).transpose(1, 2)
            if f == "repeat_kv":        # transformers' repeat_kv: every k, v head used H // HKV times
                k, v = (t[:, :, None].expand(B, HKV, H // HKV, T, D).reshape(B, H, T, D) for t in (k, v))
            if f == "rotary":           # Llama rotates q and k after their projections, not v
                q, k = (t * 0.75 + t.roll(1, dims=-1) * 0.25 for t in (q, k))
            if f == "cache":            # transformers' DynamicCache appends k, v to torch.tensor([])
                k, v = (torch.cat([torch.tensor([], dtype=t.dtype), t], dim=-2) for t in (k, v))
        elif f == "packed":             # timm: [B, T, 3, H, D] -> [3, B, H, T, D] -> unbind
            q, k, v = self.qkv(x).reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            y = self.qkv(self.ln(x) if f == "layer_norm" else x)
            if f == "also_read":
                x = x + y[..., :C]      # the projection's output has a high-precision reader
            if f == "strided":          # q and k interleave in the first 2C columns
                q, k, v = y[..., 0:2 * C:2], y[..., 1:2 * C:2], y[..., 2 * C:]
            else:                       # nanoGPT
                q, k, v = y.split(C, dim=2)
            q, k, v = (t.reshape(B, T, H, D).transpose(1, 2) for t in (q, k, v))
            if f == "scaled":           # OPT / Whisper scale q after its projection
                q = q * 0.5
        gqa = f in ("separate", "rotary", "opt", "cache")
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.proj(o.transpose(1, 2).reshape(B, T, C)) + x


# form: (handed over?, what the fp8_mha row says about Q, K, V)
FORMS = {
    "nanogpt": (True, "FP8 Q, K, V from forms.nanogpt.qkv (quantized once, at the projection's output)"),
    "separate": (True, "FP8 Q, K, V from forms.separate.q, forms.separate.k, forms.separate.v"),
    "packed": (True, "FP8 Q, K, V from forms.packed.qkv"),
    "layer_norm": (True, "FP8 Q, K, V from forms.layer_norm.qkv"),   # the norm fused into qkv
    "repeat_kv": (True, "FP8 Q, K, V from forms.repeat_kv.q, forms.repeat_kv.k, forms.repeat_kv.v"),
    # the others are quantized in the traced graph, where inductor fuses the cast with the rotation
    "rotary": (True, "FP8 V from forms.rotary.v (quantized once, at the projection's output); Q, K quantized in "
                     "the graph once they are computed (q and k are made by add, not moved out of a per-tensor FP8 "
                     "linear's output)"),
    "cache": (True, "FP8 Q, K, V from forms.cache.q, forms.cache.k, forms.cache.v"),
    "opt": (True, "FP8 K, V from forms.opt.k, forms.opt.v (quantized once, at the projection's output); Q quantized "
                  "in the graph once it is computed (q is made by mul, not moved out of a per-tensor FP8 linear"),
    # k and v are columns of the output q is computed from: none is handed over
    "scaled": (False, "Q, K, V arrive in high precision: q is made by mul, not moved out of a per-tensor FP8 "
                      "linear's output; k and v are cut from a projection output whose other columns are not "
                      "handed over"),
    # y is also read in high precision (it is written anyway; the cast is one more read)
    "also_read": (True, "FP8 Q, K, V from forms.also_read.qkv"),
    "strided": (False, "Q, K, V arrive in high precision: q is not one whole range of its projection's columns"),
}
HANDED = [name for name, (handed, _) in FORMS.items() if handed]


class Forms(nn.Module):
    def __init__(self, names=tuple(FORMS)):
        super().__init__()
        self.forms = nn.ModuleDict({name: Block(name) for name in names})

    def forward(self, x):
        return {name: m(x[name]) for name, m in self.forms.items()}


def _without_the_pass(monkeypatch):
    """The fp8_mha pass with its input side off: every site's Q, K, V arrive in high precision."""
    monkeypatch.setattr(passes.attention_projection, "hand_off_inputs",
                        lambda scope, node: (node, False, "Q, K, V arrive in high precision"))


def _run(options: dict, compiler: str = "aot_eager", names=tuple(FORMS)) -> SimpleNamespace:
    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    model = Forms(names)
    fn = torch.compile(model, backend="te", options={"compiler": compiler, **options})
    gen = torch.Generator().manual_seed(0)
    outs, grads = [], []
    for step in range(STEPS):
        x = {name: (torch.randn(B, T, C, generator=gen) * (1 + step)).requires_grad_() for name in model.forms}
        y = fn(x)
        torch.autograd.backward(list(y.values()), [torch.randn(t.shape, generator=gen) for t in y.values()])
        outs.append({name: t.detach() for name, t in y.items()})
        grads.append({name: [x[name].grad] + [p.grad.clone() for p in model.forms[name].parameters()]
                      for name in model.forms})
        model.zero_grad()
    return SimpleNamespace(report=te_compile.report(), outs=outs, grads=grads,
                           state=te_compile.recipe_state_dict(model))


DELAYED = {"recipe": "DelayedScaling", "amax_history_len": 2,
           "recipe_options": {"fp8_mha": True, "fp8_dpa_backward": "fp8"}}


@pytest.fixture(scope="module")
def runs():
    with pytest.MonkeyPatch.context() as mp:
        _without_the_pass(mp)
        apart = _run(DELAYED)
    return _run(DELAYED), apart


def test_the_fp8_mha_row_says_where_q_k_v_come_from(runs):
    handed, apart = runs
    rows = {s.fqn.split(".")[1]: s for s in handed.report.sites if s.op == "fp8_mha"}
    assert sorted(rows) == sorted(FORMS), str(handed.report)
    for name, (ok, reason) in FORMS.items():
        assert reason in rows[name].reason, (name, rows[name].reason)
        # the output side is unchanged: O is handed to the projection in every form
        assert "FP8 O handed to" in rows[name].reason and rows[name].rewritten, rows[name]
    assert not any("FP8 Q, K, V from" in s.reason for s in apart.report.sites)


def test_forward_gradients_and_state_are_those_of_the_attention_quantizing_itself(runs):
    handed, apart = runs
    for step in range(STEPS):
        for name in FORMS:
            assert_bitwise_equal(handed.outs[step][name], apart.outs[step][name], f"step {step} {name} y")
            for i, (a, b) in enumerate(zip(handed.grads[step][name], apart.grads[step][name])):
                assert_bitwise_equal(a, b, f"step {step} {name} grad {i}")
    assert sorted(handed.state) == sorted(apart.state)
    for key in handed.state:
        assert_bitwise_equal(handed.state[key], apart.state[key], key)
    # the state saw Q, K and V at different scales: a column cast with another role's scale would show
    for name in HANDED:
        scales = [handed.state[f"forms.{name}.sdpa.{role}.scale"] for role in ("query", "key", "value")]
        assert len({float(s) for s in scales}) == 3, (name, scales)


def test_current_scaling_keeps_q_k_v_in_high_precision():
    run = _run({"recipe": "Float8CurrentScaling", "recipe_options": {"fp8_mha": True}}, names=("nanogpt",))
    [row] = [s for s in run.report.sites if s.op == "fp8_mha"]
    assert row.reason.startswith("FP8 O handed to forms.nanogpt.proj"), row.reason
    assert "; Q, K, V arrive in high precision: current scaling scales them per (batch, head)" in row.reason


def test_under_inductor_too(monkeypatch):
    """Inductor fuses the cast with the projection's bias add; the bytes stay those of the attention's
    own quantization."""
    handed = _run(DELAYED, compiler="inductor", names=("layer_norm",))
    assert any("FP8 Q, K, V from" in s.reason for s in handed.report.sites), str(handed.report)
    _without_the_pass(monkeypatch)
    apart = _run(DELAYED, compiler="inductor", names=("layer_norm",))
    for step in range(STEPS):
        assert_bitwise_equal(handed.outs[step]["layer_norm"], apart.outs[step]["layer_norm"], f"step {step}")
        for a, b in zip(handed.grads[step]["layer_norm"], apart.grads[step]["layer_norm"]):
            assert_bitwise_equal(a, b, f"step {step} grads")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_triton_forward_reads_q_k_v_as_views_of_the_projections_bytes():
    """The handed-over q8, k8, v8 are strided views of one [B, T, 3C] buffer (row stride 3C, not C);
    the Triton kernel (the interpreter on CPU) reads them as they are, as the reference reads copies."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    y8 = (torch.randn(B, T, 3 * C, generator=gen) * 8).to(E4M3)
    q8, k8, v8 = (t.view(B, T, H, D).transpose(1, 2) for t in y8.split(C, dim=2))
    descales = [torch.full((B, H), s) for s in (0.5, 0.25, 2.0)]
    kwargs = dict(sm_scale=D ** -0.5, causal=True, out_dtype=torch.float32)
    o_ref, lse_ref = fp8_attention_forward_reference(q8.contiguous(), k8.contiguous(), v8.contiguous(), *descales,
                                                     **kwargs)
    o, lse = fp8_attention_forward_triton(q8.to(device), k8.to(device), v8.to(device),
                                          *(d.to(device) for d in descales), **kwargs)
    assert q8.stride()[2] == 3 * C   # really strided
    # equal up to the order of fp32 sums (the values reach ~10 here); on a GPU its exp differs too
    tol = dict(rtol=2e-6, atol=2e-6) if device == "cpu" else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(o.cpu(), o_ref, **tol)
    torch.testing.assert_close(lse.cpu(), lse_ref, **tol)


@pytest.mark.parametrize("arch", ["bert", "opt"])
def test_hugging_face_attention(arch, monkeypatch):
    """transformers' own code: BERT's separate query / key / value linears hand over (the loss and
    every gradient bit-identical to the attention quantizing itself); OPT scales q after q_proj, so
    only K and V are handed over, and the report says why not Q."""
    transformers = pytest.importorskip("transformers", reason="needs transformers for HF model code")
    if arch == "bert":
        config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, vocab_size=128, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        build = lambda: transformers.BertForMaskedLM(config)   # noqa: E731
    else:
        config = transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4,
                                        word_embed_proj_dim=64, vocab_size=128, max_position_embeddings=64,
                                        dropout=0.0, attention_dropout=0.0, attn_implementation="sdpa")
        build = lambda: transformers.OPTForCausalLM(config)   # noqa: E731
    ids = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def run():
        torch._dynamo.reset()
        te_compile.reset()
        torch.manual_seed(0)
        model = build()
        fn = torch.compile(model, backend="te", options={"compiler": "aot_eager", **DELAYED})
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        rows = [s.reason for s in te_compile.report().sites if s.op == "fp8_mha"]
        return loss.detach(), [p.grad for p in model.parameters()], rows

    loss, grads, rows = run()
    prefix = "bert.encoder.layer.0.attention.self" if arch == "bert" else "model.decoder.layers.0.self_attn.q_proj"
    if arch == "bert":
        assert rows == [f"FP8 O handed to bert.encoder.layer.0.attention.output.dense (quantized and saved once); "
                        f"FP8 Q, K, V from {prefix}.query, {prefix}.key, {prefix}.value (quantized once, at the "
                        f"projection's output)"], rows
    else:
        # k and v pass through transformers' DynamicCache (>= 5.24: cat onto an empty tensor) on the way
        assert rows == [f"FP8 O handed to model.decoder.layers.0.self_attn.out_proj (quantized and saved once); "
                        f"FP8 K, V from {prefix[:-6]}k_proj, {prefix[:-6]}v_proj (quantized once, at the "
                        f"projection's output); Q quantized in the graph once it is computed (q is made by mul, "
                        f"not moved out of a per-tensor FP8 linear's output)"], rows
    _without_the_pass(monkeypatch)
    apart_loss, apart_grads, _ = run()
    assert_bitwise_equal(loss, apart_loss, "loss")
    for i, (a, b) in enumerate(zip(grads, apart_grads)):
        if a is not None or b is not None:
            assert_bitwise_equal(a, b, f"grad {i}")
