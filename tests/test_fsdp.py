"""FSDP2 with FP8 weight all-gathers (te_compile.fsdp).

The multi-process tests share one spawned world of 3 CPU gloo ranks (one thread each, aot_eager): 3
ranks so that FSDP2 shards some weights unevenly (16 or 32 rows over 3 ranks) next to evenly sharded
ones (48 rows).
Each rank trains the same model under fully_shard (per block + root) and the 1-process reference
trains it unsharded on the same global batch, one micro-batch per rank, so every quantized input
sees the same data in both runs.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters

import te_compile
from te_compile.fsdp import Fp8AllGatherWeight, _ScaleBook, _Slot, enable_fp8_all_gather
from te_compile.recipe import Float8CurrentScaling
from te_compile.scaling import cast_to_fp8, compute_scale
from te_compile.tensor import Float8Tensor
from utils import assert_bitwise_equal, needs_gloo, run_ranks

pytestmark = needs_gloo

WORLD = 3
# 3 steps: the second and third gather weights an optimizer step moved (scales refreshed from new
# amaxes), which is what the one-process comparison and the refresh count need
STEPS = 3
OPTIONS = {"recipe": "Float8CurrentScaling", "compiler": "aot_eager"}
DELAYED = {"recipe": "DelayedScaling", "amax_history_len": 4, "compiler": "aot_eager"}


class Block(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 48) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)      # 48 rows: 16 per rank
        self.down = nn.Linear(hidden, d)    # 32 rows: 11, 11, 10 (uneven)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block0, self.block1 = Block(), Block()
        self.head = nn.Linear(32, 16)       # 16 rows: 6, 6, 4 (uneven)
        self.tiny = nn.Linear(32, 8)        # N = 8: left in high precision, so gathered in fp32

    def forward(self, x):
        h = self.block1(self.block0(x))
        return self.head(h).square().mean() + self.tiny(h).mean()


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(10 * step + rank)) * (1 + rank)


def _reference_losses() -> list[float]:
    """One process, unsharded: each step runs every rank's micro-batch (the mean of their losses).
    A forward and backward without an optimizer step comes first, as in the worker."""
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend="te", options=OPTIONS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for rank in range(WORLD):
        compiled(_batch(rank, 0)).backward()
    opt.zero_grad()
    losses = []
    for step in range(STEPS):
        total = 0.0
        for rank in range(WORLD):
            loss = compiled(_batch(rank, step))
            (loss / WORLD).backward()
            total += loss.item() / WORLD
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _fsdp_model(fp8: bool = True, mp_policy=None, seed: int = 0, options=OPTIONS):
    """(model, compiled) with fully_shard per block and on the root, the torchtitan layout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = Net()
    outcome = enable_fp8_all_gather(model, **options) if fp8 else None
    policy = mp_policy or MixedPrecisionPolicy()
    for block in (model.block0, model.block1):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, torch.compile(model, backend="te", options=options), outcome


