"""FP8 inference: graphs compiled with grad disabled read weights quantized once; Hugging Face
generate() with a static cache; calibration of delayed-scaling scales.

The numerics tests decode with a tiny Llama trained for 100 steps on the demo's byte-level text, a
batch of 16 prompts for 16 tokens, against the same model in high precision (aot_eager throughout).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import te_compile
from te_compile.data import get_batch
from models import GroupedSwiGLU
from utils import sqnr

transformers = pytest.importorskip("transformers", reason="needs transformers for HF model code")


def _compiled(model, recipe, **options):
    torch._dynamo.reset()
    te_compile.reset()
    return torch.compile(model, backend="te", options={"recipe": recipe, "compiler": "aot_eager", **options})


class NormMLP(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear, then a weight stored [K, N] and read as ``x @ W`` (GPT-2's
    Conv1D): cached transposed."""

    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)
        self.proj = nn.Parameter(torch.randn(32, 16) / 32**0.5)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) @ self.proj


# ---- weights quantized once ----------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
def test_inference_graph_quantizes_each_weight_once_and_computes_the_training_graphs_bits(recipe, quantizations):
    torch.manual_seed(0)
    model = NormMLP()
    compiled = _compiled(model, recipe)
    x = torch.randn(4, 32)
    training = compiled(x).detach()   # the graph compiled with grad enabled quantizes at every call
    assert quantizations == []
    with torch.no_grad():
        outs = [compiled(x) for _ in range(10)]
    with torch.inference_mode():
        outs.append(compiled(x))
    assert sorted(quantizations) == [(16, 32), (32, 64), (64, 32)]   # each weight once over 11 calls; proj [N, K]
    for out in outs:
        assert torch.equal(out, training)
    rows = [r for r in te_compile.report().sites if r.op == "linear"]
    cached = [r.fqn for r in rows if "weight quantized once, cached across calls" in r.reason]
    # the no_grad and inference_mode graphs (Dynamo guards on both), not the training graph
    assert sorted(cached) == ["", "", "down", "down", "up", "up"] and len(rows) == 9, [r.reason for r in rows]
    # the norm and GELU still fuse into the linears that read the cached weights
    assert {r.reason for r in te_compile.report().sites if r.op in ("layer_norm", "gelu") and r.graph > 0} == {
        "fused into up", "fused into down"}


class AutocastInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        with torch.autocast("cpu", torch.bfloat16):
            h = self.up(x)
        return self.down(h.float())


def test_under_autocast_the_copy_is_quantized_from_the_cast_weight(quantizations):
    """Autocast entered before the call: the copy is made from the weight in autocast's dtype, as the
    linear casts it, so the bits are the training graph's. Entered inside the graph: its sites quantize
    at every call, as in training (the pass does not work out the dtype at each site)."""
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    compiled = _compiled(NormMLP(), "Float8CurrentScaling")
    with torch.autocast("cpu", torch.bfloat16):
        training = compiled(x).detach()
        with torch.no_grad():
            y = compiled(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, training)
    assert len(quantizations) == 3
    quantizations.clear()
    compiled = _compiled(AutocastInside(), "Float8CurrentScaling")
    training = compiled(x).detach()
    with torch.no_grad():
        y = compiled(x)
    assert torch.equal(y, training)
    assert quantizations == []
    assert not any("cached" in r.reason for r in te_compile.report().sites)


def test_cached_weight_is_made_again_when_the_weight_or_its_scale_changes(quantizations):
    torch.manual_seed(0)
    model = NormMLP()
    compiled = _compiled(model, "DelayedScaling")
    x = torch.randn(4, 32)

    def check(expected_quantizations):
        with torch.no_grad():
            y = compiled(x)
        assert len(quantizations) == expected_quantizations
        assert torch.equal(y, compiled(x).detach())   # the grad-enabled graph quantizes afresh

    check(3)
    check(3)
    compiled(x).sum().backward()   # the backward advances the delayed state: both scales change
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    check(6)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})   # copy_: versions move
    check(9)
    state = te_compile.recipe_state_dict(model)
    state["up.weight.scale"] = state["up.weight.scale"] * 0.5
    te_compile.load_recipe_state_dict(model, state)
    check(12)   # loading writes every state tensor: every copy is made again


