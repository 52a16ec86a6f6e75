"""Training under ``cache_fp8_weights``: each weight quantized once per optimizer step and its FP8
copy reused by every gradient-accumulation micro-batch, with the bits of quantizing it at every call.

Against the same model compiled without the key: losses and gradients bit for bit over two optimizer
steps of three micro-batches each, under bf16 autocast over fp32 weights (aot_eager; inductor with
``emulate_precision_casts``, without which inductor's fused kernels skip the bf16 rounding of the
weight and the in-graph quantization differs from the eager one in the last bits) and with bf16
weights, where the norms and activations fuse into the linears that read the cached copies.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import te_compile
from models import GroupedSwiGLU, TinyGPT
from utils import needs_gloo, run_ranks


class CheckpointedGPT(TinyGPT):
    """TinyGPT with each block under activation checkpointing (the blocks' graphs are HOP bodies)."""

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Conv1DMLP(nn.Module):
    """A linear, then a weight stored [K, N] and read as ``x @ W`` (GPT-2's Conv1D): cached [N, K]."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.proj = nn.Parameter(torch.randn(64, 16) / 8)

    def forward(self, x, targets):
        return F.mse_loss(F.gelu(self.up(x)) @ self.proj, targets)


class ExpertMLP(GroupedSwiGLU):
    """GroupedSwiGLU and a loss."""

    def forward(self, x, targets):
        return F.mse_loss(super().forward(x).float(), targets)


def _batches(model, steps, micro_batches):
    g = torch.Generator().manual_seed(1)
    if isinstance(model, TinyGPT):
        return [[(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))
                 for _ in range(micro_batches)] for _ in range(steps)]
    return [[(torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g))
             for _ in range(micro_batches)] for _ in range(steps)]


def _train(model, batches, recipe, compiler, autocast, **options):
    """Losses and, per step, the accumulated gradients, training with AdamW under bf16 autocast (else
    with the model's own dtype)."""
    compiled = torch.compile(model, backend="te", options={"recipe": recipe, "compiler": compiler, **options})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    dtype = next(model.parameters()).dtype
    for step in batches:
        for x, y in step:
            x, y = (x, y) if not x.is_floating_point() else (x.to(dtype), y.to(dtype))
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = compiled(x, y) / len(step)
            loss.backward()
            losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def _compare(model_cls, recipe, compiler, quantizations, steps=2, micro_batches=3, weights=torch.float32):
    """Train a copy of one model without and one with the key (bf16 autocast over fp32 weights, or bf16
    weights without autocast); losses and gradients bit for bit; the second run's report rows."""
    torch.manual_seed(0)
    base = model_cls().to(weights)
    batches = _batches(base, steps, micro_batches)
    autocast = weights == torch.float32
    torch._dynamo.reset()
    te_compile.reset()
    ref = _train(copy.deepcopy(base), batches, recipe, compiler, autocast)
    assert quantizations == []
    torch._dynamo.reset()
    te_compile.reset()
    got = _train(copy.deepcopy(base), batches, recipe, compiler, autocast, cache_fp8_weights=True)
    for a, b in zip(ref[0], got[0]):
        assert torch.equal(a, b), (a, b)
    for ref_step, got_step in zip(ref[1], got[1]):
        for name, g in ref_step.items():
            assert torch.equal(g, got_step[name]), name
    return te_compile.report().sites


@pytest.mark.parametrize("compiler, weights", [("aot_eager", torch.float32), ("inductor", torch.float32),
                                               ("aot_eager", torch.bfloat16)])
def test_micro_batches_reuse_each_weight_quantized_once_per_step(compiler, weights, quantizations):
    with torch._inductor.config.patch(emulate_precision_casts=True):
        sites = _compare(TinyGPT, "Float8CurrentScaling", compiler, quantizations, weights=weights)
    weights = [(96, 32), (32, 32), (128, 32), (32, 128)] * 2 + [(64, 32)]   # qkv, proj, fc, proj; lm_head
    # 9 weights, quantized at the first micro-batch of each of the two steps (6 micro-batches)
    assert sorted(quantizations) == sorted(weights * 2)
    cached = [r.fqn for r in sites if "reused by every micro-batch" in r.reason]
    assert len(cached) == 9 and "lm_head" in cached, [(r.fqn, r.reason) for r in sites]
    # the norms and GELUs still fuse into the linears that read the cached weights
    assert all(r.rewritten for r in sites if r.op in ("layer_norm", "gelu"))


def test_checkpointed_blocks_and_a_weight_read_as_x_at_w(quantizations):
    _compare(CheckpointedGPT, "Float8CurrentScaling", "aot_eager", quantizations)
    assert len(quantizations) == 9 * 2
    quantizations.clear()
    _compare(Conv1DMLP, "Float8CurrentScaling", "aot_eager", quantizations)
    assert quantizations == [(64, 32), (16, 64)] * 2   # proj quantized as [N, K]


@pytest.mark.parametrize("compiler, weights", [("aot_eager", torch.float32), ("inductor", torch.float32),
                                               ("aot_eager", torch.bfloat16)])
def test_moe_expert_weights_are_quantized_once_per_step(compiler, weights, quantizations):
    # fp32 weights: the copy is made from the model's bf16 cast, and the gradient goes back through it
    with torch._inductor.config.patch(emulate_precision_casts=True):
        sites = _compare(ExpertMLP, "Float8CurrentScaling", compiler, quantizations, weights=weights)
    # w1, w3 as stored ([E, N, K]), w2 transposed to [E, N, K]; once at each of the two steps' first
    # micro-batch
    assert sorted(quantizations) == sorted([(4, 64, 32), (4, 64, 32), (4, 16, 64)] * 2)
    rows = [r for r in sites if r.op == "grouped_linear"]
    assert len(rows) == 3 and all("reused by every micro-batch" in r.reason for r in rows), rows
    # the SwiGLU between the grouped GEMMs still fuses into the second one
    assert [r.rewritten for r in sites if r.op == "swiglu"] == [True]


def test_delayed_scaling_sites_quantize_at_every_call(quantizations):
    sites = _compare(Conv1DMLP, "DelayedScaling", "aot_eager", quantizations)
    assert quantizations == []
    assert not any("reused by every micro-batch" in r.reason for r in sites)


def test_a_backward_after_the_weight_changed_reads_the_bytes_its_forward_read():
    torch.manual_seed(0)
    base = Conv1DMLP()
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    grads = []
    for options in ({}, {"cache_fp8_weights": True}):
        torch._dynamo.reset()
        te_compile.reset()
        model = copy.deepcopy(base)
        compiled = torch.compile(model, backend="te", options={"compiler": "aot_eager", **options})
        first = compiled(x, y)
        with torch.no_grad():
            model.up.weight.add_(1.0)   # a step between a forward and its backward (pipeline schedules)
        compiled(x, y).backward()       # quantizes the new weight
        model.zero_grad()
        first.backward()
        grads.append([p.grad for p in model.parameters()])
    for ref, got in zip(*grads):
        assert torch.equal(ref, got)


def _ddp_accumulation_worker(rank: int) -> dict:
    """Two steps of DDP training over gloo, three micro-batches each (the first two under
    ``no_sync``), without and with the key; DDPOptimizer splits the graph at every linear."""
    import contextlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from utils import DistMLP

    dist._DEFAULT_FIRST_BUCKET_BYTES = 4096
    out = {}
    for options in ({}, {"cache_fp8_weights": True}):
        torch._dynamo.reset()
        te_compile.reset()
        torch.manual_seed(0)
        model = DistMLP()
        ddp = DDP(model, bucket_cap_mb=0.004)
        compiled = torch.compile(ddp, backend="te", options={"compiler": "aot_eager", **options})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for step in range(2):
            for micro in range(3):
                x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
                with ddp.no_sync() if micro < 2 else contextlib.nullcontext():
                    compiled(x).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        out[bool(options)] = (grads, [r.reason for r in te_compile.report().sites if r.op == "linear"])
    return out


@needs_gloo
def test_ddp_accumulation_under_no_sync_gives_the_same_gradients(tmp_path):
    for rank_out in run_ranks(_ddp_accumulation_worker, tmp_path):
        (ref, _), (got, reasons) = rank_out[False], rank_out[True]
        for ref_step, got_step in zip(ref, got):
            for a, b in zip(ref_step, got_step):
                assert torch.equal(a, b)
        assert reasons and all("reused by every micro-batch" in r for r in reasons), reasons


def test_the_key_is_a_bool_read_from_the_file(tmp_path):
    from te_compile.config import ConfigError, load_config

    (tmp_path / "bad.toml").write_text('cache_fp8_weights = "yes"\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: cache_fp8_weights: expected a bool"):
        load_config(tmp_path / "bad.toml")
    (tmp_path / "on.toml").write_text("cache_fp8_weights = true\n")
    assert load_config(tmp_path / "on.toml").cache_fp8_weights is True
    assert te_compile.TeConfig().cache_fp8_weights is False
