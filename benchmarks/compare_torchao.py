"""te's FP8 operands against torchao float8's, bit for bit: Float8CurrentScaling vs torchao tensorwise.

    python benchmarks/compare_torchao.py                                   # 96x256x384, fp32
    python benchmarks/compare_torchao.py --shape 128x512x256 --dtype bfloat16

One bias-free ``nn.Linear`` (weight [N, K]), one input x [M, K] and one grad_output dy [M, N] (``--shape
MxKxN``). torchao's operands are the ``Float8TrainingTensor``s its ``Float8Linear`` really builds in one
forward and backward (``Float8LinearConfig(emulate=True)``: the operands are the same as on CUDA),
recorded where it calls ``hp_tensor_to_float8_dynamic``: input and weight in the forward, then
grad_output (twice: for dgrad and for wgrad), weight and input again in the backward. te's are
``te_compile.scaling.quantize_per_tensor(t, role, Float8CurrentScaling())`` of the same
high-precision tensor, what te's lowering traces (HYBRID: E4M3 input and weight, E5M2 grad_output).
torchao casts ``weight.t()``; a per-tensor cast is elementwise, so te's weight bytes are compared
transposed the same way. Per operand: the FP8 dtype, the data bytes, the scale (te's ``current_scale``
vs torchao's ``_scale``) and the scale_inv a GEMM multiplies by (te's vs torchao's ``1 / _scale``).

Then where the two rules part:
- the scale from the amax: te divides in fp32 (``448 / amax``, true division); torchao in fp64 after
  clamping the amax up to 1e-12, then rounds to fp32. Swept over amaxes from 1e-30 to 1e30;
- edge tensors: all zeros (te: scale 1; torchao: 448 / 1e-12) and an amax below 1e-12 (torchao's clamp
  leaves the FP8 range unused);
- the GEMM outputs y, dx, dw of te (the linear compiled with ``backend="te"``) and torchao on these
  operands, as SQNR against fp32 and te against torchao: equal operands can still give different sums
  (torchao's emulation divides by the scale, te multiplies by scale_inv; on CUDA torchao's forward GEMM
  uses ``use_fast_accum=True``, te's ``torch._scaled_mm`` calls do not).
Needs torchao (``pip install -e '.[bench]'``). Not timed.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

import _common
from te_compile.numerics import sqnr_db   # 20 log10(|ref| / |ref - x|), inf when equal
from te_compile.recipe import Float8CurrentScaling
from te_compile.scaling import current_scale, quantize_per_tensor


def _torchao_operands(linear: torch.nn.Linear, x: torch.Tensor, dy: torch.Tensor):
    """(what torchao cast: [(phase, role, hp tensor, Float8TrainingTensor)], y, dx, dw) of one forward
    and backward of ``linear`` converted to torchao's Float8Linear (tensorwise, emulated GEMMs)."""
    import torchao.float8.float8_linear as f8l

    model = torch.nn.Sequential(_common.fresh_copy(linear))
    model = _common.torchao_convert(model, "tensorwise", torch.device("cpu"))
    casts, original, phase = [], f8l.hp_tensor_to_float8_dynamic, "fwd"

    def recording(hp_tensor, float8_dtype, linear_mm_config, **kwargs):
        out = original(hp_tensor, float8_dtype, linear_mm_config, **kwargs)
        casts.append((phase, kwargs["gemm_input_role"].value, hp_tensor.detach().clone(), out))
        return out

    f8l.hp_tensor_to_float8_dynamic = recording
    try:
        xg = x.clone().requires_grad_(True)
        y = model(xg)
        phase = "bwd"
        y.backward(dy)
    finally:
        f8l.hp_tensor_to_float8_dynamic = original
    return casts, y.detach(), xg.grad, model[0].weight.grad


def _te_outputs(linear: torch.nn.Linear, x: torch.Tensor, dy: torch.Tensor):
    """(y, dx, dw) of ``linear`` compiled with backend="te" under Float8CurrentScaling."""
    import te_compile

    torch._dynamo.reset()
    model = _common.fresh_copy(linear)
    compiled = torch.compile(model, backend=te_compile.backend(recipe="Float8CurrentScaling"), dynamic=False)
    xg = x.clone().requires_grad_(True)
    y = compiled(xg)
    y.backward(dy)
    return y.detach(), xg.grad, model.weight.grad


def _operand_rows(casts, recipe: Float8CurrentScaling) -> list[tuple]:
    """One row per torchao cast: te's quantize_per_tensor of the same tensor against it."""
    rows = []
    for phase, role, hp, ao in casts:   # torchao's GemmInputRole values are te's role names
        data, scale_inv, amax = quantize_per_tensor(hp, role, recipe)
        scale = current_scale(amax, role, recipe)
        ao_scale = ao._scale.reshape(1).to(torch.float32)
        ao_scale_inv = torch.div(torch.ones_like(ao_scale), ao_scale)
        if data.dtype != ao._data.dtype:
            same_data = "no (dtypes differ)"
        else:
            differing = (data.view(torch.uint8) != ao._data.view(torch.uint8)).sum().item()
            same_data = "yes" if differing == 0 else f"no ({differing} of {data.numel()} differ)"
        rows.append((phase, role, str(data.dtype).replace("torch.float8_", ""),
                     str(ao._data.dtype).replace("torch.float8_", ""), same_data,
                     "yes" if torch.equal(scale, ao_scale) else f"no ({scale.item():.9g} vs {ao_scale.item():.9g})",
                     "yes" if torch.equal(scale_inv, ao_scale_inv) else
                     f"no ({scale_inv.item():.9g} vs {ao_scale_inv.item():.9g})"))
    return rows


