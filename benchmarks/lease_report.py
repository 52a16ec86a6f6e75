"""Read what a lease brought back and print the tables that go into BENCHMARKS.md.

    python benchmarks/lease_report.py OUT_DIR            # the folder with lease.sh's 8 files
    python benchmarks/lease_report.py OUT_DIR --top 40   # more kernels per provider

Runs on the CPU, with no torch import. From OUT_DIR:
- results.jsonl: every measurement, the latest run of each; ratios against the part's bf16 row of the
  same shape and metric (speedups: > 1 is faster than bf16);
- kernels.csv joined to inductor_code.tar.gz: each profiled kernel with what it fuses (the
  "Original ATen" comment inductor writes above it, else its name), the bytes inductor estimated
  (``kernel_num_gb``, written when TORCHINDUCTOR_BENCHMARK_KERNEL=1, as lease.sh sets it) and the GB/s
  that makes at the measured time, against the copy bandwidth of the ceilings part;
- te against bf16 and torchao, kernel by kernel and by class (GEMM, attention, FP8 bookkeeping,
  optimizer, other) for each profiled shape;
- the profiler's device-kernel sum per step against the event-timed step (a sum above the step means
  double counting; far below, host gaps between kernels);
- ncu.tar.gz: per kernel DRAM and SM throughput, occupancy, registers and the top stall reasons;
- logs.tar.gz: the CUDA tests' junit XML; timings.tsv: seconds per part.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import sys
import tarfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import Optional

from tabulate import tabulate

__all__ = ["load", "latest_rows", "results_tables", "code_index", "kernel_tables", "diff_tables",
           "reconcile_table", "parse_ncu_csv", "ncu_table", "tests_line", "timings_table", "summary", "classify",
           "main"]

BASELINE_PREFIX = "bf16"
# metrics where larger is better (the ratio is median / bf16's); the rest are times (bf16's / median)
HIGHER_IS_BETTER = ("tokens_per_s", "TFLOP/s", "GB/s")

# (class, pattern over the lower-cased kernel name), first match wins
CLASSES = [
    ("gemm", re.compile(r"gemm|cutlass|scaled_mm|sm90_xmma|nvjet|\bmm\b|addmm|matmul|cublas|grouped_mm")),
    ("attention", re.compile(r"flash|attention|sdpa|fmha")),
    ("fp8 bookkeeping", re.compile(r"amax|fp8|float8|e4m3|e5m2|to_copy|transpose|cast|quantize|norm_stats|"
                                   r"delayed_update|delayed_scaling|clamp")),
    ("optimizer", re.compile(r"foreach|adam|lerp|addcdiv|addcmul")),
]

_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.(triton|cpp_pybinding|cpp|cuda)\(")
_TRITON_DEF = re.compile(r"^def (triton_\w+)\(", re.MULTILINE)
_NUM_GB = re.compile(r"['\"]kernel_num_gb['\"]\s*:\s*([0-9.eE+-]+)")
_CPU_PREFIX = re.compile(r"^graph_\d+_")       # CPU kernel profile names: graph_0_cpp_fused_..._0
_ORIGINAL_ATEN = re.compile(r"Original ATen: \[([^\]]*)\]")
# inductor names a kernel after what it fused: triton_{poi,red,per,tem}_fused_<ops>_<n>, cpp_fused_<ops>_<n>
_FUSED_NAME = re.compile(r"^(?:triton_[a-z]+_|cpp_)fused_(.+?)_\d+$")


# inductor's pointwise and reduction kernels (a template, triton_tem_, is a GEMM): their names list the ops
# they fused from, so `_scaled_mm` in one means it reads a GEMM's output, never that it runs one
_FUSED_NOT_GEMM = re.compile(r"^(?:triton_(?:poi|red|per)_|cpp_fused)")


def classify(name: str) -> str:
    low = name.lower()
    for label, pattern in CLASSES:
        if label == "gemm" and _FUSED_NOT_GEMM.match(low):
            continue
        if pattern.search(low):
            return label
    return "other"


def _slug(provider: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", provider.strip()).strip("_")


# ---- loading ------------------------------------------------------------------------------------------

def _read_tar(path: str) -> dict[str, bytes]:
    """name -> bytes of every file in a gzipped tar (empty when missing or unreadable)."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return {}
    out = {}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar.getmembers():
                if member.isfile():
                    f = tar.extractfile(member)
                    if f is not None:
                        out[member.name] = f.read()
    except (tarfile.TarError, OSError, EOFError) as e:
        print(f"lease_report: cannot read {path}: {e}", file=sys.stderr)
    return out


