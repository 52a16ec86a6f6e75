"""An FP8 key/value cache for Hugging Face ``generate()``: the static cache with K and V held in E4M3.

``te_compile.fp8_static_cache(model.config, max_cache_len)`` is transformers' ``StaticCache`` whose
full-attention layers keep their keys and values as E4M3 bytes [B, H, L, D] with one fp32 scale per
(batch row, head, token) [B, H, L, 1]: current scaling at write time, each written vector scaled by
its own amax, so a token written later never changes the scale of one written earlier. That is
(D + 4) bytes per cached vector against 2D in bf16: 0.53x at head dim 64, 0.52x at 128. Pass it to
``generate(past_key_values=cache)``; the buffers are allocated at the first write and marked static,
as transformers' own static layers are, so a compiled forward (CUDA graphs included) reads and
writes them in place.

The layer hands the model its keys and values as ``te_compile::dequantize_kv`` of the bytes and
scales, in the model's dtype. Run eagerly (or compiled by another backend) that copy is what SDPA
reads: the cache then saves memory, not the bandwidth of reading it. Compiled with te, the attention
pass finds the op behind SDPA's K and V and calls te's attention over the bytes instead
(lowerings/kv_cache_attention.py), so the copy is never made. Sliding-window and other non-static
layers are kept as transformers makes them.

transformers is imported when a cache is made, not with te_compile.
"""

from __future__ import annotations

import functools

import torch

from .scaling import cast_to_fp8, compute_scale

__all__ = ["fp8_static_cache", "kv_cache_bytes", "dequantize_kv"]

_FP8 = torch.float8_e4m3fn


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 bytes as uint8 [..., D], scale_inv fp32 [..., 1]) of ``x``, each vector along the last dim
    scaled from its own amax by current scaling's rule (an all-zero vector gets scale 1)."""
    scale = compute_scale(x.abs().amax(dim=-1, keepdim=True).to(torch.float32), _FP8)
    return cast_to_fp8(x, scale, _FP8).view(torch.uint8), torch.div(torch.ones_like(scale), scale)


@torch.library.custom_op("te_compile::dequantize_kv", mutates_args=())
def dequantize_kv(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's keys or values in ``dtype``: E4M3 bytes [B, H, L, D] (uint8) times scale_inv
    [B, H, L, 1]. One op rather than its three, so that te's attention pass finds what the cache hands
    to SDPA and reads the bytes instead (passes/kv_cache_attention.py)."""
    return _dequantize(data, scale_inv, dtype)


def _dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.view(_FP8).to(torch.float32) * scale_inv).to(dtype)


@dequantize_kv.register_fake
def _(data, scale_inv, dtype):
    return data.new_empty(data.shape, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _layer_class():
    from transformers.cache_utils import StaticLayer
    from transformers.utils import is_torchdynamo_compiling

    class Fp8StaticLayer(StaticLayer):
        """transformers' StaticLayer with E4M3 keys and values and per-vector scales."""

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device, self.dtype = key_states.device, key_states.dtype
            self.batch_size, self.num_heads = key_states.shape[:2]
            self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
            lead = (self.batch_size, self.num_heads, self.max_cache_len)
            # ``keys`` / ``values`` are the bytes: what transformers reads of them (shapes, reset) holds
            self.keys = torch.zeros((*lead, self.k_head_dim), dtype=torch.uint8, device=self.device)
            self.values = torch.zeros((*lead, self.v_head_dim), dtype=torch.uint8, device=self.device)
            self.key_scale_inv = torch.zeros((*lead, 1), dtype=torch.float32, device=self.device)
            self.value_scale_inv = torch.zeros((*lead, 1), dtype=torch.float32, device=self.device)
            self.cumulative_length = self.cumulative_length.to(self.device)
            if not is_torchdynamo_compiling():
                for t in (self.keys, self.values, self.key_scale_inv, self.value_scale_inv, self.cumulative_length):
                    torch._dynamo.mark_static_address(t)
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            kv_length = key_states.shape[-2]
            position = torch.arange(kv_length, device=self.device) + self.cumulative_length
            self.cumulative_length.add_(kv_length)
            for states, data, scale_inv in ((key_states, self.keys, self.key_scale_inv),
                                            (value_states, self.values, self.value_scale_inv)):
                q, s = _quantize(states)
                data.index_copy_(2, position, q)
                scale_inv.index_copy_(2, position, s)
            # unwritten slots hold 0 with scale_inv 0: zeros, as the high-precision cache's are
            return (dequantize_kv(self.keys, self.key_scale_inv, key_states.dtype),
                    dequantize_kv(self.values, self.value_scale_inv, value_states.dtype))

        def reset(self) -> None:
            if self.is_initialized:
                for t in (self.keys, self.values, self.key_scale_inv, self.value_scale_inv):
                    t.zero_()
                self.cumulative_length.zero_()

    return Fp8StaticLayer


def fp8_static_cache(config, max_cache_len: int):
    """transformers' ``StaticCache(config, max_cache_len)`` with every full-attention layer holding its
    keys and values in E4M3 (module docstring)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    fp8_layer = _layer_class()
    cache.layers = [fp8_layer(max_cache_len=max_cache_len) if type(layer) is StaticLayer else layer
                    for layer in cache.layers]
    return cache


def kv_cache_bytes(cache) -> int:
    """Bytes of the key/value buffers (scales included) a transformers cache holds."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "key_scale_inv", "value_scale_inv"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
