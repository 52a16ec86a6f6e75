"""Dropout under tensor parallelism: te's compiled model draws the same dropout masks as torch's
compiled model (DTensor's own random-op handling) and leaves the generator where torch leaves it; a
replicated tensor drops the same elements on every rank; a checkpointed region recomputes its masks.

One world of 2 gloo ranks (``utils.run_ranks``); every model is compiled with aot_eager as the final
compiler, so te and torch differ only in te's rewrites. On a CPU mesh torch keeps no DTensor RNG tracker
(``OffsetBasedRNGTracker`` refuses CPU devices), so each rank draws its local shard's mask from its own
default generator: the assertions below pin that behaviour and that te follows it exactly.
Checkpointing is checked in one process: torch's own aot_eager compile of a checkpointed region over
DTensors fails (a DeviceMesh among the tensors saved for backward), with or without te.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from utils import full_tensor, needs_gloo, run_ranks

pytestmark = needs_gloo

WORLD = 2
P = 0.25   # dropout probability of both the attention and the residual dropout


class DropoutBlock(nn.Module):
    """One pre-norm-free transformer block with nanoGPT's two dropouts: on the attention probabilities
    [B, H, T, T] (sharded by heads under the plan below) and on the residual branch [B, T, d] (replicated
    after the row-parallel projections). ``checkpoint``: the whole block runs under
    torch.utils.checkpoint. Returns the block output and both dropout outputs, whose zeros are the masks."""

    def __init__(self, d: int = 16, heads: int = 2, hidden: int = 32, checkpoint: bool = False) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.checkpoint = checkpoint

    def forward(self, x):   # x [B, T, d]
        b, t, _ = x.shape
        # local heads from the projections' width, so the column-parallel shards need no change
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        att = (q @ k.transpose(-2, -1) * self.head_dim ** -0.5).masked_fill(~causal, float("-inf"))
        att = F.dropout(att.softmax(-1) + 1e-3, P, self.training)   # [B, H, T, T]; +1e-3: no zero but a drop
        y = (att @ v).transpose(1, 2).reshape(b, t, -1)
        resid = F.dropout(self.wo(y), P, self.training)              # [B, T, d]
        h = x + resid
        if self.checkpoint:
            return h + torch.utils.checkpoint.checkpoint(self._mlp, h, use_reentrant=False), att, resid
        return h + self._mlp(h), att, resid

    def _mlp(self, h):   # h [B, T, d] -> [B, T, d], replicated
        return F.dropout(self.w2(torch.tanh(self.w1(h))), P, self.training)


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
            "wo": RowwiseParallel(), "w1": ColwiseParallel(), "w2": RowwiseParallel()}


# (name, backend, tensor parallel, checkpoint)
CASES = [("torch", "aot_eager", True, False), ("te-none", "te-none", True, False), ("te-fp8", "te", True, False),
         ("torch-1p", "aot_eager", False, False), ("torch-1p-ckpt", "aot_eager", False, True),
         ("te-fp8-1p", "te", False, False), ("te-fp8-1p-ckpt", "te", False, True)]


def _step(model, x) -> dict:
    """One seeded forward and backward: outputs, gradients and the generator state it left."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(123)   # every rank alike, as torch asks of DTensor random ops
    out, att, resid = model(x)
    out.sum().backward()
    grads = {n: full_tensor(p.grad) for n, p in model.named_parameters()}
    return {"out": full_tensor(out).detach(), "resid": full_tensor(resid).detach(),
            "att_local": (att.to_local() if isinstance(att, DTensor) else att).detach(),
            "att": full_tensor(att).detach(), "grads": grads, "x_grad": x.grad.clone(),
            "rng": torch.get_rng_state()}