def load(out_dir: str) -> dict:
    """Everything in OUT_DIR that the tables read."""
    if not os.path.isdir(out_dir):
        raise SystemExit(f"lease_report: {out_dir!r} is not a folder (expected lease.sh's OUT with its 8 files)")
    rows = []
    results = os.path.join(out_dir, "results.jsonl")
    if os.path.exists(results):
        with open(results) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:   # a line cut at the size limit
                        pass
    kernels = []
    path = os.path.join(out_dir, "kernels.csv")
    if os.path.exists(path):
        with open(path, newline="") as f:
            kernels = _without_annotations([r for r in csv.DictReader(f)
                                            if r.get("kernel") and r.get("per_step_us")])
    timings = []
    path = os.path.join(out_dir, "timings.tsv")
    if os.path.exists(path):
        with open(path) as f:
            timings = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    return {"rows": rows, "kernels": kernels, "timings": timings,
            "code": _read_tar(os.path.join(out_dir, "inductor_code.tar.gz")),
            "ncu": _read_tar(os.path.join(out_dir, "ncu.tar.gz")),
            "logs": _read_tar(os.path.join(out_dir, "logs.tar.gz"))}


# record_function ranges the profiler also reports on the GPU's timeline (`Optimizer.step#AdamW.step` spans
# the optimizer's kernels): not kernels, and counted again if summed with them
_ANNOTATION = re.compile(r"^(?:Optimizer\.\w+#|ProfilerStep#)")


def _without_annotations(kernels: list[dict]) -> list[dict]:
    """kernels.csv rows less the annotation ranges that files written before _record dropped them hold,
    with each step's kernel sum (step_sum_us) lowered by what they added."""
    dropped: dict[tuple, float] = defaultdict(float)
    kept = []
    for r in kernels:
        if _ANNOTATION.match(r["kernel"]):
            dropped[(r.get("part"), r.get("provider"), r.get("shape"), r.get("run"))] += float(r["per_step_us"])
        else:
            kept.append(r)
    for r in kept:
        extra = dropped.get((r.get("part"), r.get("provider"), r.get("shape"), r.get("run")))
        if extra and r.get("step_sum_us"):
            r["step_sum_us"] = str(round(float(r["step_sum_us"]) - extra, 3))
    return kept


def latest_rows(rows: list[dict]) -> list[dict]:
    """The rows of the latest run of each (part, provider, shape, metric), in file order."""
    last: dict[tuple, str] = {}
    for r in rows:
        key = (r.get("part"), r.get("provider"), r.get("shape"), r.get("metric"))
        last[key] = max(last.get(key, ""), r.get("run", ""))
    return [r for r in rows if r.get("run", "") == last[(r.get("part"), r.get("provider"), r.get("shape"),
                                                         r.get("metric"))]]


def _latest_kernels(kernels: list[dict]) -> list[dict]:
    last: dict[tuple, str] = {}
    for r in kernels:
        key = (r["part"], r["provider"], r.get("shape", ""))
        last[key] = max(last.get(key, ""), r.get("run", ""))
    return [r for r in kernels if r.get("run", "") == last[(r["part"], r["provider"], r.get("shape", ""))]]


def _fmt(v, digits: int = 3) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return v
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}" if abs(v) >= 1 or v == 0 else f"{v:.{digits}g}"


# ---- results ------------------------------------------------------------------------------------------

def _ratio(row: dict, base: Optional[dict]) -> str:
    if base is None or row is base or not row.get("median") or not base.get("median"):
        return ""
    if row["metric"] in HIGHER_IS_BETTER:
        return f"{row['median'] / base['median']:.2f}x"
    return f"{base['median'] / row['median']:.2f}x"


# the metrics summary.txt keeps (the report prints every metric)
COMPACT_METRICS = ("ms", "tokens_per_s", "final_loss", "loss_gap_pct", "backend")


