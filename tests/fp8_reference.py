"""An eager FP8 emulation of the te backend's linear lowering, for numerics tests.

``Fp8Reference()`` is a TorchFunctionMode: inside it every ``F.linear`` of an unchanged eager model
runs as per-tensor current-scaling FP8 (HYBRID: E4M3 input/weight, E5M2 grad_output), with the
GEMMs done in fp32 on dequantized operands. It shares the quantizers with the library (those are
checked bit for bit against plain-torch references elsewhere) but none of the compile path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from te_compile.tensor import Float8CurrentScalingQuantizer


def _fake_quant(t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    return Float8CurrentScalingQuantizer(fp8_dtype, columnwise=False)(t.detach()).dequantize(
        dtype=torch.float32)


class _RefLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):  # x: [..., K], w: [N, K]
        xq = _fake_quant(x.reshape(-1, x.shape[-1]), torch.float8_e4m3fn)
        wq = _fake_quant(w, torch.float8_e4m3fn)
        ctx.save_for_backward(xq, wq)
        ctx.x_shape = x.shape
        return (xq @ wq.t()).reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        xq, wq = ctx.saved_tensors
        gq = _fake_quant(g.reshape(-1, g.shape[-1]), torch.float8_e5m2)
        return (gq @ wq).reshape(ctx.x_shape), gq.t() @ xq


class Fp8Reference(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.linear, torch._C._nn.linear):
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            y = _RefLinear.apply(x, w)
            return y if b is None else y + b
        return func(*args, **kwargs)
