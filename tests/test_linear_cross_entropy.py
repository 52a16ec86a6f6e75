"""The output layer and its cross_entropy as one chunked op (passes/ and lowerings/linear_cross_entropy.py):
the lowering's numerics against the unfused path of the same precision, the spellings the pass
follows in hand-written and Hugging Face models, what it leaves alone and why, and that no
[tokens, vocab] tensor is saved for backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import te_compile
from te_compile.config import ConfigError, load_config
from te_compile.lowerings.linear import LinearLowering, LinearSpec
from te_compile.lowerings.linear_cross_entropy import (LinearCrossEntropyLowering, LinearCrossEntropySpec,
                                                       chunk_rows)
from te_compile.recipe import DelayedScaling, Float8CurrentScaling
from utils import assert_bitwise_equal, seed, sqnr

M, K, V = 96, 64, 80


def _operands(dtype, gen, bias=True, ignored=7):
    x = torch.randn(M, K, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(V, K, generator=gen) / K ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(V, generator=gen).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (M,), generator=gen)
    labels[::ignored] = -100
    return x, w, b, labels


def _steps_ref(z, steps):
    for kind, value in steps:
        z = z.to(value) if kind == "cast" else torch.tanh(z / value) * value
    return z


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


# ---- the lowering ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [
    dict(), dict(reduction="sum"), dict(label_smoothing=0.1), dict(steps=(("softcap", 3.0),)),
    dict(steps=(("cast", torch.float32),), chunk=7), dict(chunk=M)],
    ids=["mean", "sum", "smoothing", "softcap", "cast-uneven-chunks", "one-chunk"])
def test_high_precision_equals_the_unfused_loss_and_gradients_to_fp32_rounding(dtype, case):
    x, w, b, labels = _operands(dtype, seed(1))
    spec = LinearCrossEntropySpec("lm_head", None, **{"chunk": 16, **case})
    loss, logits = LinearCrossEntropyLowering(spec)(x, w, b, labels)
    assert logits is None
    z = _steps_ref(F.linear(x, w, b), spec.steps)
    ref = F.cross_entropy(z, labels, reduction=spec.reduction, label_smoothing=spec.label_smoothing)
    assert loss.dtype == ref.dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2   # bf16: the unfused loss itself is computed in bf16
    assert abs(float(loss) - float(ref)) <= tol * abs(float(ref)), (float(loss), float(ref))
    for got, want, name in zip(_grads(loss, (x, w, b)), _grads(ref, (x, w, b)), "xwb"):
        assert sqnr(want.float(), got.float()) > (100 if dtype == torch.float32 else 35), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["plain", "smoothing"])
def test_fp8_logits_bit_exact_per_chunk_and_gradients_close_to_the_unfused_fp8_path(dtype, smoothing):
    x, w, b, labels = _operands(dtype, seed(2))
    recipe = Float8CurrentScaling()
    spec = LinearCrossEntropySpec("lm_head", recipe, steps=(("cast", torch.float32),), label_smoothing=smoothing,
                                  chunk=32, logits_steps=0)
    loss, logits = LinearCrossEntropyLowering(spec)(x, w, b, labels)
    z = LinearLowering(LinearSpec("lm_head", recipe))(x, w, b)
    assert_bitwise_equal(logits, z.detach(), "the chunks read the whole tensors' scales")
    assert not logits.requires_grad
    ref = F.cross_entropy(z.float(), labels, label_smoothing=smoothing)
    assert abs(float(loss) - float(ref)) <= 1e-5 * float(ref)
    hp = F.cross_entropy(F.linear(x.float(), w.float(), b.float()), labels, label_smoothing=smoothing)
    got = _grads(loss, (x, w, b))
    for g, want, high, name in zip(got, _grads(ref, (x, w, b)), _grads(hp, (x, w, b)), "xwb"):
        assert sqnr(want.float(), g.float()) >= (20 if smoothing else 30), name
        assert sqnr(high.float(), g.float()) >= 20, name


def test_delayed_scaling_uses_its_grad_output_scale_bit_for_bit_and_reports_the_real_amaxes():
    x, w, b, labels = _operands(torch.float32, seed(3), bias=False)
    recipe = DelayedScaling()
    scales = [torch.tensor([s]) for s in (2.0, 8.0, 4096.0)]
    carrier = torch.zeros(3, requires_grad=True)
    fused = LinearCrossEntropyLowering(LinearCrossEntropySpec("lm_head", recipe, chunk=16))
    loss, _ = fused(x, w, None, labels, None, None, carrier, *scales)
    dx, dw, amaxes = torch.autograd.grad(loss, (x, w, carrier))
    carrier2 = torch.zeros(3, requires_grad=True)
    z = LinearLowering(LinearSpec("lm_head", recipe))(x, w, None, carrier2, *scales)
    ref_dx, ref_dw, ref_amaxes = torch.autograd.grad(F.cross_entropy(z, labels), (x, w, carrier2))
    # dz is the same in fp32 up to summation order; quantized with the same scale it mostly is the
    # same bytes, and dw is one GEMM over every row, as the unfused path's
    assert sqnr(ref_dx, dx) > 60 and sqnr(ref_dw, dw) > 60
    assert_bitwise_equal(amaxes[:2], ref_amaxes[:2])
    assert abs(float(amaxes[2]) - float(ref_amaxes[2])) <= 1e-6 * float(ref_amaxes[2])


def test_forward_gemms_are_the_logits_and_the_backward_recomputes_none(monkeypatch):
    """The forward computes each chunk's gradient from its logits, so the backward runs no logits GEMM:
    one dgrad GEMM and one weight-gradient GEMM, each over every row of the forward's FP8 gradient
    (per-chunk dgrads would each be copied into the result; per-chunk [V, K] fp32 partial products,
    added up, would become one inductor kernel reading them all, every chunk's buffer alive at once)."""
    import te_compile.lowerings.linear_cross_entropy as lce

    calls = []

    def counting(a, b, *args, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return fp8_gemm(a, b, *args, **kwargs)

    fp8_gemm = lce.fp8_gemm
    monkeypatch.setattr(lce, "fp8_gemm", counting)
    x, w, b, labels = _operands(torch.float32, seed(4))
    spec = LinearCrossEntropySpec("lm_head", Float8CurrentScaling(), chunk=32)
    loss, _ = LinearCrossEntropyLowering(spec)(x, w, b, labels)
    assert calls == [((32, K), (K, V))] * (M // 32), calls   # the logits, chunk by chunk
    calls.clear()
    dx, dw = torch.autograd.grad(loss, (x, w))
    assert calls == [((M, V), (V, K)), ((V, M), (M, K))], calls
    ref = F.cross_entropy(LinearLowering(LinearSpec("lm_head", Float8CurrentScaling()))(x, w, b), labels)
    assert sqnr(_grads(ref, (w,))[0], dw) >= 30


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling()], ids=["hp", "fp8"])
def test_a_forward_without_backward_computes_no_gradient(monkeypatch, recipe):
    """Under no_grad (or with nothing requiring grad) the forward runs the logits GEMMs only and saves
    nothing: no [M, V] gradient is made."""
    import te_compile.lowerings.linear_cross_entropy as lce

    made = []
    real = lce._logit_grad
    monkeypatch.setattr(lce, "_logit_grad", lambda *a: made.append(1) or real(*a))
    x, w, b, labels = _operands(torch.float32, seed(5))
    fused = LinearCrossEntropyLowering(LinearCrossEntropySpec("lm_head", recipe, chunk=32))
    with torch.no_grad():
        nograd, _ = fused(x, w, b, labels)
    detached, _ = fused(x.detach(), w.detach(), b.detach(), labels)
    assert made == []
    loss, _ = fused(x, w, b, labels)
    assert len(made) == M // 32
    assert_bitwise_equal(nograd, loss.detach())
    assert_bitwise_equal(detached, loss.detach())


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling(), DelayedScaling()], ids=["hp", "current", "delayed"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_loss_gradient_scales_the_forwards_gradient(recipe, reduction):
    """The forward's gradient is for an upstream gradient of 1; the backward's gradient g scales the
    GEMMs (FP8: their scale_inv): a power of two gives g times the gradients bit for bit, 3 gives them
    to fp32 rounding (the GEMM scales its operands by a rounded product)."""
    x, w, b, labels = _operands(torch.float32, seed(6), bias=recipe is None or isinstance(recipe, Float8CurrentScaling))
    fused = LinearCrossEntropyLowering(LinearCrossEntropySpec("lm_head", recipe, chunk=32, reduction=reduction))
    delayed = ()
    if isinstance(recipe, DelayedScaling):
        delayed = (torch.zeros(3, requires_grad=True), *[torch.tensor([s]) for s in (2.0, 8.0, 4096.0)])
    params = [t for t in (x, w, b) if t is not None]

    def grads(scale):
        loss, _ = fused(x, w, b, labels, None, None, *delayed)
        return torch.autograd.grad(loss * scale, params)

    ones = grads(1.0)
    for got, want in zip(grads(4.0), ones):
        assert_bitwise_equal(got, want * 4)
    for got, want in zip(grads(3.0), ones):
        assert sqnr(want * 3, got) >= 100


@pytest.mark.parametrize("reduction, expected", [("mean", float("nan")), ("sum", 0.0)])
@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling()], ids=["hp", "fp8"])
def test_every_row_ignored_gives_torchs_loss_and_zero_gradients(reduction, expected, recipe):
    x, w, b, labels = _operands(torch.float32, seed(4))
    labels[:] = -100
    spec = LinearCrossEntropySpec("lm_head", recipe, reduction=reduction, chunk=32)
    loss, _ = LinearCrossEntropyLowering(spec)(x, w, b, labels)
    ref = F.cross_entropy(F.linear(x, w, b), labels, reduction=reduction)
    assert (float(loss) != float(loss)) if expected != expected else float(loss) == expected
    assert (float(ref) != float(ref)) if expected != expected else float(ref) == expected
    for g in _grads(loss, (x, w, b)):
        assert torch.count_nonzero(g) == 0 and torch.isfinite(g).all()


