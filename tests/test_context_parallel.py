"""Context-parallel FP8 attention: the sequence split load-balanced over the cp ranks, K and V
exchanged in FP8 and scaled with the whole sequence's amaxes, so each rank's bytes are one process's.

The multi-process tests share one world of 2 gloo ranks (``utils.run_ranks``), compiled with
aot_eager so that a compile costs seconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from utils import needs_gloo, run_ranks, sqnr

pytestmark = needs_gloo

WORLD = 2


# ---------------------------------------------------------------------------------------------
# Context-parallel FP8 attention (the op; not routed from SDPA sites yet)


def _cp_worker(rank: int) -> dict:
    """Causal attention over a 32-token sequence split load-balanced over 2 ranks (rank 0: positions
    0-7 and 24-31), GQA (4 query heads, 2 key/value heads), against one process's FP8 attention."""
    from torch.distributed.device_mesh import init_device_mesh

    import te_compile.lowerings.context_parallel_attention as cpa
    from te_compile.distributed import mesh_dim_group
    from te_compile.lowerings.attention import AttentionSpec, Fp8AttentionFunction
    from te_compile.recipe import Float8CurrentScaling

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    group = mesh_dim_group(mesh, 0)
    gathered, real = [], cpa._gather_seq

    def counting(x, g):
        gathered.append((str(x.dtype), x.numel() * x.element_size()))
        return real(x, g)

    gen = torch.Generator().manual_seed(0)
    b, h, hkv, t, d = 2, 4, 2, 32, 16
    q = torch.randn(b, h, t, d, generator=gen)
    k, v = (torch.randn(b, hkv, t, d, generator=gen) for _ in range(2))
    do = torch.randn(b, h, t, d, generator=gen)
    pos = te_compile.load_balanced_positions(t, rank, WORLD)
    out = {"pos": pos, "kv_bf16_bytes": 2 * b * hkv * len(pos) * d * 2, "model": _cp_model_worker(rank)}
    # the public split and its inverse, on a token batch [B, T] and FP8 bytes along dim 2 of [B, H, T, D]
    ids, fp8 = torch.randint(0, 100, (2, t), generator=gen), q.to(torch.float8_e4m3fn)
    shards = te_compile.context_parallel_shard(mesh, [ids, fp8], seq_dims=[1, -2])
    out["split"] = {"shards": shards, "expected": [ids[:, pos], fp8[:, :, pos]],
                    "back": te_compile.context_parallel_unshard(mesh["cp"], shards, seq_dims=[-1, 2]),
                    "full": [ids, fp8]}
    try:
        te_compile.context_parallel_shard(mesh, [ids[:, :30]], seq_dims=[1])
    except ValueError as e:
        out["split"]["error"] = str(e)
    for fp8_backward in (False, True):
        cpa._gather_seq = counting
        try:
            local = [x[:, :, pos].clone().requires_grad_() for x in (q, k, v)]
            o = cpa.ContextParallelAttention.apply(*local, pos, group, True, d ** -0.5,
                                                   torch.float8_e5m2 if fp8_backward else None)
            o.backward(do[:, :, pos])
        finally:
            cpa._gather_seq = real
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        spec = AttentionSpec("attn", Float8CurrentScaling(), d ** -0.5, True, fp8_backward)
        ref = Fp8AttentionFunction.apply(*full, None, spec, None, None, None, None, None)
        ref.backward(do)
        out[fp8_backward] = {"o": (o.detach(), ref.detach()[:, :, pos]),
                             "grads": [(x.grad, f.grad[:, :, pos]) for x, f in zip(local, full)],
                             "gathered": list(gathered)}
        gathered.clear()
    return out


