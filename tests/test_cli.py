"""The command line (te_compile/cli/), the demo's model and data.

Compiles are the cost here (~10 s each), so the compiling tests use aot_eager and small models:
report on gpt_small (1 compile), report on a module from the current directory (1), the demo on a
one-block GPT (2: te and high precision), an unsupported recipe (traced, fails before codegen).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import te_compile
from te_compile.cli import main
from te_compile.data import VOCAB_SIZE, get_batch
from te_compile.models import gpt_small
from te_compile.report import Report, SiteRecord

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Each test compiles other models/shapes; a shared Dynamo cache would turn later compiles
    # into recompiles with dynamic shapes.
    torch._dynamo.reset()
    te_compile.reset()
    yield
    torch._dynamo.reset()


def _eligible_linears(model: torch.nn.Module) -> int:
    return sum(
        isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0
        for m in model.modules()
    )


def test_version(capsys):
    assert main(["--version"]) == 0
    expected = f"te-compile {te_compile.__version__} (torch {torch.__version__})"
    assert capsys.readouterr().out.strip() == expected


def test_python_dash_m_is_the_console_script():
    out = subprocess.run([sys.executable, "-m", "te_compile", "--version"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("te-compile ")


def test_no_subcommand_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: te-compile" in capsys.readouterr().err


def test_report_gpt_small_rewrites_every_eligible_linear(capsys):
    assert main(["report", "te_compile.models:gpt_small"]) == 0
    out = capsys.readouterr().out
    eligible = _eligible_linears(gpt_small())
    assert eligible == 4 * 4 + 1  # qkv, proj, fc, proj per block, and lm_head (256 % 16 == 0)
    rewritten = [s for s in te_compile.report().sites if s.op == "linear" and s.rewritten]
    assert len(rewritten) == eligible, out
    assert {s.fqn for s in rewritten} >= {"blocks.0.attn.qkv", "blocks.3.mlp.proj", "lm_head"}
    assert f"rewritten {eligible} of {eligible} linear sites" in out
    assert "token ids int64[2, 64] (vocab 256)" in out
    assert "aot_eager" in out


def test_report_module_from_cwd_with_example_input(tmp_path, monkeypatch, capsys):
    (tmp_path / "te_cli_example_models.py").write_text(textwrap.dedent("""
        import torch

        def mlp():
            # 10 outputs: not a multiple of 16, so the second linear stays in high precision
            return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))

        def example_input():
            return torch.randn(4, 32)
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # undo the CLI's insertion of the cwd
    monkeypatch.delitem(sys.modules, "te_cli_example_models", raising=False)
    assert main(["report", "te_cli_example_models:mlp"]) == 0
    out = capsys.readouterr().out
    assert "te_cli_example_models.example_input()" in out
    sites = {s.fqn: s for s in te_compile.report().sites}
    assert sites["0"].rewritten
    assert not sites["2"].rewritten and "divisible by 16" in sites["2"].reason
    assert "rewritten 1 of 2 linear sites" in out


