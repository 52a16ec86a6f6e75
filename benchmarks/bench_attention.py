"""FP8 attention against SDPA on one attention call: time of forward and forward + backward, bytes
saved for the backward, and the error against fp32 SDPA, measured side by side in one run.

    python benchmarks/bench_attention.py                          # CPU: 2x8x512x64, causal, fp32
    python benchmarks/bench_attention.py --device cuda            # the goal's shape: 4x32x4096x128, bf16
    python benchmarks/bench_attention.py --cp 2                   # context parallel: 2 spawned gloo ranks (CPU)
    torchrun --nproc-per-node 2 benchmarks/bench_attention.py --cp 2 --device cuda   # a GPU per rank
    python benchmarks/bench_attention.py --jsonl results.jsonl --kernels-csv kernels.csv   # a lease part

Providers: ``sdpa`` (torch.compile with inductor: torch's flash / math SDPA), ``te fp8 (hp bwd)`` and
``te fp8 (fp8 bwd)`` (torch.compile(backend="te") with ``fp8_dpa``), and on CUDA with the
FlashAttention-3 package installed torch's experimental FP8 forward
(``_scaled_dot_product_attention_quantized``, forward only, fed the same E4M3 Q, K, V and descales).
The te rows include the per-(batch, head) quantization of Q, K, V in their time, as a model pays it.
On CPU the te rows run the pure-torch emulation: their times say nothing about a GPU.

``--cp N``: te's context-parallel FP8 attention (``[distributed] context_parallel``) over N ranks, each
holding its load-balanced slice of the sequence, in both backward modes: rank 0's forward and step
times, the SQNR of the gathered output against fp32 SDPA on the whole sequence, and the bytes each
rank all-gathers per step (K and V in FP8, and their positions) against the same K and V in bf16
(goal <= 0.55x), beside the dK, dV bytes it reduce-scatters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

import te_compile
from te_compile.distributed import mesh_dim_group
from te_compile.kernels.fp8_attention import quantize_heads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import _record  # noqa: E402

# lease part providers: bf16 SDPA (whichever backend torch picks: the row names it), te's FP8 attention
# with the high-precision and the FP8 backward
LEASE_PROVIDERS = ("bf16 sdpa", "te fp8 attention hp-bwd", "te fp8 attention fp8-bwd")
# (aten op that ran, backend name); the first whose op appears in the profile wins
_SDPA_OPS = (("_scaled_dot_product_cudnn_attention", "cudnn"), ("_scaled_dot_product_flash_attention_for_cpu",
             "flash (CPU)"), ("_scaled_dot_product_flash_attention", "flash"),
             ("_scaled_dot_product_efficient_attention", "mem-efficient"),
             ("_scaled_dot_product_attention_math", "math"), ("fp8_attention", "te FP8 attention"))


class Attention(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, device, warmup: int, iters: int) -> float:
    fn()   # compiles
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _saved_mib(fn) -> float:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values()) / 2 ** 20


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.float(), x.float()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum().clamp_min(1e-30))).item()


def _fa3_forward(causal: bool):
    """torch's experimental FP8 SDPA forward (Hopper + the flash_attn_interface package), or None."""
    try:
        from torch.nn.attention import _fa3
        from torch.nn.attention.experimental import _scaled_dot_product_attention_quantized as quantized

        _fa3.register_flash_attention_fa3()
    except Exception:   # not installed, not Hopper, or an older torch: the row says so
        return None

    def run(q, k, v):
        (q8, qd), (k8, kd), (v8, vd) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
        return quantized(q8, k8, v8, is_causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)

    return run