def results_tables(rows: list[dict], parts: Optional[tuple[str, ...]] = None, compact: bool = False) -> str:
    """One markdown table per part: provider, shape, metric, median, spread, ratio against bf16.
    ``compact``: the step-time and loss metrics only (the ceilings' rates instead of their times), notes
    cut to 100 characters."""
    rows = latest_rows(rows)
    by_part: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if compact:
            keep = (r.get("metric") in ("TFLOP/s", "GB/s") if r.get("part") in ("ceiling", "quantize")
                    else r.get("metric") in COMPACT_METRICS)
            if not keep:
                continue
        if parts is None or r.get("part") in parts:
            by_part[r.get("part", "?")].append(r)
    out = []
    for part, prows in by_part.items():
        bases = {}
        # plain bf16 first, so that a variant ("bf16 offload") is itself measured against it
        for r in sorted(prows, key=lambda r: r.get("provider") != BASELINE_PREFIX):
            if str(r.get("provider", "")).startswith(BASELINE_PREFIX) and r.get("median"):
                bases.setdefault((r.get("shape"), r.get("metric")), r)
        table = []
        for r in prows:
            note = str(r.get("note") or r.get("attention_backend") or "")
            if compact and len(note) > 100:
                note = note[:97] + "..."
            if r.get("metric") == "loss_gap_pct":
                note = f"{'pass' if r.get('passed') else 'FAIL'} ({r.get('goal', '')})"
            note = note.replace("|", "/")   # a pipe would end the markdown cell
            table.append([r.get("provider"), r.get("shape"), r.get("metric"), _fmt(r.get("median")),
                          _fmt(r.get("spread")), _ratio(r, bases.get((r.get("shape"), r.get("metric")))), note])
        device = prows[0].get("device", "?")
        out.append(f"### {part} ({device}, torch {prows[0].get('torch', '?')}, {prows[0].get('date', '?')})\n\n"
                   + tabulate(table, headers=["provider", "shape", "metric", "median", "spread (p90-p10)",
                                              "vs bf16", "note"], tablefmt="github", disable_numparse=True))
    return "\n\n".join(out) if out else "(no result rows)"


def copy_bandwidth(rows: list[dict]) -> Optional[float]:
    """The highest copy GB/s measured (ceilings, else the quantize part's own copy)."""
    values = [r["median"] for r in latest_rows(rows) if r.get("metric") == "GB/s" and r.get("median")
              and "copy" in str(r.get("provider", ""))]
    return max(values) if values else None


# ---- generated code -------------------------------------------------------------------------------------

def code_index(code: dict[str, bytes]) -> dict[tuple[str, str], dict[str, dict]]:
    """(part, provider slug) -> kernel name -> {fuses, num_gb, file}, from inductor's output code (the
    comments above each ``name = async_compile.triton(...)``) and Triton kernel sources (``def
    triton_...``, their ``kernel_num_gb``). Archive paths are ``<part>/<provider slug>/...``."""
    index: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for name, data in code.items():
        if not name.endswith(".py"):
            continue
        parts = name.split("/")
        key = (parts[0], parts[1]) if len(parts) > 2 else ("?", "?")
        text = data.decode("utf-8", "replace")
        lines = text.splitlines()
        comments: list[str] = []
        for i, line in enumerate(lines):
            m = _KERNEL_DEF.match(line)
            if m:
                fuses = ""
                for c in comments:   # "# Topologically Sorted Source Nodes: [...], Original ATen: [...]"
                    aten = _ORIGINAL_ATEN.search(c)
                    if aten and aten.group(1):
                        fuses = aten.group(1)
                body = "\n".join(lines[i:i + 400])
                end = body.find("''')")
                gb = _NUM_GB.search(body[:end] if end > 0 else body)
                entry = index[key].setdefault(m.group(1), {"fuses": "", "num_gb": None, "file": name})
                entry["fuses"] = entry["fuses"] or fuses
                if gb and entry["num_gb"] is None:
                    entry["num_gb"] = float(gb.group(1))
                comments = []
            elif line.startswith("#"):
                comments.append(line)
            elif line.strip():
                comments = []
        for m in _TRITON_DEF.finditer(text):   # a kernel's own source file (Triton's or inductor's cache)
            entry = index[key].setdefault(m.group(1), {"fuses": "", "num_gb": None, "file": name})
            gb = _NUM_GB.search(text)
            if gb and entry["num_gb"] is None:
                entry["num_gb"] = float(gb.group(1))
    return index