def test_moe_expert_weights_are_quantized_once_and_again_when_they_change(quantizations):
    torch.manual_seed(0)
    model = GroupedSwiGLU()
    compiled = _compiled(model, "Float8CurrentScaling")
    x = torch.randn(8, 32)
    training = compiled(x).detach()
    assert quantizations == []
    with torch.no_grad():
        outs = [compiled(x) for _ in range(5)]
    # w1, w3 as stored [E, N, K], w2 (stored [E, K, N]) transposed: each once over five calls
    assert sorted(quantizations) == [(4, 16, 64), (4, 64, 32), (4, 64, 32)]
    for out in outs:
        assert torch.equal(out, training)
    rows = [r for r in te_compile.report().sites if r.op == "grouped_linear" and r.graph > 0]
    assert len(rows) == 3 and all("expert weights quantized once, cached across calls" in r.reason for r in rows)
    with torch.no_grad():
        model.w2.mul_(2)
        y = compiled(x)
    assert len(quantizations) == 4 and torch.equal(y, compiled(x).detach())


# ---- [inference] scaling and activation_scaling ---------------------------------------------------------


def test_inference_scaling_current_runs_delayed_scaling_sites_as_current_scaling():
    torch.manual_seed(0)
    model, x = NormMLP(), torch.randn(4, 32)
    outs = []
    for options in ({"recipe": "DelayedScaling", "inference": {"scaling": "current"}},
                    {"recipe": "Float8CurrentScaling"}):
        compiled = _compiled(model, options.pop("recipe"), **options)
        with torch.no_grad():
            outs.append(compiled(x))
        rows = {r.fqn: r.recipe for r in te_compile.report().sites if r.op == "linear"}
        assert rows == {"up": "Float8CurrentScaling", "down": "Float8CurrentScaling", "": "Float8CurrentScaling"}
    assert torch.equal(*outs)
    assert te_compile.recipe_state_dict(model) == {}   # no delayed state made for the inference graph


def test_rowwise_linear_scales_each_token_on_its_own():
    """One scale per row of x (current scaling's rule per row), the weight per tensor: the bits of a
    by-hand quantization, and rows of very different magnitudes each keep their precision."""
    from te_compile.lowerings.linear_paths.rowwise import rowwise_fp8_linear
    from te_compile.recipe import Float8CurrentScaling
    from te_compile.scaling import current_scale

    torch.manual_seed(0)
    x = torch.randn(6, 64) * torch.logspace(-3, 2, 6)[:, None]
    w = torch.randn(32, 64) / 8
    recipe = Float8CurrentScaling()
    y = rowwise_fp8_linear(x, w, recipe)
    sx = current_scale(x.abs().amax(dim=1, keepdim=True), "input", recipe)   # [6, 1]: 448 / each row's amax
    sw = current_scale(w.abs().amax().reshape(1), "weight", recipe)
    xq, wq = (x * sx).to(torch.float8_e4m3fn), (w * sw).to(torch.float8_e4m3fn)
    assert torch.equal(y, (xq.float() @ wq.float().t()) * (1 / sx) * (1 / sw))
    ref = x @ w.t()
    assert min(sqnr(ref[i], y[i]) for i in range(6)) >= 25


@pytest.mark.parametrize("key, value, words", [("scaling", "dynamic", "['static', 'current']"),
                                                ("activation_scaling", "channel", "['tensor', 'row']"),
                                                ("kv_cache", "fp8", "te_compile.fp8_static_cache")])
def test_inference_config_errors_name_the_file_key_and_choices(tmp_path, key, value, words):
    path = tmp_path / "te.toml"
    path.write_text(f'recipe = "DelayedScaling"\n[inference]\n{key} = "{value}"\n')
    with pytest.raises(te_compile.ConfigError) as err:
        te_compile.load_config(path)
    assert str(path) in str(err.value) and f"inference.{key}" in str(err.value) and words in str(err.value)