def _scale_sweep(recipe: Float8CurrentScaling, n: int = 200_000) -> list[tuple]:
    """te's current_scale vs torchao's amax_to_scale over log-uniform amaxes, per FP8 dtype."""
    from torchao.float8.float8_utils import amax_to_scale

    gen = torch.Generator().manual_seed(0)
    amax = torch.pow(10.0, torch.rand(n, generator=gen, dtype=torch.float64) * 60 - 30).to(torch.float32)
    rows = []
    for role, dtype in (("input", torch.float8_e4m3fn), ("grad_output", torch.float8_e5m2)):
        te = current_scale(amax, role, recipe)   # elementwise: one scale per amax
        ao = amax_to_scale(amax, dtype)
        above = amax >= 1e-12
        rows.append((str(dtype).replace("torch.float8_", ""), n, int(above.sum()),
                     int((te[above] != ao[above]).sum()), int((~above).sum()), int((te[~above] != ao[~above]).sum())))
    return rows


def _edge_rows(recipe: Float8CurrentScaling) -> list[tuple]:
    from torchao.float8.config import e4m3_dtype
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic

    gen = torch.Generator().manual_seed(1)
    cases = {"all zeros": torch.zeros(64, 64),
             "amax 1e-13": torch.randn(64, 64, generator=gen) * 1e-13 / 4,
             "amax 1e-10": torch.randn(64, 64, generator=gen) * 1e-10 / 4}
    rows = []
    for name, t in cases.items():
        data, scale_inv, amax = quantize_per_tensor(t, "input", recipe)
        ao = hp_tensor_to_float8_dynamic(t, e4m3_dtype, LinearMMConfig())
        differing = (data.view(torch.uint8) != ao._data.view(torch.uint8)).sum().item()
        rows.append((name, f"{amax.item():.3g}", f"{1 / scale_inv.item():.4g}", f"{ao._scale.item():.4g}",
                     f"{data.float().abs().max().item():g}", f"{ao._data.float().abs().max().item():g}",
                     "yes" if differing == 0 else f"no ({differing} of {t.numel()} differ)"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="96x256x384", help="MxKxN: x [M, K], weight [N, K] (default 96x256x384)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the linear, x and dy (default float32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not _common.torchao_available():
        sys.exit(f"compare_torchao: {_common.TORCHAO_MISSING}")
    (m, k, n), = _common.parse_sizes(args.shape, "MxKxN")
    dtype = getattr(torch, args.dtype)
    recipe = Float8CurrentScaling()

    torch.manual_seed(args.seed)
    linear = torch.nn.Linear(k, n, bias=False, dtype=dtype)
    x = torch.randn(m, k, dtype=dtype)
    dy = torch.randn(m, n, dtype=dtype) * 1e-3   # gradients are small; E5M2's range covers them
    casts, ao_y, ao_dx, ao_dw = _torchao_operands(linear, x, dy)

    print(f"compare_torchao: te Float8CurrentScaling vs torchao float8 tensorwise, linear {m}x{k}x{n} "
          f"(MxKxN), {args.dtype}, seed {args.seed}, torch {torch.__version__}\n")
    print("FP8 operands of one forward + backward (torchao's casts, te's quantize_per_tensor of the same tensor):")
    print(tabulate(_operand_rows(casts, recipe), headers=["phase", "operand", "te dtype", "torchao dtype",
                                                         "data equal", "scale equal", "scale_inv equal"],
                   disable_numparse=True))

    print("\nScale from amax, te (fp32 division) vs torchao (fp64 division of the amax clamped to >= 1e-12):")
    print(tabulate(_scale_sweep(recipe), headers=["dtype", "amaxes", ">= 1e-12", "differ", "< 1e-12", "differ"],
                   disable_numparse=True))

    print("\nEdge tensors (input role, E4M3):")
    print(tabulate(_edge_rows(recipe), headers=["tensor", "amax", "te scale", "torchao scale", "te max |fp8|",
                                               "torchao max |fp8|", "data equal"], disable_numparse=True))

    te_y, te_dx, te_dw = _te_outputs(linear, x, dy)
    ref = _common.fresh_copy(linear).float()
    xr = x.float().requires_grad_(True)
    ref_y = ref(xr)
    ref_y.backward(dy.float())
    out = []
    for name, r, te, ao in (("y", ref_y.detach(), te_y, ao_y), ("dx", xr.grad, te_dx, ao_dx),
                            ("dw", ref.weight.grad, te_dw, ao_dw)):
        te, ao = te.float(), ao.float()
        same = "yes" if torch.equal(te, ao) else \
            f"no, {sqnr_db(ao, te):.1f} dB, max |diff| {(te - ao).abs().max().item():.3g}"
        out.append((name, f"{sqnr_db(r, te):.2f}", f"{sqnr_db(r, ao):.2f}", same))
    print("\nGEMM outputs (te: backend='te', compiled; torchao: Float8Linear, eager, emulate=True), "
          "SQNR vs fp32 in dB:")
    print(tabulate(out, headers=["output", "te", "torchao", "te == torchao"], disable_numparse=True))


if __name__ == "__main__":
    main()
