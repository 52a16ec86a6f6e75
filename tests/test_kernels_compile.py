"""Every Triton kernel, te_compile's and those in experiments/, compiles for a Hopper GPU (sm90), here,
without one: the kernel tests run the kernels in Triton's interpreter, which accepts code the GPU
compiler rejects (it found a kernel returning two FP8 types from one function). Triton's NVIDIA
backend ships ptxas, so a kernel can be compiled to a cubin on a CPU-only machine. The PTX also shows
what the interpreter cannot: where ptxas would fuse a multiply and an add into one FMA, one rounding
where the torch reference has two; the kernels that must equal their references bit for bit may only
hold exact ones.

How: each launcher runs once per variant on tiny CPU inputs in the interpreter, and a hook records
what reached the kernel (argument dtypes become the signature; constexpr values and launch options
are kept). A subprocess without ``TRITON_INTERPRET`` then compiles each recorded launch with
``triton.compile`` for sm90 (the interpreter's ``@triton.jit`` objects cannot be compiled)."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from te_compile.kernels._fp_bits import HAS_TRITON

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _ptxas_available() -> bool:
    if not HAS_TRITON:
        return False
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return os.path.exists(os.path.join(bin_dir, "ptxas")) or shutil.which("ptxas") is not None


needs_ptxas = pytest.mark.skipif(not _ptxas_available(), reason="needs triton with its NVIDIA backend (ptxas)")

_TL_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
             torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv",
             torch.float8_e5m2: "fp8e5", torch.bool: "i1"}


def _constexpr_names(fn) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items() if "constexpr" in str(p.annotation)}


def _record_launches(monkeypatch) -> list[dict]:
    """Run every launcher's variants in the interpreter; return the distinct launches."""
    from triton.runtime.interpreter import GridExecutor

    seen: dict[str, dict] = {}
    original = GridExecutor.__call__

    def record(self, *args, **kwargs):
        fn = getattr(self.fn, "fn", self.fn)
        constexprs = _constexpr_names(fn)
        values = dict(zip(self.arg_names, args))
        values.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        signature, consts = {}, {}
        for name in self.arg_names:
            v = values.get(name)
            if isinstance(v, torch.Tensor):
                signature[name] = "*" + _TL_TYPES[v.dtype]
            elif name in constexprs or v is None:
                signature[name], consts[name] = "constexpr", v
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                raise AssertionError(f"{fn.__name__}.{name}: a runtime argument of type {type(v).__name__}")
            else:
                signature[name] = "fp32" if isinstance(v, float) else ("i64" if abs(v) >= 2**31 else "i32")
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
        launch = {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": consts,
                  "options": options}
        seen[json.dumps(launch, sort_keys=True, default=str)] = launch
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GridExecutor, "__call__", record)
    for call in _variants():
        call()
    launches = list(seen.values())
    # the triton_op kernels compile inside inductor as inductor writes them (seen on an H200 with
    # torch 2.11, 2026-11-26, where both broke every te GPT block): from the source closure its codegen
    # collects, and with a Python float argument typed fp64
    for launch in list(launches):
        if launch["name"] in _WRAPPED:
            twin = json.loads(json.dumps(launch))
            twin["signature"] = {k: "fp64" if v == "fp32" else v for k, v in launch["signature"].items()}
            twin["inductor_source"] = True
            launches.append(twin)
    return launches


# the kernels te launches inside torch.library.triton_op (inductor compiles them with its own signature)
_WRAPPED = ("_norm_stats_kernel", "_norm_quantize_kernel", "_norm_backward_kernel")


