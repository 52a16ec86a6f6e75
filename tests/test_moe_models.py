"""Hugging Face MoE models (transformers, random init, tiny configs) train under te with every expert
GEMM rewritten: Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 and GPT-OSS through transformers' grouped_mm
(bf16) or its fallback op (fp32), Llama 4 through its batched bmm. 30 AdamW steps on learnable
sequences, final loss against the same model in high precision (eager; te under aot_eager). The
high-precision runs are shared by the cases that train the same model in the same dtype."""

from __future__ import annotations

import functools

import pytest
import torch

import te_compile

transformers = pytest.importorskip("transformers", reason="needs transformers for HF model code")

STEPS = 30
VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=64)


def _mixtral(intermediate=48):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=intermediate, num_local_experts=4, num_experts_per_tok=2, **COMMON))


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=64, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, head_dim=16, **COMMON))


def _olmoe():
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        intermediate_size=48, num_experts=4, num_experts_per_tok=2, eos_token_id=None, **COMMON))


def _deepseek_v3():
    # the first layer dense (first_k_dense_replace), the second routed with one shared expert
    config = {**COMMON, "num_key_value_heads": 2}
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        intermediate_size=64, moe_intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, rope_scaling=None, **config))


def _gpt_oss():
    # biases on every expert GEMM, gate/up interleaved, its own clamped SwiGLU
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], **COMMON))


def _llama4():
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        intermediate_size=48, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1, head_dim=16,
        interleave_moe_layer_step=1, no_rope_layers=[1, 1], attention_chunk_size=64, **COMMON))


# model -> (constructor, expert GEMM sites in the 2 layers)
MODELS = {"mixtral": (_mixtral, 4), "qwen3_moe": (_qwen3_moe, 4), "olmoe": (_olmoe, 4),
          "deepseek_v3": (_deepseek_v3, 2), "gpt_oss": (_gpt_oss, 4), "llama4": (_llama4, 4)}


def _batches(steps: int) -> torch.Tensor:
    """[steps, 4, 17] token ids: each row counts up from a random start by a random stride, which a
    model can learn (random tokens would leave every loss at log(vocab))."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randint(0, VOCAB, (steps, 4, 1), generator=gen)
    stride = torch.randint(1, 4, (steps, 4, 1), generator=gen)
    return (start + stride * torch.arange(17)) % VOCAB


def train_moe(name: str, dtype: torch.dtype, te: bool, recipe: str = "Float8CurrentScaling", build=None,
           recipe_options=None):
    torch.manual_seed(0)
    model = (build or MODELS[name][0])().to(dtype)
    torch._dynamo.reset()
    te_compile.reset()
    options = {"compiler": "aot_eager", "recipe": recipe, "recipe_options": recipe_options or {}}
    compiled = torch.compile(model, backend="te", options=options) if te else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in _batches(STEPS):
        loss = compiled(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, te_compile.report() if te else None


@functools.lru_cache(maxsize=None)
def _high_precision(name: str, dtype: torch.dtype, intermediate: int = 48) -> tuple[float, ...]:
    """The eager run's losses, computed once per model, dtype and (Mixtral's) intermediate size."""
    build = functools.partial(_mixtral, intermediate) if name == "mixtral" else None
    return tuple(train_moe(name, dtype, te=False, build=build)[0])


# every model in bf16 (transformers' grouped_mm, Llama 4's bmm); in fp32, where transformers routes the
# experts through its fallback op, Mixtral, DeepSeek-V3 (a shared expert beside the routed ones),
# GPT-OSS (biases, interleaved gate/up) and Llama 4 (its bmm in fp32)
CASES = [(name, torch.bfloat16) for name in MODELS] + [(name, torch.float32) for name in
                                                        ("mixtral", "deepseek_v3", "gpt_oss", "llama4")]


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype", CASES, ids=lambda v: {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(v, v))
def test_moe_model_trains_with_every_expert_gemm_rewritten(name, dtype):
    high = _high_precision(name, dtype)
    low, report = train_moe(name, dtype, te=True)
    experts = [s for s in report.sites if s.op == "grouped_linear"]
    assert len(experts) == MODELS[name][1] and all(s.rewritten for s in experts), str(report)
    op = "bmm ->" if name == "llama4" else ("grouped_mm ->" if dtype == torch.bfloat16 else "grouped_mm_fallback ->")
    assert all(s.reason.startswith(op) for s in experts), str(report)
    assert high[-1] < 0.85 * high[0], f"the high-precision run did not learn: {high[0]:.3f} -> {high[-1]:.3f}"
    final_high, final_low = sum(high[-5:]) / 5, sum(low[-5:]) / 5
    assert abs(final_low - final_high) <= 0.015 * final_high, \
        f"final loss {final_low:.4f} vs high precision {final_high:.4f} (more than 1.5% apart)"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling"])
def test_mixtral_trains_under_the_block_recipes(recipe):
    def build():
        return _mixtral(intermediate=64)   # MXFP8 needs K and N % 32 == 0
    high = _high_precision("mixtral", torch.bfloat16, 64)
    low, report = train_moe("mixtral", torch.bfloat16, te=True, recipe=recipe, build=build)
    experts = [s for s in report.sites if s.op == "grouped_linear"]
    assert len(experts) == 4 and all(s.rewritten and "per expert, emulated GEMMs" in s.reason for s in experts), \
        str(report)
    final_high, final_low = sum(high[-5:]) / 5, sum(low[-5:]) / 5
    # 4-bit elements move the loss further than FP8 (here 1.7% for NVFP4, 0.1% for the FP8 formats)
    tolerance = 0.03 if recipe == "NVFP4BlockScaling" else 0.015
    assert abs(final_low - final_high) <= tolerance * final_high, f"{final_low:.4f} vs {final_high:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
def test_mixtral_trains_with_its_swiglu_inputs_saved_in_fp8(recipe):
    high = _high_precision("mixtral", torch.bfloat16)
    low, report = train_moe("mixtral", torch.bfloat16, te=True, recipe=recipe,
                         recipe_options={"fp8_activation_input": True})
    swiglus = [s for s in report.sites if s.op == "swiglu" and "experts" in s.fqn]
    assert len(swiglus) == 2 and all(s.rewritten and "input saved for backward in FP8" in s.reason
                                     for s in swiglus), str(report)
    final_high, final_low = sum(high[-5:]) / 5, sum(low[-5:]) / 5
    assert abs(final_low - final_high) <= 0.015 * final_high, f"{final_low:.4f} vs {final_high:.4f}"


def test_mixtral_padded_for_the_native_grouped_gemms_pads_its_expert_tokens_once(monkeypatch):
    # transformers' grouped_mm experts (one gate_up GEMM chunked in two): with every expert's rows
    # padded to 16, as on an sm90 GPU, the tokens are padded once for the expert MLP's GEMMs, and
    # training takes the same steps as without padding
    from te_compile.passes import grouped_linear as grouped_pass

    runs = {}
    for align in (16, 1):
        monkeypatch.setattr(grouped_pass, "_align", lambda site, recipe, align=align: align)
        runs[align] = train_moe("mixtral", torch.bfloat16, te=True)
    (padded, report), (plain, _) = runs[16], runs[1]
    swiglus = [s for s in report.sites if s.op == "swiglu" and "experts" in s.fqn]
    assert len(swiglus) == 2 and all(s.reason.endswith("the expert MLP's tokens padded once for all its GEMMs")
                                     for s in swiglus), str(report)
    assert padded == plain
