"""What a norm computes beyond its tensors: the description a norm site is found as (passes), lowered
with (lowerings) and computed by (kernels/norm_quantize.py, whose docstring gives the arithmetic).

For x: [M, K]: ``kind`` picks the statistics (LayerNorm: mean and variance; RMSNorm: mean of squares),
``eps`` is added to the variance, ``zero_centered`` multiplies by (1 + w), and the dtypes say where the
computation rounds: ``pre_dtype`` before the weight product (Llama-style RMSNorm), ``prod_dtype`` after
it (and the bias), then each of ``casts`` in turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["NormSpec"]

_KINDS = ("layer_norm", "rms_norm")
_ROUNDED = (torch.float32, torch.bfloat16, torch.float16)   # dtypes the kernels can round to


@dataclass(frozen=True)
class NormSpec:
    """What a norm computes, beyond its tensors (see the module docstring)."""

    kind: str                                   # "layer_norm" | "rms_norm"
    eps: float
    zero_centered: bool = False                 # h * (1 + w)
    pre_dtype: Optional[torch.dtype] = None     # xhat rounded to this dtype before the weight product
    prod_dtype: torch.dtype = torch.float32     # the dtype the product (+ bias) rounds to
    casts: tuple[torch.dtype, ...] = ()         # later casts, in order (the norm's own, then its readers')

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"NormSpec.kind must be one of {_KINDS}, got {self.kind!r}")
        optional = () if self.pre_dtype is None else (self.pre_dtype,)
        for d in (*optional, self.prod_dtype, *self.casts):
            if d not in _ROUNDED:
                raise ValueError(f"NormSpec dtypes must be among {_ROUNDED}, got {d}")

    @property
    def out_dtype(self) -> torch.dtype:
        return self.casts[-1] if self.casts else self.prod_dtype

    def encode(self) -> str:
        """The spec as a string, for custom-op schemas (which take no dataclasses)."""
        names = lambda ds: ",".join(str(d).removeprefix("torch.") for d in ds)  # noqa: E731
        return "|".join([self.kind, repr(self.eps), str(int(self.zero_centered)),
                         names([self.pre_dtype] if self.pre_dtype else []), names([self.prod_dtype]),
                         names(self.casts)])

    @staticmethod
    def decode(text: str) -> "NormSpec":
        kind, eps, zc, pre, prod, casts = text.split("|")
        dtypes = lambda s: tuple(getattr(torch, n) for n in s.split(",") if n)  # noqa: E731
        return NormSpec(kind, float(eps), zc == "1", (dtypes(pre) or (None,))[0], dtypes(prod)[0],
                        dtypes(casts))
