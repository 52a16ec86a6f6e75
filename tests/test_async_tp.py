"""Async tensor parallelism: te's sequence-parallel FP8 linears in the form inductor's micro-pipeline TP
pass fuses, checked on the graph.

One process plays rank 0 of 2 over torch's fake process group (collectives return without moving
data), so the graphs are those of a real TP world; the pass's test mode stands in for symmetric
memory, and the fused ops run through torch's own fallbacks (registered here for the CPU: their
kernels are CUDA's). The numbers on real collectives are test_tensor_parallel.py's (gloo, 2 ranks).
"""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import te_compile
from models import TitanBlock, titan_tp_plan

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

GATHER_MM, MM_SCATTER = "fused_all_gather_scaled_matmul", "fused_scaled_matmul_reduce_scatter"


@pytest.fixture(scope="module")
def tp_mesh():
    """Rank 0 of a fake 2-rank world, its mesh, the fused ops runnable on the CPU, no AOTAutograd cache
    (a cached graph would skip the pass this file watches)."""
    from torch.distributed._symmetric_memory import (_fused_all_gather_scaled_matmul_fallback,
                                                     _fused_scaled_matmul_reduce_scatter_fallback)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    lib = torch.library.Library("symm_mem", "IMPL")
    lib.impl("fused_all_gather_scaled_matmul", _fused_all_gather_scaled_matmul_fallback, "CPU")
    lib.impl("fused_scaled_matmul_reduce_scatter", _fused_scaled_matmul_reduce_scatter_fallback, "CPU")
    # torch's config modules are patched with their own patch(): pytest's monkeypatch finds no instance
    # attribute to restore on them and deletes the key on undo, which hides it from every later test
    with pytest.MonkeyPatch.context() as patch, torch._functorch.config.patch(enable_autograd_cache=False):
        patch.setattr(dist, "is_nccl_available", lambda: True)   # the pass's first check; symm_mem's own is _test_mode
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    lib._destroy()
    dist.destroy_process_group()


def _run(mesh, options, symmetric_memory=True, backward=True, dim=32):
    """Compile a torchtitan-planned TitanBlock with te, run it (and its backward); the fused ops of
    each graph the pass saw, the graphs, and the linears' report rows."""
    from torch.distributed._symmetric_memory import _test_mode
    from torch.distributed.tensor.parallel import parallelize_module

    torch._dynamo.reset()
    te_compile.reset()
    torch.manual_seed(0)
    model = parallelize_module(TitanBlock(dim, 4, 2 * dim), mesh, titan_tp_plan())
    backend = importlib.import_module("te_compile.backend")   # te_compile.backend is a function
    seen, real = [], backend.micro_pipeline_tp

    def recording(gm):
        fused = real(gm)
        seen.append((fused, gm))
        return fused

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "micro_pipeline_tp", recording)
        compiled = torch.compile(model, backend="te", options={"compiler": "aot_eager", **options})
        x = torch.randn(2, 4, dim, requires_grad=backward)   # this rank's half of 8 positions
        with _test_mode() if symmetric_memory else torch.enable_grad():
            y = compiled(x)
            if backward:
                y.sum().backward()
    rows = [r for r in te_compile.report().sites if r.op == "linear"]
    return [f for f, _ in seen], [g for _, g in seen], rows


def _fused_inputs(gm, op: str) -> list[torch.dtype]:
    """The dtype of the tensor each ``op`` call gathers (fused_all_gather_*: its first argument, behind
    the restride the pass may put in front)."""
    dtypes = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "_opname", None) == op:
            shard = n.args[0]
            while "val" not in shard.meta:
                shard = shard.args[0]
            dtypes.append(shard.meta["val"].dtype)
    return dtypes