def test_chunk_rows_keeps_a_chunks_logits_about_as_large_as_the_input():
    assert chunk_rows(8192, 4096, 128256) == 512       # 8192 * 4096 / 128256 = 261.6 -> 512
    assert chunk_rows(100, 64, 64) == 100              # never more than the rows
    assert chunk_rows(100_000, 8, 5_000_000) == 16     # never fewer than 16
    assert chunk_rows(100_000, 8, 50_000) == 84        # nor under 2**22 logits a chunk
    assert chunk_rows(1000, 8, 50_000, chunk=3) == 3   # the config's choice
    with pytest.raises(ValueError, match="reduction must be"):
        LinearCrossEntropyLowering(LinearCrossEntropySpec("lm_head", None, reduction="none"))


# ---- the pass, on hand-written models -------------------------------------------------------------


class NanoGPTHead(nn.Module):
    """nanoGPT's spelling: the final norm, the head, ``cross_entropy(logits.view(-1, V), y.view(-1),
    ignore_index=-1)``; with ``shift``, the causal shift taken from the logits."""

    def __init__(self, vocab=64, bias=False, shift=False, tied=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, 32)
        self.fc = nn.Linear(32, 32)
        self.ln_f = nn.LayerNorm(32)
        self.lm_head = nn.Linear(32, vocab, bias=bias)
        if tied:
            self.lm_head.weight = self.wte.weight
        self.shift = shift

    def forward(self, idx, targets):
        logits = self.lm_head(self.ln_f(F.gelu(self.fc(self.wte(idx)))))
        if self.shift:   # returns the loss alone: the op would compute only the rows the loss reads
            flat = logits[..., :-1, :].contiguous().view(-1, logits.size(-1))
            return None, F.cross_entropy(flat, targets[..., 1:].reshape(-1), ignore_index=-1)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def _train_pair(model, recipe, idx, targets, **rewrite):
    """(fused model, unfused model, fused outputs, unfused outputs), one forward + backward each; the
    outputs are (logits, loss, the report's rows). The norm stays unfused unless ``rewrite`` says."""
    ref = copy.deepcopy(model)
    outs = []
    for m, on in ((model, True), (ref, False)):
        torch._dynamo.reset()
        te_compile.reset()
        backend = te_compile.backend(recipe=recipe, compiler="aot_eager",
                                     rewrite={"linear_cross_entropy": on, "layer_norm": False, **rewrite})
        logits, loss = torch.compile(m, backend=backend)(idx, targets)
        loss.backward()
        outs.append((logits, loss, te_compile.report().sites))
    return model, ref, outs[0], outs[1]


