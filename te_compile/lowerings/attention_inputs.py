"""``fp8_mha``'s input hand-off: a projection's output quantized once, where it is made, for the
attention that reads Q, K or V from it.

    y = proj(x)                 [..., N]: an FP8 linear (or a norm fused with linears)
    q, k, v = moves of y        split / view / transpose / ...: no arithmetic
    o = sdpa(q, k, v)           an FP8 attention site under DelayedScaling

Under DelayedScaling the attention's Q, K and V scales are known before y exists, so y can be
quantized as soon as the projection has written it. ``ColumnQuantizeLowering`` casts each column of
y with the scale of the tensor (q, k or v) the column goes to and measures each of those tensors'
amax for the state's history. The pass (passes/attention_inputs.py) replays the same moves on the
FP8 bytes to get FP8 q, k, v, and the attention reads those instead of quantizing q, k, v itself.

The bits are those of the attention quantizing q, k, v itself: the same elements times the same
fp32 scale, clamped and cast, and the max of the same magnitudes. What changes is where the cast
runs: on the projection's output as its GEMM laid it out, one pass over y for all three (inductor
fuses it with the bias add), where the FP8-output GEMM (experiments/fp8_gemm.py) can take it over once a
GPU has measured that; the attention no longer reads q, k, v in high precision at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fx.cache_names import name_lowering
from ..kernels.fp8_attention import E4M3
from ..scaling import cast_to_fp8

__all__ = ["ColumnQuantizeSpec", "ColumnQuantizeLowering"]


@dataclass(frozen=True)
class ColumnQuantizeSpec:
    """Which columns of a projection's output [..., N] become which attention input."""

    fqn: str                                         # the projection's module, for names and repr
    # (role, first column, end column): role 0, 1, 2 for q, k, v; together they tile [0, N)
    segments: tuple[tuple[int, int, int], ...]
    columns: int                                     # N

    def __post_init__(self) -> None:
        spans = sorted((lo, hi) for _, lo, hi in self.segments)
        if [lo for lo, _ in spans] != [0] + [hi for _, hi in spans[:-1]] or spans[-1][1] != self.columns:
            raise ValueError(f"{self.fqn}: segments {self.segments} do not tile [0, {self.columns})")


class ColumnQuantizeLowering:
    """Callable inserted into the FX graph after a projection:
    ``(y [..., N], q_scale, k_scale, v_scale) -> (y8 [..., N] as uint8 bits, amaxes [3])``.

    ``amaxes`` holds each role's max |y| over its columns (0 for a role this output does not make),
    fp32. Nothing here is differentiated: the attention's gradient reaches the projection
    through the high-precision q, k, v.
    """

    def __init__(self, spec: ColumnQuantizeSpec) -> None:
        self.spec = spec
        name_lowering(self, "te_column_quantize", __name__)

    def __call__(self, y: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
                 v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = y.detach()
        scales = (q_scale, k_scale, v_scale)
        # [N]: each column's scale, that of the role it goes to
        column_scale = torch.cat([scales[role].reshape(1).to(torch.float32).expand(hi - lo)
                                  for role, lo, hi in sorted(self.spec.segments, key=lambda s: s[1])])
        y8 = cast_to_fp8(y, column_scale, E4M3).view(torch.uint8)
        # one read of y for every role: the max per column [N], then per role over its columns
        column_max = y.abs().reshape(-1, y.shape[-1]).amax(dim=0)
        found: dict[int, torch.Tensor] = {}
        for role, lo, hi in self.spec.segments:
            amax = column_max[lo:hi].amax().to(torch.float32)
            found[role] = amax if role not in found else torch.maximum(found[role], amax)
        zero = y.new_zeros((), dtype=torch.float32)
        return y8, torch.stack([found.get(role, zero) for role in range(3)])

    def __repr__(self) -> str:
        return f"ColumnQuantizeLowering({self.spec.fqn!r}, {self.spec.segments})"