def test_every_tp_linear_of_a_block_fuses_with_its_collective(tp_mesh):
    """torchtitan's plan: wq, wk, wv and w1, w3 column-parallel on the two sequence-sharded norm outputs,
    wo and w2 row-parallel into Shard(1). Forward: one all-gather per norm output, fused with all the
    GEMMs reading it (3 and 2), each row-parallel GEMM fused with its reduce-scatter. Backward: each
    row-parallel site's gathered gradient fused into its dgrad; the column-parallel sites' dgrads are
    summed, then reduce-scattered once per norm output (a sum between GEMM and collective: not fused).
    What is gathered is FP8: E4M3 forward, E5M2 backward (HYBRID)."""
    fused, graphs, rows = _run(tp_mesh, {"recipe": "Float8CurrentScaling", "distributed": {"async_tp": True}})
    forward, backward = fused
    assert forward == Counter({GATHER_MM: 2, MM_SCATTER: 2}), forward
    assert sorted(len(n.args[1]) for n in graphs[0].graph.nodes if getattr(n.target, "_opname", None) == GATHER_MM) \
        == [2, 3]   # the weights each gather feeds
    assert backward == Counter({GATHER_MM: 2}), backward
    assert sum(n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default for n in graphs[1].graph.nodes) == 2
    assert _fused_inputs(graphs[0], GATHER_MM) == [torch.float8_e4m3fn] * 2
    assert _fused_inputs(graphs[1], GATHER_MM) == [torch.float8_e5m2] * 2
    kinds = {r.fqn.rsplit(".", 1)[-1]: r.reason for r in rows}
    assert len(kinds) == 7 and all(r.rewritten for r in rows)
    for name in ("wq", "wk", "wv", "w1", "w3"):
        assert "async TP: FP8 all-gather of x along dim 1 into _scaled_mm" in kinds[name], kinds[name]
    for name in ("wo", "w2"):
        assert "async TP: _scaled_mm into a reduce-scatter along dim 1" in kinds[name], kinds[name]
    assert all("all-gather over tp (2 ranks)" in r.collectives for r in rows)


def test_inductor_flag_set_by_the_user_means_async_tp(tp_mesh):
    import torch._inductor.config as inductor_config

    with inductor_config.patch(_micro_pipeline_tp=True):
        fused, _, rows = _run(tp_mesh, {"recipe": "Float8CurrentScaling"}, backward=False)
    assert fused == [Counter({GATHER_MM: 2, MM_SCATTER: 2})]
    assert all("async TP:" in r.reason for r in rows)


def test_without_symmetric_memory_the_collectives_stay_apart(tp_mesh):
    """A group without symmetric memory: the pass leaves the graph as it is, and the FP8 collectives
    run before and after the GEMMs."""
    fused, graphs, _ = _run(tp_mesh, {"recipe": "Float8CurrentScaling", "distributed": {"async_tp": True}},
                            symmetric_memory=False, backward=False)
    assert fused == [Counter()]
    gathers = [n for n in graphs[0].graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    assert [n.args[0].meta["val"].dtype for n in gathers] == [torch.float8_e4m3fn] * 2


def test_delayed_scaling_sites_gather_apart(tp_mesh):
    """DelayedScaling quantizes x with each site's own input scale, so wq, wk, wv gather their own
    bytes: 5 fused gathers forward, and each column site's dgrad fused with its reduce-scatter."""
    fused, _, rows = _run(tp_mesh, {"recipe": "DelayedScaling", "distributed": {"async_tp": True}})
    assert fused == [Counter({GATHER_MM: 5, MM_SCATTER: 2}), Counter({MM_SCATTER: 5, GATHER_MM: 2})], fused
    assert len(rows) == 7 and all("async TP:" in r.reason for r in rows)
    assert all(r.collectives.startswith("amax history all-reduce over tp (2 ranks)") for r in rows), rows[0].collectives


def test_block_scaled_sites_say_why_not(tp_mesh):
    # MXFP8 scales blocks of 32 along N and K: each rank's shards of a 64-wide block are whole blocks
    fused, _, rows = _run(tp_mesh, {"recipe": "MXFP8BlockScaling", "distributed": {"async_tp": True}},
                          backward=False, dim=64)
    assert fused == [Counter()]
    words = "async TP not applied: block-scaled recipes scale per block"
    assert len(rows) == 7 and all(words in r.reason for r in rows), [r.reason for r in rows]



@pytest.mark.parametrize("input_layout, words", [
    (2, "async TP not applied: a last-dim gather (the pass fuses other dims only)"),
    (None, "async TP not applied: the input is not sequence-sharded on the TP dim")])
def test_column_sites_without_a_sequence_gather_say_why_not(tp_mesh, input_layout, words):
    """A column-parallel linear whose input arrives split along its last dim (gathered on that dim), or
    replicated (plain tensor parallelism, nothing to gather): DTensor's collectives stay, with the
    reason in the report."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch._dynamo.reset()
    te_compile.reset()
    layout = Replicate() if input_layout is None else Shard(input_layout)
    model = parallelize_module(torch.nn.Sequential(torch.nn.Linear(32, 64)), tp_mesh,
                               {"0": ColwiseParallel(input_layouts=layout)})
    compiled = torch.compile(model, backend="te", options={"compiler": "aot_eager", "recipe": "Float8CurrentScaling",
                                                           "distributed": {"async_tp": True}})
    compiled(torch.randn(2, 8, 16 if input_layout == 2 else 32))   # this rank's part of x
    [row] = [r for r in te_compile.report().sites if r.op == "linear"]
    assert row.rewritten and words in row.reason, row.reason