# ---- generate() with a static cache ----------------------------------------------------------------

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64)
BUILDERS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=16)),
    "gemma": lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**COMMON, head_dim=16)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=1,
                                                                         n_head=2, n_positions=64)),
}


def _static_generate(model, recipe, ids, new_tokens, cache=None, **options):
    """Greedy generate() with a static cache (``cache``: that cache object instead) and the forward
    compiled as Hugging Face documents it."""
    from torch._dynamo.utils import counters

    model.generation_config.cache_implementation = "static" if cache is None else None
    model.generation_config.pad_token_id = 0
    torch._dynamo.reset()
    te_compile.reset()
    model.forward = torch.compile(type(model).forward.__get__(model), backend="te", fullgraph=True,
                                  options={"recipe": recipe, "compiler": "aot_eager", **options})
    counters.clear()
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, cache=cache)
    finally:
        del model.forward   # the class's forward again: the model runs in high precision
    return out, counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize("name, recipe", [("llama", "DelayedScaling"), ("qwen3", "Float8CurrentScaling"),
                                          ("gemma", "Float8CurrentScaling"), ("gpt2", "Float8CurrentScaling")])
def test_hugging_face_generate_with_a_static_cache(name, recipe, quantizations):
    torch.manual_seed(0)
    model = BUILDERS[name]().eval()
    state = te_compile.recipe_state_dict(model)
    out, graphs = _static_generate(model, recipe, torch.randint(0, 128, (4, 8)), 8)
    assert out.sequences.shape == (4, 16)
    assert graphs == 2   # prefill and decode: no recompile over the 7 decode steps
    rows = [r for r in te_compile.report().sites if r.op == "linear"]
    per_graph = {g: [r for r in rows if r.graph == g] for g in (0, 1)}
    for g, graph_rows in per_graph.items():   # every linear FP8, reading its cached weight
        assert graph_rows and all(r.rewritten and "cached across calls" in r.reason for r in graph_rows), g
    # each weight quantized once for the whole generation (a tied head shares its embedding's copy)
    assert len(quantizations) == len({r.fqn for r in rows})
    assert state == {}
    assert te_compile.recipe_state_dict(model) == {}   # inference graphs read state, never create it


# ---- FP8 weights only: quantize_weights ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
def test_weights_quantized_in_place_generate_the_cached_weights_bits(recipe):
    """quantize_weights turns a model's linears into FP8 primary weights holding the bytes its inference
    graphs would cache: generation then gives the same tokens and logits bit for bit, from one byte per
    weight element; DelayedScaling's state (calibrated here) carries over to the new weights as it was."""
    torch.manual_seed(0)
    model = BUILDERS["llama"]().eval()
    ids = torch.randint(0, 128, (4, 8))
    if recipe == "DelayedScaling":
        with torch.no_grad(), te_compile.calibrate(model, recipe=recipe):
            model(ids)
    state = te_compile.recipe_state_dict(model)
    cached, _ = _static_generate(model, recipe, ids, 6)
    elements = {f"{n}.weight": m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    done = te_compile.quantize_weights(model, getattr(te_compile.recipe, recipe)())
    assert done == {name: "FP8 primary weight (Float8Tensor)" for name in elements}, done
    weights = dict(model.named_parameters())
    assert sum(weights[n]._data.numel() * weights[n]._data.element_size() for n in elements) == sum(elements.values())
    after = te_compile.recipe_state_dict(model)
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    served, graphs = _static_generate(model, recipe, ids, 6)
    assert graphs == 2 and torch.equal(served.sequences, cached.sequences)
    for a, b in zip(served.logits, cached.logits):
        assert torch.equal(a, b)
    rows = [r for r in te_compile.report().sites if r.op == "linear"]
    assert rows and all(r.rewritten and "weight already quantized, used as is" in r.reason for r in rows)


def test_quantize_weights_after_from_pretrained_keeps_a_tied_head_in_high_precision(tmp_path):
    """from_pretrained replaces the parameters quantized_model_init builds (so the weights come back in
    high precision); quantize_weights after loading converts them. A head tied to its embedding stays
    in high precision, since the embedding reads it too."""
    recipe = te_compile.recipe.Float8CurrentScaling()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)).save_pretrained(tmp_path)
    with te_compile.quantized_model_init(recipe=recipe):
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert not any(isinstance(p, te_compile.QuantizedTensor) for p in model.parameters())
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    done = te_compile.quantize_weights(model, recipe)
    assert done.pop("lm_head.weight") == "kept in high precision: model.embed_tokens (Embedding) reads it too"
    assert done and set(done.values()) == {"FP8 primary weight (Float8Tensor)"}, done
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, param in model.named_parameters():
        if name in done:   # the weight's values, quantized: E4M3 of a per-tensor scale
            assert isinstance(param, te_compile.Float8Tensor)
            assert sqnr(ref[name], param.dequantize()) >= 25, name
    assert te_compile.quantize_weights(model, recipe)["model.layers.0.mlp.up_proj.weight"] == "already quantized"


