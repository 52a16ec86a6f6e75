"""benchmarks/bench_step.py runs as the lease kit calls it, at its ``--dry`` shape on the CPU: one
process per provider, every measure written as a result row, te's report showing every linear of the
Llama rewritten and the output layer fused with its loss.

One subprocess run of bf16 and both per-tensor te recipes (``--dry`` compiles through aot_eager: about
15 s per provider on a 2-core CPU), shared by the tests below.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_step.py"
PROVIDERS = ("bf16", "te Float8CurrentScaling", "te DelayedScaling")
TE_PROVIDERS = PROVIDERS[1:]
SHAPES = ("llama3-dry 2L 1x64 fwd+bwd+adamw", "llama3-dry 2L 1x64 fwd+bwd")
METRICS = ("tokens_per_s", "ms", "peak_GiB")
REQUIRED = ("part", "provider", "shape", "metric", "median", "spread", "device", "torch", "date", "git")
# the dry Llama's nn.Linear modules: wq, wk, wv, wo, w1, w2, w3 in each of 2 layers, and the output layer
LINEARS = 2 * 7 + 1


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """(stdout, rows, kernels.csv rows, output folder) of one ``--dry`` run of PROVIDERS."""
    out = tmp_path_factory.mktemp("bench_step")
    env = {k: v for k, v in os.environ.items() if k != "TE_COMPILE_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, str(SCRIPT), "--dry", "--providers", *PROVIDERS,
           "--jsonl", str(out / "results.jsonl"), "--kernels-csv", str(out / "kernels.csv"),
           "--trace-dir", str(out / "traces"), "--code-dir", str(out / "code")]
    # cwd: a folder with no te_compile.toml, so the recipes are the script's alone
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"bench_step.py --dry exited {proc.returncode}:\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    with open(out / "kernels.csv", newline="") as f:
        kernels = list(csv.DictReader(f))
    return proc.stdout, rows, kernels, out


def test_one_row_per_provider_shape_and_metric(dry_run):
    _, rows, _, _ = dry_run
    keys = sorted((r["provider"], r["shape"], r["metric"]) for r in rows)
    expected = sorted((p, s, m) for p in PROVIDERS for s in SHAPES for m in METRICS)
    assert keys == expected, f"rows {keys}, expected {expected}"
    for row in rows:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, f"row lacks {missing}: {row}"
        assert row["part"] == "step", row
        assert row["median"] is not None and row["median"] > 0, f"median not positive: {row}"
        assert (row["dtype"], row["optimizer"]) == ("bf16 autocast over fp32 weights", "AdamW(fused=True)"), row
        assert row["dry"] is True and row["compile"] == "block", row
    timed = [r for r in rows if r["metric"] == "ms"]
    assert all(len(r["samples"]) == r["iters"] and r["p10"] <= r["median"] <= r["p90"] for r in timed), timed


def test_te_report_every_linear_rewritten_and_head_loss_fused(dry_run):
    stdout, rows, _, _ = dry_run
    for row in (r for r in rows if r["provider"] in TE_PROVIDERS):
        assert (row["linears_total"], row["linears_rewritten"]) == (LINEARS, LINEARS), row
        assert row["linears_not_rewritten"] == [], row
        assert row["head_loss_fused"] is True, row
        assert row["note"].startswith(f"linears {LINEARS}/{LINEARS} rewritten, head + loss fused; SDPA "), row
    for row in (r for r in rows if r["provider"] == "bf16"):
        assert "linears_total" not in row, row
    # the summary's te lines say the same
    summary = [line for line in stdout.splitlines() if line.startswith(TE_PROVIDERS)]
    assert len(summary) == len(TE_PROVIDERS), stdout[-3000:]
    assert all(f"linears {LINEARS}/{LINEARS} rewritten, head + loss fused" in line for line in summary), summary


def test_each_provider_compiled_once_and_profiled(dry_run):
    stdout, rows, kernels, out = dry_run
    for provider in PROVIDERS:
        # per block: one graph for both (identical) layers, one for the final norm, output layer and loss
        first = [line for line in stdout.splitlines() if line.startswith(f"bench_step: {provider}: first step")]
        assert len(first) == 1 and ", 2 graphs," in first[0], (first, stdout[-3000:])
        slug = provider.replace(" ", "_")
        assert (out / "traces" / f"step_{slug}.json").stat().st_size > 0
        assert (out / "code" / slug / "inductor").is_dir()
        profiled = [k for k in kernels if k["provider"] == provider]
        assert profiled and all(float(k["total_us"]) >= 0 for k in profiled), provider
    assert "graphs compiled after the first step" not in stdout, stdout[-3000:]


def test_plan_fits_an_h100(monkeypatch):
    """The memory plan at the real shape: the parameters of a 4-layer Llama 3 8B with its 128k-vocabulary
    embedding and output layer, and a total that leaves an H100's 80 GB a margin."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_step

    with torch.device("meta"):
        model = bench_step.Llama(bench_step.LLAMA3_8B, n_layers=4, tokens=16)
    params = sum(p.numel() for p in model.parameters())
    assert params == 1_923_125_248, params
    plan = dict((item, nbytes) for item, nbytes, _ in bench_step.memory_plan(bench_step.LLAMA3_8B, 4, 1, 8192))
    assert plan["fp32 weights"] == 4 * params, plan
    assert plan["AdamW exp_avg, exp_avg_sq"] == 2 * plan["fp32 weights"], plan
    assert plan["total (upper bound)"] == sum(v for k, v in plan.items() if k != "total (upper bound)")
    assert plan["total (upper bound)"] < 0.7 * 80e9, plan


def test_offload_providers_count_what_moves(tmp_path, monkeypatch):
    """The kit's offload part: te's provider offloads through [memory] offload_activations and its row
    counts the bytes its report says moved; bf16's goes through torch's own flags, uncounted on a CPU."""
    env = {k: v for k, v in os.environ.items() if k != "TE_COMPILE_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    providers = ("te Float8CurrentScaling offload", "bf16 offload")
    cmd = [sys.executable, str(SCRIPT), "--dry", "--providers", *providers, "--profile-steps", "0",
           "--jsonl", str(tmp_path / "results.jsonl"), "--kernels-csv", str(tmp_path / "kernels.csv"),
           "--trace-dir", str(tmp_path / "traces"), "--code-dir", str(tmp_path / "code")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines() if line.strip()]
    moved = {r["provider"]: r for r in rows if r["metric"] == "offloaded_bytes"}
    assert set(moved) == set(providers), sorted(moved)
    te_row = moved["te Float8CurrentScaling offload"]
    # the report's offload rows, as printed in the child's report table ("offloaded N saved tensors, X B")
    printed = [int(n.replace(",", "")) for n in re.findall(r"offloaded \d+ saved tensors, ([\d,]+) B", proc.stdout)]
    assert te_row["median"] == sum(printed) > 0, (te_row, printed)
    assert moved["bf16 offload"]["median"] is None and "not counted" in moved["bf16 offload"]["measured_by"]
    # both train: the step's timing rows are there too
    assert {(r["provider"], r["metric"]) for r in rows} >= {(p, m) for p in providers for m in METRICS}
    # offload is named per provider: a variant the script has no offload for is refused
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_step

    with pytest.raises(SystemExit):
        bench_step._parse(["--dry", "--providers", "torchao float8 tensorwise offload"])
