"""Generation: prefill and decode tokens/s of a Hugging Face Llama with a static cache, te's FP8
inference graphs against bf16 (fp32 on CPU) compiled by inductor and torchao's float8 inference,
measured side by side in one run.

    python benchmarks/bench_generate.py                  # CPU: a tiny Llama (2 layers of 256)
    python benchmarks/bench_generate.py --device cuda    # a 1B-class Llama (16 layers of 2048, random weights)

Each provider compiles ``model.forward`` (``fullgraph=True``; ``mode="reduce-overhead"`` on CUDA) and runs
``generate()`` greedily with a static cache of its own, one per batch size, reset before each call. Prefill: batch 1 of ``--prompt`` tokens, timed as
``generate(max_new_tokens=1)``. Decode: ``--new`` tokens at batch 1 and 32 after an 8-token prompt,
(generate time - prefill time) / new tokens. Providers:
- ``inductor``: the baseline dtype, no FP8;
- ``te <recipe>``: ``backend="te"`` with the recipe (the weights quantized once: inference graphs);
  ``te <recipe> row``: with ``[inference] activation_scaling = "row"``;
  ``te <recipe> fp8-kv``: with ``te_compile.fp8_static_cache`` (K and V in E4M3, read as bytes by te's
  attention) instead of transformers' ``StaticCache``; ``te <recipe> fp8-weights``: the linears'
  weights turned into FP8 primary weights by ``te_compile.quantize_weights`` (no high-precision copy);
- ``torchao float8 (dynamic, rowwise)``: ``quantize_(model, Float8DynamicActivationFloat8WeightConfig(
  granularity=PerRow()))`` then inductor, when torchao imports (its FP8 GEMMs need a GPU).

Columns: median seconds of the prefill and of one decode step at each batch, tokens/s, their ratio to
inductor's, the bytes of the weights the model holds (te: the high-precision weights plus the FP8
copies its inference graphs cache; fp8-weights: the FP8 weights and the embedding) and of the batch-32
key/value cache, each with its ratio to inductor's. GPU goals: decode >= 1.15x at batch 32, prefill
>= 1.35x, weights <= 0.55x, KV cache <= 0.55x with fp8-kv.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common  # noqa: E402
import te_compile  # noqa: E402
from te_compile.kv_cache import kv_cache_bytes  # noqa: E402

SHAPES = {"cuda": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256),
          "cpu": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=4096)}


def _model(device, dtype, max_len: int):
    import transformers

    config = transformers.LlamaConfig(**SHAPES[device.type], max_position_embeddings=max_len)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


def _generator(model, provider: str, max_len: int):
    """``generate(ids, new)`` with the provider's static cache for ids' batch size (made at the first
    call, reset before every call: new cache tensors would recompile the graphs), and the caches."""
    from transformers import StaticCache

    caches = {}

    def generate(ids, new: int):
        if ids.shape[0] not in caches:
            make = te_compile.fp8_static_cache if provider.endswith("fp8-kv") else (
                lambda config, length: StaticCache(config=config, max_cache_len=length))
            caches[ids.shape[0]] = make(model.config, max_len)
        cache = caches[ids.shape[0]]
        cache.reset()
        return model.generate(ids, max_new_tokens=new, do_sample=False, cache=cache)

    return generate, caches


def _compile(model, provider: str, device, compiler: str):
    mode = "reduce-overhead" if device.type == "cuda" else None
    forward = type(model).forward.__get__(model)
    if provider == "inductor" or provider.startswith("torchao"):
        model.forward = torch.compile(forward, fullgraph=True, mode=mode,
                                      backend="inductor" if compiler == "inductor" else compiler)
        return
    recipe, *rest = provider.split()[1:]
    options = {"recipe": recipe, "compiler": compiler}   # "fp8-kv": the cache differs, not the options
    if rest == ["row"]:
        options["inference"] = {"activation_scaling": "row"}
    model.forward = torch.compile(forward, backend="te", fullgraph=True, mode=mode, options=options)


def _torchao(model):
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return model


def _median(fn, device, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` calls, after one untimed call (which compiles a graph the
    call needs for the first time, e.g. the decode graph)."""
    return _common.time_step(fn, device, iters, warmup=0)[1]


