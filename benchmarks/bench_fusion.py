"""What norm / activation fusion must improve, measured on one GPT training step (fwd + bwd):
generated kernels, FP8 casts in the forward, and bytes saved for backward; te recipes vs inductor vs
torchao float8 (tensorwise and rowwise, + inductor, when torchao is installed: ``pip install -e '.[bench]'``).

    python benchmarks/bench_fusion.py                      # CPU: 8x64x128, 1 block
    python benchmarks/bench_fusion.py --size 8x128x256 --layers 2 --device cuda

- kernels: ``torch._inductor.metrics.generated_kernel_count`` over a cold compile of forward and
  backward (the FX-graph cache is switched off so every provider generates its code). It counts
  every ``Kernel`` object codegen builds; on CPU the C++ backend builds several per loop nest
  (scalar, vectorized and tail variants), so this grows with the loop nests inside a kernel, not
  with the kernels a step runs;
- distinct: the kernels the generated forward and backward code defines (``... = async_compile...``),
  i.e. what a step can launch besides extern ops;
- launches: the kernel calls in the generated forward and backward code (cpp / Triton kernels,
  extern GEMMs, other ops): what one step runs. On CPU the C++ backend fuses a norm or an activation
  with the amax and the FP8 cast in one kernel, so launches can stay close while kernels double;
- fp8 casts (fwd): conversions to an fp8 dtype in the AOT forward graph, i.e. FP8 buffers the
  forward writes before inductor fuses anything (a norm output read by q, k, v counts once when it is
  quantized once);
- saved bytes: the distinct storages the compiled forward hands to autograd for the backward
  (``saved_tensors_hooks``, parameters excluded), and their ratio to the high-precision run.
No timing: a benchmark of structure, stable across machines and runs. Every row compiles a deep copy of
one model instance on the same batch; the torchao rows are the same measures of a
``convert_to_float8_training`` copy compiled by inductor (``emulate=True`` off CUDA: its GEMMs are fp32
matmuls of the dequantized FP8 values, as te's are fp32 matmuls of the FP8 values there).
"""

from __future__ import annotations

import argparse
import re

import torch
from tabulate import tabulate

import _common
import te_compile
from te_compile.memory import saved_for_backward_bytes   # the demo's measure
from te_compile.models import GPT

RECIPES = ("Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling")
# the same recipes with norm fusion off, to show what it changes (MXFP8 norms are not fused anyway)
UNFUSED = {"layer_norm": False, "rms_norm": False}
# and with FP8 attention (Q, K, V, O saved in FP8 instead of the input dtype), and with fp8_mha (O
# handed to the output projection in FP8, saved once; under DelayedScaling also Q, K, V cast once at
# the qkv projection's output)
ATTENTION = {"sdpa": True}
# variant of a te row -> its te options
VARIANTS = {"": {}, ", norms unfused": {"rewrite": UNFUSED}, ", FP8 attention": {"rewrite": ATTENTION},
            ", FP8 attention, fp8_mha": {"recipe_options": {"fp8_mha": True}}}


