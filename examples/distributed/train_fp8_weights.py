"""FP8 primary weights under DDP: the linears hold only their FP8 weight; AdamW updates fp32 masters.

    torchrun --nproc-per-node 2 examples/distributed/train_fp8_weights.py [--recipe NAME]

``te_compile.quantized_model_init`` builds every nn.Linear of the GPT with its weight as a quantized
parameter of the recipe's weight format (Float8Tensor for current/delayed scaling, MXFP8Tensor,
Float8BlockwiseQTensor) and keeps the initial values on the CPU; the fp32 master copies start from
those. Each step: DDP averages the gradients, AdamW updates the masters (and the high-precision
parameters: embeddings, norms, biases), and ``cast_master_weights_to_fp8`` writes the new bytes and
scales into the model's weights, which the compiled graph uses as its GEMM operands as they are.
Every rank holds whole master weights here, so no amax reduction is needed; with ZeRO-sharded
masters pass ``start_offsets`` and ``amax_reduce_group`` (tests/test_primary_weights.py has a ZeRO-1
optimizer doing that, bitwise equal to on-the-fly quantization). Runs on CPU (gloo) and CUDA (nccl).
"""

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import te_compile
from te_compile.models import gpt_small
from te_compile.tensor import QuantizedTensor
from te_compile.tensor.utils import cast_master_weights_to_fp8

from _common import finish, setup

STEPS = 10
RECIPES = ("Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling", "Float8BlockScaling")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--recipe", choices=RECIPES, default="Float8CurrentScaling")
args = parser.parse_args()

rank, world, device = setup()
recipe = getattr(te_compile.recipe, args.recipe)()

torch.manual_seed(0)                                       # the same initial weights on every rank
with torch.device(device), te_compile.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
    model = gpt_small()
weights = [p for p in model.parameters() if isinstance(p, QuantizedTensor)]
others = [p for p in model.parameters() if not isinstance(p, QuantizedTensor)]
masters = [w.get_high_precision_init_val().to(device, torch.float32).requires_grad_() for w in weights]
opt = torch.optim.AdamW(others + masters, lr=1e-3)

# DDP's initial broadcast would flatten each parameter to 1-D, which block-scaled weights cannot do
# as a view; every rank built the same model from the same seed, so skip it.
compiled = torch.compile(DDP(model, init_sync=False), backend="te", options={"recipe": args.recipe})

if rank == 0:
    # every buffer of a quantized weight (bytes, scales) is one of its flattened inner tensors
    fp8_bytes = sum(getattr(w, name).numel() * getattr(w, name).element_size()
                    for w in weights for name in w.__tensor_flatten__()[0])
    fp32_bytes = sum(4 * w.numel() for w in weights)
    print(f"{len(weights)} linear weights held as {type(weights[0]).__name__}: {fp8_bytes / 2**20:.3f} MiB "
          f"(bytes and scales) instead of {fp32_bytes / 2**20:.3f} MiB in fp32")

from te_compile.data import get_batch  # noqa: E402  (after setup: reads the corpus once per rank)

gen = torch.Generator().manual_seed(1000 + rank)            # each rank its own data
for step in range(1, STEPS + 1):
    x, y = (t.to(device) for t in get_batch("train", 8, model.block_size, gen))
    _, loss = compiled(x, y)
    loss.backward()
    with torch.no_grad():
        for weight, master in zip(weights, masters):
            master.grad = weight.grad.to(torch.float32)
            weight.grad = None
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        cast_master_weights_to_fp8(weights, [m.detach() for m in masters])
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    if rank == 0:
        print(f"step {step:3d}  loss {mean.item() / world:.4f} (mean over {world} ranks)", flush=True)

finish(model, rank)
