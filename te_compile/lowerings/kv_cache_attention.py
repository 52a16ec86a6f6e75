"""What an SDPA site reading te's FP8 key/value cache calls: ``KvCacheAttentionLowering(spec)(q, k_data,
k_scale_inv, v_data, v_scale_inv, mask) -> o``.

``te_compile.fp8_static_cache`` keeps K and V as E4M3 bytes [B, Hkv, L, D] (uint8) with one fp32
scale per vector [B, Hkv, L, 1] and hands SDPA their dequantized copy. The pass
(passes/kv_cache_attention.py) finds that and calls this instead with the bytes and scales, so the
attention reads 1 byte per cached element, not the copy's 2 or 4: te_compile::kv_cache_attention,
an opaque op around kernels/kv_cache_attention.py (the Triton kernel on sm89+ GPUs, its reference
elsewhere). Inference only: the op has no backward, and the pass leaves a site whose query needs a
gradient as SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..autocast import autocast_dtype
from ..fx.cache_names import name_lowering
from ..kernels.kv_cache_attention import kv_cache_attention

__all__ = ["KvCacheAttentionSpec", "KvCacheAttentionLowering"]

_FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class KvCacheAttentionSpec:
    """Everything about the site that is not a tensor."""

    fqn: str            # the module whose forward calls SDPA
    sm_scale: float     # SDPA's ``scale=``, else 1 / sqrt(head dim)
    causal: bool = False


@torch.library.custom_op("te_compile::kv_cache_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k_data: torch.Tensor, k_scale_inv: torch.Tensor, v_data: torch.Tensor,
                  v_scale_inv: torch.Tensor, mask: Optional[torch.Tensor], sm_scale: float,
                  causal: bool) -> torch.Tensor:
    return kv_cache_attention(q, k_data.view(_FP8), v_data.view(_FP8), k_scale_inv.squeeze(-1),
                              v_scale_inv.squeeze(-1), sm_scale=sm_scale, causal=causal, mask=mask)


@_attention_op.register_fake
def _(q, k_data, k_scale_inv, v_data, v_scale_inv, mask, sm_scale, causal):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


class KvCacheAttentionLowering:
    """Callable inserted into the FX graph for an SDPA site whose K and V come from the FP8 cache.
    q [B, H, Tq, D]; k_data, v_data uint8 [B, Hkv, Tk, D]; the scales fp32 [B, Hkv, Tk, 1]; mask as
    SDPA takes it. Under autocast q is cast to autocast's dtype first, as SDPA would run it."""

    def __init__(self, spec: KvCacheAttentionSpec) -> None:
        self.spec = spec
        name_lowering(self, "te_kv_cache_attention", __name__)

    def __call__(self, q, k_data, k_scale_inv, v_data, v_scale_inv, mask=None) -> torch.Tensor:
        dtype = autocast_dtype(q)
        if dtype is None:
            return _attention_op(q, k_data, k_scale_inv, v_data, v_scale_inv, mask, self.spec.sm_scale,
                                 self.spec.causal)
        q = q.to(dtype)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(dtype)
        with torch.autocast(q.device.type, enabled=False):
            return _attention_op(q, k_data, k_scale_inv, v_data, v_scale_inv, mask, self.spec.sm_scale,
                                 self.spec.causal)

    def __repr__(self) -> str:
        return f"KvCacheAttentionLowering({self.spec.fqn!r})"