def _weight_bytes(model) -> int:
    """The distinct storages of the parameters (a quantized weight's bytes and scales, as the demo's
    saved-bytes measure walks them), plus the FP8 copies te's inference cache holds for them."""
    from te_compile.memory import storages
    from te_compile.weight_cache import cached_bytes

    params = list(model.parameters())
    return sum(n for _, n in {key for p in params for key in storages(p)}) + cached_bytes(params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_common_args(parser)
    parser.add_argument("--prompt", type=int, default=None, help="prefill tokens (default: 2048 CUDA, 256 CPU)")
    parser.add_argument("--new", type=int, default=None, help="decode tokens, >= 2 (default: 64 CUDA, 16 CPU)")
    parser.add_argument("--recipe", default="Float8CurrentScaling")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor")
    args = parser.parse_args()
    device = _common.resolve_device(args)
    args.iters = min(args.iters, 10 if device.type == "cuda" else 3)
    prompt = args.prompt or (2048 if device.type == "cuda" else 256)
    new = args.new or (64 if device.type == "cuda" else 16)
    if new < 2 or prompt < 1:
        sys.exit(f"--new must be >= 2 and --prompt >= 1, got {new} and {prompt}")
    dtype = _common.baseline_dtype(device)
    print(f"bench_generate: Llama {SHAPES[device.type]}, {str(dtype).replace('torch.', '')}, static cache; "
          f"{_common.describe_machine(device)}; median of {args.iters}", flush=True)
    providers = ["inductor", f"te {args.recipe}", f"te {args.recipe} row", f"te {args.recipe} fp8-kv",
                 f"te {args.recipe} fp8-weights", "torchao float8 (dynamic, rowwise)"]
    rows, base = [], {}
    for provider in providers:
        row = [provider]
        try:
            if provider.startswith("torchao") and not _common.torchao_available():
                raise RuntimeError(_common.TORCHAO_MISSING)
            torch._dynamo.reset()
            te_compile.reset()
            max_len = prompt + new + 8
            model = _model(device, dtype, max_len)
            if provider.startswith("torchao"):
                model = _torchao(model)
            if provider.endswith("fp8-weights"):   # the linears' weights only in FP8, the rest as loaded
                te_compile.quantize_weights(model, getattr(te_compile.recipe, args.recipe)())
            _compile(model, provider, device, args.compiler)
            generate, caches = _generator(model, provider, max_len)
            gen = torch.Generator().manual_seed(1)
            long = torch.randint(0, model.config.vocab_size, (1, prompt), generator=gen).to(device)
            figures = {}
            with torch.no_grad():
                # the first call compiles the prefill graph (first call s)
                figures["compile_s"], figures["prefill"] = _common.time_step(
                    lambda: generate(long, 1), device, args.iters, warmup=0)
                for batch in (1, 32):
                    short = torch.randint(0, model.config.vocab_size, (batch, 8), generator=gen).to(device)
                    total = _median(lambda: generate(short, new), device, args.iters)
                    one = _median(lambda: generate(short, 1), device, args.iters)
                    # None when the timings' noise exceeds the decode steps' time (too few --new tokens)
                    figures[f"decode{batch}"] = (total - one) / (new - 1) if total > one else None
            figures["weights"] = _weight_bytes(model)
            figures["kv"] = kv_cache_bytes(caches[32])
            if provider == "inductor":
                base = figures
            row += [f"{figures['prefill']:.4f}", f"{prompt / figures['prefill']:,.0f}",
                    f"{base['prefill'] / figures['prefill']:.2f}x"]
            for batch in (1, 32):
                step, ref = figures[f"decode{batch}"], base.get(f"decode{batch}")
                row += ["n/a", "n/a", "n/a"] if step is None else [
                    f"{1e3 * step:.2f}", f"{batch / step:,.0f}", f"{ref / step:.2f}x" if ref else "n/a"]
            row += [f"{figures['weights'] / 2**20:.1f}", f"{figures['weights'] / base['weights']:.2f}x",
                    f"{figures['kv'] / 2**20:.1f}", f"{figures['kv'] / base['kv']:.2f}x", f"{figures['compile_s']:.1f}",
                    ""]
        except Exception as e:   # a provider that cannot run here keeps its row, with why
            row += ["n/a"] * 14 + [_common.failure_note(e, limit=90) if not isinstance(e, RuntimeError)
                                   or str(e) != _common.TORCHAO_MISSING else str(e)]
        rows.append(row)
        print(f"  {provider}: done", flush=True)
    print(tabulate(rows, headers=["provider", "prefill s", "prefill tok/s", "vs inductor", "decode ms (b1)",
                                  "tok/s (b1)", "vs inductor", "decode ms (b32)", "tok/s (b32)", "vs inductor",
                                  "weights MiB", "vs inductor", "KV MiB (b32)", "vs inductor", "first call s", "note"],
                   disable_numparse=True))
    print(f"\n{_common.precision_note(device)}")


if __name__ == "__main__":
    main()