def _rows(sites, op="linear_cross_entropy"):
    return [r for r in sites if r.op == op]


@pytest.mark.parametrize("recipe, form", [
    ("Float8CurrentScaling", "view"), ("Float8CurrentScaling", "shift"), ("Float8CurrentScaling", "tied-bias"),
    ("DelayedScaling", "shift"), ("none", "tied-bias")])
def test_nanogpt_head_is_fused_with_the_unfused_loss_and_logits(recipe, form):
    torch.manual_seed(0)
    model = NanoGPTHead(bias=form == "tied-bias", shift=form == "shift", tied=form == "tied-bias")
    idx = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    targets[0, :4] = -1
    fused, ref, (logits, loss, sites), (ref_logits, ref_loss, ref_sites) = _train_pair(
        model, recipe, idx, targets, linear_cross_entropy_chunk=8)
    rows, ref_rows = _rows(sites), _rows(ref_sites)
    assert [r.rewritten for r in rows] == [True], rows
    assert "8-row chunks" in rows[0].reason and "no [tokens, 64] logits" in rows[0].reason
    assert [r.rewritten for r in ref_rows] == [False]
    if form != "shift":
        assert_bitwise_equal(logits, ref_logits.detach(), "the logits the model returns")
        assert not logits.requires_grad
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
    floor = 100 if recipe == "none" else 30
    for (name, p), q in zip(fused.named_parameters(), ref.parameters()):
        assert sqnr(q.grad, p.grad) >= floor, name


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
def test_final_norm_fuses_into_the_op_as_it_fuses_into_the_unfused_head(recipe):
    """ln_f's output quantized by the norm kernels, as the unfused path's norm -> lm_head fusion does:
    the same FP8 operand, so the same logits; DelayedScaling (the same grad_output scale) gives the
    same gradients bit for bit."""
    torch.manual_seed(0)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    model, ref, (logits, loss, sites), (ref_logits, ref_loss, ref_sites) = _train_pair(
        NanoGPTHead(), recipe, idx, targets, layer_norm=True, linear_cross_entropy_chunk=8)
    assert [r.reason for r in _rows(sites, "layer_norm")] == ["fused into lm_head's output layer and loss"]
    assert [r.reason for r in _rows(ref_sites, "layer_norm")] == ["fused into lm_head"]
    assert_bitwise_equal(logits, ref_logits.detach())
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * float(ref_loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if recipe == "DelayedScaling":
            assert_bitwise_equal(p.grad, q.grad, name)
        else:
            assert sqnr(q.grad, p.grad) >= 30, name


class GptFastTail(nn.Module):
    """gpt-fast's Transformer, one SwiGLU FFN deep: hand-written RMSNorm (mean(x * x), the weight after
    type_as), ``forward(idx) -> logits``; the loss is the user's, in a compiled train step."""

    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.w1, self.w3 = nn.Linear(dim, 64, bias=False), nn.Linear(dim, 64, bias=False)
        self.w2 = nn.Linear(64, dim, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.output = nn.Linear(dim, vocab, bias=False)

    def norm(self, x):
        out = x.float() * torch.rsqrt(torch.mean(x.float() * x.float(), dim=-1, keepdim=True) + 1e-5)
        return out.type_as(x) * self.norm_weight

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        x = x + self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.output(self.norm(x))


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "none"])
def test_gpt_fast_model_with_a_compiled_train_step(recipe):
    """The loss outside the model, in the step the user compiles: gpt-fast's spelling
    ``cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))``; under FP8 its norm joins the op.
    FP8 gradients: the fused op quantizes the logits' gradient (E5M2) with its bound scale, the unfused
    path with its amax, two roundings of one gradient: each as close to high precision as the other."""
    torch.manual_seed(0)
    model = GptFastTail()
    ref, high = copy.deepcopy(model), copy.deepcopy(model)
    idx, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    losses, rows = [], []
    for m, on, r in ((model, True, recipe), (ref, False, recipe), (high, False, "none")):
        torch._dynamo.reset()
        te_compile.reset()

        def step(idx, y, m=m):
            logits = m(idx)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

        backend = te_compile.backend(recipe=r, compiler="aot_eager",
                                     rewrite={"linear_cross_entropy": on, "linear_cross_entropy_chunk": 8})
        loss = torch.compile(step, backend=backend)(idx, y)
        loss.backward()
        losses.append(float(loss.detach()))
        rows.append({r.op: r for r in te_compile.report().sites if r.op in ("linear_cross_entropy", "rms_norm")})
    assert rows[0]["linear_cross_entropy"].rewritten, rows[0]["linear_cross_entropy"].reason
    if recipe != "none":
        assert rows[0]["rms_norm"].reason == "fused into output's output layer and loss", rows[0]["rms_norm"].reason
    assert abs(losses[0] - losses[1]) <= 1e-5 * losses[1]
    for (name, p), q, h in zip(model.named_parameters(), ref.parameters(), high.parameters()):
        if recipe == "none":
            assert sqnr(q.grad, p.grad) >= 100, name
        else:
            fused, unfused = sqnr(h.grad, p.grad), sqnr(h.grad, q.grad)
            assert fused >= unfused - 3 and sqnr(q.grad, p.grad) >= 20, (name, fused, unfused)


