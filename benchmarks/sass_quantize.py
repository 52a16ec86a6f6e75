"""te's block-format quantize kernels as an H100 would run them, read from their sm90 SASS on a CPU.

    python benchmarks/sass_quantize.py            # the table
    python benchmarks/sass_quantize.py --json F   # and the rows as JSON

Each kernel is compiled with ``triton.compile`` for sm90 at the launch its launcher makes for a bf16
input (tile, warps, constexprs), and its SASS (Triton's bundled ``cuobjdump``) gives what decides its
speed before any GPU runs it:

- the widths of its global loads and stores (16-byte vectors, or scalar accesses),
- whether its FP8 conversions are the hardware ``F2FP.SATFINITE`` instructions,
- registers and local memory (spills),
- instructions on the hot path (from the entry to the first ``EXIT``; the rare NaN branches after it
  are excluded) per element of its tile.

"issue / copy" is a projection, not a measurement: the hot path's instructions for a 8192 x 8192
bf16 input at the H100 SXM's issue rate (132 SMs x 4 schedulers x 32 lanes x 1.755 GHz) as a fraction
of the time its bytes take at the copy bandwidth the 2026-11-27 lease measured (2,850 GB/s). At 1.0
and above a kernel is bound by instruction issue, not memory; the first lease measured the kernels
at 1.16-1.62 (FP8 block, MXFP8, NVFP4 before these changes) at 66%, 69% and 14% of copy.

Needs triton with its NVIDIA backend (ptxas, cuobjdump); runs without TRITON_INTERPRET (it unsets it).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable

os.environ.pop("TRITON_INTERPRET", None)   # before triton: @triton.jit reads it at decoration

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _output_code import _nvidia_tool, ptxas_available  # noqa: E402

# H100 SXM: instruction issue (lane-instructions per second) and the lease's copy bandwidth
ISSUE_RATE = 132 * 4 * 32 * 1.755e9
COPY_BW = 2.850e12
ELEMENTS = 8192 * 8192


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel variant as its launcher starts it for a bf16 input."""
    name: str                  # the table's row label
    kernel: Callable           # the @triton.jit function
    types: dict                # pointer and float argument types; the rest are i32
    constexprs: dict
    num_warps: int
    tile: tuple[int, int]      # elements per program: rows, columns
    bytes_per_element: float   # bytes read and written per input element


@dataclass
class SassRow:
    name: str
    registers: int
    local_bytes: int
    hot_instructions: int
    per_element: float
    issue_over_copy: float     # the projection above
    loads: dict                # global load opcode -> count
    stores: dict               # global store opcode -> count
    fp8_conversions: int       # F2FP instructions


def launches() -> list[KernelLaunch]:
    from te_compile.kernels import float8_block_quantize as fb, mxfp8_quantize as mx, nvfp4_quantize as nv

    mx_types = dict(x_ptr="*bf16", data_ptr="*u8", scale_ptr="*u8")
    fb_types = dict(x_ptr="*bf16", data_ptr="*u8", scale_inv_ptr="*fp32", amax_epsilon="fp32")
    nv_types = dict(x_ptr="*bf16", data_ptr="*u8", scale_ptr="*u8", amax_ptr="*fp32", rand_ptr="*fp32")
    rows = []
    for fmt, fp8_max in (("E4M3", 448.0), ("E5M2", 57344.0)):
        rows.append(KernelLaunch(
            f"MXFP8 1x32 {fmt}", mx._mxfp8_quantize_kernel, mx_types,
            dict(FP8_MAX=fp8_max, FP8_NAN=0x7F, IS_E4M3=fmt == "E4M3", BLOCK_M=mx._BLOCK_M, BLOCK_K=mx._BLOCK_K,
                 MX_BLOCK=mx.MXFP8_BLOCK),
            4, (mx._BLOCK_M, mx._BLOCK_K), 3 + 1 / 32))
    for tile_rows in (1, 128):
        rows.append(KernelLaunch(
            f"FP8 block {tile_rows}x128 E4M3", fb._float8_block_quantize_kernel, fb_types,
            dict(FP8_MAX=448.0, IS_E4M3=True, TILE_ROWS=tile_rows, BLOCK_M=fb._BLOCK_M, BLOCK_K=fb.FLOAT8_BLOCK,
                 FORCE_POW_2_SCALES=True, USE_EPSILON=False),
            8, (fb._BLOCK_M, fb.FLOAT8_BLOCK), 3 + 4 / (128 * tile_rows)))
    for tile_rows in (1, 16):
        rows.append(KernelLaunch(
            f"NVFP4 {tile_rows}x16", nv._nvfp4_quantize_kernel, nv_types,
            dict(TILE_ROWS=tile_rows, BLOCK_M=nv._BLOCK_M, BLOCK_K=nv._BLOCK_K, STOCHASTIC=False),
            4, (nv._BLOCK_M, nv._BLOCK_K), 2.5 + 1 / 16))
    return rows


def _opcodes(sass: str) -> list[str]:
    """The SASS instructions in program order, predicates dropped ("@!P0 EXIT" -> "EXIT")."""
    return [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]


def analyse(launch: KernelLaunch, workdir: str) -> SassRow:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(launch.kernel.fn).parameters)
    signature = {n: "constexpr" if n in launch.constexprs else launch.types.get(n, "i32") for n in names}
    # pointers and integers 16-divisible, as the launcher's tensors and strides are (Triton's
    # specialisation at a real launch)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n] != "constexpr" and not signature[n].startswith("fp")}
    constexprs = {(names.index(k),): v for k, v in launch.constexprs.items()}
    compiled = triton.compile(ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": launch.num_warps})
    cubin = os.path.join(workdir, re.sub(r"\W+", "_", launch.name) + ".cubin")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                          check=True).stdout
    usage = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                           check=True).stdout
    ops = _opcodes(sass)
    hot = ops[:ops.index("EXIT") + 1] if "EXIT" in ops else ops
    per_thread = launch.tile[0] * launch.tile[1] / (32 * launch.num_warps)
    per_element = len(hot) / per_thread
    issue_s = per_element * ELEMENTS / ISSUE_RATE
    copy_s = launch.bytes_per_element * ELEMENTS / COPY_BW
    local = re.search(r"(?:STACK|LOCAL):(\d+)", usage)
    return SassRow(
        name=launch.name,
        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        local_bytes=int(local.group(1)) if local else 0,
        hot_instructions=len(hot),
        per_element=round(per_element, 1),
        issue_over_copy=round(issue_s / copy_s, 2),
        loads=dict(Counter(op for op in hot if op.startswith("LDG"))),
        stores=dict(Counter(op for op in hot if op.startswith("STG"))),
        fp8_conversions=sum(op.startswith("F2FP") for op in hot),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows to FILE as JSON")
    args = parser.parse_args()
    ok, why = ptxas_available()
    if not ok:
        sys.exit(f"sass_quantize.py: cannot build for sm90 here: {why}")
    with tempfile.TemporaryDirectory() as workdir:
        rows = [analyse(launch, workdir) for launch in launches()]
    print(tabulate([[r.name, r.registers, r.local_bytes, r.hot_instructions, r.per_element, r.issue_over_copy,
                     " ".join(f"{k} x{v}" for k, v in r.loads.items()),
                     " ".join(f"{k} x{v}" for k, v in r.stores.items()), r.fp8_conversions] for r in rows],
                   headers=["kernel (bf16 in)", "regs", "local B", "hot instr", "per element",
                            "issue / copy (projected)", "global loads", "global stores", "F2FP"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
