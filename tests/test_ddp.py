"""DDP + DelayedScaling: amax histories reduced once per graph and step across data-parallel ranks;
the [distributed] config and its group arithmetic.

The multi-process tests share one world of 2 gloo ranks (``utils.run_ranks``), compiled with
aot_eager so that a compile costs seconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import te_compile
from te_compile.config import ConfigError, DistributedConfig, config_from_dict
from te_compile.distributed import AmaxGroup, minimal_groups
from utils import DistMLP, RankPatch, funcol_all_reduces, max_all_reduces, needs_gloo, recipe_state, run_ranks

pytestmark = needs_gloo

WORLD = 2


# ---------------------------------------------------------------------------------------------
# DDP + DelayedScaling


def _data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + rank)


def _ddp_worker(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from utils import AotGraphs

    graphs = AotGraphs().install(RankPatch())
    options = {"recipe": "DelayedScaling", "amax_history_len": 4, "compiler": "aot_eager"}
    out = {}
    # tiny buckets: DDPOptimizer splits the graph into one piece per linear
    dist._DEFAULT_FIRST_BUCKET_BYTES = 4096
    for group in ("world", "none"):
        torch._dynamo.reset()
        te_compile.reset()
        torch.manual_seed(0)
        model = DistMLP(attn=True)
        ddp = DDP(model, bucket_cap_mb=0.004)
        compiled = torch.compile(ddp, backend="te", options={**options, "amax_group": group,
                                                             "rewrite": {"sdpa": True}})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        runs = 0
        for step in range(3):
            def train_step():
                compiled(_data(rank, step)).pow(2).mean().backward()
            if step == 2:
                runs = funcol_all_reduces(train_step)
            else:
                train_step()
            opt.step()
            opt.zero_grad()
        out[group] = {"state": recipe_state(model), "all_reduces_run": runs,
                      "sites": [(s.graph, s.fqn, s.rewritten, s.collectives) for s in te_compile.report().sites
                                if s.op == "linear"],
                      "sdpa": [(s.rewritten, s.reason, s.collectives) for s in te_compile.report().sites
                               if s.op == "sdpa"]}
    out["forward_all_reduces"] = [max_all_reduces(g) for g in graphs.forward]
    out["backward_all_reduces"] = [max_all_reduces(g) for g in graphs.backward]

    # one process on both ranks' data (mean over the global batch = DDP's averaged gradients)
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref_model = DistMLP()
    ref = torch.compile(ref_model, backend="te", options={**options, "amax_group": "none"})
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref_losses, ddp_losses = [], []
    torch.manual_seed(0)
    model = DistMLP()
    compiled = torch.compile(DDP(model, bucket_cap_mb=0.004), backend="te", options=options)
    ddp_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.cat([_data(r, step) for r in range(WORLD)])
        loss = ref(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
        local = compiled(_data(rank, step)).pow(2).mean()
        local.backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
        mean = local.detach().clone()
        dist.all_reduce(mean)
        ddp_losses.append(mean.item() / WORLD)
    out["ref_losses"], out["ddp_losses"] = ref_losses, ddp_losses
    return out



@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    """One spawned world for every multi-process case of this file (a spawn costs seconds of imports
    per rank)."""
    return run_ranks(_ddp_worker, tmp_path_factory.mktemp("ddp"))


def test_ddp_delayed_scaling_state_identical_on_ranks(ddp_results):
    a, b = ddp_results
    # two linears' state and the attention's (keyed on a parameter of the root module, named "sdpa")
    assert a["world"]["state"].keys() == b["world"]["state"].keys() and len(a["world"]["state"]) == 12 + 8
    assert "sdpa.query.amax_history" in a["world"]["state"]
    differ = [k for k in a["world"]["state"] if not torch.equal(a["world"]["state"][k], b["world"]["state"][k])]
    assert not differ, f"state differs between ranks with amax_group='world': {differ}"
    # the ranks see different data (rank 1's is twice as large): without the reduction they drift
    differ = [k for k in a["none"]["state"] if not torch.equal(a["none"]["state"][k], b["none"]["state"][k])]
    assert any(k.endswith("input.amax_history") for k in differ), differ
    assert "sdpa.query.amax_history" in differ, differ


def test_ddp_one_all_reduce_per_graph_and_step(ddp_results):
    for rank in ddp_results:
        # DDPOptimizer split the model into 2 graphs; each reduces its amaxes once, in backward
        assert [s[0] for s in rank["world"]["sites"]] == [0, 1]
        assert rank["world"]["all_reduces_run"] == 2
        assert rank["none"]["all_reduces_run"] == 0
        assert sum(rank["forward_all_reduces"]) == 0
        # world: 2 graphs with one all_reduce each; none: 2 graphs without
        assert sorted(rank["backward_all_reduces"]) == [0, 0, 1, 1]
        for _, fqn, rewritten, collectives in rank["world"]["sites"]:
            assert rewritten and collectives == ("amax history all-reduce over world (2 ranks), one per "
                                                 "graph and step"), (fqn, collectives)
        assert all(c == "" for *_, c in rank["none"]["sites"])
        # the attention's amaxes ride in the same all-reduce as the linears'
        [(rewritten, reason, collectives)] = rank["world"]["sdpa"]
        assert rewritten and "per tensor with delayed scaling" in reason, reason
        assert collectives == "amax history all-reduce over world (2 ranks), one per graph and step"
        assert rank["none"]["sdpa"][0][2] == ""


def test_ddp_loss_tracks_one_process(ddp_results):
    ref, got = ddp_results[0]["ref_losses"], ddp_results[0]["ddp_losses"]
    assert got == pytest.approx(ref, rel=2e-3), (got, ref)




# ---------------------------------------------------------------------------------------------
# One process: config and group arithmetic


def test_distributed_config_from_toml_tables():
    cfg = config_from_dict({"distributed": {"amax_group": "none", "sharded_modules": ["layers.*.mlp.*"]}}, "f.toml")
    assert cfg.distributed == DistributedConfig("none", ("layers.*.mlp.*",))
    assert cfg.distributed.sharded("layers.3.mlp.up") and not cfg.distributed.sharded("lm_head")
    assert config_from_dict({"amax_group": "none"}, "options").distributed.amax_group == "none"
    assert config_from_dict({}, "f").distributed == DistributedConfig()
    dims = config_from_dict({"distributed": {"amax_group": ["dp_replicate", "dp_shard"], "pipeline_dims": ["stage"]}}, "f")
    assert dims.distributed.amax_group == ("dp_replicate", "dp_shard")
    assert dims.distributed.pipeline_dims == ("stage",) and DistributedConfig().amax_group == "auto"


@pytest.mark.parametrize("table, key, words", [
    ({"distributed": {"amax_group": "tp"}}, "distributed.amax_group", "allowed: ['auto', 'world', 'none'], a list of "
                                                                     "mesh dim names"),
    ({"distributed": {"amax_group": ["dp", "dp"]}}, "distributed.amax_group", "mesh dim names repeat in ['dp', 'dp']"),
    ({"distributed": {"amax_group": ["dp", 3]}}, "distributed.amax_group", "must be non-empty strings"),
    ({"distributed": {"pipeline_dims": "pp"}}, "distributed.pipeline_dims", "an array of mesh dim names"),
    ({"distributed": {"mesh": "dp"}}, "distributed.mesh", "expected a DeviceMesh"),
    ({"distributed": {"group": "world"}}, "distributed.group",
     "allowed keys: ['amax_group', 'expert_amax_group', 'sharded_modules', 'mesh', 'pipeline_dims', "
     "'context_parallel', 'async_tp']"),
    ({"distributed": {"context_parallel": 2}}, "distributed.context_parallel", "expected a mesh dim name, got 2"),
    ({"distributed": {"async_tp": "yes"}}, "distributed.async_tp", "expected true or false, got 'yes'"),
    ({"distributed": {"sharded_modules": "up"}}, "distributed.sharded_modules", "array of module globs"),
    ({"distributed": {"sharded_modules": ["up["]}}, "distributed.sharded_modules[0]", "without a closing"),
    ({"amax_group": 3}, "amax_group", "a ProcessGroup or a DeviceMesh, got 3 (int)"),
])
def test_distributed_config_errors_name_the_key(table, key, words):
    with pytest.raises(ConfigError) as info:
        config_from_dict(table, "fp8.toml")
    assert str(info.value).startswith(f"fp8.toml: {key}: ") and words in str(info.value)


def test_minimal_groups_drops_covered_groups():
    world = AmaxGroup("0", "world", 4, (0, 1, 2, 3))
    tp = AmaxGroup("1", "tp", 2, (0, 1))
    dp = AmaxGroup("2", "dp", 2, (0, 2))
    assert minimal_groups([tp, world, tp]) == (world,)
    assert minimal_groups([tp, dp]) == (tp, dp)
    assert minimal_groups([None, tp]) == (tp,)
    assert str(tp) == "tp (2 ranks)"
