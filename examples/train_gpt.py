"""Train an unchanged GPT in FP8 with the te backend: the five-line usage in a real loop.

    python examples/train_gpt.py [config.toml]      # default: examples/current_scaling.toml
"""

import sys
import time
from pathlib import Path

import torch

import te_compile
from te_compile.data import get_batch
from te_compile.models import gpt_small

config = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).with_name("current_scaling.toml"))
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)

model = gpt_small()                                           # plain nn.Linear / nn.LayerNorm / SDPA
te_compile.reset()
compiled = torch.compile(model, backend=te_compile.backend(config=config))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

for step in range(1, 31):
    x, y = get_batch("train", 8, model.block_size, gen)       # int64 [8, 64] byte tokens
    t0 = time.perf_counter()
    _, loss = compiled(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step == 1 or step % 10 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.2f}s")

print(te_compile.report())