def _lookup(index, part: str, provider: str, kernel: str) -> Optional[dict]:
    """The code entry of a profiled kernel: the provider's own folder first, then the part's, then any
    (a part may keep its code under another part's folder, as the norm cases under quantize's)."""
    name = _CPU_PREFIX.sub("", kernel)
    own = index.get((part, _slug(provider)), {})
    if name in own:
        return own[name]
    for same_part in (True, False):
        for (p, _), kernels in index.items():
            if (p == part) == same_part and name in kernels:
                return kernels[name]
    return None


def _fuses(kernel: str, entry: Optional[dict]) -> str:
    """What a kernel fuses: inductor's Original ATen comment, else the ops its name lists."""
    if entry and entry["fuses"]:
        return entry["fuses"]
    m = _FUSED_NAME.match(_CPU_PREFIX.sub("", kernel))
    return f"(from its name) {m.group(1)}" if m else ""


def kernel_tables(kernels: list[dict], index, copy_gbs: Optional[float], top: int = 25) -> str:
    """Per profiled (part, provider, shape): the slowest kernels with what they fuse and their GB/s."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in _latest_kernels(kernels):
        groups[(r["part"], r["provider"], r.get("shape", ""))].append(r)
    out = []
    for (part, provider, shape), rs in groups.items():
        rs.sort(key=lambda r: -float(r["per_step_us"]))
        whole = sum(float(r["per_step_us"]) for r in rs) or 1.0
        table = []
        for r in rs[:top]:
            per_step, avg = float(r["per_step_us"]), float(r["avg_us"])
            entry = _lookup(index, part, provider, r["kernel"])
            gb = entry["num_gb"] if entry else None
            gbs = gb / (avg * 1e-6) if gb and avg > 0 else None
            table.append([r["kernel"], _fmt(r["calls_per_step"], 2), _fmt(per_step), f"{100 * per_step / whole:.1f}%",
                          classify(r["kernel"]), _fmt(gb * 1e3 if gb else None), _fmt(gbs, 1),
                          f"{100 * gbs / copy_gbs:.0f}%" if gbs and copy_gbs else "",
                          _fuses(r["kernel"], entry)])
        left = len(rs) - len(table)
        out.append(f"#### {part} / {provider} / {shape}: {len(rs)} kernels, {whole / 1e3:.3f} ms a step"
                   + (f" (the {left} fastest not listed)" if left > 0 else "") + "\n\n"
                   + tabulate(table, headers=["kernel", "calls/step", "us/step", "share", "class", "MB (inductor)",
                                              "GB/s", "of copy", "fuses (Original ATen)"],
                              tablefmt="github", disable_numparse=True))
    return "\n\n".join(out) if out else "(no profiled kernels)"


def diff_tables(kernels: list[dict], top: int = 30) -> str:
    """For each profiled (part, shape) with a bf16 row: µs per step by class and kernel by kernel for
    every provider, te's difference from bf16 and from torchao."""
    groups: dict[tuple, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for r in _latest_kernels(kernels):
        groups[(r["part"], r.get("shape", ""))][r["provider"]][r["kernel"]] += float(r["per_step_us"])
    out = []
    for (part, shape), providers in groups.items():
        if len(providers) < 2:
            continue
        names = list(providers)
        base = next((p for p in names if p.startswith(BASELINE_PREFIX)), None)
        peer = next((p for p in names if p.startswith("torchao")), None)
        te = [p for p in names if p.startswith("te")]
        by_class = []
        for label in [c for c, _ in CLASSES] + ["other"]:
            sums = {p: sum(us for k, us in providers[p].items() if classify(k) == label) for p in names}
            by_class.append([label] + [_fmt(sums[p]) for p in names]
                            + [_fmt(sums[t] - sums[base]) if base else "-" for t in te])
        totals = {p: sum(providers[p].values()) for p in names}
        by_class.append(["**all kernels**"] + [_fmt(totals[p]) for p in names]
                        + [_fmt(totals[t] - totals[base]) if base else "-" for t in te])
        heads = ["class"] + [f"{p} us" for p in names] + [f"{t} - bf16" for t in te]
        text = (f"#### {part} / {shape}: us per step by class\n\n"
                + tabulate(by_class, headers=heads, tablefmt="github", disable_numparse=True))
        every = set().union(*(providers[p] for p in names))
        ranked = sorted(every, key=lambda k: -max(providers[p].get(k, 0.0) for p in names))[:top]
        rows = []
        for k in ranked:
            row = [k, classify(k)] + [_fmt(providers[p].get(k)) if k in providers[p] else "" for p in names]
            for t in te:
                row.append(_fmt(providers[t].get(k, 0.0) - providers[base].get(k, 0.0)) if base else "-")
                if peer:
                    row.append(_fmt(providers[t].get(k, 0.0) - providers[peer].get(k, 0.0)))
            rows.append(row)
        heads = ["kernel", "class"] + [f"{p} us" for p in names]
        for t in te:
            heads += [f"{t} - bf16"] + ([f"{t} - torchao"] if peer else [])
        text += (f"\n\n#### {part} / {shape}: kernel by kernel (us per step; blank: the provider has no such "
                 f"kernel)\n\n" + tabulate(rows, headers=heads, tablefmt="github", disable_numparse=True))
        out.append(text)
    return "\n\n".join(out) if out else "(no part profiled two providers)"


def reconcile_table(kernels: list[dict]) -> str:
    """Per profiled step: the event-timed median against the profiler's device-kernel sum per step."""
    seen = {}
    for r in _latest_kernels(kernels):
        seen.setdefault((r["part"], r["provider"], r.get("shape", "")), r)
    table = []
    for (part, provider, shape), r in seen.items():
        step = float(r["step_ms"]) if r.get("step_ms") not in (None, "", "None") else None
        summed = float(r["step_sum_us"]) / 1e3
        gap = None if step is None else step - summed
        table.append([part, provider, shape, _fmt(step), _fmt(summed), _fmt(gap),
                      "" if not step else f"{100 * summed / step:.0f}%"])
    return tabulate(table, headers=["part", "provider", "shape", "event-timed step ms", "kernel sum ms/step",
                                    "step - sum ms", "sum / step"], tablefmt="github", disable_numparse=True)


# ---- ncu ------------------------------------------------------------------------------------------------

_NCU_WANTED = {"Duration": "duration", "DRAM Throughput": "dram_pct", "Compute (SM) Throughput": "sm_pct",
               "Memory Throughput": "mem_pct", "Achieved Occupancy": "occupancy_pct",
               "Theoretical Occupancy": "theoretical_occupancy_pct", "Registers Per Thread": "registers",
               "Block Size": "block", "Grid Size": "grid"}
_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")


def parse_ncu_csv(text: str) -> list[dict]:
    """One dict per profiled launch from ``ncu --csv --page details`` output (the target's own output
    interleaved in it is skipped): kernel, the _NCU_WANTED values, ``stalls`` {reason: warps per issue}."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    reader = csv.reader(io.StringIO("\n".join(lines)))
    header = None
    launches: dict[str, dict] = {}
    for fields in reader:
        if header is None:
            if "Kernel Name" in fields and "Metric Name" in fields:
                header = fields
            continue
        if len(fields) != len(header) or fields == header:
            continue
        rec = dict(zip(header, fields))
        launch = launches.setdefault(rec.get("ID", "?"), {"kernel": rec["Kernel Name"], "stalls": {}})
        metric, value, unit = rec["Metric Name"], rec["Metric Value"], rec.get("Metric Unit", "")
        if metric in _NCU_WANTED:
            launch[_NCU_WANTED[metric]] = f"{value} {unit}".strip() if metric == "Duration" else value
        m = _STALL.match(metric)
        if m:
            try:
                launch["stalls"][m.group(1)] = float(value.replace(",", ""))
            except ValueError:
                pass
    return list(launches.values())


def ncu_table(ncu: dict[str, bytes]) -> str:
    table = []
    for name, data in sorted(ncu.items()):
        if not name.endswith(".csv"):
            continue
        for launch in parse_ncu_csv(data.decode("utf-8", "replace")):
            stalls = sorted(launch["stalls"].items(), key=lambda kv: -kv[1])[:3]
            table.append([launch["kernel"], launch.get("duration", ""), launch.get("dram_pct", ""),
                          launch.get("sm_pct", ""), launch.get("occupancy_pct", ""),
                          launch.get("theoretical_occupancy_pct", ""), launch.get("registers", ""),
                          launch.get("block", ""), launch.get("grid", ""),
                          ", ".join(f"{k} {v:.2f}" for k, v in stalls)])
    if not table:
        notes = [d.decode("utf-8", "replace").strip() for n, d in ncu.items() if n.endswith("commands.txt")]
        return "(no ncu results)" + (f"\n\n```\n{notes[0]}\n```" if notes else "")
    return tabulate(table, headers=["kernel", "duration", "DRAM %", "SM %", "achieved occupancy %",
                                    "theoretical %", "registers", "block", "grid", "top stalls (warps per issue)"],
                    tablefmt="github", disable_numparse=True)


# ---- tests, timings, summary --------------------------------------------------------------------------

def tests_line(logs: dict[str, bytes]) -> str:
    """The CUDA tests' counts and failures from the junit XML in logs.tar.gz."""
    data = next((d for n, d in logs.items() if n.endswith("tests.xml")), None)
    if not data:
        return "tests: no junit XML (the tests part did not run)"
    try:
        root = ET.fromstring(data)
    except ET.ParseError as e:
        return f"tests: unreadable junit XML ({e})"
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return "tests: no testsuite in the junit XML"
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    text = (f"tests: {suite.get('tests')} run, {suite.get('failures')} failed, {suite.get('errors')} errors, "
            f"{suite.get('skipped')} skipped, {float(suite.get('time', 0)):.0f} s")
    return text + "".join(f"\n- {name}" for name in failed[:30])


def timings_table(timings: list[list[str]]) -> str:
    table = [t[:6] for t in timings]
    return tabulate(table, headers=["part", "rc", "seconds", "limit s", "ended (UTC)", "run"], tablefmt="github",
                    disable_numparse=True)


def _env_line(rows: list[dict]) -> str:
    if not rows:
        return "no result rows"
    r = rows[-1]
    return (f"{r.get('device')}, torch {r.get('torch')}, triton {r.get('triton')}, CUDA {r.get('cuda')}, "
            f"{r.get('date')}, git {r.get('git')}")


def summary(out_dir: str, notes: Optional[list[str]] = None) -> str:
    """The short account lease.sh prints last (and saves as summary.txt)."""
    data = load(out_dir)
    files = []
    for name in sorted(os.listdir(out_dir)):
        if name != "summary.txt":
            files.append(f"{name} {os.path.getsize(os.path.join(out_dir, name)) / 2**20:.2f} MiB")
    parts = [f"lease summary: {_env_line(data['rows'])}",
             "files: " + ", ".join(files),
             "## seconds per part\n\n" + timings_table(data["timings"]),
             tests_line(data["logs"]),
             "## results (step times and losses; lease_report.py prints every metric)\n\n"
             + results_tables(data["rows"], compact=True),
             "## profiler sum against the event-timed step\n\n" + reconcile_table(data["kernels"])]
    parts += [f"note: {n}" for n in notes or []]
    parts.append(f"details: python benchmarks/lease_report.py {out_dir}")
    return "\n\n".join(parts) + "\n"


def report(out_dir: str, top: int = 25) -> str:
    data = load(out_dir)
    copy_gbs = copy_bandwidth(data["rows"])
    index = code_index(data["code"])
    return "\n\n".join([
        f"# Lease report: {_env_line(data['rows'])}",
        "## Seconds per part\n\n" + timings_table(data["timings"]),
        "## Results (ratios against bf16 of the same part, shape and metric; > 1x is better)\n\n"
        + results_tables(data["rows"]),
        "## " + tests_line(data["logs"]),
        "## Profiler sum against the event-timed step\n\n" + reconcile_table(data["kernels"]),
        "## te against bf16 and torchao\n\n" + diff_tables(data["kernels"]),
        f"## Kernels (copy bandwidth {_fmt(copy_gbs, 1)} GB/s; bytes from inductor's kernel_num_gb; "
        f"{sum(len(v) for v in index.values())} kernels found in the generated code)\n\n"
        + kernel_tables(data["kernels"], index, copy_gbs, top=top),
        "## ncu\n\n" + ncu_table(data["ncu"]),
    ]) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="the folder holding lease.sh's 8 files")
    parser.add_argument("--top", type=int, default=25, help="kernels listed per provider and shape (default 25)")
    args = parser.parse_args(argv)
    print(report(args.out_dir, top=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
