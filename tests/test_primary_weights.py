"""FP8 primary weights (te_compile.quantized_model_init) and the master-weight utilities
(te_compile.tensor.utils: cast_master_weights_to_fp8, post_all_gather_processing, replace_raw_data).

The parity test is TransformerEngine's: two ranks train the same model twice, once with fp32 weights
that the te backend quantizes on the fly, once with FP8 primary weights and ZeRO-sharded fp32 master
weights cast back with cast_master_weights_to_fp8; the losses must be bitwise equal at every step,
for current scaling, delayed scaling, MXFP8 and Float8 block.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import te_compile
from te_compile.primary_weights import quantized_model_init
from te_compile.quantization import weight_quantizer
from te_compile.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from te_compile.tensor import Float8BlockwiseQTensor, Float8Tensor, MXFP8Tensor, QuantizedTensor
from te_compile.tensor.utils import (
    cast_master_weights_to_fp8,
    post_all_gather_processing,
    quantize_master_weights,
    replace_raw_data,
)
from utils import assert_bitwise_equal, run_ranks

RECIPES = {
    "Float8CurrentScaling": (Float8CurrentScaling(), Float8Tensor),
    "DelayedScaling": (DelayedScaling(), Float8Tensor),
    "MXFP8BlockScaling": (MXFP8BlockScaling(), MXFP8Tensor),
    "Float8BlockScaling": (Float8BlockScaling(), Float8BlockwiseQTensor),
}


def _buffers(w) -> list[torch.Tensor]:
    """Every byte and scale that defines a quantized weight's values."""
    if isinstance(w, Float8Tensor):
        return [w._data, w._scale_inv]
    return [t for t in (w._rowwise_data, w._rowwise_scale_inv, w._columnwise_data, w._columnwise_scale_inv)
            if t is not None]


def _assert_same_quantized(a, b, msg: str) -> None:
    assert type(a) is type(b), msg
    for x, y in zip(_buffers(a), _buffers(b), strict=True):
        assert_bitwise_equal(x, y, msg)


# ---- quantized_model_init ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(RECIPES))
def test_linears_get_quantized_weights_of_the_recipe(name):
    recipe, cls = RECIPES[name]
    torch.manual_seed(0)
    with quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 10))
    w = model[0].weight
    assert type(w) is cls and isinstance(w, nn.Parameter) and w.requires_grad
    hp = w.get_high_precision_init_val()
    assert hp is not None and hp.device.type == "cpu" and hp.shape == (96, 64)
    # the bytes are what the backend's weight quantizer makes of the initial values
    _assert_same_quantized(w, weight_quantizer(recipe, w).quantize(hp), name)
    # N = 10 cannot be an FP8 GEMM operand: the weight stays high precision, like the backend's linear
    assert type(model[1].weight) is nn.Parameter
    w.clear_high_precision_init_val()
    assert w.get_high_precision_init_val() is None


def test_context_restores_nn_linear_and_nests():
    original = nn.Linear.__init__
    with quantized_model_init(recipe=Float8CurrentScaling()):
        with quantized_model_init(enabled=False):
            plain = nn.Linear(32, 32)
        quantized = nn.Linear(32, 32)
    assert nn.Linear.__init__ is original
    assert type(plain.weight) is nn.Parameter and type(quantized.weight) is Float8Tensor
    assert type(nn.Linear(32, 32).weight) is nn.Parameter
    with pytest.raises(RuntimeError, match="boom"), quantized_model_init(recipe=Float8CurrentScaling()):
        raise RuntimeError("boom")
    assert nn.Linear.__init__ is original


def test_unsupported_recipes_are_refused_by_name():
    with pytest.raises(ValueError, match="NVFP4BlockScaling has no primary-weight format"):
        with quantized_model_init(recipe=NVFP4BlockScaling()):
            pass
    with pytest.raises(ValueError, match="w_block_scaling_dim=2"):
        with quantized_model_init(recipe=Float8BlockScaling(w_block_scaling_dim=1)):
            pass