@pytest.mark.parametrize("spec, message", [
    ("te_compile.models", "expected MODULE:FACTORY"),
    ("no_such_module_xyz:factory", "cannot import module 'no_such_module_xyz'"),
    ("te_compile.models:no_such_factory", "has no attribute 'no_such_factory'"),
    ("te_compile.models:__doc__", "is not callable"),
])
def test_report_bad_factory_exits_2(spec, message, capsys):
    assert main(["report", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("te-compile report: error: ") and message in err, err


def test_bad_recipe_name_exits_2(capsys):
    assert main(["report", "te_compile.models:gpt_small", "--recipe", "Float8CurentScaling"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'Float8CurentScaling'" in err and "did you mean 'Float8CurrentScaling'" in err


def test_plot_without_matplotlib_exits_2_before_training(monkeypatch, capsys):
    # None in sys.modules makes "import matplotlib..." raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["demo", "--plot", "loss.png"]) == 2
    captured = capsys.readouterr()
    assert 'pip install "te_compile[plot]"' in captured.err
    assert "step" not in captured.out  # nothing was trained


def test_peer_torchao_without_torchao_exits_2_before_training(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    assert main(["demo", "--peer", "torchao"]) == 2
    captured = capsys.readouterr()
    assert 'pip install "te_compile[bench]"' in captured.err and "--peer torchao" in captured.err
    assert "step" not in captured.out  # nothing was trained


def test_demo_peer_torchao_adds_a_third_run(capsys):
    pytest.importorskip("torchao.float8", reason="the peer run needs torchao (pip install -e '.[bench]')")
    argv = ["demo", "--model", "tiny", "--compiler", "aot_eager", "--steps", "3", "--batch-size", "2",
            "--peer", "torchao"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for text in ("peer run: torchao.float8.convert_to_float8_training (tensorwise)", "torchao - hp",
                 "torchao vs hp", "final-loss gap (torchao vs high precision)"):
        assert text in out, f"{text!r} missing from:\n{out}"
    assert any(line.startswith("torchao float8") and "step    3/3" in line for line in out.splitlines()), out
    # torchao's run saves FP8 copies as well: fewer bytes than high precision
    row = next(line for line in out.splitlines() if line.startswith("saved for backward"))
    te_mib, hp_mib, ao_mib = (float(v) for v in row.split()[-5:-2])
    assert 0 < ao_mib < hp_mib and 0 < te_mib < hp_mib, row


# the demo's one-block GPT: ln_1, qkv, attention, proj, ln_2, fc, gelu, proj, ln_f, lm_head, the loss
# (ln_f fused into the output layer and loss)
_TINY_SDPA_OFF = ("10 of 11 sites rewritten (layer_norm 3/3, linear 5/5, sdpa 0/1, gelu 1/1, "
                  "linear_cross_entropy 1/1)")
_TINY_SDPA_ON = ("11 of 11 sites rewritten (layer_norm 3/3, linear 5/5, sdpa 1/1, gelu 1/1, "
                 "linear_cross_entropy 1/1)")


# --report rides on the fp8_attention run: both ways are covered without compiling a third pair
@pytest.mark.parametrize("config, sites, table", [(None, _TINY_SDPA_OFF, False),
                                                  ("examples/fp8_attention.toml", _TINY_SDPA_ON, True)],
                         ids=["default", "fp8_attention-report"])
def test_demo_tiny_trains_both_runs_and_prints_the_summary(tmp_path, capsys, config, sites, table):
    argv = ["demo", "--model", "tiny", "--compiler", "aot_eager", "--steps", "3", "--batch-size", "2"]
    if config is not None:
        argv += ["--config", str(REPO / config)]
    if table:
        argv += ["--report"]
    plot = tmp_path / "loss.png"
    try:
        import matplotlib.figure  # noqa: F401
        argv += ["--plot", str(plot)]
    except ImportError:
        plot = None
    assert main(argv) == 0
    out = capsys.readouterr().out
    for text in ("te Float8CurrentScaling", "high precision (aot_eager)", "step    3/3",
                 "final loss (mean of last 3 steps)", "final-loss gap (te vs high precision)",
                 "tokens/s (steps 2.., compile excluded)", f"te run: {sites}"):
        assert text in out, f"{text!r} missing from:\n{out}"
    if not table:
        assert "  sdpa, 1 site not rewritten: [rewrite] sdpa = false and " in out, out
    # the site table's rows (one per module) and closing total only with --report; the hint without
    table_lines = ("te_compile.report() (sites of the te run)", "blocks.0.attn.qkv", "blocks.0.mlp.fc",
                   "graph 0: rewritten 5 of 5 linear sites", f"{sites.split(' (')[0]}\n")
    for text in table_lines:
        assert (text in out) == table, f"{text!r} {'missing from' if table else 'in'}:\n{out}"
    assert ("te-compile demo --report" in out) != table, out
    # saved-for-backward MiB of the te and high-precision runs: FP8 copies are smaller
    row = next(line for line in out.splitlines() if line.startswith("saved for backward"))
    te_mib, hp_mib = (float(v) for v in row.split()[-3:-1])
    assert 0 < te_mib < hp_mib, row
    if plot is not None:
        assert plot.stat().st_size > 0


def test_demo_save_then_generate_in_fp8_and_high_precision(tmp_path, capsys):
    ckpt = tmp_path / "tiny.pt"
    argv = ["demo", "--model", "tiny", "--compiler", "aot_eager", "--steps", "2", "--batch-size", "2",
            "--recipe", "DelayedScaling", "--save", str(ckpt)]
    assert main(argv) == 0
    assert f"saved the te run's model and recipe state to {ckpt}" in capsys.readouterr().out
    saved = torch.load(ckpt, weights_only=True)
    assert saved["recipe"] == "DelayedScaling" and saved["recipe_state"]   # the trained scales travel along
    argv = ["generate", "--checkpoint", str(ckpt), "--prompt", "def f(", "--tokens", "4", "--compiler", "aot_eager"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for text in ("te recipe DelayedScaling", "prompt          'def f('", "te (FP8)", "high precision",
                 "logits SQNR of te against high precision", "linear 5/5"):
        assert text in out, f"{text!r} missing from:\n{out}"


class _NotATensor:
    pass


@pytest.mark.parametrize("content, words", [
    ("missing", "no such file"),
    ("object", "not a checkpoint that te-compile demo --save wrote (UnpicklingError"),
    ("format", "expected format 'te_compile.demo/1'")])
def test_generate_refuses_what_it_cannot_read_safely(tmp_path, capsys, content, words):
    path = tmp_path / "c.pt"
    if content == "object":   # weights_only=True refuses arbitrary objects instead of running their code
        torch.save({"format": "te_compile.demo/1", "model": "tiny", "x": _NotATensor()}, path)
    elif content == "format":
        torch.save({"state_dict": {}}, path)
    assert main(["generate", "--checkpoint", str(path), "--prompt", "x"]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.slow
def test_demo_moe_rewrites_every_expert_gemm(capsys):
    argv = ["demo", "--model", "moe", "--compiler", "aot_eager", "--steps", "2", "--batch-size", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "MoE: 8 experts, top-2, a shared expert" in out, out
    # 4 blocks: 3 grouped GEMMs each and the SwiGLU between them; the routers (N = 8) stay high precision
    assert "grouped_linear 12/12, swiglu 4/4" in out and "linear 17/21" in out, out
    assert "linear, 4 sites not rewritten: out_features (N)=8 is not divisible by 16" in out, out


def _site(fqn: str, op: str, rewritten: bool, reason: str, graph: int = 0) -> SiteRecord:
    return SiteRecord(fqn, op, "Float8CurrentScaling" if rewritten else None, rewritten, reason,
                      "x[4, 32]", graph)


def test_demo_site_counts_per_op_in_first_seen_order_with_reasons():
    from te_compile.cli.common import site_counts

    long_reason = "blocks.1.mlp.fc: " + "K=10 not divisible by 16 " * 8
    rep = Report([
        _site("ln_1", "layer_norm", True, "fused into attn.qkv"),
        _site("attn.qkv", "linear", True, "linear -> FP8 GEMMs"),
        _site("attn", "sdpa", False, "[rewrite] sdpa = false"),
        _site("lm_head", "linear", False, "recipe 'none' (override 'lm_head')"),
        # a second graph (a graph break): counted with the first, by op
        _site("blocks.1.ln_1", "layer_norm", True, "fused into blocks.1.attn.qkv", graph=1),
        _site("blocks.1.attn", "sdpa", False, "[rewrite] sdpa = false", graph=1),
        _site("blocks.1.mlp.fc", "linear", False, long_reason, graph=1),
        _site("blocks.1.mlp.proj", "linear", False, "recipe 'none' (override 'lm_head')", graph=1),
    ])
    assert rep.op_counts() == [
        ("layer_norm", 2, 2, {}),
        ("linear", 1, 4, {"recipe 'none' (override 'lm_head')": 2, long_reason: 1}),
        ("sdpa", 0, 2, {"[rewrite] sdpa = false": 2}),
    ]
    assert site_counts(rep) == [
        "te run: 3 of 8 sites rewritten (layer_norm 2/2, linear 1/4, sdpa 0/2)",
        "  linear, 3 sites not rewritten: 2 x recipe 'none' (override 'lm_head'); "
        f"1 x {long_reason[:97]}...",
        "  sdpa, 2 sites not rewritten: [rewrite] sdpa = false",
    ]


def test_demo_site_counts_name_a_few_reasons_per_op():
    from te_compile.cli.common import site_counts

    rep = Report([_site(f"fc{i}", "linear", False, f"fc{i}: N={10 + i} not divisible by 16") for i in range(5)])
    assert rep.op_counts() == [("linear", 0, 5, {f"fc{i}: N={10 + i} not divisible by 16": 1 for i in range(5)})]
    assert site_counts(rep)[1] == ("  linear, 5 sites not rewritten: 1 x fc0: N=10 not divisible by 16; "
                                   "1 x fc1: N=11 not divisible by 16; 1 x fc2: N=12 not divisible by 16; "
                                   "2 more reasons (see --report)")
    assert Report().op_counts() == []
    assert site_counts(Report()) == [str(Report())]


def test_get_batch_is_deterministic_and_shifted():
    a = get_batch("train", 4, 16, torch.Generator().manual_seed(123))
    b = get_batch("train", 4, 16, torch.Generator().manual_seed(123))
    c = get_batch("train", 4, 16, torch.Generator().manual_seed(124))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    x, y = a
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    assert 0 <= int(x.min()) and int(x.max()) < VOCAB_SIZE


def test_val_split_is_held_out():
    from te_compile.data import corpus_bytes, tokens

    train, val = tokens("train"), tokens("val")
    assert len(train) + len(val) == len(corpus_bytes()) and len(val) > 0
    assert bytes(val[:64].tolist()) == corpus_bytes()[len(train):len(train) + 64]
    x, _ = get_batch("val", 2, 32, torch.Generator().manual_seed(0))
    assert x.shape == (2, 32)


def test_saved_bytes_count_fp8_primary_weights_inner_storages_as_parameters():
    """A wrapper subclass (FP8 primary weights; torchao's weights) has a placeholder storage without a
    data pointer: the measure reads its inner tensors, and still excludes the weights."""
    from te_compile.memory import saved_for_backward_bytes
    from te_compile.primary_weights import quantized_model_init
    from te_compile.recipe import Float8CurrentScaling

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 32, bias=False)

        def forward(self, x, y):
            out = self.lin(x)
            return out, (out - y).square().mean()

    with quantized_model_init(recipe=Float8CurrentScaling()):
        net = Net()
    x, y = torch.randn(16, 64), torch.randn(16, 32)
    saved = saved_for_backward_bytes(net, x, y)
    # x (16 x 64 fp32), the eager linear's dequantized weight (32 x 64 fp32) and the loss's [16, 32]
    # activations at most (the measure raised on the weight before)
    assert 16 * 64 * 4 <= saved <= 16 * 64 * 4 + 32 * 64 * 4 + 3 * 16 * 32 * 4, saved
