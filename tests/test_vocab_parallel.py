"""Vocab-parallel output layer and loss (ColwiseParallel output layer, loss_parallel): the fused FP8
linear + cross-entropy on each rank's vocab shard, reducing per-token values and never the logits.

The multi-process tests share one world of 2 gloo ranks (``utils.run_ranks``), compiled with
aot_eager so that a compile costs seconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from utils import RankPatch, full_tensor, needs_gloo, recipe_state, run_ranks, sqnr

pytestmark = needs_gloo

WORLD = 2


# ---------------------------------------------------------------------------------------------
# Vocab-parallel output layer and loss (ColwiseParallel output layer, loss_parallel)


class TinyLM(nn.Module):
    """torchtitan's output stage: embedding, RMSNorm, output linear, with the loss in the compiled step.
    ``shift``: the causal shift inside the loss; ``logits``: the logits are returned too."""

    def __init__(self, vocab: int, bias: bool = False, smoothing: float = 0.0, shift: bool = True,
                 logits: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, 32)
        self.norm = nn.RMSNorm(32)
        self.output = nn.Linear(32, vocab, bias=bias)
        self.smoothing, self.shift, self.logits = smoothing, shift, logits

    def forward(self, ids, labels):
        logits = self.output(self.norm(self.tok(ids)))
        z, y = (logits[:, :-1], labels[:, 1:]) if self.shift else (logits, labels)
        loss = F.cross_entropy(z.flatten(0, 1).float(), y.flatten(0, 1), label_smoothing=self.smoothing)
        return (loss, logits) if self.logits else loss


# name: (recipe, vocab, TinyLM arguments, torchtitan's sequence-parallel plan); 101 classes split 51 / 50
VOCAB_CASES = {
    "hp": ("none", 101, dict(bias=True, shift=False, logits=True), False),
    "current": ("Float8CurrentScaling", 128, dict(), True),
    "delayed": ("DelayedScaling", 128, dict(bias=True), False),
}
_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def _collectives(gm) -> list[tuple[str, str, int]]:
    """(op, reduce op or "", elements) of each collective node of an AOT graph."""
    out = []
    for n in gm.graph.nodes:
        name = getattr(n.target, "_opname", "")
        if n.op == "call_function" and "_c10d_functional" in str(n.target) and name in _COLLECTIVES:
            out.append((name, n.args[1] if name == "all_reduce" else "", n.meta["val"].numel()))
    return out


def _vocab_worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel,
                                                   parallelize_module)

    from utils import AotGraphs

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    graphs = AotGraphs().install(RankPatch())
    out = {}
    for name, (recipe, vocab, kwargs, sp) in VOCAB_CASES.items():
        torch._dynamo.reset()
        te_compile.reset()
        graphs.forward.clear()
        graphs.backward.clear()
        torch.manual_seed(3)
        base = TinyLM(vocab, **kwargs)
        ref_model = TinyLM(vocab, **kwargs)
        ref_model.load_state_dict(base.state_dict())
        plan = {"output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        if sp:   # torchtitan's: the embedding's output and the norm split by sequence, gathered for the output
            plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                    "norm": SequenceParallel(),
                    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
        parallelize_module(base, mesh, plan)
        options = {"recipe": recipe, "compiler": "aot_eager",
                   **({"amax_history_len": 4} if recipe == "DelayedScaling" else {})}
        tp, ref = (torch.compile(m, backend="te", options=options) for m in (base, ref_model))
        steps = []
        for step in range(2):
            g = torch.Generator().manual_seed(20 + step)
            ids, labels = torch.randint(0, vocab, (2, 8), generator=g), torch.randint(0, vocab, (2, 8), generator=g)
            labels[0, 2:4] = -100
            with loss_parallel():
                res = tp(ids, labels)
                loss = res[0] if kwargs.get("logits") else res
                loss.backward()
            if step == 0:
                sites = [(s.op, s.rewritten, s.reason, s.collectives) for s in te_compile.report().sites
                         if s.op == "linear_cross_entropy"]
            ref_res = ref(ids, labels)
            ref_loss = ref_res[0] if kwargs.get("logits") else ref_res
            ref_loss.backward()
            steps.append(dict(loss=loss.full_tensor().detach(), ref_loss=ref_loss.detach(),
                              logits=res[1].full_tensor().detach() if kwargs.get("logits") else None,
                              ref_logits=ref_res[1].detach() if kwargs.get("logits") else None,
                              loss_type=type(loss).__name__))
        params = dict(ref_model.named_parameters())
        grads = {n: (full_tensor(p.grad), params[n].grad) for n, p in base.named_parameters()}
        out[name] = dict(steps=steps, grads=grads, sites=sites, vocab=vocab,
                         forward=[_collectives(g) for g in graphs.forward],
                         backward=[_collectives(g) for g in graphs.backward],
                         state=recipe_state(base) if recipe == "DelayedScaling" else {},
                         ref_state=recipe_state(ref_model) if recipe == "DelayedScaling" else {})
    # loss_parallel refuses label smoothing at trace time, so the eager lowering covers it (and a
    # soft-cap): one process's op on the whole weight against the two ranks' on its shards
    from torch.distributed.tensor import DTensor

    from te_compile.lowerings.linear_cross_entropy import LinearCrossEntropyLowering, LinearCrossEntropySpec
    from te_compile.recipe import Float8CurrentScaling

    spec = LinearCrossEntropySpec("output", Float8CurrentScaling(), (("cast", torch.float32), ("softcap", 3.0)),
                                  label_smoothing=0.1, chunk=8)
    op = LinearCrossEntropyLowering(spec)
    torch.manual_seed(4)
    x, w, labels = torch.randn(16, 32), torch.randn(64, 32), torch.randint(0, 64, (16,))
    labels[3] = -100
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref_loss = op(xs, ws, None, labels)[0]
    ref_loss.backward()
    xd = DTensor.from_local(x.clone(), mesh, [Replicate()]).requires_grad_()
    wd = nn.Parameter(DTensor.from_local(w.chunk(WORLD, 0)[rank].clone(), mesh, [Shard(0)]))
    loss = op(xd, wd, None, labels)[0]
    loss.backward()
    out["eager"] = dict(loss=loss.full_tensor().detach(), ref_loss=ref_loss.detach(),
                        grads=[(full_tensor(xd.grad), xs.grad), (full_tensor(wd.grad), ws.grad)])
    return out


@pytest.fixture(scope="module")
def vocab_results(tmp_path_factory):
    """One spawned world for every multi-process case of this file (a spawn costs seconds of imports
    per rank)."""
    return run_ranks(_vocab_worker, tmp_path_factory.mktemp("vocab_parallel"))


def test_vocab_parallel_loss_is_fused(vocab_results):
    for rank, r in enumerate(vocab_results):
        for name, res in ((k, v) for k, v in r.items() if k in VOCAB_CASES):
            [(op, rewritten, reason, collectives)] = res["sites"]
            assert rewritten, (name, reason)
            full = -(-res["vocab"] // WORLD)   # 101 classes: 51 on rank 0, 50 on rank 1
            assert f"[tokens, {min(full, res['vocab'] - rank * full)}] logits per rank" in reason, reason
            assert "all-reduce over tp (2 ranks): per token max (MAX), sum-exp and target logit (SUM)" in collectives
            assert ("weight amax" in collectives) == (name == "current"), collectives


@pytest.mark.parametrize("name", list(VOCAB_CASES))
def test_vocab_parallel_matches_one_process(vocab_results, name):
    """Loss, logits and gradients of the 2-rank vocab-parallel step against one process's fused op."""
    for r in vocab_results:
        res = r[name]
        for step in res["steps"]:
            assert step["loss_type"] == "DTensor"   # loss_parallel's Replicate loss, as unfused
            torch.testing.assert_close(step["loss"], step["ref_loss"], rtol=1e-5, atol=0)
            if step["logits"] is not None:
                torch.testing.assert_close(step["logits"], step["ref_logits"], rtol=1e-5, atol=1e-6)
        for param, (g, g_ref) in res["grads"].items():
            # fp32 summation order only (FP8: the same bytes and scales on the shards as in one process)
            assert sqnr(g_ref, g) >= 60, (name, param, sqnr(g_ref, g))
        for key, value in res["ref_state"].items():
            torch.testing.assert_close(res["state"][key], value, rtol=1e-6, atol=0, msg=lambda m: f"{key}: {m}")


