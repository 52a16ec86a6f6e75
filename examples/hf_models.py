"""Tiny randomly initialised Hugging Face models for ``te-compile report`` dry runs.

    te-compile report examples.hf_models:tiny_llama
    te-compile report examples.hf_models:tiny_gpt2

Nothing is downloaded: the models are built from small configs (every linear dimension a
multiple of 16, so all of them can run in FP8). Needs ``pip install transformers``.
"""

from __future__ import annotations

import torch


def tiny_llama():
    """LlamaForCausalLM: hidden 64, MLP 128, 2 layers, 4 heads, byte vocab (256)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        use_cache=False,  # training-style forward: no KV cache object in the graph
    )
    return LlamaForCausalLM(config)


def tiny_gpt2():
    """GPT2LMHeadModel: width 64, 2 layers, 4 heads, byte vocab (256). Its linears are Conv1D."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=0,  # the defaults (50256) lie outside the byte vocabulary
        eos_token_id=0,
        use_cache=False,
    )
    return GPT2LMHeadModel(config)