def _train(model, compiled, opt, rank: int, steps: range) -> list[float]:
    """The global mean loss of each step."""
    losses = []
    for step in steps:
        loss = compiled(_batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    return losses


def _fsdp_worker(rank: int, checkpoint_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    gathered = []   # bytes each rank contributes per all-gather, and their dtype

    def counting(output, input, *args, **kwargs):
        gathered.append((input.numel() * input.element_size(), input.dtype))
        return all_gather_single(output, input, *args, **kwargs)

    all_gather_single = dist.all_gather_single
    dist.all_gather_single = counting
    te_compile.reset()
    model, compiled, outcome = _fsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = compiled(_batch(rank, 0))
    unsharded = type(model.head.weight).__mro__   # the root keeps its weights unsharded until backward
    loss.backward()
    opt.zero_grad()
    gathered.clear()
    per_step, losses = [], []
    for step in range(STEPS):
        before = len(gathered)
        losses += _train(model, compiled, opt, rank, range(step, step + 1))
        per_step.append(sum(b for b, _ in gathered[before:]))
    dist.all_gather_single = all_gather_single
    refreshes = model._te_fp8_all_gather.refreshes
    report = [(s.fqn, s.op, s.rewritten, s.reason) for s in te_compile.report().sites]

    # torch.distributed.checkpoint: save the sharded weights, load them into another FP8-gathering
    # model, and both train on identically
    dcp.save(model.state_dict(), checkpoint_id=checkpoint_dir)
    restored, restored_compiled, _ = _fsdp_model(seed=1)
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    restored.load_state_dict(state)
    same_weights = all(torch.equal(a.full_tensor(), b.full_tensor())
                       for a, b in zip(model.state_dict().values(), restored.state_dict().values()))
    next_step = range(STEPS, STEPS + 1)
    after_load = [_train(m, c, torch.optim.SGD(m.parameters(), lr=1e-2), rank, next_step)
                  for m, c in ((model, compiled), (restored, restored_compiled))]

    # bf16 mixed precision: gathering FP8 gives what quantizing the gathered bf16 weight gives
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mixed = []
    for fp8 in (True, False):
        m, c, _ = _fsdp_model(fp8, policy)
        mixed.append(_train(m, c, torch.optim.AdamW(m.parameters(), lr=1e-2), rank, range(2)))

    # delayed scaling: the shards cast with the graph's scale give the bytes the graph would make of
    # the gathered high-precision weight, and the same amaxes enter the history
    delayed, delayed_state = [], []
    for fp8 in (True, False):
        torch._dynamo.reset()   # this worker compiled Net many times: stay under the recompile limit
        m, c, dl_outcome = _fsdp_model(fp8, options=DELAYED)
        # 3 steps: the third quantizes with scales from an amax history that holds two steps' weights
        delayed.append(_train(m, c, torch.optim.AdamW(m.parameters(), lr=1e-2), rank, range(3)))
        delayed_state.append(te_compile.recipe_state_dict(m))
        if fp8:
            delayed_outcome = dl_outcome
    # recipe state of a sharded model: loads into a fresh FP8-gathering one before its first step
    # (the shards link their state); a high-precision gather gets its state at the first all-gather
    fresh, _, _ = _fsdp_model(True, options=DELAYED)
    te_compile.load_recipe_state_dict(fresh, delayed_state[0])
    reloaded = te_compile.recipe_state_dict(fresh)
    try:
        te_compile.load_recipe_state_dict(_fsdp_model(False, options=DELAYED)[0], delayed_state[1])
        load_error = None
    except RuntimeError as e:
        load_error = str(e)
    return {
        "losses": losses, "outcome": outcome, "bytes_per_step": per_step,
        "dtypes": {str(d) for _, d in gathered}, "refreshes": refreshes,
        "report": report, "unsharded_head": [c.__name__ for c in unsharded],
        "shard_rows": {n: p.to_local().shape[0] for n, p in model.named_parameters() if n.endswith("weight")},
        "same_weights": same_weights, "after_load": after_load, "mixed": mixed,
        "delayed": delayed, "delayed_outcome": delayed_outcome, "delayed_state": delayed_state,
        "reloaded": reloaded, "load_error": load_error,
    }


def _world(rank: int, checkpoint_dir: str) -> dict:
    """Every multi-process case of this file in one spawned world (a spawn of 3 ranks costs seconds of
    imports each)."""
    out = {"fsdp": _fsdp_worker(rank, checkpoint_dir)}
    torch._dynamo.reset()
    te_compile.reset()
    out["block"] = _block_worker(rank)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    return run_ranks(_world, tmp, str(tmp / "checkpoint"), world=WORLD)


@pytest.fixture(scope="module")
def fsdp_results(world):
    return [r["fsdp"] for r in world]


def test_fsdp_fp8_all_gather_matches_one_process(fsdp_results):
    reference = _reference_losses()
    for rank, result in enumerate(fsdp_results):
        for step, (got, want) in enumerate(zip(result["losses"], reference)):
            assert got == pytest.approx(want, rel=1e-5), f"rank {rank} step {step}: {got} vs {want}"
    # the shards really are uneven on some weights
    rows = [r["shard_rows"] for r in fsdp_results]
    assert [r["head.weight"] for r in rows] == [6, 6, 4]
    assert [r["block0.down.weight"] for r in rows] == [11, 11, 10]


def test_fsdp_gathers_fp8_bytes(fsdp_results):
    result = fsdp_results[0]
    assert result["outcome"]["block0.up"] == "FP8 all-gather"
    assert "K and N % 16" in result["outcome"]["tiny"]
    fp8 = ("block0.up", "block0.down", "block1.up", "block1.down", "head")
    # gloo gathers one flat buffer per FSDP group; mixed fp8/fp32 inputs travel as uint8
    assert result["dtypes"] == {"torch.uint8"}
    model = Net()
    shapes = {n: p.shape for n, p in model.named_parameters()}

    def padded(name, itemsize):
        shape = shapes[name]
        return math.ceil(shape[0] / WORLD) * math.prod(shape[1:]) * itemsize

    fp8_names = {f"{m}.weight" for m in fp8}
    forward = sum(padded(n, 1 if n in fp8_names else 4) for n in shapes)
    # the blocks are re-gathered for backward (reshard_after_forward), the root is not
    backward = sum(padded(n, 1 if n in fp8_names else 4) for n in shapes if n.startswith("block"))
    assert set(result["bytes_per_step"]) == {forward + backward}
    high = sum(padded(n, 4) for n in shapes) + sum(padded(n, 4) for n in shapes if n.startswith("block"))
    assert forward + backward < 0.5 * high


def test_fsdp_scales_refresh_once_per_step(fsdp_results):
    # the first forward, then the first forward after each optimizer step but the last; the
    # backward re-gathers and the other blocks' all-gathers reuse the amaxes
    assert all(r["refreshes"] == STEPS for r in fsdp_results)


def test_fsdp_checkpoint_round_trip(fsdp_results):
    for result in fsdp_results:
        assert result["same_weights"]
        assert result["after_load"][0] == result["after_load"][1]


def test_fsdp_mixed_precision_fp8_gather_equals_high_precision_gather(fsdp_results):
    fp8, high = fsdp_results[0]["mixed"]
    assert fp8 == high


def test_fsdp_delayed_scaling_fp8_gather_equals_high_precision_gather(fsdp_results):
    assert fsdp_results[0]["delayed_outcome"]["block0.up"] == "FP8 all-gather"
    for result in fsdp_results:
        fp8, high = result["delayed"]
        assert fp8 == high
        assert len(set(fp8)) == len(fp8), "training moved"


def test_fsdp_delayed_scaling_recipe_state_dict(fsdp_results):
    for result in fsdp_results:
        fp8, high = result["delayed_state"]
        assert {k.rsplit(".", 2)[0] for k in fp8} == {"block0.up", "block0.down", "block1.up", "block1.down",
                                                      "head"}
        assert fp8.keys() == high.keys()
        for key in fp8:
            assert_bitwise_equal(fp8[key], high[key], key)
        assert result["reloaded"].keys() == fp8.keys()
        for key in fp8:
            assert_bitwise_equal(result["reloaded"][key], fp8[key], key)
        assert "run one forward before loading its recipe state" in result["load_error"]


def test_fsdp_report_and_unsharded_weight(fsdp_results):
    result = fsdp_results[0]
    assert "Float8Tensor" in result["unsharded_head"]
    rows = {fqn: (rewritten, reason) for fqn, op, rewritten, reason in result["report"] if op == "linear"}
    assert rows["head"][0] and "weight already quantized, used as is" in rows["head"][1]
    assert rows["block1.down"][0] and "weight already quantized, used as is" in rows["block1.down"][1]
    assert not rows["tiny"][0] and "weight already quantized, used as is" not in rows["tiny"][1]


# ---------------------------------------------------------------------------------------------
# The extension points on their own (one process): padding, empty shards, the refill


class _Mesh:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("rows,world,local", [(16, 3, 4), (16, 3, 6), (16, 32, 0)])
def test_pre_all_gather_pads_to_fsdp_shard_size(monkeypatch, rows, world, local):
    recipe = Float8CurrentScaling()
    book = _ScaleBook()
    book.slots.append(_Slot(None, "weight", "w", recipe))
    amax = torch.tensor([3.5])
    monkeypatch.setattr(_ScaleBook, "amax", lambda self, slot, shard, mesh: amax)
    shard = torch.randn(local, 32) * 2
    wrapped = Fp8AllGatherWeight(shard, book, 0)
    (data,), (scale_inv, fp8_dtype, _, _) = wrapped.fsdp_pre_all_gather(
        _Mesh(world), torch.Size([rows, 32]), (32, 1), None, SimpleNamespace(param_dtype=None))
    assert data.dtype == torch.uint8 and data.shape == (math.ceil(rows / world), 32)
    scale = compute_scale(amax, torch.float8_e4m3fn)
    assert_bitwise_equal(data[:local], cast_to_fp8(shard, scale, torch.float8_e4m3fn).view(torch.uint8))
    assert not data[local:].any()
    assert_bitwise_equal(scale_inv, 1 / scale)


def test_post_all_gather_builds_then_refills_float8_tensor():
    book = _ScaleBook()
    book.slots.append(_Slot(None, "weight", "w", Float8CurrentScaling()))
    wrapped = Fp8AllGatherWeight(torch.zeros(2, 16), book, 0)
    gathered = torch.randint(0, 100, (4, 16), dtype=torch.uint8)
    meta = lambda scale_inv: (torch.tensor([scale_inv]), torch.float8_e4m3fn, torch.ones(1), None)  # noqa: E731
    weight, inner = wrapped.fsdp_post_all_gather((gathered,), meta(0.5), torch.bfloat16)
    assert isinstance(weight, Float8Tensor) and weight.dtype == torch.bfloat16 and inner == (gathered,)
    assert weight._data.data_ptr() == gathered.data_ptr()
    version = weight._scale_inv._version
    gathered.copy_(gathered + 1)     # FSDP re-fills the same buffer in the next step
    assert wrapped.fsdp_post_all_gather((gathered,), meta(0.25), torch.bfloat16, out=weight) is None
    assert weight._scale_inv.item() == 0.25 and weight._scale_inv._version == version
    assert torch.equal(weight._data, gathered)


def test_wrapper_is_an_ordinary_weight_outside_fsdp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8))
    outcome = enable_fp8_all_gather(model, recipe="Float8CurrentScaling")
    assert outcome == {"0": "FP8 all-gather", "1": "weight [8, 16]: FP8 GEMMs need K and N % 16 == 0"}
    assert isinstance(model[0].weight, Fp8AllGatherWeight)
    x = torch.randn(4, 32)
    ref = nn.functional.linear(x, model[0].weight._tensor, model[0].bias)
    y = model[0](x)
    assert type(y) is torch.Tensor and torch.equal(y, ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).sum().backward()
    before = model[0].weight._tensor.clone()
    opt.step()
    assert not torch.equal(model[0].weight._tensor, before)
    assert isinstance(model[0].weight, Fp8AllGatherWeight)
    assert enable_fp8_all_gather(model, recipe="Float8CurrentScaling")["0"] == "already wrapped"