def test_delayed_scaling_state_advances_as_the_unfused_sites():
    torch.manual_seed(0)
    model = NanoGPTHead()
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    fused, ref, _, _ = _train_pair(model, "DelayedScaling", idx, targets)
    state, ref_state = te_compile.recipe_state_dict(fused), te_compile.recipe_state_dict(ref)
    assert state.keys() == ref_state.keys() and any("lm_head" in k for k in state)
    for key in state:
        if "lm_head" in key and "grad_output" not in key:
            assert_bitwise_equal(state[key], ref_state[key], key)


class ShiftedHead(nn.Module):
    """The causal shift on a plain module: logits[..., :-1, :] against labels[..., 1:]."""

    def __init__(self, vocab=96):
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, vocab, bias=False)

    def forward(self, x, labels):
        logits = self.head(torch.relu(self.body(x)))
        return F.cross_entropy(logits[..., :-1, :].reshape(-1, logits.size(-1)), labels[..., 1:].reshape(-1))


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
def test_causal_shift_reads_the_unfused_bytes_and_scales_when_the_dropped_rows_hold_the_amax(recipe):
    """The last position's rows, which the loss drops, hold the input's largest values: the unfused head
    quantizes them too, so the fused op's scale must come from all rows. Three steps (DelayedScaling's
    scales then come from recorded amaxes): the same logits, so losses to fp32 rounding of the row sums;
    under DelayedScaling (the same grad_output scale) gradients and recipe state bit for bit. Current
    scaling quantizes the logits' gradient with its bound scale, not the unfused amax: the first step's
    loss as tight and its gradients close (20 dB: two E5M2 roundings of one gradient), the later
    steps' losses to 1e-3."""
    torch.manual_seed(0)
    base = ShiftedHead()
    x = torch.randn(3, 9, 32)
    x[:, -1] *= 8
    labels = torch.randint(0, 96, (3, 9))
    runs = []
    for fuse in (True, False):
        torch._dynamo.reset()
        te_compile.reset()
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = torch.compile(model, backend=te_compile.backend(
            recipe=recipe, compiler="aot_eager", rewrite={"linear_cross_entropy": fuse}))
        losses = []
        for _ in range(3):
            loss = compiled(x, labels)
            loss.backward()
            losses.append(loss.detach())
            if recipe == "DelayedScaling" or not losses[1:]:   # current scaling: the first step's
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        assert [r.rewritten for r in _rows(te_compile.report().sites)] == [fuse]
        runs.append((losses, grads, te_compile.recipe_state_dict(model)))
    (losses, grads, state), (ref_losses, ref_grads, ref_state) = runs
    exact = recipe == "DelayedScaling"
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(float(a) - float(b)) <= (1e-6 if exact or i == 0 else 1e-3) * float(b), (i, float(a), float(b))
    for name in grads:
        if exact:
            assert_bitwise_equal(grads[name], ref_grads[name], name)
        else:
            assert sqnr(ref_grads[name], grads[name]) >= 20, (name, sqnr(ref_grads[name], grads[name]))
    assert state.keys() == ref_state.keys()
    for key in state:
        assert_bitwise_equal(state[key], ref_state[key], key)


