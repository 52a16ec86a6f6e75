"""A small GPT written the way an unchanged user model would be: plain ``nn`` modules, no te_compile.

It is the model of the demo (``te-compile demo``), of ``benchmarks/bench_block.py`` and of the
report dry run (``te-compile report te_compile.models:gpt_small``). Every linear layer is a plain
``nn.Linear`` so that the backend, not the model, decides what runs in FP8. Module names (as
``named_modules()`` gives them): ``tok_emb``, ``pos_emb``, ``blocks.{i}.ln_1``, ``blocks.{i}.attn.qkv``,
``blocks.{i}.attn.proj``, ``blocks.{i}.ln_2``, ``blocks.{i}.mlp.fc``, ``blocks.{i}.mlp.proj``,
``ln_f``, ``lm_head``.

With ``n_experts`` the MLP of every block is a mixture of experts instead (``gpt_moe``, the demo's
``--model moe``), written as torchtitan writes one: ``blocks.{i}.moe.router`` (top-k), the experts
``blocks.{i}.moe.experts`` (3-D weights through ``torch._grouped_mm``) and a shared expert
``blocks.{i}.moe.shared`` (an ordinary MLP, as in DeepSeek-V3).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "MoE", "Experts", "gpt_small", "gpt_tiny", "gpt_moe"]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)   # fused q, k, v projection
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, C]
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, n_head, T, C // n_head]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Experts(nn.Module):
    """E SwiGLU experts, each projection one grouped GEMM over tokens sorted by expert (torchtitan's
    GroupedExperts): w1, w3 [E, hidden, dim] and w2 [E, dim, hidden], read transposed by
    ``torch._grouped_mm`` in bf16 (the only dtype it compiles in)."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # x: [M, dim] sorted by expert; counts: [E] tokens per expert
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        xb = x.bfloat16()
        h = F.silu(torch._grouped_mm(xb, self.w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(xb, self.w3.bfloat16().transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


class MoE(nn.Module):
    """Top-k routing (softmax over the experts, the k largest renormalized), each token's copies
    sorted by expert through the experts and summed back with their weights; plus a shared expert."""

    def __init__(self, n_embd: int, n_experts: int, top_k: int, hidden: int) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.top_k = top_k
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = Experts(n_experts, n_embd, hidden)
        self.shared = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        tokens = x.reshape(-1, C)                                      # [N, C]
        weights, chosen = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)   # [N, k]
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)                                      # [N * k]
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.router.out_features, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))
        routed = self.experts(tokens[order // self.top_k], counts) * weights.reshape(-1)[order, None]
        out = torch.zeros_like(tokens).index_add(0, order // self.top_k, routed)
        return (out + self.shared(tokens)).view(B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) (or the MoE layer)."""

    def __init__(self, n_embd: int, n_head: int, n_experts: int = 0, top_k: int = 2,
                 expert_hidden: Optional[int] = None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        if n_experts:
            self.moe = MoE(n_embd, n_experts, top_k, expert_hidden or n_embd)
        else:
            self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return x + ffn(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer: ``forward(idx [B, T], targets [B, T] | None) -> (logits, loss)``."""

    def __init__(self, vocab_size: int, n_layer: int, n_head: int, n_embd: int, block_size: int,
                 n_experts: int = 0, top_k: int = 2, expert_hidden: Optional[int] = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, n_experts, top_k, expert_hidden) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("experts.w2"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, Experts):
            for p in module.parameters():
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                pos: Optional[torch.Tensor] = None):
        # idx: [B, T] int64 token ids, T <= block_size; pos: [T] the rows' positions in the sequence
        # (default 0..T-1; under context parallelism a rank's rows keep their global positions)
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.block_size}")
        if pos is None:
            pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)          # [B, T, C]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))                # [B, T, vocab]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def gpt_small(vocab_size: int = 256, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
              block_size: int = 64) -> GPT:
    """The demo's model: byte-level (vocab 256), 4 layers of width 128 (~0.8M parameters)."""
    return GPT(vocab_size, n_layer, n_head, n_embd, block_size)


def gpt_tiny(vocab_size: int = 256, n_layer: int = 1, n_head: int = 2, n_embd: int = 32,
             block_size: int = 32) -> GPT:
    """A one-block GPT for fast tests (every linear is still a multiple of 16)."""
    return GPT(vocab_size, n_layer, n_head, n_embd, block_size)


def gpt_moe(vocab_size: int = 256, n_layer: int = 4, n_head: int = 4, n_embd: int = 128, block_size: int = 64,
            n_experts: int = 8, top_k: int = 2, expert_hidden: int = 128) -> GPT:
    """The demo's MoE model (``--model moe``): gpt_small with an MoE layer in every block (8 experts,
    top-2, a shared expert); the router's N = 8 keeps it in high precision, as in real MoE models."""
    return GPT(vocab_size, n_layer, n_head, n_embd, block_size, n_experts, top_k, expert_hidden)