def _worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    state = DropoutBlock().state_dict()
    x = torch.randn(1, 8, 16)
    out = {}
    for name, backend, tp, ckpt in CASES:
        torch._dynamo.reset()
        te_compile.reset()
        model = DropoutBlock(checkpoint=ckpt)
        model.load_state_dict(state)
        if tp:
            model = parallelize_module(model, mesh, tp_plan())
        if backend == "te-none":
            backend = te_compile.backend(recipe="none", compiler="aot_eager")
        elif backend == "te":
            backend = te_compile.backend(compiler="aot_eager")   # default config: Float8CurrentScaling
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        xi = x.clone().requires_grad_()
        out[name] = _step(compiled, xi)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("tp_dropout"))


def _mask(t: torch.Tensor) -> torch.Tensor:
    """Where dropout dropped: its inputs here are never 0 (softmax + 1e-3, linear outputs)."""
    return t == 0


def _assert_same(a: dict, b: dict, keys, msg: str) -> None:
    for k in keys:
        if k == "grads":
            for n in a[k]:
                assert torch.equal(a[k][n], b[k][n]), f"{msg}: grad of {n} differs"
        else:
            assert torch.equal(a[k], b[k]), f"{msg}: {k} differs"


def test_te_draws_torch_masks_under_tp(ranks):
    for rank, r in enumerate(ranks):
        # high precision: te's graph is torch's, bit for bit, outputs and gradients included
        _assert_same(r["te-none"], r["torch"], ("out", "resid", "att", "grads", "x_grad", "rng"), f"rank {rank} none")
        # FP8 changes the values, not which elements drop, nor how far the generator advanced
        for k in ("att", "resid"):
            assert torch.equal(_mask(r["te-fp8"][k]), _mask(r["torch"][k])), f"rank {rank}: {k} mask differs"
        assert not torch.equal(r["te-fp8"]["out"], r["torch"]["out"])   # FP8 did run
        assert torch.equal(r["te-fp8"]["rng"], r["torch"]["rng"]), f"rank {rank}: te drew other random numbers"
        assert 0 < _mask(r["te-fp8"]["resid"]).float().mean() < 0.6


def test_replicated_mask_is_the_same_on_every_rank(ranks):
    # resid [B, T, d] is Replicate() after the row-parallel wo: both ranks drop the same elements
    for name in ("torch", "te-none", "te-fp8"):
        assert torch.equal(ranks[0][name]["resid"], ranks[1][name]["resid"]), name


def test_sharded_masks_on_a_cpu_mesh(ranks):
    """Torch's CPU behaviour, which te keeps: no DTensor RNG tracker on a CPU mesh, so each rank draws
    its local [B, H/2, T, T] attention mask from the start of its own generator. Both ranks' shards get
    the same mask, one process's first heads' mask; the generator then stands elsewhere than one
    process's, so the replicated residual mask differs from one process's. (On CUDA, torch's
    OffsetBasedRNGTracker gives each shard its own offset instead.)"""
    heads = ranks[0]["torch-1p"]["att"].shape[1] // WORLD
    for name in ("torch", "te-fp8"):
        local = [_mask(r[name]["att_local"]) for r in ranks]
        assert torch.equal(local[0], local[1]), name
        assert torch.equal(local[0], _mask(ranks[0]["torch-1p"]["att"])[:, :heads]), name
        assert not torch.equal(_mask(ranks[0][name]["resid"]), _mask(ranks[0]["torch-1p"]["resid"])), name


def test_checkpoint_recomputes_the_masks(ranks):
    for r in ranks:
        # recomputed (or saved) masks: the checkpointed step equals the plain one bit for bit
        _assert_same(r["torch-1p-ckpt"], r["torch-1p"], ("out", "resid", "att", "grads", "x_grad", "rng"), "torch")
        _assert_same(r["te-fp8-1p-ckpt"], r["te-fp8-1p"], ("out", "resid", "att", "grads", "x_grad", "rng"), "te")
        for k in ("att", "resid"):
            assert torch.equal(_mask(r["te-fp8-1p-ckpt"][k]), _mask(r["torch-1p-ckpt"][k])), k