def test_compiled_backward_runs_no_logits_gemm(monkeypatch):
    """The GEMMs touching the vocab dim in the graphs AOTAutograd hands the compilers: the forward's
    chunk logits, then one dgrad and one wgrad over every row in the backward (a recomputing backward
    ran 2 * chunks + 1), and no softmax in the backward. The body's linear, [., 32] x [32, 32], is left
    out by shape."""
    from torch._dynamo.backends import debugging

    real, counts = debugging.aot_eager, {}

    def spy(gm, example_inputs, **kwargs):
        def compiler(name):
            def run(g, inputs):
                counts[name] = sum(1 for n in g.graph.nodes if n.op == "call_function" and n.target in (
                    torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default) and any(
                    96 in a.meta["val"].shape for a in (n, *n.args[:2])))
                counts[name + " exp"] = sum(1 for n in g.graph.nodes if n.target == torch.ops.aten.exp.default)
                return kwargs.get(name, debugging.boxed_nop)(g, inputs)
            run._boxed_call = True
            return run
        return real(gm, example_inputs, fw_compiler=compiler("fw_compiler"), bw_compiler=compiler("bw_compiler"))

    monkeypatch.setattr(debugging, "aot_eager", spy)
    torch._dynamo.reset()
    te_compile.reset()
    x, labels = torch.randn(3, 9, 32), torch.randint(0, 96, (3, 9))
    compiled = torch.compile(ShiftedHead(), backend=te_compile.backend(
        recipe="Float8CurrentScaling", compiler="aot_eager", rewrite={"linear_cross_entropy_chunk": 8}))
    compiled(x, labels).backward()
    assert [r.rewritten for r in _rows(te_compile.report().sites)] == [True]
    assert counts == {"fw_compiler": 3, "bw_compiler": 1 + 1, "fw_compiler exp": 3, "bw_compiler exp": 0}, counts


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_final_norm_under_autocast_runs_ahead_of_the_op_and_trains_as_the_unfused_path(recipe, dtype):
    """final norm -> head -> cross_entropy under autocast, the shape of most language models: the norm
    stays fused in the report (with a note) and runs in plain torch in front of the op; loss and
    gradients match the unfused FP8 path under the same autocast."""
    torch.manual_seed(0)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=dtype):
        model, ref, (_, loss, sites), (_, ref_loss, _) = _train_pair(
            NanoGPTHead(), recipe, idx, targets, layer_norm=True, linear_cross_entropy_chunk=8)
    name = str(dtype).removeprefix("torch.")
    assert [r.reason for r in _rows(sites, "layer_norm")] == [
        f"fused into lm_head's output layer and loss; under autocast ({name}) the norm runs in plain torch "
        "ahead of them"]
    assert [r.rewritten for r in _rows(sites)] == [True]
    assert loss.dtype == ref_loss.dtype == torch.float32   # autocast runs cross_entropy in fp32
    assert abs(float(loss) - float(ref_loss)) <= 2e-3 * float(ref_loss), (float(loss), float(ref_loss))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert sqnr(q.grad.float(), p.grad.float()) >= 25, n


