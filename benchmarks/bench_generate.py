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


def _providers(args, device) -> list[_common.Provider]:
    """inductor, te with the recipe and its variants, torchao's float8 inference: each prepares a
    freshly loaded model in place (quantizes, compiles its forward) and returns it."""
    def preparing(name: str):
        def prepare(model):
            if name.startswith("torchao"):
                model = _torchao(model)
            if name.endswith("fp8-weights"):   # the linears' weights only in FP8, the rest as loaded
                te_compile.quantize_weights(model, getattr(te_compile.recipe, args.recipe)())
            _compile(model, name, device, args.compiler)
            return model
        return prepare

    names = ["inductor", f"te {args.recipe}", f"te {args.recipe} row", f"te {args.recipe} fp8-kv",
             f"te {args.recipe} fp8-weights", "torchao float8 (dynamic, rowwise)"]
    missing = [] if _common.torchao_available() else [name for name in names if name.startswith("torchao")]
    return [_common.Provider(name, True, None, _common.TORCHAO_MISSING) if name in missing
            else _common.Provider(name, name != "inductor", preparing(name)) for name in names]


def _build_and_measure(name: str, device, dtype, prompt: int, new: int, iters: int,
                       figures: dict) -> tuple:
    """(build, measure) for run_provider: the step is the prefill (``generate(ids [1, prompt], 1)``);
    the measure adds to ``figures`` the decode step's median seconds at batch 1 and 32 (None when the
    timings' noise exceeds the decode steps' time, too few ``new`` tokens), the weights' bytes and the
    batch-32 KV cache's."""
    max_len = prompt + new + 8
    gen = torch.Generator().manual_seed(1)
    made = {}

    def build(prepare):
        model = made["model"] = prepare(_model(device, dtype, max_len))
        generate, made["caches"] = _generator(model, name, max_len)
        made["generate"] = generate
        long = torch.randint(0, model.config.vocab_size, (1, prompt), generator=gen).to(device)

        def step():
            with torch.no_grad():
                generate(long, 1)
        return step

    def measure() -> None:
        model, generate = made["model"], made["generate"]
        with torch.no_grad():
            for batch in (1, 32):
                short = torch.randint(0, model.config.vocab_size, (batch, 8), generator=gen).to(device)
                total = _median(lambda: generate(short, new), device, iters)
                one = _median(lambda: generate(short, 1), device, iters)
                figures[f"decode{batch}"] = (total - one) / (new - 1) if total > one else None
        figures["weights"] = _weight_bytes(model)
        figures["kv"] = kv_cache_bytes(made["caches"][32])

    return build, measure


def _row(provider: str, figures: dict, base: dict, prompt: int) -> list[str]:
    """A measured provider's table row; ratios against ``base`` (inductor's figures), n/a without them."""
    def ratio(num, den):
        return f"{num / den:.2f}x" if num is not None and den else "n/a"

    row = [provider, f"{figures['prefill']:.4f}", f"{prompt / figures['prefill']:,.0f}",
           ratio(base.get("prefill"), figures["prefill"])]
    for batch in (1, 32):
        step, ref = figures[f"decode{batch}"], base.get(f"decode{batch}")
        row += ["n/a", "n/a", "n/a"] if step is None else [
            f"{1e3 * step:.2f}", f"{batch / step:,.0f}", ratio(ref, step)]
    return row + [f"{figures['weights'] / 2**20:.1f}", ratio(figures["weights"], base.get("weights")),
                  f"{figures['kv'] / 2**20:.1f}", ratio(figures["kv"], base.get("kv")),
                  f"{figures['compile_s']:.1f}", ""]


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
    args.warmup = 0   # every timing here follows one untimed call only, the prefill's (it compiles) too
    prompt = args.prompt or (2048 if device.type == "cuda" else 256)
    new = args.new or (64 if device.type == "cuda" else 16)
    if new < 2 or prompt < 1:
        sys.exit(f"--new must be >= 2 and --prompt >= 1, got {new} and {prompt}")
    dtype = _common.baseline_dtype(device)
    print(f"bench_generate: Llama {SHAPES[device.type]}, {str(dtype).replace('torch.', '')}, static cache; "
          f"{_common.describe_machine(device)}; median of {args.iters}", flush=True)
    rows, base = [], {}
    for provider in _providers(args, device):
        figures = {}
        build, measure = _build_and_measure(provider.name, device, dtype, prompt, new, args.iters, figures)
        figures["compile_s"], figures["prefill"], note = _common.run_provider(
            provider, build, device, args, measure)
        if figures["prefill"] is None:   # a provider that cannot run here keeps its row, with why
            rows.append([provider.name] + ["n/a"] * 14 + [note])
        else:
            if provider.name == "inductor":
                base = figures
            rows.append(_row(provider.name, figures, base, prompt))
        print(f"  {provider.name}: done", flush=True)
    print(tabulate(rows, headers=["provider", "prefill s", "prefill tok/s", "vs inductor", "decode ms (b1)",
                                  "tok/s (b1)", "vs inductor", "decode ms (b32)", "tok/s (b32)", "vs inductor",
                                  "weights MiB", "vs inductor", "KV MiB (b32)", "vs inductor", "first call s", "note"],
                   disable_numparse=True))
    print(f"\n{_common.precision_note(device)}")

if __name__ == "__main__":
    main()
