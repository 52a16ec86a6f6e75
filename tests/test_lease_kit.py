"""The lease kit (benchmarks/lease.sh) works end to end before a GPU ever runs it: a dry run of some of
its parts on the CPU brings back exactly the 8 files the device tool returns, with rows that name their
part, provider and device, and lease_report.py reads them. Plus the recording helpers' own behaviour:
rows, timing, per-provider caches, and the report's parsers of inductor's code and ncu's CSV.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import _record  # noqa: E402
import lease_parts  # noqa: E402
import lease_report  # noqa: E402

REQUIRED = ("part", "provider", "shape", "metric", "median", "spread", "device", "torch", "date")


# ---- _record ------------------------------------------------------------------------------------------

def test_write_row_appends_required_keys(tmp_path):
    path = tmp_path / "r.jsonl"
    first = _record.write_row(str(path), part="block", provider="te Float8CurrentScaling",
                              shape="2x32x64 gpt-1L fwd+bwd", metric="ms", median=1.5, spread=0.25, note="x")
    _record.write_row(str(path), part="step", provider="bf16", shape="1x64 fwd", metric="tokens_per_s", median=None)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2 and rows[0] == first
    for row in rows:
        assert set(REQUIRED) <= set(row)
    assert rows[0]["median"] == 1.5 and rows[0]["spread"] == 0.25 and rows[0]["note"] == "x"
    assert rows[0]["device"] == ("cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0))
    assert rows[1]["median"] is None


@pytest.mark.parametrize("part, provider", [("speed", "bf16"), ("block", "inductor"), ("block", "")])
def test_write_row_rejects_unknown_part_or_provider(tmp_path, part, provider):
    with pytest.raises(ValueError, match="part must be|provider must"):
        _record.write_row(str(tmp_path / "r.jsonl"), part=part, provider=provider, shape="1 fwd", metric="ms",
                          median=1.0)
    assert not (tmp_path / "r.jsonl").exists()


def test_time_steps_counts_every_step_on_cpu():
    calls = []
    timing = _record.time_steps(lambda: calls.append(1), warmup=2, iters=7, device=torch.device("cpu"))
    assert len(calls) == 9
    assert len(timing["samples"]) == 7
    assert timing["p10_ms"] <= timing["median_ms"] <= timing["p90_ms"]
    with pytest.raises(ValueError, match="iters must be >= 1, got 0"):
        _record.time_steps(lambda: None, warmup=0, iters=0)


def test_provider_cache_dir_sets_both_caches(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    folder = _record.provider_cache_dir(str(tmp_path), "torchao float8 rowwise")
    assert folder == str(tmp_path / "torchao_float8_rowwise")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(folder, "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == os.path.join(folder, "triton")
    assert os.path.isdir(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def test_profile_steps_writes_kernel_rows(tmp_path):
    x = torch.randn(64, 64)
    rows = _record.profile_steps(lambda: (x @ x).relu(), steps=3, trace_path=str(tmp_path / "t.json"),
                                 csv_path=str(tmp_path / "k.csv"), part="linear", provider="bf16", step_ms=1.0,
                                 shape="64x64x64 fwd")
    assert (tmp_path / "t.json").stat().st_size > 0
    with open(tmp_path / "k.csv", newline="") as f:
        written = list(csv.DictReader(f))
    assert tuple(written[0]) == _record.KERNEL_COLUMNS
    assert len(written) == len(rows) > 0
    names = {r["kernel"] for r in written}
    assert any("mm" in n for n in names), names
    step_sum = float(written[0]["step_sum_us"])
    assert step_sum == pytest.approx(sum(float(r["per_step_us"]) for r in written), rel=1e-3)


# ---- lease_report's parsers -----------------------------------------------------------------------------

OUTPUT_CODE = '''
# kernel path: /tmp/x/ab/cabc.py
# Topologically Sorted Source Nodes: [h, amax], Original ATen: [aten.mul, aten.amax, aten._to_copy]
# Source node to ATen node mapping:
triton_red_fused__to_copy_amax_mul_0 = async_compile.triton('triton_red_fused__to_copy_amax_mul_0', \'\'\'
@triton_heuristics.reduction(
    inductor_meta={'kernel_name': 'triton_red_fused__to_copy_amax_mul_0', 'kernel_num_gb': 0.0335},
)
@triton.jit
def triton_red_fused__to_copy_amax_mul_0(in_ptr0, out_ptr0, xnumel, r0_numel):
    pass
\'\'\', device_str='cuda')
'''

NCU_CSV = '''==PROF== Connected to process 1
block te Float8CurrentScaling: ran one step in the NVTX range lease_ncu
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python","h","triton_red_fused__to_copy_amax_mul_0","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","81.5"
"0","1","python","h","triton_red_fused__to_copy_amax_mul_0","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Compute (SM) Throughput","%","22.0"
"0","1","python","h","triton_red_fused__to_copy_amax_mul_0","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Occupancy","Achieved Occupancy","%","61.2"
"0","1","python","h","triton_red_fused__to_copy_amax_mul_0","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","40"
"0","1","python","h","triton_red_fused__to_copy_amax_mul_0","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","","5.5"
"0","1","python","h","triton_red_fused__to_copy_amax_mul_0","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","","0.5"
'''


def test_code_index_reads_fusion_and_bytes():
    index = lease_report.code_index({"block/te_Float8CurrentScaling/inductor/ab/cabc.py": OUTPUT_CODE.encode()})
    entry = index[("block", "te_Float8CurrentScaling")]["triton_red_fused__to_copy_amax_mul_0"]
    assert entry["fuses"] == "aten.mul, aten.amax, aten._to_copy"
    assert entry["num_gb"] == pytest.approx(0.0335)
    found = lease_report._lookup(index, "block", "te Float8CurrentScaling", "triton_red_fused__to_copy_amax_mul_0")
    assert found is entry


@pytest.mark.parametrize("name, label", [
    ("nvjet_sm90_qqtst_144x128_128x6_1x2_h_bz_coopA_algo2_TNN", "gemm"),
    ("triton_tem_fused__scaled_mm_3", "gemm"),
    # named after the GEMM whose output it reads: an amax and cast, not a GEMM
    ("triton_per_fused__scaled_mm__to_copy_abs_amax_clamp_div_21", "fp8 bookkeeping"),
    ("triton_poi_fused_addmm_gelu_4", "other"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
])
def test_classify_keeps_fused_kernels_out_of_gemm(name, label):
    assert lease_report.classify(name) == label


def test_load_drops_annotation_ranges_and_their_share_of_the_step_sum(tmp_path):
    cols = ["part", "provider", "shape", "kernel", "per_step_us", "step_sum_us", "run"]
    rows = [["step", "bf16", "s", "Optimizer.step#AdamW.step", "22000", "171000", "r"],
            ["step", "bf16", "s", "multi_tensor_apply_kernel", "21900", "171000", "r"],
            ["step", "bf16", "s", "nvjet_sm90_tst_256x128", "127100", "171000", "r"]]
    (tmp_path / "kernels.csv").write_text("\n".join(",".join(r) for r in [cols] + rows) + "\n")
    kernels = lease_report.load(str(tmp_path))["kernels"]
    assert [k["kernel"] for k in kernels] == ["multi_tensor_apply_kernel", "nvjet_sm90_tst_256x128"]
    assert {float(k["step_sum_us"]) for k in kernels} == {149000.0}


def test_parse_ncu_csv_skips_the_targets_output():
    [launch] = lease_report.parse_ncu_csv(NCU_CSV)
    assert launch["kernel"] == "triton_red_fused__to_copy_amax_mul_0"
    assert (launch["dram_pct"], launch["sm_pct"], launch["occupancy_pct"], launch["registers"]) == \
        ("81.5", "22.0", "61.2", "40")
    assert max(launch["stalls"], key=launch["stalls"].get) == "long_scoreboard"
    table = lease_report.ncu_table({"ncu_block.csv": NCU_CSV.encode()})
    assert "long_scoreboard 5.50" in table


def test_ncu_command_filters_kernels_in_the_nvtx_range():
    cmd = lease_parts.ncu_command("ncu", ["triton_poi_fused_add_0", "_norm_quantize_kernel"], ["python", "t.py"])
    assert cmd[:3] == ["ncu", "--clock-control", "none"]
    for section in lease_parts.NCU_SECTIONS:
        assert section in cmd
    assert cmd[cmd.index("--nvtx-include") + 1] == "lease_ncu/"
    assert cmd[cmd.index("-k") + 1] == "regex:^(triton_poi_fused_add_0|_norm_quantize_kernel)$"
    assert cmd[-2:] == ["python", "t.py"] and "--csv" in cmd


def test_ncu_command_without_a_range_counts_one_steps_launches():
    cmd = lease_parts.ncu_command("ncu", ["triton_poi_fused_add_0"], ["python", "t.py"], nvtx_range=None,
                                  launches=16)
    assert "--nvtx" not in cmd and "--nvtx-include" not in cmd
    assert cmd[cmd.index("-c") + 1] == "16"


def _kernels_csv(path, rows):
    cols = ["part", "provider", "shape", "kernel", "per_step_us", "calls_per_step", "run"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(cols)
        writer.writerows(rows)


def test_ncu_profiles_the_steps_te_kernels_on_the_steps_cache(tmp_path):
    """The step's te profile names the kernels (the latest run's, Triton ones only) and ncu's target is
    the step's te process on the step part's cache, where the compile is a cache hit."""
    csv_path = tmp_path / "kernels.csv"
    _kernels_csv(csv_path, [
        ["block", "te Float8CurrentScaling", "s", "triton_poi_fused_mul_0", "900", "1", "r2"],
        ["step", "te Float8CurrentScaling", "s", "triton_red_fused_amax_8", "100", "4.0", "r1"],   # older run
        ["step", "te Float8CurrentScaling", "s", "triton_poi_fused_cast_2", "50", "16.0", "r2"],
        ["step", "te Float8CurrentScaling", "s", "nvjet_sm90_tst_256x128", "500", "28.0", "r2"],  # cuBLAS
        ["step", "te Float8CurrentScaling", "s", "_norm_quantize_kernel", "80", "8.0", "r2"],
        ["step", "bf16", "s", "triton_poi_fused_add_1", "300", "4.0", "r2"],
    ])
    part, names, launches = lease_parts.slowest_te_kernels(str(csv_path))
    assert (part, names, launches) == ("step", ["_norm_quantize_kernel", "triton_poi_fused_cast_2"], 24)

    paths = lease_parts._paths(str(tmp_path / "work"))
    target, nvtx_range = lease_parts.ncu_target(part, paths)
    assert nvtx_range is None and target[1].endswith("bench_step.py")
    assert target[target.index("--code-dir") + 1] == os.path.join(paths["code"], "step")
    assert target[target.index("--providers") + 1] == "te Float8CurrentScaling"
    # the target as ncu would start it runs (here on the CPU: --dry) and keeps its rows out of results.jsonl
    proc = subprocess.run(target + ["--dry"], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(target[target.index("--jsonl") + 1])]
    assert {r["provider"] for r in rows} == {"te Float8CurrentScaling"}
    assert not os.path.exists(paths["results"])
    # the block (by name only now) is the target when only it profiled te
    _kernels_csv(csv_path, [["block", "te Float8CurrentScaling", "s", "triton_poi_fused_mul_0", "900", "1", "r2"]])
    assert lease_parts.slowest_te_kernels(str(csv_path)) == ("block", ["triton_poi_fused_mul_0"], 1)
    target, nvtx_range = lease_parts.ncu_target("block", paths)
    assert nvtx_range == "lease_ncu" and "--ncu-target" in target


# ---- bench parts: time per provider process -----------------------------------------------------------------

class _Clock:
    """time.monotonic for part_bench, moved on by each fake provider process by the seconds it used."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