def test_quantize_weights_in_a_block_format_gives_the_on_the_fly_bits():
    """MXFP8: each weight's blocks are those the linear would quantize at every call, so the compiled
    forward's logits are bit for bit the same; a weight whose N is not a multiple of 32 stays in high
    precision, saying why, as the backend keeps that linear."""
    torch.manual_seed(0)
    model = BUILDERS["llama"]().eval()
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        on_the_fly = _compiled(model, "MXFP8BlockScaling")(ids).logits
        done = te_compile.quantize_weights(model, te_compile.recipe.MXFP8BlockScaling())
        served = _compiled(model, "MXFP8BlockScaling")(ids).logits
    assert done["model.layers.0.self_attn.k_proj.weight"] == \
        "kept in high precision: weight [16, 32]: MXFP8 scales blocks of 32 along K and N"
    assert done["model.layers.0.mlp.up_proj.weight"] == "FP8 primary weight (MXFP8Tensor)"
    assert sum(v.startswith("FP8 primary weight") for v in done.values()) == 6, done
    assert torch.equal(served, on_the_fly)


# ---- numerics on a trained model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_llama():
    """A tiny Llama (byte vocab) trained 100 AdamW steps on the demo's text, in fp32, eagerly."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        x, y = get_batch("train", 16, 32, gen)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    prompts = get_batch("val", 16, 16, torch.Generator().manual_seed(1))[0]
    with torch.no_grad():
        high = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16, do_sample=False,
                              pad_token_id=0)
    current, graphs = _static_generate(model, "Float8CurrentScaling", prompts, 16)
    return model, prompts, high, current, graphs


def _decode_numerics(model, prompts, fp8):
    """Per decode step: SQNR of the FP8 logits against high precision on the same tokens (the high-
    precision model run over the FP8 run's sequences), and whether each token step matches."""
    with torch.no_grad():
        ref = model(fp8.sequences, attention_mask=torch.ones_like(fp8.sequences)).logits
    start = prompts.shape[1] - 1
    steps = [sqnr(ref[:, start + i], logits) for i, logits in enumerate(fp8.logits)]
    overall = sqnr(torch.stack([ref[:, start + i] for i in range(len(fp8.logits))]), torch.stack(fp8.logits))
    return overall, min(steps), ref


def _tokens_match_or_near_tie(fp8_sequences, high, ref, margin=0.01):
    """Greedy tokens equal high precision's, or the first divergence in each row is a near-tie: the
    high-precision top-2 gap under ``margin`` of that step's logit range."""
    for row in range(high.shape[0]):
        diff = (fp8_sequences[row] != high[row]).nonzero()
        if not len(diff):
            continue
        pos = int(diff[0]) - 1   # the logits that chose the first differing token
        logits = ref[row, pos]
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] < margin * (logits.max() - logits.min()), (row, pos, top2)


