"""What both torchrun examples share: process group setup, the training loop, and the report and
per-rank recipe-state check at the end."""

import os
import sys

import torch
import torch.distributed as dist

import te_compile


def setup() -> tuple[int, int, torch.device]:
    """(rank, world size, device) under torchrun: nccl on CUDA (a GPU per rank), gloo on CPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        dist.init_process_group("gloo")
    return rank, world, device


def train(compiled, model: torch.nn.Module, device: torch.device, gen: torch.Generator, rank: int, steps: int,
          *, mean_over_ranks: bool, masters=None) -> None:
    """``steps`` AdamW steps of the compiled GPT on batches from ``gen``; rank 0 prints each step's
    loss, averaged over the ranks when they train on different data (``mean_over_ranks``).
    ``masters``: fp32 master weights of FP8 primary weights (``params``, ``take_grads()`` before the
    step, ``cast()`` after it); AdamW updates those instead of the FP8 weights."""
    from te_compile.data import get_batch

    params = list(model.parameters()) if masters is None else masters.params
    opt = torch.optim.AdamW(params, lr=1e-3)
    world = dist.get_world_size()
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in get_batch("train", 8, model.block_size, gen))
        _, loss = compiled(x, y)
        loss.backward()
        if masters is not None:
            masters.take_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters is not None:
            masters.cast()
        if mean_over_ranks:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            text = f"loss {mean.item() / world:.4f} (mean over {world} ranks)"
        else:
            text = f"loss {loss.item():.4f}"
        if rank == 0:
            print(f"step {step:3d}  {text}", flush=True)


def check_state_identical(model: torch.nn.Module, rank: int) -> bool:
    """Compare every recipe-state tensor (delayed scaling's scales and amax histories) across ranks;
    rank 0 prints the result. True when all ranks hold the same values."""
    state = {k: v.cpu() for k, v in te_compile.recipe_state_dict(model).items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state)
    differ = sorted(k for k in state if any(not torch.equal(other[k], state[k]) for other in gathered))
    if rank == 0:
        if not state:
            print("scale check: this recipe keeps no state across steps (current or block scaling)")
        elif differ:
            print(f"scale check: {len(differ)} of {len(state)} state tensors differ between ranks, "
                  f"e.g. {differ[:3]}")
        else:
            print(f"scale check: all {len(state)} state tensors identical on {len(gathered)} ranks")
    return not differ


def finish(model: torch.nn.Module, rank: int) -> None:
    """Print the report (rank 0), check the state across ranks, and exit non-zero if it differs."""
    if rank == 0:
        print(te_compile.report())
    ok = check_state_identical(model, rank)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


class _AllGathers:
    """What this rank hands to FSDP2's all-gathers (``dist.all_gather_single``), in bytes and in
    elements, so that FP8 (1 byte) can be set against high precision (4 bytes in fp32)."""

    def __init__(self) -> None:
        self.bytes, self.elements = 0, 0
        self.real = dist.all_gather_single
        dist.all_gather_single = self._count

    def _count(self, output, input, *args, **kwargs):
        self.bytes += input.numel() * input.element_size()
        self.elements += input.numel()
        return self.real(output, input, *args, **kwargs)

    def print(self, steps: int, world: int) -> None:
        fp32 = 4 * self.elements
        print(f"all-gather: {self.bytes / steps / 2**20:.3f} MiB per step from each of {world} ranks; the same "
              f"shards in fp32 would be {fp32 / steps / 2**20:.3f} MiB ({self.bytes / fp32:.2f}x)")


def count_all_gathers() -> _AllGathers:
    return _AllGathers()


def gather_in_fp8(model: torch.nn.Module, rank: int, options: dict) -> dict:
    """``te_compile.enable_fp8_all_gather(model, **options)``; rank 0 prints how many linears gather in
    FP8 and why the others do not. Returns what it did per weight."""
    outcome = te_compile.enable_fp8_all_gather(model, **options)
    if rank == 0:
        fp8 = [fqn for fqn, what in outcome.items() if what.startswith("FP8 all-gather")]
        print(f"FP8 all-gather: {len(fp8)} of {len(outcome)} weights; " + "; ".join(
            f"{fqn}: {what}" for fqn, what in outcome.items() if fqn not in fp8), flush=True)
    return outcome


def print_amax_groups() -> None:
    """The report's collectives column, tallied: how many sites reduce their amaxes over which group."""
    tally: dict[str, int] = {}
    for site in te_compile.report().sites:
        if site.rewritten and site.op in ("linear", "grouped_linear", "sdpa"):
            key = site.collectives or "none (each rank scales its own data)"
            tally[key] = tally.get(key, 0) + 1
    print("amax reductions in the compiled graphs:")
    for what, sites in sorted(tally.items()):
        print(f"  {sites:3d} sites: {what}")
