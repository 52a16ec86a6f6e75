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