@pytest.mark.slow
def test_trained_llama_decodes_in_fp8_close_to_high_precision(trained_llama):
    model, prompts, high, out, graphs = trained_llama
    assert graphs == 2
    overall, worst, ref = _decode_numerics(model, prompts, out)
    assert overall >= 25 and worst >= 22, (overall, worst)
    _tokens_match_or_near_tie(out.sequences, high, ref)


@pytest.mark.slow
def test_trained_llama_decodes_with_one_scale_per_token(trained_llama):
    model, prompts, high, current, _ = trained_llama
    out, graphs = _static_generate(model, "Float8CurrentScaling", prompts, 16,
                                   inference={"activation_scaling": "row"})
    assert graphs == 2
    rows = [r for r in te_compile.report().sites if r.op == "linear"]
    assert rows and all("one input scale per token" in r.reason for r in rows)
    overall, worst, ref = _decode_numerics(model, prompts, out)
    assert overall >= 28 and worst >= 25, (overall, worst)
    _tokens_match_or_near_tie(out.sequences, high, ref)


def test_module_compile_generates_in_fp8():
    """``model.compile(backend="te")`` (nn.Module.compile) with a static cache: generate() calls the
    compiled module, two graphs, every linear on its cached FP8 weight."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = BUILDERS["llama"]().eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    torch._dynamo.reset()
    te_compile.reset()
    model.compile(backend="te", fullgraph=True, options={"recipe": "Float8CurrentScaling", "compiler": "aot_eager"})
    counters.clear()
    ids = torch.randint(0, 128, (4, 8))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert out.shape == (4, 16) and counters["stats"]["unique_graphs"] == 2
    rows = [r for r in te_compile.report().sites if r.op == "linear"]
    assert {r.graph for r in rows} == {0, 1} and all(r.rewritten and "cached across calls" in r.reason for r in rows)


@pytest.fixture
def cache_reads(monkeypatch):
    """What reads the FP8 cache during a generation: "dequantized" per copy made for SDPA, and the
    dtypes of the K operands te's cache attention received."""
    from te_compile import kv_cache
    from te_compile.lowerings import kv_cache_attention as lowering

    seen = {"dequantized": 0, "attention": []}
    dequantize, attention = kv_cache._dequantize, lowering.kv_cache_attention

    def counting_dequantize(*args):
        seen["dequantized"] += 1
        return dequantize(*args)

    def counting_attention(q, k8, *args, **kwargs):
        seen["attention"].append(k8.dtype)
        return attention(q, k8, *args, **kwargs)

    monkeypatch.setattr(kv_cache, "_dequantize", counting_dequantize)
    monkeypatch.setattr(lowering, "kv_cache_attention", counting_attention)
    return seen