class Unfusable(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.lm_head = nn.Linear(32, 64)
        self.case = case

    def forward(self, x, y):
        logits = self.lm_head(x)
        if self.case == "none-reduction":
            return F.cross_entropy(logits, y, reduction="none").mean()
        if self.case == "class-weights":
            return F.cross_entropy(logits, y, weight=torch.ones(64))
        if self.case == "other-reader":
            return F.cross_entropy(logits, y) + logits.square().mean()
        if self.case == "returned-slice":
            return F.cross_entropy(logits[:-1], y[1:]), logits
        return F.cross_entropy(logits.float().softmax(-1), y)   # "another-op"


@pytest.mark.parametrize("case, reason", [
    ("none-reduction", "reduction='none'"), ("class-weights", "class weights"),
    ("other-reader", "has other readers"), ("another-op", "softmax between the output layer and the loss"),
    ("returned-slice", "the loss reads a slice of their rows")])
def test_what_is_left_alone_says_why(case, reason):
    torch._dynamo.reset()
    te_compile.reset()
    model = Unfusable(case)
    backend = te_compile.backend(recipe="Float8CurrentScaling", compiler="aot_eager")
    out = torch.compile(model, backend=backend)(torch.randn(16, 32), torch.randint(0, 64, (16,)))
    (out[0] if isinstance(out, tuple) else out).backward()
    rows = [r for r in te_compile.report().sites if r.op == "linear_cross_entropy"]
    assert len(rows) == 1 and not rows[0].rewritten and reason in rows[0].reason, rows


@pytest.mark.parametrize("recipe, compiler", [("Float8CurrentScaling", "inductor"), ("none", "aot_eager")])
def test_no_logits_are_saved_for_backward_only_the_gradient_in_one_buffer(recipe, compiler):
    """What the compiled forward hands autograd with the vocab as its last dim: under FP8 the logits'
    gradient, computed chunk by chunk in the forward, as one [tokens, V] buffer of one byte a logit, no
    chunk's logits. In high precision nothing: the GEMMs that read that gradient take the backward's
    loss gradient only as a final scalar multiply, so the partitioner runs them in the forward and
    saves their [tokens, K] and [V, K] products. The unfused path saves the whole [tokens, V] logits."""
    torch._dynamo.reset()
    te_compile.reset()
    model = NanoGPTHead(vocab=256)
    idx, targets = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
    saved = []

    def pack(t):
        saved.append(t)
        return t
    for on in (True, False):
        saved.clear()
        backend = te_compile.backend(recipe=recipe, compiler=compiler, rewrite={"linear_cross_entropy": on,
                                                                                "linear_cross_entropy_chunk": 32})
        compiled = torch.compile(copy.deepcopy(model), backend=backend)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = compiled(idx, targets)
        loss.backward()
        wide = [t for t in saved if t.dim() and t.shape[-1] == 256 and t.numel() >= 16 * 256]
        vocab_bytes = sum(t.numel() * t.element_size() for t in wide)
        if on:
            want = [] if recipe == "none" else [((128, 256), torch.float8_e5m2)]   # HYBRID: E5M2 gradients
            assert [(tuple(t.shape), t.dtype) for t in wide] == want, \
                [(tuple(t.shape), t.dtype) for t in saved]
        else:
            assert vocab_bytes >= 128 * 256 * 4, [tuple(t.shape) for t in saved]


def test_chunk_config_key_is_checked_with_the_file_and_key(tmp_path):
    path = tmp_path / "te.toml"
    path.write_text("[rewrite]\nlinear_cross_entropy_chunk = -4\n")
    with pytest.raises(ConfigError, match=r"te.toml: rewrite.linear_cross_entropy_chunk: must be >= 0"):
        load_config(path)


# ---- the pass, on Hugging Face models -------------------------------------------------------------


def _hf(kind):
    transformers = pytest.importorskip("transformers", reason="needs transformers for HF model code")
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "gemma2":   # final_logit_softcapping: tanh(z / 30) * 30 between the head and the loss
        config = transformers.Gemma2Config(**common, head_dim=16, final_logit_softcapping=30.0)
        return transformers.Gemma2ForCausalLM(config)
    # GPT-2, unchanged: lm_head tied to wte. Its class name names no loss, and transformers warns about
    # that inside loss_function, a call te makes a no-op in traced code (library_warnings.py)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2,
                                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


@pytest.mark.parametrize("kind, recipe", [("llama", "Float8CurrentScaling"), ("llama", "none"),
                                          ("gemma2", "Float8CurrentScaling"), ("gpt2", "Float8CurrentScaling")])
def test_hugging_face_causal_lm_loss_is_fused_and_its_logits_still_returned(kind, recipe):
    torch.manual_seed(0)
    model = _hf(kind)
    if kind == "gemma2":
        model.config._attn_implementation = "eager"
    ids = torch.randint(0, 128, (2, 16))
    ref = copy.deepcopy(model)
    results = []
    for m, on in ((model, True), (ref, False)):
        torch._dynamo.reset()
        te_compile.reset()
        backend = te_compile.backend(recipe=recipe, compiler="aot_eager", rewrite={"linear_cross_entropy": on})
        out = torch.compile(m, backend=backend)(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out, [r for r in te_compile.report().sites if r.op == "linear_cross_entropy"]))
    (out, rows), (ref_out, _) = results
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert [r.rewritten for r in rows] == [True], rows
    assert "still computed for the model's output" in rows[0].reason
    assert_bitwise_equal(out.logits, ref_out.logits.detach(), "logits (soft-capped for Gemma 2)")
    assert abs(float(out.loss) - float(ref_out.loss)) <= 1e-5 * float(ref_out.loss)
    head = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert sqnr(head[name].grad, p.grad) >= (100 if recipe == "none" else 20), name