def _variants():
    """One call per kernel variant worth compiling: dtypes, formats and flags that change the code."""
    from experiments.fp8_cast_transpose import fp8_cast_transpose_triton
    from experiments.fp8_gemm import fp8_gemm_amax_triton
    from te_compile.kernels import fp8_attention as att
    from te_compile.kernels.delayed_update import delayed_update_triton
    from te_compile.kernels.float8_block_quantize import float8_block_quantize_triton
    from te_compile.kernels.mxfp8_quantize import mxfp8_quantize_triton
    from te_compile.kernels.norm_quantize import NormSpec, norm_backward_triton, norm_quantize_triton, norm_stats_triton
    from te_compile.kernels.nvfp4_quantize import nvfp4_quantize_triton

    e4m3, e5m2, bf16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(64, 128, generator=g)
    one = torch.ones(1)
    calls = []
    for dtype in (torch.float32, bf16):
        for fp8 in (e4m3, e5m2):
            calls.append(lambda d=dtype, f=fp8: fp8_cast_transpose_triton(x32.to(d), one, f))
        calls.append(lambda d=dtype: mxfp8_quantize_triton(x32.to(d), e4m3))
        calls.append(lambda d=dtype: float8_block_quantize_triton(x32.to(d), e4m3, tile_rows=1, force_pow_2_scales=True,
                                                                  amax_epsilon=0.0))
        calls.append(lambda d=dtype: float8_block_quantize_triton(x32.to(d), e5m2, tile_rows=128,
                                                                  force_pow_2_scales=False, amax_epsilon=1e-6))
        calls.append(lambda d=dtype: nvfp4_quantize_triton(x32.to(d), x32.abs().amax().reshape(1), tile_rows=1,
                                                           rand=None))
    calls.append(lambda: nvfp4_quantize_triton(x32, x32.abs().amax().reshape(1), tile_rows=16,
                                               rand=torch.rand(64, 128, generator=g)))
    a, b = x32[:32, :64].to(e4m3), x32[:, :64].to(e4m3).t()
    for a_, out, out_scale, fp8 in ((a, torch.float32, None, None), (a.float().to(e5m2), bf16, None, None),
                                    (a, bf16, one, e4m3), (a, torch.float16, one, e5m2)):
        calls.append(lambda a_=a_, o=out, s=out_scale, f=fp8: fp8_gemm_amax_triton(a_, b, one, one, o, s, f))
    for most_recent in (False, True):
        calls.append(lambda m=most_recent: delayed_update_triton([torch.zeros(8)], [torch.ones(1)], one, [448.0],
                                                                 [1.0], m))
    w, bias = torch.rand(128, generator=g) + 0.5, torch.randn(128, generator=g)
    for spec, wb, fp8 in ((NormSpec("layer_norm", 1e-5), (w, bias), e4m3),
                          (NormSpec("rms_norm", 1e-6, zero_centered=True, pre_dtype=bf16, prod_dtype=bf16,
                                    casts=(torch.float32,)), (w, None), e5m2),
                          (NormSpec("rms_norm", 1e-6), (None, None), e4m3)):
        def norm(spec=spec, wb=wb, fp8=fp8):
            mean, rstd, _ = norm_stats_triton(x32, *wb, spec)
            norm_quantize_triton(x32, *wb, mean, rstd, one, spec, fp8)
            norm_backward_triton(torch.randn(64, 128, generator=g), x32, wb[0], mean, rstd, spec)
        calls.append(norm)
    q = torch.randn(1, 2, 32, 64, generator=g)
    q8, qd = att.quantize_heads(q)
    kv8, kvd = att.quantize_heads(q[:, :1])                 # GQA: one key/value head for two query heads
    masks = (None, torch.rand(32, 32, generator=g) > 0.3, torch.randn(1, 2, 32, 32, generator=g))
    for causal, mask in ((True, None), (False, masks[1]), (False, masks[2])):
        def attention(causal=causal, mask=mask):
            o, lse = att.fp8_attention_forward_triton(q8, kv8, kv8, qd, kvd, kvd, sm_scale=0.125, causal=causal,
                                                      mask=mask, out_dtype=bf16)
            do = torch.randn(1, 2, 32, 64, generator=g)
            for fp8_grads, grad in ((False, e5m2), (True, e5m2), (True, e4m3)):
                att.fp8_attention_backward_triton(do, q8, kv8, kv8, qd, kvd, kvd, o.float(), lse, sm_scale=0.125,
                                                  causal=causal, mask=mask, fp8_grads=fp8_grads, grad_dtype=grad)
        calls.append(attention)
    from te_compile.kernels.kv_cache_attention import kv_cache_attention_triton

    cache8 = torch.randn(2, 2, 40, 64, generator=g).to(e4m3)
    cache_scale = torch.rand(2, 2, 40, generator=g)
    for dtype, tq, causal, mask in ((torch.float32, 1, False, torch.rand(2, 1, 1, 40, generator=g) > 0.3),
                                    (bf16, 1, False, None), (torch.float16, 24, True, None),
                                    (bf16, 24, False, torch.randn(2, 4, 24, 40, generator=g))):
        query = torch.randn(2, 4, tq, 64, generator=g).to(dtype)   # GQA: two query heads per key/value head
        calls.append(lambda q=query, c=causal, m=mask: kv_cache_attention_triton(
            q, cache8, cache8, cache_scale, cache_scale, sm_scale=0.125, causal=c, mask=m))
    return calls


