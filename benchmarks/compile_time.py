"""Compile time: the demo model's first training step under te vs plain inductor, cold and warm.

    python benchmarks/compile_time.py                                  # Float8CurrentScaling, DelayedScaling
    python benchmarks/compile_time.py --recipes Float8BlockScaling NVFP4BlockScaling --model tiny
    python benchmarks/compile_time.py --repeat 3                       # medians of 3 rounds

Each figure comes from a fresh Python process (compiled code, Dynamo and AOTAutograd keep in-process
state). "cold" runs against an empty ``TORCHINDUCTOR_CACHE_DIR`` made for that provider; "warm" runs
the same command again against the cache the cold run left, as a second launch of a training script
would. The first step is the ``torch.compile`` call, then forward, backward and an AdamW step on the demo's
model and batch; import time is measured apart. The AOTAutograd column shows whether the warm run reused the
traced forward and backward (hit) or traced them again (miss: a key changed; bypass: the graph was
refused), from ``torch._dynamo.utils.counters["aot_autograd"]``. With ``--repeat N`` the providers
take turns N times (each round's cold run on a new cache) and the table shows medians and ranges: on
a shared machine a single figure moves by 10-20%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_RECIPES = ("Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling", "Float8BlockScaling",
            "NVFP4BlockScaling")


def _child(args: argparse.Namespace) -> None:
    """One process: import, compile, first step; one JSON line on stdout."""
    t0 = time.perf_counter()
    import torch

    import te_compile
    from te_compile.data import get_batch
    from te_compile.models import gpt_small, gpt_tiny

    import_s = time.perf_counter() - t0
    from torch._dynamo.utils import counters

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = (gpt_tiny if args.model == "tiny" else gpt_small)().to(device=device, dtype=dtype)
    x, y = get_batch("train", 8, model.block_size, torch.Generator().manual_seed(0), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # from the torch.compile call: backend="inductor" imports inductor there, te at its first graph
    t1 = time.perf_counter()
    backend = "inductor" if args.provider == "inductor" else te_compile.backend(recipe=args.provider)
    compiled = torch.compile(model, backend=backend)
    _, loss = compiled(x, y)
    loss.backward()
    opt.step()
    loss.item()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t1
    aot = counters["aot_autograd"]
    print(json.dumps({"import_s": import_s, "first_step_s": first_step_s,
                      "aot": {k: aot[f"autograd_cache_{k}"] for k in ("hit", "miss", "bypass")},
                      "fxgraph": {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss")}}))


def _run_child(provider: str, cache_dir: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--provider", provider,
           "--device", args.device, "--model", args.model]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{provider}: the measuring process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _aot(counts: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items() if v) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", choices=_RECIPES, default=["Float8CurrentScaling", "DelayedScaling"],
                        help="te recipes to measure (default: Float8CurrentScaling DelayedScaling)")
    parser.add_argument("--model", choices=("small", "tiny"), default="small",
                        help="the demo's model (small, the default) or its one-layer test model (tiny)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over the providers; medians are shown")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--provider", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        _child(args)
        return

    import torch
    from tabulate import tabulate

    results: dict[str, list] = {}   # label -> [(cold, warm) per round]
    with tempfile.TemporaryDirectory(prefix="te_compile_time_") as root:
        for round_ in range(args.repeat):
            for provider in ("inductor", *args.recipes):
                cache = os.path.join(root, f"{provider}-{round_}")
                label = "inductor" if provider == "inductor" else f"te {provider}"
                print(f"{label}: cold ...", end="", flush=True)
                cold = _run_child(provider, cache, args)
                print(f" {cold['first_step_s']:.1f} s; warm ...", end="", flush=True)
                warm = _run_child(provider, cache, args)
                print(f" {warm['first_step_s']:.1f} s", flush=True)
                results.setdefault(label, []).append((cold, warm))

    def median(label, i):
        return statistics.median(r[i]["first_step_s"] for r in results[label])

    def cell(label, i):
        values = [r[i]["first_step_s"] for r in results[label]]
        spread = f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
        return f"{median(label, i):.1f}{spread}"

    rows = [(label, cell(label, 0), f"{median(label, 0) / median('inductor', 0):.2f}x",
             cell(label, 1), f"{median(label, 1) / median('inductor', 1):.2f}x",
             _aot(runs[-1][1]["aot"]), f"{statistics.median(r[1]['import_s'] for r in runs):.1f}")
            for label, runs in results.items()]
    what = "medians of {} rounds, ".format(args.repeat) if args.repeat > 1 else ""
    print(f"\nfirst training step (compile included), demo model '{args.model}', {args.device}, {what}"
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(tabulate(rows, headers=["provider", "cold s", "vs inductor", "warm s", "vs inductor",
                                  "warm AOTAutograd cache", "import s"], disable_numparse=True))


if __name__ == "__main__":
    main()