def test_te_attention_reads_the_fp8_cache_bytes(cache_reads):
    """Compiled with te, the SDPA calls of the prefill and of every decode step read the E4M3 bytes and
    their per-token scales (no dequantized copy is made) and give what SDPA over the copy gives, for a
    GQA Llama in both of transformers' forms: the prefill's cropped cache with enable_gqa, the decode's
    repeat_kv with a mask. Only the attention differs here: the linears stay in high precision."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, "num_attention_heads": 4,
                                                                      "num_key_value_heads": 2})).eval()
    ids = torch.randint(0, 128, (2, 5))
    model.generation_config.pad_token_id = 0
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        eager = model.generate(ids, cache=te_compile.fp8_static_cache(model.config, 12), **kwargs)
    assert cache_reads["dequantized"] == 2 * 4 and not cache_reads["attention"]   # K and V, prefill + 3 decodes
    cache_reads["dequantized"] = 0
    out, graphs = _static_generate(model, "Float8CurrentScaling", ids, 4, te_compile.fp8_static_cache(model.config, 12),
                                   rewrite={"linear": False})
    assert graphs == 2 and cache_reads["dequantized"] == 0
    assert cache_reads["attention"] == [torch.float8_e4m3fn] * 4
    rows = [r for r in te_compile.report().sites if r.op == "sdpa"]
    assert [r.graph for r in rows] == [0, 1] and all(r.rewritten and "E4M3 bytes" in r.reason for r in rows), rows
    assert torch.equal(out.sequences, eager.sequences)
    for got, expect in zip(out.logits, eager.logits):   # the same sums in another order
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_trained_llama_decodes_with_an_fp8_kv_cache(trained_llama, cache_reads):
    """K and V held as E4M3 with one scale per (row, head, token): (D + 4) bytes a vector against the
    fp32 cache's 4D, read as bytes by te's attention, and decoding stays close to high precision."""
    from transformers import StaticCache

    from te_compile.kv_cache import kv_cache_bytes

    model, prompts, high, _, _ = trained_llama
    length = prompts.shape[1] + 16
    cache = te_compile.fp8_static_cache(model.config, length)
    out, graphs = _static_generate(model, "Float8CurrentScaling", prompts, 16, cache=cache)
    assert graphs == 2
    assert cache_reads["dequantized"] == 0 and len(cache_reads["attention"]) == 2 * 16   # 2 layers, 16 forwards
    overall, worst, ref = _decode_numerics(model, prompts, out)
    assert overall >= 25 and worst >= 20, (overall, worst)
    # E4M3 K and V (3 mantissa bits, on top of the FP8 linears) move the logits more than the linears
    # alone: a row was seen to part at a top-2 gap of 1.6% of the logit range (3.13 vs 3.01 of 7.9)
    _tokens_match_or_near_tie(out.sequences, high, ref, margin=0.02)
    plain = StaticCache(config=model.config, max_cache_len=length)
    with torch.no_grad():
        model.generate(prompts[:, :4], attention_mask=torch.ones_like(prompts[:, :4]), max_new_tokens=1,
                       do_sample=False, cache=plain, pad_token_id=0)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert kv_cache_bytes(cache) * 4 * head_dim == kv_cache_bytes(plain) * (head_dim + 4)


@pytest.mark.slow
def test_calibrated_static_scales_decode_as_well_as_current_scaling(trained_llama):
    """calibrate() runs the model in high precision (its own outputs), leaves each history holding the
    true max|x| and max|w| of every call, and DelayedScaling decoding with those scales is within 1 dB
    of current scaling's SQNR."""
    model, prompts, _, current, _ = trained_llama
    options = {"recipe": "DelayedScaling", "amax_history_len": 16}
    calib = get_batch("train", 16, 32, torch.Generator().manual_seed(2))[0]
    inputs = {}
    hooks = [model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda m, a: inputs.setdefault("down", []).append(a[0].abs().amax()))]
    compiled = torch.compile(model, backend="te", options={**options, "compiler": "aot_eager"})
    with torch.no_grad(), te_compile.calibrate(compiled, **options) as calls:
        calibrated_logits = compiled(calib).logits
        own = model(calib).logits
    hooks[0].remove()
    assert torch.equal(calibrated_logits, own)
    assert len(calls) == 15 and set(calls.values()) == {2}, calls   # 14 linears + lm_head, two forwards each
    state = te_compile.recipe_state_dict(model)
    history = state["model.layers.0.mlp.down_proj.input.amax_history"]
    assert torch.equal(history[:2], torch.stack(inputs["down"][::-1]).float())
    w = model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(state["model.layers.0.mlp.down_proj.weight.amax_history"][:2], w.abs().amax().repeat(2))

    static, _ = _static_generate(model, "DelayedScaling", prompts, 16, amax_history_len=16)
    s_static, _, _ = _decode_numerics(model, prompts, static)
    s_current, _, _ = _decode_numerics(model, prompts, current)
    assert s_static >= s_current - 1, (s_static, s_current)
    assert te_compile.recipe_state_dict(model)["model.layers.0.mlp.down_proj.input.amax_history"].equal(history)


CALIBRATED = {"recipe": "DelayedScaling", "amax_history_len": 16, "compiler": "aot_eager",
              "inference": {"scaling": "static"}}
