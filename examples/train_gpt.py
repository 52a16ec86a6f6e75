"""Train an unchanged GPT in FP8 with the te backend: the five-line usage in a real loop.

    python examples/train_gpt.py [config.toml]      # default: examples/current_scaling.toml
    python examples/train_gpt.py examples/delayed_scaling.toml --mode reduce-overhead   # CUDA graphs on a GPU

On a GPU the model runs in bf16; ``--mode reduce-overhead`` replays each step as CUDA graphs
(inductor ignores it on CPU), with DelayedScaling's state updated in place where it lives.
"""

import argparse
import time
from pathlib import Path

import torch

import te_compile
from te_compile.data import get_batch
from te_compile.models import gpt_small

parser = argparse.ArgumentParser(description="Train a small GPT with backend='te'.")
parser.add_argument("config", nargs="?", default=str(Path(__file__).with_name("current_scaling.toml")))
parser.add_argument("--mode", choices=("default", "reduce-overhead"), default="default",
                    help="torch.compile mode (reduce-overhead: CUDA graphs on a GPU)")
args = parser.parse_args()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)

model = gpt_small().to(device)                               # plain nn.Linear / nn.LayerNorm / SDPA
if device.type == "cuda":
    model = model.to(torch.bfloat16)
te_compile.reset()
compiled = torch.compile(model, backend=te_compile.backend(config=args.config),
                         mode=None if args.mode == "default" else args.mode)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

for step in range(1, 31):
    x, y = get_batch("train", 8, model.block_size, gen, device=device)   # int64 [8, 64] byte tokens
    t0 = time.perf_counter()
    torch.compiler.cudagraph_mark_step_begin()   # a new step: CUDA graphs may reuse last step's buffers
    _, loss = compiled(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step == 1 or step % 10 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.2f}s")

print(te_compile.report())