class CpGPT(nn.Module):
    """A one-block GPT that takes its tokens' global positions (context parallelism keeps them global)."""

    def __init__(self, vocab: int = 64, d: int = 32, block: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.ln, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, positions):   # idx [B, t], positions [t]
        x = self.tok(idx) + self.pos(positions)
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in self.qkv(self.ln(x)).split(d, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        x = x + self.out(F.gelu(self.fc(x)))
        return self.head(self.ln_f(x))


def _cp_model_worker(rank: int) -> dict:
    """CpGPT trained 3 steps with the sequence split over 2 context-parallel ranks (gradients summed
    over them by hand), against one process on the whole sequence; and the error for a site that
    cannot run context-parallel."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    losses, sites, states, first_logits = {}, {}, {}, {}
    # DelayedScaling: the "fp8" backward, and the amax group left to one rank, so that only the
    # context-parallel reduction te adds for the attention makes its state one process's
    delayed = {"recipe": "DelayedScaling", "recipe_options": {"fp8_dpa_backward": "fp8"}, "amax_group": "none"}
    for mode in ("cp", "one", "cp delayed", "one delayed"):
        torch._dynamo.reset()
        te_compile.reset()
        torch.manual_seed(0)
        model = CpGPT()
        options = {"recipe": "Float8CurrentScaling", "compiler": "aot_eager", "rewrite": {"sdpa": True}}
        if mode.endswith("delayed"):
            options.update(delayed)
        if mode.startswith("cp"):
            options.update(distributed={"context_parallel": "cp"}, mesh=mesh)
        compiled = torch.compile(model, backend="te", options=options)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[mode] = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            idx, target = torch.randint(0, 64, (2, 32), generator=gen), torch.randint(0, 64, (2, 32), generator=gen)
            pos = torch.arange(32)
            if mode.startswith("cp"):   # this rank's rows, their global positions kept
                idx, target, pos = te_compile.context_parallel_shard(mesh, [idx, target, pos], seq_dims=[1, 1, 0])
            logits = compiled(idx, pos)
            if step == 0:
                first_logits[mode] = (te_compile.context_parallel_unshard(mesh, [logits], seq_dims=[1])[0]
                                      if mode.startswith("cp") else logits.detach())
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
            total = loss.detach().clone()
            if mode.startswith("cp"):   # equal token counts: the global mean is the mean of the ranks' means
                (loss / WORLD).backward()   # so dO is one process's too
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                dist.all_reduce(total)
                total /= WORLD
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses[mode].append(total.item())
        sites[mode] = [(r.rewritten, r.reason, r.collectives) for r in te_compile.report().sites if r.op == "sdpa"]
        states[mode] = {k: v for k, v in te_compile.recipe_state_dict(model).items() if "sdpa" in k}
    torch._dynamo.reset()

    def masked(x, mask):
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)

    try:
        torch.compile(masked, backend="te", options={"recipe": "Float8CurrentScaling", "compiler": "aot_eager",
                                                     "distributed": {"context_parallel": "cp"}, "mesh": mesh})(
            torch.randn(1, 2, 8, 16), torch.ones(8, 8, dtype=torch.bool))
        error = ""
    except Exception as e:   # Dynamo wraps the backend's ConfigError
        error = str(e)
    torch._dynamo.reset()
    try:
        torch.compile(lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True), backend="te", options={
            "recipe": "Float8CurrentScaling", "compiler": "aot_eager", "distributed": {"context_parallel": "sp"},
            "mesh": mesh})(torch.randn(1, 2, 8, 16))
        unknown = ""
    except Exception as e:
        unknown = str(e)
    return {"losses": losses, "sites": sites, "states": states, "error": error, "unknown_dim": unknown,
            "first_logits": first_logits}


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    """One spawned world for every multi-process case of this file (a spawn costs seconds of imports
    per rank)."""
    return run_ranks(_cp_worker, tmp_path_factory.mktemp("context_parallel"))


@pytest.mark.parametrize("fp8_backward", [False, True], ids=["high_precision", "fp8"])
def test_context_parallel_fp8_attention_matches_one_process(cp_results, fp8_backward):
    """Every rank scales Q, K, V (and O; dO in the "fp8" backward) with the whole sequence's per-head
    amax, so its FP8 bytes are one process's: the local output and gradients equal the unsharded FP8
    attention's to fp32 rounding."""
    covered = torch.cat([r["pos"] for r in cp_results]).sort().values
    assert torch.equal(covered, torch.arange(32))
    for r in (r[fp8_backward] for r in cp_results):
        o, ref = r["o"]
        assert sqnr(ref, o) >= 40, sqnr(ref, o)
        for (g, g_ref), name in zip(r["grads"], "qkv"):
            assert sqnr(g_ref, g) >= 40, (name, sqnr(g_ref, g))


def test_context_parallel_shard_and_unshard(cp_results):
    """te_compile.context_parallel_shard gives each rank its load-balanced rows (rank 0: chunks 0 and 3 of
    4), along any dim and for FP8 bytes; context_parallel_unshard puts every rank's rows back in order."""
    def bits(x):   # FP8 compared as its bytes
        return (x.dtype, x.shape, x.view(torch.uint8) if x.dtype.itemsize == 1 else x)

    def same(a, b):
        return a[:2] == b[:2] and torch.equal(a[2], b[2])

    assert torch.equal(cp_results[0]["pos"], torch.cat([torch.arange(8), torch.arange(24, 32)]))
    for r in cp_results:
        split = r["split"]
        for got, want in [*zip(split["shards"], split["expected"]), *zip(split["back"], split["full"])]:
            assert same(bits(got), bits(want)), (got.shape, want.shape)
        assert split["error"] == "context_parallel_shard: buffers[0] has 30 positions along dim 1; 2 ranks need " \
                                 "a multiple of 4", split["error"]


def test_context_parallel_trains_a_gpt_as_one_process_does(cp_results):
    for r in cp_results:
        m = r["model"]
        # the first step's logits, put back together: one process's, but for the FP8 linears, which scale
        # each rank's activations on their own (two roundings apart; 29.5 dB seen)
        assert sqnr(m["first_logits"]["one"], m["first_logits"]["cp"]) >= 25, \
            sqnr(m["first_logits"]["one"], m["first_logits"]["cp"])
        cp, one = m["losses"]["cp"], m["losses"]["one"]
        # the attention's bytes are one process's; the linears scale each rank's activations alone
        assert cp == pytest.approx(one, rel=2e-3), (cp, one)
        [(rewritten, reason, collectives)] = m["sites"]["cp"]
        assert rewritten and reason.startswith("context parallel over cp (2 ranks)"), reason
        assert "all-gather over cp (2 ranks): K, V in FP8" in collectives
        assert "distributed.context_parallel = 'cp', but the SDPA call in <root> cannot run context-parallel: " \
               "an attn_mask" in m["error"], m["error"]
        assert "distributed.context_parallel: the mesh has no dim 'sp'; its dims are ['cp']" in m["unknown_dim"], \
            m["unknown_dim"]


def test_context_parallel_under_delayed_scaling(cp_results):
    """DelayedScaling ("fp8" backward): Q, K, V, dO per tensor with the state's scales, the attention's
    amaxes reduced over the context-parallel ranks (here the only reduction: amax_group = "none"), so
    every rank's histories are one process's: the first step's entries exactly, the later ones as
    close as the runs (each rank's linears keep their own scales under "none"); training follows one
    process's."""
    for r in cp_results:
        m = r["model"]
        cp, one = m["losses"]["cp delayed"], m["losses"]["one delayed"]
        assert cp == pytest.approx(one, rel=2e-3), (cp, one)
        [(rewritten, reason, collectives)] = m["sites"]["cp delayed"]
        assert rewritten and "Q, K, V, dO per tensor with delayed scaling" in reason, reason
        assert "amax history all-reduce over cp (2 ranks)" in collectives, collectives
        states, ref = m["states"]["cp delayed"], m["states"]["one delayed"]
        assert states.keys() == ref.keys() and any(k.endswith("amax_history") for k in states), states.keys()
        histories = [k for k in ref if k.endswith("amax_history")]
        assert len(histories) == 4, histories   # q, k, v, dO
        for key in histories:   # [history len, 1], the newest first: 3 steps
            assert ref[key][:3].gt(0).all(), key
            torch.testing.assert_close(states[key][2], ref[key][2], rtol=1e-6, atol=0, msg=key)
            torch.testing.assert_close(states[key], ref[key], rtol=5e-2, atol=0, msg=key)   # seen: 4%


def test_context_parallel_exchanges_k_and_v_in_fp8(cp_results):
    for r in cp_results:
        gathered = r[False]["gathered"]
        kv = [(dtype, n) for dtype, n in gathered if dtype == "torch.uint8"]
        assert len(kv) == 2 and all(dtype != "torch.bfloat16" for dtype, _ in gathered), gathered
        assert sum(n for _, n in kv) / r["kv_bf16_bytes"] == 0.5   # K and V bytes against bf16's