@pytest.mark.parametrize("budget, used, limits", [
    # each process uses all it is given: the first gets what is left less 50 s kept for one later process
    # (two would not fit), the second those 50 s, the third nothing and is skipped
    (120, None, [70, 50]),
    # each uses 10 s: all three run, each given what is left less 50 s for each one after it
    (200, 10, [100, 140, 180]),
    # under one process's minimum: nothing starts
    (40, None, []),
])
def test_part_bench_starts_a_provider_only_with_the_time_it_needs(tmp_path, monkeypatch, capsys, budget, used,
                                                                   limits):
    clock, started = _Clock(), []

    def fake_run(cmd, limit):
        started.append((cmd[cmd.index("--providers") + 1], round(limit)))
        clock.now += limit if used is None else used
        return 0

    monkeypatch.setattr(lease_parts, "time", clock)
    monkeypatch.setattr(lease_parts, "_run", fake_run)
    monkeypatch.setitem(lease_parts.PROCESS_MIN_SECONDS, "attention", 50)
    args = lease_parts.argparse.Namespace(name="attention", budget=budget, dry=False)
    rc = lease_parts.part_bench(args, lease_parts._paths(str(tmp_path)))
    providers = lease_parts.PART_PROVIDERS["attention"][1]
    assert started == list(zip(providers, limits))
    out = capsys.readouterr().out
    skipped = providers[len(limits):]
    for provider in skipped:
        assert f"bench attention: no time left for [{provider!r}]" in out
        assert "a process needs 50 s" in out
    assert rc == (124 if skipped else 0)


