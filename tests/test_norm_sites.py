"""Norm sites: every LayerNorm / RMSNorm form is found by structure in Dynamo's graph (the finder
the norm fusion pass will build on), in modules written here and in Hugging Face's own model code."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from te_compile.fx.graphs import graph_scopes
from te_compile.passes.norm_sites import find_norm_sites

D = 32


def norm_sites(model: nn.Module, *args, **kwargs) -> list[tuple[str, str, str]]:
    """(fqn, op, form) of every norm site in the graphs Dynamo captures for ``model(*args)``."""
    found = []

    def capture(gm, example_inputs):
        for scope in graph_scopes(gm, example_inputs):
            found.extend((s.fqn, s.op, s.form) for s in find_norm_sites(scope))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(*args, **kwargs)
    return found


class NanoLayerNorm(nn.Module):
    """nanoGPT's LayerNorm with an optional bias."""

    def __init__(self, d: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class LlamaRMSNorm(nn.Module):
    """HF Llama / Mistral / Qwen2: fp32 variance, weight times the cast-back result."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + 1e-6)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(nn.Module):
    """HF Gemma: zero-centred gamma, (1 + w), cast back with type_as."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6)
        out = out * (1.0 + self.weight.float())
        return out.type_as(x)


class T5LayerNorm(nn.Module):
    """HF T5: squares a cast copy, multiplies the uncast input."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + 1e-6)
        return self.weight * x


class GptFastRMSNorm(nn.Module):
    """gpt-fast: mean(x * x), then the weight after type_as."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        out = x.float() * torch.rsqrt(torch.mean(x.float() * x.float(), dim=-1, keepdim=True) + 1e-5)
        return out.type_as(x) * self.weight


class CohereLayerNorm(nn.Module):
    """HF Cohere / Cohere2: a hand-written LayerNorm in fp32, no bias, x - mean written twice."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt(variance + 1e-5)
        h = self.weight.to(torch.float32) * h
        return h.to(dtype)


class HandLayerNorm(nn.Module):
    """A hand-written LayerNorm with a bias, centring once: (x - mean) * rsqrt(var + eps) * w + b."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = x.float()
        centered = h - torch.mean(h, dim=-1, keepdim=True)
        h = centered * torch.rsqrt((centered * centered).mean(-1, keepdim=True) + 1e-6)
        return (h * self.weight + self.bias).type_as(x)


NORMS = {
    "ln": (lambda: nn.LayerNorm(D), "layer_norm", "layer_norm"),
    "ln_nobias": (lambda: nn.LayerNorm(D, bias=False), "layer_norm", "layer_norm"),
    "ln_noaffine": (lambda: nn.LayerNorm(D, elementwise_affine=False), "layer_norm", "layer_norm"),
    "nano": (lambda: NanoLayerNorm(D, bias=False), "layer_norm", "layer_norm"),
    "rms": (lambda: nn.RMSNorm(D), "rms_norm", "rms_norm"),
    "llama": (lambda: LlamaRMSNorm(D), "rms_norm", "hand-written RMSNorm"),
    "gemma": (lambda: GemmaRMSNorm(D), "rms_norm", "hand-written RMSNorm"),
    "t5": (lambda: T5LayerNorm(D), "rms_norm", "hand-written RMSNorm"),
    "gptfast": (lambda: GptFastRMSNorm(D), "rms_norm", "hand-written RMSNorm"),
    "cohere": (lambda: CohereLayerNorm(D), "layer_norm", "hand-written LayerNorm"),
    "handln": (lambda: HandLayerNorm(D), "layer_norm", "hand-written LayerNorm"),
}



class Block(nn.Module):
    """One norm of each kind, each feeding a linear; and an rsqrt that is not a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleDict({name: make() for name, (make, _, _) in NORMS.items()})
        self.proj = nn.ModuleDict({name: nn.Linear(D, D) for name in NORMS})

    def forward(self, x):
        out = x * torch.rsqrt(x.abs() + 1.0)   # rsqrt without mean(x²): not a norm
        for name in NORMS:
            out = out + self.proj[name](self.norms[name](x))
        return out


def test_every_norm_form_is_found_once_with_its_module_path():
    found = norm_sites(Block(), torch.randn(2, 8, D))
    assert sorted(found) == sorted((f"norms.{name}", op, form) for name, (_, op, form) in NORMS.items())


def test_plain_math_with_rsqrt_is_not_a_norm():
    class NotNorms(nn.Module):
        def forward(self, x):
            # no mean over the last dim, and a mean of x (not x²)
            out = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1) + x * torch.rsqrt(x.mean(-1, keepdim=True).abs() + 1)
            # a variance around the row mean, multiplying x centred around another mean
            var = (x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True)
            out = out + (x - x.mean(0, keepdim=True)) * torch.rsqrt(var + 1)
            # x itself, not x - mean, divided by that standard deviation
            return out + x * torch.rsqrt((x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + 1)

    assert norm_sites(NotNorms(), torch.randn(2, D)) == []


def _hf_models():
    transformers = pytest.importorskip("transformers", reason="needs transformers for HF model code")
    t = transformers
    return {
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128)),
        "gemma": (t.GemmaForCausalLM, t.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                     vocab_size=128)),
        "t5": (t.T5EncoderModel, t.T5Config(d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16, vocab_size=128)),
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128)),
        "cohere": (t.CohereForCausalLM, t.CohereConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128)),
    }


HF_EXPECTED = {
    "llama": [("model.layers.0.input_layernorm", "rms_norm", "hand-written RMSNorm"),
              ("model.layers.0.post_attention_layernorm", "rms_norm", "hand-written RMSNorm"),
              ("model.norm", "rms_norm", "hand-written RMSNorm")],
    "gemma": [("model.layers.0.input_layernorm", "rms_norm", "hand-written RMSNorm"),
              ("model.layers.0.post_attention_layernorm", "rms_norm", "hand-written RMSNorm"),
              ("model.norm", "rms_norm", "hand-written RMSNorm")],
    "t5": [("encoder.block.0.layer.0.layer_norm", "rms_norm", "hand-written RMSNorm"),
           ("encoder.block.0.layer.1.layer_norm", "rms_norm", "hand-written RMSNorm"),
           ("encoder.final_layer_norm", "rms_norm", "hand-written RMSNorm")],
    "gpt2": [("transformer.h.0.ln_1", "layer_norm", "layer_norm"), ("transformer.h.0.ln_2", "layer_norm", "layer_norm"),
             ("transformer.ln_f", "layer_norm", "layer_norm")],
    # parallel attention and MLP: one norm per layer
    "cohere": [("model.layers.0.input_layernorm", "layer_norm", "hand-written LayerNorm"),
               ("model.norm", "layer_norm", "hand-written LayerNorm")],
}


@pytest.mark.parametrize("name", list(HF_EXPECTED))
def test_hugging_face_norms_are_found(name):
    cls, config = _hf_models()[name]
    torch.manual_seed(0)
    model = cls(config)
    found = norm_sites(model, input_ids=torch.randint(0, 128, (2, 8)))
    assert found == HF_EXPECTED[name]
