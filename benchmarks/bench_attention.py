"""FP8 attention against SDPA on one attention call: time of forward and forward + backward, bytes
saved for the backward, and the error against fp32 SDPA, measured side by side in one run.

    python benchmarks/bench_attention.py                          # CPU: 2x8x512x64, causal, fp32
    python benchmarks/bench_attention.py --device cuda            # the goal's shape: 4x32x4096x128, bf16

Providers: ``sdpa`` (torch.compile with inductor: torch's flash / math SDPA), ``te fp8 (hp bwd)`` and
``te fp8 (fp8 bwd)`` (torch.compile(backend="te") with ``fp8_dpa``), and on CUDA with the
FlashAttention-3 package installed torch's experimental FP8 forward
(``_scaled_dot_product_attention_quantized``, forward only, fed the same E4M3 Q, K, V and descales).
The te rows include the per-(batch, head) quantization of Q, K, V in their time, as a model pays it.
On CPU the te rows run the pure-torch emulation: their times say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

import te_compile
from te_compile.kernels.fp8_attention import quantize_heads


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", help="BxHxTxD (default: 4x32x4096x128 on CUDA, 2x8x512x64 on CPU)")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--iters", type=int, help="timed iterations (default: 20 on CUDA, 3 on CPU)")
    args = parser.parse_args()
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