# ---- setup: once per machine ------------------------------------------------------------------------------------

def test_second_setup_skips_pip_on_the_marker(tmp_path):
    """lease.sh's setup (not --dry) through a stand-in interpreter that logs its arguments: the first setup
    calls pip and lease_parts setup and leaves setup.done; a second call's setup on the same work folder
    calls neither and gets the short budget."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\nexit 0\n')
    fake.chmod(0o755)
    work = tmp_path / "work"
    env = dict(os.environ, PYTHON=str(fake), OUT=str(tmp_path / "out"), LEASE_WORK=str(work), LEASE_DRY="0")

    def setup() -> tuple[str, str]:
        proc = subprocess.run(["bash", str(BENCH / "lease.sh"), "setup"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        made, log = calls.read_text(), (work / "logs" / "setup.log").read_text()
        calls.write_text("")
        return made, log

    first_calls, _ = setup()
    assert "-m pip" in first_calls and "lease_parts.py setup" in first_calls
    assert (work / "setup.done").read_text().split() == [str(ROOT), str(fake)]
    second_calls, log = setup()
    assert "-m pip" not in second_calls and "lease_parts.py setup" not in second_calls
    assert "setup.done" in log
    timings = [line.split("\t") for line in (work / "timings.tsv").read_text().splitlines()]
    assert [(t[0], t[1], t[3]) for t in timings] == [("setup", "0", "35"), ("setup", "0", "10")]


# ---- the kit end to end -----------------------------------------------------------------------------------

def test_dry_lease_brings_back_the_eight_files(tmp_path):
    """ceilings, the block part (bench orchestration, one compile per provider, profile, traces) and ncu
    (command only) on the CPU; the rest of the parts share this machinery (the whole dry kit is run by
    hand: bash benchmarks/lease.sh --dry all)."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), LEASE_WORK=str(work), OMP_NUM_THREADS="1",
               TE_COMPILE_REV="test")
    proc = subprocess.run(["bash", str(BENCH / "lease.sh"), "--dry", "ceilings", "block", "ncu"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == sorted(lease_parts.OUT_FILES)
    for name in lease_parts.OUT_FILES:
        assert (out / name).stat().st_size < 16 * 2**20, name
    assert "seconds per part" in proc.stdout and "lease summary" in proc.stdout   # summary printed last
    assert (out / "summary.txt").read_text().startswith("lease summary: cpu")

    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for row in rows:
        assert set(REQUIRED) <= set(row), row
        assert row["part"] in _record.PARTS and row["provider"].split()[0] in _record.PROVIDER_PREFIXES, row
        assert row["device"] == "cpu" and row["git"] == "test"
    assert {r["part"] for r in rows} == {"ceiling", "block"}
    block = {r["provider"]: r for r in rows if r["part"] == "block" and r["metric"] == "ms"}
    assert block["bf16"]["median"] > 0 and block["te Float8CurrentScaling"]["median"] > 0
    assert "fwd+bwd" in block["bf16"]["shape"]
    copy = [r for r in rows if r["provider"] == "bf16 copy" and r["metric"] == "GB/s"]
    assert copy and copy[0]["median"] > 0

    timings = [line.split("\t") for line in (out / "timings.tsv").read_text().splitlines()]
    assert [t[0] for t in timings] == ["ceilings", "block", "ncu"] and all(t[1] == "0" for t in timings)

    with open(out / "kernels.csv", newline="") as f:
        kernels = list(csv.DictReader(f))
    assert {k["provider"] for k in kernels} == {"bf16", "te Float8CurrentScaling"}
    assert all(float(k["step_sum_us"]) > 0 and float(k["step_ms"]) > 0 for k in kernels)
    with tarfile.open(out / "traces.tar.gz") as tar:
        assert len([n for n in tar.getnames() if n.startswith("block-")]) == 2
    with tarfile.open(out / "ncu.tar.gz") as tar:
        assert "commands.txt" in tar.getnames()

    report = subprocess.run([sys.executable, str(BENCH / "lease_report.py"), str(out)], capture_output=True,
                            text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    for heading in ("## Results", "### block", "## Profiler sum against the event-timed step",
                    "## te against bf16 and torchao", "#### block / ", "## ncu"):
        assert heading in report.stdout, heading