def _cp_run(rank: int, world: int, device: torch.device, args) -> None:
    """One rank of ``--cp``: the table on rank 0."""
    from torch.distributed.device_mesh import init_device_mesh

    import te_compile.lowerings.context_parallel_attention as cpa

    cuda = device.type == "cuda"
    b, h, t, d = (int(v) for v in (args.shape or ("1x32x16384x128" if cuda else "1x4x512x64")).split("x"))
    dtype = torch.bfloat16 if cuda else torch.float32
    iters = args.iters or (20 if cuda else 3)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(b, h, t, d, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]
    do_full = torch.randn(b, h, t, d, generator=gen).to(device=device, dtype=dtype)
    ref = F.scaled_dot_product_attention(*(x.float() for x in full), is_causal=True)
    pos = te_compile.load_balanced_positions(t, rank, world).to(device)
    q, k, v, do = te_compile.context_parallel_shard(mesh, [*full, do_full], seq_dims=[2] * 4)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    moved = {"gathered": 0, "scattered": 0}
    gather, scatter = cpa._gather_seq, cpa._reduce_scatter_seq

    def counting(real, key):
        def count(x, group):
            moved[key] += x.numel() * x.element_size() * (group.size if key == "gathered" else 1)
            return real(x, group)
        return count

    rows = []
    for mode in ("high_precision", "fp8"):
        torch._dynamo.reset()
        te_compile.reset()
        fn = torch.compile(Attention(True), backend=te_compile.backend(
            recipe="Float8CurrentScaling", fp8_dpa=True, fp8_dpa_backward=mode, compiler=args.compiler,
            distributed={"context_parallel": "cp"}, mesh=mesh))
        with torch.no_grad():
            fwd = _median_ms(lambda: fn(q, k, v), device, 2, iters)
        step = _median_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), device, 2, iters)
        # the bytes of one step, counted on the op run eagerly (the compiled graph calls the same code)
        cpa._gather_seq, cpa._reduce_scatter_seq = counting(gather, "gathered"), counting(scatter, "scattered")
        moved.update(gathered=0, scattered=0)
        try:
            o = cpa.ContextParallelAttention.apply(q, k, v, pos, mesh_dim_group(mesh, 0), True, d ** -0.5,
                                                   torch.float8_e5m2 if mode == "fp8" else None)
            torch.autograd.grad(o, (q, k, v), do)
        finally:
            cpa._gather_seq, cpa._reduce_scatter_seq = gather, scatter
        [out] = te_compile.context_parallel_unshard(mesh, [o.float()], seq_dims=[2])
        kv_bf16 = 2 * b * k.shape[1] * t * d * 2   # K and V of the whole sequence at 2 bytes an element
        rows.append([f"te fp8 CP={world} ({'hp' if mode == 'high_precision' else 'fp8'} bwd)", f"{fwd:.3f}",
                     f"{step:.3f}", f"{_sqnr(ref, out):.1f}", f"{moved['gathered'] / 2**20:.3f}",
                     f"{kv_bf16 / 2**20:.3f}", f"{moved['gathered'] / kv_bf16:.2f}x",
                     f"{moved['scattered'] / 2**20:.3f}"])
    if rank == 0:
        where = torch.cuda.get_device_name(device) if cuda else "CPU (pure-torch emulation)"
        print(f"\ncontext-parallel attention {b}x{h}x{t}x{d} causal over {world} ranks, {str(dtype)[6:]}, {where}, "
              f"torch {torch.__version__}, median of {iters} on rank 0")
        print(tabulate(rows, headers=["provider", "fwd ms", "fwd+bwd ms", "SQNR vs fp32 (dB)", "gathered MiB",
                                      "K, V in bf16 MiB", "vs bf16", "reduce-scattered MiB"],
                       disable_numparse=True))


def _cp_worker(rank: int, world: int, port: int, args) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _cp_run(rank, world, torch.device("cpu"), args)
    finally:
        dist.destroy_process_group()


def _cp_main(args) -> None:
    import os
    import socket

    import torch.distributed as dist

    if "WORLD_SIZE" in os.environ:   # torchrun
        cuda = args.device == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        if dist.get_world_size() != args.cp:
            raise SystemExit(f"--cp {args.cp} needs {args.cp} ranks, torchrun started {dist.get_world_size()}")
        _cp_run(dist.get_rank(), args.cp, device, args)
        dist.destroy_process_group()
        return
    if args.device == "cuda":
        raise SystemExit("--cp on CUDA: launch with torchrun --nproc-per-node N (a GPU per rank)")
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_cp_worker, args=(args.cp, port, args), nprocs=args.cp, join=True)