def test_in_place_init_through_data_refreshes_the_init_value():
    # Hugging Face's _init_weights: module.weight.data.normal_(std=...) after construction
    with quantized_model_init(recipe=DelayedScaling(), preserve_high_precision_init_val=True):
        lin = nn.Linear(64, 32)
    torch.manual_seed(3)
    lin.weight.data.normal_(std=0.02)
    hp = lin.weight.get_high_precision_init_val()
    assert hp.std() < 0.03, "the init value follows the re-initialization"
    assert_bitwise_equal(lin.weight._amax, hp.abs().amax().reshape(1))
    scale = 1.0 / lin.weight._scale_inv
    assert_bitwise_equal(lin.weight._data.view(torch.float8_e4m3fn).float(),
                         (hp * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("name", ["Float8CurrentScaling", "MXFP8BlockScaling"])
def test_meta_device_init_then_to_empty_and_reset(name):
    # torchtitan's way: build on the meta device, materialize, initialize in place
    recipe, cls = RECIPES[name]
    with torch.device("meta"), quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        lin = nn.Linear(64, 96)
    assert type(lin.weight) is cls and lin.weight.is_meta
    assert lin.weight.get_high_precision_init_val() is None, "no values yet"
    lin.to_empty(device="cpu")
    torch.manual_seed(5)
    lin.reset_parameters()
    hp = lin.weight.get_high_precision_init_val()
    assert hp is not None and 0.01 < hp.std() < 0.2, "filled by the first initialization"
    _assert_same_quantized(lin.weight, weight_quantizer(recipe).quantize(hp), name)
    with pytest.raises(ValueError, match="DelayedScaling primary weights cannot be built on the meta device"):
        with torch.device("meta"), quantized_model_init(recipe=DelayedScaling()):
            nn.Linear(64, 96)


@pytest.mark.parametrize("name", list(RECIPES))
def test_backend_uses_the_weight_as_is(name):
    """One step of the compiled model: same loss and input gradient as fp32 weights holding the init
    values (the on-the-fly quantization gives the same operand), and the report says so."""
    recipe, _ = RECIPES[name]
    torch.manual_seed(1)
    with quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        fp8 = nn.Sequential(nn.Linear(64, 96, bias=False), nn.GELU(), nn.Linear(96, 64, bias=False))
    ref = nn.Sequential(nn.Linear(64, 96, bias=False), nn.GELU(), nn.Linear(96, 64, bias=False))
    with torch.no_grad():
        for a, b in zip(ref.parameters(), fp8.parameters()):
            a.copy_(b.get_high_precision_init_val())
    x = torch.randn(16, 64)
    options = {"recipe": name, "compiler": "aot_eager"}
    # a fresh Dynamo cache: past Dynamo's recompile limit for this code the model would run eagerly
    torch._dynamo.reset()
    te_compile.reset()
    outs = []
    for model in (ref, fp8):
        xi = x.clone().requires_grad_()
        loss = torch.compile(model, backend=te_compile.backend(**options))(xi).square().mean()
        loss.backward()
        outs.append((loss.detach(), xi.grad))
    assert_bitwise_equal(outs[0][0], outs[1][0], name)
    assert_bitwise_equal(outs[0][1], outs[1][1], name)
    rows = [r for r in te_compile.report().sites if r.op == "linear"]
    assert [("used as is" in r.reason) for r in rows] == [False, False, True, True]


# ---- master-weight utilities ---------------------------------------------------------------------

def _make(name: str, n: int = 288, k: int = 320):
    recipe, _ = RECIPES[name]
    with quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        return nn.Linear(k, n, bias=False).weight


@pytest.mark.parametrize("name", list(RECIPES))
def test_cast_of_whole_master_weights_equals_quantizing_them(name):
    w = _make(name)
    master = w.get_high_precision_init_val() + 0.01 * torch.randn(w.shape)
    cast_master_weights_to_fp8([w], [master])
    assert w.get_high_precision_init_val() is None, "cleared: the master weights exist now"
    if name == "DelayedScaling":
        # the graph's scale (1 before any step) and the true amax for the history
        assert_bitwise_equal(w._scale_inv, torch.ones(1))
        assert_bitwise_equal(w._amax, master.abs().amax().reshape(1))
    _assert_same_quantized(w, weight_quantizer(RECIPES[name][0], w).quantize(master), name)


def test_cast_checks_its_arguments():
    w = _make("Float8CurrentScaling", 32, 32)
    with pytest.raises(ValueError, match="master_weights has 2 entries"):
        cast_master_weights_to_fp8([w], [None, None])
    with pytest.raises(ValueError, match="does not fit"):
        cast_master_weights_to_fp8([w], [torch.zeros(10)], start_offsets=[1020])
    with pytest.raises(ValueError, match="look like start offsets"):   # TE's positional order
        cast_master_weights_to_fp8([w], [torch.zeros(32, 32)], [0], None)
    quantize_master_weights([w], [torch.zeros(32, 32)], [0], None)   # ... is quantize_master_weights'
    assert_bitwise_equal(w.dequantize(), torch.zeros(32, 32))
    with pytest.raises(ValueError, match="no quantizer"):
        plain = Float8Tensor(data=w._data.clone(), scale_inv=w._scale_inv.clone(), fp8_dtype=w._fp8_dtype)
        cast_master_weights_to_fp8([plain], [torch.zeros(32, 32)])


@pytest.mark.parametrize("name", ["Float8CurrentScaling", "Float8BlockScaling"])
def test_replace_raw_data_round_trip_into_a_flat_buffer(name):
    weights = [_make(name, 64, 32), _make(name, 32, 96)]
    before = [w.dequantize() for w in weights]
    field = "_data" if name == "Float8CurrentScaling" else "_rowwise_data"
    flat = torch.zeros(sum(w.numel() for w in weights), dtype=torch.uint8)
    offset = 0
    for w in weights:
        replace_raw_data(w, flat[offset:offset + w.numel()].view(w.shape))
        offset += w.numel()
    for w, values in zip(weights, before):
        assert_bitwise_equal(w.dequantize(), values, name)
        assert getattr(w, field).untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    # writing the flat buffer (what a ZeRO all-gather does) changes the weights
    flat[:64 * 32].copy_(getattr(weights[1], field).reshape(-1)[:64 * 32])
    assert not torch.equal(weights[0].dequantize(), before[0])
    with pytest.raises(ValueError, match="two independently scaled copies"):
        replace_raw_data(_make("MXFP8BlockScaling", 32, 32), torch.zeros(32, 32, dtype=torch.uint8))


def test_post_all_gather_processing_rebuilds_derived_copies_idempotently():
    fp8 = _make("Float8CurrentScaling", 64, 32)
    fp8.update_usage(columnwise_usage=True)
    block = _make("Float8BlockScaling", 160, 288)
    block.update_usage(columnwise_usage=True)
    master_fp8, master_block = torch.randn(64, 32), torch.randn(160, 288)
    # manual: the cast leaves the derived copies stale until the caller processes the weights
    cast_master_weights_to_fp8([fp8, block], [master_fp8, master_block], manual_post_all_gather_processing=True)
    assert not torch.equal(fp8._transpose, fp8._data.t())
    for _ in range(2):
        post_all_gather_processing([fp8, block, torch.zeros(3)])
        assert_bitwise_equal(fp8._transpose, fp8._data.t().contiguous())
        expect = weight_quantizer(Float8BlockScaling(), block).copy()
        expect.set_usage(columnwise=True)
        _assert_same_quantized(block, expect.quantize(master_block), "Float8 block columnwise copy")


# ---- ZeRO-sharded master weights, 2 ranks: bitwise parity with on-the-fly quantization ---------------

STEPS = 10


class MiniZero:
    """ZeRO-1 SGD: rank r owns a contiguous range of the flat concatenation of all weights (a range may
    start and end anywhere inside a weight, cutting scaling blocks); the fp32 master weights hold that
    range. After the update the owners' values (fp32) or bytes (FP8) are all-gathered through one
    flat buffer that the weights' storage lives in."""

    def __init__(self, weights, lr: float) -> None:
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.weights, self.lr = weights, lr
        self.quantized = isinstance(weights[0], QuantizedTensor)
        self.offsets, total = [], 0
        for w in weights:
            self.offsets.append(total)
            total += w.numel()
        total += -total % self.world
        per = total // self.world
        self.lo, self.hi = self.rank * per, (self.rank + 1) * per
        self.masters, self.starts = [], []
        for w, off in zip(weights, self.offsets):
            lo, hi = max(self.lo, off), min(self.hi, off + w.numel())
            if lo >= hi:
                self.masters.append(None)
                self.starts.append(None)
                continue
            init = w.get_high_precision_init_val() if self.quantized else w.detach()
            self.masters.append(init.reshape(-1)[lo - off:hi - off].float().clone())
            self.starts.append(lo - off)
        self.buffer = torch.zeros(total, dtype=torch.uint8 if self.quantized else torch.float32)
        self.col_buffer = torch.zeros(total, dtype=torch.uint8) if isinstance(weights[0], MXFP8Tensor) else None
        for w, off in zip(weights, self.offsets):
            view = self.buffer[off:off + w.numel()].view(w.shape)
            if self.quantized and not isinstance(w, MXFP8Tensor):
                replace_raw_data(w, view)
            elif not self.quantized:
                view.copy_(w.detach())
                w.data = view

    def _gather(self, buffer: torch.Tensor) -> None:
        parts = list(buffer.chunk(self.world))
        dist.all_gather(parts, buffer[self.lo:self.hi].clone())
        buffer.copy_(torch.cat(parts))

    def _mxfp8_copies(self, into_buffer: bool) -> None:
        # MXFP8 keeps two copies with their own scales: both are gathered, through two buffers
        for w, off in zip(self.weights, self.offsets):
            for buf, data in ((self.buffer, w._rowwise_data), (self.col_buffer, w._columnwise_data)):
                part = buf[off:off + w.numel()]
                (part.copy_(data.reshape(-1)) if into_buffer else data.view(-1).copy_(part))

    @torch.no_grad()
    def step(self) -> None:
        grads = torch.zeros(self.buffer.numel())
        for w, off in zip(self.weights, self.offsets):
            grads[off:off + w.numel()] = w.grad.reshape(-1)
            w.grad = None
        dist.all_reduce(grads)
        grads /= self.world
        for master, start, off in zip(self.masters, self.starts, self.offsets):
            if master is not None:
                master -= self.lr * grads[off + start:off + start + master.numel()]
        if self.quantized:
            cast_master_weights_to_fp8(self.weights, self.masters, start_offsets=self.starts,
                                       amax_reduce_group=dist.group.WORLD)
            if self.col_buffer is not None:
                self._mxfp8_copies(into_buffer=True)
                self._gather(self.col_buffer)
            self._gather(self.buffer)
            if self.col_buffer is not None:
                self._mxfp8_copies(into_buffer=False)
            post_all_gather_processing(self.weights)
        else:
            for master, start, off in zip(self.masters, self.starts, self.offsets):
                if master is not None:
                    self.buffer[off + start:off + start + master.numel()] = master
            self._gather(self.buffer)


class _Net(nn.Module):
    """A user-defined forward: under DDP, Dynamo compiles the wrapped module's forward frame, which it
    skips for torch's own nn.Sequential."""

    def __init__(self) -> None:
        super().__init__()
        # 6144 + 15360 + 10240 elements: the 2-rank split falls inside the second weight, mid-row,
        # inside a 32-row MXFP8 block and a 128x128 tile
        self.up = nn.Linear(64, 96, bias=False)
        self.mid = nn.Linear(96, 160, bias=False)
        self.down = nn.Linear(160, 64, bias=False)

    def forward(self, x):
        gelu = nn.functional.gelu
        return self.down(gelu(self.mid(gelu(self.up(x)))))



def _twins(recipe, build) -> tuple[nn.Module, nn.Module]:
    """(fp32 model, the same model with FP8 primary weights) holding the same initial values."""
    torch.manual_seed(0)
    with quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        fp8 = build()
    ref = build()
    with torch.no_grad():
        for a, b in zip(ref.parameters(), fp8.parameters()):
            a.copy_(b.get_high_precision_init_val())
    return ref, fp8


def _train_twins(compiled: list, opts: list, rank: int) -> list:
    """STEPS steps of the reference and the FP8-weight model on this rank's batches: per step the
    pair of losses."""
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, target = torch.randn(16, 64, generator=gen), torch.randn(16, 64, generator=gen)
        pair = []
        for model, opt in zip(compiled, opts):
            loss = nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            pair.append(loss.detach())
        losses.append(pair)
    return losses


def _parity_rank(rank: int, names) -> dict:
    out = {}
    for name in names:
        recipe, cls = RECIPES[name]
        ref, fp8 = _twins(recipe, _Net)
        opts = [MiniZero(list(m.parameters()), lr=0.5) for m in (ref, fp8)]
        options = {"recipe": name, "compiler": "aot_eager"}
        compiled = [torch.compile(m, backend=te_compile.backend(**options)) for m in (ref, fp8)]
        losses = _train_twins(compiled, opts, rank)
        out[name] = {"losses": losses, "types": [type(p) for p in fp8.parameters()]}
    return out


EXPERT_NAMES = ["Float8CurrentScaling", "DelayedScaling"]
DDP_NAMES = ["Float8CurrentScaling", "MXFP8BlockScaling"]


def _world(rank: int, tmp: str) -> dict:
    """Every multi-rank case of this file in one spawned world of 2 ranks (a spawn costs a few
    seconds of imports per rank): ZeRO-1 parity, the expert masters, DDP, FSDP2 per recipe."""
    # each part compiles its models afresh (its report rows, the recompile limit): reset Dynamo between
    parts = [("parity", lambda: _parity_rank(rank, list(RECIPES))),
             ("expert", lambda: _expert_parity_rank(rank, EXPERT_NAMES)),
             ("ddp", lambda: _ddp_rank(rank, DDP_NAMES))]
    parts += [(("fsdp2", name), lambda name=name: _fsdp_rank(rank, name, os.path.join(tmp, f"ckpt_{name}")))
              for name in RECIPES]
    out = {}
    for key, part in parts:
        torch._dynamo.reset()
        out[key] = part()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    tmp = tmp_path_factory.mktemp("primary")
    return run_ranks(_world, tmp, str(tmp))


def test_zero_sharded_master_weights_match_on_the_fly_quantization_bitwise(world):
    results = [r["parity"] for r in world]
    for rank, result in enumerate(results):
        for name, (_, cls) in RECIPES.items():
            assert result[name]["types"] == [cls] * 3, name
            losses = result[name]["losses"]
            for step, (ref, fp8) in enumerate(losses):
                assert_bitwise_equal(ref, fp8, f"{name} rank {rank} step {step}")
            # training moved: the last loss differs from the first (a frozen run would pass trivially)
            assert losses[-1][0] != losses[0][0], name


class _ExpertNet(nn.Module):
    """MoE experts (3-D weights in fp32, one GEMM per expert on its rows: 5, 4 and 7 tokens) and a
    head. w1, w2: 3 x 6144 elements each, head 4096: the 2-rank split falls in w2's first expert,
    mid-row, so that expert's amax needs both ranks' masters. (A bf16 grouped GEMM would quantize
    the bf16 copy of an on-the-fly weight but the fp32 master of an FP8 one: no bitwise parity.)"""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(3, 96, 64) / 8)
        self.w2 = nn.Parameter(torch.randn(3, 64, 96) / 10)
        self.head = nn.Linear(64, 64, bias=False)

    def forward(self, x):   # x [16, 64], sorted by expert
        outs = []
        for e, rows in enumerate(x.split([5, 4, 7])):
            outs.append(nn.functional.linear(nn.functional.gelu(nn.functional.linear(rows, self.w1[e])), self.w2[e]))
        return self.head(torch.cat(outs))


def _expert_parity_rank(rank: int, names) -> dict:
    from te_compile.tensor.grouped_float8_tensor import GroupedFloat8Tensor

    out = {}
    for name in names:
        recipe, _ = RECIPES[name]
        ref, fp8 = _twins(recipe, _ExpertNet)
        opts = [MiniZero(list(m.parameters()), lr=0.5) for m in (ref, fp8)]
        te_compile.reset()
        compiled = [torch.compile(m, backend=te_compile.backend(recipe=name, compiler="aot_eager")) for m in (ref, fp8)]
        losses = _train_twins(compiled, opts, rank)
        # the one expert split between the ranks: its master range on this rank
        split = opts[1].masters[1]
        out[name] = {"losses": losses, "grouped": [isinstance(p, GroupedFloat8Tensor) for p in fp8.parameters()],
                     "w2_master": None if split is None else split.numel(),
                     "used": [s.reason for s in te_compile.report().sites if s.op == "grouped_linear"]}
    return out


def test_zero_sharded_expert_masters_match_on_the_fly_quantization_bitwise(world):
    """ZeRO-1 over FP8 expert weights (GroupedFloat8Tensor): each rank casts its range of the fp32
    masters, the amax of the expert split between the ranks is all-reduced, and the losses equal fp32
    weights quantized on the fly, bit for bit, at every step."""
    results = [r["expert"] for r in world]
    for rank, result in enumerate(results):
        for name in EXPERT_NAMES:
            assert result[name]["grouped"] == [True, True, False], name
            # both ranks hold part of w2 (the split falls inside its first expert)
            assert result[name]["w2_master"] not in (None, 0, 3 * 64 * 96), result[name]["w2_master"]
            assert any("weight already quantized, used as is" in r for r in result[name]["used"]), result[name]["used"]
            losses = result[name]["losses"]
            for step, (ref, fp8) in enumerate(losses):
                assert_bitwise_equal(ref, fp8, f"{name} rank {rank} step {step}")
            assert losses[-1][0] != losses[0][0], name


@torch.no_grad()
def _sgd(lr: float, plain, weights=(), masters=()) -> None:
    """One SGD step: plain parameters in place, FP8 primary weights through their fp32 masters and
    cast_master_weights_to_fp8 (whole masters: no amax reduction)."""
    for p in plain:
        p -= lr * p.grad
        p.grad = None
    for weight, master in zip(weights, masters):
        master -= lr * weight.grad
        weight.grad = None
    if weights:
        cast_master_weights_to_fp8(list(weights), list(masters))


# ---- DDP -----------------------------------------------------------------------------------------------

def _ddp_rank(rank: int, names) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name in names:
        recipe, _ = RECIPES[name]
        ref, fp8 = _twins(recipe, _Net)
        masters = [p.get_high_precision_init_val().clone() for p in fp8.parameters()]
        # DDP's initial broadcast flattens each parameter to 1-D, which a block-scaled weight cannot
        # do as a view: those models skip it (every rank built the same weights from the same seed)
        init_sync = not isinstance(next(fp8.parameters()), (MXFP8Tensor, Float8BlockwiseQTensor))
        options = {"recipe": name, "compiler": "aot_eager"}
        models = [torch.compile(DDP(m, init_sync=init_sync), backend=te_compile.backend(**options))
                  for m in (ref, fp8)]
        te_compile.reset()
        losses = []
        for step in range(4):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x, target = torch.randn(16, 64, generator=gen), torch.randn(16, 64, generator=gen)
            pair = []
            for model in models:
                loss = nn.functional.mse_loss(model(x), target)
                loss.backward()
                pair.append(loss.detach())
            losses.append(pair)
            _sgd(0.5, ref.parameters())
            # whole master weights on every rank: no amax reduction needed
            _sgd(0.5, (), list(fp8.parameters()), masters)
        used = [r.reason for r in te_compile.report().sites if r.op == "linear"]
        out[name] = {"reasons": used, "losses": losses, "bytes": [_buffers(p)[0].clone() for p in fp8.parameters()],
                     "used_as_is": sum("used as is" in r for r in used)}
    return out


def test_ddp_trains_fp8_primary_weights_like_on_the_fly_weights(world):
    r0, r1 = (r["ddp"] for r in world)
    for name in DDP_NAMES:
        assert r0[name]["used_as_is"] >= 3, (name, r0[name]["reasons"])
        for rank, result in enumerate((r0, r1)):
            for step, (ref, fp8) in enumerate(result[name]["losses"]):
                assert_bitwise_equal(ref, fp8, f"{name} rank {rank} step {step}")
        # DDP averaged the gradients: both ranks hold the same weights
        for a, b in zip(r0[name]["bytes"], r1[name]["bytes"]):
            assert_bitwise_equal(a, b, name)


# ---- FSDP2 -------------------------------------------------------------------------------------------

class _Layer(nn.Module):
    """One linear (+ GELU) with a user-defined forward, the unit FSDP2 shards and Dynamo compiles
    (Dynamo does not compile the forward frame of torch's own nn.Linear)."""

    def __init__(self, k: int, n: int, act: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(k, n, bias=False)
        self.act = act

    def forward(self, x):
        y = self.linear(x)
        return nn.functional.gelu(y) if self.act else y


# FSDP2 layer widths: per-tensor formats take any rows (96 and 160 rows over 2 ranks split unevenly
# into neither 32- nor 128-row blocks); block formats need each rank's rows to be whole blocks.
FSDP_DIMS = {"Float8CurrentScaling": (64, 96, 160, 64), "DelayedScaling": (64, 96, 160, 64),
             "MXFP8BlockScaling": (64, 128, 192, 64), "Float8BlockScaling": (128, 256, 512, 256)}


class _Layers(nn.Module):
    def __init__(self, dims=FSDP_DIMS["Float8CurrentScaling"]) -> None:
        super().__init__()
        pairs = list(zip(dims, dims[1:]))
        self.layers = nn.ModuleList([_Layer(k, n, act=i < len(pairs) - 1) for i, (k, n) in enumerate(pairs)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _fsdp_rank(rank: int, name: str, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    recipe, _ = RECIPES[name]
    world = dist.get_world_size()
    dims = FSDP_DIMS[name]
    ref, fp8 = _twins(recipe, lambda: _Layers(dims))
    # the master shard of each weight: the rows FSDP2 gives this rank (dim-0 chunks)
    masters, starts = [], []
    for p in fp8.parameters():
        rows = p.get_high_precision_init_val().chunk(world)[rank]
        masters.append(rows.reshape(-1).clone())
        starts.append(rank * -(-p.shape[0] // world) * p.shape[1])
    # torchtitan's layout: each layer sharded and compiled on its own (FSDP2's hooks break the graph
    # of the root's forward between layers), the root sharded too
    options = {"recipe": name, "compiler": "aot_eager"}
    for model in (ref, fp8):
        for layer in model.layers:
            fully_shard(layer)
            layer.compile(backend=te_compile.backend(**options))
        fully_shard(model)
    gathered = []
    patched = dist.all_gather_single   # what FSDP2 all-gathers with (torch 2.13)

    def counting(output, input, *args, **kwargs):
        gathered.append((input.dtype, input.numel() * input.element_size()))
        return patched(output, input, *args, **kwargs)

    dist.all_gather_single = counting
    models = (ref, fp8)
    te_compile.reset()
    losses = []
    try:
        for step in range(4):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x, target = torch.randn(16, dims[0], generator=gen), torch.randn(16, dims[-1], generator=gen)
            pair, sent = [], []
            for model in models:
                gathered.clear()
                loss = nn.functional.mse_loss(model(x), target)
                loss.backward()
                pair.append(loss.detach())
                sent.append(list(gathered))
            losses.append(pair)
            _sgd(0.5, ref.parameters())
            with torch.no_grad():
                params = list(fp8.parameters())
                for p, master in zip(params, masters):
                    master -= 0.5 * p.grad.to_local().reshape(-1)
                    p.grad = None
                cast_master_weights_to_fp8(params, masters, start_offsets=starts, amax_reduce_group=dist.group.WORLD,
                                           fsdp_shard_model_weights=[p.to_local() for p in params])
    finally:
        dist.all_gather_single = patched
    # torch.distributed.checkpoint round trip of the sharded FP8 weights: save, move the weights
    # (a cast of other masters), load: the outputs are back to the saved ones, bit for bit
    params = list(fp8.parameters())
    with torch.no_grad():
        saved_out = fp8(x)
        dcp.save(fp8.state_dict(), checkpoint_id=ckpt)
        cast_master_weights_to_fp8(params, [0.5 * m for m in masters], start_offsets=starts,
                                   amax_reduce_group=dist.group.WORLD,
                                   fsdp_shard_model_weights=[p.to_local() for p in params])
        moved_out = fp8(x)
        state = fp8.state_dict()
        dcp.load(state, checkpoint_id=ckpt)
        fp8.load_state_dict(state)
        loaded_out = fp8(x)
    error = None
    if isinstance(recipe, (MXFP8BlockScaling, Float8BlockScaling)):
        # a block-scaled shard's master must be the rank's whole shard (its blocks are cast locally)
        p = next(fp8.parameters())
        try:
            cast_master_weights_to_fp8([p], [masters[0][1:]], start_offsets=[starts[0] + 1],
                                       fsdp_shard_model_weights=[p.to_local()])
        except ValueError as e:
            error = str(e)
    used = [r.reason for r in te_compile.report().sites if r.op == "linear"]
    return {"losses": losses, "sent": sent, "reasons": used, "error": error,
            "dcp": (saved_out, moved_out, loaded_out, type(params[0].to_local())),
            "shard_type": type(next(fp8.parameters()).to_local())}


@pytest.mark.parametrize("name", list(RECIPES))
def test_fsdp2_gathers_fp8_primary_weights_as_bytes(world, name):
    for rank, result in enumerate(r[("fsdp2", name)] for r in world):
        assert result["shard_type"] is RECIPES[name][1]
        ref_sent, fp8_sent = result["sent"]
        assert {dtype for dtype, _ in ref_sent} == {torch.float32}
        # FP8 bytes (MXFP8: both copies) and block scales, packed by FSDP2 into one uint8 buffer
        assert {dtype for dtype, _ in fp8_sent} == {torch.uint8}
        ratio = sum(n for _, n in fp8_sent) / sum(n for _, n in ref_sent)
        assert ratio < (0.54 if name == "MXFP8BlockScaling" else 0.26), ratio
        assert sum("used as is" in r for r in result["reasons"]) >= 3, result["reasons"]
        for step, (ref, fp8) in enumerate(result["losses"]):
            assert_bitwise_equal(ref, fp8, f"{name} rank {rank} step {step}")
        assert result["losses"][-1][0] != result["losses"][0][0], "training moved"
        saved_out, moved_out, loaded_out, loaded_type = result["dcp"]
        assert not torch.equal(saved_out, moved_out), "the cast moved the weights"
        assert loaded_type is RECIPES[name][1]
        assert_bitwise_equal(saved_out, loaded_out, f"{name} rank {rank}: DCP round trip")
        if name in ("MXFP8BlockScaling", "Float8BlockScaling"):
            assert "must be the rank's whole shard" in result["error"], result["error"]


# ---- model code we did not write ---------------------------------------------------------------------

def test_hf_llama_with_fp8_primary_weights_trains_like_on_the_fly_weights():
    """An unchanged Hugging Face Llama built inside quantized_model_init (its post_init re-initializes
    the weights in place through .data): 3 steps bitwise equal to fp32 weights quantized on the fly."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    with quantized_model_init(recipe=DelayedScaling(), preserve_high_precision_init_val=True):
        fp8 = transformers.LlamaForCausalLM(config)
    ref = transformers.LlamaForCausalLM(config)
    quantized = _train_hf_twins(ref, fp8, "DelayedScaling", vocab=256, tokens=32)
    assert len(quantized) == 8, sorted(quantized)   # q, k, v, o, gate, up, down, lm_head
    used = [s.reason for s in te_compile.report().sites if s.op == "linear"]
    assert sum("used as is" in r for r in used) == len(quantized)


def _train_hf_twins(ref, fp8, recipe: str, vocab: int, tokens: int) -> dict:
    """Train two HF causal LMs 3 SGD steps under te: ``ref`` with high-precision weights quantized on
    the fly, ``fp8`` with FP8 primary weights through fp32 masters; the losses must be bitwise equal.
    ``ref`` starts from ``fp8``'s kept initial values. Returns fp8's quantized parameters by name."""
    quantized = {n: p for n, p in fp8.named_parameters() if isinstance(p, QuantizedTensor)}
    with torch.no_grad():
        for (name, a), b in zip(ref.named_parameters(), fp8.parameters()):
            a.copy_(b.get_high_precision_init_val() if name in quantized else b)
    masters = [p.get_high_precision_init_val().clone() for p in quantized.values()]
    options = {"recipe": recipe, "compiler": "aot_eager"}
    models = [torch.compile(m, backend=te_compile.backend(**options)) for m in (ref, fp8)]
    ids = torch.randint(0, vocab, (2, tokens), generator=torch.Generator().manual_seed(1))
    te_compile.reset()
    for step in range(3):
        losses = []
        for model in models:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        assert_bitwise_equal(losses[0], losses[1], f"step {step}")
        _sgd(0.1, ref.parameters())
        _sgd(0.1, [p for n, p in fp8.named_parameters() if n not in quantized], list(quantized.values()), masters)
    return quantized


def test_expert_weights_get_one_scale_per_expert_and_their_master_cast_equals_quantizing_them():
    from te_compile.scaling import quantize_per_expert
    from te_compile.tensor.grouped_float8_tensor import GroupedFloat8Tensor

    recipe = Float8CurrentScaling(use_power_2_scales=True)
    with quantized_model_init(recipe=recipe):
        experts = nn.Module()
        experts.w = nn.Parameter(torch.randn(4, 48, 32))
        experts.w_odd = nn.Parameter(torch.randn(4, 48, 24))   # K = 24: stays high precision
        experts.bias = nn.Parameter(torch.randn(4, 48))         # 2-D, not a linear's: left as it is
    assert isinstance(experts.w, GroupedFloat8Tensor) and type(experts.w_odd) is nn.Parameter
    assert type(experts.bias) is nn.Parameter
    master = torch.randn(4, 48, 32) * torch.tensor([1.0, 100.0, 0.01, 3.0]).view(4, 1, 1)
    cast_master_weights_to_fp8([experts.w], [master])
    data, scale_inv, _ = quantize_per_expert(master, "weight", recipe)
    assert_bitwise_equal(experts.w._data, data.view(torch.uint8), "bytes")
    assert_bitwise_equal(experts.w._scale_inv, scale_inv, "per-expert scales (powers of two)")


@pytest.mark.parametrize("name", ["Float8CurrentScaling", "DelayedScaling"])
def test_hf_mixtral_expert_weights_as_fp8_primary_weights_train_like_on_the_fly_weights(name):
    """A tiny Hugging Face Mixtral (fp32: transformers' grouped GEMM op reads the 3-D expert weights as
    they are) built inside quantized_model_init: its expert weights become GroupedFloat8Tensors with one
    scale per expert, the grouped GEMMs use their bytes, and 3 SGD steps through fp32 masters and
    cast_master_weights_to_fp8 are bitwise equal to fp32 weights quantized on the fly."""
    from te_compile.tensor.grouped_float8_tensor import GroupedFloat8Tensor

    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32)
    recipe, _ = RECIPES[name]
    torch.manual_seed(0)
    with quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        fp8 = transformers.MixtralForCausalLM(config)
    ref = transformers.MixtralForCausalLM(config)
    experts = fp8.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, GroupedFloat8Tensor) and experts.gate_up_proj._scale_inv.shape == (4,)
    _train_hf_twins(ref, fp8, name, vocab=64, tokens=16)
    grouped = [s.reason for s in te_compile.report().sites if s.op == "grouped_linear"]
    assert grouped and all("weight already FP8 per expert" in r for r in grouped[len(grouped) // 2:]), grouped


def test_state_dict_round_trip_of_fp8_primary_weights(tmp_path):
    with quantized_model_init(recipe=Float8CurrentScaling()):
        model = nn.Linear(64, 32)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    with quantized_model_init(recipe=Float8CurrentScaling()):
        other = nn.Linear(64, 32)
    other.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    _assert_same_quantized(other.weight, model.weight, "load_state_dict of a Float8Tensor")
    assert type(other.weight) is Float8Tensor
    # a high-precision checkpoint loads into an FP8 weight by quantizing it
    plain = nn.Linear(64, 32)
    other.load_state_dict(plain.state_dict())
    _assert_same_quantized(other.weight, weight_quantizer(Float8CurrentScaling()).quantize(plain.weight.detach()),
                           "load_state_dict of fp32 values")