def test_vocab_parallel_label_smoothing_and_softcap(vocab_results):
    for r in vocab_results:
        res = r["eager"]
        torch.testing.assert_close(res["loss"], res["ref_loss"], rtol=1e-5, atol=0)
        for g, g_ref in res["grads"]:
            assert sqnr(g_ref, g) >= 60, sqnr(g_ref, g)


def test_vocab_parallel_never_communicates_logits(vocab_results):
    """Forward: one MAX and one SUM all-reduce of per-token values (one chunk here), and current
    scaling's weight amax or DelayedScaling's amax update (its 3 amaxes, the logits gradient's
    among them, are all known in the forward, which computes that gradient, so the partitioner runs
    the reduction there); backward: only x's partial gradient [tokens, hidden], summed by DTensor.
    Nothing as large as a rank's [tokens, V / 2] logits crosses ranks either way."""
    for r in vocab_results:
        for name, res in ((k, v) for k, v in r.items() if k in VOCAB_CASES):
            tokens = 16 if name == "hp" else 14
            local_logits = tokens * -(-res["vocab"] // WORLD)
            forward, backward = res["forward"][0], res["backward"][0]   # the 2-rank model's (compiled first)
            sums = [c for c in forward if c[1] == "sum"]
            maxes = [c for c in forward if c[1] == "max"]
            # sequence parallel: the embedding's reduce-scatter and the norm output's all-gather, [tokens, hidden]
            others = sorted(c[0] for c in forward if c[0] != "all_reduce")
            sp = VOCAB_CASES[name][3]
            assert others == (["all_gather_into_tensor", "reduce_scatter_tensor"] if sp else []), forward
            assert len(sums) == 1 and sums[0][2] == 2 * tokens, forward
            amaxes = {"current": [1], "delayed": [3]}.get(name, [])
            assert sorted(c[2] for c in maxes) == sorted([*amaxes, tokens]), forward
            for op, _, numel in [*forward, *backward]:
                assert numel < local_logits, (name, op, numel, local_logits)
