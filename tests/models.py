"""Small models written the way an unchanged user model is: plain nn.Linear, nn.LayerNorm, SDPA."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):  # x: [B, T, C]
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, C/H]
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """nanoGPT in miniature: per block attn.qkv, attn.proj, mlp.fc, mlp.proj, plus lm_head."""

    def __init__(self, vocab: int = 64, n_embd: int = 32, n_head: int = 2, n_layer: int = 2,
                 block_size: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, targets=None):  # idx: [B, T] int64
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


LINEARS_PER_BLOCK = 4  # attn.qkv, attn.proj, mlp.fc, mlp.proj


# The activation between an MLP's two linears, by name: f(h = up(x), g = gate(x), or None)
ACTIVATIONS = {
    "gelu": lambda h, g: F.gelu(h),
    "gelu_tanh": lambda h, g: F.gelu(h, approximate="tanh"),
    "relu": lambda h, g: torch.relu(h),
    "relu2": lambda h, g: F.relu(h) ** 2,
    "swiglu": lambda h, g: F.silu(g) * h,
}


class ActivationMLP(nn.Module):
    """up (and gate, for SwiGLU) -> ``ACTIVATIONS[kind]`` -> down: [..., d] -> [..., hidden] -> [..., d]."""

    def __init__(self, kind: str, d: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.kind = kind
        self.up, self.gate, self.down = nn.Linear(d, hidden), nn.Linear(d, hidden, bias=False), nn.Linear(hidden, d)

    def forward(self, x):
        gate = self.gate(x) if self.kind == "swiglu" else None
        return self.down(ACTIVATIONS[self.kind](self.up(x), gate))



class GroupedSwiGLU(nn.Module):
    """torchtitan-style MoE experts: SwiGLU through torch._grouped_mm on bf16 copies of the weights, w1
    and w3 stored [E, out, in] and read transposed, w2 stored [E, in, out]; [8, 32] tokens, 2 per
    expert, -> [8, 16] in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 64, 32) / 6)
        self.w3 = nn.Parameter(torch.randn(4, 64, 32) / 6)
        self.w2 = nn.Parameter(torch.randn(4, 64, 16) / 8)

    def forward(self, x):
        offs = torch.tensor([2, 4, 6, 8], dtype=torch.int32)
        xb = x.bfloat16()
        h = F.silu(torch._grouped_mm(xb, self.w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(xb, self.w3.bfloat16().transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.bfloat16(), offs=offs)


class TitanAttention(nn.Module):
    """torchtitan's attention without rotary embeddings: wq / wk / wv / wo, local heads found from the
    projections' width (``view(bs, seqlen, -1, head_dim)``), so tensor parallelism needs no change."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        bs, seqlen, _ = x.shape
        q, k, v = (w(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    """A Llama block as torchtitan writes it (RMSNorm, attention, SwiGLU feed-forward, no biases)."""

    def __init__(self, dim: int = 32, n_heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = TitanAttention(dim, n_heads)
        self.feed_forward = TitanFeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def titan_tp_plan() -> dict:
    """torchtitan's sequence-parallel plan for one TitanBlock (its parallelize_llama, per block): the
    block's input and output are sequence shards, Shard(1)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"attention_norm": SequenceParallel(), "attention": gather,
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(), "feed_forward": gather,
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