_COMPILE = textwrap.dedent(r"""
    import importlib, importlib.util, json, os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton <= 3.9's default, the case to check
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import re

    # an FMA that rounds as a multiply then an add would: the FP8 rounding's fma(a, 2^k, 2^23)
    # (addend 0f4B000000, a power-of-two multiplier made from bits), or a product with an
    # immediate power of two
    def exact(operands):
        _, a, b, c = [o.strip() for o in operands.split(",")]
        pow2 = [int(o[2:], 16) for o in (a, b) if o.startswith("0f")]
        return c == "0f4B000000" or any(v & 0x7FFFFF == 0 and 0 < (v >> 23) & 0xFF < 255 for v in pow2)

    failures, fused = [], []
    def load(i, launch):
        module = importlib.import_module(launch["module"])
        if not launch.get("inductor_source"):
            return module
        # the module inductor's wrapper codegen writes for a user-defined kernel: its source and the
        # transitive closure of the JIT helpers it calls, each under the helper's own name
        from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code
        path = os.path.join(os.path.dirname(sys.argv[1]), f"inductor_{i}_{launch['name']}.py")
        with open(path, "w") as f:
            f.write("import triton\nimport triton.language as tl\n\n@triton.jit\n"
                    + user_defined_triton_kernel_transitive_closure_source_code(getattr(module, launch["name"])))
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        generated = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(generated)
        return generated

    for i, launch in enumerate(json.load(open(sys.argv[1]))):
        fn = getattr(load(i, launch), launch["name"])
        try:
            kernel = triton.compile(ASTSource(fn, launch["signature"], constexprs=launch["constexprs"]),
                                    target=GPUTarget("cuda", int(sys.argv[2]), 32), options=launch["options"])
        except Exception as e:
            cause = e
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__
            failures.append(f"{launch['name']} {launch['constexprs']}: {type(cause).__name__}: {cause}"[:800])
            continue
        fmas = re.findall(r"fma\.rn\.f32\s+([^;]+);", kernel.asm["ptx"])
        inexact = [f for f in fmas if not exact(f)]
        if inexact:
            fused.append(f"{launch['name']} {launch['constexprs']}: {len(inexact)} FMAs, e.g. {inexact[0]}")
    print(json.dumps({"failures": failures, "fused": fused}))
""")

# kernels that must give their references' bits: ptxas may not contract a product with an add in them
# (one rounding where torch rounds twice), except the exact one inside the FP8 rounding
_BITWISE = ("_fp8_cast_transpose_kernel", "_fp8_gemm_amax_kernel", "_delayed_update_kernel",
            "_mxfp8_quantize_kernel", "_float8_block_quantize_kernel", "_nvfp4_quantize_kernel",
            "_norm_quantize_kernel")


@needs_ptxas
@pytest.mark.skipif(torch.cuda.is_available(), reason="records launches in Triton's interpreter, which is off on a "
                    "CUDA machine; the kernel tests compile every kernel for the GPU there")
def test_every_kernel_compiles_for_sm90_and_bit_exact_ones_keep_their_roundings(monkeypatch, tmp_path):
    launches = _record_launches(monkeypatch)
    names = {launch["name"] for launch in launches}
    kernels = {"_fp8_cast_transpose_kernel", "_fp8_gemm_amax_kernel", "_delayed_update_kernel",
               "_mxfp8_quantize_kernel", "_float8_block_quantize_kernel", "_nvfp4_quantize_kernel",
               "_norm_stats_kernel", "_norm_quantize_kernel", "_norm_backward_kernel", "_fp8_attention_fwd_kernel",
               "_fp8_attention_bwd_dkdv_kernel", "_fp8_attention_bwd_dq_kernel", "_kv_cache_attention_kernel"}
    assert names == kernels, names ^ kernels   # a new kernel must get a variant in _variants()
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches, default=str))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the subprocess imports each kernel's module by name: the experiments package sits in the repo root
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(path), "90"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    failures = result["failures"]
    assert not failures, (f"{len(failures)} of {len(launches)} launches fail to compile for sm90:\n"
                          + "\n".join(failures))
    # the bit-exact kernels keep every rounding torch does (the others agree to fp32 rounding)
    fused = [f for f in result["fused"] if f.split()[0] in _BITWISE]
    assert not fused, "value-changing FMA contraction in a bit-exact kernel:\n" + "\n".join(fused)
