"""The default config (no options: Float8CurrentScaling with every default-on feature) on the setups
people train with, compiled by inductor: a plain GPT whose final norm feeds the output layer and its
loss, under autocast bf16 / fp16 and with bf16 weights; Hugging Face Llama, Qwen2 and GPT-2 with their
own loss code, under autocast, with gradient checkpointing, with bf16 weights and two
gradient-accumulation micro-batches, then greedy ``generate()``.

Each case must train without an exception, give every GEMM module a report row (rewritten, or left
in high precision with a reason), and end within 3% of eager's loss in the same precision. A feature
that is turned on by default gets a case here first (docs/testing.md).

Inductor's C++ compile costs about a minute of CPU per case here, so the suite compiles two cases
with inductor (the GPT under autocast bf16; Llama with checkpointing and generate) and the rest with
aot_eager, whose graphs are te's same rewritten graphs; ``TE_SWEEP_COMPILER=inductor pytest
tests/test_default_config.py`` compiles every case with inductor.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.nn as nn

import te_compile
from te_compile.models import gpt_tiny

pytestmark = pytest.mark.slow

_STEPS = 3
_EVERY_CASE_INDUCTOR = os.environ.get("TE_SWEEP_COMPILER", "") == "inductor"
_LOSS_TOLERANCE = 0.03   # relative, te against eager in the same precision after the last step
_GEMM_OPS = ("linear", "matmul", "mm", "addmm", "linear_cross_entropy")


def _gemm_modules(model: nn.Module) -> set[str]:
    """The module paths of the model's GEMM layers: nn.Linear and transformers' Conv1D (GPT-2)."""
    return {name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}


def _hf(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="needs transformers for HF model code")
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(   # unchanged: no loss_type set
        vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def _autocast(dtype):
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _train(model, batches, autocast, micro_batches: int, hf: bool) -> list[float]:
    """``_STEPS`` AdamW steps, each over ``micro_batches`` micro-batches (the loss divided by their
    count, the gradients accumulated); returns each step's summed loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(_STEPS):
        total = 0.0
        for idx in batches[step * micro_batches:(step + 1) * micro_batches]:
            with _autocast(autocast):
                loss = model(input_ids=idx, labels=idx).loss if hf else model(idx, idx)[1]
            (loss / micro_batches).backward()
            total += loss.item() / micro_batches
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def _check(model_fn, *, hf: bool, inductor: bool, autocast=None, weights=torch.float32, micro_batches=1,
           checkpointing=False, generate=False):
    torch.manual_seed(0)
    base = model_fn().to(weights)
    if checkpointing:
        base.gradient_checkpointing_enable()
    vocab = 128 if hf else 256
    batches = [torch.randint(0, vocab, (2, 16)) for _ in range(_STEPS * micro_batches)]
    eager = copy.deepcopy(base)
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    te_compile.reset()
    if inductor or _EVERY_CASE_INDUCTOR:
        model.compile(backend="te")   # the default config: no options, no config file in the test's cwd
    else:
        model.compile(backend="te", options={"compiler": "aot_eager"})
    losses = _train(model, batches, autocast, micro_batches, hf)
    ref = _train(eager, batches, autocast, micro_batches, hf)

    sites = te_compile.report().sites
    rows = {r.fqn for r in sites if r.op in _GEMM_OPS}
    missing = sorted(_gemm_modules(base) - rows)
    assert not missing, f"GEMM modules without a report row: {missing}"
    assert all(r.rewritten or r.reason for r in sites), [r for r in sites if not (r.rewritten or r.reason)]
    assert any(r.rewritten for r in sites if r.op in _GEMM_OPS), "no GEMM ran in FP8"
    assert abs(losses[-1] - ref[-1]) <= _LOSS_TOLERANCE * abs(ref[-1]), (losses, ref)

    if generate:
        prompt = batches[0][:1, :8]
        with torch.no_grad(), _autocast(autocast):
            out = model.generate(prompt, max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 12) and torch.equal(out[:, :8], prompt)


@pytest.mark.parametrize("autocast, weights", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                               (None, torch.bfloat16)],
                         ids=["autocast-bf16", "autocast-fp16", "bf16-weights"])
def test_gpt_with_a_final_norm_trains_under_the_default_config(autocast, weights):
    _check(gpt_tiny, hf=False, inductor=autocast is torch.bfloat16, autocast=autocast, weights=weights)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("setup", ["autocast-bf16-checkpointing", "autocast-fp16", "bf16-weights-accumulation"])
def test_hugging_face_causal_lm_trains_and_generates_under_the_default_config(kind, setup):
    options = {
        "autocast-bf16-checkpointing": dict(autocast=torch.bfloat16, checkpointing=True, generate=True),
        "autocast-fp16": dict(autocast=torch.float16),
        "bf16-weights-accumulation": dict(weights=torch.bfloat16, micro_batches=2, generate=True),
    }[setup]
    inductor = kind == "llama" and setup == "autocast-bf16-checkpointing"
    _check(lambda: _hf(kind), hf=True, inductor=inductor, **options)