def _model(t: int, c: int, layers: int, device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=256, n_layer=layers, n_head=max(4, c // 128), n_embd=c, block_size=t).to(device)


def _fp8_casts(gm: torch.fx.GraphModule) -> int:
    fp8 = {torch.float8_e4m3fn, torch.float8_e5m2}
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and getattr(n.target, "overloadpacket", None) in (torch.ops.aten._to_copy,
                                                                 torch.ops.prims.convert_element_type)
               and (n.kwargs.get("dtype") in fp8 or (len(n.args) > 1 and n.args[1] in fp8)))


class _ForwardGraphs:
    """The AOT forward graphs inductor receives while ``recording()`` is active."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def recording(self):
        def wrap(inner):
            def record(gm, example_inputs, **kwargs):
                if not kwargs.get("is_backward", False):
                    self.graphs.append(gm)
                return inner(gm, example_inputs, **kwargs)
            return record
        return _common.wrapping_inductor_inner(wrap)


_DEFINED = re.compile(r"^\w+ = async_compile\.\w+\(", re.MULTILINE)
_LAUNCH = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(",
                     re.MULTILINE)


class _GeneratedCode:
    """While active, the source of every module inductor generates (its output code)."""

    def __init__(self) -> None:
        self.sources: list[str] = []

    def __enter__(self):
        from torch._inductor.graph import GraphLowering

        self._original = GraphLowering.compile_to_module
        sources, original = self.sources, self._original

        def compile_to_module(graph, *args, **kwargs):
            module = original(graph, *args, **kwargs)
            with open(module.__file__) as f:
                sources.append(f.read())
            return module

        GraphLowering.compile_to_module = compile_to_module
        return self

    def __exit__(self, *exc):
        from torch._inductor.graph import GraphLowering

        GraphLowering.compile_to_module = self._original

    def launches(self) -> int:
        return sum(len(_LAUNCH.findall(src)) for src in self.sources)

    def defined(self) -> int:
        return sum(len(_DEFINED.findall(src)) for src in self.sources)


def _measure(provider: str, model, x, y, variant: str = "") -> dict:
    """provider: "inductor", a te recipe (with a VARIANTS key) or "torchao <recipe>"."""
    from torch._inductor import metrics

    torch._dynamo.reset()
    metrics.reset()
    forwards = _ForwardGraphs()
    # "inductor" resolves compile_fx at call time, as the te backend does: both meet the patch
    with forwards.recording(), _GeneratedCode() as code:
        if provider == "inductor":
            compiled = torch.compile(model, backend="inductor")
        elif provider.startswith("torchao "):
            recipe = provider.split()[1]
            compiled = torch.compile(_common.torchao_convert(model, recipe, x.device), backend="inductor")
        else:
            compiled = torch.compile(model, backend=te_compile.backend(recipe=provider, **VARIANTS[variant]))
        saved = saved_for_backward_bytes(compiled, x, y)
    name = (provider if provider == "inductor" else
            f"torchao float8 {provider.split()[1]}" if provider.startswith("torchao ") else f"te {provider}{variant}")
    return {"provider": name,
            "kernels": metrics.generated_kernel_count, "distinct": code.defined(), "launches": code.launches(),
            "fp8 casts (fwd)": sum(_fp8_casts(g) for g in forwards.graphs), "saved bytes": saved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8x64x128", help="BxTxC (default 8x64x128)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False   # every provider generates (and counts) its kernels
    b, t, c = (int(v) for v in args.size.split("x"))
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (b, t), generator=gen).to(device)
    y = torch.randint(0, 256, (b, t), generator=gen).to(device)
    rows = []
    runs = ([("inductor", "")] + [(r, "") for r in RECIPES] + [(r, ", norms unfused") for r in RECIPES[:2]]
            + [(RECIPES[0], ", FP8 attention"), (RECIPES[0], ", FP8 attention, fp8_mha"),
               (RECIPES[1], ", FP8 attention, fp8_mha")])
    torchao = [f"torchao {r}" for r in _common.TORCHAO_RECIPES]
    have_torchao = _common.torchao_available()
    if have_torchao:
        runs += [(p, "") for p in torchao]
    base_model = _model(t, c, args.layers, device)
    for provider, variant in runs:
        row = _measure(provider, _common.fresh_copy(base_model), x, y, variant)
        rows.append(row)
        print(f"{row['provider']}: done", flush=True)
    base = rows[0]
    table = [(r["provider"], r["kernels"], f"{r['kernels'] / base['kernels']:.2f}x", r["distinct"],
              f"{r['distinct'] / base['distinct']:.2f}x", r["launches"],
              f"{r['launches'] / base['launches']:.2f}x", r["fp8 casts (fwd)"],
              f"{r['saved bytes'] / 2**20:.2f}", f"{r['saved bytes'] / base['saved bytes']:.2f}x", "") for r in rows]
    if not have_torchao:
        table += [(f"torchao float8 {p.split()[1]}", *["n/a"] * 9, _common.TORCHAO_MISSING) for p in torchao]
    print(f"\nGPT {args.layers} block(s), {args.size} on {device.type}, torch {torch.__version__}")
    headers = ["provider", "kernels", "vs inductor", "distinct", "vs inductor", "launches", "vs inductor",
               "fp8 casts (fwd)", "saved MiB", "saved vs inductor", "note"]
    print(tabulate(table, headers=headers, disable_numparse=True))


if __name__ == "__main__":
    main()