# the ways users compile a model: Hugging Face's (the bound forward), nn.Module.compile, the wrapper
# torch.compile returns, and a te_compile.backend() callable; each returns what calibrate() receives
COMPILE_FORMS = {
    "model.forward": lambda m: setattr(m, "forward", torch.compile(m.forward, backend="te", options=CALIBRATED)),
    "model.compile": lambda m: m.compile(backend="te", options=CALIBRATED),
    "torch.compile(model)": lambda m: torch.compile(m, backend="te", options=CALIBRATED),
    "te_compile.backend()": lambda m: setattr(m, "forward", torch.compile(m.forward,
                                                                          backend=te_compile.backend(**CALIBRATED))),
}


@pytest.mark.parametrize("form", list(COMPILE_FORMS))
def test_calibrate_takes_the_config_the_model_is_compiled_with(form):
    """calibrate(model) without options calibrates under the config the model was compiled with,
    however it was compiled: the state is that of calibrating the plain model with those options
    explicitly, key for key and bit for bit (history length 16, the compile's, not the default 1024)."""
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    reference = BUILDERS["llama"]().eval()
    with torch.no_grad(), te_compile.calibrate(reference, **CALIBRATED):
        reference(ids)
    expected = te_compile.recipe_state_dict(reference)
    torch.manual_seed(0)
    model = BUILDERS["llama"]().eval()
    wrapper = COMPILE_FORMS[form](model)
    target = model if wrapper is None else wrapper
    with torch.no_grad(), te_compile.calibrate(target) as calls:
        target(ids)
    assert len(calls) == 8 and set(calls.values()) == {1}, calls   # 7 linears + lm_head, one forward
    state = te_compile.recipe_state_dict(model)
    assert len(state) == 8 * 3 * 2 and state.keys() == expected.keys()   # 3 roles x (scale, history)
    assert state["model.layers.0.mlp.gate_proj.input.amax_history"].shape == (16,)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_calibrate_under_a_config_without_delayed_scaling_names_it():
    """A model not compiled with te resolves the default config, whose recipe is not DelayedScaling:
    calibrating nothing is an error naming the config and the recipe, not an empty state dict."""
    model = BUILDERS["llama"]().eval()
    with pytest.raises(ValueError, match=r"no nn.Linear of LlamaForCausalLM runs under DelayedScaling in the "
                                         r"config from <defaults> \(recipe Float8CurrentScaling"):
        with te_compile.calibrate(model):
            pass
    assert te_compile.recipe_state_dict(model) == {}


def _generate_logits(model, ids):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return torch.stack(out.logits)


@pytest.mark.slow
def test_generation_reads_the_calibrated_state_and_leaves_it_alone():
    """Hugging Face's compile form (the bound forward), DelayedScaling with static inference scaling:
    generating before calibration creates no state (an inference graph never does); calibrating after
    the graphs are built gives every linear its keys, which the same graphs then read without a
    recompile; generating changes neither keys nor values; and the saved state, loaded into a fresh
    copy before its first compile, generates the same logits bit for bit."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = BUILDERS["llama"]().eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    copy = BUILDERS["llama"]().eval()
    copy.load_state_dict(model.state_dict())
    copy.generation_config = model.generation_config
    for m in (model, copy):
        COMPILE_FORMS["model.forward"](m)
    counters.clear()
    uncalibrated = _generate_logits(model, ids)
    assert te_compile.recipe_state_dict(model) == {}   # no grad_output (or any) state from inference
    assert counters["stats"]["unique_graphs"] == 2   # prefill and decode
    with torch.no_grad(), te_compile.calibrate(model):
        model(ids)
    state = te_compile.recipe_state_dict(model)
    assert len(state) == 8 * 3 * 2 and "lm_head.grad_output.scale" in state
    assert not torch.equal(state["model.layers.0.mlp.gate_proj.input.scale"], torch.ones(1))
    calibrated = _generate_logits(model, ids)
    assert counters["stats"]["unique_graphs"] == 2   # the graphs built before calibration read its scales
    assert not torch.equal(calibrated, uncalibrated)
    after = te_compile.recipe_state_dict(model)
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    te_compile.load_recipe_state_dict(copy, state)
    assert torch.equal(_generate_logits(copy, ids), calibrated)
    assert te_compile.recipe_state_dict(copy).keys() == state.keys()