# ---------------------------------------------------------------------------------------------
# Block formats (MXFP8, Float8 block): shards of whole blocks, every buffer gathered


class BlockFormatBlock(nn.Module):
    """up [h, d] (gathered in the block format: h rows split into whole blocks over 3 ranks) and
    down [d, h] (d rows do not: gathered in high precision)."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class BlockFormatNet(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.block0, self.block1 = BlockFormatBlock(d, h), BlockFormatBlock(d, h)

    def forward(self, x):
        return self.block1(self.block0(x)).square().mean()


BLOCK_CASES = {"MXFP8BlockScaling": (64, 96), "Float8BlockScaling": (128, 384)}


def _block_worker(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    out = {}
    for name, (d, h) in BLOCK_CASES.items():
        options = {"recipe": name, "compiler": "aot_eager"}
        runs = []
        for fp8 in (True, False):
            torch._dynamo.reset()
            te_compile.reset()
            torch.manual_seed(0)
            model = BlockFormatNet(d, h)
            outcome = enable_fp8_all_gather(model, **options) if fp8 else None
            for block in (model.block0, model.block1):
                fully_shard(block)
            fully_shard(model)
            compiled = torch.compile(model, backend="te", options=options)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step in range(2):   # the second gathers the shards of weights AdamW moved
                x = torch.randn(4, 8, d, generator=torch.Generator().manual_seed(10 * step + rank))
                loss = compiled(x)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            report = {s.fqn: s.reason for s in te_compile.report().sites if s.op == "linear"}
            runs.append((losses, outcome, report))
        out[name] = runs
    return out


def test_fsdp_block_formats_gather_whole_blocks(world):
    for result in (r["block"] for r in world):
        for name, ((fp8, outcome, report), (high, _, _)) in result.items():
            assert outcome["block0.up"] == "FP8 all-gather", (name, outcome)
            assert "do not split into whole" in outcome["block0.down"], (name, outcome)
            assert "used as is" in report["block1.up"] and "used as is" not in report["block1.down"]
            # the shard's blocks are the whole weight's: gathering them is quantizing the gathered weight
            assert fp8 == high, name
            assert len(set(fp8)) == len(fp8), "training moved"


def test_enable_fp8_all_gather_follows_the_config():
    model = Net()
    outcome = enable_fp8_all_gather(model, recipe="Float8CurrentScaling", overrides=[
        {"modules": "head", "recipe": "none"}, {"modules": "block1.*", "recipe": "MXFP8BlockScaling"}])
    assert outcome["block0.up"] == outcome["block0.down"] == "FP8 all-gather"
    assert outcome["head"].startswith("recipe none: FP8 all-gather supports Float8CurrentScaling, DelayedScaling")
    assert outcome["block1.up"] == "weight [48, 32]: MXFP8 scales blocks of 32 along K and N"
    # block formats check that the shards are whole blocks, which needs the world size
    outcome = enable_fp8_all_gather(BlockFormatNet(64, 96), recipe="MXFP8BlockScaling")
    assert outcome["block0.up"] == "block formats need the process group initialized first (to check the shards)"
    assert type(model.head.weight.data) is torch.Tensor and type(model.block1.up.weight.data) is torch.Tensor
    assert enable_fp8_all_gather(Net(), recipe="Float8CurrentScaling", rewrite={"linear": False})["head"] \
        == "[rewrite] linear = false"
    with pytest.raises(ValueError, match="either a TeConfig or inline options"):
        enable_fp8_all_gather(Net(), te_compile.TeConfig(), recipe="DelayedScaling")


def test_fp8_lowering_uses_a_float8tensor_weight_as_it_is():
    """The gathered weight's bytes are the GEMM operand: a Float8Tensor made by current scaling of W
    holds the bytes the lowering would make from W, so outputs and gradients are bit-identical; a
    Float8Tensor with another scale shows its own bytes are used, not re-quantized from its values."""
    from te_compile.distributed import NO_GROUPS
    from te_compile.gemm.per_tensor import fp8_gemm
    from te_compile.lowerings.linear import Fp8LinearFunction
    from te_compile.scaling import quantize_per_tensor
    from te_compile.tensor import Float8CurrentScalingQuantizer

    recipe = Float8CurrentScaling()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=gen)
    w = torch.randn(32, 64, generator=gen)
    wq = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, columnwise=False)(w)

    def run(weight):
        xg, wg = x.clone().requires_grad_(), weight.detach().requires_grad_()
        y = Fp8LinearFunction.apply(xg, wg, recipe, NO_GROUPS, None, None, None, None)
        y.backward(torch.ones_like(y))
        return y, xg.grad, wg.grad

    for got, want in zip(run(wq), run(w)):
        assert type(got) is torch.Tensor and got.dtype == torch.float32
        assert_bitwise_equal(got, want)
    # bytes using a third of the range: re-quantizing their values would spread them over the
    # whole range (other bytes, another scale); the lowering must multiply these bytes as they are
    scale = compute_scale(w.abs().amax().reshape(1), torch.float8_e4m3fn) / 3
    narrow = Float8Tensor(data=cast_to_fp8(w, scale, torch.float8_e4m3fn).view(torch.uint8),
                          scale_inv=1 / scale, fp8_dtype=torch.float8_e4m3fn)
    xq, x_sinv, _ = quantize_per_tensor(x, "input", recipe)
    want = fp8_gemm(xq.contiguous(), narrow._data.view(torch.float8_e4m3fn).t(), x_sinv, narrow._scale_inv,
                    out_dtype=torch.float32)
    assert_bitwise_equal(run(narrow)[0], want)
    assert not torch.equal(run(narrow.dequantize())[0], want)


def test_wrapper_gives_the_compile_cache_a_stable_hash_and_torch_does_not_warn(tmp_path, monkeypatch):
    """A traced sharded weight is keyed by its plain weight's layout and slot, not by the book (whose
    modules hold the weights' values), and a graph reading it hits AOTAutograd's cache without torch's
    missing-hash warning."""
    book = _ScaleBook()
    book.slots.append(_Slot(nn.Linear(16, 2), "weight", "w", Float8CurrentScaling()))
    wrapped = Fp8AllGatherWeight(torch.randn(2, 16), book, 0)
    key = wrapped._stable_hash_for_caching()
    assert Fp8AllGatherWeight(torch.randn(2, 16) * 9, _ScaleBook(), 0)._stable_hash_for_caching() == key
    assert len({key, Fp8AllGatherWeight(torch.randn(2, 16), book, 1)._stable_hash_for_caching(),
                Fp8AllGatherWeight(torch.randn(16, 2), book, 0)._stable_hash_for_caching(),
                Fp8AllGatherWeight(torch.randn(2, 16, dtype=torch.bfloat16), book, 0)._stable_hash_for_caching()}) == 4
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())   # torch warns once per process
    x, seen = torch.randn(4, 16), []
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            torch.compile(lambda x, w: x @ w.t())(x, wrapped)
            seen.append(dict(counters["aot_autograd"]))
    assert seen[0].get("autograd_cache_miss") == 1 and seen[1].get("autograd_cache_hit") == 1, seen
    assert not [w for w in caught if "_stable_hash_for_caching" in str(w.message)]
