"""benchmarks/offline.py, the offline model of the H100 step: without a GPU, inductor writes its whole
CUDA output code for te's GPT block, every Triton kernel in it (inductor's and te's own, through
``torch.library.triton_op``) builds for sm90 with the ptxas Triton ships, and the counts table has its
structure. A kernel that the GPU compiler rejects (as te's norm kernels were, inside inductor, on the
first lease) fails here.

The script runs in a subprocess: tests/conftest.py sets TRITON_INTERPRET on a machine without CUDA,
under which ``@triton.jit`` gives interpreter functions that cannot be built for a GPU. The block is
small (2 x 64 tokens, width 256, 4 heads) but takes te's GPU paths: FP8 GEMMs through
``torch._scaled_mm``, its fused LayerNorm + quantize Triton kernels.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from utils import BENCHMARKS, sm90_build_available

ROOT = os.path.dirname(BENCHMARKS)
PROVIDER = "te Float8CurrentScaling"


_OK, _WHY = sm90_build_available()


def _run_offline(out, *args: str) -> dict:
    """summary.json of one offline.py run with ``args``, its code and tables under ``out``, plus its exit
    code, stdout and ``out``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(out / "inductor"), TRITON_CACHE_DIR=str(out / "triton"))
    cmd = [sys.executable, os.path.join(BENCHMARKS, "offline.py"), *args, "--providers", PROVIDER, "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = out / "summary.json"
    assert summary.exists(), (f"offline.py exited {run.returncode} without a summary:\n{run.stdout[-3000:]}\n"
                              f"{run.stderr[-3000:]}")
    data = json.loads(summary.read_text())
    data["returncode"], data["stdout"], data["out"] = run.returncode, run.stdout, out
    return data


@pytest.fixture(scope="module")
def offline(tmp_path_factory) -> dict:
    """summary.json of one offline.py run over te's GPT block, every kernel built for sm90."""
    # scaled down below te's small-GEMM line ([rewrite] small_gemms): "fp8" keeps every linear in FP8
    return _run_offline(tmp_path_factory.mktemp("offline"), "--cases", "block", "--block-size", "2x64x256",
                        "--heads", "4", "--compile-sm90", "--sm90-configs", "first", "--small-gemms", "fp8")


@pytest.mark.skipif(not _OK, reason=f"cannot build for sm90 here: {_WHY}")
def test_every_kernel_builds_for_sm90(offline):
    builds = offline["sm90"]
    failed = [f"{b['graph']}: {b['kernel']} [{b['config']}]: {b['error']}" for b in builds if b["error"]]
    assert not failed, "kernels the GPU compiler rejects:\n" + "\n".join(failed)
    assert offline["returncode"] == 0, offline["stdout"][-3000:]
    graphs = {b["graph"] for b in builds}
    assert graphs == {"block fwd", "block bwd"}, f"built kernels of {sorted(graphs)}, expected both graphs"
    # all of them inductor's: te's LayerNorm + quantize kernels step aside where no lease measured them
    # faster (kernels/norm_quantize.py), and tests/test_kernels_compile.py builds them for sm90 directly
    te_kernels = {b["kernel"].rsplit("_", 1)[0] for b in builds if not b["kernel"].startswith("triton_")}
    assert not te_kernels, sorted(te_kernels)
    assert all(b["registers"] and b["registers"] > 0 for b in builds), "a build without a register count"


@pytest.mark.skipif(not _OK, reason=f"cannot build for sm90 here: {_WHY}")
def test_counts_table_structure(offline):
    rows = {r["graph"]: r for r in offline["rows"]}
    assert set(rows) == {"block fwd", "block bwd"}, sorted(rows)
    fwd, bwd = rows["block fwd"], rows["block bwd"]
    for row in (fwd, bwd):
        assert row["provider"] == PROVIDER and row["launches"] > 0 and row["memory_bytes"] > 0, row
        assert 0 < row["tiny"] < row["launches"], row
        assert row["unknown_bytes"] == 0, f"launches without bytes: {row}"
        assert row["attention"] == 1, row
    # four linears (qkv, proj, fc, proj2): one FP8 GEMM each forward, dgrad and wgrad backward
    assert (fwd["gemms"], bwd["gemms"]) == (4, 8), (fwd["gemms"], bwd["gemms"])
    # the two LayerNorm + quantize sites run as inductor's kernels, not te's
    assert fwd["te_kernels"] == 0 and fwd["te_bytes"] == 0, fwd
    # the generated code is kept, with the launches it lists: the norm fused with its FP8 cast
    code = offline["out"] / "block" / "te_Float8CurrentScaling" / "block_fwd.py"
    text = code.read_text()
    assert "_norm_quantize_kernel" not in text and "te_norm_linears_layer_norm" in text
    assert "roofline" in offline["stdout"] and "projection, not a measurement" in offline["stdout"]


@pytest.fixture(scope="module")
def offline_step(tmp_path_factory) -> dict:
    """summary.json of offline.py over the Llama-shaped step (one layer, the fused output layer + loss)
    at 1024 tokens (the loss in 16 chunks): fake tensors, no storage."""
    return _run_offline(tmp_path_factory.mktemp("offline_step"), "--cases", "step", "--tokens", "1024",
                        "--layers", "1", "--small-gemms", "fp8")


def test_no_fp8_operand_is_written_once_per_reader(offline_step):
    # q, k and v read one norm's FP8 output (forward rowwise, backward transposed for their wgrads), and
    # the loss chunks' dgrads read one column-major copy of the output layer's weight: each is written
    # once. Inductor inlines a node into a copy per extern reader it does not realize for; on an H100 the
    # transposed operand written three times took 2.5 ms a layer against 0.7.
    rows = {r["graph"]: r for r in offline_step["rows"]}
    assert set(rows) == {"layer fwd", "layer bwd", "head fwd", "head bwd"}, sorted(rows)
    repeated = {graph: r["repeated_stores"] for graph, r in rows.items() if r["repeated_stores"]}
    assert not repeated, f"kernels storing one value into several buffers: {repeated}"
    assert rows["layer fwd"]["gemms"] == 7 and rows["layer bwd"]["gemms"] == 14, rows



def test_gradients_leave_their_gemms_and_the_loss_writes_no_one_hot(offline_step):
    """Under autocast over fp32 weights, each weight's gradient leaves its wgrad GEMM in fp32: no
    kernel after it reads a bf16 gradient to write an fp32 one (at 8192 tokens 1.3 GB a layer), and
    the output layer's fp32 gradient is not copied again (4.2 GB at Llama 3's head). The fused loss
    takes its one-hot term and its label logit inside the kernels it runs anyway: no [rows, V] zeros
    buffer, scatter or gather per chunk, and one dgrad and one wgrad GEMM over every row."""
    import csv

    launches = list(csv.DictReader(open(offline_step["out"] / "launches.csv")))
    names = {}
    for row in launches:
        names.setdefault(row["graph"], []).append(row["name"])
    # (the forward's two are RoPE's cos and sin tables cast to bf16, as in every provider's graph)
    casts = {graph: [n for n in names[graph] if re.fullmatch(r"triton_poi_fused__to_copy(_t)?_\d+", n)]
             for graph in ("layer bwd", "head bwd")}
    assert not any(casts.values()), f"kernels that only cast a tensor: {casts}"
    per_chunk = [n for n in names["head fwd"] if "scatter" in n or "gather" in n or "zeros_like" in n]
    assert not per_chunk, per_chunk
    rows = {r["graph"]: r for r in offline_step["rows"]}
    assert rows["head bwd"]["gemms"] == 2 and rows["head fwd"]["gemms"] == 16, rows

_KERNEL = '''
    tmp3 = tmp2.to(tl.float8e4nv)
    tl.store(out_ptr0 + (x0 + 8192*r0_1), tmp3, None)
    tl.store(out_ptr1 + (x0 + 8192*r0_1), tmp3, None)
    tl.store(out_ptr2 + (r0_1 + 4096*x0), tmp3, None)
    tl.store(out_ptr3 + (tl.full([1, 1], 0, tl.int32)), tmp4, None)
    tl.store(out_ptr4 + (tl.full([1, 1], 0, tl.int32)), tmp4, None)
'''


def test_repeated_stores_counts_a_value_written_to_two_buffers():
    sys.path.insert(0, BENCHMARKS)
    try:
        from _output_code import repeated_stores
    finally:
        sys.path.remove(BENCHMARKS)
    q = "'" * 3
    code = (f"triton_poi_fused_0 = async_compile.triton('triton_poi_fused_0', {q}\n@triton.jit\n"
            f"def triton_poi_fused_0(out_ptr0):{_KERNEL}{q}, device_str='cuda')\n")
    # the second store at the same index counts; the transposed layout and the scalar amax slots do not
    assert repeated_stores(code) == {"triton_poi_fused_0": 1}
