"""Compile time and speed of a training run's start: te vs plain inductor vs torchao float8.

    python benchmarks/compile_time.py                                  # Float8CurrentScaling, DelayedScaling
    python benchmarks/compile_time.py --recipes Float8BlockScaling NVFP4BlockScaling --model tiny
    python benchmarks/compile_time.py --repeat 3                       # medians of 3 rounds
    python benchmarks/compile_time.py --model nanogpt --repeat 3       # nanoGPT-sized: 4 layers x 256

Each figure comes from a fresh Python process (compiled code, Dynamo and AOTAutograd keep in-process
state). "cold" runs against an empty ``TORCHINDUCTOR_CACHE_DIR`` made for that provider; "warm" runs
the same command again against the cache the cold run left, as a second launch of a training script
would. The first step is the ``torch.compile`` call (for torchao, its ``convert_to_float8_training``
module swap first), then forward, backward and an AdamW step on the model and a batch of the standard
library's text; import time (torchao's included) is measured apart. After it, one untimed step and
``--steps`` timed ones give the steady tokens/s (batch x block_size over the median step; the median
over the cold and the warm process of every round). The AOTAutograd column shows whether the warm run
reused the traced forward and backward (hit) or traced them again (miss: a key changed; bypass: the
graph was refused), from ``torch._dynamo.utils.counters["aot_autograd"]``. With ``--repeat N`` the
providers take turns N times (each round's cold run on a new cache) and the table shows medians and
ranges: on a shared machine a single figure moves by 10-20%, and the steady tokens/s far more: on a
2-core CPU inductor's OpenMP kernels run up to 100x slower while another process keeps a core busy,
so check the load before a run.

Models: ``small`` is the demo's (``gpt_small``: 4 layers x 128, block 64, batch 8); ``nanogpt`` is
nanoGPT's model code at 4 layers x 256, 4 heads, block 256, batch 8 (``te_compile.models.GPT``);
``tiny`` is the one-block test model; ``moe`` is the demo's MoE model (``gpt_moe``: ``small`` with 8
experts, top-2, and a shared expert in every block). Providers: inductor (fp32 on CPU, bf16 on CUDA), te with each of
``--recipes``, torchao float8 tensorwise and, when a block recipe is asked, rowwise (``emulate=True``
off CUDA; shown as not installed without the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

_RECIPES = ("Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling", "Float8BlockScaling",
            "NVFP4BlockScaling")
_BLOCK_RECIPES = _RECIPES[2:]
_TORCHAO = "torchao-"   # provider ids "torchao-tensorwise", "torchao-rowwise"
# model name -> (factory in te_compile.models, its arguments, batch size)
_MODELS = {"small": ("gpt_small", {}, 8),
           "nanogpt": ("GPT", {"vocab_size": 256, "n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256}, 8),
           "tiny": ("gpt_tiny", {}, 8),
           "moe": ("gpt_moe", {}, 8)}


def _model(name: str):
    """(the model ``name`` on the current default device, its batch size)."""
    import te_compile.models

    factory, kwargs, batch = _MODELS[name]
    return getattr(te_compile.models, factory)(**kwargs), batch


def _label(provider: str) -> str:
    if provider == "inductor":
        return provider
    if provider.startswith(_TORCHAO):
        return f"torchao float8 {provider[len(_TORCHAO):]}"
    return f"te {provider}"


def _child(args: argparse.Namespace) -> None:
    """One process: import, compile, first step, steady steps; one JSON line on stdout."""
    t0 = time.perf_counter()
    import torch

    import te_compile
    from te_compile.data import get_batch

    if args.provider.startswith(_TORCHAO):
        import _common    # benchmarks/: torchao's configs, shared with the other scripts

        import torchao.float8  # noqa: F401  (its import counts as import time, as te_compile's does)
    import_s = time.perf_counter() - t0
    from torch._dynamo.utils import counters

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model, batch = _model(args.model)
    model, block_size = model.to(device=device, dtype=dtype), model.block_size
    gen = torch.Generator().manual_seed(0)
    batches = [get_batch("train", batch, block_size, gen, device=device) for _ in range(args.steps + 2)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(compiled, x, y):
        _, loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        sync()

    nodes = _count_nodes()
    # from the torch.compile call: backend="inductor" imports inductor there, te at its first graph
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t1 = time.perf_counter()
    if args.provider.startswith(_TORCHAO):
        model = _common.torchao_convert(model, args.provider[len(_TORCHAO):], device)
        compiled = torch.compile(model)
    else:
        backend = "inductor" if args.provider == "inductor" else te_compile.backend(recipe=args.provider)
        compiled = torch.compile(model, backend=backend)
    step(compiled, *batches[0])
    first_step_s = time.perf_counter() - t1
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    aot = counters["aot_autograd"]
    # what this provider's cache holds: the C++ kernel modules built so far (each a compiler run)
    cpp = glob.glob(os.path.join(os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""), "**", "*.main.cpp"), recursive=True)
    result = {"import_s": import_s, "first_step_s": first_step_s,
              "first_step_cpu_s": cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
              "cpp_modules": len(cpp), "cpp_lines": sum(open(f).read().count("\n") for f in cpp),
              "post_grad_nodes": nodes.count,
              "aot": {k: aot[f"autograd_cache_{k}"] for k in ("hit", "miss", "bypass")},
              "fxgraph": {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss")}}
    step(compiled, *batches[1])   # untimed: anything the second call still sets up
    times = []
    for x, y in batches[2:]:
        t2 = time.perf_counter()
        step(compiled, x, y)
        times.append(time.perf_counter() - t2)
    result["tokens_per_s"] = batch * block_size / statistics.median(times)
    print(json.dumps(result))


def _count_nodes():
    """Counts the operator nodes of every graph inductor lowers (forward and backward after
    AOTAutograd's partition, before inductor's own post-grad passes): each is traced, partitioned,
    lowered and scheduled, so they track the Python side of a compile. A constant uuid keeps the FX
    graph cache as it is without the pass; a warm run that hits it lowers nothing and counts 0."""
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class CountNodes(CustomGraphPass):
        count = 0

        def __call__(self, graph) -> None:
            self.count += sum(node.op == "call_function" for node in graph.nodes)

        def uuid(self) -> str:
            return "benchmarks.compile_time.count_nodes"

    counter = CountNodes()
    inductor_config.post_grad_custom_pre_pass = counter
    return counter


def _run_child(provider: str, cache_dir: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--provider", provider,
           "--device", args.device, "--model", args.model, "--steps", str(args.steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{_label(provider)}: the measuring process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _aot(counts: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items() if v) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", choices=_RECIPES, default=["Float8CurrentScaling", "DelayedScaling"],
                        help="te recipes to measure (default: Float8CurrentScaling DelayedScaling)")
    parser.add_argument("--model", choices=tuple(_MODELS), default="small",
                        help="the demo's model (small, the default), nanoGPT's size (nanogpt: 4 layers x 256, "
                             "block 256), the one-layer test model (tiny) or the demo's MoE model (moe)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over the providers; medians are shown")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps after the first two, for the steady tokens/s (default: 5)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--provider", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.repeat < 1:
        parser.error(f"--steps and --repeat must be >= 1, got {args.steps} and {args.repeat}")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        _child(args)
        return

    import torch
    from tabulate import tabulate

    torchao = [_TORCHAO + "tensorwise"] + ([_TORCHAO + "rowwise"] if set(args.recipes) & set(_BLOCK_RECIPES) else [])
    import _common    # benchmarks/: whether torchao imports, and the line that says it does not

    if not _common.torchao_available():
        missing, torchao = [_label(p) for p in torchao], []
    else:
        missing = []
    results: dict[str, list] = {}   # label -> [(cold, warm) per round]
    with tempfile.TemporaryDirectory(prefix="te_compile_time_") as root:
        for round_ in range(args.repeat):
            for provider in ("inductor", *args.recipes, *torchao):
                cache = os.path.join(root, f"{provider}-{round_}")
                label = _label(provider)
                print(f"{label}: cold ...", end="", flush=True)
                cold = _run_child(provider, cache, args)
                print(f" {cold['first_step_s']:.1f} s; warm ...", end="", flush=True)
                warm = _run_child(provider, cache, args)
                steady = statistics.median((cold["tokens_per_s"], warm["tokens_per_s"]))
                print(f" {warm['first_step_s']:.1f} s; {steady:,.0f} tokens/s", flush=True)
                results.setdefault(label, []).append((cold, warm))

    def values(label, i):
        return [r[i]["first_step_s"] for r in results[label]]

    def tokens(label):   # both processes of every round run the same steady steps
        return [r[i]["tokens_per_s"] for r in results[label] for i in (0, 1)]

    def cell(vals, spec):
        spread = f" ({min(vals):{spec}}-{max(vals):{spec}})" if len(vals) > 1 else ""
        return f"{statistics.median(vals):{spec}}{spread}"

    def ratio(a, b):
        return f"{statistics.median(a) / statistics.median(b):.2f}x"

    rows = [(label, cell(values(label, 0), ".1f"), ratio(values(label, 0), values("inductor", 0)),
             cell(values(label, 1), ".1f"), ratio(values(label, 1), values("inductor", 1)),
             cell(tokens(label), ",.0f"), ratio(tokens(label), tokens("inductor")),
             _aot(runs[-1][1]["aot"]), f"{statistics.median(r[1]['import_s'] for r in runs):.1f}", "")
            for label, runs in results.items()]
    rows += [(label, *["n/a"] * 8, _common.TORCHAO_MISSING) for label in missing]
    with torch.device("meta"):
        model, batch = _model(args.model)
    what = "medians of {} rounds, ".format(args.repeat) if args.repeat > 1 else ""
    print(f"\nfirst training step (compile included) and steady tokens/s ({args.steps} steps), model "
          f"'{args.model}' ({len(model.blocks)} layers x {model.tok_emb.embedding_dim}, "
          f"batch {batch} x {model.block_size}), {args.device}, {what}"
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(tabulate(rows, headers=["provider", "cold s", "vs inductor", "warm s", "vs inductor", "tokens/s",
                                  "vs inductor", "warm AOTAutograd cache", "import s", "note"],
                   disable_numparse=True))
    cold = {label: [r[0] for r in runs] for label, runs in results.items()}
    if args.device == "cpu":
        _print_compile_work(cold, tabulate)


def _print_compile_work(cold: dict[str, list[dict]], tabulate) -> None:
    """The cold step's work in counts that move less with the machine's load than its seconds: the
    measuring process's CPU seconds (Dynamo, AOTAutograd, inductor's Python; the C++ compiler runs in
    worker processes), the operator nodes of the graphs inductor lowered, and the C++ kernel modules
    it built, with their lines."""
    def med(label, key):
        return statistics.median(r[key] for r in cold[label])

    base = med("inductor", "first_step_cpu_s")
    rows = [(label, f"{med(label, 'first_step_cpu_s'):.1f}", f"{med(label, 'first_step_cpu_s') / base:.2f}x",
             f"{med(label, 'post_grad_nodes'):,.0f}", f"{med(label, 'cpp_modules'):.0f}",
             f"{med(label, 'cpp_lines'):,.0f}") for label in cold]
    print("\nthe cold first step's compile work (medians over the rounds)")
    print(tabulate(rows, headers=["provider", "CPU s, measuring process", "vs inductor", "graph nodes",
                                  "C++ modules", "C++ lines"], disable_numparse=True))


if __name__ == "__main__":
    main()