def _attention_backend(fn, *inputs) -> str:
    """Which attention ran in one call of ``fn``: read off the op names the profiler records (SDPA
    picks its backend per call from the inputs and the enabled backends, so ask what actually ran)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*inputs)
    names = {e.name for e in prof.events()}
    for op, label in _SDPA_OPS:
        if any(op in name for name in names):
            return label
    hits = sorted(n for n in names if "attention" in n.lower() or "flash" in n.lower())
    return "unknown: " + (", ".join(hits[:4]) or "no attention op in the profile")


def lease_main(args) -> None:
    """The lease part: each provider's forward and forward + backward, rows to --jsonl with the SDPA
    backend that ran."""
    device = _common.lease_device(args)
    cuda = device.type == "cuda"
    b, h, t, d = (int(v) for v in (args.shape or ("4x32x4096x128" if cuda else "1x2x64x16")).split("x"))
    dtype = torch.bfloat16 if cuda else torch.float32
    causal = not args.no_causal
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=gen, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    do = torch.randn(b, h, t, d, generator=gen, device=device, dtype=dtype)
    flags = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
             for name in ("flash", "mem_efficient", "math", "cudnn")
             if hasattr(torch.backends.cuda, f"{name}_sdp_enabled")}
    print(f"attention {b}x{h}x{t}x{d}: SDPA backends enabled {flags}", flush=True)
    iters = args.iters or (20 if cuda else 3)
    for provider in args.providers or LEASE_PROVIDERS:
        if provider.startswith("te "):
            mode = "fp8" if provider.endswith("fp8-bwd") else "high_precision"
            backend = te_compile.backend(recipe="Float8CurrentScaling", fp8_dpa=True, fp8_dpa_backward=mode,
                                         compiler=_common.lease_compiler(args))
        else:
            backend = _common.lease_compiler(args)
        holder = {}

        def build_fwd(backend=backend):
            holder["fn"] = torch.compile(Attention(causal), backend=backend)

            def fwd():
                with torch.no_grad():
                    holder["fn"](q, k, v)
            return fwd

        def build_step(backend=backend):
            fn = torch.compile(Attention(causal), backend=backend)
            return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)
        base = f"{b}x{h}x{t}x{d} {'causal' if causal else 'full'}"
        ran = {}
        for shape, build in ((f"{base} fwd", build_fwd), (f"{base} fwd+bwd", build_step)):
            median = _common.lease_step(args, part="attention", provider=provider, shape=shape, build=build,
                                        warmup=2, iters=iters, flags=str(flags), **ran)
            if median is not None and "fn" in holder and not ran:
                ran["attention_backend"] = _attention_backend(holder["fn"], q, k, v)
                print(f"attention {provider}: {ran['attention_backend']} ran", flush=True)
                _record.write_row(args.jsonl, part="attention", provider=provider, shape=f"{base} fwd",
                                  metric="backend", median=None, attention_backend=ran["attention_backend"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", help="BxHxTxD (default: 4x32x4096x128 on CUDA, 2x8x512x64 on CPU)")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--iters", type=int, help="timed iterations (default: 20 on CUDA, 3 on CPU)")
    parser.add_argument("--cp", type=int, default=0, metavar="N",
                        help="context parallel over N ranks (default shape: 1x32x16384x128 CUDA, 1x4x512x64 CPU)")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                        help="te's final compiler for --cp (default: inductor)")
    _common.add_lease_args(parser, LEASE_PROVIDERS)
    args = parser.parse_args()
    if args.jsonl or args.ncu_target:
        lease_main(args)
        return
    if args.cp:
        if args.cp < 2:
            raise SystemExit(f"--cp must be >= 2, got {args.cp}")
        _cp_main(args)
        return
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    b, h, t, d = (int(v) for v in (args.shape or ("4x32x4096x128" if cuda else "2x8x512x64")).split("x"))
    dtype = torch.bfloat16 if cuda else torch.float32
    causal = not args.no_causal
    iters = args.iters or (20 if cuda else 3)
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=gen, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    do = torch.randn(ref.shape, generator=gen, device=device, dtype=dtype)

    rows = []
    providers = [("sdpa (inductor)", lambda: torch.compile(Attention(causal)))]
    for mode in ("high_precision", "fp8"):
        providers.append((f"te fp8 ({'hp' if mode == 'high_precision' else 'fp8'} bwd)",
                          lambda mode=mode: torch.compile(Attention(causal), backend=te_compile.backend(
                              recipe="Float8CurrentScaling", fp8_dpa=True, fp8_dpa_backward=mode))))
    for name, make in providers:
        torch._dynamo.reset()
        fn = make()
        with torch.no_grad():
            fwd = _median_ms(lambda: fn(q, k, v), device, 2, iters)
        step = _median_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), device, 2, iters)
        rows.append([name, fwd, step, _saved_mib(lambda: fn(q, k, v)), _sqnr(ref, fn(q, k, v))])
        print(f"{name}: done", flush=True)
    fa3 = _fa3_forward(causal) if cuda else None
    if fa3 is not None:
        with torch.no_grad():
            out = fa3(q, k, v)
            out = out[0] if isinstance(out, tuple) else out
            rows.append(["torch FP8 SDPA fwd (FA3)", _median_ms(lambda: fa3(q, k, v), device, 2, iters), None, None,
                         _sqnr(ref, out)])
    base = rows[0]
    table = [[r[0], f"{r[1]:.3f}", f"{base[1] / r[1]:.2f}x",
              "-" if r[2] is None else f"{r[2]:.3f}", "-" if r[2] is None else f"{base[2] / r[2]:.2f}x",
              "-" if r[3] is None else f"{r[3]:.2f}", f"{r[4]:.1f}"] for r in rows]
    where = torch.cuda.get_device_name(device) if cuda else "CPU (te rows: pure-torch emulation)"
    print(f"\nattention {b}x{h}x{t}x{d} {'causal' if causal else 'full'}, {str(dtype)[6:]}, {where}, "
          f"torch {torch.__version__}, median of {iters}")
    print(tabulate(table, headers=["provider", "fwd ms", "fwd speedup", "fwd+bwd ms", "step speedup",
                                   "saved MiB", "SQNR vs fp32 (dB)"], disable_numparse=True))
    if cuda and fa3 is None:
        print("torch FP8 SDPA (FA3): not available (needs Hopper and the flash_attn_interface package)")


if __name__ == "__main__":
    main()
